"""The command line itself: help, output formats, exit codes (no Docker needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def cli(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "imagefactory", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("command", ["list", "render", "build", "test", "push", "schema"])
def test_every_command_has_help(command):
    r = cli(command, "--help")
    assert r.returncode == 0 and "Usage" in r.stdout


def test_list_github_format_is_a_job_matrix():
    r = cli("list", "--format", "github")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    assert len(doc["include"]) == 11
    first = doc["include"][0]
    assert first["cell"] == first["id"] and first["tag"].startswith("registry.example.com/ml/train:")


def test_list_json_and_only():
    r = cli("list", "--format", "json", "--only", "py3.11-cu12.9-mkl-conda")
    rows = json.loads(r.stdout)
    assert [row["id"] for row in rows] == ["py3.11-cu12.9-mkl-conda"] and rows[0]["cuda"] == "12.9"


def test_list_shows_each_cells_platform_last_and_in_json(write_matrix):
    path = write_matrix("""
        image: registry.example.com/ml/train
        matrix: {python: ["3.11"], cuda: ["none"], blas: [openblas], installer: [pip],
                 platform: [linux/amd64, linux/arm64]}
        torch: "2.10.0"
        pip: {torch_index_url: "https://download.pytorch.org/whl/{variant}"}
    """)
    table = cli("list", "--matrix", str(path)).stdout.splitlines()
    assert table[0].split() == ["id", "torch", "threads", "base_image", "tag", "platform"]
    assert [line.split()[0::5] for line in table[1:]] == [["py3.11-cpu-openblas-pip", "linux/amd64"],
                                                          ["py3.11-cpu-openblas-pip-arm64", "linux/arm64"]]
    rows = json.loads(cli("list", "--matrix", str(path), "--format", "json").stdout)
    assert [r["platform"] for r in rows] == ["linux/amd64", "linux/arm64"]
    assert list(rows[0])[:-1] == ["id", "python", "cuda", "blas", "installer", "variant", "torch", "threads",
                                  "base_image", "tag"]  # the keys it had, in their order; platform added last


def test_schema_is_json_schema():
    doc = json.loads(cli("schema").stdout)
    assert doc["$schema"].startswith("https://json-schema.org/") and "matrix" in doc["properties"]


def test_no_docker_engine_exits_3_with_how_to_start_one(tmp_path):
    r = cli("build", "--only", "py3.11-cpu-mkl-conda", "--work-dir", str(tmp_path), "--report",
            str(tmp_path / "r.json"), env={"DOCKER_HOST": f"unix://{tmp_path}/nothing.sock"})
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: no Docker engine answered") and "dockerd" in r.stderr


def test_atomic_without_push_is_a_usage_error(tmp_path):
    r = cli("build", "--atomic", "--work-dir", str(tmp_path))
    assert r.returncode == 2 and "--atomic" in r.stderr


def test_missing_matrix_file():
    r = cli("list", "--matrix", "nope.yaml")
    assert r.returncode == 2 and "nope.yaml: no such matrix file" in r.stderr


def test_unwritable_output_is_one_line_not_a_traceback(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = cli("render", "--out", str(blocker / "sub"))
    assert r.returncode == 2 and "Traceback" not in r.stderr  # issue 25, item 6: bad input, exit 2
    assert r.stderr.startswith("error: --out ") and str(blocker) in r.stderr


def test_every_error_line_reaches_the_terminal_escaped(tmp_path, monkeypatch, capsys):
    """A message carries what the user gave (here a --netrc path with a terminal escape and a
    bell); cli.main prints it with every control character written out, lines kept."""
    from tests.unit.helpers import run_cli

    (tmp_path / "matrix.yaml").write_text(
        'image: r.example.com/ml/t\nmatrix: {python: ["3.11"], cuda: ["none"], blas: [openblas]}\ntorch: "2.7.1"\n')
    bad = tmp_path / "\x1b[31mred\x07"
    code, out, err = run_cli(["build", "--matrix", str(tmp_path / "matrix.yaml"), "--builder", "classic",
                              "--netrc", str(bad)], monkeypatch, capsys)
    assert code == 2 and "file not found" in err
    assert "\x1b" not in err and "\x07" not in err and "\\x1b[31mred\\x07" in err
