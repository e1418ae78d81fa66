"""How fast is the factory: every figure of issue 9 as a ratio, measured side by side.

Builds on this machine's real engine, with base images from the local base registry
(127.0.0.1:5000) and torch's CPU wheel from a wheelhouse, like the integration tests.
Each figure is the median of interleaved pairs (A, B, A, B, ...), so a drifting, shared
machine hits both sides alike. Prints one Markdown table.

    python bench/factory.py [--pairs 3] [--cold-pairs 1] [--wheelhouse DIR] [--keep]

Figures:
- no-op rebuild, 1 cell: `imagefactory build` on an unchanged matrix vs a loop of plain,
  fully cached `docker build` (classic builder, like the SDK's) over the same contexts.
- no-op rebuild, 3 cells: three Python 3.11 CPU pip cells that differ in `threads:` (a
  `matrix.variant` axis: the only cells that build and pass here are Python 3.11, CPU, pip,
  OpenBLAS), built once; then `imagefactory build` of all three, unchanged, vs a loop of
  three fully cached `docker build`s (classic builder) over their contexts.
- `imagefactory test` (verdicts cached, and --retest: the probe; for the cell as built and
  for the same cell with `compiler: false`, whose probe runs no torch.compile child) vs
  `docker run --rm --network none IMAGE python -c 'import torch, numpy'`.
- the probe in every launch mode (docker, bare, hpc: three containers side by side, as
  `imagefactory build`/`test` run it) vs the probe in the `docker` mode alone, on the built
  cell: with its torch.compile child, and as a `compiler: false` cell would be probed (the
  same image, the probe told to leave torch.compile out). Timed in-process through
  smoke.test_image, the engine call the CLI makes.
- -j 2 vs -j 1, cold, on a two-cell matrix (the openblas cell and an mkl cell whose NumPy
  comes from PyPI: its build is real work, its BLAS check fails, which does not matter
  for build time). "Cold": each run builds on a new base (the bench's own base, one new
  label per run, pushed to the base registry), so no layer after FROM is cached.
- image size vs the naive blog recipe for the same cell: one package per RUN, apt lists and
  pip's cache kept, one stage. A cell with a compiler (the default) ships g++ and the Python
  headers, so its recipe installs them the blog way, `build-essential` and `python3-dev`
  (bench/fixtures/naive-pip-compiler.Dockerfile); a `compiler: false` cell is compared with
  bench/fixtures/naive-pip.Dockerfile.
- the probe goal (issue 16): `imagefactory test --retest` of the cell as built vs ONE
  `docker run` of the same image doing `import torch, numpy` and then one bare
  `torch.compile` of the very function the probe compiles, with the probe's Inductor
  settings (the program is the probe's own compile section, resources/probe.py): the sum
  of the two, side by side. (The `compiler: false` cell's goal is the row above it: the
  probe vs one import.)
- fresh runner, content tag in the registry (issue 16): `build --push` of the cell on an
  engine that does not have its image (the bench's own image removed, a verdict cache of
  its own), the registry serving its content-hash tag: pulled, not built; vs a cold
  `build` of the same cell on a new base. The base layers are shared with other local
  images, so the pull fetches the cell's own layers only (a real fresh runner also pulls
  the base's, about 50 MB here).
- BuildKit vs classic (issue 16), the same cell with `--builder buildkit` and
  `--builder classic`: cold (each run on a new base; BuildKit's pip cache mount is as
  warm as earlier builds left it, which is part of what BuildKit buys) and no-op.
- cache mounts: the cold BuildKit build (new base) of the cell whose packages an earlier
  build already fetched into the builder's cache mount, rendered with the mounts vs
  rendered without them (the classic rendering, `pip --no-cache-dir`), both built by
  `docker buildx build`.
- fresh runner, changed cell, registry cache (issue 16): the cell pushed by a BuildKit build
  (inline cache) to the no-auth registry 127.0.0.1:5000 (buildx reads only `docker login`
  credentials), then changed (`threads:`) and built with `--builder buildkit
  --registry-cache` on an engine without the pushed image and without the build cache
  records this bench made (pruned by id; other builds' records stay); vs a cold BuildKit
  build on a new base.
- image size vs the payload: what the image must carry, measured on what it does carry.
  payload = the environment (`du -sb /opt/venv` in the image) + the minimal OS (the base
  image's size) + the toolchain: the files (regular files and links, each inode once, from
  `dpkg-query -L`) of every package installed in the image but not in the base (package
  lists from `dpkg-query -W` in both images), as they are in the image. So apt's caches,
  files a later layer hides or replaces, and anything else outside those three count as
  overhead; docs that dpkg was told not to install count on neither side. The note also
  gives the sum of those packages' dpkg `Installed-Size` (with docs, man pages and
  translations), and the sizes of the toolchain and venv layers from `docker history`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from imagefactory.engine.docker import Engine  # noqa: E402
from imagefactory.engine.api import Builder, BuildRequest  # noqa: E402
from imagefactory.errors import EngineError  # noqa: E402

BASE_REGISTRY = "127.0.0.1:5000"
TORCH = "2.13.0"
GOOD, MKL = "py3.11-cpu-openblas-pip", "py3.11-cpu-mkl-pip"


# Run in the image with the packages' names as arguments: the bytes of their files as they are
# in the image (regular files and links, each inode once; directories are shared with other
# packages), then the sum of their dpkg Installed-Size.
PACKAGE_BYTES = """
import os, stat, subprocess, sys
names = subprocess.run(["dpkg-query", "-L", *sys.argv[1:]], capture_output=True, text=True).stdout
seen, total = set(), 0
for path in names.splitlines():
    try:
        st = os.lstat(path)
    except OSError:  # not installed (dpkg path-exclude), removed later, or a "diverted by" line
        continue
    if not stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
        seen.add((st.st_dev, st.st_ino))
        total += st.st_size
