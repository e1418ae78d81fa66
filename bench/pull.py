"""What a GPU node pays to get an image: pulls from the local registry into a cold engine,
side by side in one run (issue 34).

    python bench/pull.py --ref REG/REPO:TAG [--sibling REF] [--release REF] [--pairs 3] [--mbit N]
                         [--user U --password P] [--stargz BIN [--stargz-args "..."]]

REF is a cell as `imagefactory build --push` made it (layers by rate of change, gzip). The bench
makes two variants of it on the default engine (BuildKit, pushed beside it):
- `single`: the same files with everything above the base in one layer (`FROM base` +
  `COPY --from=REF / /`), the shape of an image before issue 34 (one environment layer);
- `zstd`: REF's layers recompressed with zstd (`compression=zstd,force-compression=true`, OCI
  media types);
- `estargz`: REF's layers recompressed as eStargz (`compression: estargz`'s push), with --stargz.
Then, in a private engine of its own (its own containerd and data root: nothing shared with the
machine's engines, emptied between runs), it times, as interleaved pairs:
- cold pull and unpack of REF vs `single`, and then the first `import torch` in each;
- zstd vs gzip (cold pull of `zstd` vs REF);
- with REF held: pull of SIBLING and of RELEASE (the next release), vs REF's cold pull;
- with --stargz BIN (stargz-snapshotter's `containerd-stargz-grpc`, or a build that takes its
  `--root` and `--address`; --stargz-args passes it more, such as the registry's plain-HTTP mirror
  config): a cold `docker run` of `estargz` to the end of its first `import torch` on a second
  private engine whose containerd store uses the stargz snapshotter (lazy pulling; the engine,
  the snapshotter and their roots made anew for every run), vs the same on REF in the first
  private engine (pull in full, then run);
and prints the bytes each would move (from the registry's manifests). With --mbit N, the private
engines pull through a link of N Mbit/s (bench/link.py: a proxy in front of the registry, shared by
every connection): a node's network, where the loopback costs nothing. One Markdown table;
nothing is asserted. Disk: REF's variants and the private engine's copies of each; for the CUDA
pip cell (3.2 GB compressed) the free space fell from 66 to 18 GB, the cell's own build included.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from factory import Row, pairs, say, timed  # noqa: E402
from link import Link, link  # noqa: E402

MADE: list[str] = []  # what the bench put on the default engine: removed at its end
CURRENT_BIN = Path("/opt/imagefactory/engine-current/bin")
ACCEPT = ", ".join(["application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json",
                    "application/vnd.docker.distribution.manifest.v2+json",
                    "application/vnd.docker.distribution.manifest.list.v2+json"])


class Registry:
    def __init__(self, user: str | None, password: str | None):
        self.auth = (user, password) if user and password else None

    def manifest(self, ref: str) -> list[tuple[str, int]]:
        """(digest, compressed size) of each layer of `ref`'s amd64 image."""
        name, _, tag = ref.rpartition("@") if "@" in ref else ref.rpartition(":")
        host, _, repo = name.partition("/")
        req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{tag}", headers={"Accept": ACCEPT})
        if self.auth:
            token = base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        with urllib.request.urlopen(req, timeout=30) as r:
            doc = json.loads(r.read(4 << 20))
        if "manifests" in doc:
            digest = next(m["digest"] for m in doc["manifests"] if m.get("platform", {}).get("architecture") == "amd64")
            return self.manifest(f"{name}@{digest}")
        return [(layer["digest"], layer["size"]) for layer in doc["layers"]]


