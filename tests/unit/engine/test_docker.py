"""podman's Docker API (`podman system service`): what the engine tells of it and what follows.
The real podman is driven by tests/integration/test_podman.py; here the rules, each able to fail.
"""

from __future__ import annotations

import time
from typing import Any

import docker.errors
import pytest

from imagefactory.probe import checks
from imagefactory.probe import smoke
from imagefactory.engine.api import DOCKER, PODMAN, Manifest
from imagefactory.errors import ConfigError, RegistryError
from tests.unit.helpers import CPU_OPENBLAS, good_probe

DIGEST = "sha256:" + "a" * 64
PODMAN_VERSION = {"Version": "4.3.1", "Components": [{"Name": "Podman Engine"}, {"Name": "Conmon"}]}
DOCKER_VERSION = {"Version": "26.1.5", "Components": [{"Name": "Engine"}, {"Name": "containerd"}]}


class _Api:
    def __init__(self, distribution: Any):
        self.distribution = distribution
        self.hooks: dict[str, list] = {"response": []}

    def inspect_distribution(self, ref: str, auth_config: Any = None) -> dict:
        if isinstance(self.distribution, BaseException):
            raise self.distribution
        return self.distribution


class _Client:
    """The parts of a docker.DockerClient these rules use: ping, version, the distribution API."""

    def __init__(self, version: dict, distribution: Any = None):
        self.answer, self.versions = version, 0
        self.api = _Api(distribution if distribution is not None else docker.errors.NotFound("404 page not found"))

    def ping(self) -> bool:
        return True

    def version(self) -> dict:
        self.versions += 1
        return self.answer


def _engine(version: dict, distribution: Any = None, shared: dict | None = None):
    from imagefactory.engine.docker import Engine

    return Engine(_Client(version, distribution), shared=shared)


def test_the_engine_tells_podman_from_docker_once_a_run():
    shared: dict = {}
    podman = _engine(PODMAN_VERSION, shared=shared)
    assert podman.product() == PODMAN and podman.product() == PODMAN
    assert podman.client.versions == 1
    assert _engine(DOCKER_VERSION, shared=shared).product() == PODMAN  # one run's engines share the answer
    assert _engine(DOCKER_VERSION).product() == DOCKER
    assert _engine({"Components": "Podman Engine"}).product() == DOCKER  # an odd answer is not podman


def test_a_base_digest_comes_from_the_registry_when_the_engine_has_no_distribution_api(monkeypatch):
    """podman 4.3 answers GET /distribution with 404: the registry's HTTP API is asked instead
    (on podman only: Docker's engine answers it, and its silence means the registry's)."""
    from imagefactory.engine.registry import HttpRegistry

    asked: list[str] = []

    def served(self, ref: str, *, auth_config=None) -> Manifest | None:
        asked.append(ref)
        return Manifest("application/vnd.oci.image.index.v1+json", DIGEST, b"{}")

    monkeypatch.setattr(HttpRegistry, "manifest", served)
    ref = "127.0.0.1:5000/library/python:3.11-slim-bookworm"
    assert _engine(PODMAN_VERSION).registry_digest(ref) == DIGEST and asked == [ref]
    # an engine that answers is believed, and the registry not asked
    other = "sha256:" + "b" * 64
    assert _engine(DOCKER_VERSION, {"Descriptor": {"digest": other}}).registry_digest(ref) == other and asked == [ref]
    # an engine answer that is not a digest is not taken
    assert _engine(DOCKER_VERSION, {"Descriptor": {"digest": "sha256:x"}}).registry_digest(ref) is None
    # Docker's engine that cannot say (a missing tag, a registry it cannot reach) is believed: no second ask
    assert _engine(DOCKER_VERSION).registry_digest(ref) is None and asked == [ref]


def test_a_registry_that_has_nothing_or_refuses_gives_no_digest(monkeypatch):
    from imagefactory.engine.registry import HttpRegistry

    monkeypatch.setattr(HttpRegistry, "manifest", lambda self, ref, auth_config=None: None)
    assert _engine(PODMAN_VERSION).registry_digest("127.0.0.1:5000/x:1") is None

    def refuses(self, ref, auth_config=None):
        raise RegistryError("401 unauthorized", transient=False)

    monkeypatch.setattr(HttpRegistry, "manifest", refuses)
    assert _engine(PODMAN_VERSION).registry_digest("127.0.0.1:5000/x:1") is None


def test_buildkit_through_podman_is_refused_naming_the_engine(monkeypatch):
    """Made as a run makes it (its own client, connected through _connect): refused at once."""
    from concurrent.futures import Future

    from imagefactory.engine import buildkit
    from imagefactory.engine import docker as engine_mod

    answered: Future = Future()
    answered.set_result({"Architecture": "x86_64"})
    monkeypatch.setattr(engine_mod, "_ask_info", lambda timeout, version: answered)
    monkeypatch.setenv("DOCKER_HOST", "unix:///run/podman/podman.sock")
    for version, refused in ((PODMAN_VERSION, True), (DOCKER_VERSION, False)):
        def connect(timeout, shared, version=version):
            shared["api_version"] = "1.41"
            return _Client(version)

        monkeypatch.setattr(engine_mod, "_connect", connect)
        if not refused:
            assert engine_mod.Engine(builder=buildkit.BuildxBuilder()).product() == DOCKER
            continue
        with pytest.raises(ConfigError) as e:
            engine_mod.Engine(builder=buildkit.BuildxBuilder())
        assert "podman" in e.value.message and "unix:///run/podman/podman.sock" in e.value.message
        assert "--builder classic" in e.value.message and "\n" not in e.value.message


