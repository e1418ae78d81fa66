"""Template text kept between runs: what a Jinja2 template renders is a pure function of the
template files, the values it is given and the code that renders it (Jinja2 and MarkupSafe, and
the modules whose filters and properties the templates call). A render whose key is unchanged
reads its text back instead of importing Jinja2 and compiling the templates (~35 ms): a no-op
build renders the same contexts every run, and writes the same catalogue (render/contexts.py, catalog.py).

The key: this module's format, imagefactory's version, the source of the calling modules
(store.code_digest), Jinja2's and MarkupSafe's own source files (found, not imported), every
file of the template folder, the template's name and the values as JSON that keeps what a
template can tell apart (_exact). A value it cannot state exactly (anything but str, int, float,
bool, None, lists, tuples, dicts, dataclasses, enums and paths) makes no key: that render always
runs. Kept in the store RENDERS (store.py: one text file per key, read bounded, never through a
link, the newest KEPT staying).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from pathlib import Path, PurePath
from typing import Any, Callable, Mapping

from imagefactory import __version__
from imagefactory.files.store import Store

FORMAT = 1
KEPT = 512
MAX_BYTES = 16 << 20
RENDERS = Store("rendered", KEPT, MAX_BYTES)


def text(name: str, values: Mapping[str, Any], make: Callable[[], str], *, templates: Path,
         code: tuple[str, ...]) -> str:
    """The text template `name` of the folder `templates` renders for `values`: `make()`'s, kept
    for the next render of the same key; `code`: the modules whose code the render runs."""
    key = _key(name, values, templates, code)
    kept = _read(key) if key is not None else None
    if kept is not None:
        return kept
    out = make()
    if key is not None:
        _keep(key, out)
    return out


def _exact(value: object) -> object:
    """`value` as JSON that keeps what a template can tell apart: the order of a dict's items, a
    tuple from a list, a dataclass's, enum's or path's type. TypeError for anything else (a set's
    order is not the same from run to run)."""
    if isinstance(value, enum.Enum):  # before str and int: a StrEnum is a str
        return {"__enum__": f"{type(value).__qualname__}.{value.name}", "value": _exact(value.value)}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, list):
        return [_exact(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_exact(v) for v in value]}
    if isinstance(value, dict):
        return {"__dict__": [[_exact(k), _exact(v)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__dataclass__": type(value).__qualname__,
                "fields": [[f.name, _exact(getattr(value, f.name))] for f in dataclasses.fields(value)]}
    if isinstance(value, PurePath):
        return {"__path__": str(value)}
    raise TypeError(f"no exact JSON for {type(value).__qualname__}")


def _key(name: str, values: Mapping[str, Any], templates: Path, code: tuple[str, ...]) -> str | None:
    try:
        return RENDERS.key(FORMAT, __version__, _libraries(), _folder(str(templates)), name, _exact(dict(values)),
                           code=(__name__, *code))
    except (TypeError, ValueError, RecursionError, OSError):
        return None


@functools.lru_cache(maxsize=1)
def _libraries() -> str:
    """sha256 of Jinja2's and MarkupSafe's package files, found without importing them."""
    import importlib.util

    h = hashlib.sha256()
    for name in ("jinja2", "markupsafe"):
        spec = importlib.util.find_spec(name)
        folder = Path(spec.origin).parent if spec is not None and spec.origin else None
        h.update(name.encode() + b"\0" + (_folder(str(folder)).encode() if folder else b"?") + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _folder(folder: str) -> str:
    """sha256 of every .py and template file under `folder` (names and bytes)."""
    h = hashlib.sha256()
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _file(key: str) -> Path | None:
    return RENDERS.file(key)


def _read(key: str) -> str | None:
    return RENDERS.get(key)


def _keep(key: str, out: str) -> None:
    RENDERS.put(key, out)
