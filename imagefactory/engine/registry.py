"""The registry HTTP API (distribution's /v2/), in one place: what the engine cannot do through the
Docker daemon (read a manifest as the registry serves it, PUT a list) and what `verify` reads.

- Where a registry's API is (its scheme, host and paths: loopback registries are plain HTTP, Docker
  Hub's API is registry-1.docker.io) is config/registries.py's `Registry`.
- A 401 is answered once: Basic with the registry's own credentials, or Bearer through the token
  realm the challenge names (an https URL, or http on loopback only; its service and scope checked
  whole). The token is checked whole before it goes into a header.
- Every body is read bounded: at most MAX_BYTES + 1 bytes are kept, so a caller sees an answer
  that is too large by its length, never by the memory it took.
- Nothing a registry says is echoed raw: errors carry the HTTP status, the error code when it is
  one of distribution's (`MANIFEST_UNKNOWN`), and values shown through `shown` (escaped, capped).

The references are parsed by refs.py (the one grammar); a digest is sha256:<64 hex>, whole.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from imagefactory.config import refs
from imagefactory.config.registries import Registry, host_of, is_loopback
from imagefactory.engine.api import DIGEST_RE, INDEX_TYPES, MANIFEST_TYPES, Manifest
from imagefactory.engine.api import MAX_MANIFEST_BYTES as MAX_BYTES
from imagefactory.errors import RegistryError
from imagefactory.interrupt import Interrupt

TIMEOUT = (5, 20)  # connect, read (s): an interrupt is seen between requests, so keep them short
_REALM_RE = re.compile(rf"(?P<scheme>https?)://(?P<host>{refs._DOMAIN})(?P<path>/[A-Za-z0-9._~/-]*)?", re.ASCII)
_PARAM_RE = re.compile(r"[A-Za-z0-9._:/,*@+-]{1,512}", re.ASCII)  # service, scope
_TOKEN_RE = re.compile(r"[A-Za-z0-9._~+/=-]{1,16384}", re.ASCII)
_CODE_RE = re.compile(r"[A-Z][A-Z_]{0,63}", re.ASCII)
Auth = dict[str, str]


@dataclass(frozen=True)
class Reply:
    """A registry's answer, its body bounded (longer than MAX_BYTES means too large)."""

    status_code: int
    headers: Mapping[str, str] = field(default_factory=dict)
    content: bytes = b""

    def json(self) -> Any:
        return json.loads(self.content)


def shown(text: object, limit: int = 80) -> str:
    """A value a registry gave, safe to print: escaped (ascii()), capped."""
    return ascii(str(text)[:limit])


def _bounded(response: Any) -> bytes:
    body = b""
    for chunk in response.iter_content(65536):
        body += chunk
        if len(body) > MAX_BYTES:
            break
    response.close()
    return body[:MAX_BYTES + 1]


def _send(method: str, url: str, headers: dict[str, str], data: bytes | None, basic: tuple[str, str] | None) -> Reply:
    import requests

    r = requests.request(method, url, headers=headers, data=data, auth=basic, timeout=TIMEOUT, stream=True,
                         allow_redirects=method in ("GET", "HEAD"))
    return Reply(r.status_code, r.headers, b"" if method == "HEAD" else _bounded(r))


def _token(challenge: str, basic: tuple[str, str] | None) -> str | None:
    """The Bearer token the challenge's realm gives, or None when the challenge is not one to follow."""
    params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    realm = _REALM_RE.fullmatch(params.pop("realm", ""))
    if realm is None or (realm["scheme"] == "http" and not is_loopback(host_of(realm["host"]))):
        return None
    query = {k: v for k, v in params.items() if k in ("service", "scope") and _PARAM_RE.fullmatch(v)}
    import requests

    r = requests.get(realm.group(0), params=query, auth=basic, timeout=TIMEOUT, stream=True)
    body = _bounded(r)
    try:
        doc = json.loads(body) if r.ok and len(body) <= MAX_BYTES else {}
    except ValueError:
        return None
    token = str(doc.get("token") or doc.get("access_token") or "") if isinstance(doc, dict) else ""
    return token if _TOKEN_RE.fullmatch(token) else None


def request(method: str, url: str, auth: Auth | None, accept: str = "", *, content_type: str = "",
            data: bytes | None = None) -> Reply:
    """One registry request, answering a Basic or Bearer challenge once. requests' errors (OSErrors)
    go to the caller."""
    headers = {k: v for k, v in (("Accept", accept), ("Content-Type", content_type)) if v}
    basic = (auth["username"], auth["password"]) if auth else None
    r = _send(method, url, headers, data, None)
    if r.status_code != 401:
        return r
    challenge = r.headers.get("WWW-Authenticate", "")
    if challenge.lower().startswith("bearer"):
        token = _token(challenge, basic)
        return r if token is None else _send(method, url, {**headers, "Authorization": f"Bearer {token}"}, data, None)
    return _send(method, url, headers, data, basic) if basic else r


def _url(ref: str) -> tuple[str, str]:
    """(manifest URL, reference part) of `ref`; RegistryError for a non-reference."""
    parsed = refs.parse(ref)
    if parsed is None:
        raise RegistryError(f"{shown(ref, 200)} is not an image reference", transient=False)
    registry = Registry(parsed.registry)
    reference = parsed.digest or parsed.tag or "latest"
    return f"{registry.api}/{registry.path(parsed.path)}/manifests/{reference}", reference


def _failure(what: str, r: Reply) -> RegistryError:
    try:
        errors = r.json().get("errors") or []
        code = str(errors[0].get("code", ""))
    except (ValueError, AttributeError, IndexError, TypeError):
        code = ""
    why = f"HTTP {r.status_code}" + (f" {code}" if _CODE_RE.fullmatch(code) else "")
    return RegistryError(f"{what}: the registry answered {why}", transient=r.status_code >= 500 or r.status_code == 429)


