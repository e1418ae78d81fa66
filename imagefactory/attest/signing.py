"""Signing with cosign: the one module that runs it.

`--sign KEY` (push, build --push) signs each pushed digest once the push is verified, and
attaches the cell's SBOM (`--type cyclonedx`) and provenance (`--type slsaprovenance1`) as
attestations; `imagefactory verify` checks them (verify.py, through the functions here).

- cosign 2.x only: cosign 3 changes the signing flags and defaults (bundle format,
  `--signing-config`). `cosign version` gives the version; a distribution build that says
  "devel" is judged by its flags instead (see check_version).
- Offline: `--tlog-upload=false` to sign, `--insecure-ignore-tlog` to verify: nothing is sent to
  a transparency log and no TUF root is fetched.
- Secrets: the key's password comes only from COSIGN_PASSWORD, handed to cosign in its
  environment (sign and attest only); the registry login goes through a temporary Docker config
  (DOCKER_CONFIG, a 0700 folder removed afterwards), never on the command line. What cosign prints
  is shown as a short tail, the secrets replaced and control characters escaped.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from imagefactory.files import bounded
from imagefactory import terminal
from imagefactory.config import refs
from imagefactory.config.registries import Registry
from imagefactory.config import tags
from imagefactory.errors import ConfigError, ImageFactoryError

PASSWORD_ENV = "COSIGN_PASSWORD"
COSIGN_ENV = "IMAGEFACTORY_COSIGN"  # the cosign executable (default: cosign on PATH)
MAJOR = 2
TIMEOUT = 180.0
TAIL_CHARS = 300
KMS_RE = re.compile(r"(?:awskms|gcpkms|azurekms|hashivault|k8s)://[A-Za-z0-9._~:/?#@!$&'()*+,;=%-]{1,500}")
SEMVER_RE = re.compile(r"v?([0-9]{1,4})\.([0-9]{1,4})\.([0-9]{1,4})(?:[-+][0-9A-Za-z.+-]{1,60})?")
PRIVATE_PEM = re.compile(rb"-----BEGIN ENCRYPTED (?:SIGSTORE|COSIGN) PRIVATE KEY-----")
PUBLIC_PEM = re.compile(rb"-----BEGIN PUBLIC KEY-----")
TYPES = ("cyclonedx", "slsaprovenance1")  # the attestations every signed image carries
# cosign's answers to `verify`: measured with cosign 2.5
EXIT_NO_SIGNATURE, EXIT_WRONG_KEY = 10, 12

Auth = dict[str, str]


class SigningError(ImageFactoryError):
    """cosign failed to sign, attest or answer (exit 1)."""


class Refused(ImageFactoryError):
    """A verification failed; `kind` says which check: signature, key, attestation, sbom."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Key:
    ref: str  # an absolute path, or a KMS URI passed through to cosign
    kms: bool

    @property
    def shown(self) -> str:
        return self.ref


def check_key(value: str, *, private: bool, flag: str) -> Key:
    """A key file (absolute, regular, a PEM cosign key of the right kind) or a KMS URI. A private
    key file's password must be in COSIGN_PASSWORD (empty for a key made without one)."""
    if KMS_RE.fullmatch(value):
        return Key(value, True)
    if "://" in value:
        raise ConfigError(f"{flag} {terminal.show(value)}: not a key file, and not a KMS URI cosign takes "
                          "(awskms://, gcpkms://, azurekms://, hashivault://, k8s://)")
    path = Path(value).expanduser()
    try:
        data = bounded.read_regular(path, 64 << 10)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {terminal.show(value)}: cannot read the key file ({e})") from None
    pem = PRIVATE_PEM if private else PUBLIC_PEM
    if not pem.search(data):
        kind = "an encrypted cosign private key (cosign generate-key-pair)" if private else "a PEM public key"
        raise ConfigError(f"{flag} {terminal.show(value)}: not {kind}")
    if private and PASSWORD_ENV not in os.environ:
        raise ConfigError(f"{flag}: set {PASSWORD_ENV} to the key's password (empty for a key without one); "
                          "it is read from the environment only")
    return Key(str(path.resolve()), False)


def executable() -> str:
    exe = os.environ.get(COSIGN_ENV) or shutil.which("cosign")
    if not exe or not os.access(exe, os.X_OK):
        raise ConfigError(f"cosign not found ({COSIGN_ENV} or PATH): install cosign {MAJOR}.x "
                          "(scripts/ci-setup.sh installs Debian's)")
    return exe


