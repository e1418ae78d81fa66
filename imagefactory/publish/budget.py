"""The size budget (issue 34, item 4): a cell whose image is larger, compressed, than its
`size_budget` is not pushed, and its report names its largest layers and the packages in them (an
environment layer's list, engine/layers.py), or the step that made a layer that carries no list.

The size is the engine's measure before the push (engine/layers.py): exact on the containerd image
store (its compressed blobs are what a push sends), a gzip estimate on the graph-driver store (a
push gzips there). With zstd chosen the pushed bytes are usually fewer than this gzip figure.
"""

from __future__ import annotations

import re
from typing import Any

from imagefactory.config.sizes import human
from imagefactory.engine.layers import Layer, Measured

SHOWN = 3  # the largest layers a message names
PACKAGES_SHOWN = 12  # the packages a message names per layer


def largest(measured: Measured, n: int = SHOWN) -> list[Layer]:
    """The `n` largest layers, largest first (the base's order among equals)."""
    return sorted(measured.layers, key=lambda layer: -layer.size)[:n]


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


def _what(layer: Layer) -> str:
    if layer.packages:
        more = len(layer.packages) - PACKAGES_SHOWN
        return (f"{human(layer.size)} ({', '.join(layer.packages[:PACKAGES_SHOWN])}"
                + (f" and {more} more" if more > 0 else "") + ")")
    return f"{human(layer.size)} ({_step(layer)[:100] or 'step not recorded'})"


def verdict(measured: Measured, budget: int) -> dict[str, Any]:
    """The report's record of the check (CellReport.sizes["budget"]): the limit, the measure,
    how it was measured (exact | estimated), whether it is over, and the largest layers."""
    return {"limit": budget, "measured": measured.total, "how": "exact" if measured.exact else "estimated",
            "over": measured.total > budget,
            "largest": [{"size": layer.size, "step": layer.step, "diff_id": layer.diff_id,
                         "packages": list(layer.packages)} for layer in largest(measured)]}


def refusal(measured: Measured, budget: int) -> str | None:
    """Why the image may not be pushed (one line), or None when it is within its budget."""
    if measured.total <= budget:
        return None
    how = "" if measured.exact else " (estimated: gzip of each layer)"
    return (f"not published: {human(measured.total)} compressed{how} is over its size_budget of {human(budget)} "
            f"by {human(measured.total - budget)}; largest layers: " + "; ".join(_what(x) for x in largest(measured)))
