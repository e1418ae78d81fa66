"""Fresh bases: every cell's base image is resolved to a manifest digest before building.

The digest is pinned in the rendered FROM (`name:tag@sha256:...`), so it is part of the
Dockerfile and therefore of the content hash: when a base tag moves to a patched image,
the cell's hash changes and the cell is rebuilt; when it does not move, the cell stays
cached. The build is reproducible from its context alone.

--pull modes (like `docker build --pull` / buildx's policy):
- always:  ask the registry (an error if it does not answer) and re-pull the base.
- missing: ask the registry; if it does not answer, fall back to the local copy's
           digest (RepoDigests). The base is pulled only if that digest is not local.
- never:   no network: the local copy's digest, an error if there is none.

Registry lookups go through the engine (`docker.APIClient.inspect_distribution`), so
the same credentials rules apply as for `docker pull`: the engine client's `docker
login` config and credential helpers. IMAGEFACTORY_REGISTRY_* are for the publish
registry only and are not sent to base registries.

Every digest, whichever side it came from, is checked with a whole-string pattern
before it reaches a Dockerfile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Protocol

from imagefactory.config import refs
from imagefactory.run.context import Pull
from imagefactory.errors import ImageFactoryError

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


class BaseImageError(ImageFactoryError):
    """A base image could not be resolved to a digest (exit 1, before any build)."""


class DigestSource(Protocol):
    def registry_digest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str | None: ...

    def local_repo_digests(self, ref: str) -> list[str]: ...


@dataclass(frozen=True)
class Base:
    ref: str  # as in the matrix: name:tag
    digest: str  # sha256:...
    source: str  # registry | local | matrix

    @property
    def pinned(self) -> str:
        return self.ref if "@" in self.ref else f"{self.ref}@{self.digest}"


def repository(ref: str) -> str | None:
    """'host:5000/a/b:tag@sha256:..' -> 'host:5000/a/b' (Docker Hub names normalised; imagefactory.config.refs)."""
    return refs.canonical_repository(ref)


def _valid(digest: object) -> str | None:
    return digest if isinstance(digest, str) and DIGEST_RE.fullmatch(digest) else None


def local_digest(engine: DigestSource, ref: str) -> str | None:
    """The digest the local copy of `ref` was pulled or pushed under, for the same repository."""
    repo = repository(ref)
    found = []
    for entry in engine.local_repo_digests(ref):
        name, _, digest = str(entry).partition("@")
        if repo is not None and repository(name) == repo and _valid(digest):
            found.append(digest)
    return sorted(found)[0] if found else None


def resolve_one(engine: DigestSource, ref: str, pull: Pull) -> Base:
    """`pull` is checked once, when the run's settings are made (run/context.py)."""
    if "@" in ref:  # the matrix pinned it already
        digest = _valid(ref.split("@", 1)[1])
        if digest is None:
            raise BaseImageError(f"base image {ref}: not a sha256 digest")
        return Base(ref, digest, "matrix")
    if pull is not Pull.never:
        served = engine.registry_digest(ref)
        if served is not None:
            digest = _valid(served)
            if digest is None:
                raise BaseImageError(f"base image {ref}: the registry answered a digest that is not "
                                     f"sha256:<64 hex> ({str(served)[:80]!r})")
            return Base(ref, digest, "registry")
        if pull is Pull.always:
            raise BaseImageError(f"base image {ref}: the registry gave no digest (unreachable, unknown "
                                 "tag or no credentials; `docker login` to it), and --pull always needs one")
    local = local_digest(engine, ref)
    if local is None:
        where = "no local copy with a registry digest" + ("" if pull is Pull.never else ", and the registry gave none")
        hint = "pull or push it first, or use --pull missing" if pull is Pull.never else "check the name and the registry"
        raise BaseImageError(f"base image {ref}: {where}; {hint}")
    return Base(ref, local, "local")


def resolve(engine: DigestSource, refs: Iterable[str], pull: Pull) -> dict[str, Base]:
    """{matrix base reference: its resolved Base}, each distinct reference asked once."""
    return {ref: resolve_one(engine, ref, pull) for ref in sorted(set(refs))}
