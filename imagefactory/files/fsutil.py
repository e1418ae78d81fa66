"""What several steps share about files: a file's sha256, an atomic write, the cache folder, and a
run's file locks (`locked`: one run at a time on a work dir and a report; `exclusive`: one such
lock, as `lock` holds the matrix's; not lock/, which pins packages)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from imagefactory.errors import ConfigError


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


PID_MAX_BYTES = 32  # what a lock file holds: a pid and a newline


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
    elif st.st_size > PID_MAX_BYTES or (st.st_size and not os.pread(fd, PID_MAX_BYTES, 0).strip().isdigit()):
        why = "holds something other than a pid"
    if why is not None:
        os.close(fd)
        raise ConfigError(f"{what}: its lock file {path} {why}, so it is not one imagefactory made; remove it")
    return fd


@contextmanager
def locked(work_dir: Path, report: Path) -> Iterator[None]:
    """Hold exclusive locks on the work dir and on the report for the whole run, so that a
    second run on either stops at once instead of overwriting this run's files."""
    with exclusive(Path(work_dir) / ".imagefactory.lock", f"--work-dir {work_dir}"), \
            exclusive(Path(report).with_name(f".{Path(report).name}.lock"), f"--report {report}"):
        yield


@contextmanager
def exclusive(lock_path: Path, what: str, *, own_file: bool = True,
              hint: str = "give this run its own --work-dir and --report") -> Iterator[None]:
    """Hold an exclusive lock on `lock_path` while the block runs; ConfigError naming `what` (and
    the holder's pid) when another run holds it. `own_file`: the lock file is ours (created, the
    pid written in it); else an existing file (the matrix) is locked as it is, read-only."""
    if own_file:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_lock(lock_path, what) if own_file else os.open(lock_path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() if own_file else ""
            holder = holder if holder.isdigit() else "?"
            raise ConfigError(f"{what}: another imagefactory run (pid {holder}) is using it; wait for it to "
                              f"end, or {hint}") from None
        if own_file:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
