"""verify.py without cosign or a registry: which image every check is made on (the digest the tag
resolved to first, never the tag again), and what it reads of the registry (each manifest and the
config by digest, their bytes checked, any JSON shape survived).

What verify says for attestations that describe another image is in test_signing.py; the real
cosign and registry in tests/integration/test_signing.py.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from imagefactory.engine import registry as registry_mod
from imagefactory.engine.registry import Reply
from imagefactory.attest import signing
from imagefactory.attest import verify

REPO = "127.0.0.1:5001/ml/train"
CONTENT = "c" * 64
KEY = signing.Key("/k.pub", False)


def digest_of(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


class Registry:
    """A registry as verify asks it (through engine/registry.py's `request`): tags that can be re-pushed, manifests and blobs
    by digest (or, for the hostile cases, other bytes under a digest), and what was asked."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.objects: dict[str, bytes] = {}  # digest -> the bytes served under it
        self.asked: list[tuple[str, str]] = []
        self.on_head = lambda: None  # runs after each HEAD of a tag: a push between the checks

    def put(self, body: bytes) -> str:
        self.objects[digest_of(body)] = body
        return digest_of(body)

    def image(self, labels: dict[str, str]) -> str:
        """An image manifest whose config carries `labels`; its digest."""
        config = self.put(json.dumps({"config": {"Labels": labels}}).encode())
        return self.put(json.dumps({"schemaVersion": 2, "config": {"digest": config}}).encode())

    def get(self, url: str, auth, accept: str = "", method: str = "GET") -> Reply:
        self.asked.append((method, url))
        prefix = f"http://{REPO.split('/', 1)[0]}/v2/ml/train/"
        assert url.startswith(prefix), url
        kind, _, name = url[len(prefix):].partition("/")
        if kind == "manifests" and name in self.tags and method == "HEAD":
            digest = self.tags[name]
            self.on_head()
            return Reply(200, {"Docker-Content-Digest": digest})
        body = self.objects.get(name)
        return Reply(404) if body is None else Reply(200, {}, body)


@pytest.fixture
def registry(monkeypatch):
    reg = Registry()
    monkeypatch.setattr(registry_mod, "request", lambda method, url, auth, accept="": reg.get(url, auth, accept, method))
    return reg


class Cosign:
    """cosign as verify asks it: signatures and attestations exist per digest; a reference by tag
    is resolved as cosign resolves it, at the moment it is asked (the registry's tag now)."""

    def __init__(self, reg: Registry, monkeypatch) -> None:
        self.reg, self.signed, self.refs = reg, set(), []
        monkeypatch.setattr(signing, "verify_signature", self.verify_signature)
        monkeypatch.setattr(signing, "verified_statements", self.verified_statements)

    def _digest(self, ref: str) -> str:
        self.refs.append(ref)
        return ref.split("@", 1)[1] if "@" in ref else self.reg.tags[ref.rsplit(":", 1)[1]]

    def verify_signature(self, key, ref: str, auth) -> None:
        if self._digest(ref) not in self.signed:
            raise signing.Refused("signature", "no signature")

    def verified_statements(self, key, ref: str, kind: str, auth) -> list[dict]:
        digest = self._digest(ref)
        if digest not in self.signed:
            raise signing.Refused("attestation", f"no {kind} attestation verifies with key {key.shown}")
        return []


@pytest.fixture
def cosign(registry, monkeypatch):
    return Cosign(registry, monkeypatch)


def test_a_tag_re_pushed_between_the_checks_is_judged_at_the_digest_it_resolved_to_first(registry, cosign):
    """The tag names the unsigned image A when verify resolves it, then a signed image B is pushed
    under it: the signature is checked on A (by digest), so A is not verified by B's signature."""
    unsigned = registry.image({"io.imagefactory.content-hash": CONTENT})
    signed = registry.image({"io.imagefactory.content-hash": "d" * 64})
    cosign.signed.add(signed)
    registry.tags["1"] = unsigned

    def push():
        registry.tags["1"] = signed
    registry.on_head = push
    v = verify.verify_ref(f"{REPO}:1", KEY, None)
    assert not v.ok and v.digest == unsigned and v.kind == "signature", v
    assert v.line == f"{REPO}:1: FAILED: no signature"
    assert cosign.refs == [f"{REPO}@{unsigned}"]


def test_every_check_of_an_image_is_made_on_its_digest(registry, cosign, monkeypatch):
    image = registry.image({"io.imagefactory.content-hash": CONTENT})
    registry.tags["1"] = image
    cosign.signed.add(image)
    monkeypatch.setattr(verify, "_sbom_matches", lambda predicate, content, config, manifest="": 0)
    v = verify.verify_ref(f"{REPO}:1", KEY, None)
    assert v.ok and v.digest == image, v
    assert cosign.refs == [f"{REPO}@{image}"] * (1 + len(signing.TYPES))  # the signature, each attestation kind
    assert [m for m, _ in registry.asked].count("HEAD") == 1  # the tag is resolved once


def test_a_manifest_or_config_served_with_other_bytes_than_its_digest_is_refused(registry):
    image = registry.image({"io.imagefactory.content-hash": CONTENT})
    config = json.loads(registry.objects[image])["config"]["digest"]
    assert verify.image_config(f"{REPO}@{image}", None) == (config, {"io.imagefactory.content-hash": CONTENT})
    good = registry.objects[config]
    registry.objects[config] = json.dumps({"config": {"Labels": {"io.imagefactory.content-hash": "e" * 64}}}).encode()
    with pytest.raises(signing.Refused) as e:
        verify.image_config(f"{REPO}@{image}", None)
    assert e.value.kind == "registry" and f"other bytes for {config}" in e.value.message
    registry.objects[config] = good
    other = registry.image({"io.imagefactory.content-hash": "e" * 64})
    registry.objects[image] = registry.objects[other]  # the registry answers for A with B's manifest
    with pytest.raises(signing.Refused, match=f"other bytes for {image} \\(their digest is {other}\\)"):
        verify.image_config(f"{REPO}@{image}", None)


def test_an_index_is_read_for_its_amd64_image_by_digest(registry):
    amd = registry.image({"io.imagefactory.content-hash": CONTENT})
    arm = registry.image({"io.imagefactory.content-hash": "e" * 64})
    index = registry.put(json.dumps({"schemaVersion": 2, "manifests": [
        {"digest": arm, "platform": {"architecture": "arm64", "os": "linux"}},
        {"digest": amd, "platform": {"architecture": "amd64", "os": "linux"}}]}).encode())
    assert verify.image_config(f"{REPO}@{index}", None)[1] == {"io.imagefactory.content-hash": CONTENT}
    registry.objects[amd] = registry.objects[arm]
    with pytest.raises(signing.Refused, match=f"other bytes for {amd}"):
        verify.image_config(f"{REPO}@{index}", None)


@pytest.mark.parametrize("manifest", [
    b"[]", b'"text"', b'{"manifests": "x"}', b'{"manifests": [1, null, {"platform": "amd64"}]}',
    b'{"config": "sha256:x"}', b'{"config": {"digest": 7}}', b'{"config": {"digest": "sha256:' + b"0" * 64 + b'"}}'])
def test_a_manifest_of_any_other_shape_is_a_registry_failure(registry, manifest):
    digest = registry.put(manifest)
    with pytest.raises(signing.Refused) as e:
        verify.image_config(f"{REPO}@{digest}", None)
    assert e.value.kind == "registry"


@pytest.mark.parametrize("config", [b"[]", b'{"config": []}', b'{"config": {"Labels": ["a=b"]}}', b'{"config": null}'])
def test_a_config_of_another_shape_has_no_labels(registry, config):
    blob = registry.put(config)
    image = registry.put(json.dumps({"config": {"digest": blob}}).encode())
    assert verify.image_config(f"{REPO}@{image}", None) == (blob, {})


@pytest.mark.parametrize("header", ["", "sha256:abc", "sha256:" + "A" * 64, "md5:" + "0" * 32, "sha256:" + "0" * 64 + "\n"])
def test_a_tag_the_registry_names_no_well_formed_digest_for_is_not_served(registry, cosign, header):
    registry.tags["1"] = header
    v = verify.verify_ref(f"{REPO}:1", KEY, None)
    assert not v.ok and v.kind == "registry" and v.line == f"{REPO}:1: FAILED: the registry does not serve it"
    assert cosign.refs == []  # nothing was asked of cosign


def test_a_registry_without_the_tag_or_unreachable_is_one_line(registry, cosign, monkeypatch):
    v = verify.verify_ref(f"{REPO}:absent", KEY, None)
    assert not v.ok and v.line.endswith("FAILED: the registry does not serve it")

    def down(*args, **kwargs):
        raise ConnectionError("refused")
    monkeypatch.setattr(registry_mod, "request", down)
    v = verify.verify_ref(f"{REPO}:1", KEY, None)
    assert not v.ok and v.kind == "registry" and v.line == f"{REPO}:1: FAILED: registry unreachable (ConnectionError)"
