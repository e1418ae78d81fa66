"""The matrix's cells before they are cells: the axes' values, every combination of them, less
the `exclude` entries, with the `include` entries applied (GitHub Actions' semantics). Each
mistake is reported through `problem(keypath, message)`, as matrix.py's checks are."""

from __future__ import annotations

import difflib
import itertools
from typing import Any, Callable

from imagefactory.config import platforms
from imagefactory import terminal

Report = Callable[[tuple[Any, ...], str], None]  # problem(keypath, message)

AXES = ("python", "cuda", "blas", "installer", "platform", "variant")
# An axis the file leaves out: installer conda; platform linux/amd64 (platforms.DEFAULT); variant
# none ("", the fifth axis is optional).
DEFAULT_AXES: dict[str, list[str]] = {"installer": ["conda"], "platform": [platforms.DEFAULT.oci], "variant": [""]}
DEFAULT_NEW_CELL = {"installer": "conda", "platform": platforms.DEFAULT.oci, "variant": ""}  # a cell an include adds


def expand(spec: dict[str, Any], problem: Report) -> list[dict[str, Any]]:
    """The combinations `spec` (the file's `matrix:`) makes, each a dict of axis values and the
    keys an include entry added, in the file's order."""
    axes = axes_of(spec, problem)
    check_excludes(spec, axes, problem)
    combos = combinations(spec, axes)
    include(spec, axes, combos, problem)
    return combos


def axes_of(spec: dict[str, Any], problem: Report) -> dict[str, list[Any]]:
    """Each axis's values (DEFAULT_AXES where the file has none); a value listed twice is a problem."""
    axes = {a: list(spec.get(a, DEFAULT_AXES.get(a, []))) for a in AXES}
    for axis, values in axes.items():
        for i, v in enumerate(values):
            if values.index(v) != i:
                problem(("matrix", axis, i), f"{v!r} is listed twice (duplicate cells)")
    return axes


def check_excludes(spec: dict[str, Any], axes: dict[str, list[Any]], problem: Report) -> None:
    """An exclude value that is not on its axis removes nothing: a problem (a misspelt value)."""
    for i, ex in enumerate(spec.get("exclude", [])):
        for axis, value in ex.items():
            if value not in axes[axis]:
                problem(("matrix", "exclude", i, axis),
                        f"{value!r} is not in matrix.{axis}, so this exclude removes nothing "
                        f"(allowed: {', '.join(v for v in axes[axis] if v) or 'none, matrix.' + axis + ' is not set'})")


def combinations(spec: dict[str, Any], axes: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, less those an exclude entry matches: a partial
    match removes every combination it matches (GitHub Actions semantics)."""
    combos: list[dict[str, Any]] = []
    for picked in itertools.product(*(dict.fromkeys(axes[a]) for a in AXES)):
        combo = dict(zip(AXES, picked))
        if any(all(combo[k] == v for k, v in ex.items()) for ex in spec.get("exclude", [])):
            continue
        combos.append(combo)
    return combos


def include(spec: dict[str, Any], axes: dict[str, list[Any]], combos: list[dict[str, Any]],
            problem: Report) -> None:
    """Apply the include entries to `combos`, in place: an entry extends the combinations whose
    original axis values it matches (never overwriting one); an entry that extends none adds a
    new cell, which needs python, cuda and blas, and only a variant listed under matrix.variant."""
    original = [dict(c) for c in combos]
    for i, inc in enumerate(spec.get("include", [])):
        inc_axes = {k: v for k, v in inc.items() if k in AXES}
        matched = False
        for combo, orig in zip(combos, original):
            if all(orig[k] == v for k, v in inc_axes.items()):
                combo.update(inc)
                matched = True
        if not matched:
            missing = [a for a in ("python", "cuda", "blas") if a not in inc_axes]
            if missing:
                problem(("matrix", "include", i), f"matches no cell, and a new cell needs {', '.join(missing)}")
                continue
            new = {**DEFAULT_NEW_CELL, **inc}
            # Only a variant the entry names must be listed; an entry without one adds a cell of no
            # variant, as a matrix without matrix.variant does (a tag it shares is reported later).
            if "variant" in inc and new["variant"] not in axes["variant"]:
                problem(("matrix", "include", i, "variant"), new_variant(new["variant"], axes["variant"]))
                continue
            combos.append(new)
            original.append({k: new[k] for k in AXES})


def new_variant(variant: str, listed: list[str]) -> str:
    """Why an include entry that adds a cell may not bring its own variant: variants are named once,
    under matrix.variant, so a misspelt one is a mistake, not a new cell."""
    names = [v for v in listed if v]
    near = difflib.get_close_matches(variant, names, n=1)
    return (f"{variant!r} is not in matrix.variant ({terminal.listing(names, empty='not set')}), so this entry would "
            f"add a cell of its own" + (f"; did you mean {near[0]!r}?" if near else "; list the variant there first"))