def _call(method: str, url: str, auth: Auth | None, what: str, **kwargs: Any) -> Reply:
    try:
        return request(method, url, auth, **kwargs)
    except OSError as e:  # requests' errors
        raise RegistryError(f"{what}: the registry did not answer ({type(e).__name__})", transient=True) from None


def get_manifest(ref: str, auth: Auth | None) -> Manifest | None:
    """The manifest (or index) the registry serves for `ref`, its digest checked against its bytes;
    None when the registry has none under that name."""
    url, reference = _url(ref)
    what = f"reading {ref}"
    r = _call("GET", url, auth, what, accept=", ".join(MANIFEST_TYPES + INDEX_TYPES))
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        raise _failure(what, r)
    if len(r.content) > MAX_BYTES:
        raise RegistryError(f"{what}: the registry's manifest is larger than {MAX_BYTES >> 20} MiB", transient=False)
    media_type = r.headers.get("Content-Type", "").split(";", 1)[0].strip()
    if media_type not in MANIFEST_TYPES + INDEX_TYPES:
        raise RegistryError(f"{what}: the registry serves media type {shown(media_type)}", transient=False)
    digest = "sha256:" + hashlib.sha256(r.content).hexdigest()
    named = r.headers.get("Docker-Content-Digest", digest)
    if DIGEST_RE.fullmatch(reference) and reference != digest:  # whatever digest it names for them
        said = f", named {shown(named)}" if "Docker-Content-Digest" in r.headers else ""
        raise RegistryError(f"{what}: the registry served other bytes (their sha256 is {digest}{said})",
                            transient=False)
    if named != digest:
        raise RegistryError(f"{what}: the registry names digest {shown(named)} for a manifest whose sha256 is "
                            f"{digest}", transient=False)
    return Manifest(media_type, digest, r.content)


def put_manifest(ref: str, manifest: Manifest, auth: Auth | None) -> str:
    """PUT `manifest` under `ref` (a tag or its own digest); the digest the registry stored it as."""
    url, _ = _url(ref)
    what = f"putting {ref}"
    if len(manifest.body) > MAX_BYTES or manifest.media_type not in MANIFEST_TYPES + INDEX_TYPES:
        raise RegistryError(f"{what}: not a manifest to put ({manifest.media_type[:60]})", transient=False)
    r = _call("PUT", url, auth, what, content_type=manifest.media_type, data=manifest.body)
    if r.status_code not in (200, 201):
        raise _failure(what, r)
    stored = r.headers.get("Docker-Content-Digest", manifest.digest)
    if stored != manifest.digest:
        raise RegistryError(f"{what}: the registry stored it as {shown(stored)}, not {manifest.digest}",
                            transient=False)
    return stored


def served_digest(ref: str, auth: Auth | None) -> str | None:
    """The digest the registry serves `ref` as now (a HEAD of its tag; a digest in `ref` is its own);
    None for a non-reference or when the registry names none. The path is `ref`'s as written.
    requests' errors (OSErrors) go to the caller."""
    parsed = refs.parse(ref)
    if parsed is None:
        return None
    if parsed.digest:
        return parsed.digest
    url = f"{Registry(parsed.registry).api}/{parsed.path}/manifests/{parsed.tag or 'latest'}"
    r = request("HEAD", url, auth, ", ".join(MANIFEST_TYPES + INDEX_TYPES))
    digest = r.headers.get("Docker-Content-Digest", "") if r.status_code == 200 else ""
    return digest if DIGEST_RE.fullmatch(digest) else None


def content(pinned: str, kind: str, digest: str, auth: Auth | None, accept: str = "") -> bytes | None:
    """The bytes the registry serves for `digest` (`kind`: manifests or blobs) in `pinned`'s repository
    (its path as written), unchecked: the caller holds them against `digest`. None when it gives none,
    or more than MAX_BYTES. requests' errors (OSErrors) go to the caller."""
    parsed = refs.parse(pinned)
    assert parsed is not None
    r = request("GET", f"{Registry(parsed.registry).api}/{parsed.path}/{kind}/{digest}", auth, accept)
    if r.status_code != 200 or len(r.content) > MAX_BYTES:
        return None
    return r.content


class HttpRegistry:
    """The registry's HTTP API as a client of its own (implements engine.api.RegistryClient): what
    the engine cannot read or write through the daemon. `login(ref)`: the credentials a call without
    auth_config is given (the Docker config's for the ref's registry: engine.docker gives it); the
    interrupt is checked before and after each call."""

    def __init__(self, interrupt: Interrupt, login: Callable[[str], Auth | None] = lambda ref: None) -> None:
        self.interrupt = interrupt
        self._login = login

    def manifest(self, ref: str, *, auth_config: Auth | None = None) -> Manifest | None:
        self.interrupt.check()
        manifest = get_manifest(ref, auth_config or self._login(ref))
        self.interrupt.check()
        return manifest

    def put_manifest(self, ref: str, manifest: Manifest, *, auth_config: Auth | None = None) -> str:
        self.interrupt.check()
        stored = put_manifest(ref, manifest, auth_config or self._login(ref))
        self.interrupt.check()
        return stored

    def digest(self, ref: str, *, auth_config: Auth | None = None) -> str | None:
        self.interrupt.check()
        found = served_digest(ref, auth_config or self._login(ref))
        self.interrupt.check()
        return found

    def content(self, pinned: str, kind: str, digest: str, *, auth_config: Auth | None = None,
                accept: str = "") -> bytes | None:
        self.interrupt.check()
        found = content(pinned, kind, digest, auth_config or self._login(pinned), accept)
        self.interrupt.check()
        return found
