"""files/wheelfiles.py: the wheelhouse's files, refusing odd names and links to themselves."""

from __future__ import annotations

from pathlib import Path
from tests.unit.helpers import run_cli


BASE = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
torch: "2.7.1"
"""


PIP = BASE.replace("blas: [openblas]", "blas: [openblas]\n  installer: [pip]")


def refused(tmp_path: Path, text: str, monkeypatch, capsys) -> str:
    """`render` of this matrix exits 2 with one printable, located line; nothing is written."""
    path = tmp_path / "matrix.yaml"
    path.write_text(text)
    code, out, err = run_cli(["render", "--matrix", str(path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2, err
    (line,) = err.splitlines()
    assert line.startswith(f"error: {path}:") and line.isprintable(), line
    assert not (tmp_path / "out").exists()
    return line


def test_a_wheel_name_with_a_newline_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.7.1+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")
    (tmp_path / "wheels" / "x\nRUN id-1.0-py3-none-any.whl").write_bytes(b"wheel")
    line = refused(tmp_path, PIP + "pip: {wheelhouse: wheels, torch_index_url: null}\n", monkeypatch, capsys)
    assert "pip.wheelhouse: 'x\\nRUN id-1.0-py3-none-any.whl' is not a wheel or archive file name" in line


def test_a_wheelhouse_entry_that_links_to_itself(tmp_path, monkeypatch, capsys):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.7.1+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")
    (tmp_path / "wheels" / "loop-1.0-py3-none-any.whl").symlink_to("loop-1.0-py3-none-any.whl")
    line = refused(tmp_path, PIP + "pip: {wheelhouse: wheels, torch_index_url: null}\n", monkeypatch, capsys)
    assert "pip.wheelhouse: loop-1.0-py3-none-any.whl is a symbolic link loop" in line


def test_a_wheelhouse_that_links_to_itself(tmp_path, monkeypatch, capsys):
    (tmp_path / "wheels").symlink_to("wheels")
    line = refused(tmp_path, PIP + "pip: {wheelhouse: wheels, torch_index_url: null}\n", monkeypatch, capsys)
    assert "pip.wheelhouse: is a symbolic link loop" in line
