"""engine/logins.py: one credential variable pair per registry, never two registries on one pair."""

from __future__ import annotations

from pathlib import Path
import pytest
from imagefactory.engine import logins
from imagefactory.config import matrix
from tests.unit.helpers import run_cli


PIP = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
torch: "2.13.0"
pip:
  index_url: https://pkgs.example.com/simple
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    for name in ("NETRC", "DOCKER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")  # never the real engine
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "matrix.yaml").write_text(PIP)
    return tmp_path


def one_error(args: list[str], monkeypatch, capsys, code: int = 2) -> str:
    """The command exits `code` with one printable error line."""
    got, out, err = run_cli(args, monkeypatch, capsys)
    assert got == code, err
    (line,) = err.splitlines()
    assert line.startswith("error: ") and line.isprintable(), line
    return line


def write(project: Path, text: str) -> Path:
    (project / "matrix.yaml").write_text(text)
    return project / "matrix.yaml"


def refused(project: Path, text: str, monkeypatch, capsys) -> str:
    write(project, text)
    line = one_error(["list"], monkeypatch, capsys)
    assert line.startswith("error: matrix.yaml:"), line
    return line


def test_registries_that_map_to_one_credential_variable_are_refused(project, monkeypatch, capsys):
    line = refused(project, PIP + "tags:\n  registries: [reg-a.example.com, reg.a.example.com]\n", monkeypatch, capsys)
    assert "tags.registries" in line and "IMAGEFACTORY_REGISTRY_USER_REG_A_EXAMPLE_COM" in line


def test_the_credential_mapping_is_one_to_one_for_a_loaded_matrix(project):
    from imagefactory.config import tags

    m = matrix.load(write(project, PIP + "tags:\n  registries: [a.example.com, b.example.com:5000, Other.Example.NET]\n"))
    suffixes = [tags.env_suffix(r) for r in tags.allowed_registries(m)[1:]]
    assert len(set(suffixes)) == len(suffixes) and logins.env_suffix is tags.env_suffix
