"""issue 8: `imagefactory doctor` on this real host (engine, no GPU) and `imagefactory bench`
in a real built image (the small pip CPU cell)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.integration.helpers import REPO, TEST_REGISTRY, matrix_text, run_cli

pytestmark = pytest.mark.docker

CELL = "py3.11-cpu-openblas-pip"

CPU_AND_GPU = """
    matrix:
      python: ["3.11"]
      cuda: ["none", "13.0"]
      blas: [openblas]
      installer: [pip]
"""


@pytest.fixture
def no_gpu_here():
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0"):
        pytest.skip("this test describes a host without a GPU; this one has one")


def doctor(*args: str, cwd=None, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "imagefactory", "doctor", *args], capture_output=True,
                          text=True, cwd=cwd, env=full_env, timeout=120)


def test_doctor_here_reports_engine_no_gpu_and_judges_each_cell(engine, wheelhouse, tmp_path, no_gpu_here):
    path = tmp_path / "matrix.yaml"
    path.write_text(matrix_text(image="127.0.0.1:5001/doctor/train", wheelhouse=wheelhouse, cells=CPU_AND_GPU))
    result = doctor("--matrix", str(path), "--format", "json")
    assert result.returncode == 1, result.stdout + result.stderr  # the GPU cell cannot run here
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == 1
    assert doc["engine"]["reachable"] is True
    assert doc["engine"]["version"] == engine.client.version()["Version"]
    assert doc["gpu"] is False and doc["driver"]["version"] is None
    assert "nvidia-smi" in doc["driver"]["error"]
    cells = {c["cell"]: c for c in doc["cells"]}
    assert cells["py3.11-cpu-openblas-pip"]["verdict"] == "runs"
    gpu = cells["py3.11-cu13.0-openblas-pip"]
    assert gpu["verdict"] == "cannot-run" and "no GPU" in gpu["reason"]
    assert "580.65.06" in gpu["fix"] and "py3.11-cpu-openblas-pip" in gpu["fix"]
    assert doc["recommended"] == cells["py3.11-cpu-openblas-pip"]["tag"] == "127.0.0.1:5001/doctor/train:2.13.0-py3.11-cpu-openblas-pip"

    text = doctor("--matrix", str(path))
    assert text.returncode == 1
    assert "only CPU cells can run here" in text.stdout
    assert f"pull:     {doc['recommended']}" in text.stdout


def test_doctor_exit_0_when_every_cell_runs_and_host_facts_without_a_matrix(engine, wheelhouse, tmp_path,
                                                                             no_gpu_here):
    path = tmp_path / "cpu.yaml"
    path.write_text(matrix_text(image="127.0.0.1:5001/doctor/train", wheelhouse=wheelhouse))
    result = doctor("--matrix", str(path), "--format", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [c["verdict"] for c in json.loads(result.stdout)["cells"]] == ["runs"]

    bare = doctor("--format", "json", cwd=tmp_path)  # no --matrix, no matrix.yaml here: host facts only
    assert bare.returncode == 0, bare.stderr
    doc = json.loads(bare.stdout)
    assert doc["matrix"] is None and doc["cells"] == [] and doc["engine"]["reachable"] is True


def test_doctor_exit_3_without_an_engine(tmp_path):
    result = doctor("--format", "json", cwd=tmp_path, env={"DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    assert result.returncode == 3, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["engine"]["reachable"] is False and "no Docker engine answered" in doc["engine"]["error"]


@pytest.fixture(scope="module")
def cpu_image(tmp_path_factory, engine, base_registry, wheelhouse, session_id, created_images, cpu_build):
    """The small pip CPU cell: the shared cpu_build's good cell under another name (same content
    hash), so `imagefactory build` finds it built and tested, and bench measures that image."""
    root = tmp_path_factory.mktemp("bench")
    path = root / "matrix.yaml"
    path.write_text(matrix_text(image=f"{TEST_REGISTRY}/bench-{session_id}/train", wheelhouse=wheelhouse))
    result = run_cli("build", "--matrix", str(path), "--plain", "--gpus", "none",
                     "--report", str(root / "report.json"), "--work-dir", str(root / "work"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (cell,) = json.loads((root / "report.json").read_text())["cells"]
    assert cell["candidate"] == cpu_build.good_image, (cell, cpu_build.good_image)
    return path, root


def test_bench_measures_the_built_cpu_image(cpu_image, engine):
    path, root = cpu_image
    out = root / "bench.json"
    result = run_cli("bench", "--matrix", str(path), "--work-dir", str(root / "work"), "--out", str(out),
                     "--budget", "400", timeout=900)  # slack for a loaded machine; idle, it takes far less
    assert result.returncode == 0, result.stdout + result.stderr
    good = json.loads(out.read_text())["cells"][0]
    assert good["cell"] == CELL and good["status"] == "measured", good
    figures = {f["name"] + ("" if f["container"] == "default" else " " + f["container"]): f for f in good["figures"]}
    for name in ("gemm.numpy", "gemm.torch", "oversub.numpy --cpus 1", "oversub.torch --cpus 1", "dataloader"):
        f = figures[name]
        assert f["status"] == "ok", f
        assert f["baseline"]["value"] > 0 and f["candidate"]["value"] > 0 and f["speedup"] > 0, f
    host = engine.client.info()["NCPU"]
    assert figures["oversub.torch --cpus 1"]["baseline"]["label"] == f"threads = host cores ({host})"
    # the workload found the --cpus 1 quota itself (cgroup), not os.cpu_count()
    assert figures["oversub.torch --cpus 1"]["candidate"]["label"] == "threads = CPU budget (1)"
    assert figures["gemm.torch"]["candidate"]["label"] == "image threads (2)"  # the matrix bakes threads: 2
    # the image ships the compiler (compiler: true, the default), so torch.compile must work; a
    # missing compiler as a failed figure is test_bench.py's test_workload_child_failure_is_a_figure_error
    compile_ = figures["compile"]
    assert compile_["status"] == "ok" and compile_["error"] == "", compile_  # bench writes "" for no error
    assert compile_["baseline"]["value"] > 0 and compile_["candidate"]["value"] > 0 and compile_["speedup"] > 0
    for name in ("gpu.amp", "gpu.gemm"):
        assert figures[name]["status"] == "skipped" and "no CUDA device" in figures[name]["error"]
    md = out.with_suffix(".md").read_text()
    assert f"## `{CELL}`: measured" in md and "| gemm.torch |" in md
    assert "gemm.torch" in result.stdout and "×" in result.stdout


def test_bench_of_a_cell_never_built_fails_without_running_anything(cpu_image):
    path, root = cpu_image
    changed = root / "changed.yaml"  # one more package: another content hash, so no image
    changed.write_text(path.read_text() + "packages: [imagefactory-never-built]\n")
    out = root / "changed.json"
    result = run_cli("bench", "--matrix", str(changed), "--work-dir", str(root / "work2"), "--out", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{CELL}: not-built" in result.stdout and "1 of 1 cell(s) not measured" in result.stderr
    assert json.loads(out.read_text())["cells"][0]["status"] == "not-built"