@functools.lru_cache(maxsize=8)
def check_version(exe: str) -> str:
    """The version of cosign at `exe`, refused unless it is 2.x. An unversioned build ("devel",
    as Debian's reports) passes only with cosign 2's signing flags and without cosign 3's."""
    out = _plain(exe, ["version", "--json"])
    try:
        version = str(json.loads(out).get("gitVersion", ""))
    except (ValueError, AttributeError):
        version = ""
    m = SEMVER_RE.fullmatch(version)
    if m:
        if int(m[1]) != MAJOR:
            raise ConfigError(f"cosign {version} at {exe}: imagefactory drives cosign {MAJOR}.x (cosign 3 "
                              f"changed the signing flags and defaults); install cosign {MAJOR}.x")
        return version
    flags = _plain(exe, ["sign", "--help"])
    if "--tlog-upload" not in flags or "--signing-config" in flags or "--use-signing-config" in flags:
        raise ConfigError(f"cosign at {exe} reports no version ({terminal.show(version or 'none')}) and its `sign` has "
                          f"not cosign {MAJOR}'s flags: install cosign {MAJOR}.x")
    return f"{version or 'unversioned'} (cosign {MAJOR} flags)"


def _plain(exe: str, args: list[str]) -> str:
    try:
        r = subprocess.run([exe, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tempfile.gettempdir()})
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"cosign at {exe} does not run: {type(e).__name__}") from None
    return r.stdout + r.stderr


def ready(value: str, *, private: bool, flag: str) -> Key:
    """--sign / --key checked before anything is built or fetched: cosign 2.x there, the key usable."""
    check_version(executable())
    return check_key(value, private=private, flag=flag)


# -- running cosign --------------------------------------------------------------------------------

