"""`imagefactory verify`: may a node trust this image? Checked offline, one line per image.

For each image (a matrix's release tags, or one reference) at the digest the registry serves now:
1. a signature made with `--key` (cosign verify; no transparency log);
2. a CycloneDX attestation and a SLSA provenance attestation, both verified with that key;
3. the SBOM is valid CycloneDX 1.6, and every SBOM and provenance attached names the content
   hash the image's own `io.imagefactory.content-hash` label carries, and the SBOM the image's
   config digest: an SBOM made for another image is refused even when properly signed.

The image's labels come from the registry (manifest and config blob), with the registry's
credentials: IMAGEFACTORY_REGISTRY_USER/PASSWORD for the matrix's own registry (the _<HOST>
pair for one under tags.registries), else the `auths` of the Docker config, else none.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagefactory.attest import provenance
from imagefactory.attest import sbom
from imagefactory.attest import signing
from imagefactory.config import refs
from imagefactory.config.recipe import HASH_LABEL
from imagefactory.config.registries import Registry
from imagefactory.engine import logins
from imagefactory.engine.api import DIGEST_RE, INDEX_TYPES, MANIFEST_TYPES, RegistryClient
from imagefactory.engine.registry import HttpRegistry
from imagefactory.errors import ImageFactoryError
from imagefactory.interrupt import Interrupt

HASH_RE = re.compile(r"[0-9a-f]{64}")
Auth = dict[str, str]


class VerifyFailed(ImageFactoryError):
    """At least one image failed verification (exit 1)."""


@dataclass(frozen=True)
class Verdict:
    ref: str
    ok: bool
    line: str  # what `verify` prints for this image
    digest: str | None = None
    kind: str = ""  # which check failed: registry, signature, key, attestation, sbom

    def as_dict(self) -> dict[str, Any]:
        return {"ref": self.ref, "ok": self.ok, "digest": self.digest, "kind": self.kind, "line": self.line}


# -- the registry: digests and labels, read through its client (engine/registry.py) ---------------

def client() -> RegistryClient:
    """The registry client verify reads with: no run to interrupt it, no login but the one given."""
    return HttpRegistry(Interrupt())


def manifest_digest(ref: str, auth: Auth | None) -> str | None:
    return client().digest(ref, auth_config=auth)


def _by_digest(pinned: str, kind: str, digest: str, auth: Auth | None, accept: str = "") -> bytes | None:
    """The registry's bytes for `digest` (a manifest or a blob of `pinned`'s repository); None when it
    gives none (or too much). Refused when they are not the bytes `digest` names: the labels and
    config judged are then those of the image the signature was checked on, whatever the registry says."""
    body = client().content(pinned, kind, digest, auth_config=auth, accept=accept)
    if body is None:
        return None
    got = "sha256:" + hashlib.sha256(body).hexdigest()
    if got != digest:
        raise signing.Refused("registry", f"the registry serves other bytes for {digest} (their digest is {got})")
    return body


def _object(body: bytes | None) -> dict:
    return _dict(json.loads(body) if body is not None else {})


def _dict(value: Any) -> dict:
    """`value` when it is a mapping, else an empty one: a registry's JSON may be of any shape."""
    return value if isinstance(value, dict) else {}


def image_config(pinned: str, auth: Auth | None) -> tuple[str, dict[str, str]]:
    """(config digest, labels) of the image `pinned` names (an index: its linux/amd64 image), each
    manifest and the config read by digest and checked against its bytes."""
    parsed = refs.parse(pinned)
    assert parsed is not None and parsed.digest is not None
    doc = _object(_by_digest(pinned, "manifests", parsed.digest, auth, ", ".join(MANIFEST_TYPES + INDEX_TYPES)))
    if doc.get("manifests"):  # an index: the platform imagefactory builds
        manifests = doc["manifests"] if isinstance(doc["manifests"], list) else []
        entry: dict = next((m for m in map(_dict, manifests) if _dict(m.get("platform")).get("architecture") == "amd64"),
                           {})
        digest = str(entry.get("digest", ""))
        doc = _object(_by_digest(pinned, "manifests", digest, auth, ", ".join(MANIFEST_TYPES))
                      if DIGEST_RE.fullmatch(digest) else None)
    config = str(_dict(doc.get("config")).get("digest", ""))
    if not DIGEST_RE.fullmatch(config):
        raise signing.Refused("registry", f"the registry gave no image manifest for {parsed.digest}")
    blob = _by_digest(pinned, "blobs", config, auth)
    if blob is None:
        raise signing.Refused("registry", f"the registry gave no image config {config}")
    labels = _dict(_dict(_object(blob).get("config")).get("Labels"))
    return config, {str(k): str(v) for k, v in labels.items()}


# -- credentials -------------------------------------------------------------------------------------