def login_config(folder: Path, registry: str, user: str | None, password: str | None) -> dict[str, str]:
    """A Docker config of the bench's own in `folder` (the registry's login, if any): the machine's
    ~/.docker is neither read nor written. The environment that points the CLI at it."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    auths = {registry: {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}} if user and password else {}
    (folder / "config.json").write_text(json.dumps({"auths": auths}))
    (folder / "config.json").chmod(0o600)
    return {"DOCKER_CONFIG": str(folder)}


def through(ref: str, node_link: Link | None) -> str:
    """`ref` as the private engines pull it: through the link when there is one."""
    return f"{node_link.host}/{ref.partition('/')[2]}" if node_link else ref


def fetched(image: list[tuple[str, int]], held: list[tuple[str, int]]) -> int:
    have = {d for d, _ in held}
    return sum(size for d, size in image if d not in have)


class PrivateEngine:
    """A containerd and a dockerd of the bench's own (own roots, sockets): every pull is cold."""

    def __init__(self, root: Path, env: dict[str, str], stargz: list[str] | None = None):
        self.root, self.run = root, Path(tempfile.mkdtemp(prefix="ifpull-", dir="/run"))
        self.host = f"unix://{self.run}/docker.sock"
        self.procs: list[subprocess.Popen] = []
        self.env = env  # DOCKER_CONFIG: the bench's own (login_config)
        self.stargz = stargz  # the snapshotter's command line (--stargz, --stargz-args): lazy pulls

    def start(self) -> None:
        sock = self.run / "containerd.sock"
        conf = self.run / "containerd.toml"
        env = dict(os.environ, PATH=f"{CURRENT_BIN}:{os.environ['PATH']}")
        lazy = ""
        if self.stargz:
            snap = self.run / "stargz.sock"
            self._spawn([*self.stargz[:1], "--root", str(self.root / "stargz"), "--address", str(snap),
                         *self.stargz[1:]], env)
            self._wait_for(snap, "the stargz snapshotter")
            lazy = f'[proxy_plugins]\n  [proxy_plugins.stargz]\n    type = "snapshot"\n    address = "{snap}"\n'
        conf.write_text(f'version = 2\nroot = "{self.root}/containerd"\nstate = "{self.run}/state"\n'
                        f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n[grpc]\n  address = "{sock}"\n'
                        f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{self.root}/opt"\n' + lazy)
        self._spawn([str(CURRENT_BIN / "containerd"), "--config", str(conf)], env)
        self._wait_for(sock, "the bench's containerd")
        daemon = {"features": {"containerd-snapshotter": True}, **({"storage-driver": "stargz"} if self.stargz else {})}
        (self.run / "daemon.json").write_text(json.dumps(daemon) + "\n")
        self._spawn([str(CURRENT_BIN / "dockerd"), "--config-file", str(self.run / "daemon.json"), "--containerd",
                     str(sock), "-H", self.host, "--data-root", str(self.root / "docker"), "--exec-root",
                     str(self.run / "exec"), "--pidfile", str(self.run / "dockerd.pid"), "--bridge=none",
                     "--iptables=false", "--ip-forward=false", "--ip-masq=false"], env)
        for _ in range(120):
            if self.docker("version", check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise SystemExit(f"the bench's engine did not start: {(self.run / 'dockerd.log').read_text()[-2000:]}")

    def _wait_for(self, sock: Path, what: str) -> None:
        for _ in range(60):
            if sock.exists():
                return
            time.sleep(0.5)
        raise SystemExit(f"{what} did not start (see {self.run})")

    def _spawn(self, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.run / f"{Path(argv[0]).name}.log", "wb")
        self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True))

    def docker(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", "-H", self.host, *args], capture_output=True, text=True, check=check,
                              env={**os.environ, **self.env})

    def empty(self) -> None:
        """No image, no layer, no cache: the next pull is cold (containerd's GC frees the blobs)."""
        self.docker("system", "prune", "-af", check=False)
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n") if os.access("/proc/sys/vm/drop_caches", os.W_OK) else None

    def pull(self, ref: str) -> float:
        return timed(["docker", "-H", self.host, "pull", "-q", ref], env=self.env)

    def first_import(self, ref: str) -> float:
        """`docker run` to the end of a first `import torch` (it pulls `ref` when the engine lacks it)."""
        return timed(["docker", "-H", self.host, "run", "--rm", "--network", "none", ref, "python", "-c",
                      "import torch"], env=self.env)

    def lazily_mounted(self) -> int:
        """The snapshotter's FUSE mounts under this engine's root now (one per lazily pulled layer)."""
        with open("/proc/self/mounts") as mounts:
            return sum(1 for line in mounts if f" {self.root}/" in line and " fuse" in line)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        subprocess.run(["umount", str(self.run / "exec" / "netns" / "default")], capture_output=True)
        with open("/proc/self/mounts") as mounts:  # the snapshotter's FUSE mounts, deepest first
            left = sorted((line.split()[1] for line in mounts if f" {self.root}/" in line), reverse=True)
        for mount in left:
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(self.run, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def fresh(self) -> PrivateEngine:
        """This engine stopped and its roots gone; a new one like it, started (nothing cached at all)."""
        self.stop()
        engine = PrivateEngine(Path(tempfile.mkdtemp(prefix="bench-pull-engine-", dir="/var/lib")), self.env,
                               self.stargz)
        engine.start()
        return engine


def recompressed(ref: str, how: str, work: Path, env: dict[str, str]) -> str:
    """REF's layers recompressed (`how`: zstd or estargz, OCI media types), pushed beside it; its ref."""
    out = f"{ref.rpartition(':')[0]}:bench-{how}"
    (work / how).mkdir()
    (work / how / "Dockerfile").write_text(f"FROM {ref}\n")
    say(f"pushing the {how} variant")
    timed(["docker", "buildx", "build", "--network", "host", "--provenance=false", "--output",
           f"type=image,name={out},push=true,compression={how},oci-mediatypes=true,force-compression=true",
           str(work / how)], env=env)
    MADE.append(out)
    return out


def variants(ref: str, work: Path, env: dict[str, str]) -> tuple[str, str]:
    """Push `single` and `zstd` beside REF (default engine, BuildKit); their refs."""
    had = subprocess.run(["docker", "image", "inspect", ref], capture_output=True).returncode == 0
    timed(["docker", "pull", "-q", ref], env=env)
    MADE.extend([] if had else [ref])
    labels = json.loads(subprocess.run(["docker", "image", "inspect", ref, "--format", "{{json .Config.Labels}}"],
                                       capture_output=True, text=True, check=True).stdout)
    base = labels["org.opencontainers.image.base.name"]
    repo = ref.rpartition(":")[0]
    single = f"{repo}:bench-single"
    (work / "single").mkdir()
    (work / "single" / "Dockerfile").write_text(f"FROM {ref} AS cell\nFROM {base}\nCOPY --from=cell / /\n"
                                                f"USER 1000\nENTRYPOINT [\"/usr/local/bin/imagefactory-entrypoint\"]\n")
    say("pushing the single-layer variant")
    timed(["docker", "buildx", "build", "--network", "host", "--output", f"type=image,name={single},push=true",
           str(work / "single")], env=env)
    MADE.append(single)
    return single, recompressed(ref, "zstd", work, env)


def cold(engine: PrivateEngine, ref: str, then_import: bool = False) -> float:
    engine.empty()
    took = engine.pull(ref)
    return took + (engine.first_import(ref) if then_import else 0.0)


class Lazy:
    """The stargz engine, made anew before each run: its `docker run` of `ref` pulls lazily. It is
    stopped as soon as it is timed: the snapshotter goes on fetching in the background, which
    would slow the other side of the pair."""

    def __init__(self, engine: PrivateEngine, ref: str):
        self.engine, self.ref = engine, ref
        self.mounts: list[int] = []

    def run(self) -> float:
        self.engine = self.engine.fresh()
        took = self.engine.first_import(self.ref)
        self.mounts.append(self.engine.lazily_mounted())
        self.engine.stop()
        return took


def held(engine: PrivateEngine, first: str, ref: str) -> float:
    engine.empty()
    engine.pull(first)
    return engine.pull(ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True)
    ap.add_argument("--sibling")
    ap.add_argument("--release")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--user", default=os.environ.get("IMAGEFACTORY_REGISTRY_USER"))
    ap.add_argument("--password", default=os.environ.get("IMAGEFACTORY_REGISTRY_PASSWORD"))
    ap.add_argument("--stargz", metavar="BIN", help="the stargz snapshotter's daemon (containerd-stargz-grpc)")
    ap.add_argument("--stargz-args", default="",
                    help="more arguments for it (its registry config); {registry} is the host the engines pull from")
    ap.add_argument("--mbit", type=float, help="the node's link: pulls through a proxy of N Mbit/s (bench/link.py)")
    args = ap.parse_args()
    reg = Registry(args.user, args.password)
    work = Path(tempfile.mkdtemp(prefix="bench-pull-"))
    registry = args.ref.split("/")[0]
    node_link = link(registry, args.mbit) if args.mbit else None
    pulled = node_link.host if node_link else registry
    env = login_config(work / "docker-config", registry, args.user, args.password)
    node_env = login_config(work / "node-config", pulled, args.user, args.password)
    engine = PrivateEngine(Path(tempfile.mkdtemp(prefix="bench-pull-engine-", dir="/var/lib")), node_env)
    lazy: Lazy | None = None
    try:
        single, zstd = variants(args.ref, work, env)
        estargz = recompressed(args.ref, "estargz", work, env) if args.stargz else None
        engine.start()
        ref, n_single, n_zstd = (through(r, node_link) for r in (args.ref, single, zstd))
        rows = [Row("cold pull + unpack", "layered (gzip)", "single layer (gzip)",
                    *pairs(args.pairs, lambda: cold(engine, ref), lambda: cold(engine, n_single)), "≤ 0.6x"),
                Row("cold pull, then first `import torch`", "layered", "single layer",
                    *pairs(args.pairs, lambda: cold(engine, ref, True), lambda: cold(engine, n_single, True)),
                    "≤ 0.6x"),
                Row("cold pull + unpack", "zstd (layered)", "gzip (layered)",
                    *pairs(args.pairs, lambda: cold(engine, n_zstd), lambda: cold(engine, ref)), "< 1x"),
                Row("cold pull + unpack", "zstd (layered)", "single layer (gzip)",
                    *pairs(args.pairs, lambda: cold(engine, n_zstd), lambda: cold(engine, n_single)), "< 0.6x")]
        mine = reg.manifest(args.ref)
        total = sum(s for _, s in mine)
        for name, other in (("sibling", args.sibling), ("next release", args.release)):
            if other:
                moved = fetched(reg.manifest(other), mine)
                rows.append(Row(f"pull of the {name}, the first held", name, "cold pull of the first",
                                *pairs(args.pairs, lambda o=through(other, node_link): held(engine, ref, o),
                                       lambda: cold(engine, ref)),
                                "≤ 0.2x" if name == "sibling" else "≤ 0.05x",
                                note=f"{moved / 1e6:,.1f} MB of {total / 1e6:,.1f} MB moved "
                                     f"({moved / total:.1%})"))
        if args.stargz and estargz:
            snapshotter = [args.stargz, *shlex.split(args.stargz_args.replace("{registry}", pulled))]
            lazy = Lazy(PrivateEngine(Path(tempfile.mkdtemp(prefix="bench-pull-engine-", dir="/var/lib")), node_env,
                                      snapshotter), through(estargz, node_link))
            rows.append(Row("cold `docker run` to the end of the first `import torch`", "eStargz, lazy",
                            "layered gzip, pulled whole",
                            *pairs(args.pairs, lazy.run, lambda: cold(engine, ref, True)), "< 1x",
                            note=f"FUSE mounts per lazy run: {lazy.mounts} (one per layer: lazy)"))
        sizes = {name: sum(s for _, s in reg.manifest(r)) for name, r in (("layered", args.ref), ("single", single),
                                                                          ("zstd", zstd), ("estargz", estargz))
                 if r}
        print(f"link: {f'{args.mbit:g} Mbit/s (bench/link.py)' if node_link else 'the loopback, unpaced'}\n")
        print("| figure | A | B | A/B | goal | runs |\n|---|---|---|---|---|---|")
        for row in rows:
            print(row.line())
        print("\ncompressed sizes: " + ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in sizes.items()))
    finally:
        engine.stop()
        if lazy is not None:
            lazy.engine.stop()
        if node_link:
            node_link.stop()
        if MADE:
            subprocess.run(["docker", "image", "rm", "-f", *MADE], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
