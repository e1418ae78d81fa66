"""The SBOM of an image that passed: CycloneDX 1.6 JSON, validated before it is used.

What it lists, all of it read by the in-image probe in the run that judged the image (its
"packages" and "sbom" sections: no extra container):

- the Python distributions (`pkg:pypi`), with the lock's sha256 where the cell is locked;
- the conda records (`pkg:conda/NAME@VER?build=..&channel=..&subdir=..`), with their sha256;
- the Debian packages of /var/lib/dpkg/status (`pkg:deb/debian/NAME@VER?arch=..`);
- the native libraries the probe saw loaded: each BLAS and OpenMP runtime threadpoolctl found
  (with its version and real path), the CUDA runtime, cuDNN and NCCL with the versions torch
  reports, and MKL when torch carries it statically;
- the base image by digest (`pkg:oci`).

The document describes one image: its metadata component carries the content hash, the image id
(the config digest, which a push keeps) and the cell; `imagefactory verify` compares both with
the image it is attached to. Same image, same bytes: no timestamp, and the serial number is
derived from the document's own content.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from imagefactory import __version__
from imagefactory.files import fsutil
from imagefactory.files.store import Store
from imagefactory.config import refs
from imagefactory.errors import ImageFactoryError
from imagefactory.lock.lockfile import Lock, canonical

SPEC = "1.6"
CONTENT_HASH = "imagefactory:content-hash"
IMAGE_ID = "imagefactory:image-id"
CELL = "imagefactory:cell"
SHA256_RE = re.compile(r"[0-9a-f]{64}")
IMAGE_ID_RE = re.compile(r"sha256:[0-9a-f]{64}")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~:-]{0,213}")
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~:!-]{0,127}")
_PATH_RE = re.compile(r"/[A-Za-z0-9._+/@-]{1,1023}")


class SbomError(ImageFactoryError):
    """No valid SBOM could be made (or read back) for an image."""


@dataclass(frozen=True)
class Subject:
    """The image an SBOM describes."""

    image: str  # the matrix's image: [registry/]namespace/name
    cell: str
    content_hash: str  # sha256 hex
    image_id: str  # sha256:<hex>: the engine's id of the image (identity.py): config digest, or manifest digest
    # in the containerd image store
    base_image: str  # name:tag@sha256:... as built


def _ok(pattern: re.Pattern[str], value: object) -> str | None:
    """A value from inside the image, kept only when it is wholly well-formed."""
    return value if isinstance(value, str) and pattern.fullmatch(value) else None


def _dict(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _lock_hashes(lock: Lock | None, installer: str) -> dict[tuple[str, str], tuple[str, ...]]:
    """The lock's sha256s by (name, version), for the components its installer put there: a conda
    lock's numpy file is not the PyPI numpy distribution that conda's numpy also shows as."""
    if lock is None or lock.installer != installer:
        return {}
    return {(p.name, p.version): p.hashes for p in lock.pins}


def _props(pairs: Iterable[tuple[str, str | None]]) -> list[Any]:
    from cyclonedx.model import Property

    return [Property(name=k, value=v) for k, v in pairs if v]


def _component(kind: str, name: str, version: str, purl: Any, *, hashes: Iterable[str] = (),
               props: Iterable[tuple[str, str | None]] = (), path: str | None = None) -> Any:
    """One component; its bom-ref (what the document's de-duplication keys on) is its purl, else
    kind:name@version, and then the file's `path` where it has one: two builds of one library at
    two places (cuDNN from a wheel and from conda, libgomp and libomp) are two components."""
    from cyclonedx.model import HashAlgorithm, HashType
    from cyclonedx.model.component import Component, ComponentType

    kinds = {"library": ComponentType.LIBRARY, "container": ComponentType.CONTAINER,
             "application": ComponentType.APPLICATION}
    ref = str(purl) if purl is not None else f"{kind}:{name}@{version}" + (f":{path}" if path else "")
    return Component(type=kinds[kind], name=name, version=version, purl=purl, bom_ref=ref,
                     hashes=[HashType(alg=HashAlgorithm.SHA_256, content=h) for h in sorted(set(hashes))],
                     properties=_props(props))


def pip_components(python: object, lock: Lock | None) -> list[Any]:
    from packageurl import PackageURL

    hashes = _lock_hashes(lock, "pip")
    out = []
    for name, version in sorted(python.items()) if isinstance(python, dict) else ():
        name, version = _ok(_NAME_RE, name), _ok(_VERSION_RE, version)
        if name and version:  # a pip lock names each distribution by its canonical name (Jinja2: jinja2)
            purl = PackageURL(type="pypi", name=name.lower(), version=version)
            out.append(_component("library", name, version, purl, hashes=hashes.get((canonical(name), version), ())))
    return out


def conda_components(records: object, lock: Lock | None) -> list[Any]:
    from packageurl import PackageURL

    hashes = _lock_hashes(lock, "conda")
    out = []
    for r in records if isinstance(records, list) else ():
        if not isinstance(r, dict):
            continue
        name, version = _ok(_NAME_RE, r.get("name")), _ok(_VERSION_RE, r.get("version"))
        if not (name and version):
            continue
        qualifiers = {k: v for k in ("build", "channel", "subdir") if (v := _ok(_CONDA_Q_RE, r.get(k)))}
        purl = PackageURL(type="conda", name=name, version=version, qualifiers=qualifiers)
        own = _ok(SHA256_RE, r.get("sha256"))
        found = ([own] if own else []) + list(hashes.get((name, version), ()))
        out.append(_component("library", name, version, purl, hashes=found))
    return out


_CONDA_Q_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+:/-]{0,255}")


def deb_components(packages: object) -> list[Any]:
    from packageurl import PackageURL

    out = []
    for p in packages if isinstance(packages, list) else ():
        if not isinstance(p, dict):
            continue
        name, version, arch = _ok(_NAME_RE, p.get("name")), _ok(_VERSION_RE, p.get("version")), \
            _ok(_NAME_RE, p.get("arch"))
        if name and version:
            purl = PackageURL(type="deb", namespace="debian", name=name, version=version,
                              qualifiers={"arch": arch} if arch else {})
            out.append(_component("library", name, version, purl))
    return out


def native_components(probe: dict) -> list[Any]:
    """The BLAS/OpenMP runtimes threadpoolctl saw (with versions), the CUDA libraries mapped in
    the probe's process (versions from torch), and MKL when torch links it statically."""
    out = []
    for e in _list(probe.get("threadpool_info")):
        if not isinstance(e, dict):
            continue
        api, path = _ok(_NAME_RE, e.get("internal_api")), _ok(_PATH_RE, e.get("filepath"))
        version = _ok(_VERSION_RE, e.get("version")) or "unknown"
        if api and path:
            out.append(_component("library", api, version, None, path=path, props=[
                ("imagefactory:path", path), ("imagefactory:user-api", _ok(_NAME_RE, e.get("user_api"))),
                ("imagefactory:loaded", "true")]))
    section = _dict(probe.get("sbom"))
    libs, versions = _dict(section.get("libraries")), _dict(section.get("versions"))
    for kind in ("cudart", "cudnn", "nccl", "cublas"):
        version = _ok(_VERSION_RE, versions.get({"cudart": "cuda", "cublas": "cuda"}.get(kind, kind))) or "unknown"
        for path in _list(libs.get(kind)):
            if _ok(_PATH_RE, path):
                out.append(_component("library", kind, version, None, path=path,
                                      props=[("imagefactory:path", path), ("imagefactory:loaded", "true")]))
    torch = _dict(probe.get("torch"))
    if torch.get("mkl_available") is True and torch.get("blas_info") == "mkl":
        out.append(_component("library", "mkl", "unknown", None,
                              props=[("imagefactory:linked", "statically, into libtorch (BLAS_INFO=mkl)")]))
    return out


def base_component(base_image: str) -> Any:
    from packageurl import PackageURL

    parsed = refs.parse(base_image)
    if parsed is None or parsed.digest is None:
        raise SbomError(f"base image {base_image[:200]!r}: not pinned by digest")
    name = parsed.path.rsplit("/", 1)[-1]
    qualifiers = {"repository_url": f"{parsed.registry}/{parsed.path}"}
    if parsed.tag:
        qualifiers["tag"] = parsed.tag
    purl = PackageURL(type="oci", name=name, version=parsed.digest, qualifiers=qualifiers)
    return _component("container", f"{parsed.registry}/{parsed.path}", parsed.digest, purl,
                      props=[("imagefactory:role", "base image")])


def _root(subject: Subject) -> Any:
    from cyclonedx.model.component import Component, ComponentType

    return Component(type=ComponentType.CONTAINER, name=subject.image, version=subject.content_hash,
                     bom_ref=f"image:{subject.image_id}",
                     properties=_props([(CONTENT_HASH, subject.content_hash), (IMAGE_ID, subject.image_id),
                                        (CELL, subject.cell)]))


def components(probe: dict, lock: Lock | None, base_image: str) -> list[Any]:
    """Every component, each once: one listed twice (one bom-ref) is kept the first time; a
    same-named one of another source, version or place has another bom-ref and is kept too."""
    packages, section = _dict(probe.get("packages")), _dict(probe.get("sbom"))
    found = (pip_components(packages.get("python"), lock) + conda_components(section.get("conda"), lock)
             + deb_components(section.get("dpkg")) + native_components(probe) + [base_component(base_image)])
    unique: dict[str, Any] = {}
    for c in found:
        unique.setdefault(str(c.bom_ref), c)
    return list(unique.values())


def _serialize(bom: Any) -> str:
    from cyclonedx.output.json import JsonV1Dot6

    return JsonV1Dot6(bom).output_as_string(indent=1) + "\n"


def document(subject: Subject, probe: dict, lock: Lock | None) -> str:
    """The SBOM's JSON text, validated; the same input gives the same bytes (the serial number is
    a digest of what the document lists). Bytes made before from the same input are read back
    (kept_document) instead of made again: cyclonedx-python-lib's import and serializer are most of
    a no-op build's own time."""
    if not (SHA256_RE.fullmatch(subject.content_hash) and IMAGE_ID_RE.fullmatch(subject.image_id)):
        raise SbomError(f"cell {subject.cell}: no content hash or image id to describe")
    key = document_key(subject, probe, lock)
    kept = kept_document(key, subject)
    if kept is not None:
        return kept
    text = _made(subject, probe, lock)
    keep_document(key, text)
    return text


DOCUMENTS_KEPT = 64  # documents kept; the oldest go first
DOCUMENT_MAX_BYTES = 64 << 20
DOCUMENTS = Store("sbom-documents", DOCUMENTS_KEPT, DOCUMENT_MAX_BYTES, suffix=".cdx.json")  # documents made before


@functools.lru_cache(maxsize=1)
def _cyclonedx_version() -> str:
    """The serializer's and validator's code, by cyclonedx-python-lib's version (the schema ships
    with it); its package's own attribute: importlib.metadata scans site-packages (~12 ms)."""
    import cyclonedx

    return str(cyclonedx.__version__)


def document_key(subject: Subject, probe: dict, lock: Lock | None) -> str:
    """sha256 of everything document() reads: the subject, the probe, the lock's pins, and the code
    that makes the bytes (imagefactory's version and this module's source, cyclonedx-python-lib's
    version)."""
    pins = None if lock is None else [[p.name, p.version, list(p.hashes)] for p in lock.pins]
    what = ["imagefactory-sbom-document/1", __version__, _cyclonedx_version(), SPEC, subject.__dict__, probe, pins]
    return DOCUMENTS.key(json.loads(json.dumps(what, default=repr)), code=(__name__,))


def _document_file(key: str) -> Path | None:
    return DOCUMENTS.file(key)


def kept_document(key: str, subject: Subject) -> str | None:
    """The document made before from the input `key` names, when its bytes still pass validate()
    (VALIDATED's key of these very bytes, or the validator) and it describes `subject`; else None.
    Read bounded, never through a link; anything odd is made again."""
    text = DOCUMENTS.get(key)
    try:
        doc = validate(text) if text is not None else None
    except (ValueError, RecursionError, SbomError):
        return None
    if doc is None:
        return None
    want = {"content-hash": subject.content_hash, "image-id": subject.image_id, "cell": subject.cell}
    return text if described(doc) == want else None


def keep_document(key: str, text: str) -> None:
    """Keep `text` (validated) as the document of the input `key` names; never fatal."""
    DOCUMENTS.put(key, text)


def _made(subject: Subject, probe: dict, lock: Lock | None) -> str:
    """document()'s bytes, made by cyclonedx-python-lib and validated."""
    import warnings

    from cyclonedx.model.bom import Bom, BomMetaData
    from cyclonedx.model.component import Component, ComponentType

    root = _root(subject)
    tool = Component(type=ComponentType.APPLICATION, name="imagefactory", version=__version__,
                     bom_ref="tool:imagefactory")
    meta = BomMetaData(component=root)
    meta.tools.components.add(tool)
    meta.timestamp = None  # type: ignore[assignment]  # same image, same bytes
    parts = components(probe, lock, subject.base_image)
    listed = json.dumps([subject.__dict__, __version__] + sorted(
        [str(c.bom_ref), c.version, sorted(h.content for h in c.hashes), sorted((p.name, p.value) for p in c.properties)]
        for c in parts), sort_keys=True)
    serial = uuid.UUID(bytes=hashlib.sha256(listed.encode()).digest()[:16], version=5)
    bom = Bom(metadata=meta, serial_number=serial, components=parts)
    with warnings.catch_warnings():  # no dependency graph: the image contains each component, no more is known
        warnings.simplefilter("ignore", UserWarning)
        text = _serialize(bom)
    validate(text)
    return text


VALIDATED = Store("sbom-validated", 256, 16, suffix=".ok")  # an empty entry per document that passed


def validation_key(text: str) -> str:
    """sha256 of what decides the validator's verdict: the document's bytes and the validator's
    code (cyclonedx-python-lib's version, which ships the schema)."""
    return VALIDATED.key(SPEC, _cyclonedx_version(), text.encode("utf-8"))


def validate(text: str) -> dict:
    """The document parsed, once it passed cyclonedx-python-lib's strict 1.6 validator. A document
    whose bytes passed it before (the store VALIDATED) is not validated again: an unchanged image's SBOM
    has the same bytes, and importing the validator costs seconds (jsonschema's format grammars)."""
    key = validation_key(text)
    if not VALIDATED.has(key):
        from cyclonedx.schema import SchemaVersion
        from cyclonedx.validation.json import JsonStrictValidator

        error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
        if error is not None:
            raise SbomError(f"not a valid CycloneDX {SPEC} document: {' '.join(str(error).split())[:300]}")
        VALIDATED.put(key, "")
    doc = json.loads(text)
    if doc.get("specVersion") != SPEC:
        raise SbomError(f"CycloneDX {str(doc.get('specVersion'))[:20]}, not {SPEC}")
    return doc


def described(doc: dict) -> dict[str, str]:
    """{content-hash, image-id, cell} of the image a (validated) SBOM describes; {} when absent."""
    root = (doc.get("metadata") or {}).get("component") or {}
    props = {p.get("name"): p.get("value") for p in root.get("properties") or () if isinstance(p, dict)}
    out = {"content-hash": props.get(CONTENT_HASH), "image-id": props.get(IMAGE_ID), "cell": props.get(CELL)}
    return {k: v for k, v in out.items() if isinstance(v, str)}


def probe_for_sbom(probes: dict) -> dict | None:
    """The probe run whose inventory the SBOM takes: the `docker` launch mode's (the image's
    own user and entrypoint), else the first one that has the SBOM section."""
    for mode in ("docker", *sorted(probes)):
        probe = probes.get(mode)
        if isinstance(probe, dict) and isinstance(probe.get("sbom"), dict):
            return probe
    return None


def path_for(report_path: Path, cell: str) -> Path:
    """build/sbom/<cell>.cdx.json, beside the report."""
    return Path(report_path).parent / "sbom" / f"{cell}.cdx.json"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write(path, text)
    return path
