"""podman's Docker API (`podman system service`): what the engine tells of it and what follows.
The real podman is driven by tests/integration/test_podman.py; here the rules, each able to fail.
"""

from __future__ import annotations

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
