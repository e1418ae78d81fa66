"""pip cells that cannot exist are refused up front, from a sourced table of torch wheels
(issue 18, part 5): a CUDA build torch was never made for, a Python it has no wheel for."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from importlib import resources

import pytest

from imagefactory.config import availability
from imagefactory.config import matrix
from imagefactory.errors import ConfigError
from tests.conftest import REPO

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