sizes = subprocess.run(["dpkg-query", "-W", "-f", "${Installed-Size}\\n", *sys.argv[1:]],
                       capture_output=True, text=True, check=True).stdout.split()
print(total, 1024 * sum(int(k) for k in sizes if k.isdigit()))
"""


@dataclass
class Row:
    figure: str
    a: str
    b: str
    a_s: list[float]
    b_s: list[float]
    target: str
    unit: str = "s"
    note: str = ""

    @property
    def ratio(self) -> float:
        return statistics.median(x / y for x, y in zip(self.a_s, self.b_s))

    def line(self) -> str:
        def fmt(values: list[float]) -> str:
            m = statistics.median(values)
            return f"{m / 1e6:,.0f} MB" if self.unit == "MB" else f"{m:.2f} s"
        n = f"{len(self.a_s)} pair{'s' if len(self.a_s) > 1 else ''}"
        return (f"| {self.figure} | {self.a}: {fmt(self.a_s)} | {self.b}: {fmt(self.b_s)} | "
                f"**{self.ratio:.2f}x** | {self.target} | {n}{'; ' + self.note if self.note else ''} |")


def timed(cmd: list[str], env: dict | None = None, check: bool = True) -> float:
    started = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    took = time.perf_counter() - started
    if check and r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return took


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def pairs(n: int, a: Callable[[], float], b: Callable[[], float]) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i in range(n):
        xs.append(a())
        ys.append(b())
        say(f"  pair {i + 1}/{n}: {xs[-1]:.2f} s vs {ys[-1]:.2f} s")
    return xs, ys


class Bench:
    def __init__(self, root: Path, wheelhouse: Path, engine: Engine):
        self.root, self.wheelhouse, self.engine = root, wheelhouse, engine
        self.id = uuid.uuid4().hex[:8]
        self.started = time.time() - 1  # build cache records made since then are this bench's (docker lock held)
        self.base_repo = f"bench-{self.id}/python"
        self.base_ref = f"{BASE_REGISTRY}/{self.base_repo}:3.11-slim-bookworm"
        self.matrix = root / "matrix.yaml"
        # bytecode written once into the bench's folder, as an installed imagefactory has it (bench/cli.py)
        self.env = {"IMAGEFACTORY_CACHE_DIR": str(root / "cache"), "PYTHONDONTWRITEBYTECODE": "",
                    "PYTHONPYCACHEPREFIX": str(root / "pycache")}
        self.images: list[str] = []
        self.runs = 0
        certs = json.dumps(sorted(glob.glob("/usr/local/share/ca-certificates/*.crt")))
        self.matrix.write_text(f"""
image: 127.0.0.1:5001/bench-{self.id}/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas, mkl]
  installer: [pip]
torch: "{TORCH}"
threads: 2
base_registry: {BASE_REGISTRY}
base_images:
  pip: "bench-{self.id}/python:{{python}}-slim-bookworm"
ca_certificates: {certs}
pip:
  torch_index_url: null
  numpy_index_url: https://pypi.org/simple
  wheelhouse: {wheelhouse}
