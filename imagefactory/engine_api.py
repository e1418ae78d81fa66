"""The container engine as the pipeline sees it: value types and the ContainerEngine interface.

This module imports no Docker SDK. Every command takes a `ContainerEngine` (or an
`EngineFactory`, one engine per worker thread); engine.py implements it with the Docker SDK
for Python, tests/fake_engine.py in memory. Commands that never talk to an engine (`list`,
`render`, `schema`, `lock --check`) therefore load no SDK at all.

Failures are imagefactory errors (errors.py): BuildError / PushError / EngineError (EngineGone
when the engine stopped answering), and Cancelled once the engine's Interrupt is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from imagefactory.interrupt import Interrupt


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


@dataclass(frozen=True)
class EngineInfo:
    version: str
    api_version: str
    runtimes: tuple[str, ...]
    cdi_spec_dirs: tuple[str, ...]  # empty before Docker 25 or when CDI is off
    cpus: int = 0  # CPUs the engine's host has (NCPU)


class ContainerEngine(Protocol):
    """Every engine operation the commands use."""

    builder: str  # what `build` builds with: "classic" (the Docker SDK) or "buildkit" (docker buildx)

    def describe(self) -> EngineInfo:
        """Version, runtimes, CDI directories and CPU count (EngineError if it will not say)."""
        ...

    def images_with_label(self, key: str, value: str) -> dict[str, list[str]]: ...

    def image_id(self, ref: str) -> str | None: ...

    def tag(self, image: str, ref: str) -> None: ...

    def untag(self, ref: str) -> None:
        """Remove the name `ref`, never the image another name still holds."""
        ...

    def remove_image(self, ref: str) -> None:
        """Remove the image `ref` names, with its layers (a bench's own images)."""
        ...

    def build(self, context: str, tag: str, *, network_mode: str | None = "host",
              log: Callable[[str], None] = ..., progress: Callable[[BuildProgress], None] = ...,
              pull: bool = False, cache_from: list[str] | None = None, nocache: bool = False,
              secrets: Mapping[str, Path] | None = None, platform: str | None = None) -> str:
        """Build `context` as `tag`; the image id. `nocache`: reuse no layer (cold builds).
        `secrets`: BuildKit secrets (id -> file), never part of the image; the classic builder
        has none and refuses them. `platform`: os/arch the image is built for (None: the engine's)."""
        ...

    def gpus_available(self) -> bool: ...

    def run(self, image: str, command: list[str], *, timeout: float, gpus: bool = False,
            environment: dict[str, str] | None = None, cpus: float | None = None,
            options: dict[str, Any] | None = None) -> RunResult:
        """Run `command` in a fresh, network-less container of `image`; kill it after
        `timeout` s (exit_code None). `cpus` is `docker run --cpus` (a CFS quota); `options`
        are more container-create options (a launch mode's, see smoke.LaunchMode)."""
        ...

    def push(self, ref: str, *, auth_config: dict[str, str] | None = None,
             progress: Callable[[dict], None] = ...) -> PushOutcome: ...

    def pull(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str:
        """Pull `ref` (name:tag@sha256:...) from its registry; the local image id. EngineError
        when the registry refuses or does not have it."""
        ...

    def registry_digest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str | None: ...

    def local_repo_digests(self, ref: str) -> list[str]: ...


EngineFactory = Callable[[], ContainerEngine]

_AUTH_WORDS = ("unauthorized", "authentication required", "no basic auth credentials",
               "denied", "forbidden", "incorrect username or password")


def is_transient(message: str) -> bool:
    """Authentication and permission failures never get better by retrying; most else may."""
    low = message.lower()
    return not any(w in low for w in _AUTH_WORDS)


def docker_engine(interrupt: Interrupt | None = None, *, buildkit: bool = False,
                  buildx_builder: str | None = None) -> ContainerEngine:
    """A connected Docker engine (engine.Engine, or buildkit.BuildxEngine that builds with
    `docker buildx`): the Docker SDK is imported here, on first use, never by the commands that
    need no engine. Raises DockerUnavailable."""
    if buildkit:
        from imagefactory.buildkit import BuildxEngine

        return BuildxEngine(interrupt=interrupt, buildx_builder=buildx_builder)
    from imagefactory.engine import Engine

    return Engine(interrupt=interrupt)


def docker_factory(interrupt: Interrupt | None = None, *, buildkit: bool = False,
                   buildx_builder: str | None = None) -> EngineFactory:
    """Makes Docker engines that share `interrupt` (one per worker thread)."""
    if buildkit:
        return lambda: docker_engine(interrupt, buildkit=True, buildx_builder=buildx_builder)
    return lambda: docker_engine(interrupt)
