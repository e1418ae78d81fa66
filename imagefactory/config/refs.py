"""Image references: one grammar, matched against the whole string.

Every place that takes a reference apart (the matrix's base images and tags, the engine's
tag and push, the freshness check's digests) goes through `parse`. The grammar is Docker's
(distribution/reference): `[domain/]path[:tag][@sha256:<64 hex>]`. A first path component
is a registry only when it has a `.` or `:` or is `localhost` (as the Docker client reads
it); otherwise the reference is on Docker Hub (`docker.io`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DOCKER_HUB = "docker.io"
_HUB_ALIASES = ("docker.io", "index.docker.io", "registry-1.docker.io")
MAX_NAME = 255  # characters of domain/path

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"{_LABEL}(?:\.{_LABEL})*(?::[0-9]{{1,5}})?"
_TAG = r"[\w][\w.-]{0,127}"
REFERENCE_RE = re.compile(
    rf"(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>sha256:[0-9a-f]{{64}}))?", re.ASCII)
REGISTRY_RE = re.compile(_DOMAIN, re.ASCII)


@dataclass(frozen=True)
class Reference:
    domain: str | None  # as written; None: Docker Hub
    path: str  # "library/debian", "ml/train"
    tag: str | None
    digest: str | None  # "sha256:<64 hex>"

    @property
    def repository(self) -> str:
        """The name as written, without tag or digest: 'host:5000/a/b', 'debian'."""
        return f"{self.domain}/{self.path}" if self.domain else self.path

    @property
    def registry(self) -> str:
        """The registry host the reference lives on, normalised ('docker.io' for Docker Hub)."""
        return normal_registry(self.domain or DOCKER_HUB)


def _is_domain(first: str) -> bool:
    return "." in first or ":" in first or first == "localhost" or first != first.lower()


def parse(ref: str) -> Reference | None:
    """The parts of `ref`, or None when the whole string is not a reference."""
    match = REFERENCE_RE.fullmatch(ref)
    if match is None:
        return None
    domain, path = match.group("domain"), match.group("path")
    if domain is not None and not _is_domain(domain):
        if not re.fullmatch(_COMPONENT, domain):
            return None
        domain, path = None, f"{domain}/{path}"
    name = f"{domain}/{path}" if domain else path
    if len(name) > MAX_NAME:
        return None
    return Reference(domain, path, match.group("tag"), match.group("digest"))


def is_reference(ref: str) -> bool:
    """True when `ref` is a valid image reference (name, optional tag and digest)."""
    return parse(ref) is not None


def normal_registry(host: str) -> str:
    """A registry host compared case-insensitively, Docker Hub's aliases as 'docker.io'."""
    host = host.lower()
    return DOCKER_HUB if host in _HUB_ALIASES else host


def registry(ref: str) -> str | None:
    """The registry `ref` lives on ('docker.io' for Docker Hub), or None for a non-reference."""
    parsed = parse(ref)
    return parsed.registry if parsed else None


def repository(ref: str) -> str | None:
    """The name as written, no tag or digest; None for a non-reference."""
    parsed = parse(ref)
    return parsed.repository if parsed else None


def canonical_repository(ref: str) -> str | None:
    """The repository with Docker Hub's spellings folded: 'docker.io/library/python:3.11'
    and 'python' are both 'python'. None for a non-reference."""
    parsed = parse(ref)
    if parsed is None:
        return None
    if parsed.registry != DOCKER_HUB:
        return parsed.repository
    path = parsed.path
    return path[len("library/"):] if path.startswith("library/") and path.count("/") == 1 else path


def split_tag(ref: str) -> tuple[str, str]:
    """'host:5000/a/b:tag' -> ('host:5000/a/b', 'tag'); a digest stands for the tag; no tag
    -> 'latest'. Raises ValueError for a non-reference."""
    parsed = parse(ref)
    if parsed is None:
        raise ValueError(f"not an image reference: {ref[:300]!r}")
    return parsed.repository, parsed.digest or parsed.tag or "latest"


def with_registry(ref: str, base_registry: str | None) -> str:
    """Prefix a Docker Hub reference with a mirror (`library/` added for official images);
    a reference that names its registry, or a non-reference, is returned unchanged."""
    parsed = parse(ref)
    if not base_registry or parsed is None or parsed.domain is not None:
        return ref
    path = parsed.path if "/" in parsed.path else f"library/{parsed.path}"
    rest = ref[len(parsed.path):]  # ":tag@digest"
    return f"{base_registry.rstrip('/')}/{path}{rest}"
