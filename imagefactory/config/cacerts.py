"""The CA certificate files a matrix names (`ca_certificates`): each checked, and what enters an
image is each certificate parsed and re-encoded, so a key, or anything else labelled CERTIFICATE,
never does. Bytes parsed before are not parsed again (passcache.py), so that a run of an
unchanged matrix imports no X.509 parser. Its own module: inputs.py sits below passcache.py."""

from __future__ import annotations

import base64
import binascii
import glob
from pathlib import Path

from imagefactory.files import pem
from imagefactory.files import store as passcache
from imagefactory.files.bounded import InputError, read_real, resolved, short
from imagefactory.files.pem import CERT_MAX_BYTES, GLOB_CHARS, MAX_CA_FILES, pem_blocks

CERTS_CHECKED = "certificates-checked.json"  # passcache.py's file for certificates()


def certificates(path: Path) -> bytes:
    """The X.509 certificates of a PEM file, re-encoded, one after another. Every CERTIFICATE
    block must parse as a certificate (a key or anything else labelled CERTIFICATE is refused);
    a file with a private key anywhere in it, or a block cut short, is refused whole.

    Bytes that cryptography parsed before, and whose re-encoding was exactly the PEM of their own
    DER (what _plain_pem makes without cryptography), are not parsed again (passcache.py: the key
    covers the bytes, that re-encoding, this module's source and cryptography's version): its import is ~30 ms of every
    run of a matrix with CA files."""
    real, data, blocks = _pem_file(path)
    plain = _plain_pem(blocks)
    key = _certificates_key(data, plain) if plain is not None else None
    if key is not None and passcache.passed(CERTS_CHECKED, key):
        return plain  # type: ignore[return-value]  # key is None whenever plain is
    out = _parsed_certificates(real, blocks)
    if key is not None and out == plain:
        passcache.remember(CERTS_CHECKED, key)
    return out


def _certificates_key(data: bytes, plain: bytes) -> str:
    import hashlib

    import cryptography  # its own package only (1 ms), for the version

    h = hashlib.sha256(f"imagefactory-certificates/1\0{cryptography.__version__}\0".encode())
    h.update(passcache.code_digest(__name__).encode())
    h.update(hashlib.sha256(plain).digest())
    h.update(data)
    return h.hexdigest()


def _plain_pem(blocks: list[tuple[str, bytes, int]]) -> bytes | None:
    """Each CERTIFICATE block's DER as PEM (64 base64 characters a line), or None when a block is
    not base64 or there is none: what cryptography's public_bytes(PEM) writes for a certificate."""
    out = []
    for label, body, _ in blocks:
        if label != "CERTIFICATE":
            continue
        if not pem._BASE64.fullmatch(body):
            return None
        try:
            b64 = base64.b64encode(base64.b64decode(body, validate=True))
        except binascii.Error:
            return None
        lines = b"\n".join(b64[i:i + 64] for i in range(0, len(b64), 64))
        out.append(b"-----BEGIN CERTIFICATE-----\n" + lines + b"\n-----END CERTIFICATE-----\n")
    return b"".join(out) or None


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
    from cryptography import x509  # 30 ms to import: only for CA files not checked before
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