@contextmanager
def docker_config(registry: str, auth: Auth | None) -> Iterator[Path | None]:
    """A temporary Docker config (0700 folder, 0600 file) holding `auth` for `registry` alone,
    removed afterwards; None without auth (cosign then reads the user's own, as `docker` does)."""
    if auth is None:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="imagefactory-cosign-"))
    try:
        os.chmod(folder, 0o700)
        token = base64.b64encode(f"{auth['username']}:{auth['password']}".encode()).decode()
        fd = os.open(folder / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": {Registry(registry).auth_key: {"auth": token}}}, f)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


_PASS_ENV = ("PATH", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
             "SSL_CERT_FILE", "SSL_CERT_DIR")
_KMS_ENV = re.compile(r"(?:AWS|GOOGLE|VAULT|AZURE|KUBECONFIG)[A-Z0-9_]*")


def environment(config: Path | None, key: Key, *, password: bool) -> dict[str, str]:
    """cosign's whole environment: the password only when it signs, KMS settings only for a
    KMS key, the temporary Docker config when there is one (else the user's)."""
    env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    env["HOME"] = os.environ.get("HOME", tempfile.gettempdir())
    if config is not None:
        env["DOCKER_CONFIG"] = str(config)
    elif "DOCKER_CONFIG" in os.environ:
        env["DOCKER_CONFIG"] = os.environ["DOCKER_CONFIG"]
    if key.kms:
        env.update({k: v for k, v in os.environ.items() if _KMS_ENV.fullmatch(k)})
    if password:
        env[PASSWORD_ENV] = os.environ.get(PASSWORD_ENV, "")
    return env


def tail(text: str, secrets: tuple[str, ...] = ()) -> str:
    """cosign's last words: its `Error:` line when it printed one, else its last line; secrets
    replaced, control characters escaped, at most TAIL_CHARS."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    errors = [ln for ln in lines if ln.startswith("Error:")]
    line = (errors or lines or ["no output"])[-1].removeprefix("Error: ")
    for s in secrets:
        if s:
            line = line.replace(s, "***")
    line = terminal.escaped(line)
    return line if len(line) <= TAIL_CHARS else line[:TAIL_CHARS - 3] + "..."


def run(args: list[str], env: dict[str, str], secrets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    exe = executable()
    try:
        return subprocess.run([exe, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        raise SigningError(f"cosign {args[0]} did not finish within {TIMEOUT:.0f} s") from None
    except OSError as e:
        raise SigningError(f"cosign {args[0]} did not start: {e.strerror}") from None


def _secrets(auth: Auth | None) -> tuple[str, ...]:
    return tuple(s for s in ((auth or {}).get("password"), os.environ.get(PASSWORD_ENV)) if s)


# -- signing ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Signed:
    image: str  # repository@sha256:...
    signature: str  # the .sig tag
    attestations: str  # the .att tag

    def as_dict(self, digest_of: dict[str, str | None]) -> dict:
        return {"image": self.image, "signature": self.signature, "signature_digest": digest_of.get(self.signature),
                "attestations": self.attestations, "attestations_digest": digest_of.get(self.attestations),
                "types": list(TYPES)}


SIG_TAG_RE = tags.SIG_TAG_RE


def cosign_tag(tag: str) -> bool:
    """Whether `tag` is one of cosign's own (sha256-<hex>.sig / .att / .sbom): never a release tag."""
    return SIG_TAG_RE.fullmatch(tag) is not None


def sign(key: Key, pinned: str, sbom: Path, predicate: Path, auth: Auth | None) -> Signed:
    """Sign `pinned` (repository@sha256:...) and attach the SBOM and the provenance predicate."""
    registry = Registry.of(pinned).host
    secrets = _secrets(auth)
    steps = [["sign", "--key", key.ref, "--tlog-upload=false", "-y", pinned]] + [
        ["attest", "--key", key.ref, "--tlog-upload=false", "-y", "--replace", "--type", kind,
         "--predicate", str(path), pinned] for kind, path in zip(TYPES, (sbom, predicate))]
    with docker_config(registry, auth) as config:
        env = environment(config, key, password=True)
        for args in steps:
            r = run(args, env, secrets)
            if r.returncode != 0:
                what = args[0] + (f" --type {args[args.index('--type') + 1]}" if "--type" in args else "")
                raise SigningError(f"cosign {what} {pinned} failed (exit {r.returncode}): "
                                   f"{tail(r.stderr + r.stdout, secrets)}")
        sig, att = (_triangulate(pinned, kind, env, secrets) for kind in ("signature", "attestation"))
    return Signed(pinned, sig, att)


def _triangulate(pinned: str, kind: str, env: dict[str, str], secrets: tuple[str, ...]) -> str:
    r = run(["triangulate", "--type", kind, pinned], env, secrets)
    ref = r.stdout.strip()
    parsed = refs.parse(ref)
    if r.returncode != 0 or parsed is None or not cosign_tag(parsed.tag or ""):
        raise SigningError(f"cosign triangulate {pinned}: no {kind} tag ({tail(r.stderr + r.stdout, secrets)})")
    return ref


# -- verifying -------------------------------------------------------------------------------------

def verify_signature(key: Key, pinned: str, auth: Auth | None) -> None:
    """Refused (one line) unless `pinned` carries a signature made with `key`."""
    registry = Registry.of(pinned).host
    with docker_config(registry, auth) as config:
        r = run(["verify", "--key", key.ref, "--insecure-ignore-tlog", "-o", "json", pinned],
                environment(config, key, password=False), _secrets(auth))
    if r.returncode == EXIT_NO_SIGNATURE:
        raise Refused("signature", "no signature")
    if r.returncode == EXIT_WRONG_KEY:
        raise Refused("key", f"not signed with key {key.shown} (signed with another key)")
    if r.returncode != 0:
        raise Refused("signature", f"signature not verified (cosign exit {r.returncode}: {tail(r.stderr)})")


def verified_statements(key: Key, pinned: str, kind: str, auth: Auth | None) -> list[dict]:
    """The in-toto statements of `kind` attached to `pinned` whose signatures `key` verifies;
    Refused when there is none or cosign refuses them."""
    registry = Registry.of(pinned).host
    with docker_config(registry, auth) as config:
        r = run(["verify-attestation", "--key", key.ref, "--insecure-ignore-tlog", "--type", kind, pinned],
                environment(config, key, password=False), _secrets(auth))
    if r.returncode != 0:
        why = tail(r.stderr)
        if "no matching attestations" in why and "Found: 0" in why:
            raise Refused("attestation", f"no {kind} attestation verifies with key {key.shown} "
                                         f"(missing, tampered or signed with another key)")
        raise Refused("attestation", f"{kind} attestation refused: {why}")
    return [_statement(line, kind) for line in r.stdout.splitlines() if line.strip()]


def _statement(line: str, kind: str) -> dict:
    try:
        envelope = json.loads(line)
        statement = json.loads(base64.b64decode(envelope["payload"], validate=True))
    except (ValueError, KeyError, TypeError):
        raise Refused("attestation", f"{kind} attestation: not a DSSE envelope of an in-toto statement") from None
    if not isinstance(statement, dict) or not isinstance(statement.get("predicate"), dict):
        raise Refused("attestation", f"{kind} attestation: the statement has no predicate")
    return statement
