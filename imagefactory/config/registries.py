"""Registry policy, in one place: what a registry is to imagefactory (`Registry`: its host, its
API base and scheme, Docker Hub's API host, `library/` rule and config key, its login's variable
names) and what a matrix may do with registries (the allow-list, each registry's compression).

Every step that talks to a registry asks this module instead of comparing host strings: the
engine's logins and HTTP client (engine/logins.py, engine/registry.py), signing and verify
(attest/), the pushes, lists and sizes (publish/). A new registry rule or a new compression is a
change here and in the schema (`resources/matrix.schema.json`), nothing else.

The reference grammar (what part of a reference names the registry, Docker Hub's spellings of
itself) is refs.py's, as it is distribution/reference's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from imagefactory.config import refs
from imagefactory.config.model import Matrix

DOCKER_HUB = refs.DOCKER_HUB
HUB_API_HOST = "registry-1.docker.io"  # Docker Hub's /v2/ API
HUB_AUTH_KEY = "https://index.docker.io/v1/"  # Docker Hub's key in a Docker config's `auths`
# Loopback registries are plain HTTP, as Docker trusts them; every other one is HTTPS.
LOOPBACK_RE = re.compile(r"localhost|\[::1\]|127(?:\.[0-9]{1,3}){3}")

# The login of `image`'s registry; a registry under tags.registries adds _<HOST> (Registry.env_suffix).
USER_ENV = "IMAGEFACTORY_REGISTRY_USER"
PASSWORD_ENV = "IMAGEFACTORY_REGISTRY_PASSWORD"

# -- compressions ----------------------------------------------------------------------------------
# How pushed layers are compressed (the schema's `compression` enum): gzip is the engine's own push;
# the rest BuildKit recompresses a tested image's layers to at push time.
GZIP = "gzip"
RECOMPRESSED = ("zstd", "estargz")
COMPRESSIONS = (GZIP, *RECOMPRESSED)
ZSTD_TYPES = ("application/vnd.oci.image.layer.v1.tar+zstd",)
# An eStargz layer is a gzip layer whose descriptor names its table of contents (BuildKit's
# compression=estargz; stargz-snapshotter's key): any launcher pulls it as gzip.
ESTARGZ_TOC = "containerd.io/snapshot/stargz/toc.digest"


def layer_compression(media_type: str, estargz: bool) -> str:
    """How one pushed layer is compressed, from its descriptor (media type, eStargz TOC named)."""
    return "zstd" if media_type in ZSTD_TYPES else "estargz" if estargz else GZIP


def host_of(registry: str) -> str:
    """The host of 'host[:port]' ('[::1]:5000' -> '[::1]')."""
    return registry.split("]", 1)[0] + "]" if registry.startswith("[") else registry.rsplit(":", 1)[0]


def is_loopback(host: str) -> bool:
    return LOOPBACK_RE.fullmatch(host) is not None


@dataclass(frozen=True)
class Registry:
    """One registry, by its normalised host[:port] ('docker.io' for Docker Hub)."""

    host: str

    @classmethod
    def of(cls, ref: str) -> Registry:
        """The registry `ref` lives on (Docker Hub for a non-reference, as every caller had it)."""
        return cls(refs.registry(ref) or DOCKER_HUB)

    @property
    def is_hub(self) -> bool:
        return self.host == DOCKER_HUB

    @property
    def scheme(self) -> str:
        return "http" if is_loopback(host_of(self.host)) else "https"

    @property
    def api(self) -> str:
        """The base URL of its /v2/ API."""
        return f"{self.scheme}://{HUB_API_HOST if self.is_hub else self.host}/v2"

    def path(self, path: str) -> str:
        """The repository path its API names: an official Docker Hub image is under `library/`."""
        return path if not self.is_hub or "/" in path else f"library/{path}"

    @property
    def auth_key(self) -> str:
        """Its key in a Docker config's `auths`."""
        return HUB_AUTH_KEY if self.is_hub else self.host

    @property
    def env_suffix(self) -> str:
        """The <HOST> of its credential variables (IMAGEFACTORY_REGISTRY_USER_<HOST>):
        'ghcr.io' -> 'GHCR_IO', 'reg.example.com:5000' -> 'REG_EXAMPLE_COM_5000'."""
        return env_suffix(self.host)

    def credential_variables(self, own: bool) -> tuple[str, str]:
        """(user, password) variable names of its login: `image`'s registry (`own`) has the plain pair."""
        return (USER_ENV, PASSWORD_ENV) if own else (f"{USER_ENV}_{self.env_suffix}", f"{PASSWORD_ENV}_{self.env_suffix}")


def env_suffix(registry: str) -> str:
    """Registry(registry).env_suffix: one mapping, so the matrix refuses registries it would confuse."""
    return re.sub(r"[^A-Z0-9]", "_", registry.upper())


# -- the allow-list --------------------------------------------------------------------------------

def allowed(image: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The registries tags may point at: `image`'s first, then those the matrix names (normalised)."""
    own = refs.registry(image) or DOCKER_HUB
    return tuple(dict.fromkeys([own] + [refs.normal_registry(r) for r in extra]))


def allowed_registries(matrix: Matrix) -> tuple[str, ...]:
    return allowed(matrix.image, matrix.registries)


def credential_clashes(allowed: tuple[str, ...]) -> list[str]:
    """Registries under tags.registries whose names map to one credential variable (they differ
    only in '.', '-' or ':'): one would be sent the other's login, so the matrix is refused."""
    seen: dict[str, str] = {}
    out = []
    for registry in allowed[1:]:  # allowed[0], image's registry, uses the variables without a suffix
        suffix = env_suffix(registry)
        if suffix in seen:
            out.append(f"registries {seen[suffix]} and {registry} would share the credential variables "
                       f"{USER_ENV}_{suffix}/PASSWORD_{suffix}, so one would get the other's "
                       f"login; publish to one of them from this matrix")
        seen.setdefault(suffix, registry)
    return out


def not_allowed(ref: str, registry: str, allowed: tuple[str, ...]) -> str | None:
    """Why a tag `ref` on `registry` may not be pushed for the allow-list (None when it may).
    allowed[0] is the registry of `image`."""
    if registry in allowed:
        return None
    return (f"{ref!r} points at registry {registry}, not {allowed[0]} (the registry of image); "
            f"list it under tags.registries to publish there (it then gets only its own credentials)")


# -- compression per registry ----------------------------------------------------------------------

def compression_for(matrix: Matrix, ref: str) -> str:
    """How layers pushed as `ref` are compressed (`compression`, `tags.compression`)."""
    return matrix.compression_for(Registry.of(ref).host)


def compressed_with(matrix: Matrix, how: str) -> list[str]:
    """The registries this matrix pushes `how` layers to (`compression`, `tags.compression`)."""
    return [r for r in allowed_registries(matrix) if matrix.compression_for(r) == how]


def recompressed(matrix: Matrix) -> dict[str, list[str]]:
    """{zstd | estargz: its registries}: the pushes BuildKit recompresses (gzip: the engine's own)."""
    return {how: found for how in RECOMPRESSED if (found := compressed_with(matrix, how))}
