"""What several steps share about files: a file's sha256, an atomic write, and the cache folder."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """imagefactory's cache folder: $IMAGEFACTORY_CACHE_DIR, else $XDG_CACHE_HOME/imagefactory,
    else ~/.cache/imagefactory. The verdicts, the file digests and buildx's answer live in it."""
    explicit = os.environ.get("IMAGEFACTORY_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "imagefactory"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, data: str | bytes, *, durable: bool = False) -> None:
    """Replace `path` with `data` at once: a reader sees the old file or the new one, never a part.
    The temporary file lives beside it and is removed if anything fails (Ctrl-C included);
    `durable` also syncs it to disk before the rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
