"""`imagefactory --help` and `imagefactory list` import no pipeline step they do not run, and a
matrix whose bytes passed the schema before is not validated again (matrix.py's validation cache).
No timing assertion: what is imported is the regression that timing would only show as noise
(the figures: bench/cli.py, docs/performance.md#the-cli-itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from imagefactory.config import matrix
from tests.conftest import REPO
from tests.unit.helpers import RUN_CLI as RUN, TWO_PIP_CELLS

# What neither `--help` nor `list` of a matrix validated before may import (each is a command's or
# a step's own: the Docker SDK and requests the engine's, jsonschema the first validation's, Jinja2
# render's, tenacity publish's, rich the live display's, packaging a matrix with packages').
LAZY = ("docker", "requests", "urllib3", "jsonschema", "jinja2", "tenacity", "rich", "packaging",
        "imagefactory.pipeline.build", "imagefactory.render.contexts", "imagefactory.publish.push", "imagefactory.engine.docker",
        "imagefactory.lock.resolve", "imagefactory.probe.smoke",
        # context.py's annotations only (TYPE_CHECKING): a run's engines, netrc reader and report
        "imagefactory.engine.select", "imagefactory.config.netrc", "imagefactory.report.summary", "imagefactory.probe.checks")
# ... and what only a command that reads a matrix imports (PyYAML: inputs.py imports it to parse)
HELP_LAZY = ("yaml", "imagefactory.config.matrix", "imagefactory.config.model", "imagefactory.config.availability")


def imported(args: list[str], cache: os.PathLike | str) -> tuple[set[str], int, str]:
    """The modules loaded after `imagefactory ARGS` in a fresh interpreter, its exit code, stdout."""
    env = {**os.environ, "IMAGEFACTORY_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    r = subprocess.run([sys.executable, "-c", RUN, json.dumps(args)], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=120)
    tail = r.stderr.rsplit("\nMODULES ", 1)
    assert len(tail) == 2, r.stderr
    modules, code = tail[1].rsplit(" EXIT ", 1)
    return set(json.loads(modules)), int(code.strip() or 0), r.stdout


def heavy(modules: set[str], lazy: tuple[str, ...] = LAZY) -> list[str]:
    return sorted(m for m in lazy if m in modules)


@pytest.mark.parametrize("args", [["--help"], [], ["list", "--help"], ["build", "--help"]],
                         ids=["help", "bare", "list-help", "build-help"])
def test_help_imports_no_pipeline_step(args, tmp_path):
    modules, code, out = imported(args, tmp_path / "cache")
    assert code == 0 and ("Usage" in out or "First steps" in out)
    assert heavy(modules, LAZY + HELP_LAZY) == []


def test_list_of_a_validated_matrix_imports_no_pipeline_step(tmp_path):
    path = tmp_path / "matrix.yaml"
    path.write_text(TWO_PIP_CELLS)
    first, code, out = imported(["list", "--matrix", str(path)], tmp_path / "cache")
    assert code == 0 and "py3.11-cpu-openblas-pip" in out
    assert "jsonschema" in first and "yaml" in first  # the first `list` parses and validates (so the check below can fail)
    again, code, out2 = imported(["list", "--matrix", str(path)], tmp_path / "cache")
    assert code == 0 and out2 == out
    assert heavy(again, LAZY + ("yaml",)) == []  # the parsed matrix kept: no YAML parser either


def test_the_table_is_what_rich_printed(tmp_path, monkeypatch, capsys):
    """`list`'s table, printed without rich, is byte for byte the rich Table(box=None) it replaces."""
    from rich.console import Console
    from rich.table import Table

    from imagefactory.cli import app

    lines = [list(app.TABLE_COLUMNS), ["py3.11-cpu-openblas-pip", "2.13.0", "2", "python:3.11-slim-bookworm",
                                       "registry.example.com/ml/train:2.13.0-py3.11-cpu-openblas-pip", "linux/amd64"],
             ["py3.12-cu12.9-mkl-conda", "2.12.1", "auto", "mambaorg/micromamba:2-debian12", "", "linux/arm64"]]
    t = Table(show_header=True, header_style="bold", box=None)
    for col in lines[0]:
        t.add_column(col)
    for row in lines[1:]:
        t.add_row(*row)
    console = Console(highlight=False, width=200, force_terminal=False, no_color=True, record=True, file=open(
        os.devnull, "w"))
    console.print(t)
    assert app.table(lines) == console.export_text()


