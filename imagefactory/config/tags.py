"""Tag names: computed from the matrix before anything is built, validated as references (which
registries they may name, and how each is compressed, is registries.py's).

Release tags are applied (publish/push.py) only to cells whose build and checks passed.

Platforms, as docker-stacks does it: cells alike but for their platform share one release tag,
which names a list (an OCI image index) of their images; each cell's own tag is then a per-arch
tag beside it, `name:aarch64-<tag>` / `name:x86_64-<tag>` (`plan`). Publishing pushes the per-arch
tags; the lists (Matrix.lists) are merged once every platform of one passed (publish/lists.py). A
release tag of one cell stays that cell's own tag: a linux/amd64-only matrix is tagged as before.
"""

from __future__ import annotations

import datetime as _dt
import re
import string

from imagefactory.config import refs
from imagefactory.config import registries
from imagefactory.config.model import Cell, Matrix, TagList
from imagefactory.config.platforms import Platform

FIELDS = ("image", "torch", "python", "cuda", "accel", "blas", "installer", "installer_suffix", "variant",
          "variant_suffix", "id")
HASH_FIELDS = FIELDS + ("hash",)
CANDIDATE_REPO = "imagefactory-candidate"
# cosign's own tags (signing.cosign_tag): sha256-<hex>.sig / .att / .sbom next to each signed digest
SIG_TAG_RE = re.compile(r"sha256-[0-9a-f]{64}\.(?:sig|att|sbom)")


class TagTemplateError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _fields(image: str, cell: Cell) -> dict[str, str]:
    return {
        "image": image,
        "torch": cell.torch,
        "python": cell.python,
        "cuda": cell.cuda or "none",
        "accel": cell.accel,
        "blas": cell.blas,
        "installer": cell.installer,
        "installer_suffix": "-pip" if cell.installer == "pip" else "",
        "variant": cell.variant,
        "variant_suffix": f"-{cell.variant}" if cell.variant else "",
        "id": cell.id,
    }


def _fields_of(key: str, template: str, allowed: tuple[str, ...]) -> list[tuple[str, str | None, str | None, str | None]]:
    try:
        return list(string.Formatter().parse(template))
    except ValueError as e:  # a lone { or }
        raise TagTemplateError(key, f"{template!r}: {e}; braces only surround a field (allowed: "
                                    + ", ".join("{" + f + "}" for f in allowed) + ")") from None


def _format(key: str, template: str, allowed: tuple[str, ...], values: dict[str, str]) -> str:
    fields = _fields_of(key, template, allowed)
    for _, name, spec, conv in fields:
        if name is None:
            continue
        if name not in allowed or spec or conv:
            raise TagTemplateError(key, f"unknown field {{{name}}} in {template!r} (allowed: "
                                        + ", ".join("{" + f + "}" for f in allowed) + ")")
    return template.format(**values)


def release_tag(template: str, image: str, cell: Cell) -> str:
    return _format("template", template, FIELDS, _fields(image, cell))


def hash_tag(template: str, image: str, cell: Cell, content_hash: str) -> str:
    """The immutable tag: the template must hold {hash}, or two builds of a cell would share it."""
    if not any(name == "hash" for _, name, _, _ in _fields_of("hash_template", template, HASH_FIELDS)):
        raise TagTemplateError("hash_template", f"{template!r} has no {{hash}} field: the content-hash tag "
                                                f"must name the content, or a rebuild would overwrite it")
    return _format("hash_template", template, HASH_FIELDS, {**_fields(image, cell), "hash": content_hash[:12]})


def refusal(ref: str, allowed: tuple[str, ...]) -> str | None:
    """Why `ref` cannot be a tag to push (None when it can): not a reference, a digest in it, or a
    registry the matrix did not name. allowed[0] is the registry of `image`."""
    parsed = refs.parse(ref)
    if parsed is None:
        return f"{ref!r} is not a valid Docker reference"
    if parsed.digest is not None:
        return (f"{ref!r} holds a digest (@{parsed.digest[:15]}...): a tag names what is pushed, a digest "
                f"names what was already pushed; remove the @ part")
    if parsed.tag and SIG_TAG_RE.fullmatch(parsed.tag):
        return (f"{ref!r}: tag {parsed.tag} has the form of cosign's signature and attestation tags "
                f"(sha256-<digest>.sig/.att/.sbom); a release tag may not take their place")
    return registries.not_allowed(ref, parsed.registry, allowed)


def extra_tags(release: str, kinds: tuple[str, ...], *, today: _dt.date | None = None,
               git_sha: str | None = None) -> list[str]:
    """Optional date / git-sha variants of a release tag: `<release>-20261130`, `<release>-g1a2b3c4`."""
    out = []
    for kind in kinds:
        if kind == "date":
            out.append(f"{release}-{(today or _dt.date.today()).strftime('%Y%m%d')}")
        elif kind == "git-sha" and git_sha:
            out.append(f"{release}-g{git_sha[:7]}")
    return out


def arch_tag(ref: str, platform: Platform) -> str:
    """The per-arch tag beside the list tag `ref`: registry/ns/name:aarch64-2.13.0-py3.11-cpu-openblas."""
    repo, tag = refs.split_tag(ref)
    return f"{repo}:{platform.arch}-{tag}"


def plan(releases: list[tuple[Cell, str]]) -> tuple[list[str], tuple[TagList, ...]]:
    """Each cell's own release tag (in order), and the lists: the valid release tags that cells of
    several platforms share, one cell per platform. Each cell of a list gets its per-arch tag.
    Any other release tag stays its cells' own: the caller refuses one that two cells share (two
    cells of one platform) or that is no reference, as it did before platforms."""
    groups: dict[str, list[Cell]] = {}
    for cell, ref in releases:
        groups.setdefault(ref, []).append(cell)
    listed = {ref for ref, cells in groups.items() if len(cells) > 1 and refs.parse(ref) is not None
              and len({c.platform for c in cells}) == len(cells)}
    own = [arch_tag(ref, cell.platform) if ref in listed else ref for cell, ref in releases]
    lists = tuple(TagList(ref, tuple((c.id, c.platform.oci, arch_tag(ref, c.platform)) for c in groups[ref]))
                  for ref in groups if ref in listed)
    return own, lists


def list_of(matrix: Matrix, cell: Cell) -> TagList | None:
    """The list the cell's image is one platform of, if any."""
    return next((t for t in matrix.lists if any(cell.id == member for member, _, _ in t.members)), None)


def candidate(cell: Cell, content_hash: str) -> str:
    """The local name a freshly built image gets before its checks pass."""
    return f"{CANDIDATE_REPO}/{cell.id.replace('.', '_')}:{content_hash[:12]}"
