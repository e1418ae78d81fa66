"""Issue 18, sections 1-2: a lock is checked against its cell, and read like the matrix file.

Every rule is broken here on a copy of the fixture project (tests/fixtures/locks) and must be
caught twice: by rendering (exit 2, the lock's line named) and by `lock --check` (stale, the
same problem).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest

from imagefactory.lock import resolve as lock
from imagefactory.lock import lockfile
from imagefactory.config import matrix
from imagefactory.render import contexts as render
from imagefactory.errors import ConfigError
from tests.conftest import REPO
from tests.unit.helpers import run_cli

FIXTURE = REPO / "tests" / "fixtures" / "locks"
PIP, CONDA = "py3.11-cpu-openblas-pip", "py3.9-cpu-openblas-conda"
CONDA_URL = "https://conda.anaconda.org/conda-forge/linux-64/"
SHA = "0123456789abcdef" * 4


@pytest.fixture
def project(tmp_path) -> Path:
    dest = tmp_path / "project"
    shutil.copytree(FIXTURE, dest, ignore=shutil.ignore_patterns("golden"))
    text = (dest / "matrix.yaml").read_text()
    (dest / "matrix.yaml").write_text(text.replace("../../golden/wheels/", str(REPO / "tests/golden/wheels")))
    return dest


def lock_path(project: Path, cell: str) -> Path:
    return project / "locks" / f"{cell}.txt"


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def caught(project: Path, cell: str) -> list[str]:
    """The problems of `cell`'s lock: rendering refuses it (exit 2, nothing written) and
    `lock --check` calls it stale with the same lines."""
    m = matrix.load(project / "matrix.yaml")
    with pytest.raises(ConfigError) as err:
        render.render(m, project / "out", [m.cell(cell)])
    assert err.value.exit_code == 2
    assert not (project / "out" / cell).exists()
    (outcome,) = lock.check(m, [m.cell(cell)])
    assert outcome.status == lock.STALE
    assert outcome.problems == err.value.problems
    return err.value.problems


def line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(text))


def test_the_fixture_locks_are_current(project):
    m = matrix.load(project / "matrix.yaml")
    assert {o.cell: o.status for o in lock.check(m, [m.cell(PIP), m.cell(CONDA)])} == {
        PIP: "current", CONDA: "current"}


# --------------------------------------------------------------------------- the build variant

def test_a_cuda_torch_in_a_cpu_pip_lock(project):
    path = lock_path(project, PIP)  # the record edited too: only the variant rule can catch it
    edit(path, "# resolved: torch==2.13.0+cpu", "# resolved: torch==2.13.0+cu129")
    edit(path, "\ntorch==2.13.0+cpu", "\ntorch==2.13.0+cu129")
    (problem,) = caught(project, PIP)
    assert f"{path.name}:{line_of(path, 'torch==')}: torch: cell {PIP} wants the +cpu build" in problem


def test_another_package_of_a_cuda_build_in_a_cpu_pip_lock(project):
    path = lock_path(project, PIP)
    edit(path, "# resolved: numpy==2.4.6", "# resolved: numpy==2.4.6+cu129")
    edit(path, "\nnumpy==2.4.6", "\nnumpy==2.4.6+cu129")
    (problem,) = caught(project, PIP)
    assert f":{line_of(path, 'numpy==')}: numpy: 2.4.6+cu129 is a +cu129 build, cell {PIP} is +cpu" in problem


def test_an_nvidia_library_in_a_cpu_pip_lock(project):
    path = lock_path(project, PIP)
    edit(path, "# resolved: numpy==2.4.6", "# resolved: numpy==2.4.6\n# resolved: nvidia-cublas-cu12==12.9.1.4")
    path.write_text(path.read_text() + f"nvidia-cublas-cu12==12.9.1.4 \\\n    --hash=sha256:{SHA}\n")
    (problem,) = caught(project, PIP)
    assert "nvidia-cublas-cu12: a CUDA library in the lock of CPU cell" in problem


def _add_conda(path: Path, name: str, version: str, build: str) -> None:
    edit(path, "# resolved: numpy==", f"# resolved: {name}=={version}={build}\n# resolved: numpy==")
    sha = hashlib.sha256(name.encode()).hexdigest()
    path.write_text(path.read_text() + f"{CONDA_URL}{name}-{version}-{build}.conda#{sha}\n")


@pytest.mark.parametrize("build, words", [
    ("cuda126_generic_py39h0123456_200", "wants a cpu_generic build, the lock pins build cuda126_generic"),
    ("cpu_mkl_py39h0123456_100", "wants a cpu_generic build, the lock pins build cpu_mkl"),  # the BLAS
], ids=["cuda-build", "mkl-build"])
def test_a_conda_pytorch_of_another_variant(project, build, words):
    path = lock_path(project, CONDA)
    _add_conda(path, "pytorch", "2.7.1", build)
    (problem,) = caught(project, CONDA)
    assert f":{line_of(path, CONDA_URL + 'pytorch-')}: pytorch: cell {CONDA} {words}" in problem


def test_cuda_version_and_cuda_builds_in_a_cpu_conda_lock(project):
    path = lock_path(project, CONDA)
    _add_conda(path, "cuda-version", "12.9", "h4f385c5_3")
    _add_conda(path, "libcublas", "12.9.1.4", "cuda129_h9ab20c4_0")
    problems = caught(project, CONDA)
    assert any("cuda-version: cell py3.9-cpu-openblas-conda is a CPU cell, the lock pins cuda-version 12.9" in p
               for p in problems), problems
    assert any("libcublas: build cuda129_h9ab20c4_0 is a CUDA build" in p for p in problems), problems


def test_a_blas_library_of_the_other_blas(project):
    path = lock_path(project, CONDA)
    edit(path, "liblapack-3.9.0-31_h7ac8fdf_openblas", "liblapack-3.9.0-31_h7ac8fdf_mkl")
    edit(path, "# resolved: liblapack==3.9.0=31_h7ac8fdf_openblas", "# resolved: liblapack==3.9.0=31_h7ac8fdf_mkl")
    (problem,) = caught(project, CONDA)
    assert "liblapack: cell py3.9-cpu-openblas-conda wants openblas, the lock pins liblapack build" in problem


# --------------------------------------------------------------------------- channel URLs

@pytest.mark.parametrize("prefix", [
    "https://conda.anaconda.org/conda-forge/../evil/linux-64/",
    "https://conda.anaconda.org/conda-forge/%2e%2e/evil/linux-64/",
    "https://conda.anaconda.org/conda-forge/./linux-64/",
    "https://conda.anaconda.org/conda-forge//linux-64/",
    "https://conda.anaconda.org/conda-forge/label/x/linux-64/",
], ids=["dot-dot", "percent", "dot", "double-slash", "sub-channel"])
def test_a_conda_url_that_leaves_the_channel(project, prefix):
    path = lock_path(project, CONDA)
    edit(path, CONDA_URL + "numpy-", prefix + "numpy-")
    (problem,) = caught(project, CONDA)
    assert f":{line_of(path, prefix)}: numpy: " in problem and "is not CHANNEL/SUBDIR/FILE" in problem


# --------------------------------------------------------------------------- completeness and hashes

def test_a_package_left_out(project):
    path = lock_path(project, PIP)
    edit(path, "sympy==1.14.0 \\\n", "")
    text = path.read_text()
    path.write_text(re.sub(r"\n    --hash=sha256:[0-9a-f]{64}\n(?=    --hash|threadpoolctl)", "\n", text, count=1))
    (problem,) = caught(project, PIP)
    assert f":{line_of(path, '# resolved: sympy')}: sympy: the recorded resolution needs sympy 1.14.0, and " \
           f"no line pins it" in problem


def test_a_package_left_out_with_its_record(project):
    path = lock_path(project, PIP)
    text = path.read_text().replace("# resolved: threadpoolctl==3.8.0\n", "")
    path.write_text(re.sub(r"threadpoolctl==3\.8\.0 \\\n    --hash=sha256:[0-9a-f]{64}\n", "", text))
    (problem,) = caught(project, PIP)
    assert f"threadpoolctl: cell {PIP} asks for threadpoolctl, and the lock pins none" in problem


def test_an_extra_package(project):
    path = lock_path(project, PIP)
    path.write_text(path.read_text() + f"rich==14.0.0 \\\n    --hash=sha256:{SHA}\n")
    (problem,) = caught(project, PIP)
    assert f":{line_of(path, 'rich==')}: rich: not in the lock's recorded resolution" in problem


def test_a_lock_without_a_recorded_resolution(project):
    path = lock_path(project, PIP)
    path.write_text("".join(line for line in path.read_text().splitlines(True) if "# resolved:" not in line))
    (problem,) = caught(project, PIP)
    assert ":1: (lock): cell py3.11-cpu-openblas-pip: records no resolution" in problem


def test_one_sha256_for_two_files(project):
    path = lock_path(project, PIP)
    text = path.read_text()
    numpy = re.search(r"numpy==2\.4\.6 \\\n    --hash=sha256:([0-9a-f]{64})", text)[1]
    torch = re.search(r"torch==2\.13\.0\+cpu \\\n    --hash=sha256:([0-9a-f]{64})", text)[1]
    path.write_text(text.replace(torch, numpy))
    (problem,) = caught(project, PIP)
    assert f":{line_of(path, 'torch==')}: torch: sha256 {numpy[:12]}... is also the hash of numpy" in problem


def test_two_hashes_for_one_requirement(project):
    path = lock_path(project, PIP)
    edit(path, "\nnumpy==2.4.6 \\\n", f"\nnumpy==2.4.6 \\\n    --hash=sha256:{SHA} \\\n")
    (problem,) = caught(project, PIP)
    assert f":{line_of(path, 'numpy==')}: numpy: 2 hashes; a lock names exactly one file per package" in problem


# --------------------------------------------------------------------------- the header

def test_a_header_without_an_input_the_matrix_sets_is_stale(project):
    path = lock_path(project, PIP)
    edit(path, "# input indexes: https://pypi.org/simple\n", "")
    (problem,) = caught(project, PIP)
    assert "input.indexes: cell py3.11-cpu-openblas-pip: the lock does not record indexes" in problem


def test_an_input_given_twice_or_unknown_is_stale(project):
    path = lock_path(project, PIP)
    edit(path, "# input numpy: any\n", "# input numpy: any\n# input numpy: 2.0\n# input channels: evil\n")
    problems = caught(project, PIP)
    assert any(f":{line_of(path, '# input numpy: 2.0')}: input.numpy: given twice" in p for p in problems)
    assert any(":" + str(line_of(path, "# input channels")) + ": input.channels: not an input of a pip cell" in p
               for p in problems), problems


def test_lock_check_exits_2_for_an_edited_lock(project, monkeypatch, capsys):
    edit(lock_path(project, PIP), "# resolved: sympy==1.14.0\n", "")
    code, _, err = run_cli(["lock", "--check", "--matrix", str(project / "matrix.yaml"), "--only", PIP],
                           monkeypatch, capsys)
    assert code == 2 and "sympy: not in the lock's recorded resolution" in err


def test_lock_writes_the_resolution_record_it_is_judged_against(project):
    m = matrix.load(project / "matrix.yaml")
    lock_path(project, PIP).unlink()

    def resolver(m, cell, held):
        return "".join(f"{n}=={v} \\\n    --hash=sha256:{hashlib.sha256(n.encode()).hexdigest()}\n" for n, v in
                       (("numpy", "2.4.6"), ("threadpoolctl", "3.8.0"), ("torch", "2.13.0+cpu"))), "stand-in"

    lock.lock(m, [m.cell(PIP)], lock.Options(), resolver=resolver, say=lambda _: None)
    written = lockfile.load(m, m.cell(PIP))
    assert written is not None and [r[:2] for r in written.resolved] == [
        ("numpy", "2.4.6"), ("threadpoolctl", "3.8.0"), ("torch", "2.13.0+cpu")]


# --------------------------------------------------------------------------- reading (section 2)


@pytest.mark.parametrize("target", ["/proc/self/environ", "outside"])
def test_a_lock_linked_out_of_locks_is_refused_and_nothing_of_it_shown(project, target, monkeypatch, capsys):
    monkeypatch.setenv("IMAGEFACTORY_TEST_TOKEN", "tok-3f9a7c")
    if target == "outside":
        target = str(project / "secret.txt")
        Path(target).write_text(lockfile.FIRST_LINE + "x\nIMAGEFACTORY_TEST_TOKEN=tok-3f9a7c\n")
    path = lock_path(project, PIP)
    path.unlink()
    path.symlink_to(target)
    for command in (["render", "--out", str(project / "out")], ["lock", "--check"]):
        code, out, err = run_cli([*command, "--matrix", str(project / "matrix.yaml"), "--only", PIP],
                                 monkeypatch, capsys)
        assert code == 2, err
        assert "tok-3f9a7c" not in out + err
        assert f"{PIP}.txt:1: (lock): is a symbolic link to" in err and "outside" in err


def test_a_link_inside_locks_is_followed(project):
    path = lock_path(project, PIP)
    path.rename(project / "locks" / "real.txt")
    path.symlink_to("real.txt")
    m = matrix.load(project / "matrix.yaml")
    assert lockfile.load(m, m.cell(PIP)) is not None


def test_a_file_that_is_not_a_lock_is_not_echoed(project):
    path = lock_path(project, PIP)
    path.write_text("AWS_SECRET_ACCESS_KEY=abc123secret\n" * 3)
    (problem,) = caught(project, PIP)
    assert "abc123secret" not in problem and "not a lock written by `imagefactory lock`" in problem


def test_a_huge_sparse_lock_is_refused_by_size(project):
    path = lock_path(project, PIP)
    with path.open("r+b") as f:
        f.truncate(4 << 30)  # sparse: no disk used
    (problem,) = caught(project, PIP)
    assert f"is larger than {lockfile.LOCK_MAX_BYTES} bytes" in problem


def test_a_fifo_lock_is_an_error_not_an_unlocked_cell(project):
    path = lock_path(project, PIP)
    path.unlink()
    os.mkfifo(path)
    (problem,) = caught(project, PIP)
    assert "is a FIFO (named pipe), not a regular file" in problem


def test_twenty_thousand_bad_lines_give_a_capped_report(project):
    path = lock_path(project, PIP)
    path.write_text(path.read_text() + "oops\n" * 20_000)
    problems = caught(project, PIP)
    assert len(problems) == 21 and problems[-1] == f"{20_000 - 20} more problems not shown"


def test_lock_messages_are_escaped(tmp_path):
    evil = tmp_path / "p\x1b[31mred\x07"
    shutil.copytree(FIXTURE, evil, ignore=shutil.ignore_patterns("golden"))
    text = (evil / "matrix.yaml").read_text()
    (evil / "matrix.yaml").write_text(text.replace("../../golden/wheels/", str(REPO / "tests/golden/wheels")))
    edit(lock_path(evil, PIP), "# input numpy: any", "# input numpy: 2.0")
    problems = caught(evil, PIP)
    assert problems and all(line.isprintable() for line in problems), problems
    assert "\\x1b[31mred\\x07" in problems[0]
