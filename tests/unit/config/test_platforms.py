"""The platform seam: one table says what a platform is; the engine interface is one frozen build
request and constructs no engine; the builder is one typed value."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from imagefactory.engine import buildkit
from imagefactory.engine import select as engines
from imagefactory.config import platforms
from imagefactory.engine.api import Builder, BuildRequest
from imagefactory.config.model import Cell
from tests.conftest import REPO
from tests.unit.helpers import package_modules

PACKAGE = REPO / "imagefactory"


def test_the_table_names_each_platform_the_way_each_tool_does():
    amd64, arm64 = platforms.get("linux/amd64"), platforms.get("linux/arm64")
    assert (amd64.arch, amd64.architecture, amd64.conda_subdir) == ("x86_64", "amd64", "linux-64")
    assert (arm64.arch, arm64.architecture, arm64.conda_subdir) == ("aarch64", "arm64", "linux-aarch64")
    assert amd64.pip_platform == "manylinux_2_28_x86_64" and arm64.pip_platform == "manylinux_2_28_aarch64"
    assert arm64.glibc_platforms[-2:] == ("manylinux2014_aarch64", "linux_aarch64")
    assert arm64.uv_platform == "aarch64-manylinux_2_28"
    assert amd64.mkl and not arm64.mkl  # no MKL for aarch64 anywhere
    assert arm64.emulation.binfmt == "qemu-aarch64" and arm64.emulation.qemu_cpu == "neoverse-n1"
    assert platforms.DEFAULT == amd64 and platforms.names() == ["linux/amd64", "linux/arm64"]
    assert platforms.by_architecture("arm64") == arm64 and platforms.by_architecture("s390x") is None
    assert platforms.native("aarch64") == arm64 and platforms.native("x86_64") == amd64
    with pytest.raises(dataclasses.FrozenInstanceError):
        arm64.mkl = True  # type: ignore[misc]


def test_a_cell_of_the_default_platform_keeps_its_id_and_another_names_its_arch():
    cell = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.10.0", threads=2,
                base_image="python:3.11-slim-bookworm")
    assert cell.id == "py3.11-cpu-openblas-pip"
    assert dataclasses.replace(cell, platform=platforms.ARM64).id == "py3.11-cpu-openblas-pip-arm64"
    assert dataclasses.replace(cell, platform=platforms.ARM64, variant="vision").id == \
        "py3.11-cpu-openblas-pip-arm64-vision"


def test_a_build_request_is_one_frozen_value_and_buildx_builds_its_platform(tmp_path):
    request = BuildRequest("/ctx", "t:1", platform=platforms.ARM64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.tag = "u:2"  # type: ignore[misc]
    args = buildkit.command("docker", request, tmp_path / "m.json", builder=None)
    assert args[args.index("--platform") + 1] == "linux/arm64"
    default = buildkit.command("docker", BuildRequest("/ctx", "t:1"), tmp_path / "m.json", builder=None)
    assert default[default.index("--platform") + 1] == "linux/amd64"


def _imports(path: Path) -> set[str]:
    """The imagefactory modules `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("imagefactory"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("imagefactory"))
    return found & set(package_modules())


def test_the_engine_interface_constructs_no_engine():
    """engine_api.py describes engines; engines.py makes them. An interface module that imports its
    implementations closes the engine_api -> engine/buildkit -> context -> engine_api circle."""
    assert not _imports(PACKAGE / "engine" / "api.py") & {"imagefactory.engine.docker", "imagefactory.engine.buildkit",
                                                       "imagefactory.engine.select", "imagefactory.run.context"}


def test_the_package_has_no_import_cycle():
    graph = {name: _imports(path) for name, path in package_modules().items()}

    def cycle_from(start: str, node: str, seen: tuple[str, ...]) -> tuple[str, ...] | None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return seen + (nxt,)
            if nxt not in seen:
                found = cycle_from(start, nxt, seen + (nxt,))
                if found:
                    return found
        return None

    for module in sorted(graph):
        assert cycle_from(module, module, (module,)) is None, " -> ".join(cycle_from(module, module, (module,)) or ())


def test_auto_is_a_choice_no_engine_is_made_of(monkeypatch):
    with pytest.raises(ValueError, match="resolve it"):
        engines.docker_engine(builder=Builder.auto)


def test_an_arm64_pip_cell_on_this_host_is_resolved_by_uv_not_by_pip(tmp_path, monkeypatch):
    """pip's --platform reads markers on this host (an aarch64 torch would lock x86 CUDA wheels): a
    cell of another platform goes to uv (tests/unit/test_lock_platforms.py locks one for real)."""
    from imagefactory.lock import resolve as lock
    from imagefactory.config.model import Matrix

    cell = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.10.0", threads=2,
                base_image="python:3.11-slim-bookworm", platform=platforms.ARM64)
    m = Matrix(path=tmp_path / "matrix.yaml", image="r.example.com/ml/train", cells=(cell,))
    monkeypatch.setattr(platforms, "native", lambda machine=None: platforms.AMD64)
    monkeypatch.setattr(lock, "resolve_uv", lambda m, c, held: ("uv-body", "uv"))
    assert lock.resolve(m, cell, {}) == ("uv-body", "uv")
