"""The one store every kept result goes through: `Store(name, limit, max_bytes)`.

A store is a folder under the cache folder (fsutil.cache_root()/name), one file per entry, named
by its key. A key is built one way (Store.key): sha256 of the store's name, the inputs (JSON, or
bytes as they are) and the source of the modules whose code made the result (code_digest), so an
edit of that code (an editable install, no new version) is a new key. Entries are read bounded,
never through a link (a symlink, a FIFO or anything over max_bytes reads as no entry), written
atomically, and the newest `limit` stay. A missing cache folder (no HOME), or one that cannot be
written, costs the result being made again, never the run.

What is kept, and why (each saves a figure a user notices): the probe's verdicts (verdicts.py: a
cached `test` is 0.9 s against 17 s), the digests of big context files (digests.py: a 190 MB
wheel is a second to hash), the matrix's parsed data and the schema's verdict on its bytes
(matrix.py: no YAML parser nor jsonschema import on `list`), the templates' renders (rendered.py:
no Jinja2 import on a no-op build), and an SBOM's documents and validations (sbom.py: the strict
validator's import takes seconds), and each layer's measured size (layer_sizes.py: a graph-driver
engine's layers are gzipped once, not at every push).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path

from imagefactory.errors import ConfigError
from imagefactory.files import bounded, fsutil

_KEY_RE = re.compile(r"[0-9a-f]{64}")


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


class Store:
    """One kept-result store: `name` (its folder under the cache folder), `limit` (entries kept,
    the oldest pruned beyond), `max_bytes` (an entry read back is at most this), `suffix` (its
    files' ending), `durable` (sync each write to disk before the rename), `at` (a folder of its
    own instead: verdicts.py's --verdicts-dir)."""

    def __init__(self, name: str, limit: int, max_bytes: int, *, suffix: str = ".txt", durable: bool = False,
                 at: Path | None = None) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"not a store name: {name!r}")
        self.name = name
        self.limit = limit
        self.max_bytes = max_bytes
        self.suffix = suffix
        self.durable = durable
        self.at = at

    def folder(self) -> Path | None:
        """The store's folder, or None where there is no cache folder (no HOME)."""
        if self.at is not None:
            return self.at
        try:
            return fsutil.cache_root() / self.name
        except ConfigError:
            return None

    def key(self, *inputs: object, code: tuple[str, ...] = ()) -> str:
        """The key of a result made from `inputs` (bytes, or what JSON states) by the modules
        `code`. TypeError (or ValueError) for an input JSON cannot state."""
        h = hashlib.sha256(b"imagefactory-store/1\0" + self.name.encode() + b"\0")
        for value in inputs:
            data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
            h.update((b"b" if isinstance(value, bytes) else b"j") + str(len(data)).encode() + b"\0" + data)
        h.update(code_digest(*code).encode())
        return h.hexdigest()

    def file(self, key: str) -> Path | None:
        """The entry `key`'s file (it may not exist), or None: no cache folder, or not a key."""
        folder = self.folder()
        return None if folder is None or not is_key(key) else folder / f"{key}{self.suffix}"

    def get_bytes(self, key: str) -> bytes | None:
        """The entry `key`: a regular file of at most max_bytes, never through a link; else None."""
        file = self.file(key)
        try:
            if file is None or file.is_symlink() or not file.exists():
                return None
            return bounded.read_regular(file, self.max_bytes)
        except (OSError, ValueError):  # bounded.InputError is a ValueError
            return None

    def get(self, key: str) -> str | None:
        """The entry `key` as UTF-8 text (get_bytes); None for anything else."""
        data = self.get_bytes(key)
        try:
            return data.decode("utf-8") if data is not None else None
        except UnicodeDecodeError:
            return None

    def has(self, key: str) -> bool:
        return self.get_bytes(key) is not None

    def put(self, key: str, value: str | bytes) -> bool:
        """Keep `value` as the entry `key`, atomically, pruning beyond `limit`; False when it could
        not be kept (never fatal: the next run makes it again)."""
        file = self.file(key)
        if file is None or len(value) > self.max_bytes:
            return False
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            fsutil.atomic_write(file, value, durable=self.durable)
            self.prune()
        except OSError:
            return False
        return True

    def delete(self, key: str) -> None:
        file = self.file(key)
        try:
            if file is not None:
                file.unlink(missing_ok=True)
        except OSError:
            pass

    def prune(self) -> None:
        """Remove all but the `limit` newest entries."""
        folder = self.folder()
        if folder is None:
            return
        entries = sorted((e.stat(follow_symlinks=False).st_mtime_ns, e.path) for e in os.scandir(folder)
                         if e.name.endswith(self.suffix) and not e.name.startswith(".") and not e.is_dir(follow_symlinks=False))
        for _, old in entries[:-self.limit] if self.limit > 0 else entries:
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass  # another run pruned it first
