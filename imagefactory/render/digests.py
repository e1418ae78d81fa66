"""sha256 of context files, remembered for big ones (the wheelhouse) between runs.

Hashing a 190 MB torch wheel costs a second or more on every no-op `build`. Render links
wheelhouse files into the context (same inode), so a digest is remembered per
(device, inode, size, modification time in ns): the stat data that make-like tools and
git's index trust. A file changed in place without its mtime changing is the accepted
blind spot; --retest does not cover it, deleting the cache file does.

The cache is one JSON file beside the verdicts (in fsutil.cache_root()), written
atomically, and every entry is checked when read; a bad file is ignored.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

from imagefactory.files import fsutil
from imagefactory.files import bounded
MIN_SIZE = 1 << 20  # smaller files are hashed every time: cheaper than a lookup
MAX_ENTRIES = 512
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_KEY_RE = re.compile(r"\d+:\d+:\d+:\d+")
_lock = threading.Lock()


def cache_file() -> Path:
    return fsutil.cache_root() / "file-digests.json"


_hash = fsutil.sha256_file


def _load(path: Path) -> dict[str, str]:
    try:
        if path.is_symlink() or not path.exists():
            return {}
        doc = json.loads(bounded.read_regular(path, MAX_ENTRIES * 200).decode("utf-8"))  # no FIFO, bounded
    except (OSError, ValueError, RecursionError):  # bounded.InputError is a ValueError
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items()
            if isinstance(k, str) and isinstance(v, str) and _KEY_RE.fullmatch(k) and _DIGEST_RE.fullmatch(v)}


def _save(path: Path, entries: dict[str, str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fsutil.atomic_write(path, json.dumps(dict(list(entries.items())[-MAX_ENTRIES:])))
    except OSError:
        pass  # never fatal: the next run hashes again


def file_digest(path: Path) -> str:
    st = path.stat()
    if st.st_size < MIN_SIZE:
        return _hash(path)
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    store = cache_file()
    with _lock:
        entries = _load(store)
        if key in entries:
            return entries[key]
    digest = _hash(path)
    with _lock:
        entries = _load(store)
        entries.pop(key, None)
        entries[key] = digest
        _save(store, entries)
    return digest
