"""The size budget (issue 34, item 4): a cell whose image is larger, compressed, than its
`size_budget` is not pushed, and its report names its largest layers and the packages in them (an
environment layer's list, engine/layer_sizes.py), or the step that made a layer that carries no list; a
layer of the base image by the base's reference (base_of: when the base is in the engine's store, its
diff ids say which of the image's first layers are its own).

The size is the engine's measure before the push (engine/layer_sizes.py): exact on the containerd image
store (its compressed blobs are what a push sends), a gzip estimate on the graph-driver store (a
push gzips there). With zstd chosen the pushed bytes are usually fewer than this gzip figure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from imagefactory.config.model import human
from imagefactory.engine.layer_sizes import Layer, Measured

SHOWN = 3  # the largest layers a message names
PACKAGES_SHOWN = 12  # the packages a message names per layer


@dataclass(frozen=True)
class Base:
    """The base image an image was built FROM: its reference, and how many of the image's first
    layers are its own."""

    ref: str
    layers: int


def base_of(measured: Measured, ref: str, diff_ids: Sequence[str] | None) -> Base | None:
    """The base's share of `measured`: its first layers, as long as they are the base's (`diff_ids`,
    the local base image's); None when the base is not known here or shares no layer."""
    count = 0
    for layer, own in zip(measured.layers, diff_ids or ()):
        if not own or layer.diff_id != own:
            break
        count += 1
    return Base(ref, count) if count else None


def ranked(measured: Measured, n: int = SHOWN) -> list[tuple[int, Layer]]:
    """The `n` largest layers with their places in the image, largest first (the base's order among equals)."""
    return sorted(enumerate(measured.layers), key=lambda pair: -pair[1].size)[:n]


def largest(measured: Measured, n: int = SHOWN) -> list[Layer]:
    """The `n` largest layers, largest first (the base's order among equals)."""
    return [layer for _, layer in ranked(measured, n)]


# The shell a step ran in: the classic builder's history says `/bin/sh -c CMD`, BuildKit's `RUN /bin/sh -c CMD`
_SHELL_RE = re.compile(r"^(?:RUN )?(?:/bin/(?:ba)?sh (?:-o pipefail )?-c )?(?:#\(nop\) +)?")
# A settled RUN (partials/stamp.j2) starts with its stamp, which says nothing of what it installs
_STAMP_RE = re.compile(r"^touch /tmp/imagefactory-stamp +&& +(?:sleep [0-9.]+ +&& +)?")
# ... and an apt step is named by what it installs (the flags left out)
_APT_RE = re.compile(r"\bapt-get install(?: +-[-A-Za-z0-9=]+)*((?: +[A-Za-z0-9][A-Za-z0-9.+:=~-]*)+)")


def _step(layer: Layer) -> str:
    step = _STAMP_RE.sub("", _SHELL_RE.sub("", " ".join(layer.step.removesuffix(" # buildkit").split())))
    apt = _APT_RE.search(step)
    return f"apt-get install{apt.group(1)}" if apt else step


def _owner(index: int, base: Base | None) -> str | None:
    """The base image's reference when the layer at `index` is one of its own."""
    return base.ref if base is not None and index < base.layers else None


def _what(layer: Layer, base: str | None) -> str:
    if base is not None:
        return f"{human(layer.size)} (base image {base.partition('@')[0][:200]})"
    if layer.packages:
        more = len(layer.packages) - PACKAGES_SHOWN
        return (f"{human(layer.size)} ({', '.join(layer.packages[:PACKAGES_SHOWN])}"
                + (f" and {more} more" if more > 0 else "") + ")")
    return f"{human(layer.size)} ({_step(layer)[:100] or 'step not recorded'})"


def verdict(measured: Measured, budget: int, base: Base | None = None) -> dict[str, Any]:
    """The report's record of the check (CellReport.sizes["budget"]): the limit, the measure,
    how it was measured (exact | estimated), whether it is over, and the largest layers (`base`:
    the base image's reference for a layer of its own, else null)."""
    return {"limit": budget, "measured": measured.total, "how": "exact" if measured.exact else "estimated",
            "over": measured.total > budget,
            "largest": [{"size": layer.size, "step": layer.step, "diff_id": layer.diff_id,
                         "packages": list(layer.packages), "base": _owner(i, base)} for i, layer in ranked(measured)]}


def refusal(measured: Measured, budget: int, base: Base | None = None) -> str | None:
    """Why the image may not be pushed (one line), or None when it is within its budget."""
    if measured.total <= budget:
        return None
    how = "" if measured.exact else " (estimated: gzip of each layer)"
    return (f"not published: {human(measured.total)} compressed{how} is over its size_budget of {human(budget)} "
            f"by {human(measured.total - budget)}; largest layers: "
            + "; ".join(_what(x, _owner(i, base)) for i, x in ranked(measured)))