# -- the validation cache ---------------------------------------------------------------------------
def schema_runs(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = matrix._schema_problems

    def counted(data, loc):
        calls.append(1)
        return real(data, loc)

    monkeypatch.setattr(matrix, "_schema_problems", counted)
    return calls


def test_unchanged_bytes_are_validated_once(tmp_path, monkeypatch):
    path = tmp_path / "matrix.yaml"
    path.write_text(TWO_PIP_CELLS)
    calls = schema_runs(monkeypatch)
    first = matrix.load(path)
    assert matrix.load(path) == first
    assert len(calls) == 1
    path.write_text(TWO_PIP_CELLS + "\n")  # one more byte: validated again
    matrix.load(path)
    assert len(calls) == 2


def test_another_schema_or_version_validates_again(tmp_path, monkeypatch):
    path = tmp_path / "matrix.yaml"
    path.write_text(TWO_PIP_CELLS)
    calls = schema_runs(monkeypatch)
    matrix.load(path)
    monkeypatch.setattr(matrix, "_schema_text", lambda: matrix.resources.files("imagefactory").joinpath(
        "resources/matrix.schema.json").read_text() + " ")
    matrix.load(path)
    monkeypatch.setattr(matrix, "__version__", "0.0.0-other")
    matrix.load(path)
    assert len(calls) == 3


def test_a_bad_matrix_is_never_remembered(tmp_path, monkeypatch):
    path = tmp_path / "matrix.yaml"
    path.write_text(TWO_PIP_CELLS.replace("threads: 2", "threads: 4.0"))
    calls = schema_runs(monkeypatch)
    for _ in range(2):
        with pytest.raises(matrix.ConfigError):
            matrix.load(path)
    assert len(calls) == 2
    assert not (tmp_path / "imagefactory-cache" / matrix.DATA.name).exists()


def test_a_planted_key_skips_the_schema_only(tmp_path, monkeypatch):
    """The cache says only "these bytes load to this data": a matrix whose kept data someone wrote
    there still meets every other check of `load`, and an odd cache entry is ignored."""
    path = tmp_path / "matrix.yaml"
    text = TWO_PIP_CELLS.replace("matrix:\n", "matrix:\n  exclude: [{python: \"3.9\"}]\n")  # removes nothing
    path.write_text(text)
    data = matrix._parse(text, "matrix.yaml")[1]
    assert matrix.DATA.put(matrix.validation_key(text), json.dumps(data))
    calls = schema_runs(monkeypatch)
    with pytest.raises(matrix.ConfigError, match="exclude removes nothing"):
        matrix.load(path)
    assert calls == []  # the planted data did skip the schema, and only the schema
    entry = matrix._data_file(matrix.validation_key(TWO_PIP_CELLS))
    assert entry is not None
    for odd in ("link", "folder", " " * (1 << 20)):  # never through a link, only a regular file, bounded
        if odd == "link":
            entry.symlink_to(path)
        elif odd == "folder":
            entry.mkdir()
        else:
            entry.write_text(odd)
        calls = schema_runs(monkeypatch)
        path.write_text(TWO_PIP_CELLS)
        matrix.load(path)
        assert len(calls) == 1
        if odd == "folder":
            entry.rmdir()
        else:
            assert entry.is_file() and not entry.is_symlink() and json.loads(entry.read_text())["torch"]  # kept anew
            entry.unlink()


# -- the parsed matrix ------------------------------------------------------------------------------
def parses(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = matrix._parse

    def counted(text, shown):
        calls.append(shown)
        return real(text, shown)

    monkeypatch.setattr(matrix, "_parse", counted)
    return calls


def test_bytes_that_loaded_before_are_not_parsed_again(tmp_path, monkeypatch):
    path = tmp_path / "matrix.yaml"
    path.write_text(TWO_PIP_CELLS)
    calls = parses(monkeypatch)
    first = matrix.load(path)
    assert matrix.load(path) == first and len(calls) == 1  # the same Matrix, from the kept data
    path.write_text(TWO_PIP_CELLS.replace("threads: 2", "threads: 3"))
    assert matrix.load(path) != first and len(calls) == 2  # other bytes: parsed


def test_a_problem_after_a_kept_load_still_names_its_line(tmp_path, monkeypatch):
    """A file the matrix names can go away between runs: the kept data skips the YAML, so the
    problem's line comes from composing it then."""
    (tmp_path / "ca.pem").write_text((REPO / "tests" / "golden" / "certs" / "corp-ca.pem").read_text())
    path = tmp_path / "matrix.yaml"
    path.write_text(TWO_PIP_CELLS + "ca_certificates: [ca.pem]\n")
    matrix.load(path)
    line = TWO_PIP_CELLS.count("\n") + 1
    (tmp_path / "ca.pem").unlink()
    calls = parses(monkeypatch)
    with pytest.raises(matrix.ConfigError) as e:
        matrix.load(path)
    assert f"matrix.yaml:{line}: ca_certificates[0]: " in e.value.problems[0], e.value.problems
    assert len(calls) == 1  # composed for the line only


def test_odd_kept_data_is_parsed_again_and_json_must_hold_the_data_exactly(tmp_path, monkeypatch):
    import datetime

    path = tmp_path / "matrix.yaml"
    path.write_text(TWO_PIP_CELLS)
    first = matrix.load(path)
    kept = matrix._data_file(matrix.validation_key(TWO_PIP_CELLS))
    assert kept is not None
    good = json.loads(kept.read_text())
    assert good["torch"] == "2.13.0"
    for odd in ("[1, 2]", "{not json", "x" * (matrix.DATA_MAX_BYTES + 1)):
        kept.write_text(odd)
        calls = parses(monkeypatch)
        assert matrix.load(path) == first and len(calls) == 1
        assert json.loads(kept.read_text()) == good  # kept anew
    kept.unlink()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**good, "image": "evil.example.com/ml/x"}))
    kept.symlink_to(elsewhere)  # never through a link
    calls = parses(monkeypatch)
    assert matrix.load(path) == first and len(calls) == 1
    from imagefactory.files import store

    real = store.code_digest
    monkeypatch.setattr(store, "code_digest", lambda *names: real(*names) + "-edited")
    assert matrix._data_file(matrix.validation_key(TWO_PIP_CELLS)) != kept  # inputs.py edited: another file
    assert matrix._as_json({"a": datetime.date(2026, 12, 2)}) is None and matrix._as_json({1: "x"}) is None
    assert matrix._as_json({"a": [1, 2.5, True, None]}) == '{"a": [1, 2.5, true, null]}'


