"""The conda-forge pytorch availability table, its refusals and the exact build spec."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from imagefactory.config import availability
from imagefactory.config import matrix
from imagefactory.config.availability import conda_build_spec, conda_problem
from imagefactory.errors import ConfigError
from tests.conftest import REPO
import re
from importlib import resources

PY = ["3.8", "3.9", "3.10", "3.11", "3.12", "3.13", "3.14", "3.15"]
CUDA = [None, "11.8", "12.6", "12.8", "12.9", "13.0", "13.1"]


def pys(first: str, last: str) -> set[str]:
    return set(PY[PY.index(first):PY.index(last) + 1])


# What conda-forge publishes for linux-64, written out independently of the data file
# (pytorch-cpu-feedstock branches, .ci_support; see the file's sources): torch -> CUDA -> Python.
OLD = pys("3.9", "3.13")
MID = pys("3.10", "3.13")
NEW = pys("3.10", "3.14")
FACTS: dict[str, dict[str | None, set[str]]] = {
    "2.7.0": {None: OLD, "12.6": OLD},
    "2.7.1": {None: OLD, "12.6": OLD, "12.9": OLD},  # build 0: CUDA 12.6; builds 1-4: CUDA 12.9
    "2.8.0": {None: MID, "12.9": MID},
    "2.9.1": {None: MID, "12.9": MID},
    "2.10.0": {None: NEW, "12.9": NEW, "13.0": NEW},
    "2.11.0": {None: NEW, "12.9": NEW, "13.0": NEW},
    "2.12.0": {None: NEW, "12.9": NEW, "13.0": NEW},
    "2.12.1": {None: NEW, "12.9": NEW, "13.0": NEW},
    "2.13.0": {None: NEW, "12.9": NEW, "13.0": NEW},
}


def test_table_loads_with_its_sources():
    t = availability.table()
    assert sorted({r.torch for r in t.releases}, key=lambda v: tuple(map(int, v.split(".")))) == list(FACTS)
    assert all(r.source.strip() for r in t.releases)
    doc = json.loads((REPO / availability.DATA_FILE).read_text())
    assert any("conda-forge/pytorch-cpu-feedstock" in s for s in doc["sources"])
    assert ".ci_support" in " ".join(doc["sources"]) and doc["how_to_extend"]


@pytest.mark.parametrize("torch", list(FACTS))
def test_every_published_combination_and_only_those(torch):
    """Every torch x CUDA x Python x BLAS of the table, against the facts above."""
    for cuda in CUDA:
        for python in PY:
            for blas in ("mkl", "openblas"):
                expected = python in FACTS[torch].get(cuda, set())
                got = conda_problem(torch, cuda, python, blas)
                assert (got is None) == expected, (torch, cuda, python, blas, got)


@pytest.mark.parametrize("minor, published", [
    ("2.7", {None: OLD, "12.6": OLD, "12.9": OLD}),
    ("2.8", FACTS["2.8.0"]),
    ("2.9", FACTS["2.9.1"]),
    ("2.12", FACTS["2.12.1"]),
])
def test_minor_version_means_any_published_patch(minor, published):
    for cuda in CUDA:
        for python in PY:
            assert (conda_problem(minor, cuda, python, "mkl") is None) == (python in published.get(cuda, set()))


def test_cuda_not_built_for_that_torch_names_the_cuda_it_has_and_the_nearest():
    assert conda_problem("2.8", "12.6", "3.11", "mkl") == (
        "conda-forge has no pytorch 2.8 build for CUDA 12.6 (2.8 is built for CUDA 12.9 only); "
        "nearest: torch 2.8 with cuda 12.9, or torch 2.7.1 with cuda 12.6, python 3.11")
    msg = conda_problem("2.13.0", "12.6", "3.12", "openblas")
    assert msg is not None and "(2.13.0 is built for CUDA 12.9 and 13.0 only)" in msg
    assert msg.endswith("nearest: torch 2.13.0 with cuda 12.9, or torch 2.7.1 with cuda 12.6, python 3.12")
    # No 2.7.x build has Python 3.14, so only the CUDA change is one step away.
    msg = conda_problem("2.13.0", "12.6", "3.14", "openblas")
    assert msg is not None and msg.endswith("nearest: torch 2.13.0 with cuda 12.9")


def test_python_outside_the_range_is_refused():
    msg = conda_problem("2.9.1", None, "3.14", "mkl")
    assert msg == ("conda-forge has no pytorch 2.9.1 build for Python 3.14 (2.9.1 is built for Python "
                   "3.10-3.13 only); nearest: torch 2.9.1 with python 3.13, or torch 2.10.0 with python 3.14")
    msg = conda_problem("2.13.0", "12.9", "3.9", "mkl")
    assert msg is not None and "for Python 3.9 with CUDA 12.9 (2.13.0 is built for Python 3.10-3.14 only)" in msg
    assert msg.endswith("nearest: torch 2.13.0 with python 3.10, or torch 2.7.1 with cuda 12.9, python 3.9")


def small_table(**change) -> availability.Table:
    """A two-release table to exercise what the real one cannot (no generic build, ties)."""
    doc = {"releases": [
        {"torch": "3.0.0", "builds": "0", "cuda": ["none", "12.6", "13.0"], "python": ["3.11", "3.12"],
         "blas": ["mkl", "generic"], "source": "test"},
        {"torch": "3.1.0", "builds": "0-2", "cuda": ["none", "13.0"], "python": ["3.12"],
         "blas": ["mkl"], "source": "test"},
    ]}
    for key, value in change.items():
        doc["releases"][1][key] = value
    return availability.parse_table(doc)


def test_no_generic_build_is_refused():
    msg = conda_problem("3.1.0", "13.0", "3.12", "openblas", small_table())
    assert msg == ("conda-forge has no OpenBLAS (generic) pytorch 3.1.0 build for CUDA 13.0 and Python 3.12 "
                   "(only MKL); nearest: torch 3.1.0 with blas mkl, or torch 3.0.0 with cuda 13.0, python 3.12")
    assert conda_problem("3.1.0", "13.0", "3.12", "mkl", small_table()) is None


def test_nearest_cuda_tie_goes_to_the_newer():
    # 12.9 lies between 12.6 and 13.0, one step from each: the newer wins.
    msg = conda_problem("3.0.0", "12.9", "3.11", "mkl", small_table())
    assert msg is not None and msg.endswith("nearest: torch 3.0.0 with cuda 13.0")


def test_nearest_is_deterministic_and_never_crosses_cpu_and_cuda():
    first = conda_problem("2.8", "12.6", "3.11", "mkl")
    assert all(conda_problem("2.8", "12.6", "3.11", "mkl") == first for _ in range(5))
    assert "cuda none" not in (conda_problem("2.13.0", "11.8", "3.11", "mkl") or "")
    assert "cuda" not in (conda_problem("2.13.0", None, "3.9", "mkl") or "").split("nearest:")[1]


def test_two_changes_give_the_single_closest_combination():
    # CUDA 11.8 exists nowhere, and 2.13.0 has no Python 3.9: keep torch, move cuda and python.
    msg = conda_problem("2.13.0", "11.8", "3.9", "mkl")
    assert msg is not None and msg.endswith("nearest: torch 2.13.0 with cuda 12.9, python 3.10")


def test_torch_newer_than_the_table_is_refused_with_how_to_extend_it():
    msg = conda_problem("2.14.0", "13.0", "3.12", "mkl")
    assert msg is not None
    assert msg.startswith("torch 2.14.0 is newer than imagefactory's conda-forge build table "
                          "(torch 2.7.0 to 2.13.0); if conda-forge publishes it now, add its builds to "
                          "imagefactory/resources/conda_pytorch_builds.json")
    assert msg.endswith("nearest: torch 2.13.0 with cuda 13.0, python 3.12")
    assert conda_problem("2.14", None, "3.12", "mkl") is not None
    assert conda_problem("3.0", None, "3.12", "mkl") is not None
    old = conda_problem("2.5.1", None, "3.11", "mkl")
    assert old is not None and old.startswith("torch 2.5.1 is older than imagefactory's conda-forge build table")


def test_unpublished_patch_inside_the_table_is_refused():
    assert conda_problem("2.9.0", None, "3.11", "mkl") == (
        "conda-forge publishes no pytorch 2.9.0 (its 2.9 releases: 2.9.1); nearest: torch 2.9.1 with python 3.11")
    assert conda_problem("2.12.2", "12.9", "3.12", "mkl") is not None


@pytest.mark.parametrize("torch, cuda, spec", [
    ("2.10.0", "12.9", "pytorch=2.10.0=cuda129*"),
    ("2.13.0", "13.0", "pytorch=2.13.0=cuda130*"),
    ("2.13", "12.9", "pytorch=2.13=cuda129*"),
    ("2.7.1", "12.6", "pytorch=2.7.1=cuda126*"),  # 2.7.1's only CUDA 12.6 build is build 0
    ("2.13.0", None, "pytorch=2.13.0=cpu*"),
])
def test_exact_build_spec(torch, cuda, spec):
    assert conda_build_spec(torch, cuda) == spec


@pytest.mark.parametrize("torch, cuda", [
    ("2.13.0\n", "12.9"), ("2.13.0 ; rm -rf /", None), ("2.13.*", None), ("2.13.0", "12.9*"), ("2.13.0", "129"),
])
def test_build_spec_refuses_malformed_values(torch, cuda):
    with pytest.raises(ValueError):
        conda_build_spec(torch, cuda)
    assert conda_problem(torch, cuda, "3.12", "mkl") is not None


@pytest.mark.parametrize("change", [
    {"cuda": ["12.9*"]}, {"cuda": []}, {"python": ["3.12\n"]}, {"blas": ["openblas"]},
    {"torch": "3.1"}, {"builds": "two"}, {"source": ""},
])
def test_malformed_table_entries_are_rejected(change):
    with pytest.raises(ValueError, match="conda_pytorch_builds.json: releases\\[1\\]"):
        small_table(**change)


def test_breaking_a_table_entry_is_caught(monkeypatch):
    """The facts test above sees a wrong entry (here: 2.8.0 given CUDA 12.6)."""
    doc = json.loads((REPO / availability.DATA_FILE).read_text())
    broken = copy.deepcopy(doc)
    entry = next(r for r in broken["releases"] if r["torch"] == "2.8.0")
    entry["cuda"].append("12.6")
    monkeypatch.setattr(availability, "table", lambda: availability.parse_table(broken))
    with pytest.raises(AssertionError):
        test_every_published_combination_and_only_those("2.8.0")


def test_known_issues_record_the_dot_bug():
    (note,) = availability.known_issues("2.7.1", "mkl")
    assert "#398" in note.source and "#399" in note.source and note.builds == "0-1"
    assert len(availability.known_issues("2.7", "mkl")) == 2
    assert availability.known_issues("2.7.1", "openblas") == []
    assert availability.known_issues("2.13.0", "mkl") == []


IMPOSSIBLE = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none", "12.9"]
  blas: [mkl]
  include:
    - {python: "3.11", cuda: "12.6", blas: mkl, torch: "2.8.0"}
torch: "2.13.0"
"""


