"""The wheelhouse's files: regular files inside it, never a link out of it, names checked.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path


from imagefactory.files.bounded import InputError, kind, resolved, short
from imagefactory.terminal import show


MAX_WHEELS = 1000


WHEEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,254}")


WHEEL_SUFFIXES = (".whl", ".gz", ".zip")


def wheelhouse_files(root: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """(name in the context, regular file to copy) for each wheel of the wheelhouse, and what is
    refused: a symbolic link leading out of the wheelhouse (or in a loop), a wheel that is not a
    regular file, a name that is not a plain file name (it goes into the context and pip's
    command line as it is)."""
    root = resolved(root)
    files: list[tuple[str, Path]] = []
    refused: list[str] = []
    try:
        entries = sorted(root.iterdir())
    except OSError as e:
        raise InputError(f"cannot be read: {e.strerror}") from None
    for entry in entries:
        if entry.suffix not in WHEEL_SUFFIXES:
            continue
        if len(files) >= MAX_WHEELS:
            refused.append(f"more than {MAX_WHEELS} wheels")
            break
        if not WHEEL_NAME_RE.fullmatch(entry.name):
            refused.append(f"{show(entry.name)} is not a wheel or archive file name (letters, digits, . _ + -)")
            continue
        try:
            target = resolved(entry)
        except InputError as e:
            refused.append(f"{entry.name} {e}")
            continue
        mode = entry.lstat().st_mode
        if stat.S_ISLNK(mode) and not target.is_relative_to(root):
            refused.append(f"{entry.name} is a symbolic link to {short(target)}, outside the wheelhouse")
        elif not target.exists() or not stat.S_ISREG(target.lstat().st_mode):
            what = kind(target.lstat().st_mode) if target.exists() else "a broken link"
            refused.append(f"{entry.name} is {what}, not a regular file")
        else:
            files.append((entry.name, target))
    return files, refused
