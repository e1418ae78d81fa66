"""The engine boundary: only engine/docker.py imports the Docker SDK, and the commands that need no
engine (`list`, `render`, `schema`, `lock --check`) never load it. Each command runs in a fresh
interpreter under `python -X importtime`, which names every module it imports."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.helpers import package_modules

MATRIX = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
torch: "2.7.1"
pip: {wheelhouse: wheels}
"""


def imported_modules(args: list[str], cwd: Path) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "IMAGEFACTORY_CACHE_DIR": str(cwd / "cache")}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "imagefactory", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    rows = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "imagefactory.cli.app" in rows, r.stderr[-2000:]  # the command really ran through the CLI
    return set(rows)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "matrix.yaml").write_text(MATRIX)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with open(wheels / "big-1.0-py3-none-any.whl", "wb") as f:  # >= 1 MiB: its digest goes to the cache file
        f.truncate(2 << 20)
    return tmp_path


@pytest.mark.parametrize("args", [["list"], ["schema"], ["render", "--out", "out"], ["lock", "--check"]],
                         ids=["list", "schema", "render", "lock-check"])
def test_commands_without_an_engine_load_no_docker_sdk(args, project):
    modules = imported_modules(args, project)
    sdk = sorted(m for m in modules if m.split(".")[0] == "docker" or m == "imagefactory.engine.docker")
    assert not sdk, f"`imagefactory {' '.join(args)}` imported {sdk}"
    if args[0] == "render":
        assert (project / "out" / "py3.11-cpu-openblas-pip" / "Dockerfile").is_file()


def test_only_engine_py_imports_the_docker_sdk():
    """Outside engine.py (package and bench/ scripts), no module imports `docker`."""
    offenders = []
    for path in [*package_modules().values(), *(REPO / "bench").glob("*.py")]:
        if path == REPO / "imagefactory" / "engine" / "docker.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(REPO)}:{node.lineno}" for n in names if n.split(".")[0] == "docker"]
    assert not offenders


def test_the_fake_and_the_docker_engine_implement_the_whole_interface():
    """tests/fake_engine.py and engine.Engine both have every ContainerEngine method, with the
    same parameters: a command that works on the fake uses nothing the real engine lacks."""
    import inspect

    from imagefactory.engine.docker import Engine
    from imagefactory.engine.api import ContainerEngine
    from tests.fake_engine import FakeEngine

    methods = [n for n, f in vars(ContainerEngine).items() if callable(f) and not n.startswith("_")]
    assert {"describe", "build", "run", "push", "remove_image"} <= set(methods)
    for name in methods:
        wanted = list(inspect.signature(getattr(ContainerEngine, name)).parameters)
        for impl in (Engine, FakeEngine):
            assert list(inspect.signature(getattr(impl, name)).parameters) == wanted, f"{impl.__name__}.{name}"


def test_the_fake_and_the_http_registry_client_implement_the_whole_interface():
    """tests/fake_engine.py's FakeRegistry and registry.HttpRegistry both have every RegistryClient
    method, with the same parameters; and the engine interface has no registry HTTP call left."""
    import inspect

    from imagefactory.engine.api import ContainerEngine, RegistryClient
    from imagefactory.engine.registry import HttpRegistry
    from tests.fake_engine import FakeRegistry

    methods = [n for n, f in vars(RegistryClient).items() if callable(f) and not n.startswith("_")]
    assert set(methods) == {"manifest", "put_manifest", "digest", "content"}
    for name in methods:
        wanted = list(inspect.signature(getattr(RegistryClient, name)).parameters)
        for impl in (HttpRegistry, FakeRegistry):
            assert list(inspect.signature(getattr(impl, name)).parameters) == wanted, f"{impl.__name__}.{name}"
    assert not {"registry_manifest", "put_manifest"} & set(vars(ContainerEngine))
    assert ContainerEngine.__annotations__["registry"] in (RegistryClient, "RegistryClient")
