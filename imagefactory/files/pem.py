"""The CERTIFICATE blocks of a CA file, and only those: never the rest of the file (a private key,
an environment dump).
"""

from __future__ import annotations

import re


from imagefactory.files.bounded import InputError


CERT_MAX_BYTES = 1 << 20


_BEGIN = re.compile(rb"-----BEGIN ([A-Z0-9 ]{1,64})-----")


_END = re.compile(rb"-----END ([A-Z0-9 ]{1,64})-----")


_BASE64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")


MAX_PEM_BLOCKS = 1000  # a public CA bundle holds about 150 certificates


MAX_CA_FILES = 256


GLOB_CHARS = set("*?[")


def pem_blocks(data: bytes) -> list[tuple[str, bytes, int]]:
    """(label, base64 body, line) of each PEM block, in one pass over the lines (linear time, at
    most MAX_PEM_BLOCKS blocks). A block cut short (a BEGIN without its END, or another
    boundary inside it) is an InputError, not text to skip."""
    blocks: list[tuple[str, bytes, int]] = []
    label: bytes | None = None
    body: list[bytes] = []
    start = 0
    for number, raw in enumerate(data.splitlines(), 1):
        line = raw.strip()
        if label is None:
            m = _BEGIN.fullmatch(line)
            if m:
                label, body, start = m[1], [], number
            continue
        end = _END.fullmatch(line)
        if end and end[1] == label:
            blocks.append((label.decode(), b"".join(body), start))
            label = None
            if len(blocks) > MAX_PEM_BLOCKS:
                raise InputError(f"holds more than {MAX_PEM_BLOCKS} PEM blocks")
        elif line.startswith(b"-----"):
            raise InputError(f"line {start}: the {label.decode()} block is cut short (line {number} is "
                             f"not its END line)")
        else:
            body.append(line)
    if label is not None:
        raise InputError(f"line {start}: the {label.decode()} block is cut short (no END line)")
    return blocks