def test_an_unwritable_cache_is_not_fatal(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(blocker / "cache"))
    path = tmp_path / "matrix.yaml"
    path.write_text(TWO_PIP_CELLS)
    calls = schema_runs(monkeypatch)
    matrix.load(path)
    matrix.load(path)
    assert len(calls) == 2


def test_a_build_that_pushes_nothing_imports_no_retry_library():
    """tenacity is a push's (publish.py, publish_lists.py import it where they retry): the modules
    a no-op `build` loads leave it out."""
    code = ("import sys; from imagefactory.pipeline import build, regcache; from imagefactory.engine import docker; "
            "from imagefactory.publish import push, lists; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tenacity'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


# The CLI's `build` in a fresh interpreter, against the fake engine (tests/fake_engine.py): every
# cell builds and passes its probe.
RUN_BUILD_ON_FAKE = """
import json, sys
from imagefactory.engine import select
from imagefactory.config import matrix
from tests.fake_engine import World
from tests.unit.helpers import good_probe
m = matrix.load(sys.argv[2])
world = World(probes={c.id: good_probe(c) for c in m.cells})
def engine(interrupt, **kwargs):
    world.interrupt = interrupt
    return world.engine()
select.docker_engine = engine
""" + RUN.replace("json.loads(sys.argv[1])", "json.loads(sys.argv[1])")

# What a build that pushes nothing may load of the later steps: nothing. SBOM and provenance are
# written by the attest step of a run that publishes (build --push, push); nothing of publish,
# signing or verify either.
PLAIN_BUILD_ATTEST: set[str] = set()


def test_a_build_without_push_imports_no_publish_or_signing_module(tmp_path):
    (tmp_path / "matrix.yaml").write_text(TWO_PIP_CELLS)
    args = ["build", "--matrix", str(tmp_path / "matrix.yaml"), "--builder", "classic", "--plain", "--gpus", "none",
            "--work-dir", str(tmp_path / "work"), "--report", str(tmp_path / "report.json")]
    env = {**os.environ, "IMAGEFACTORY_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", RUN_BUILD_ON_FAKE, json.dumps(args), str(tmp_path / "matrix.yaml")],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    modules, code = r.stderr.rsplit("\nMODULES ", 1)[1].rsplit(" EXIT ", 1)
    loaded = set(json.loads(modules))
    assert int(code) == 0, r.stderr[-3000:]
    assert {c["status"] for c in json.loads((tmp_path / "report.json").read_text())["cells"]} == {"passed"}
    assert "imagefactory.pipeline.build" in loaded  # the build really ran through the pipeline
    later = sorted(m for m in loaded if m.split(".")[:2] in (["imagefactory", "publish"], ["imagefactory", "attest"]))
    assert set(later) == PLAIN_BUILD_ATTEST, later
    # nor what this matrix does not use: CA files (X.509), a wheelhouse, the registry cache and its logins
    unused = {"imagefactory.config.cacerts", "imagefactory.files.pem", "imagefactory.files.wheelfiles",
              "imagefactory.pipeline.regcache", "imagefactory.engine.logins",
              "imagefactory.engine.layer_sizes"}  # layers are measured before a push only
    assert sorted(unused & loaded) == []
    # Fewer modules than before the package was laid out by step (issue 33): 44 of the flat package's
    # modules at 298a409, counted the same way (the package folders' __init__ not counted).
    steps = {m for m in loaded if m.startswith("imagefactory.") and m.count(".") == 1 and "." not in m[13:]
             and (REPO / "imagefactory" / m.split(".")[1] / "__init__.py").exists()}
    modules = sorted(m for m in loaded if m.startswith("imagefactory.") and m not in steps)
    assert len(modules) < 44, modules
