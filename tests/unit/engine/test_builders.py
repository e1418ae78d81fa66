"""BuildKit by composition: the Docker SDK engine is given its builder (engine.docker.ClassicBuilder or
buildkit.BuildxBuilder); engine/select.py wires them. No engine subclasses another."""

from __future__ import annotations

import pytest

from imagefactory.engine import buildkit
from imagefactory.engine import docker as engine_mod
from imagefactory.engine.api import Builder, BuildRequest
from imagefactory.errors import ConfigError


class _Client:
    """The parts of a docker.DockerClient an engine's construction uses."""

    def __init__(self, components: list[dict] | None = None):
        self.components = components or [{"Name": "Engine"}]
        self.api = type("Api", (), {"hooks": {"response": []}})()

    def ping(self) -> bool:
        return True

    def version(self) -> dict:
        return {"Components": self.components}


class _Recording:
    kind = Builder.buildkit

    def __init__(self) -> None:
        self.attached: list = []
        self.built: list = []

    def attach(self, engine) -> None:
        self.attached.append(engine)

    def build(self, engine, request, *, log, progress) -> str:
        self.built.append((engine, request))
        log("built")
        return "sha256:" + "b" * 64


def test_the_engine_builds_with_the_builder_it_is_given():
    given = _Recording()
    engine = engine_mod.Engine(_Client(), builder=given)  # type: ignore[arg-type]
    lines: list[str] = []
    request = BuildRequest("/ctx", "t:1")
    assert engine.build(request, log=lines.append) == "sha256:" + "b" * 64
    assert given.attached == [engine] and given.built == [(engine, request)] and lines == ["built"]
    assert engine.builder is Builder.buildkit  # the engine's kind is its builder's


def test_without_a_builder_the_engine_builds_with_the_classic_one():
    engine = engine_mod.Engine(_Client())  # type: ignore[arg-type]
    assert isinstance(engine._builder, engine_mod.ClassicBuilder) and engine.builder is Builder.classic


def test_buildkit_is_a_builder_not_an_engine():
    assert not issubclass(buildkit.BuildxBuilder, engine_mod.Engine)
    assert not [c for c in vars(buildkit).values() if isinstance(c, type) and issubclass(c, engine_mod.Engine)]
    assert buildkit.BuildxBuilder.kind is Builder.buildkit and engine_mod.ClassicBuilder.kind is Builder.classic


def test_a_builder_refuses_an_engine_once_it_answered():
    """BuildxBuilder refuses podman (no BuildKit behind its Docker API) and a bad --buildx-builder."""
    with pytest.raises(ConfigError, match="is podman"):
        engine_mod.Engine(_Client([{"Name": "Podman Engine"}]), builder=buildkit.BuildxBuilder())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a builder name"):
        engine_mod.Engine(_Client(), builder=buildkit.BuildxBuilder("a b"))  # type: ignore[arg-type]
    engine = engine_mod.Engine(_Client(), builder=buildkit.BuildxBuilder("mine"))  # type: ignore[arg-type]
    assert engine.builder is Builder.buildkit and engine._builder.buildx_builder == "mine"  # type: ignore[attr-defined]


@pytest.mark.parametrize("choice, kind", [(Builder.classic, engine_mod.ClassicBuilder),
                                          (Builder.buildkit, buildkit.BuildxBuilder)])
def test_select_gives_the_engine_the_builder_chosen(monkeypatch, choice, kind):
    from imagefactory.engine import select

    made: list = []

    class _Engine:
        def __init__(self, *, interrupt, shared, builder):
            made.append(builder)

    monkeypatch.setattr(engine_mod, "Engine", _Engine)
    select.docker_engine(builder=choice, buildx_builder="mine")
    assert [type(b) for b in made] == [kind]
    if choice is Builder.buildkit:
        assert made[0].buildx_builder == "mine"
    with pytest.raises(ValueError):
        select.docker_engine(builder=Builder.auto)
