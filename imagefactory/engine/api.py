"""The container engine as the pipeline sees it: value types and the ContainerEngine interface.

This module imports no Docker SDK and constructs no engine. Every command takes a
`ContainerEngine` (or an `EngineFactory`, one engine per worker thread); engine/docker.py implements
it with the Docker SDK for Python, given a builder (its ClassicBuilder, or buildkit.py's BuildxBuilder
running `docker buildx`), tests/fake_engine.py in memory, and engine/select.py makes the Docker ones.
The registry's HTTP API is a `RegistryClient` of its own (engine/registry.py's HttpRegistry; the
fake's FakeRegistry), the one each engine carries as `registry`. Commands that never talk to an engine (`list`,
`render`, `schema`, `lock --check`) therefore load no SDK at all.

A build is one frozen `BuildRequest` (what to build, for which platform, from which caches);
`Builder` is the one value that says what builds it (the CLI's choice, the engines' kind).

Failures are imagefactory errors (errors.py): BuildError / PushError / EngineError (EngineGone
when the engine stopped answering), and Cancelled once the engine's Interrupt is set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from imagefactory.config import platforms
from imagefactory.errors import ForeignPlatform
from imagefactory.config.platforms import Platform

if TYPE_CHECKING:  # measured only before a push (publish/push.py): a build loads no layer reader
    from imagefactory.engine.layer_sizes import Measured


class Builder(str, Enum):
    """What builds the images: the classic builder (the Docker SDK) or BuildKit (`docker buildx`).
    auto is a choice only (buildkit.select resolves it); an engine is classic or buildkit."""

    auto = "auto"
    buildkit = "buildkit"
    classic = "classic"


@dataclass(frozen=True)
class BuildRequest:
    """One image build. `nocache`: reuse no layer (cold builds). `secrets`: BuildKit secrets
    (id, file), never part of the image; the classic builder has none and refuses them.
    `cache_from`: images whose layers (or inline cache) the build may reuse."""

    context: str  # the build context folder
    tag: str  # the name the image gets
    platform: Platform = platforms.DEFAULT
    network: str | None = "host"  # the RUN steps' network mode (None: the engine's default)
    pull: bool = False  # pull the base image even when it is present
    cache_from: tuple[str, ...] = ()
    nocache: bool = False
    secrets: tuple[tuple[str, Path], ...] = ()


@dataclass
class BuildProgress:
    step: int = 0
    steps: int = 0
    instruction: str = ""


@dataclass(frozen=True)
class RunResult:
    exit_code: int | None  # None: killed at the timeout
    stdout: str
    stderr: str


@dataclass(frozen=True)
class PushOutcome:
    ref: str
    digest: str
    layers_pushed: list[str]
    layers_existing: list[str]


# The media types of what a RegistryClient reads and puts: image manifests and lists (indexes).
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MAX_MANIFEST_BYTES = 4 << 20  # the manifest size every registry must accept (OCI distribution spec)
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Manifest:
    """A manifest or index as the registry serves it: its media type, its digest (the sha256 of
    `body`, checked) and its bytes (at most MAX_MANIFEST_BYTES)."""

    media_type: str
    digest: str
    body: bytes

    @property
    def size(self) -> int:
        return len(self.body)


@dataclass(frozen=True)
class LocalImage:
    """A local image as the engine's store holds it: its size there (uncompressed, as `docker
    images` shows it) and its layers' diff ids, base first."""

    size: int
    diff_ids: tuple[str, ...]


@dataclass(frozen=True)
class EngineInfo:
    version: str
    api_version: str
    runtimes: tuple[str, ...]
    cdi_spec_dirs: tuple[str, ...]  # empty before Docker 25 or when CDI is off
    cpus: int = 0  # CPUs the engine's host has (NCPU)
    architecture: str = ""  # the engine's host's `uname -m` (docker info Architecture: x86_64, aarch64)
    store: str = ""  # the image store: identity.GRAPH_DRIVER or identity.CONTAINERD ("": not said)
    driver: str = ""  # docker info Driver: overlay2 (a graph driver) or the containerd snapshotter (overlayfs)


class RegistryClient(Protocol):
    """The registry's HTTP API (distribution's /v2/, engine/registry.py): what the engine cannot
    read or write through the daemon. RegistryError when the registry refuses, fails or
    contradicts itself; Cancelled once the run's Interrupt is set."""

    def manifest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> Manifest | None:
        """The manifest or index the registry serves for `ref`, its digest checked against its bytes;
        None when it serves none."""
        ...

    def put_manifest(self, ref: str, manifest: Manifest, *, auth_config: dict[str, str] | None = None) -> str:
        """PUT `manifest` (a list) under `ref`; the digest stored."""
        ...

    def digest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str | None:
        """The digest the registry serves `ref` as now (a digest in `ref` is its own); None when it
        names none. The connection's own errors (OSError) are the caller's."""
        ...

    def content(self, pinned: str, kind: str, digest: str, *, auth_config: dict[str, str] | None = None,
                accept: str = "") -> bytes | None:
        """The bytes served for `digest` (`kind`: manifests or blobs) in `pinned`'s repository, for the
        caller to check against `digest`; None when the registry gives none (or too much)."""
        ...


class ContainerEngine(Protocol):
    """Every engine operation the commands use: build, run, inspect, tag, push and pull images.
    The registry's HTTP API is not the engine's: `registry` is the client of it that goes with
    this engine (it resolves logins as the engine's Docker config does)."""

    builder: Builder  # what `build` builds with: Builder.classic or Builder.buildkit, never auto
    registry: RegistryClient

    def describe(self) -> EngineInfo:
        """Version, runtimes, CDI directories and CPU count (EngineError if it will not say)."""
        ...

    def product(self) -> str:
        """What serves the Docker API: DOCKER ("docker") or PODMAN ("podman", `podman system service`),
        from the engine's version answer (asked once a run)."""
        ...

    def images_with_label(self, key: str, value: str) -> dict[str, list[str]]: ...

    def labelled_image(self, ref: str, key: str, value: str) -> str | None:
        """The id of the local image `ref` if it carries label key=value; None if there is no
        such image or its label differs (one inspect, where images_with_label lists them all)."""
        ...

    def image_id(self, ref: str) -> str | None: ...

    def image_platform(self, ref: str) -> str | None:
        """The local image's os/architecture from its config ("linux/arm64"); None if there is none."""
        ...

    def local_image(self, ref: str) -> LocalImage | None:
        """The local image `ref` names: its size in the store and its diff ids; None if there is none."""
        ...

    def layer_sizes(self, ref: str) -> Measured:
        """The compressed layers a push of the local image `ref` would send, base first, each with
        the Dockerfile step that made it (engine/layer_sizes.py: exact blobs or gzip estimates)."""
        ...

    def tag(self, image: str, ref: str) -> None: ...

    def untag(self, ref: str) -> None:
        """Remove the name `ref`, never the image another name still holds."""
        ...

    def remove_image(self, ref: str) -> None:
        """Remove the image `ref` names, with its layers (a bench's own images)."""
        ...

    def build(self, request: BuildRequest, *, log: Callable[[str], None] = ...,
              progress: Callable[[BuildProgress], None] = ...) -> str:
        """Build `request.context` as `request.tag`; the image id. `log` gets each line of the
        build's output, `progress` each step started. ForeignPlatform when this builder cannot
        build `request.platform` (the classic builder: any platform but the engine's own)."""
        ...

    def native_platform(self) -> Platform | None:
        """The platform of the engine's own host (docker info Architecture); None if not in the table."""
        ...

    def gpus_available(self) -> bool: ...

    def run(self, image: str, command: list[str], *, timeout: float, gpus: bool = False,
            environment: dict[str, str] | None = None, cpus: float | None = None,
            options: dict[str, Any] | None = None, platform: Platform | None = None) -> RunResult:
        """Run `command` in a fresh, network-less container of `image`; kill it after
        `timeout` s (exit_code None). `cpus` is `docker run --cpus` (a CFS quota); `options`
        are more container-create options (a launch mode's, see smoke.LaunchMode). `platform`:
        create it as that platform (`docker run --platform`, API 1.41), for an image of another
        platform than the engine's own, run through binfmt/QEMU; None: the engine's default."""
        ...

    def push(self, ref: str, *, auth_config: dict[str, str] | None = None,
             progress: Callable[[dict], None] = ..., compression: str = "gzip") -> PushOutcome:
        """Push the local tag `ref`; `compression` zstd or estargz: its layers recompressed, OCI media types."""
        ...

    def pull(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str:
        """Pull `ref` (name:tag@sha256:...) from its registry; the local image id. EngineError
        when the registry refuses or does not have it."""
        ...

    def registry_digest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str | None:
        """The manifest digest the registry serves for `ref`, asked of the engine (GET /distribution:
        the engine's own logins and mirrors; on podman, which has none, of `registry`). None when
        the registry serves nothing under `ref` or will not say."""
        ...

    def local_repo_digests(self, ref: str) -> list[str]: ...


EngineFactory = Callable[[], ContainerEngine]

DOCKER, PODMAN = "docker", "podman"  # ContainerEngine.product()

_AUTH_WORDS = ("unauthorized", "authentication required", "no basic auth credentials",
               "denied", "forbidden", "incorrect username or password")


def is_transient(message: str) -> bool:
    """Authentication and permission failures never get better by retrying; most else may."""
    low = message.lower()
    return not any(w in low for w in _AUTH_WORDS)


def refuse_foreign(request: BuildRequest, native: Platform | None) -> None:
    """ForeignPlatform unless the classic builder's one platform, the engine's own, is the request's:
    given another it silently builds its own (an amd64 image named as the arm64 cell's)."""
    own = native or platforms.DEFAULT
    if request.platform != own:
        raise ForeignPlatform(f"the classic builder builds only for the engine's own platform ({own.oci}), not "
                              f"{request.platform.oci}; build {request.platform.oci} cells with --builder buildkit")
