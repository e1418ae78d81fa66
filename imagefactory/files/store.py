"""Keys of inputs that passed a slow validator before: the matrix's bytes under its JSON Schema
(matrix.py) and an SBOM's bytes under CycloneDX's strict schema (sbom.py). Both validators import
jsonschema, which builds its format checkers' grammars at import (seconds on a small machine), and
both verdicts are a pure function of the bytes and the code: the same key passes again.

One file per validator in the cache folder (fsutil.cache_root), a JSON list of sha256 hex keys, at
most LIMIT, the newest last. Only keys of inputs that passed go in; the file is read bounded, never
through a link, and anything odd in it reads as empty (then the input is validated again). A
missing cache folder, or one that cannot be written, costs a validation, never the run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

from imagefactory.files import fsutil
from imagefactory.files import bounded
from imagefactory.errors import ConfigError

LIMIT = 256
_KEY_RE = re.compile(r"[0-9a-f]{64}")


def path(name: str) -> Path | None:
    """The cache file `name`, or None where there is no cache folder (no HOME)."""
    try:
        return fsutil.cache_root() / name
    except ConfigError:
        return None


def keys(file: Path) -> list[str]:
    """The keys in `file`: read bounded, no link or FIFO; anything odd reads as empty."""
    try:
        if file.is_symlink() or not file.exists():
            return []
        doc = json.loads(bounded.read_regular(file, LIMIT * 70 + 64).decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # bounded.InputError is a ValueError
        return []
    if not isinstance(doc, list):
        return []
    return [k for k in doc if isinstance(k, str) and _KEY_RE.fullmatch(k)]


@functools.lru_cache(maxsize=None)
def code_digest(*modules: str) -> str:
    """sha256 of the source files of `modules` (dotted names, as imported): part of a cache key
    whose verdict is their code's, so that an edit (an editable install, no new version) is a new
    key. Read from the file each module was loaded from."""
    import sys

    h = hashlib.sha256()
    for name in modules:
        file = getattr(sys.modules.get(name), "__file__", None)
        h.update(name.encode() + b"\0" + (Path(file).read_bytes() if file else b"?") + b"\0")
    return h.hexdigest()


def is_key(key: str) -> bool:
    return bool(_KEY_RE.fullmatch(key))


def prune(folder: Path, suffix: str, kept: int) -> None:
    """Remove all but the `kept` newest files named *`suffix` in `folder` (a cache of files)."""
    import os

    files = sorted((e.stat().st_mtime_ns, e.path) for e in os.scandir(folder) if e.name.endswith(suffix))
    for _, old in files[:-kept]:
        os.unlink(old)


def read_kept(file: Path | None, limit: int) -> str | None:
    """A kept result's text (sbom.py's documents, matrix.py's data, rendered.py's renders): a
    regular file of at most `limit` bytes, never through a link, UTF-8; None for anything else."""
    try:
        if file is None or file.is_symlink() or not file.exists():
            return None
        return bounded.read_regular(file, limit).decode("utf-8")
    except (OSError, ValueError):  # bounded.InputError and UnicodeDecodeError are ValueErrors
        return None


def keep(file: Path | None, text: str, suffix: str, kept: int) -> None:
    """Write a kept result atomically, the `kept` newest *`suffix` files of its folder staying;
    never fatal (the next run makes it again)."""
    if file is None:
        return
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fsutil.atomic_write(file, text)
        prune(file.parent, suffix, kept)
    except OSError:
        pass


def passed(name: str, key: str) -> bool:
    file = path(name)
    return file is not None and key in keys(file)


def remember(name: str, key: str) -> None:
    """Add `key` (an input that passed) to the cache file `name`; never fatal."""
    file = path(name)
    if file is None or not _KEY_RE.fullmatch(key):
        return
    kept = [k for k in keys(file) if k != key] + [key]
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fsutil.atomic_write(file, json.dumps(kept[-LIMIT:]))
    except OSError:
        pass  # the next run validates again