def docker_config_auth(registry: str) -> Auth | None:
    """The `auths` entry of the Docker config for `registry` (credential helpers are cosign's
    business: it reads the config itself when imagefactory gives it none)."""
    folder = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
    try:
        auths = json.loads((folder / "config.json").read_text()).get("auths") or {}
        token = (auths.get(Registry(registry).auth_key) or {}).get("auth", "")
        user, _, password = base64.b64decode(token).decode().partition(":")
    except (OSError, ValueError, AttributeError):
        return None
    return {"username": user, "password": password} if user and password else None


# -- the checks ------------------------------------------------------------------------------------

def _attested(key: signing.Key, pinned: str, auth: Auth | None, content: str, config: str) -> int:
    """Check both attestation kinds against the image; the number of SBOM components."""
    digest = pinned.split("@", 1)[1]
    components = 0
    for kind in signing.TYPES:
        for st in signing.verified_statements(key, pinned, kind, auth):
            subjects = [s.get("digest", {}).get("sha256") for s in st.get("subject") or () if isinstance(s, dict)]
            if f"sha256:{subjects[0] if subjects else ''}" != digest:
                raise signing.Refused("sbom", f"{kind} attestation for another digest ({subjects[:1]})")
            if kind == "cyclonedx":
                components = max(components, _sbom_matches(st["predicate"], content, config, manifest=digest))
            elif provenance.content_hash_of(st["predicate"]) != content:
                raise signing.Refused("sbom", f"provenance for another image (content hash "
                                              f"{str(provenance.content_hash_of(st['predicate']))[:12]}, the image has "
                                              f"{content[:12]})")
    return components


def _sbom_matches(predicate: dict, content: str, config: str, *, manifest: str = "") -> int:
    """The SBOM's components, when it describes this image: its content hash, and its image id,
    which is the engine's id of the image that was probed (identity.py): the config digest in the
    graph-driver store, the image's manifest digest (`manifest`, the digest verified) in the
    containerd store. Either names this one image."""
    try:
        doc = sbom.validate(json.dumps(predicate))
    except sbom.SbomError as e:
        raise signing.Refused("sbom", f"SBOM attestation: {e.message}") from None
    said = sbom.described(doc)
    if said.get("content-hash") != content or said.get("image-id") not in {config, manifest} - {""}:
        raise signing.Refused("sbom", f"SBOM for another image (content hash {said.get('content-hash', '?')[:12]}, "
                                      f"config {said.get('image-id', '?')[:19]}; the image has {content[:12]}, "
                                      f"{config[:19]})")
    return len(doc.get("components") or ())


def verify_ref(ref: str, key: signing.Key, auth: Auth | None) -> Verdict:
    """Every check on one image reference; never raises for a failed check."""
    parsed = refs.parse(ref)
    if parsed is None:
        return Verdict(ref, False, f"{ref[:200]}: FAILED: not an image reference", kind="registry")
    digest = None
    try:
        digest = manifest_digest(ref, auth)
        if digest is None:
            raise signing.Refused("registry", "the registry does not serve it")
        pinned = f"{parsed.repository}@{digest}"
        signing.verify_signature(key, pinned, auth)
        config, labels = image_config(pinned, auth)
        content = labels.get(HASH_LABEL, "")
        if not HASH_RE.fullmatch(content):
            raise signing.Refused("sbom", f"the image has no {HASH_LABEL} label")
        n = _attested(key, pinned, auth, content, config)
    except signing.Refused as e:
        return Verdict(ref, False, f"{ref}: FAILED: {e.message}", digest, e.kind)
    except ImageFactoryError as e:
        return Verdict(ref, False, f"{ref}: FAILED: {e.message}", digest, "cosign")
    except (OSError, ValueError) as e:  # requests' errors are OSErrors; a body that is not JSON
        return Verdict(ref, False, f"{ref}: FAILED: registry unreachable ({type(e).__name__})", digest, "registry")
    return Verdict(ref, True, f"{ref}: verified {digest}: signature, SBOM ({n} components) and provenance "
                              f"for content {content[:12]}", digest)


def verify_refs(targets: list[tuple[str, Auth | None]], key: signing.Key) -> list[Verdict]:
    return [verify_ref(ref, key, auth) for ref, auth in targets]


def matrix_targets(matrix: Any, cells: list[Any]) -> list[tuple[str, Auth | None]]:
    """Each selected cell's release tags, with the credentials of the tag's registry."""

    creds = logins.registry_credentials(matrix)
    out = []
    for cell in cells:
        for tag in cell.tags:
            registry = Registry.of(tag).host
            out.append((tag, creds.get(registry) or docker_config_auth(registry)))
    return out


def one_target(ref: str) -> list[tuple[str, Auth | None]]:

    return [(ref, logins.credentials() or docker_config_auth(Registry.of(ref).host))]
