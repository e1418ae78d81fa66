"""The command line itself: help, output formats, exit codes (no Docker needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
import math
import os
from imagefactory.cli import app, options, preflight
from tests.unit.helpers import run_cli
import typer
from typer.testing import CliRunner
from tests.unit.helpers import hardening_project, one_error


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

    (tmp_path / "matrix.yaml").write_text(
        'image: r.example.com/ml/t\nmatrix: {python: ["3.11"], cuda: ["none"], blas: [openblas]}\ntorch: "2.7.1"\n')
    bad = tmp_path / "\x1b[31mred\x07"
    code, out, err = run_cli(["build", "--matrix", str(tmp_path / "matrix.yaml"), "--builder", "classic",
                              "--netrc", str(bad)], monkeypatch, capsys)
    assert code == 2 and "file not found" in err
    assert "\x1b" not in err and "\x07" not in err and "\\x1b[31mred\\x07" in err


# -- moved from test_hardening_iii.py ----------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


@pytest.mark.parametrize("args, flag", [
    (["--work-dir", "/proc/imagefactory"], "--work-dir"),
    (["--report", "/proc/self/report.json"], "--report"),
    (["--work-dir", "matrix.yaml"], "--work-dir"),
    (["--work-dir", "matrix.yaml/sub"], "--work-dir"),
    (["--report", "matrix.yaml"], "--report"),
    (["--report", "matrix.json"], "--report"),  # with the matrix in matrix.md: the summary would overwrite it
])
def test_an_unusable_work_dir_or_report_is_exit_2_naming_the_flag(project, monkeypatch, capsys, args, flag):
    if args[1] == "matrix.json":  # the Markdown summary beside it would overwrite a matrix.md
        (project / "matrix.yaml").rename(project / "matrix.md")
        args = ["--matrix", "matrix.md", *args]
    before = (project / ("matrix.md" if "matrix.md" in args else "matrix.yaml")).read_bytes()
    line = one_error(["build", "--builder", "classic", *args], monkeypatch, capsys)
    assert line.startswith(f"error: {flag} "), line
    assert (project / ("matrix.md" if "matrix.md" in args else "matrix.yaml")).read_bytes() == before
    assert not (project / "build").exists()


def test_a_report_that_is_the_matrix_file_through_a_link_is_refused(project, monkeypatch, capsys):
    os.symlink("matrix.yaml", project / "report.json")
    line = one_error(["test", "--report", "report.json"], monkeypatch, capsys)
    assert "is the matrix file" in line


@pytest.mark.parametrize("value", ["", "a\nb", "--push", "type=registry,ref=x", "a b", "x" * 300])
def test_cache_from_is_an_image_reference(project, monkeypatch, capsys, value):
    line = one_error(["build", "--builder", "classic", "--cache-from", value], monkeypatch, capsys)
    assert line.startswith("error: --cache-from ") and "not an image reference" in line


def test_cache_from_takes_a_reference():
    assert preflight._cache_from(["registry.example.com/ml/train:2.13.0", "debian"]) == (
        "registry.example.com/ml/train:2.13.0", "debian")


@pytest.mark.parametrize("args", [["build", "--probe-timeout", "nan"], ["build", "--retry-delay", "nan"],
                                  ["build", "--probe-timeout", "inf"], ["bench", "--budget", "nan"],
                                  ["test", "--probe-timeout", "NaN"]])
def test_nan_and_inf_fail_the_float_flags(project, monkeypatch, capsys, args):
    line = one_error(args, monkeypatch, capsys)
    assert line.startswith(f"error: {args[1]} ") and "finite" in line


def test_every_float_flag_is_checked_for_nan():
    floats = [name for name, (kind, _) in options.FLAGS.items() if kind is float]
    assert floats and all(options.FLAGS[name][1].callback is options._finite for name in floats)
    assert not math.isfinite(float("nan"))


def test_buildx_builder_under_the_classic_builder_is_refused(project, monkeypatch, capsys):
    line = one_error(["build", "--builder", "classic", "--buildx-builder", "remote"], monkeypatch, capsys)
    assert "--buildx-builder remote" in line and "--builder buildkit" in line


# -- moved from test_help.py ----------------------------------------
# Every command's --help fits one screen and ends with an example; `imagefactory` alone names the
# three commands of a first run and exits 0 (docs/builders.md#build-options).


WIDTH = 100  # columns


SCREEN = 40  # lines


FIRST = ("list", "render", "build")  # the README's first run: see the cells, review the Dockerfiles, build


def commands() -> list[str]:
    group = typer.main.get_command(app.app)
    return sorted(group.commands)  # type: ignore[attr-defined]


def run(*args: str):
    return CliRunner().invoke(app.app, list(args), env={"COLUMNS": str(WIDTH)}, terminal_width=WIDTH)


def test_every_command_is_checked():
    assert {"list", "render", "build", "test", "push", "doctor", "bench", "lock", "schema", "verify",
            "report"} <= set(commands())


@pytest.mark.parametrize("command", [None, *commands()])
def test_help_fits_one_screen_and_has_an_example(command):
    r = run(*([command] if command else []), "--help")
    assert r.exit_code == 0, r.output
    lines = r.output.rstrip("\n").splitlines()
    assert len(lines) <= SCREEN, f"{command or 'imagefactory'} --help: {len(lines)} lines\n{r.output}"
    assert max(map(len, lines)) <= WIDTH, r.output
    examples = [line.strip() for line in lines if line.strip().startswith("Example: imagefactory ")]
    assert len(examples) == 1, r.output
    if command:
        assert examples[0].startswith(f"Example: imagefactory {command}"), examples


def test_bare_imagefactory_names_the_first_three_commands():
    r = run()
    assert r.exit_code == 0, r.output
    assert "Usage" not in r.output  # not the usage error
    lines = r.output.splitlines()
    assert len(lines) <= SCREEN and max(map(len, lines)) <= WIDTH
    named = [w for line in lines for w in line.split()[1:2] if line.strip().startswith("imagefactory ")]
    assert named[:3] == list(FIRST), r.output
    assert "imagefactory --help" in r.output


def test_the_installed_entry_point_agrees(monkeypatch, capsys):
    """cli.main (what `imagefactory` runs) prints the same first steps, exit 0."""

    code, out, _ = run_cli([], monkeypatch, capsys)
    assert code == 0 and out == app.FIRST_STEPS
