"""Shared unit-test helpers: the cells and the probe reports several test modules judge.

Test modules import shared helpers from here, never from one another: a helper kept in a test
module ties every importer to that module's edits (tests/unit/project/test_lint.py checks the rule).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from imagefactory.probe.checks import Check, judge, passed
from imagefactory.config.model import Cell

# Two pip CPU cells (Python 3.11 and 3.12) that build and pass: what most orchestration tests run.
TWO_PIP_CELLS = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11", "3.12"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
torch: "2.13.0"
threads: 2
"""
CELL_A, CELL_B = "py3.11-cpu-openblas-pip", "py3.12-cpu-openblas-pip"
# Their base images as a registry (the fake engine's) serves them: tag -> digest.
BASE_DIGESTS = {f"python:{v}-slim-bookworm": "sha256:" + hashlib.sha256(v.encode()).hexdigest()
                for v in ("3.11", "3.12")}

CPU_OPENBLAS = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.13.0",
                    threads=4, base_image="python:3.11-slim-bookworm")
CUDA_MKL = Cell(python="3.12", cuda="12.9", blas="mkl", installer="conda", torch="2.7.1",
                threads=2, base_image="nvidia/cuda:12.9.1-runtime-ubuntu24.04")


def openmp_entry(name: str, realpath: str, threads: int) -> dict:
    return {"prefix": name.split(".")[0], "filepath": f"/opt/env/lib/{name}", "realpath": realpath,
            "version": None, "num_threads": threads, "internal_api": "openmp"}


