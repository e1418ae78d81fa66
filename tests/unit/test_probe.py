"""The in-image probe, run in a subprocess of the Python running the tests (no Docker).

The host needs numpy and threadpoolctl; torch may be absent, and then the probe must
say so and still report everything else.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[2] / "imagefactory" / "resources" / "probe.py"
PYTHON = sys.executable  # the interpreter the test extra was installed into, not whatever is on PATH
THREAD_ENV = {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3",
              "MKL_THREADING_LAYER": "GNU"}


def _has(module: str) -> bool:
    out = subprocess.run([PYTHON, "-c", f"import {module}"], capture_output=True)
    return out.returncode == 0


def run_probe(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[dict, str, str]:
    full_env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV and k != "PYTHONPATH"}
    full_env.update(env or {})
    proc = subprocess.run([PYTHON, "-I", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout  # exactly one JSON document, on one line, nothing else
    return json.loads(lines[0]), proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    if not (_has("numpy") and _has("threadpoolctl")):
        pytest.fail(f"{PYTHON} lacks numpy or threadpoolctl: install the test extra (pip install -e '.[test]')")
    cwd = tmp_path_factory.mktemp("probe-cwd")
    return run_probe(str(PROBE), cwd=cwd, env=THREAD_ENV)[0]


def test_probe_imports_only_stdlib_and_what_it_inspects():
    tree = ast.parse(PROBE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert "imagefactory" not in imported
    assert not re.search(r"^\s*(import|from)\s+imagefactory", PROBE.read_text(), re.M)
    assert "__import__(\"imagefactory" not in PROBE.read_text()
    allowed_third_party = {"numpy", "threadpoolctl", "torch"}
    for name in imported - allowed_third_party:
        spec = importlib.util.find_spec(name)
        assert spec is not None and "site-packages" not in (spec.origin or ""), name


def test_report_shape(report):
    assert report["probe_version"] == 2
    for key in ("python", "user", "cpus", "env", "numpy", "torch", "openmp", "threadpool_info"):
        assert key in report, key
    assert report["python"]["version"].count(".") == 2
    assert os.path.isabs(report["python"]["executable"])
    assert report["user"]["uid"] == os.getuid() and report["user"]["gid"] == os.getgid()
    cpus = report["cpus"]
    assert cpus["os_cpu_count"] == os.cpu_count()
    assert cpus["affinity"] == len(os.sched_getaffinity(0))
    assert cpus["cgroup_quota"] is None or cpus["cgroup_quota"] > 0


def test_env_is_reported(report):
    for k, v in THREAD_ENV.items():
        assert report["env"][k] == v
    assert "NVIDIA_VISIBLE_DEVICES" in report["env"] and "NVIDIA_DRIVER_CAPABILITIES" in report["env"]


def test_numpy_blas_seen_with_threads(report):
    numpy = report["numpy"]
    assert numpy["error"] is None and numpy["version"]
    assert numpy["blas"], "threadpoolctl found no BLAS behind numpy"
    cap = min(3, report["cpus"]["affinity"], report["cpus"]["os_cpu_count"])
    for lib in numpy["blas"]:
        assert lib["internal_api"] in ("openblas", "mkl", "blis", "flexiblas")
        assert lib["num_threads"] in (3, cap)  # OPENBLAS_NUM_THREADS=3, capped at visible CPUs
        assert set(lib) >= {"version", "threading_layer", "filepath", "architecture"}


def test_torch_section(report):
    torch = report["torch"]
    if not _has("torch"):
        assert torch["error"].startswith("ModuleNotFoundError")
        assert torch["version"] is None and torch["gpu_matmul"] is None
        assert isinstance(report["openmp"], list)  # later sections still ran
        return
    assert torch["error"] is None, torch
    cpus = report["cpus"]
    cap = min(3, *(c for c in (cpus["affinity"], cpus["os_cpu_count"], cpus["physical_cores"]) if c))
    assert torch["version"] and torch["num_threads"] in (3, cap)  # from the env, capped at the CPUs
    assert isinstance(torch["mkl_available"], bool)
    assert torch["cuda"] is None or torch["cuda"].count(".") >= 1
    if torch["cuda_available"]:
        assert torch["device_count"] == len(torch["devices"]) >= 1
        assert torch["gpu_matmul"]["ok"] is True, torch["gpu_matmul"]
    else:
        assert torch["gpu_matmul"] is None


def test_openmp_list_is_from_threadpool_info(report):
    openmp = [e for e in report["threadpool_info"] if e["user_api"] == "openmp"]
    assert [e["filepath"] for e in report["openmp"]] == [e["filepath"] for e in openmp]
    assert report["threadpool_error"] is None


def test_runs_as_dash_c_from_any_cwd(tmp_path):
    if not _has("numpy"):
        pytest.fail(f"{PYTHON} lacks numpy: install the test extra (pip install -e '.[test]')")
    report, _, _ = run_probe("-c", PROBE.read_text(), cwd=tmp_path)
    assert report["probe_version"] == 2
    assert report["env"]["OMP_NUM_THREADS"] is None


def test_never_crashes_without_any_package(tmp_path):
    """A python without numpy, threadpoolctl and torch: every section errors, one JSON line still comes."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    for name in ("numpy", "threadpoolctl", "torch"):
        (blocker / f"{name}.py").write_text("raise ImportError('blocked for the test')\n")
    script = f"import sys; sys.path.insert(0, {str(blocker)!r}); " + "exec(compile(open(%r).read(), 'probe', 'exec'))" % str(PROBE)
    report, _, _ = run_probe("-c", script, cwd=tmp_path)
    assert report["numpy"]["error"] == "ImportError: blocked for the test" and report["numpy"]["blas"] is None
    assert report["torch"]["error"] == "ImportError: blocked for the test"
    assert report["openmp"] is None and report["threadpool_error"].startswith("ImportError")
    assert report["python"]["version"] and report["user"]["uid"] == os.getuid()


def test_stray_prints_go_to_stderr(tmp_path):
    """A package that prints on import (Python-level and C-level) must not spoil stdout."""
    noisy = tmp_path / "noisy"
    noisy.mkdir()
    (noisy / "torch.py").write_text(
        "import os\nprint('hello from torch')\nos.write(1, b'raw fd1 chatter\\n')\n"
        "raise RuntimeError('no torch here')\n")
    script = f"import sys; sys.path.insert(0, {str(noisy)!r}); " + "exec(compile(open(%r).read(), 'probe', 'exec'))" % str(PROBE)
    report, stdout, stderr = run_probe("-c", script, cwd=tmp_path)
    assert report["torch"]["error"] == "RuntimeError: no torch here"
    assert "hello from torch" in stderr and "raw fd1 chatter" in stderr
    assert "hello" not in stdout and "chatter" not in stdout


def test_new_sections_on_the_host(report):
    """Bytecode, activation and the compute children report in their documented shapes."""
    bc = report["bytecode"]
    assert bc["checked"] > 0 and {"missing", "stale", "examples"} <= set(bc)
    act = report["activation"]
    assert act["error"] is None and isinstance(act["scripts"], list) and isinstance(act["missing"], list)
    compute = report["compute"]
    assert set(compute) >= {"numpy_matmul", "torch_matmul", "numpy_complex", "torch_complex", "torch_compile",
                            "import_time"}
    if _has("numpy"):
        assert compute["numpy_complex"]["ok"] is True, compute["numpy_complex"]
    if not _has("torch"):
        assert compute["torch_compile"]["ok"] is False
        assert "ModuleNotFoundError" in compute["torch_compile"]["error"]
