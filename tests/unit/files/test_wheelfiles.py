"""files/wheelfiles.py: the wheelhouse's files, refusing odd names and links to themselves."""

from __future__ import annotations

from tests.unit.helpers import render_refused as refused
from tests.unit.helpers import ONE_CELL as BASE


PIP = BASE.replace("blas: [openblas]", "blas: [openblas]\n  installer: [pip]")


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
