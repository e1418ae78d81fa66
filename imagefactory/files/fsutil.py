"""What several steps share about files: a file's sha256, an atomic write, and the cache folder."""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from imagefactory.errors import ConfigError

LOCK_MAX_BYTES = 32  # what a lock file holds: a pid and a newline


def cache_root() -> Path:
    """imagefactory's cache folder: $IMAGEFACTORY_CACHE_DIR, else $XDG_CACHE_HOME/imagefactory,
    else ~/.cache/imagefactory. Every kept result lives in it, each store (store.Store) a folder."""
    explicit = os.environ.get("IMAGEFACTORY_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "imagefactory"
    found = home()
    if found is None:
        raise ConfigError(f"$HOME is not set and UID {os.getuid()} has no passwd entry, so imagefactory has no cache "
                          f"folder: set HOME, XDG_CACHE_HOME or IMAGEFACTORY_CACHE_DIR")
    return found / ".cache" / "imagefactory"


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


def open_lock(path: Path, what: str) -> int:
    """A file descriptor of the lock file `path`, opened read-write without following a link, and
    created (0644) when missing. An existing one must be what a run leaves there: a regular file of
    this user, with no other name (hard link), holding at most a pid. Anything else (a link planted
    in a repository CI builds, someone's file) is ConfigError naming `what`: the caller truncates
    the file to write its pid, and must never truncate what no run created."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        opened = "is a symbolic link" if os.path.islink(path) else f"cannot be opened: {e.strerror}"
        raise ConfigError(f"{what}: its lock file {path} {opened}; remove it (imagefactory makes its own)") from None
    st = os.fstat(fd)
    why: str | None = None
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif st.st_nlink != 1 or st.st_uid != os.geteuid():
        why = "has another name (a hard link) or another owner"
    elif st.st_size > LOCK_MAX_BYTES or (st.st_size and not os.pread(fd, LOCK_MAX_BYTES, 0).strip().isdigit()):
        why = "holds something other than a pid"
    if why is not None:
        os.close(fd)
        raise ConfigError(f"{what}: its lock file {path} {why}, so it is not one imagefactory made; remove it")
    return fd


def home(environ: Any = None) -> Path | None:
    """The user's home folder: $HOME, else the passwd entry's; None for a UID with neither (a
    container started as --user 4242 with HOME unset)."""
    env = os.environ if environ is None else environ
    if env.get("HOME"):
        return Path(env["HOME"])
    try:
        import pwd

        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except (KeyError, ImportError, OSError):
        return None