def test_impossible_cell_is_a_located_error(write_matrix):
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(IMPOSSIBLE))
    (p,) = e.value.problems
    assert ":7: matrix.include[0]: cell py3.11-cu12.6-mkl-conda: conda-forge has no pytorch 2.8.0 build" in p


def test_impossible_cell_exits_2_through_the_cli(write_matrix):
    path = write_matrix(IMPOSSIBLE)
    r = subprocess.run([sys.executable, "-m", "imagefactory", "list", "--matrix", str(path)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert f"{path}:7: " in lines[0] and "py3.11-cu12.6-mkl-conda" in lines[0]
    assert "nearest: torch 2.8.0 with cuda 12.9, or torch 2.7.1 with cuda 12.6, python 3.11" in lines[0]
    assert "Traceback" not in r.stderr


def test_shipped_and_golden_matrices_are_within_the_table():
    for path in (REPO / "matrix.yaml", REPO / "tests" / "golden" / "matrix.yaml"):
        m = matrix.load(path)
        for cell in m.cells:
            if cell.installer == "conda":
                assert conda_problem(cell.torch, cell.cuda, cell.python, cell.blas) is None, cell.id


# -- moved from test_availability_pip.py ----------------------------------------
# pip cells that cannot exist are refused up front, from a sourced table of torch wheels
# (issue 18, part 5): a CUDA build torch was never made for, a Python it has no wheel for.


PIP = """
image: registry.example.com/ml/train
matrix: {{python: ["{python}"], cuda: ["{cuda}"], blas: [openblas], installer: [pip]}}
torch: "{torch}"
"""


def text(torch="2.13.0", cuda="13.0", python="3.11", extra="") -> str:
    return PIP.format(torch=torch, cuda=cuda, python=python) + extra


def problems(write_matrix, source: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(source))
    assert e.value.exit_code == 2
    return e.value.problems


def raw() -> dict:
    return json.loads(resources.files("imagefactory").joinpath("resources/pip_torch_wheels.json").read_text())


@pytest.mark.parametrize("cuda", ["12.1", "00.0"])
def test_a_cuda_build_torch_was_never_made_for_is_refused(write_matrix, cuda):
    [p] = problems(write_matrix, text(cuda=cuda))
    assert f"PyTorch's wheel index has no torch 2.13.0 build for CUDA {cuda}" in p
    assert "nearest: torch 2.13.0 with cuda 13.0" in p


def test_a_python_a_release_has_no_wheels_for_is_refused(write_matrix):
    [p] = problems(write_matrix, text(torch="2.7.1", cuda="12.6", python="3.14"))
    assert "no torch 2.7.1 build for Python 3.14 with CUDA 12.6 (2.7.1 is built for Python 3.9-3.13 only)" in p
    assert "nearest: torch 2.7.1 with python 3.13, or torch 2.9.0 with cuda 12.6, python 3.14" in p


def test_a_cpu_cell_is_checked_for_its_python_too(write_matrix):
    [p] = problems(write_matrix, text(torch="2.9.1", cuda="none", python="3.9"))
    assert "no torch 2.9.1 build for Python 3.9" in p


def test_pypi_serves_only_the_default_cuda_build(write_matrix):
    null = "pip: {torch_index_url: null}\n"
    [p] = problems(write_matrix, text(torch="2.7.1", cuda="12.8", extra=null))
    assert "PyPI has no torch 2.7.1 build for CUDA 12.8" in p and "nearest: torch 2.7.1 with cuda 12.6" in p
    assert "set pip.torch_index_url" in p
    assert matrix.load(write_matrix(text(torch="2.7.1", cuda="12.6", extra=null))).cells
    assert matrix.load(write_matrix(text(torch="2.7.1", cuda="12.8"))).cells  # on the PyTorch index


def test_an_unknown_release_is_refused_with_the_table_span(write_matrix):
    [p] = problems(write_matrix, text(torch="2.99.0"))
    assert "newer than imagefactory's torch wheel table (torch 2.5.0 to 2.15.0)" in p


def test_the_very_wheel_in_the_wheelhouse_makes_a_cell_possible(write_matrix, tmp_path):
    house = tmp_path / "wheels"
    house.mkdir()
    extra = "pip: {wheelhouse: wheels}\n"
    (house / "torch-2.13.0+cu121-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"x")
    assert problems(write_matrix, text(cuda="12.1", extra=extra))  # a wheel for another Python
    (house / "torch-2.13.0+cu121-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"x")
    assert matrix.load(write_matrix(text(cuda="12.1", extra=extra))).cells


def test_an_impossible_cell_exits_2_from_the_cli(write_matrix):
    path = write_matrix(text(cuda="12.1"))
    r = subprocess.run([sys.executable, "-m", "imagefactory", "list", "--matrix", str(path)],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "nearest: torch 2.13.0 with cuda 13.0" in r.stderr


# -- the table itself ----------------------------------------------------------------------------
def test_the_versions_the_project_uses_are_covered():
    used = set()
    for path in [REPO / "matrix.yaml", *REPO.glob("examples/*.yaml"), *REPO.glob("tests/**/*.py")]:
        used |= set(re.findall(r'torch: *"?(2\.[0-9]+\.[0-9]+)"?', path.read_text()))
    listed = {r.torch for r in availability.pip_tables()["index"].releases}
    assert {"2.7.1", "2.13.0", "2.14.1"} <= used
    assert used - {"2.99.0"} <= listed


def test_every_entry_says_where_each_fact_was_read():
    for entry in raw()["releases"]:
        for key in ("python_source", "pypi_cuda_source", "index_cuda_source"):
            assert len(entry[key]) > 20, (entry["torch"], key)
        assert "pypi.org" in entry["python_source"]
    tables = availability.pip_tables()
    assert all(r.source for t in tables.values() for r in t.releases)


@pytest.mark.parametrize("change", [
    lambda e: e.pop("python_source"),
    lambda e: e.update(index_cuda=["12.1", "12.1"]),
    lambda e: e.update(pypi_cuda="13"),
    lambda e: e.update(python=["3.11\n"]),
])
def test_a_mistake_in_the_table_is_refused(change):
    doc = copy.deepcopy(raw())
    change(doc["releases"][0])
    with pytest.raises(ValueError, match="pip_torch_wheels.json: releases\\[0\\]"):
        availability.parse_pip_table(doc)


def test_a_release_listed_twice_is_refused():
    doc = raw()
    doc["releases"].append(doc["releases"][0])
    with pytest.raises(ValueError, match="listed twice"):
        availability.parse_pip_table(doc)
