"""The registry as a cache (part of step 10, pipeline/): what a fresh CI runner reuses from the
target registry instead of building.

- **Content tag already pushed.** A cell's immutable content-hash tag (tags.hash_tag) names
  exactly one content. When the target registry serves it, the image is pulled, by the digest
  the registry gave (checked against sha256:<64 hex> first), instead of built; it must carry
  the cell's content-hash label, or it is not used. A fresh runner with an unchanged matrix
  therefore never builds. Both builders take this path: it needs only the engine.
- **Cell changed.** The cell's release tags in the registry are the previous content of the
  same cell: BuildKit builds take them as `--cache-from` (their inline cache metadata names
  the layers a changed cell can reuse). Registry cache export (`--cache-to type=registry`)
  needs the docker-container driver or the containerd image store, which dockerd 20.10's
  built-in BuildKit does not have: inline cache only.

Lookups go through the engine with the credentials of the content tag's own registry
(logins.auth_for: IMAGEFACTORY_REGISTRY_* for `image`'s registry, the _<HOST> pair for one
under tags.registries, else `docker login`'s), and only for the matrix's own tags: base
registries and other registries never see them. A registry that does not answer, or serves something else, costs
a build, never the run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from imagefactory.engine import logins
from imagefactory.render import contexts
from imagefactory.config import tags
from imagefactory.engine.api import ContainerEngine
from imagefactory.errors import EngineError, EngineGone, PushError
from imagefactory.config.model import Cell, Matrix

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Pulled:
    image_id: str
    ref: str  # name:tag@sha256:... as pulled


def content_ref(matrix: Matrix, cell: Cell, content_hash: str) -> str:
    """The cell's immutable content-hash tag in the target registry."""
    return tags.hash_tag(matrix.hash_tag_template, matrix.image, cell, content_hash)


def lookup(engine: ContainerEngine, ref: str, auth: dict[str, str] | None) -> str | None:
    """The digest the registry serves for `ref`, if it serves one that is a well-formed digest."""
    digest = engine.registry_digest(ref, auth_config=auth)
    return digest if isinstance(digest, str) and DIGEST_RE.fullmatch(digest) else None


def pull_content(engine: ContainerEngine, matrix: Matrix, cell: Cell, content_hash: str,
                 creds: dict[str, logins.Auth | None], log: Callable[[str], None]) -> Pulled | None:
    """Pull the cell's content-hash tag when the registry has it, and tag it locally under
    that tag (so later runs find it without the registry). `creds`: per registry, as
    logins.registry_credentials gives them. None: build instead (`log` says why)."""
    ref = content_ref(matrix, cell, content_hash)
    try:
        auth = logins.auth_for(ref, creds)
    except PushError as e:
        log(f"registry cache: {e.message}; building")
        return None
    digest = lookup(engine, ref, auth)
    if digest is None:
        log(f"registry cache: {ref} is not in the registry; building")
        return None
    pinned = f"{ref}@{digest}"
    try:
        image_id = engine.pull(pinned, auth_config=auth)
    except EngineGone:
        raise
    except (EngineError, PushError) as e:
        log(f"registry cache: could not pull {pinned} ({e.message}); building")
        return None
    labelled = engine.images_with_label(contexts.HASH_LABEL, content_hash)
    if image_id not in labelled:
        log(f"registry cache: {pinned} does not carry content hash {content_hash[:12]}; building")
        return None
    engine.tag(image_id, ref)
    log(f"registry cache: pulled {pinned} instead of building (content hash {content_hash[:12]})")
    return Pulled(image_id, pinned)


def cache_sources(cell: Cell) -> list[str]:
    """The registry's images of this cell a BuildKit build may take its cache from: its release
    tags (the cell's last published content, pushed with inline cache metadata)."""
    return list(cell.tags)
