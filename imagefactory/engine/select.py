"""Where Docker engines come from: the one place that constructs engine.docker.Engine and
gives it its builder (engine.docker.ClassicBuilder or buildkit.BuildxBuilder).

engine/api.py only describes the interface; the commands that drive an engine get a factory
from here. The Docker SDK is imported on the first call, never by the commands that need no
engine (`list`, `render`, `schema`, `lock --check`).
"""

from __future__ import annotations

from typing import Any

from imagefactory.engine.api import Builder, ContainerEngine, EngineFactory
from imagefactory.interrupt import Interrupt


def docker_engine(interrupt: Interrupt | None = None, *, builder: Builder = Builder.classic,
                  buildx_builder: str | None = None, shared: dict[str, Any] | None = None) -> ContainerEngine:
    """A connected Docker engine (engine.docker.Engine) given the builder `builder` names: the
    classic one (engine.docker.ClassicBuilder) or BuildKit (buildkit.BuildxBuilder, which runs
    `docker buildx`; auto must have been resolved by buildkit.select). `shared`: what the engines
    of one factory learn once (engine.Engine). Raises DockerUnavailable, or ConfigError when the
    builder refuses the engine (BuildKit through podman) or its name."""
    if builder is Builder.auto:
        raise ValueError("Builder.auto is a choice: resolve it with buildkit.select first")
    from imagefactory.engine.docker import ClassicBuilder, Engine, ImageBuilder

    made: ImageBuilder = ClassicBuilder()
    if builder is Builder.buildkit:
        from imagefactory.engine.buildkit import BuildxBuilder

        made = BuildxBuilder(buildx_builder)
    return Engine(interrupt=interrupt, shared=shared, builder=made)


def docker_factory(interrupt: Interrupt | None = None, *, builder: Builder = Builder.classic,
                   buildx_builder: str | None = None) -> EngineFactory:
    """Makes Docker engines that share `interrupt` (one per worker thread), and what the first
    learnt of the engine: its API version and `docker info`, asked once a run."""
    shared: dict[str, Any] = {}
    return lambda: docker_engine(interrupt, builder=builder, buildx_builder=buildx_builder, shared=shared)
