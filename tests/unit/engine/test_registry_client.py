"""The registry's HTTP API as a client of its own (engine.registry.HttpRegistry), beside the engine:
which credentials each call carries, the interrupt, and the one world the two fakes share."""

from __future__ import annotations

import pytest

from imagefactory.engine import registry as registry_mod
from imagefactory.engine.api import OCI_INDEX, Manifest
from imagefactory.engine.registry import HttpRegistry
from imagefactory.errors import Cancelled
from imagefactory.interrupt import Interrupt
from tests.fake_engine import Image, World

DIGEST = "sha256:" + "a" * 64
LOGIN = {"username": "config-user", "password": "config-secret"}
GIVEN = {"username": "flag-user", "password": "flag-secret"}


@pytest.fixture
def http(monkeypatch) -> list[tuple]:
    """registry.get_manifest / put_manifest stood in: what each was asked, with which credentials."""
    asked: list[tuple] = []

    def get(ref, auth):
        asked.append(("get", ref, auth))
        return Manifest(OCI_INDEX, DIGEST, b"{}")

    def put(ref, manifest, auth):
        asked.append(("put", ref, auth))
        return manifest.digest

    monkeypatch.setattr(registry_mod, "get_manifest", get)
    monkeypatch.setattr(registry_mod, "put_manifest", put)
    return asked


def test_a_call_without_credentials_gets_the_login_and_given_ones_win(http):
    logins: list[str] = []
    client = HttpRegistry(Interrupt(), lambda ref: logins.append(ref) or LOGIN)
    assert client.manifest("r.example/a:1").digest == DIGEST
    assert client.put_manifest("r.example/a:2", Manifest(OCI_INDEX, DIGEST, b"{}"),
                               auth_config=GIVEN) == DIGEST
    assert http == [("get", "r.example/a:1", LOGIN), ("put", "r.example/a:2", GIVEN)]
    assert logins == ["r.example/a:1"]  # the login is asked only where no credentials were given


def test_without_a_login_nothing_is_sent(http):
    HttpRegistry(Interrupt()).manifest("r.example/a:1")
    assert http == [("get", "r.example/a:1", None)]


def test_an_interrupted_run_asks_the_registry_nothing(http):
    interrupt = Interrupt()
    interrupt.cancel()
    client = HttpRegistry(interrupt, lambda ref: LOGIN)
    with pytest.raises(Cancelled):
        client.manifest("r.example/a:1")
    with pytest.raises(Cancelled):
        client.put_manifest("r.example/a:1", Manifest(OCI_INDEX, DIGEST, b"{}"))
    assert http == []


def test_the_docker_engine_goes_with_a_registry_client_of_its_config_logins(http):
    from imagefactory.engine.docker import Engine

    class _Auths:
        def resolve_authconfig(self, registry):
            return {"username": "u", "password": "p"} if registry == "r.example" else None

    class _Client:
        api = type("Api", (), {"hooks": {"response": []}, "_auth_configs": _Auths()})()

        def ping(self) -> bool:
            return True

    engine = Engine(_Client())  # type: ignore[arg-type]
    assert isinstance(engine.registry, HttpRegistry) and not hasattr(engine, "registry_manifest")
    engine.registry.manifest("r.example/a:1")
    engine.registry.manifest("other.example/a:1")
    assert http == [("get", "r.example/a:1", {"username": "u", "password": "p"}), ("get", "other.example/a:1", None)]
    given = HttpRegistry(Interrupt())
    assert Engine(_Client(), registry=given).registry is given  # type: ignore[arg-type]


def test_the_fake_engine_and_the_fake_registry_share_one_world():
    """What a fake engine pushes, the fake registry serves; what the registry is PUT, the engine's
    GET /distribution answers."""
    world = World()
    world.images["img1"] = Image("img1", {}, {"r.example/a:1"}, "cell")
    engine = world.engine()
    pushed = engine.push("r.example/a:1")
    served = engine.registry.manifest("r.example/a:1")
    assert served is not None and served.digest == pushed.digest
    index = Manifest(OCI_INDEX, DIGEST, b"{}")
    assert world.engine().registry.put_manifest("r.example/a:list", index) == DIGEST
    assert engine.registry_digest("r.example/a:list") == DIGEST
    assert world.ops("registry_manifest") == ["r.example/a:1"] and world.ops("put_manifest") == ["r.example/a:list"]
