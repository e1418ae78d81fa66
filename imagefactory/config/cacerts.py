"""The CA certificate files a matrix names (`ca_certificates`): each checked, and what enters an
image is each certificate parsed and re-encoded, so a key, or anything else labelled CERTIFICATE,
never does. Every run parses them (cryptography's import is a few tens of ms, only for a matrix
with CA files): no cache of checked certificates, whose saving no user would notice."""

from __future__ import annotations

import base64
import binascii
import glob
from pathlib import Path

from imagefactory.files import pem
from imagefactory.files.bounded import InputError, read_real, resolved, short
from imagefactory.files.pem import CERT_MAX_BYTES, GLOB_CHARS, MAX_CA_FILES, pem_blocks


def certificates(path: Path) -> bytes:
    """The X.509 certificates of a PEM file, re-encoded, one after another. Every CERTIFICATE
    block must parse as a certificate (a key or anything else labelled CERTIFICATE is refused);
    a file with a private key anywhere in it, or a block cut short, is refused whole."""
    real, _, blocks = _pem_file(path)
    return _parsed_certificates(real, blocks)


def _pem_file(path: Path) -> tuple[Path, bytes, list[tuple[str, bytes, int]]]:
    """The file's real path, its bytes and its PEM blocks; InputError for a key or a cut block."""
    try:
        path, data = read_real(path, CERT_MAX_BYTES)
    except InputError as e:
        raise InputError(f"{short(path)}: {e}") from None
    if b"PRIVATE KEY-----" in data:  # whole or cut short, a key never enters an image
        keys = sorted({m.decode() for m in pem._BEGIN.findall(data) if b"PRIVATE KEY" in m})
        raise InputError(f"{short(path)} holds a private key ({', '.join(keys) or 'PRIVATE KEY'}); "
                         f"give a file with the certificates only")
    try:
        return path, data, pem_blocks(data)
    except InputError as e:
        raise InputError(f"{short(path)}: {e}") from None


def _parsed_certificates(path: Path, blocks: list[tuple[str, bytes, int]]) -> bytes:
    """Each CERTIFICATE block parsed by cryptography and re-encoded by it."""
    from cryptography import x509  # 30 ms to import: only for a matrix with CA files
    from cryptography.hazmat.primitives import serialization

    out = []
    for label, body, line in blocks:
        if label != "CERTIFICATE":
            continue
        if not pem._BASE64.fullmatch(body):
            raise InputError(f"{short(path)}:{line}: a CERTIFICATE block is not base64")
        try:
            der = base64.b64decode(body, validate=True)
            cert = x509.load_der_x509_certificate(der)
        except (binascii.Error, ValueError):
            raise InputError(f"{short(path)}:{line}: a CERTIFICATE block does not hold an X.509 "
                             f"certificate (not valid base64, or DER that is something else, such as a key)") from None
        out.append(cert.public_bytes(serialization.Encoding.PEM))
    if not out:
        raise InputError(f"not a PEM certificate: {short(path)}")
    return b"".join(out)


def ca_files(entry: str, base_dir: Path) -> list[Path]:
    """The certificate files one `ca_certificates` entry names, each checked, links followed.
    A glob may have wildcards only in its file name: it lists one directory, never walks a tree
    (`/*/*/*.pem` would read the whole host), and matches at most MAX_CA_FILES files."""
    pattern = base_dir / entry
    if not GLOB_CHARS & set(entry):
        found = [pattern]
    else:
        if GLOB_CHARS & set(str(pattern.parent)):
            raise InputError(f"{short(entry)}: wildcards are allowed only in the file name (a glob lists "
                             f"one directory), e.g. certs/*.pem")
        try:
            names = sorted(glob.glob(pattern.name, root_dir=pattern.parent))
        except OSError as e:
            raise InputError(f"{short(pattern.parent)}: cannot be listed: {e.strerror}") from None
        if len(names) > MAX_CA_FILES:
            raise InputError(f"{short(entry)} matches {len(names)} files, more than {MAX_CA_FILES}")
        found = [pattern.parent / name for name in names]
        if not found:
            raise InputError(f"no file matches {short(pattern)}")
    out = []
    for p in found:
        certificates(p)
        out.append(resolved(p))
    return out