def _probe(name: Any) -> dict:
    probe = good_probe(CPU_OPENBLAS)
    probe["user"].update(uid=smoke.HPC_UID, gid=smoke.HPC_UID, name=name)
    probe["launch"].update(root_read_only=True, tmp_writable=True, tmp_noexec=False, home_writable=False)
    probe["cpus"]["affinity"] = 1
    return probe


def test_the_hpc_mode_expects_the_user_name_each_engine_gives_an_arbitrary_uid():
    hpc = smoke.MODES["hpc"]
    assert hpc.expect(DOCKER)["user name"] is None and hpc.expect(PODMAN)["user name"] == "4242"
    on = {product: checks.launch_conditions(hpc.expect(product), _probe(name))
          for product, name in ((DOCKER, None), (PODMAN, "4242"))}
    assert all(c.verdict == checks.PASS for c in on.values()), on
    # each engine's own: a passwd entry under Docker, or none under podman, is not the launch asked for
    assert checks.launch_conditions(hpc.expect(DOCKER), _probe("4242")).verdict == checks.FAIL
    assert checks.launch_conditions(hpc.expect(PODMAN), _probe(None)).verdict == checks.FAIL


# --------------------------------------------------------------------------- one run's engines
class _SdkClient:
    """What Engine asks of a docker.DockerClient here: ping (its answer's Api-Version header
    seen by the session's response hooks), the negotiated version, docker info, close."""

    server = "1.41"  # the engine's API version: what negotiating gives and its ping names
    refuses: str | None = None  # a version whose ping the engine answers with an APIError
    infos = 0
    info_fails = 0  # how many `docker info` calls fail before one answers

    def __init__(self, version: str | None):
        self.api = type("Api", (), {"api_version": version or _SdkClient.server, "hooks": {"response": []}})()

    def ping(self) -> bool:
        import docker.errors

        if self.api.api_version == _SdkClient.refuses:
            raise docker.errors.APIError("client version is too new")
        answer = type("Response", (), {"headers": {"Api-Version": _SdkClient.server}})()
        for hook in self.api.hooks["response"]:
            hook(answer)
        return True

    def info(self) -> dict:
        _SdkClient.infos += 1
        if _SdkClient.info_fails:
            _SdkClient.info_fails -= 1
            raise OSError("the engine hung up")
        return {"Architecture": "x86_64", "Runtimes": {"runc": {}}}

    def close(self) -> None:
        pass


@pytest.fixture
def clients(monkeypatch) -> list[str | None]:
    """docker.from_env stood in by _SdkClient; the versions asked of it, in order."""
    import docker

    asked: list[str | None] = []

    def from_env(timeout: int, version: str | None = None) -> _SdkClient:
        asked.append(version)
        return _SdkClient(version)

    monkeypatch.setattr(docker, "from_env", from_env)
    monkeypatch.setattr(_SdkClient, "server", "1.41")
    monkeypatch.setattr(_SdkClient, "refuses", None)
    monkeypatch.setattr(_SdkClient, "infos", 0)
    monkeypatch.setattr(_SdkClient, "info_fails", 0)
    return asked


def test_the_engines_of_one_factory_negotiate_once_and_ask_docker_info_once(clients):
    """A run makes one engine per worker: the second takes the first's API version (no second
    negotiation round trip) and its `docker info` (runtimes, architecture) instead of asking again."""
    from imagefactory.engine import select
    from imagefactory.config import platforms

    factory = select.docker_factory()
    first = factory()
    deadline = time.monotonic() + 10
    while _SdkClient.infos == 0 and time.monotonic() < deadline:  # asked in the background, unprompted
        time.sleep(0.01)
    assert _SdkClient.infos == 1, "docker info was not asked ahead"
    second = factory()
    assert not first.gpus_available() and second.native_platform() == platforms.native("x86_64")
    assert _SdkClient.infos == 1
    # negotiated by the first engine only; the rest (the second, the info thread's) were given it
    assert clients.count(None) == 1 and clients[0] is None and set(clients[1:]) == {"1.41"}
    select.docker_factory()().gpus_available()  # another run's factory asks again
    assert _SdkClient.infos == 2


def test_each_run_negotiates_its_api_version_and_keeps_none_on_disk(clients, tmp_path, monkeypatch):
    """No API version is kept between runs (a cache that saved one GET /version): every run's
    first engine negotiates, and nothing is written to the cache folder."""
    from imagefactory.engine import select

    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "cache"))
    select.docker_factory()()
    assert clients[0] is None  # the first run negotiates ...
    clients.clear()
    _SdkClient.server = "1.47"  # ... and the next one too, whatever the engine now speaks
    made = select.docker_factory()()
    assert clients[0] is None and made.client.api.api_version == "1.47"
    assert not (tmp_path / "cache").exists()


def test_a_failed_background_docker_info_is_asked_again_by_the_engine(clients):
    from imagefactory.engine import select

    _SdkClient.info_fails = 1  # the background question fails; the engine's own answers
    assert not select.docker_factory()().gpus_available()
    assert _SdkClient.infos == 2


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
