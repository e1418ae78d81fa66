"""engine/registry.py against a stand-in transport (registry._send): what a registry may not
make it believe (a manifest asked for by digest answered with other bytes, one stored under
another digest), where it asks (Docker Hub's API and library/ path), how a 401 is answered, and
which failures are worth a retry.

The same client against a real loopback HTTP server (bounded bodies, hostile challenges and
tokens) is in test_publish_lists.py.
"""

from __future__ import annotations

import hashlib

import pytest

from imagefactory.engine import registry
from imagefactory.engine.api import DOCKER_MANIFEST, Manifest
from imagefactory.errors import RegistryError

DOCKER = DOCKER_MANIFEST
REPO = "127.0.0.1:5000/ml/train"
API = "http://127.0.0.1:5000/v2/ml/train/manifests/"
BODY = b'{"schemaVersion": 2, "config": {"digest": "sha256:' + b"a" * 64 + b'"}}'
OTHER = b'{"schemaVersion": 2, "config": {"digest": "sha256:' + b"b" * 64 + b'"}}'


def digest_of(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


class Transport:
    """Answers by (method, URL); records every request as (method, URL, headers, Basic login)."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], registry.Reply] = {}
        self.sent: list[tuple[str, str, dict[str, str], tuple[str, str] | None]] = []

    def __call__(self, method, url, headers, data, basic) -> registry.Reply:
        self.sent.append((method, url, dict(headers), basic))
        return self.answers.get((method, url), registry.Reply(404))

    def serve(self, url: str, body: bytes, *, named: str | None = "own", media_type: str = DOCKER) -> None:
        headers = {"Content-Type": media_type}
        if named is not None:
            headers["Docker-Content-Digest"] = digest_of(body) if named == "own" else named
        self.answers[("GET", url)] = registry.Reply(200, headers, body)


@pytest.fixture
def transport(monkeypatch):
    t = Transport()
    monkeypatch.setattr(registry, "_send", t)
    return t


def test_a_manifest_asked_for_by_digest_is_its_bytes(transport):
    digest = digest_of(BODY)
    transport.serve(API + digest, BODY)
    got = registry.get_manifest(f"{REPO}@{digest}", None)
    assert got == Manifest(DOCKER, digest, BODY)


@pytest.mark.parametrize("named", ["own", None], ids=["naming-their-digest", "naming-none"])
def test_a_manifest_asked_for_by_digest_and_served_as_other_bytes_is_refused(transport, named):
    """The registry answers for A with B's bytes, and says (or lets it be computed) they are B:
    consistent in themselves, and still not what was asked for."""
    digest = digest_of(BODY)
    transport.serve(API + digest, OTHER, named=named)
    with pytest.raises(RegistryError) as e:
        registry.get_manifest(f"{REPO}@{digest}", None)
    assert not e.value.transient, e.value.message
    said = f", named '{digest_of(OTHER)}'" if named else ""
    assert e.value.message == (f"reading {REPO}@{digest}: the registry served other bytes (their sha256 is "
                               f"{digest_of(OTHER)}{said})"), e.value.message


def test_a_manifest_whose_named_digest_is_not_its_bytes_is_refused(transport):
    digest = digest_of(BODY)
    transport.serve(API + digest, BODY, named=digest_of(OTHER))
    with pytest.raises(RegistryError, match=f"names digest '{digest_of(OTHER)}'"):
        registry.get_manifest(f"{REPO}@{digest}", None)
    transport.serve(API + "1", BODY, named="sha256:" + "0" * 64)
    with pytest.raises(RegistryError, match="names digest 'sha256:0000"):
        registry.get_manifest(f"{REPO}:1", None)


def test_a_tag_is_whatever_bytes_the_registry_serves_with_their_digest(transport):
    transport.serve(API + "1", OTHER, named=None)
    got = registry.get_manifest(f"{REPO}:1", None)
    assert got is not None and got.digest == digest_of(OTHER)


def test_docker_hub_is_asked_at_its_api_host_under_library(transport):
    assert registry.get_manifest("python:3.11", None) is None
    assert registry.get_manifest("docker.io/pytorch/pytorch", None) is None
    assert [url for _, url, _, _ in transport.sent] == [
        "https://registry-1.docker.io/v2/library/python/manifests/3.11",
        "https://registry-1.docker.io/v2/pytorch/pytorch/manifests/latest"]


def test_a_basic_challenge_is_answered_once_with_the_registrys_login_and_never_without_one(transport):
    transport.answers[("GET", API + "1")] = registry.Reply(401, {"WWW-Authenticate": 'Basic realm="r"'})
    with pytest.raises(RegistryError, match="HTTP 401"):
        registry.get_manifest(f"{REPO}:1", {"username": "u", "password": "p"})
    assert [basic for _, _, _, basic in transport.sent] == [None, ("u", "p")]
    transport.sent.clear()
    with pytest.raises(RegistryError, match="HTTP 401"):
        registry.get_manifest(f"{REPO}:1", None)
    assert len(transport.sent) == 1


@pytest.mark.parametrize("status, transient", [(500, True), (503, True), (429, True), (403, False), (400, False)])
def test_only_a_server_error_or_a_rate_limit_is_worth_a_retry(transport, status, transient):
    transport.answers[("GET", API + "1")] = registry.Reply(status, {}, b'{"errors": [{"code": "TOOMANYREQUESTS"}]}')
    with pytest.raises(RegistryError) as e:
        registry.get_manifest(f"{REPO}:1", None)
    assert e.value.transient is transient and f"HTTP {status} TOOMANYREQUESTS" in e.value.message


def test_a_transport_failure_is_a_transient_registry_error(monkeypatch):
    def down(*args):
        raise ConnectionError("refused")
    monkeypatch.setattr(registry, "_send", down)
    with pytest.raises(RegistryError) as e:
        registry.get_manifest(f"{REPO}:1", None)
    assert e.value.transient and e.value.message.endswith("did not answer (ConnectionError)")


def test_a_put_stored_under_another_digest_is_refused(transport):
    manifest = Manifest(DOCKER, digest_of(BODY), BODY)
    transport.answers[("PUT", API + "1")] = registry.Reply(201, {"Docker-Content-Digest": digest_of(BODY)})
    assert registry.put_manifest(f"{REPO}:1", manifest, None) == digest_of(BODY)
    transport.answers[("PUT", API + "1")] = registry.Reply(201, {"Docker-Content-Digest": digest_of(OTHER)})
    with pytest.raises(RegistryError, match=f"stored it as '{digest_of(OTHER)}', not {digest_of(BODY)}"):
        registry.put_manifest(f"{REPO}:1", manifest, None)


def test_a_put_of_no_manifest_is_refused_before_anything_is_sent(transport):
    with pytest.raises(RegistryError, match="not a manifest to put"):
        registry.put_manifest(f"{REPO}:1", Manifest("text/html", digest_of(BODY), BODY), None)
    big = b" " * (registry.MAX_BYTES + 1)
    with pytest.raises(RegistryError, match="not a manifest to put"):
        registry.put_manifest(f"{REPO}:1", Manifest(DOCKER, digest_of(big), big), None)
    assert transport.sent == []