""")

    def new_base(self) -> None:
        """A base no layer cache has seen: library/python plus one new label and one new layer, pushed."""
        self.runs += 1
        ctx = self.root / f"base-{self.runs}"
        ctx.mkdir()
        (ctx / "Dockerfile").write_text(f"FROM {BASE_REGISTRY}/library/python:3.11-slim-bookworm\n"
                                        f"LABEL io.imagefactory.tools.bench.run={self.id}-{self.runs}\n"
                                        # a layer of its own: BuildKit keys an image source by its layers
                                        # alone, so a label-only base would not make its builds cold
                                        f"RUN echo {self.id}-{self.runs} > /etc/imagefactory-bench-run\n")
        self.engine.build(BuildRequest(str(ctx), self.base_ref))
        self.engine.push(self.base_ref)
        self.images.append(self.engine.image_id(self.base_ref) or self.base_ref)

    def cli(self, *args: str, work: str = "work", only: str | None = GOOD, check: bool = True,
            matrix: Path | None = None, python: tuple[str, ...] = ()) -> float:
        """`imagefactory ARGS` on the bench's cell; `python`: interpreter options (-m cProfile -o F)."""
        cmd = [sys.executable, *python, "-m", "imagefactory", *args, "--matrix", str(matrix or self.matrix), "--plain",
               "--work-dir", str(self.root / work), "--report", str(self.root / work / "report.json")]
        return timed(cmd + (["--only", only] if only else []), self.env, check)

    def report(self, work: str = "work") -> dict:
        cells = json.loads((self.root / work / "report.json").read_text())["cells"]
        for c in cells:
            if c.get("image_id"):
                self.images.append(c["image_id"])
        return {c["cell"]: c for c in cells}

    # -- figures --------------------------------------------------------------------------
    def cold_parallel(self, n: int) -> Row:
        def cold(jobs: int) -> float:
            self.new_base()
            took = self.cli("build", "-j", str(jobs), work=f"cold-{self.runs}", only=None, check=False)
            states = {c: r["status"] for c, r in self.report(f"cold-{self.runs}").items()}
            if states.get(GOOD) != "passed" or any(s == "build-failed" for s in states.values()):
                raise SystemExit(f"cold build -j {jobs} did not build both cells: {states}")
            return took
        say("cold builds, -j 2 then -j 1 (minutes each)")
        a, b = pairs(n, lambda: cold(2), lambda: cold(1))
        return Row("cold build, 2 cells", "`build -j 2`", "`build -j 1`", a, b, "< 1 (pays off)",
                   note="each run on a new base, nothing cached after FROM")

    def noop(self, n: int) -> tuple[Row, Row]:
        say("no-op rebuilds")
        self.cli("build")  # make sure the cell is built and its verdicts recorded
        context = str(self.root / "work" / "contexts" / GOOD)
        docker = ["docker", "build", "-q", context]
        env = {"DOCKER_BUILDKIT": "0"}
        a, b = pairs(n, lambda: self.cli("build"), lambda: timed(docker, env))
        assert self.report()[GOOD]["cached"] is True
        one = Row("no-op rebuild, 1 cell", "`imagefactory build`", "`docker build` (cached)", a, b, "≤ 1.0x")
        return one, self.noop_three(n)

    def noop_three(self, n: int) -> Row:
        """Three Python 3.11 CPU cells that differ in `threads:` (matrix.variant), built once, then
        a no-op `imagefactory build` of all three vs a loop of three fully cached `docker build`s."""
        matrix3 = self.root / "matrix3.yaml"
        text = self.matrix.read_text().replace("  blas: [openblas, mkl]\n", "  blas: [openblas]\n")
        matrix3.write_text(text.replace("  installer: [pip]\n", "  installer: [pip]\n  variant: [t2, t3, t4]\n"
                                        "  include:\n    - {variant: t3, threads: 3}\n"
                                        "    - {variant: t4, threads: 4}\n"))
        say("three cells (variants t2, t3, t4): built once (minutes), then no-op rebuilds")
        self.cli("build", "-j", "1", work="work3", only=None, matrix=matrix3)
        built = self.report("work3")
        if sorted(built) != [f"{GOOD}-t{k}" for k in (2, 3, 4)] or any(
                r["status"] != "passed" for r in built.values()):
            raise SystemExit(f"the three cells did not all pass: { {c: r['status'] for c, r in built.items()} }")
        contexts = [str(self.root / "work3" / "contexts" / cell) for cell in sorted(built)]

        def docker_loop() -> float:
            return sum(timed(["docker", "build", "-q", ctx], {"DOCKER_BUILDKIT": "0"}) for ctx in contexts)

        a, b = pairs(n, lambda: self.cli("build", work="work3", only=None, matrix=matrix3), docker_loop)
        if not all(r["cached"] for r in self.report("work3").values()):
            raise SystemExit("a no-op rebuild of the three cells built something")
        return Row("no-op rebuild, 3 cells", "`imagefactory build` (3 cells)", "3 x `docker build` (cached)",
                   a, b, "≤ 0.35x", note="three cells that differ in `threads:` (matrix.variant)")

    def test(self, n: int) -> list[Row]:
        image = self.report()[GOOD]["candidate"]
        run = ["docker", "run", "--rm", "--network", "none", image, "python", "-c", "import torch, numpy"]
        say("imagefactory test vs docker run")
        a, b = pairs(n, lambda: self.cli("test"), lambda: timed(run))
        cached = Row("`imagefactory test`, verdicts cached", "`imagefactory test`", "`docker run … import torch, numpy`",
                     a, b, "≤ 1.5x")
        a, b = pairs(n, lambda: self.cli("test", "--retest"), lambda: timed(run))
        seconds = self.compile_seconds()
        probed = Row("`imagefactory test --retest` (the probe, with torch.compile)", "`test --retest`",
                     "`docker run … import torch, numpy`", a, b, "≤ 1.5x",
                     note=f"the torch.compile check alone took {seconds} in the last probe")
        return [cached, probed, self.test_without_compiler(n)]

    def launch_modes(self, n: int) -> list[Row]:
        """Every launch mode, side by side, vs the docker mode alone: what the modes cost."""
        from dataclasses import replace

        from imagefactory.config import matrix
        from imagefactory.probe import smoke

        cell = matrix.load(self.matrix).cell(GOOD)
        image = self.report()[GOOD]["candidate"]

        def probe(c, modes: tuple[str, ...]) -> float:
            started = time.perf_counter()
            result = smoke.test_image(self.engine, c, image, gpus=False, modes=modes)
            took = time.perf_counter() - started
            if not result.passed:
                raise SystemExit(f"the probe failed in {modes}: "
                                 f"{[(x.mode, x.name) for x in result.checks if x.verdict == 'fail']}")
            return took

        rows = []
        for label, c in (("with torch.compile", cell), ("`compiler: false`", replace(cell, compiler=False))):
            say(f"launch modes, {label}: all three vs docker alone")
            a, b = pairs(n, lambda c=c: probe(c, smoke.DEFAULT_MODES), lambda c=c: probe(c, ("docker",)))
            rows.append(Row(f"probe in 3 launch modes, {label}", "docker + bare + hpc (side by side)",
                            "docker mode alone", a, b, "information (3 probes of work)",
                            note=f"{os.cpu_count()} cores: the three containers share them"))
        return rows

    def compile_seconds(self, work: str = "work") -> str:
        checks = {c["name"]: c for c in self.report(work)[GOOD]["checks"]}
        actual = checks.get("torch.compile", {}).get("actual", "")
        return actual.rsplit(" in ", 1)[-1] if " in " in actual else f"? ({actual})"

    def test_without_compiler(self, n: int) -> Row:
        """The same cell with `compiler: false`: the probe leaves torch.compile out."""
        nocc = self.root / "matrix-nocc.yaml"
        nocc.write_text(self.matrix.read_text() + "compiler: false\n")
        say("building the compiler: false variant (the venv stage is cached)")
        self.cli("build", matrix=nocc, work="nocc")
        image = self.report("nocc")[GOOD]["candidate"]
        run = ["docker", "run", "--rm", "--network", "none", image, "python", "-c", "import torch, numpy"]
        a, b = pairs(n, lambda: self.cli("test", "--retest", matrix=nocc, work="nocc"), lambda: timed(run))
        return Row("`imagefactory test --retest`, `compiler: false` cell", "`test --retest`",
                   "`docker run … import torch, numpy`", a, b, "≤ 1.5x",
                   note="no torch.compile child: the check is `skip` in such a cell")

    # -- issue 16 rows (registry cache, probe goal) ----------------------------------------
    def probe_goal(self, n: int) -> Row:
        """The probe of the cell as built vs import + one bare torch.compile of the same function."""
        sys.path.insert(0, str(REPO / "imagefactory" / "resources"))
        import probe  # the in-image probe script: its compile section is the baseline's program

        image = self.report()[GOOD]["candidate"]
        bare = ["docker", "run", "--rm", "--network", "none", image, "python", "-c",
                probe.child_code(["torch_compile"])]

        def baseline() -> float:
            started = time.perf_counter()
            out = subprocess.run(bare, capture_output=True, text=True)
            took = time.perf_counter() - started
            if out.returncode != 0 or '"ok": true' not in out.stdout:
                raise SystemExit(f"the bare torch.compile failed: {out.stdout[-500:]} {out.stderr[-1500:]}")
            return took

        say("the probe vs import + one bare torch.compile")
        a, b = pairs(n, lambda: self.cli("test", "--retest"), baseline)
        return Row("probe goal: `test --retest` vs import + bare torch.compile", "`test --retest`",
                   "`docker run … import torch, numpy` + one bare `torch.compile` (one container)", a, b, "≤ 1.5x",
                   note=f"same image, same function and Inductor settings as the probe; the probe's compile "
                        f"check alone took {self.compile_seconds()}")

    def registry_pull(self, n: int) -> Row:
        """A fresh runner whose registry has the cell's content tag vs a cold build."""
        creds = {"IMAGEFACTORY_REGISTRY_USER": os.environ.get("IMAGEFACTORY_TEST_REGISTRY_USER", "imagefactory"),
                 "IMAGEFACTORY_REGISTRY_PASSWORD": os.environ.get("IMAGEFACTORY_TEST_REGISTRY_PASSWORD",
                                                                  "ci-password")}
        say("pushing the cell's content tag")
        self.env.update(creds)
        try:
            self.cli("build", "--push", work="regcache-push")
            pushed = self.report("regcache-push")[GOOD]

            def fresh() -> float:
                self.engine.remove_image(pushed["image_id"])  # the bench's own image: this engine lacks it now
                self.runs += 1
                work = f"regcache-{self.runs}"
                self.env["IMAGEFACTORY_CACHE_DIR"] = str(self.root / f"cache-{self.runs}")
                took = self.cli("build", "--push", work=work)
                if not self.report(work)[GOOD]["pulled"]:
                    raise SystemExit("the fresh runner built the cell instead of pulling its content tag")
                return took

            def cold() -> float:
                self.new_base()
                took = self.cli("build", work=f"cold-{self.runs}")
                if self.report(f"cold-{self.runs}")[GOOD]["status"] != "passed":
                    raise SystemExit("the cold build did not pass")
                return took

            say("fresh runner (content tag in the registry) vs cold build (minutes each)")
            a, b = pairs(n, fresh, cold)
        finally:
            self.env["IMAGEFACTORY_CACHE_DIR"] = str(self.root / "cache")
            for key in creds:
                self.env.pop(key, None)
        return Row("fresh runner, content tag in the registry", "`build --push` (pulled, probed)",
                   "cold `build` (probed)", a, b, "< 1 (pays off)",
                   note="no local image, an empty verdict cache; base layers were local (shared)")

    def builders(self, n: int, noop_pairs: int) -> tuple[Row, Row]:
        """BuildKit vs classic, cold (`n` pairs) and no-op (`noop_pairs`, at least 3), the same cell."""
        def cold(builder: str) -> float:
            self.new_base()
            work = f"cold-{builder}-{self.runs}"
            took = self.cli("build", "--builder", builder, work=work)
            if self.report(work)[GOOD]["builder"] != builder:
                raise SystemExit(f"the cold build did not use {builder}")
            return took

        say("cold builds, BuildKit then classic (minutes each)")
        a, b = pairs(n, lambda: cold("buildkit"), lambda: cold("classic"))
        cold_row = Row("cold build, BuildKit vs classic", "`build --builder buildkit`", "`build --builder classic`",
                       a, b, "≤ 1.0x", note="each run on a new base; BuildKit's pip cache mount as earlier builds left it")
        say("no-op rebuilds, BuildKit vs classic")
        self.cli("build", "--builder", "buildkit", work="bk")
        self.cli("build", "--builder", "classic", work="work")
        a, b = pairs(max(noop_pairs, 3), lambda: self.cli("build", "--builder", "buildkit", work="bk"),
                     lambda: self.cli("build", "--builder", "classic", work="work"))
        if not (self.report("bk")[GOOD]["cached"] and self.report()[GOOD]["cached"]):
            raise SystemExit("a no-op rebuild built something")
        return cold_row, Row("no-op rebuild, BuildKit vs classic", "`build --builder buildkit`",
                             "`build --builder classic`", a, b, "≤ 1.0x")

    def mounts(self, n: int) -> Row:
        """Cold BuildKit builds of the cell with and without the pip cache mount."""
        from imagefactory.config import matrix
        from imagefactory.render import contexts as render

        m = matrix.load(self.matrix)
        cell = m.cell(GOOD)
        self.cli("build", "--builder", "buildkit", work="bk")  # the cell's packages are in the cache mount now

        def cold(mounts: bool) -> float:
            self.new_base()
            ctx = self.root / f"mounts-{self.runs}"
            # FROM pinned to the new base's digest: by tag, BuildKit may reuse the tag's earlier resolution
            pinned = f"{self.base_ref}@{self.engine.registry_digest(self.base_ref)}"
            render.render(m, ctx, [cell], bases={cell.base_image: pinned},
                          builder=Builder.buildkit if mounts else Builder.classic)
            ctx = ctx / cell.id
            tag = f"imagefactory-bench/mounts-{self.id}:{self.runs}"
            took = timed(["docker", "buildx", "build", "--progress=plain", "--network", "host", "--load", "-t", tag,
                          str(ctx)], {"BUILDX_NO_DEFAULT_ATTESTATIONS": "1"})
            self.images.append(tag)
            return took

        say("cold BuildKit builds with and without the cache mounts (minutes each)")
        a, b = pairs(n, lambda: cold(True), lambda: cold(False))
        return Row("cache mounts: cold build, packages already fetched", "with the mounts", "without (classic "
                   "rendering)", a, b, "< 1 (pays off)",
                   note="both `docker buildx build` on a new base; torch comes from the wheelhouse either way")

    def registry_changed(self, n: int) -> Row:
        """A fresh runner builds a changed cell with the registry's inline cache vs a cold build. One
        pair whatever `n`: the cold side moves the bench's base, which the pushed cell was built on."""
        image = f"{BASE_REGISTRY}/bench-{self.id}/regcache"
        base = self.matrix.read_text().replace(f"image: 127.0.0.1:5001/bench-{self.id}/train\n", f"image: {image}\n")
        pushed_matrix = self.root / "matrix-regcache.yaml"
        pushed_matrix.write_text(base)
        say("pushing the cell built by BuildKit (inline cache)")
        self.cli("build", "--builder", "buildkit", "--push", work="rc-push", matrix=pushed_matrix)
        pushed = self.report("rc-push")[GOOD]

        def fresh() -> float:
            for ref in [pushed["image_id"], *self.images]:  # the bench's images hold its cache records
                if ref != self.base_ref and not ref.startswith(f"{BASE_REGISTRY}/bench-{self.id}/python"):
                    try:
                        self.engine.remove_image(ref)
                    except EngineError:  # a base that later images are built on: it stays
                        pass
            prune_build_cache_since(self.started)
            self.runs += 1
            changed = self.root / f"matrix-changed-{self.runs}.yaml"
            changed.write_text(base.replace("threads: 2", f"threads: {2 + self.runs}"))
            work = f"rc-changed-{self.runs}"
            took = self.cli("build", "--builder", "buildkit", "--registry-cache", work=work, matrix=changed)
            log = Path(self.report(work)[GOOD]["log"]).read_text()
            if " CACHED" not in log:
                raise SystemExit("the changed cell reused no step from the registry's inline cache")
            return took

        def cold() -> float:
            self.new_base()
            work = f"rc-cold-{self.runs}"
            took = self.cli("build", "--builder", "buildkit", work=work)
            self.report(work)
            return took

        say("fresh runner with a changed cell (registry cache) vs cold BuildKit build (minutes each)")
        a, b = pairs(1, fresh, cold)
        return Row("fresh runner, changed cell, registry cache", "`build --builder buildkit --registry-cache`",
                   "cold `build --builder buildkit`", a, b, "< 1 (pays off)",
                   note="inline cache from 127.0.0.1:5000; this bench's build cache records pruned before each run")

    def sizes(self) -> tuple[Row, Row]:
        from imagefactory.config import matrix

        ours = self.report()[GOOD]
        image = self.engine.client.images.get(ours["image_id"])
        compiler = matrix.load(self.matrix).cell(GOOD).compiler
        recipe = "naive-pip-compiler.Dockerfile" if compiler else "naive-pip.Dockerfile"
        ctx = self.root / "naive"
        ctx.mkdir()
        shutil.copy(REPO / "bench" / "fixtures" / recipe, ctx / "Dockerfile")
        shutil.copytree(self.root / "work" / "contexts" / GOOD / "certs", ctx / "certs")
        (ctx / "wheelhouse").mkdir()
        for whl in self.wheelhouse.glob(f"torch-{TORCH}+cpu-*.whl"):
            shutil.copy(whl, ctx / "wheelhouse" / whl.name)
        naive_tag = f"imagefactory-bench/naive-{self.id}:latest"
        say(f"building the naive recipe ({recipe})")
        resp = self.engine.api.build(path=str(ctx), tag=naive_tag, rm=True, forcerm=True, decode=True,
                                     network_mode="host", buildargs={"BASE": ours["base_image"]})
        for event in resp:
            if "error" in event:
                raise SystemExit(f"naive build failed: {event['error']}")
        naive = self.engine.client.images.get(naive_tag)
        self.images.append(naive.id)
        venv = int(self.run_in(image.id, ["du", "-sb", "/opt/venv"]).split()[0])
        base = self.engine.client.images.get(self.base_ref).attrs["Size"]
        added = sorted(set(self.packages(image.id)) - set(self.packages(self.base_ref)))
        toolchain = installed = 0
        if added:
            toolchain, installed = map(int, self.run_in(image.id, ["python", "-c", PACKAGE_BYTES, *added]).split())
        layers = self.layers(image)
        size = image.attrs["Size"]
        what = "build-essential, python3-dev, " if compiler else ""
        return (Row("image size vs naive recipe", "ours", "naive (one package per RUN, caches kept)",
                    [size], [naive.attrs["Size"]], "≤ 0.6x", unit="MB",
                    note=f"naive: {recipe} ({what}caches kept); ours: {layers}"),
                Row("image size vs payload", "ours", "payload (/opt/venv + base OS + toolchain packages)",
                    [size], [venv + base + toolchain], "≤ 1.15x", unit="MB",
                    note=f"venv {venv / 1e6:,.0f} MB + base {base / 1e6:,.0f} MB + toolchain "
                         f"{toolchain / 1e6:,.0f} MB (files in the image of the {len(added)} packages "
                         f"not in the base; their dpkg Installed-Size: {installed / 1e6:,.0f} MB)"))

    def run_in(self, image: str, cmd: list[str]) -> str:
        out = self.engine.client.containers.run(image, cmd, remove=True, network_mode="none", stderr=False)
        return out.decode()

    def packages(self, image: str) -> list[str]:
        return self.run_in(image, ["dpkg-query", "-W", "-f", "${binary:Package}\\n"]).split()

    def layers(self, image) -> str:
        """The sizes of the toolchain layer and the venv layer, from `docker history`."""
        found = []
        for step in image.history():
            made_by = step.get("CreatedBy", "")
            if "apt-get install" in made_by and "g++" in made_by:
                found.append(f"toolchain layer {step['Size'] / 1e6:,.0f} MB")
            elif "COPY" in made_by and " in /opt/venv" in made_by:
                found.append(f"venv layer {step['Size'] / 1e6:,.0f} MB")
        return ", ".join(reversed(found)) or "no toolchain or venv layer found"

    def cleanup(self) -> None:
        import requests

        try:  # the bench's base in the base registry (works where the registry allows deletes)
            r = requests.head(f"http://{BASE_REGISTRY}/v2/{self.base_repo}/manifests/3.11-slim-bookworm",
                              headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
                              timeout=10)
            if r.status_code == 200:
                requests.delete(f"http://{BASE_REGISTRY}/v2/{self.base_repo}/manifests/"
                                f"{r.headers['Docker-Content-Digest']}", timeout=10)
        except requests.RequestException:
            pass
        self.images.append(self.base_ref)
        for ref in reversed(self.images):
            try:
                self.engine.client.images.remove(ref, force=True)
            except Exception:  # noqa: BLE001 - best effort: an image may share layers with a later one
                pass


