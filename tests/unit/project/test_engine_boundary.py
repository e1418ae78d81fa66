"""The engine boundary: only engine.py imports the Docker SDK, and the commands that need no
engine (`list`, `render`, `schema`, `lock --check`) never load it. Each command runs in a fresh
interpreter under `python -X importtime`, which names every module it imports."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.helpers import package_modules

MATRIX = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
torch: "2.7.1"
pip: {wheelhouse: wheels}
"""


def imported_modules(args: list[str], cwd: Path) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "IMAGEFACTORY_CACHE_DIR": str(cwd / "cache")}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "imagefactory", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    rows = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "imagefactory.cli.app" in rows, r.stderr[-2000:]  # the command really ran through the CLI
    return set(rows)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "matrix.yaml").write_text(MATRIX)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with open(wheels / "big-1.0-py3-none-any.whl", "wb") as f:  # >= 1 MiB: its digest goes to the cache file
        f.truncate(2 << 20)
    return tmp_path


@pytest.mark.parametrize("args", [["list"], ["schema"], ["render", "--out", "out"], ["lock", "--check"]],
                         ids=["list", "schema", "render", "lock-check"])
def test_commands_without_an_engine_load_no_docker_sdk(args, project):
    modules = imported_modules(args, project)
    sdk = sorted(m for m in modules if m.split(".")[0] == "docker" or m == "imagefactory.engine.docker")
    assert not sdk, f"`imagefactory {' '.join(args)}` imported {sdk}"
    if args[0] == "render":
        assert (project / "out" / "py3.11-cpu-openblas-pip" / "Dockerfile").is_file()


def test_only_engine_py_imports_the_docker_sdk():
    """Outside engine.py (package and bench/ scripts), no module imports `docker`."""
    offenders = []
    for path in [*package_modules().values(), *(REPO / "bench").glob("*.py")]:
        if path == REPO / "imagefactory" / "engine" / "docker.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(REPO)}:{node.lineno}" for n in names if n.split(".")[0] == "docker"]
    assert not offenders


def test_the_fake_and_the_docker_engine_implement_the_whole_interface():
    """tests/fake_engine.py and engine.Engine both have every ContainerEngine method, with the
    same parameters: a command that works on the fake uses nothing the real engine lacks."""
    import inspect

    from imagefactory.engine.docker import Engine
    from imagefactory.engine.api import ContainerEngine
    from tests.fake_engine import FakeEngine

    methods = [n for n, f in vars(ContainerEngine).items() if callable(f) and not n.startswith("_")]
    assert {"describe", "build", "run", "push", "remove_image"} <= set(methods)
    for name in methods:
        wanted = list(inspect.signature(getattr(ContainerEngine, name)).parameters)
        for impl in (Engine, FakeEngine):
            assert list(inspect.signature(getattr(impl, name)).parameters) == wanted, f"{impl.__name__}.{name}"


def test_the_fake_and_the_http_registry_client_implement_the_whole_interface():
    """tests/fake_engine.py's FakeRegistry and registry.HttpRegistry both have every RegistryClient
    method, with the same parameters; and the engine interface has no registry HTTP call left."""
    import inspect

    from imagefactory.engine.api import ContainerEngine, RegistryClient
    from imagefactory.engine.registry import HttpRegistry
    from tests.fake_engine import FakeRegistry

    methods = [n for n, f in vars(RegistryClient).items() if callable(f) and not n.startswith("_")]
    assert set(methods) == {"manifest", "put_manifest"}
    for name in methods:
        wanted = list(inspect.signature(getattr(RegistryClient, name)).parameters)
        for impl in (HttpRegistry, FakeRegistry):
            assert list(inspect.signature(getattr(impl, name)).parameters) == wanted, f"{impl.__name__}.{name}"
    assert not {"registry_manifest", "put_manifest"} & set(vars(ContainerEngine))
    assert ContainerEngine.__annotations__["registry"] in (RegistryClient, "RegistryClient")


# --------------------------------------------------------------------------- one run's engines
class _Client:
    """What Engine asks of a docker.DockerClient here: ping (its answer's Api-Version header
    seen by the session's response hooks), the negotiated version, docker info, close."""

    server = "1.41"  # the engine's API version: what negotiating gives and its ping names
    refuses: str | None = None  # a version whose ping the engine answers with an APIError
    infos = 0
    info_fails = 0  # how many `docker info` calls fail before one answers

    def __init__(self, version: str | None):
        self.api = type("Api", (), {"api_version": version or _Client.server, "hooks": {"response": []}})()

    def ping(self) -> bool:
        import docker.errors

        if self.api.api_version == _Client.refuses:
            raise docker.errors.APIError("client version is too new")
        answer = type("Response", (), {"headers": {"Api-Version": _Client.server}})()
        for hook in self.api.hooks["response"]:
            hook(answer)
        return True

    def info(self) -> dict:
        _Client.infos += 1
        if _Client.info_fails:
            _Client.info_fails -= 1
            raise OSError("the engine hung up")
        return {"Architecture": "x86_64", "Runtimes": {"runc": {}}}

    def close(self) -> None:
        pass


