"""What a pushed image costs a node to pull, read from the registry's manifests (issue 34, item 5).

For each pushed cell: its compressed size, layer count and largest layer, as the registry serves
its manifest (exact: the bytes a pull fetches); for each sibling cell of the run (same platform)
and for the release this push replaced, the bytes a node already holding that image must fetch:
the sizes of this image's layers whose digests the other image lacks, each blob counted once.
A release tag's earlier manifest is gone once the tag moves, so it is read before the push.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from imagefactory.config import refs
from imagefactory.config import registries
from imagefactory.config.registries import ESTARGZ_TOC
from imagefactory.engine.api import DIGEST_RE, INDEX_TYPES, MANIFEST_TYPES, Manifest, RegistryClient
from imagefactory.errors import RegistryError


@dataclass(frozen=True)
class Blob:
    digest: str
    size: int
    media_type: str = ""
    estargz: bool = False  # its descriptor names an eStargz table of contents (ESTARGZ_TOC)


@dataclass(frozen=True)
class Pulled:
    """One image as a registry serves it: its manifest's digest and its layers, base first."""

    digest: str
    layers: tuple[Blob, ...]

    @property
    def total(self) -> int:
        return sum(b.size for b in {b.digest: b for b in self.layers}.values())

    @property
    def largest(self) -> Blob | None:
        return max(self.layers, key=lambda b: b.size, default=None)


def layers_of(manifest: Manifest) -> tuple[Blob, ...]:
    """The layer descriptors of an image manifest; ValueError for anything else (an index, a
    descriptor without a sha256 digest or a non-negative integer size)."""
    if manifest.media_type not in MANIFEST_TYPES:
        raise ValueError(f"not an image manifest ({manifest.media_type[:60]})")
    doc = json.loads(manifest.body)
    found = []
    for d in doc.get("layers") or [] if isinstance(doc, dict) else []:
        size, digest = d.get("size") if isinstance(d, dict) else None, d.get("digest") if isinstance(d, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str) \
                or not DIGEST_RE.fullmatch(digest):
            raise ValueError("a layer descriptor without a sha256 digest and a size")
        toc = (d.get("annotations") or {}).get(ESTARGZ_TOC) if isinstance(d.get("annotations"), dict) else None
        found.append(Blob(digest, size, str(d.get("mediaType", ""))[:100],
                          estargz=isinstance(toc, str) and DIGEST_RE.fullmatch(toc) is not None))
    return tuple(found)


def fetch_bytes(image: Pulled, held: Pulled) -> int:
    """Bytes a node holding `held` must fetch to pull `image`: its blobs `held` lacks, each once."""
    have = {b.digest for b in held.layers}
    return sum(b.size for b in {b.digest: b for b in image.layers if b.digest not in have}.values())


def _platform_child(index: Manifest, platform: str) -> str | None:
    """The digest of `platform`'s image manifest in an index (attestation manifests skipped)."""
    doc = json.loads(index.body)
    for m in doc.get("manifests") or [] if isinstance(doc, dict) else []:
        p = m.get("platform") or {} if isinstance(m, dict) else {}
        if f"{p.get('os')}/{p.get('architecture')}" == platform and isinstance(m.get("digest"), str):
            return str(m["digest"]) if DIGEST_RE.fullmatch(m["digest"]) else None
    return None


def read(registry: RegistryClient, ref: str, platform: str, auth: dict[str, str] | None) -> Pulled | None:
    """The image `ref` names on its registry (an index resolved to `platform`'s manifest); None when
    the registry has none or serves something else. RegistryError passes up."""
    manifest = registry.manifest(ref, auth_config=auth)
    if manifest is not None and manifest.media_type in INDEX_TYPES:
        parsed, child = refs.parse(ref), _platform_child(manifest, platform)
        if parsed is None or child is None:
            return None
        manifest = registry.manifest(f"{parsed.repository}@{child}", auth_config=auth)
    if manifest is None:
        return None
    try:
        return Pulled(manifest.digest, layers_of(manifest))
    except ValueError:
        return None


def read_quietly(registry: RegistryClient, ref: str, platform: str, auth: dict[str, str] | None) -> Pulled | None:
    """`read`, None where the registry will not answer: sizes are a report's, never a push's failure."""
    try:
        return read(registry, ref, platform, auth)
    except RegistryError:
        return None


def record(image: Pulled) -> dict[str, Any]:
    """The report's figures of one pushed image (CellReport.sizes)."""
    largest = image.largest
    kinds = {registries.layer_compression(b.media_type, b.estargz) for b in image.layers}
    return {"digest": image.digest, "compressed": image.total, "layers": len(image.layers),
            "largest_layer": largest.size if largest else 0, "largest_layer_digest": largest.digest if largest else "",
            "compression": "+".join(sorted(kinds)) or "none", "fetch_after": {}}


def with_previous(figures: dict[str, Any], image: Pulled, previous: Pulled | None) -> dict[str, Any]:
    """`figures` with what a node holding the release this push replaced must fetch (when one was there)."""
    if previous is None:
        return figures
    return {**figures, "previous": {"digest": previous.digest, "fetch": fetch_bytes(image, previous)}}


def siblings(pulled: dict[str, tuple[str, Pulled]]) -> dict[str, dict[str, int]]:
    """{cell: {sibling: bytes to fetch}} for the cells pushed in one run (`pulled`: cell -> (platform,
    image)), each against every other of its platform."""
    return {cell: {other: fetch_bytes(image, held) for other, (p, held) in pulled.items()
                   if other != cell and p == platform}
            for cell, (platform, image) in pulled.items()}