def good_probe(cell: Cell, *, gpu: bool = False, cpus: int = 8) -> dict:
    """What a correct image for `cell` reports. conda cells look like a conda-forge environment:
    LLVM's libomp loaded under several names, MKL on its intel layer, MKL_INTERFACE_LAYER from
    the libblas activation script; pip cells like PyPI torch (libgomp)."""
    assert isinstance(cell.threads, int)
    t = str(cell.threads)
    conda = cell.installer == "conda"
    layer = "intel" if conda else "gnu"
    blas = {"internal_api": cell.blas, "version": "0.3.31", "num_threads": cell.threads,
            "threading_layer": "pthreads" if cell.blas == "openblas" else layer,
            "filepath": f"/opt/lib/lib{cell.blas}.so", "architecture": "Haswell"}
    if conda:
        openmp = [openmp_entry("libgomp.so.1", "/opt/env/lib/libomp.so", cell.threads),
                  openmp_entry("libomp.so", "/opt/env/lib/libomp.so", cell.threads)]
    else:
        openmp = [openmp_entry("libgomp.so.1", "/opt/venv/lib/libgomp.so.1", cell.threads)]
    mkl = [{"filepath": "/opt/env/lib/libmkl_rt.so.2", "version": "2025.2", "threading_layer": layer,
            "num_threads": cell.threads}] if cell.blas == "mkl" and conda else []
    activation = {"prefix": "/opt/env", "scripts": ["libblas_mkl_activate.sh"],
                  "exported": {"MKL_INTERFACE_LAYER": "LP64,GNU"}, "missing": [], "different": [],
                  "error": None} if cell.blas == "mkl" and conda else \
        {"prefix": "/opt/venv", "scripts": [], "exported": {}, "missing": [], "different": [], "error": None}
    ok = {"ok": True, "returncode": 0, "error": None, "info": {}}
    local = "+cpu" if cell.cuda is None else "+cu" + cell.cuda.replace(".", "")
    return {
        "probe_version": 5,
        "python": {"version": cell.python + ".7", "executable": "/opt/venv/bin/python", "machine": cell.platform.arch},
        "user": {"uid": 1000, "gid": 1000, "name": "trainer"},
        "cpus": {"os_cpu_count": cpus, "affinity": cpus, "cgroup_quota": None, "physical_cores": cpus},
        "env": {"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t,
                "MKL_THREADING_LAYER": layer.upper() if cell.blas == "mkl" else None,
                "NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
        "numpy": {"error": None, "version": "2.2.1", "blas": [blas], "import_seconds": 0.21},
        "torch": {"error": None, "version": cell.torch + local, "cuda": cell.cuda, "import_seconds": 1.83,
                  "cudnn": None if cell.cuda is None else 92400, "cuda_available": gpu,
                  "device_count": int(gpu), "devices": ["NVIDIA H200"] if gpu else [],
                  "blas_info": "mkl", "mkl_available": True, "num_threads": cell.threads,
                  "gpu_matmul": {"ok": True, "max_abs_err": 2e-5, "tolerance": 1e-3, "error": None} if gpu else None},
        "openmp": openmp,
        "mkl": mkl,
        "threadpool_info": [dict(blas, user_api="blas", prefix="lib" + cell.blas),
                            *(dict(e, user_api="openmp") for e in openmp)],
        "bytecode": {"checked": 812, "missing": 0, "stale": 0, "examples": [], "dont_write": False},
        "activation": activation,
        "launch": {"home": "/home/trainer", "home_writable": True, "root_read_only": False, "tmp": "/tmp",
                   "tmp_writable": True, "tmp_noexec": False, "shm_bytes": 1 << 30, "error": None},
        "compute": {"numpy_matmul": ok, "torch_matmul": ok, "numpy_complex": dict(ok, info={"scipy": None}),
                    "torch_complex": ok,
                    "compile_place": dict(ok, info={"dir": "/tmp", "env": None, "triton": None, "writable": True,
                                                    "noexec": False}),
                    "torch_compile": dict(ok, info={"devices": ["cpu"], "seconds": 9.1, "cxx": "/usr/bin/g++"}),
                    "dataloader_shm": dict(ok, info={"workers": 2, "batch_mib": 80}),
                    "gloo_all_reduce": dict(ok, info={"backend": "gloo", "world_size": 2}),
                    **({"nccl_all_reduce": dict(ok, info={"backend": "nccl", "world_size": 1, "devices": 1})}
                       if gpu else {})},
    }


def assert_torch_section(report: dict, threads: int) -> None:
    """The probe's `torch` section, from a Python that has torch, with `threads` asked for through
    OMP/MKL_NUM_THREADS. tests/unit/resources/test_probe.py runs it where the host has torch (the test extra
    has none); tests/integration/test_probe_in_image.py runs it in the shared built image, in CI."""
    torch = report["torch"]
    assert torch["error"] is None, torch
    cpus = report["cpus"]
    cap = min(threads, *(c for c in (cpus["affinity"], cpus["os_cpu_count"], cpus["physical_cores"]) if c))
    assert torch["version"] and torch["num_threads"] in (threads, cap), torch  # from the env, capped at the CPUs
    assert isinstance(torch["mkl_available"], bool)
    assert torch["cuda"] is None or torch["cuda"].count(".") >= 1
    if torch["cuda_available"]:
        assert torch["device_count"] == len(torch["devices"]) >= 1
        assert torch["gpu_matmul"]["ok"] is True, torch["gpu_matmul"]
    else:
        assert torch["device_count"] == 0 and torch["devices"] == [], torch
        assert torch["gpu_matmul"] is None


def by_name(checks: list[Check]) -> dict[str, Check]:
    names = [c.name for c in checks]
    assert len(names) == len(set(names)), names
    return {c.name: c for c in checks}


def failures(checks: list[Check]) -> set[str]:
    return {c.name for c in checks if c.verdict == "fail"}


def only_failure(cell: Cell, probe: dict, name: str, *, gpu_required: bool = False) -> Check:
    checks = judge(cell, probe, gpu_required=gpu_required)
    assert failures(checks) == {name}, [c for c in checks if c.verdict == "fail"]
    assert not passed(checks)
    check = by_name(checks)[name]
    assert check.detail and "\n" not in check.detail
    return check


def run_cli(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """The installed entry point (cli.main), in this process: (exit code, stdout, stderr)."""
    import sys

    from imagefactory.cli import app

    monkeypatch.setattr(sys, "argv", ["imagefactory", *args])
    with pytest.raises(SystemExit) as e:
        app.main()
    out, err = capsys.readouterr()
    return int(e.value.code or 0), out, err


# A two-platform pip matrix (tests of lists, the merge job and emulation): the same cell for
# linux/amd64 and linux/arm64, one list tag for both.
PIP_BOTH = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
  platform: [linux/amd64, linux/arm64]
torch: "2.10.0"
threads: 2
pip: {torch_index_url: null, wheelhouse: wheels}
"""
AMD, ARM = "py3.11-cpu-openblas-pip", "py3.11-cpu-openblas-pip-arm64"
BASE = "registry.example.com/ml/train:"
LIST = BASE + "2.10.0-py3.11-cpu-openblas-pip"
AMD_TAG, ARM_TAG = BASE + "x86_64-2.10.0-py3.11-cpu-openblas-pip", BASE + "aarch64-2.10.0-py3.11-cpu-openblas-pip"


def pip_both_project(root):
    """`root` as PIP_BOTH's project: its wheelhouse (one stand-in torch wheel) and matrix.yaml."""
    (root / "wheels").mkdir(exist_ok=True)
    (root / "wheels" / "torch-2.10.0+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"x")
    (root / "matrix.yaml").write_text(PIP_BOTH)
    return root


# The CLI run in a fresh interpreter (`python -c RUN_CLI ARGS_JSON`); its stderr ends with the modules it
# loaded and its exit code, for the tests that check what a command imports.
RUN_CLI = """
import json, sys
from imagefactory.cli import app
sys.argv = ["imagefactory", *json.loads(sys.argv[1])]
try:
    app.main()
except SystemExit as e:
    code = e.code
else:
    code = 0
sys.__stderr__.write("\\nMODULES " + json.dumps(sorted(m for m in sys.modules)) + " EXIT " + str(code) + "\\n")
"""


PACKAGE_DIR = Path(__file__).resolve().parents[2] / "imagefactory"


def package_modules() -> dict[str, Path]:
    """Every Python module of the package, subpackages included (resources/ holds the files that
    run inside images, not modules of the package): dotted name -> path."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
        if "resources" in rel.parts or "__pycache__" in rel.parts:
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        found[".".join(parts)] = path
    return found


# -- a small pip matrix in an empty folder, and the one error line a command ends with: the -----------
# -- setting of the hardening reviews' tests, now filed under the modules they test (netrc, terminal, ----
# -- fsutil, environment, logins, tags, the CLI...) ----------------------------------------------------

# One pip CPU cell, torch 2.13.0: the tests of matrix keys (sizes, budgets) start from it, and the
# hardening tests from it with a private index.
ONE_PIP_CELL = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
torch: "2.13.0"
"""
HARDENING_PIP = ONE_PIP_CELL + "pip:\n  index_url: https://pkgs.example.com/simple\n"


def hardening_project(tmp_path, monkeypatch, text: str = HARDENING_PIP) -> Path:
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    for name in ("NETRC", "DOCKER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")  # never the real engine
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "matrix.yaml").write_text(text)
    return tmp_path


def one_error(args: list[str], monkeypatch, capsys, code: int = 2) -> str:
    """The command exits `code` with one printable error line."""
    got, out, err = run_cli(args, monkeypatch, capsys)
    assert got == code, err
    (line,) = err.splitlines()
    assert line.startswith("error: ") and line.isprintable(), line
    return line


def write_matrix_text(project: Path, text: str) -> Path:
    (project / "matrix.yaml").write_text(text)
    return project / "matrix.yaml"


def list_refused(project: Path, text: str, monkeypatch, capsys) -> str:
    """`list` of this matrix exits 2 with one error line located in matrix.yaml."""
    write_matrix_text(project, text)
    line = one_error(["list"], monkeypatch, capsys)
    assert line.startswith("error: matrix.yaml:"), line
    return line


def render_refused(tmp_path: Path, text: str, monkeypatch, capsys) -> str:
    """`render` of this matrix exits 2 with one printable, located line; nothing is written."""
    path = tmp_path / "matrix.yaml"
    path.write_text(text)
    code, out, err = run_cli(["render", "--matrix", str(path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2, err
    (line,) = err.splitlines()
    assert line.startswith(f"error: {path}:") and line.isprintable(), line
    assert not (tmp_path / "out").exists()
    return line


# One CPU cell, the smallest matrix the input-hardening tests start from; the golden CA file; an
# Ed25519 private key (PKCS#8), for the tests that a key never passes as a certificate.
ONE_CELL = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
torch: "2.7.1"
"""
GOLDEN_CERT = (PACKAGE_DIR.parent / "tests" / "golden" / "certs" / "corp-ca.pem").read_text()
KEY_BODY = "MC4CAQAwBQYDK2VwBCIEIBm5nGyGzDNZm0Ql0sm6yAZdLS0rYH/3wNudt2Wv4nsC"
PRIVATE_KEY = f"-----BEGIN PRIVATE KEY-----\n{KEY_BODY}\n-----END PRIVATE KEY-----\n"
