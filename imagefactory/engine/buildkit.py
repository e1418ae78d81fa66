"""BuildKit builds: `docker buildx build` as a subprocess, behind the ContainerEngine interface.

docker-py builds only with the classic builder (docker/docker-py#2230), so `BuildxBuilder` is the
builder a Docker SDK engine (engine/docker.py) is given: the engine does everything else, and its
`build` runs buildx:

    docker buildx build --progress=rawjson --metadata-file FILE --output LOAD -t TAG [--builder NAME]
                        --network host --platform P [--secret id=netrc,src=FILE] CONTEXT

built from one engine_api.BuildRequest (`command`): the platform is the cell's, always given.

No `# syntax=` line is ever rendered (the frontend image cannot be pulled here); BuildKit's
built-in Dockerfile frontend reads `RUN --mount=type=cache|secret`. `--progress=rawjson` prints
one JSON document per progress event (vertexes, statuses, logs) on stderr; `RawJsonProgress`
turns it into the same log lines, step N of M and 30-line tail the classic stream gives. An
interrupt stops buildx's whole process group (SIGINT, then SIGKILL): buildx closing its session
cancels the build in the engine.

`select` chooses the builder: buildkit when `docker buildx version` answers with at least
MIN_VERSION, else classic (auto) or exit 2 (buildkit). The answer is asked each run, never kept.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable

from imagefactory.config import recipe
from imagefactory.config.registries import RECOMPRESSED, Registry
from imagefactory.engine import identity
from imagefactory import terminal
from imagefactory.engine.api import PODMAN, Builder, BuildProgress, BuildRequest
from imagefactory.errors import BuildError, Cancelled, ConfigError, EngineGone
from imagefactory.interrupt import Interrupt

if TYPE_CHECKING:  # the SDK engine is the caller's: this module imports no SDK
    from imagefactory.engine.docker import Engine

MIN_VERSION = (0, 13)
TAIL_LINES = 30
STOP_SECONDS = 3.0  # after SIGINT, how long buildx gets to cancel its build before SIGKILL
INSTALL_HINT = ("install the buildx CLI plugin (`bash scripts/ci-setup.sh` does, from Debian trixie's "
                "docker-buildx package), or build with --builder classic")
# "github.com/docker/buildx 0.13.1+ds1 0.13.1+ds1-3", "github.com/docker/buildx v0.17.1 8c2a5c6"
VERSION_RE = re.compile(r"\S*buildx\s+v?(\d+)\.(\d+)(?:\.(\d+))?\S*(?:\s+\S+)?\s*")
# "[2/3] RUN ...", "[venv 4/7] RUN ...", "[stage-1 1/9] FROM ..."
STEP_RE = re.compile(r"\[(?:(\S+) )?(\d+)/(\d+)\] (.*)", re.DOTALL)
# builder names buildx accepts (`docker buildx create --name`)
BUILDER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def docker_cli() -> str | None:
    return shutil.which("docker")


# Where the docker CLI looks for plugins on Linux, after $DOCKER_CONFIG/cli-plugins and the
# config's cliPluginsExtraDirs (docker/cli cli-plugins/manager).
SYSTEM_PLUGIN_DIRS = ("/usr/local/lib/docker/cli-plugins", "/usr/local/libexec/docker/cli-plugins",
                      "/usr/lib/docker/cli-plugins", "/usr/libexec/docker/cli-plugins")


def buildx_version(timeout: float = 20.0) -> tuple[tuple[int, int, int] | None, str]:
    """buildx's version, or None and why not (no docker CLI, no plugin, an answer we cannot read).
    Asked every time it is needed (`docker buildx version`): no answer is kept between runs."""
    cli = docker_cli()
    if cli is None:
        return None, "no `docker` CLI on PATH"
    return _ask(cli, timeout)


def _parsed(first: str) -> tuple[tuple[int, int, int] | None, str]:
    m = VERSION_RE.fullmatch(first)
    if m is None:
        return None, f"`docker buildx version` answered {first!r}, not a version"
    return (int(m[1]), int(m[2]), int(m[3] or 0)), first


def _ask(cli: str, timeout: float) -> tuple[tuple[int, int, int] | None, str]:
    try:
        done = subprocess.run([cli, "buildx", "version"], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"`docker buildx version` did not answer ({type(e).__name__})"
    first = (done.stdout.strip().splitlines() or [""])[0][:200]
    if done.returncode != 0:
        return None, "`docker buildx version` failed: the buildx plugin is not installed"
    return _parsed(first)


def select(choice: Builder | str, say: Callable[[str], None]) -> Builder:
    """The builder a run uses: buildkit or classic. `buildkit` without a usable buildx is
    ConfigError (exit 2) naming the fix; `auto` then falls back to classic and says so once."""
    choice = Builder(choice)
    if choice is Builder.classic:
        return choice
    version, text = buildx_version()
    why = text if version is None else None
    if version is not None and version[:2] < MIN_VERSION:
        why = f"buildx {'.'.join(map(str, version))} is older than {'.'.join(map(str, MIN_VERSION))}"
    if why is None:
        return Builder.buildkit
    if choice is Builder.buildkit:
        raise ConfigError(f"--builder buildkit: {why}; {INSTALL_HINT}")
    say(f"builder: classic ({why}; BuildKit builds need buildx >= {'.'.join(map(str, MIN_VERSION))}: "
        f"{INSTALL_HINT.split(', or')[0]})")
    return Builder.classic


def check_builder_name(name: str | None) -> str | None:
    if name is not None and not BUILDER_NAME_RE.fullmatch(name):
        raise ConfigError(f"--buildx-builder {name[:80]!r}: not a builder name (letters, digits, '_', '.', '-')")
    return name


# `--load` (into the engine's own image store), with gzip forced. Without force-compression,
# BuildKit writing the inline cache (below) lists every combination of the compression variants
# it holds of the parent layers (moby/buildkit cache/remote.go, getAvailableBlobs): once a push
# as zstd or eStargz has given each layer of a 20-layer image a second blob, that is 2**20 chains,
# and dockerd grew to 24 GB within a minute here. Forced, it takes one chain. Layers already gzip
# (the default every build writes) are kept as they are; 20.10's exporter takes the keys too.
LOAD = "type=docker,compression=gzip,force-compression=true"


def command(cli: str, request: BuildRequest, metadata: Path, *, builder: str | None) -> list[str]:
    """The buildx command line of `request` (a list: no shell ever sees it); `builder`: buildx's
    --builder NAME. One platform per build: the docker driver builds no more."""
    args = [cli, "buildx", "build", "--progress=rawjson", "--metadata-file", str(metadata), "--output", LOAD,
            "-t", request.tag]
    if builder:
        args += ["--builder", builder]
    if request.network:
        args += ["--network", request.network]
    args += ["--platform", request.platform.oci]
    if request.pull:
        args.append("--pull")
    if request.nocache:
        args.append("--no-cache")
    # inline cache metadata in every image (regcache.py): a later build on another machine can take
    # its cache from this image once it is pushed (registry cache export needs another driver)
    args += ["--build-arg", "BUILDKIT_INLINE_CACHE=1"]
    # the image's and its history's times (BuildKit >= 0.11): a constant, so two builds of one
    # context on any day give one config (the layers' own times are fixed inside the build)
    args += ["--build-arg", f"SOURCE_DATE_EPOCH={recipe.SOURCE_DATE_EPOCH}"]
    for ref in request.cache_from:
        args += ["--cache-from", ref]
    for name, src in sorted(request.secrets):
        args += ["--secret", f"id={name},src={src}"]
    args.append(request.context)
    return args


class RawJsonProgress:
    """buildx's `--progress=rawjson` stream -> log lines, BuildProgress and the log tail.

    Each event is one JSON document (pretty-printed over several lines). A vertex named
    "[stage k/n] INSTRUCTION" is a Dockerfile step; step N of M counts the steps started of
    all the steps announced. Lines that are not JSON (buildx's final "ERROR: ...") are log
    lines too."""

    def __init__(self, log: Callable[[str], None], progress: Callable[[BuildProgress], None]):
        self.log, self.progress = log, progress
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.state = BuildProgress()
        self._names: dict[str, str] = {}  # vertex digest -> name
        self._steps: dict[str, int] = {}  # "stage" -> its step count
        self._started: set[str] = set()  # step vertexes started
        self._announced: set[str] = set()  # vertexes whose start was logged
        self._errors: list[str] = []
        self._buffer: list[str] = []
        self._partial: dict[str, str] = {}  # vertex -> an unfinished log line

    @property
    def error(self) -> str | None:
        return self._errors[-1] if self._errors else None

    def emit(self, line: str) -> None:
        self.tail.append(line)
        self.log(line)

    def feed_line(self, line: str) -> None:
        """One line of buildx's stderr."""
        if not self._buffer:
            if line.startswith("{"):
                self._buffer.append(line)
                if line.rstrip().endswith("}"):  # a whole document on one line (or "{}"): no closing line follows
                    self._flush(keep_if_partial=True)
            elif line.strip():
                text = line.rstrip()
                self.emit(text)
                if text.startswith("ERROR:"):
                    self._errors.append(text.removeprefix("ERROR:").strip())
            return
        self._buffer.append(line)
        end = line.rstrip()
        if end == "}":  # a document's closing brace is alone on its line, unindented
            self._flush()
        elif line[:1] in "}]" and end.endswith("}"):  # an unindented `]}`: perhaps the end too
            self._flush(keep_if_partial=True)

    def _flush(self, keep_if_partial: bool = False) -> None:
        text = "".join(self._buffer)
        try:
            event = json.loads(text)
        except ValueError:
            if keep_if_partial:  # a first line like `{"a": {}` : the document goes on
                return
            self._buffer = []
            for line in text.splitlines():
                self.emit(line)
            return
        self._buffer = []
        if isinstance(event, dict):
            self.feed(event)

    def feed(self, event: dict) -> None:
        for v in event.get("vertexes") or ():
            if isinstance(v, dict):
                self._vertex(v)
        for entry in event.get("logs") or ():
            if isinstance(entry, dict):
                self._logs(entry)

    def _vertex(self, v: dict) -> None:
        digest, name = str(v.get("digest", "")), str(v.get("name", ""))
        self._names[digest] = name
        m = STEP_RE.fullmatch(name)
        if m:
            self._steps[m[1] or ""] = int(m[3])
        if v.get("started") and digest not in self._announced:
            self._announced.add(digest)
            self.emit(f"#{len(self._announced)} {name}" + (" CACHED" if v.get("cached") else ""))
            if m and digest not in self._started:
                self._started.add(digest)
                self.state = BuildProgress(len(self._started), max(sum(self._steps.values()), len(self._started)),
                                           m[4])
                self.progress(self.state)
        if v.get("error"):
            message = str(v["error"]).strip()
            self.emit(f"ERROR: {name}: {message}")
            self._errors.append(message)
            if m:
                self._failed_step = name

    def _logs(self, entry: dict) -> None:
        vertex = str(entry.get("vertex", ""))
        try:
            data = base64.b64decode(str(entry.get("data", "")), validate=True).decode(errors="replace")
        except ValueError:
            return
        text = self._partial.pop(vertex, "") + data.replace("\r\n", "\n").replace("\r", "\n")
        lines = text.split("\n")
        if lines[-1]:
            self._partial[vertex] = lines[-1]
        for line in lines[:-1]:
            if line.strip():
                self.emit(line)

    def step_text(self) -> str | None:
        failed = getattr(self, "_failed_step", None)
        if failed:
            m = STEP_RE.fullmatch(failed)
            return f"{failed}" if m is None else f"step {m[2]}/{m[3]}{' of ' + m[1] if m[1] else ''}: {m[4]}"
        s = self.state
        return f"step {s.step}/{s.steps}: {s.instruction}" if s.step else None

    def build_error(self, message: str) -> BuildError:
        return BuildError(message, step=self.step_text(), log_tail=list(self.tail))


def _stop(proc: subprocess.Popen) -> None:
    """Stop buildx and its build: SIGINT to its process group (buildx cancels the build and
    exits), then SIGKILL to whatever of the group is left, at most STOP_SECONDS later."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        return

    def later() -> None:
        try:
            proc.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever of the group is left, even once buildx itself has exited
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    threading.Thread(target=later, name="imagefactory-buildx-stop", daemon=True).start()


def run_build(args: list[str], parser: RawJsonProgress, interrupt: Interrupt,
              env: dict[str, str] | None = None) -> int:
    """Run buildx in its own process group, feed its output to `parser`, return its exit status.
    Cancelled once `interrupt` is set (the process group stopped). `env`: instead of _buildx_env()."""
    interrupt.check()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env or _buildx_env())
    try:
        with interrupt.on_cancel(lambda: _stop(proc)):
            out: IO[bytes] | None = proc.stdout
            assert out is not None
            for raw in out:
                parser.feed_line(raw.decode(errors="replace"))
            code = proc.wait()
    finally:
        if proc.poll() is None:  # an exception (or an interrupt) while reading: never leave it running
            _stop(proc)
            try:
                proc.wait(timeout=STOP_SECONDS + 2)
            except subprocess.TimeoutExpired:
                pass
        if proc.stdout is not None:
            proc.stdout.close()
    interrupt.check()
    return code


def _buildx_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("BUILDX_BUILDER", None)  # the builder is chosen by --buildx-builder only
    env["BUILDX_NO_DEFAULT_ATTESTATIONS"] = "1"  # the docker driver cannot store them
    return env


def recompress_command(cli: str, ref: str, compression: str, metadata: Path, context: Path) -> list[str]:
    """The buildx command that pushes the local image `ref` as `ref` with its layers recompressed
    (`FROM ref` and nothing else: BuildKit resolves it in the containerd image store, no pull)."""
    if compression not in RECOMPRESSED:  # a word of the --output value: only what the schema allows
        raise ValueError(f"not a compression BuildKit is asked for: {compression[:20]!r}")
    output = (f"type=image,name={ref},push=true,compression={compression},oci-mediatypes=true,"
              f"force-compression=true")
    return [cli, "buildx", "build", "--progress=rawjson", "--metadata-file", str(metadata), "--provenance=false",
            "--output", output, str(context)]


def _docker_config(folder: Path, registry: str, auth: dict[str, str] | None) -> dict[str, str]:
    """buildx's environment for one push: with `auth`, a Docker config of its own in `folder` holding
    only that login (the user's buildx plugins and builders linked in); without, the user's."""
    env = _buildx_env()
    if not auth:
        return env
    mine = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
    folder.mkdir(mode=0o700)
    for name in ("cli-plugins", "buildx"):
        if (mine / name).is_dir():
            (folder / name).symlink_to(mine / name)
    token = base64.b64encode(f"{auth['username']}:{auth['password']}".encode()).decode()
    (folder / "config.json").write_text(json.dumps({"auths": {registry: {"auth": token}}}))
    (folder / "config.json").chmod(0o600)
    return {**env, "DOCKER_CONFIG": str(folder)}


def push_recompressed(ref: str, registry: str, compression: str, auth: dict[str, str] | None,
                      interrupt: Interrupt) -> str:
    """Push the local image `ref` with `compression` layers under OCI media types (`docker buildx build
    --output type=image,push=true,compression=...,force-compression=true`); the manifest digest pushed.
    Needs the containerd image store (the caller checks). PushError when buildx fails."""
    from imagefactory.engine.api import is_transient
    from imagefactory.errors import PushError

    cli = docker_cli()
    if cli is None:
        raise PushError(f"push of {ref} with {compression}: no `docker` CLI on PATH: " + INSTALL_HINT, transient=False)
    parser = RawJsonProgress(lambda line: None, lambda p: None)
    with tempfile.TemporaryDirectory(prefix="imagefactory-recompress-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(f"FROM {ref}\n")
        metadata = Path(tmp) / "metadata.json"
        env = _docker_config(Path(tmp) / "docker-config", registry, auth)
        try:
            code = run_build(recompress_command(cli, ref, compression, metadata, Path(tmp)), parser, interrupt, env)
        except OSError as e:
            raise PushError(f"push of {ref}: could not run docker buildx: {e.strerror}", transient=True) from None
        if code != 0:
            message = parser.error or f"docker buildx build exited {code}"
            raise PushError(f"push of {ref} with {compression} failed: {message}", transient=is_transient(message))
        digest = _pushed_digest(metadata)
    if digest is None:
        raise PushError(f"push of {ref} with {compression} ended without a digest", transient=True)
    return digest


def _pushed_digest(path: Path) -> str | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    digest = data.get("containerimage.digest") if isinstance(data, dict) else None
    return digest if isinstance(digest, str) and identity.DIGEST_RE.fullmatch(digest) else None


class BuildxBuilder:
    """BuildKit as the builder a Docker SDK engine is given (engine.docker.ImageBuilder): `build`
    runs `docker buildx build` (`buildx_builder`: its --builder NAME); the engine does the rest."""

    kind = Builder.buildkit

    def __init__(self, buildx_builder: str | None = None) -> None:
        self.buildx_builder = buildx_builder

    def attach(self, engine: Engine) -> None:
        """The builder name checked, and a podman engine refused, before anything is built: buildx
        would fail in its first step."""
        self.buildx_builder = check_builder_name(self.buildx_builder)
        if engine.product() == PODMAN:
            where = terminal.printable(os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"))
            raise ConfigError(f"builder buildkit: the engine at {where} is podman, whose Docker API serves no BuildKit "
                              f"(docker buildx cannot build through it); build with --builder classic")

    def push_recompressed(self, engine: Engine, ref: str, compression: str, auth: dict[str, str] | None) -> str:
        """Push the local image `ref` with `compression` layers (push_recompressed); its digest."""
        return push_recompressed(ref, Registry.of(ref).host, compression, auth, engine.interrupt)

    def build(self, engine: Engine, request: BuildRequest, *, log: Callable[[str], None] = lambda line: None,
              progress: Callable[[BuildProgress], None] = lambda p: None) -> str:
        cli = docker_cli()
        if cli is None:
            raise BuildError("no `docker` CLI on PATH: " + INSTALL_HINT)
        parser = RawJsonProgress(log, progress)
        tag = request.tag
        with tempfile.TemporaryDirectory(prefix="imagefactory-buildx-") as tmp:
            metadata = Path(tmp) / "metadata.json"
            args = command(cli, request, metadata, builder=self.buildx_builder)
            try:
                code = run_build(args, parser, engine.interrupt)
            except Cancelled:
                raise
            except OSError as e:
                raise parser.build_error(f"could not run docker buildx: {e.strerror}") from None
            if code != 0:
                message = parser.error or f"docker buildx build exited {code}"
                if not engine.alive():
                    raise EngineGone(f"build of {tag}: the Docker engine stopped answering ({message})")
                raise parser.build_error(message)
            made = _metadata_digests(metadata)
        # The engine's id for the name, in its own store (identity.py), never buildx's config
        # digest: in the containerd image store no image answers to that.
        named = engine.image_id(tag)
        image_id = identity.built(named, made)
        if image_id is None:
            raise parser.build_error("the build ended without producing an image" if named is None else
                                     f"{tag} names another image than the build made (moved meanwhile?)")
        return image_id


def _metadata_digests(path: Path) -> frozenset[str]:
    """The digests buildx's --metadata-file names (identity.builder_digests); none when the
    file is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return frozenset()
    return identity.builder_digests(data) if isinstance(data, dict) else frozenset()