FIGURES = ("cold", "noop", "test", "modes", "sizes", "probe-goal", "registry", "builders", "mounts", "registry-changed")


def prune_build_cache_since(started: float) -> None:
    """Remove the BuildKit cache records made since `started` (this bench's, under the docker
    lock), one id at a time (buildx takes one id per filter); other builds' records stay."""
    import datetime as dt
    import re

    for _ in range(10):
        out = subprocess.run(["docker", "buildx", "du", "--verbose"], capture_output=True, text=True, check=True)
        ids = []
        for block in out.stdout.split("\n\n"):
            rec = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
            stamp = re.match(r"\s*(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", rec.get("Created at", ""))
            if stamp and "ID" in rec and dt.datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S").replace(
                    tzinfo=dt.timezone.utc).timestamp() >= started:
                ids.append(rec["ID"].strip())
        if not ids:
            return
        pruned = [r for r in ids if r in subprocess.run(["docker", "buildx", "prune", "-f", "--filter", f"id={r}"],
                                                        capture_output=True, text=True).stdout]
        if not pruned:  # what is left is held by an image that is not the bench's to remove
            say(f"  {len(ids)} build cache record(s) of this bench could not be pruned")
            return


def issue16_rows(bench: Bench, figures: set[str], args: argparse.Namespace, rows: list[Row]) -> None:
    """The rows issue 16 added (the probe goal, BuildKit, the registry as a cache), appended to
    `rows` as each is measured: a later row that fails leaves the earlier ones printed."""
    if "probe-goal" in figures:
        bench.cli("build")  # the cell as built (compiler: true), probed once
        rows.append(bench.probe_goal(args.pairs))
    if "registry" in figures:
        rows.append(bench.registry_pull(args.cold_pairs))
    if "builders" in figures:
        for row in bench.builders(args.cold_pairs, args.pairs):
            rows.append(row)
    if "mounts" in figures:
        rows.append(bench.mounts(args.cold_pairs))
    if "registry-changed" in figures:
        rows.append(bench.registry_changed(args.cold_pairs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="interleaved pairs per figure (default 3)")
    ap.add_argument("--cold-pairs", type=int, default=1, help="pairs of cold -j 2 / -j 1 builds (minutes each)")
    ap.add_argument("--wheelhouse", type=Path,
                    default=Path(os.environ.get("IMAGEFACTORY_CI_CACHE", Path.home() / ".cache/imagefactory-ci"))
                    / "wheels")
    ap.add_argument("--skip-cold", action="store_true", help="leave out the cold -j figure")
    ap.add_argument("--only-modes", action="store_true",
                    help="only the launch-mode figures (builds the cell once, then times the probes); "
                         "the same as --figures modes")
    ap.add_argument("--keep", action="store_true", help="keep the images and the work folder")
    ap.add_argument("--figures", default=",".join(FIGURES),
                    help="comma-separated figures to measure (default: all): " + ", ".join(FIGURES))
    args = ap.parse_args()
    if not list(args.wheelhouse.glob(f"torch-{TORCH}+cpu-*.whl")):
        raise SystemExit(f"no torch-{TORCH}+cpu wheel in {args.wheelhouse}: "
                         f"pip download --no-deps -d {args.wheelhouse} torch=={TORCH}+cpu")
    root = Path(tempfile.mkdtemp(prefix="imagefactory-bench-"))
    bench = Bench(root, args.wheelhouse.resolve(), Engine())
    rows: list[Row] = []
    try:
        bench.new_base()
        figures = {"modes"} if args.only_modes else set(args.figures.split(","))
        if figures - set(FIGURES):
            raise SystemExit(f"--figures: unknown {sorted(figures - set(FIGURES))} (known: {', '.join(FIGURES)})")
        if not args.skip_cold and "cold" in figures:
            rows.append(bench.cold_parallel(args.cold_pairs))
        if "noop" in figures:
            rows.extend(bench.noop(args.pairs))
        if "test" in figures:
            rows.extend(bench.test(args.pairs))
        if "modes" in figures:
            bench.cli("build")  # a no-op where an earlier figure built the cell
            rows.extend(bench.launch_modes(args.pairs))
        if "sizes" in figures:
            rows.extend(bench.sizes())
        issue16_rows(bench, figures, args, rows)
    finally:
        cold = " --skip-cold" if args.skip_cold else f" --cold-pairs {args.cold_pairs}"
        cold += "" if args.figures == ",".join(FIGURES) and not args.only_modes else (
            f" --figures {'modes' if args.only_modes else args.figures}")
        print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
              f"load {os.getloadavg()[0]:.1f}; `python bench/factory.py --pairs {args.pairs}{cold}`\n")
        print("| figure | A | B | A/B (median) | goal | runs |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            print(row.line())
        if args.keep:
            print(f"\nkept: {root}")
        else:
            bench.cleanup()
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
