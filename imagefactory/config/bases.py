"""A cell's base image: the matrix's per-installer default (or the cell's own base_image) with
{python}, {cuda} and {accel} filled in and the base_registry mirror applied, and the checks a
base must pass (a reference; not scratch; not a pip template's build-stage name)."""

from __future__ import annotations

from typing import Any, Callable

from imagefactory.config import refs
from imagefactory.config.model import Cell

Report = Callable[[tuple[Any, ...], str], None]  # problem(keypath, message), as matrix.py's checks

DEFAULT_BASE_IMAGES = {"conda": "debian:bookworm-slim", "pip": "python:{python}-slim-bookworm"}
STAGE_NAMES = {"venv"}  # build-stage names in dockerfiles/; a base image with one of them would be the stage


def given(combo: dict[str, Any], base_images: dict[str, str]) -> str:
    """The base as the file gives it: the cell's own base_image, else its installer's."""
    return combo.get("base_image", base_images[combo["installer"]])


def resolve(combo: dict[str, Any], base_images: dict[str, str], base_registry: str | None) -> str:
    """The base a cell is built on: the given one with its placeholders filled, mirrored."""
    cuda = None if combo["cuda"] == "none" else combo["cuda"]
    accel = "cpu" if cuda is None else f"cu{cuda}"
    base = given(combo, base_images)
    base = base.replace("{python}", combo["python"]).replace("{cuda}", cuda or "").replace("{accel}", accel)
    return apply_base_registry(base, base_registry)


def check(cell: Cell, combo: dict[str, Any], base_images: dict[str, str], where: tuple[Any, ...],
          problem: Report) -> None:
    """The first thing wrong with `cell`'s base image, reported at the key that names it."""
    keypath = where + ("base_image",) if "base_image" in combo else ("base_images", combo["installer"])
    base = cell.base_image
    if refs.canonical_repository(given(combo, base_images)) == "scratch":
        problem(keypath, f"cell {cell.id}: scratch is the empty image: it has no Python, shell or package manager "
                         f"to install torch with; name a base that has them")
    elif not refs.is_reference(base):
        problem(keypath, f"cell {cell.id}: base image {base!r} is not a valid image reference")
    elif cell.installer == "pip" and repository(base) in STAGE_NAMES:
        problem(keypath, f"cell {cell.id}: base image {base!r} has the name of a build stage of the pip "
                         f"template ({', '.join(sorted(STAGE_NAMES))}); name its registry or namespace")


def repository(ref: str) -> str:
    """The repository part of a reference: no registry-less tag, no digest."""
    return refs.repository(ref) or ref


def apply_base_registry(ref: str, base_registry: str | None) -> str:
    """Prefix a Docker Hub reference with a mirror; references naming a registry are kept."""
    return refs.with_registry(ref, base_registry)