@pytest.fixture
def clients(monkeypatch) -> list[str | None]:
    """docker.from_env stood in by _Client; the versions asked of it, in order."""
    import docker

    asked: list[str | None] = []

    def from_env(timeout: int, version: str | None = None) -> _Client:
        asked.append(version)
        return _Client(version)

    monkeypatch.setattr(docker, "from_env", from_env)
    monkeypatch.setattr(_Client, "server", "1.41")
    monkeypatch.setattr(_Client, "refuses", None)
    monkeypatch.setattr(_Client, "infos", 0)
    monkeypatch.setattr(_Client, "info_fails", 0)
    return asked


def test_the_engines_of_one_factory_negotiate_once_and_ask_docker_info_once(clients):
    """A run makes one engine per worker: the second takes the first's API version (no second
    negotiation round trip) and its `docker info` (runtimes, architecture) instead of asking again."""
    from imagefactory.engine import select as engines
    from imagefactory.config import platforms

    factory = engines.docker_factory()
    first = factory()
    deadline = time.monotonic() + 10
    while _Client.infos == 0 and time.monotonic() < deadline:  # asked in the background, unprompted
        time.sleep(0.01)
    assert _Client.infos == 1, "docker info was not asked ahead"
    second = factory()
    assert not first.gpus_available() and second.native_platform() == platforms.native("x86_64")
    assert _Client.infos == 1
    # negotiated by the first engine only; the rest (the second, the info thread's) were given it
    assert clients.count(None) == 1 and clients[0] is None and set(clients[1:]) == {"1.41"}
    engines.docker_factory()().gpus_available()  # another run's factory asks again
    assert _Client.infos == 2


def test_each_run_negotiates_its_api_version_and_keeps_none_on_disk(clients, tmp_path, monkeypatch):
    """No API version is kept between runs (a cache that saved one GET /version): every run's
    first engine negotiates, and nothing is written to the cache folder."""
    from imagefactory.engine import select as engines

    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "cache"))
    engines.docker_factory()()
    assert clients[0] is None  # the first run negotiates ...
    clients.clear()
    _Client.server = "1.47"  # ... and the next one too, whatever the engine now speaks
    made = engines.docker_factory()()
    assert clients[0] is None and made.client.api.api_version == "1.47"
    assert not (tmp_path / "cache").exists()


def test_a_failed_background_docker_info_is_asked_again_by_the_engine(clients):
    from imagefactory.engine import select as engines

    _Client.info_fails = 1  # the background question fails; the engine's own answers
    assert not engines.docker_factory()().gpus_available()
    assert _Client.infos == 2


# --------------------------------------------------------------------------- a push's digest
class _PushClient:
    """A docker.DockerClient whose push streams `events` (what each image store sends)."""

    def __init__(self, events: list[dict]):
        self.events = events
        self.api = type("Api", (), {"hooks": {"response": []}, "push": self._push})()

    def _push(self, repo, tag=None, stream=True, decode=True, auth_config=None):
        return iter(self.events)

    def ping(self) -> bool:
        return True


DIGEST = "sha256:" + "5" * 64
LAYERS = [{"status": "Pushed", "progressDetail": {}, "id": "aaaaaaaaaaaa"},
          {"status": "Layer already exists", "progressDetail": {}, "id": "bbbbbbbbbbbb"}]


@pytest.mark.parametrize("events", [
    # the graph-driver store: the digest in an aux event, after the status line
    [*LAYERS, {"status": f"v1: digest: {DIGEST} size: 3048"}, {"aux": {"Tag": "v1", "Digest": DIGEST, "Size": 3048}}],
    # the containerd image store: the status line only
    [*LAYERS, {"status": f"v1: digest: {DIGEST} size: 3048"}],
], ids=["graph-driver", "containerd"])
def test_a_push_gives_its_digest_in_either_image_store(events):
    from imagefactory.engine.docker import Engine

    outcome = Engine(_PushClient(events)).push("127.0.0.1:5001/ml/train:v1")
    assert (outcome.digest, outcome.layers_pushed, outcome.layers_existing) == (
        DIGEST, ["aaaaaaaaaaaa"], ["bbbbbbbbbbbb"])


@pytest.mark.parametrize("line", [f"v2: digest: {DIGEST} size: 3048", f"v1: digest: {DIGEST[:-1]} size: 3048",
                                  f"v1: digest: {DIGEST} size: 3048 extra", f"x v1: digest: {DIGEST} size: 1"])
def test_a_status_line_that_names_no_digest_of_this_tag_is_not_taken(line):
    from imagefactory.engine.docker import Engine
    from imagefactory.errors import PushError

    with pytest.raises(PushError, match="ended without a digest"):
        Engine(_PushClient([*LAYERS, {"status": line}])).push("127.0.0.1:5001/ml/train:v1")
