"""checks.judge against crafted probe reports: a good probe passes, each defect fails its own check."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from imagefactory.probe.checks import Check, judge, passed
from imagefactory.config.model import Cell
from tests.unit.helpers import CPU_OPENBLAS, CUDA_MKL, by_name, failures, good_probe, only_failure, openmp_entry
from imagefactory.probe import smoke


ALL_NAMES = {
    "python.version", "torch.version", "torch.cuda_build", "torch.gpu_available", "torch.gpu_matmul",
    "numpy.blas", "torch.mkl", "mkl.threading_layer", "env.OMP_NUM_THREADS", "env.MKL_NUM_THREADS",
    "env.OPENBLAS_NUM_THREADS", "threads.torch", "threads.numpy_blas", "openmp.single_runtime",
    "user.non_root", "probe.numpy", "probe.torch", "numpy.matmul", "torch.matmul",
    "numpy.complex_blas", "torch.complex_blas", "torch.compile", "python.bytecode", "env.activation",
    "probe.import_time", "packages.locked", "shm.dataloader", "torch.distributed.gloo", "torch.distributed.nccl",
    "platform.machine",
}


@pytest.mark.parametrize("cell, gpu", [(CPU_OPENBLAS, False), (CUDA_MKL, False), (CUDA_MKL, True)])
def test_good_probe_passes_everything(cell, gpu):
    checks = judge(cell, good_probe(cell, gpu=gpu), gpu_required=gpu)
    assert set(by_name(checks)) == ALL_NAMES
    assert passed(checks), [c for c in checks if c.verdict == "fail"]
    for c in checks:
        assert c.verdict in ("pass", "skip", "info") and isinstance(c.actual, str) and isinstance(c.expected, str)


def test_skips_for_cpu_cell_and_openblas():
    checks = by_name(judge(CPU_OPENBLAS, good_probe(CPU_OPENBLAS), gpu_required=True))
    for name in ("torch.gpu_available", "torch.gpu_matmul", "torch.mkl", "mkl.threading_layer", "env.activation"):
        assert checks[name].verdict == "skip", checks[name]


def test_gpu_not_requested_is_skip_showing_what_was_seen():
    checks = by_name(judge(CUDA_MKL, good_probe(CUDA_MKL), gpu_required=False))
    assert checks["torch.gpu_available"].verdict == "skip"
    assert checks["torch.gpu_available"].actual == "not available (no GPU requested)"
    assert checks["torch.gpu_matmul"].verdict == "skip"


def test_wrong_python():
    p = good_probe(CPU_OPENBLAS)
    p["python"]["version"] = "3.10.14"
    assert only_failure(CPU_OPENBLAS, p, "python.version").actual == "3.10"


def test_wrong_torch():
    p = good_probe(CPU_OPENBLAS)
    p["torch"]["version"] = "2.12.1+cpu"
    assert only_failure(CPU_OPENBLAS, p, "torch.version").actual == "2.12.1+cpu"


def test_torch_version_ignores_local_label_and_zero_padding():
    cell = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.7",
                threads=4, base_image="python:3.11-slim-bookworm")
    p = good_probe(cell)
    p["torch"]["version"] = "2.7.0+cpu"
    assert passed(judge(cell, p, gpu_required=False))


def test_cpu_cell_with_cuda_torch():
    p = good_probe(CPU_OPENBLAS)
    p["torch"]["cuda"] = "12.6"
    assert only_failure(CPU_OPENBLAS, p, "torch.cuda_build").actual == "12.6"


def test_cuda_cell_with_cpu_torch():
    p = good_probe(CUDA_MKL)
    p["torch"]["cuda"] = None
    assert only_failure(CUDA_MKL, p, "torch.cuda_build").actual == "none (CPU build)"


def test_cuda_minor_mismatch():
    p = good_probe(CUDA_MKL)
    p["torch"]["cuda"] = "12.8"
    assert "12.8" in only_failure(CUDA_MKL, p, "torch.cuda_build").detail


def test_gpu_required_without_gpu():
    p = good_probe(CUDA_MKL, gpu=False)
    checks = judge(CUDA_MKL, p, gpu_required=True)
    assert failures(checks) == {"torch.gpu_available", "torch.gpu_matmul", "torch.distributed.nccl"}
    assert by_name(checks)["torch.gpu_available"].actual == "not available"


def test_bad_matmul():
    p = good_probe(CUDA_MKL, gpu=True)
    p["torch"]["gpu_matmul"] = {"ok": False, "max_abs_err": 3.5, "tolerance": 1e-3, "error": None}
    check = only_failure(CUDA_MKL, p, "torch.gpu_matmul", gpu_required=True)
    assert "3.5" in check.actual


def test_matmul_error_is_reported():
    p = good_probe(CUDA_MKL, gpu=True)
    p["torch"]["gpu_matmul"] = {"ok": False, "max_abs_err": None, "tolerance": None,
                                "error": "RuntimeError: CUDA error: no kernel image"}
    assert "no kernel image" in only_failure(CUDA_MKL, p, "torch.gpu_matmul", gpu_required=True).detail


def test_mkl_expected_but_openblas():
    p = good_probe(CUDA_MKL)
    p["numpy"]["blas"][0]["internal_api"] = "openblas"
    check = only_failure(CUDA_MKL, p, "numpy.blas")
    assert (check.expected, check.actual) == ("mkl", "openblas")


def test_a_broken_libblas_switch_names_the_library_behind_it():
    """conda's libblas.so.3 is a switch: the failure names the path numpy loaded and the file
    that answers (an MKL cell whose libblas points at OpenBLAS)."""
    p = good_probe(CUDA_MKL)
    p["numpy"]["blas"][0].update(internal_api="openblas", filepath="/opt/env/lib/libblas.so.3",
                                 realpath="/opt/env/lib/libopenblas.so.0")
    check = only_failure(CUDA_MKL, p, "numpy.blas")
    assert check.actual == "openblas"
    assert "/opt/env/lib/libblas.so.3 -> libopenblas.so.0" in check.detail and "cell wants mkl" in check.detail


def test_two_blas_libraries():
    p = good_probe(CPU_OPENBLAS)
    p["numpy"]["blas"].append(dict(p["numpy"]["blas"][0], internal_api="mkl"))
    assert "2 BLAS" in only_failure(CPU_OPENBLAS, p, "numpy.blas").detail


def test_no_blas_found():
    p = good_probe(CPU_OPENBLAS)
    p["numpy"]["blas"] = []
    checks = judge(CPU_OPENBLAS, p, gpu_required=False)
    assert failures(checks) == {"numpy.blas", "threads.numpy_blas"}


def test_threadpoolctl_missing():
    p = good_probe(CPU_OPENBLAS)
    p["numpy"] = {"error": "ModuleNotFoundError: No module named 'threadpoolctl'", "version": "2.2.1", "blas": None}
    p["openmp"] = None
    checks = judge(CPU_OPENBLAS, p, gpu_required=False)
    assert failures(checks) == {"probe.numpy", "numpy.blas", "threads.numpy_blas", "openmp.single_runtime"}
    assert "threadpoolctl" in by_name(checks)["numpy.blas"].detail


def test_mkl_cell_torch_without_mkl():
    p = good_probe(CUDA_MKL)
    p["torch"].update(mkl_available=False, blas_info="open")
    only_failure(CUDA_MKL, p, "torch.mkl")


def test_mkl_cell_blas_info_alone_is_enough():
    p = good_probe(CUDA_MKL)
    p["torch"]["mkl_available"] = None
    assert passed(judge(CUDA_MKL, p, gpu_required=False))


PIP_MKL = Cell(python="3.11", cuda=None, blas="mkl", installer="pip", torch="2.13.0",
               threads=4, base_image="python:3.11-slim-bookworm")


def test_conda_forge_shape_llvm_openmp_under_three_names_and_intel_layer_passes():
    p = good_probe(CUDA_MKL)
    p["openmp"].append(openmp_entry("libiomp5.so", "/opt/env/lib/libomp.so", 2))
    checks = by_name(judge(CUDA_MKL, p, gpu_required=False))
    assert passed(checks.values())
    assert checks["mkl.threading_layer"].verdict == "pass"
    assert checks["mkl.threading_layer"].expected.startswith("intel (for llvm OpenMP")
    assert "libomp.so (as libgomp.so.1, libiomp5.so, libomp.so)" in checks["openmp.single_runtime"].actual


def test_gnu_layer_under_llvm_openmp_fails_naming_the_runtime():
    p = good_probe(CUDA_MKL)
    p["mkl"][0]["threading_layer"] = "gnu"  # MKL_THREADING_LAYER=GNU baked into a conda-forge image
    check = only_failure(CUDA_MKL, p, "mkl.threading_layer")
    assert "gnu" in check.actual and "llvm" in check.detail and "MKL_THREADING_LAYER=INTEL" in check.detail


def test_expectation_follows_the_loaded_runtime_not_the_route():
    p = good_probe(CUDA_MKL)  # a conda cell whose process runs GNU's libgomp: GNU is right there
    p["openmp"] = [openmp_entry("libgomp.so.1", "/usr/lib/libgomp.so.1", 2)]
    p["mkl"][0]["threading_layer"] = "gnu"
    assert by_name(judge(CUDA_MKL, p, gpu_required=False))["mkl.threading_layer"].verdict == "pass"
    p["mkl"][0]["threading_layer"] = "intel"
    only_failure(CUDA_MKL, p, "mkl.threading_layer")


@pytest.mark.parametrize("value, ok", [("GNU", True), (None, False), ("INTEL", False), ("SEQUENTIAL", False)])
def test_static_mkl_judged_by_its_setting_against_libgomp(value, ok):
    p = good_probe(PIP_MKL)  # PyPI torch: MKL linked statically, invisible to threadpoolctl; libgomp
    p["env"]["MKL_THREADING_LAYER"] = value
    if ok:
        assert by_name(judge(PIP_MKL, p, gpu_required=False))["mkl.threading_layer"].verdict == "pass"
    else:
        only_failure(PIP_MKL, p, "mkl.threading_layer")


def test_activation_variable_missing_is_named():
    p = good_probe(CUDA_MKL)
    p["activation"]["missing"] = ["MKL_INTERFACE_LAYER"]
    check = only_failure(CUDA_MKL, p, "env.activation")
    assert "MKL_INTERFACE_LAYER" in check.actual and "MKL_INTERFACE_LAYER" in check.detail
    p = good_probe(CUDA_MKL)
    p["activation"] = {"error": "TimeoutExpired: bash"}
    only_failure(CUDA_MKL, p, "env.activation")


def test_no_activation_scripts_is_a_skip():
    check = by_name(judge(CPU_OPENBLAS, good_probe(CPU_OPENBLAS), gpu_required=False))["env.activation"]
    assert check.verdict == "skip" and "no activate.d scripts in /opt/venv" in check.actual


@pytest.mark.parametrize("missing, stale", [(120, 0), (0, 3)])
def test_bytecode_missing_or_stale(missing, stale):
    p = good_probe(CPU_OPENBLAS)
    p["bytecode"].update(missing=missing, stale=stale, examples=["torch._tensor"])
    assert "torch._tensor" in only_failure(CPU_OPENBLAS, p, "python.bytecode").detail


@pytest.mark.parametrize("key, name", [("numpy_complex", "numpy.complex_blas"), ("torch_complex", "torch.complex_blas")])
def test_wrong_complex_result(key, name):
    p = good_probe(CUDA_MKL)
    p["compute"][key] = {"ok": False, "returncode": 1, "info": None,
                         "error": "AssertionError: scipy.linalg.blas.zdotc: got (0j), want (-13+4j)"}
    assert "zdotc" in only_failure(CUDA_MKL, p, name).actual


def test_torch_compile_fails_without_a_compiler_unless_declared_absent():
    p = good_probe(CPU_OPENBLAS)
    p["compute"]["torch_compile"] = {"ok": False, "returncode": 1, "info": None, "error":
                                     "torch._inductor.exc.InductorError: InvalidCxxCompiler: No working C++ compiler found"}
    assert "InvalidCxxCompiler" in only_failure(CPU_OPENBLAS, p, "torch.compile").detail
    declared = replace(CPU_OPENBLAS, compiler=False)
    checks = by_name(judge(declared, p, gpu_required=False))
    assert passed(checks.values()) and checks["torch.compile"].verdict == "skip"
    assert "compiler: false" in checks["torch.compile"].expected


@pytest.mark.parametrize("numpy_s, torch_s, actual", [
    (0.21, 1.83, "2.04 s (numpy 0.21 s, torch 1.83 s)"),
    (0.21, None, "not measured (only numpy: 0.21 s)"),
    ("1", True, "not measured"),
    (float("nan"), -1, "not measured"),
])
def test_import_time_is_information_only(numpy_s, torch_s, actual):
    p = good_probe(CPU_OPENBLAS)
    p["numpy"]["import_seconds"], p["torch"]["import_seconds"] = numpy_s, torch_s
    checks = by_name(judge(CPU_OPENBLAS, p, gpu_required=False))
    assert checks["probe.import_time"].verdict == "info" and passed(checks.values())
    assert checks["probe.import_time"].actual == actual


def test_compile_skipped_when_the_probe_did_not_run_it():
    p = good_probe(CPU_OPENBLAS)
    del p["compute"]["torch_compile"]  # what `probe.py --no-compile` leaves out
    checks = by_name(judge(replace(CPU_OPENBLAS, compiler=False), p, gpu_required=False))
    assert checks["torch.compile"].verdict == "skip" and checks["torch.compile"].actual == "not run"
    assert passed(checks.values())
    fails = by_name(judge(CPU_OPENBLAS, p, gpu_required=False))["torch.compile"]
    assert fails.verdict == "fail" and fails.actual == "not reported"  # a compiler cell must run it


AUTO_CELL = replace(CPU_OPENBLAS, threads="auto")


@pytest.mark.parametrize("affinity, quota, budget", [(8, None, 8), (8, 1.0, 1), (8, 1.5, 1), (1, None, 1),
                                                     (8, 0.5, 1), (4, 6.0, 4)])
def test_threads_auto_expects_the_container_budget(affinity, quota, budget):
    p = good_probe(replace(CPU_OPENBLAS, threads=budget), cpus=affinity)
    p["cpus"]["cgroup_quota"] = quota
    checks = by_name(judge(AUTO_CELL, p, gpu_required=False))
    assert passed(checks.values()), [c for c in checks.values() if c.verdict == "fail"]
    assert checks["env.OMP_NUM_THREADS"].expected == str(budget)
    p["env"]["OMP_NUM_THREADS"] = str(budget + 1)  # oversubscribed: baked or not recomputed
    only_failure(AUTO_CELL, p, "env.OMP_NUM_THREADS")


@pytest.mark.parametrize("var", ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"])
@pytest.mark.parametrize("value", [None, "8", " 4", "4.0"])
def test_thread_env_missing_or_wrong(var, value):
    p = good_probe(CPU_OPENBLAS)
    if value is None:
        del p["env"][var]
    else:
        p["env"][var] = value
    check = only_failure(CPU_OPENBLAS, p, f"env.{var}")
    assert check.expected == "4"


def test_torch_threads_capped_by_mkl_at_physical_cores_passes():
    p = good_probe(CPU_OPENBLAS, cpus=4)  # MKL_NUM_THREADS=4, 4 logical CPUs on 2 cores
    p["cpus"]["physical_cores"] = 2
    p["torch"]["num_threads"] = 2
    assert passed(judge(CPU_OPENBLAS, p, gpu_required=False))


def test_torch_threads_wrong():
    p = good_probe(CPU_OPENBLAS)
    p["torch"]["num_threads"] = 2
    only_failure(CPU_OPENBLAS, p, "threads.torch")


def test_numpy_blas_threads_capped_at_cpu_count_passes():
    p = good_probe(CPU_OPENBLAS, cpus=2)  # OPENBLAS_NUM_THREADS=4 on 2 visible CPUs reports 2
    p["numpy"]["blas"][0]["num_threads"] = 2
    checks = judge(CPU_OPENBLAS, p, gpu_required=False)
    assert passed(checks)
    assert by_name(checks)["threads.numpy_blas"].expected.startswith("2 or 4")


def test_numpy_blas_threads_other_value_fails():
    p = good_probe(CPU_OPENBLAS, cpus=2)
    p["numpy"]["blas"][0]["num_threads"] = 1
    only_failure(CPU_OPENBLAS, p, "threads.numpy_blas")
    p = good_probe(CPU_OPENBLAS, cpus=8)  # plenty of CPUs: no capping excuse
    p["numpy"]["blas"][0]["num_threads"] = 2
    only_failure(CPU_OPENBLAS, p, "threads.numpy_blas")


def test_two_openmp_runtimes():
    p = good_probe(CPU_OPENBLAS)
    p["openmp"].append(openmp_entry("libiomp5.so", "/opt/lib/libiomp5.so", 2))
    check = only_failure(CPU_OPENBLAS, p, "openmp.single_runtime")
    assert "/opt/lib/libiomp5.so" in check.actual and "/opt/venv/lib/libgomp.so.1" in check.actual


def test_two_copies_of_one_implementation_are_two_runtimes():
    p = good_probe(CPU_OPENBLAS)  # each copy keeps its own thread pool
    p["openmp"].append(openmp_entry("libgomp-a34b3233.so.1", "/opt/torch/lib/libgomp-a34b3233.so.1", 4))
    only_failure(CPU_OPENBLAS, p, "openmp.single_runtime")


def test_one_runtime_under_two_names_is_one_runtime():
    p = good_probe(CPU_OPENBLAS)
    p["openmp"].append(openmp_entry("libgomp-alias.so.1", "/opt/venv/lib/libgomp.so.1", 4))
    assert passed(judge(CPU_OPENBLAS, p, gpu_required=False))


def test_root_user():
    p = good_probe(CPU_OPENBLAS)
    p["user"] = {"uid": 0, "gid": 0, "name": "root"}
    assert only_failure(CPU_OPENBLAS, p, "user.non_root").actual == "uid 0"


@pytest.mark.parametrize("cell, gpu_required", [(CPU_OPENBLAS, False), (CUDA_MKL, True)])
def test_torch_import_error(cell, gpu_required):
    p = good_probe(cell)
    p["torch"] = {"error": "ImportError: libcudnn.so.9: cannot open shared object file", "version": None,
                  "cuda": None, "cuda_available": False, "gpu_matmul": None}
    checks = by_name(judge(cell, p, gpu_required=gpu_required))
    assert checks["probe.torch"].verdict == "fail" and "libcudnn" in checks["probe.torch"].detail
    torch_derived = ["torch.version", "torch.cuda_build", "threads.torch", "torch.matmul", "torch.complex_blas",
                     "torch.compile", "shm.dataloader", "torch.distributed.gloo"]
    if cell.blas == "mkl":
        torch_derived.append("torch.mkl")
    if gpu_required:
        torch_derived += ["torch.gpu_available", "torch.gpu_matmul", "torch.distributed.nccl"]
    for name in torch_derived:
        assert checks[name].verdict == "fail", checks[name]
        assert checks[name].actual == "torch not importable"
        assert "libcudnn" in checks[name].detail
    assert {n for n, c in checks.items() if c.verdict == "fail"} == {"probe.torch", *torch_derived}


def test_empty_probe_fails_without_raising():
    for cell, gpu in ((CPU_OPENBLAS, False), (CUDA_MKL, True)):
        checks = judge(cell, {}, gpu_required=gpu)
        named = by_name(checks)
        assert set(named) == ALL_NAMES
        assert not passed(checks)
        for name in ("probe.numpy", "probe.torch", "python.version", "platform.machine", "user.non_root", "torch.version",
                     "numpy.blas", "env.OMP_NUM_THREADS", "threads.torch", "threads.numpy_blas",
                     "openmp.single_runtime"):
            assert named[name].verdict == "fail", named[name]


@pytest.mark.parametrize("mutate", [
    lambda p: p.update(torch="garbage"),
    lambda p: p.update(numpy={"blas": "not a list"}),
    lambda p: p["numpy"].update(blas=[None, 3]),
    lambda p: p.update(env=None, cpus=[], user="x", python=None),
    lambda p: p["torch"].update(version=None, cuda=7, gpu_matmul="x"),
    lambda p: p.update(openmp=[None, {"prefix": None}, "x"]),
])
def test_malformed_probes_never_raise(mutate):
    for cell in (CPU_OPENBLAS, CUDA_MKL):
        p = copy.deepcopy(good_probe(cell, gpu=True))
        mutate(p)
        checks = judge(cell, p, gpu_required=True)
        assert all(isinstance(c, Check) and c.verdict in ("pass", "fail", "skip", "info") for c in checks)
        assert not passed(checks)
        assert "probe.judge" not in {c.name for c in checks}


def test_non_dict_probe():
    assert not passed(judge(CPU_OPENBLAS, None, gpu_required=False))  # type: ignore[arg-type]


def test_numpy_matmul_that_aborts_is_caught():
    cell = Cell(python="3.11", cuda=None, blas="mkl", installer="conda", torch="2.7.1", threads=4,
                base_image="debian:bookworm-slim")
    probe = good_probe(cell)
    probe["compute"]["numpy_matmul"] = {"ok": False, "returncode": 127,
                                        "error": "symbol lookup error: libmkl_gnu_thread.so: undefined symbol: omp_get_num_procs"}
    check = only_failure(cell, probe, "numpy.matmul")
    assert "omp_get_num_procs" in check.actual


def test_torch_matmul_wrong_result_is_caught():
    cell = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.13.0", threads=2,
                base_image="python:3.11-slim-bookworm")
    probe = good_probe(cell)
    probe["compute"]["torch_matmul"] = {"ok": False, "returncode": 1, "error": "AssertionError: (1.0, 2.0)"}
    only_failure(cell, probe, "torch.matmul")


def test_compute_not_reported_fails():
    cell = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.13.0", threads=2,
                base_image="python:3.11-slim-bookworm")
    probe = good_probe(cell)
    del probe["compute"]
    assert {"numpy.matmul", "torch.matmul"} <= failures(judge(cell, probe, gpu_required=False))


# -- moved from test_caught_mutants.py ----------------------------------------


def test_a_blas_running_every_host_cpu_fails_a_cell_that_asked_for_fewer():
    """Mutant: the allowed counts use the CPU cap itself instead of min(threads, cap). On a
    64-CPU host a threads: 4 cell whose BLAS and torch run 64 threads then passed."""
    assert CPU_OPENBLAS.threads == 4
    p = good_probe(CPU_OPENBLAS, cpus=64)
    assert passed(judge(CPU_OPENBLAS, p, gpu_required=False))
    p["numpy"]["blas"][0]["num_threads"] = 64
    p["torch"]["num_threads"] = 64
    checks = {c.name: c for c in judge(CPU_OPENBLAS, p, gpu_required=False)}
    assert {n for n, c in checks.items() if c.verdict == "fail"} == {"threads.numpy_blas", "threads.torch"}
    assert checks["threads.torch"].expected == "4"  # no capping excuse: 64 CPUs are plenty


@pytest.mark.parametrize("cpus, allowed", [(64, {4}), (4, {4}), (3, {3, 4}), (1, {1, 4})])
def test_allowed_thread_counts_are_the_request_and_the_request_capped(cpus, allowed):
    for n in range(1, 70):
        p = good_probe(CPU_OPENBLAS, cpus=cpus)
        p["numpy"]["blas"][0]["num_threads"] = p["torch"]["num_threads"] = n
        assert passed(judge(CPU_OPENBLAS, p, gpu_required=False)) == (n in allowed), n


# -- moved from test_hardening_iii.py ----------------------------------------


def test_an_hpc_probe_that_reports_no_launch_facts_fails_launch_conditions():
    from imagefactory.probe import checks

    expect = smoke.MODES["hpc"].expect()
    assert expect.get("root read-only") is True
    probe = {"user": {"uid": expect["uid"], "name": None}, "cpus": {"affinity": expect.get("CPUs (affinity)", 1)}}
    got = checks.launch_conditions(expect, probe)
    assert got.verdict == "fail" and "root read-only is None" in (got.detail or "")
    assert checks.launch_conditions(expect, {**probe, "launch": "garbage"}).verdict == "fail"
