"""Files a matrix names: only regular files, read within bounds.

The matrix file itself (`read_regular`), CA certificates (`certificates`: only the parsed
CERTIFICATE blocks, never the rest of the file, such as a private key or an environment dump)
and wheelhouse entries (`wheelhouse_files`: regular files inside the wheelhouse, never a link
out of it). matrix.py checks them when the matrix is loaded; render.py calls the same
functions when it writes a context, so what enters an image is what was checked.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from pathlib import Path

MAX_BYTES = 1 << 20
# Pseudo file systems: a "file" there is the state of a process or a device, not a certificate.
REFUSED_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n(.*?)-----END \1-----", re.DOTALL)
_BASE64 = re.compile(rb"[A-Za-z0-9+/=\r\n]+")


WHEEL_SUFFIXES = (".whl", ".gz", ".zip")


class InputError(ValueError):
    """The file cannot be used; the message says why."""


def _short(path: Path | str, limit: int = 120) -> str:
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


def certificates(path: Path) -> bytes:
    """The CERTIFICATE blocks of a PEM file, normalised, one after another."""
    try:
        path = Path(path).resolve()
    except OSError as e:
        raise InputError(f"{_short(path)}: cannot be read: {e.strerror}") from None
    if any(path == root or path.is_relative_to(root) for root in REFUSED_ROOTS):
        raise InputError(f"{_short(path)} is in a pseudo file system, not a certificate file")
    try:
        data = read_regular(path, MAX_BYTES)
    except InputError as e:
        raise InputError(f"{_short(path)}: {e}") from None
    blocks = _BLOCK.findall(data)
    keys = sorted({label.decode() for label, _ in blocks if b"PRIVATE KEY" in label})
    if keys or b"PRIVATE KEY-----" in data:
        raise InputError(f"{_short(path)} holds a private key ({', '.join(keys) or 'PRIVATE KEY'}); "
                       f"give a file with the certificates only")
    out = []
    for label, body in blocks:
        if label != b"CERTIFICATE":
            continue
        if not _BASE64.fullmatch(body):
            raise InputError(f"{_short(path)}: a CERTIFICATE block is not base64")
        try:
            der = base64.b64decode(b"".join(body.split()), validate=True)
        except (binascii.Error, ValueError):
            raise InputError(f"{_short(path)}: a CERTIFICATE block is not valid base64") from None
        if not der.startswith(b"\x30"):
            raise InputError(f"{_short(path)}: a CERTIFICATE block does not hold a DER certificate")
        text = base64.encodebytes(der).decode().replace("\n", "")
        lines = [text[i:i + 64] for i in range(0, len(text), 64)]
        out.append("-----BEGIN CERTIFICATE-----\n" + "\n".join(lines) + "\n-----END CERTIFICATE-----\n")
    if not out:
        raise InputError(f"not a PEM certificate: {path}")
    return "".join(out).encode()


def wheelhouse_files(root: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """(name in the context, regular file to copy) for each wheel of the wheelhouse, and what is
    refused: a symbolic link leading out of the wheelhouse, or a wheel that is not a regular file."""
    root = Path(root).resolve()
    files: list[tuple[str, Path]] = []
    refused: list[str] = []
    for entry in sorted(root.iterdir()):
        if entry.suffix not in WHEEL_SUFFIXES:
            continue
        target = entry.resolve()
        mode = entry.lstat().st_mode
        if stat.S_ISLNK(mode) and not target.is_relative_to(root):
            refused.append(f"{entry.name} is a symbolic link to {target}, outside the wheelhouse")
        elif not target.exists() or not stat.S_ISREG(target.lstat().st_mode):
            what = kind(target.lstat().st_mode) if target.exists() else "a broken link"
            refused.append(f"{entry.name} is {what}, not a regular file")
        else:
            files.append((entry.name, target))
    return files, refused
