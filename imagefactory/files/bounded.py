"""Bounded reads: the bytes of a regular file within a size cap (a FIFO, a device, a directory or a
file too big is an InputError, never waited on or read whole), links resolved only where meant,
and the checks on an output path before anything is written there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from imagefactory.errors import ConfigError
from imagefactory.terminal import printable


# Pseudo file systems: a "file" there is the state of a process or a device, not a certificate.
REFUSED_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))


class InputError(ValueError):
    """The file cannot be used; the message says why."""


def short(path: Path | str, limit: int = 120) -> str:
    """A path as messages show it: cut to `limit` characters (the CLI escapes what it prints)."""
    text = str(path)
    return text if len(text) <= limit else text[:limit] + "..."


def kind(mode: int) -> str:
    """What a file's mode says it is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; InputError (a message without the
    path) for anything else. Opened without blocking, so a FIFO is reported, not waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError("file not found") from None
    except OSError as e:  # ENAMETOOLONG, EACCES, ELOOP, ...
        raise InputError(f"cannot be read: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputError(f"is {kind(mode)}, not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InputError(f"is larger than {limit} bytes")
    return data


def in_pseudo_fs(path: Path) -> bool:
    """Whether a resolved path is in /proc, /sys or /dev: the state of a process or a device."""
    return any(path == root or path.is_relative_to(root) for root in REFUSED_ROOTS)


def read_real(path: Path, limit: int) -> tuple[Path, bytes]:
    """(the file `path` leads to, its bytes): links are followed (a Kubernetes secret volume and a
    dotfile manager's ~/.netrc are links), and what they lead to must be a regular file of at most
    `limit` bytes outside /proc, /sys and /dev. InputError (a message without the file's content)
    for anything else. The returned path is what later steps use, so a link swapped after this
    check changes nothing."""
    real = resolved(path)
    if in_pseudo_fs(real):
        raise InputError(f"leads to {short(real)}, in a pseudo file system (/proc, /sys, /dev), not a file")
    return real, read_regular(real, limit)


def resolved(path: Path) -> Path:
    """`path` with its links followed; InputError (never RuntimeError) for a loop or an unreadable one."""
    try:
        return Path(path).resolve(strict=False)
    except RuntimeError:  # Python 3.11 raises RuntimeError for a symbolic link loop
        raise InputError("is a symbolic link loop") from None
    except OSError as e:  # Python 3.13: ELOOP, ENAMETOOLONG, ...
        raise InputError(f"cannot be resolved: {e.strerror}") from None


def read_within(path: Path, root: Path, limit: int) -> bytes | None:
    """The bytes of `path`, a regular file of at most `limit` bytes that is, or links to, a file
    inside `root`; None when nothing at all is there. InputError (a message that shows nothing
    of the file) for a link out of `root`, a link loop, a FIFO, a device, a directory, a file too big."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InputError(f"cannot be read: {e.strerror}") from None
    target = Path(path)
    if stat.S_ISLNK(st.st_mode):
        target = resolved(path)
        if not target.is_relative_to(resolved(root)):
            raise InputError(f"is a symbolic link to {short(target)}, outside {short(root)}")
        if not target.exists():
            raise InputError("is a broken symbolic link")
    return read_regular(target, limit)


def check_output(path: Path, flag: str, *, folder: bool, keep: tuple[Path, ...] = ()) -> None:
    """Whether `path` can be written: a folder (folder=True) or a file, in a place that exists as a
    folder or can be made one, outside /proc, /sys and /dev, and never one of `keep` (the matrix
    file). ConfigError naming the flag otherwise, before anything is written: the OS's own message
    would come mid-run, with exit 1."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(printable(f"{flag} {short(path)}: {why}"))

    try:
        real = resolved(path)
    except InputError as e:
        raise refuse(str(e)) from None
    if in_pseudo_fs(real):
        raise refuse("is in a pseudo file system (/proc, /sys, /dev)")
    if any(real == resolved(k) for k in keep):
        raise refuse("is the matrix file, which is never overwritten")
    if os.path.lexists(real):
        mode = os.lstat(real).st_mode
        if folder and not stat.S_ISDIR(mode):
            raise refuse(f"is {kind(mode)}, not a folder")
        if not folder and not stat.S_ISREG(mode):
            raise refuse(f"is {kind(mode)}, not a regular file")
    parent = real if folder else real.parent
    while not os.path.lexists(parent):
        parent = parent.parent
    if not os.path.isdir(parent):
        raise refuse(f"{short(parent)} is a file where a folder should be")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise refuse(f"{short(parent)} cannot be written")
