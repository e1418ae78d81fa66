"""Sizes in bytes as a matrix writes them (`size_budget: 6GB`, `900MiB`, or an integer) and as a
report shows them. The schema's pattern (resources/matrix.schema.json, $defs.size_budget) admits
the text; `parse` is the one reader of it, SIZE_RE the same pattern matched whole."""

from __future__ import annotations

import re
from decimal import Decimal

UNITS = {"B": 1, "kB": 1000, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "TB": 1000 ** 4,
         "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "TiB": 1024 ** 4}
SIZE_RE = re.compile(r"(?P<number>(?:0|[1-9][0-9]{0,12})(?:\.[0-9]{1,3})?) ?(?P<unit>" + "|".join(UNITS) + ")")
MAX_BYTES = 1 << 40  # 1 TiB: no image is larger; a budget above it is a typo


def parse(value: int | str) -> int:
    """Bytes of `value` (an integer, or a number and a unit, whole); ValueError saying why not."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected bytes or a size such as 6GB, got {type(value).__name__}")
    if isinstance(value, int):
        n = value
    else:
        m = SIZE_RE.fullmatch(value)
        if m is None:
            raise ValueError(f"{value[:40]!r} is not a size (a number and a unit: {', '.join(UNITS)}; e.g. 6GB)")
        n = int(Decimal(m["number"]) * UNITS[m["unit"]])
    if not 1 <= n <= MAX_BYTES:
        raise ValueError(f"{value!r} is {n} bytes: a size budget is between 1 byte and 1 TiB")
    return n


def human(n: int) -> str:
    """`n` bytes for people: 1.43 GB, 220 MB, 512 B (decimal units, as registries show them)."""
    for unit, size in (("TB", 1000 ** 4), ("GB", 1000 ** 3), ("MB", 1000 ** 2), ("kB", 1000)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"
