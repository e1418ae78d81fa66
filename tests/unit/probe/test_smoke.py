"""Launch modes (smoke.MODES), judged on crafted probes and run through an in-memory engine:
each mode is judged on its own, names its failing checks, and gives the report its launches;
the shm, distributed and torch.compile-place checks fail where they must and name the fix."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from imagefactory.probe import checks
from imagefactory.report import summary as report
from imagefactory.probe import smoke
from imagefactory.errors import ConfigError
from tests.fake_engine import Image, World, as_launched
from tests.unit.helpers import CPU_OPENBLAS, CUDA_MKL, by_name, good_probe, only_failure
from imagefactory.cli import app as cli


def launched(cell=CPU_OPENBLAS, mode: str = "hpc", **kw) -> dict:
    m = smoke.MODES[mode]
    return as_launched(good_probe(cell, **kw), m.options(smoke.DEFAULT_SHM), m.environment())


def all_modes(cell=CPU_OPENBLAS, **kw) -> dict:
    return {m: launched(cell, m, **kw) for m in smoke.DEFAULT_MODES}


# -- the modes' container options -----------------------------------------------------------

def test_modes_ask_the_engine_for_what_gpu_nodes_do():
    docker, bare, hpc = (smoke.MODES[m].options("1g") for m in ("docker", "bare", "hpc"))
    assert docker == {"shm_size": "1g"}
    assert bare == {"entrypoint": ["python"], "shm_size": "1g"}
    assert hpc == {"entrypoint": ["python"], "user": "4242:4242", "read_only": True, "cpuset_cpus": "0",
                   "tmpfs": {"/tmp": "rw,exec,nosuid,nodev,mode=1777"}, "shm_size": "1g"}
    assert smoke.MODES["hpc"].environment() == {"HOME": "/nonexistent"}
    assert smoke.shm_options("host") == {"ipc_mode": "host"} and smoke.shm_options("default") == {}


@pytest.mark.parametrize("bad", ["", "1", "0g", "host ", "1g;rm", "-1g", "1234567g", "HOST"])
def test_shm_values_are_checked_whole(bad):
    with pytest.raises(ConfigError, match="--probe-shm"):
        smoke.check_shm(bad)


def test_every_mode_runs_side_by_side_through_the_engine():
    world = World()
    world.images["sha256:1"] = Image("sha256:1", {}, {"img"}, CPU_OPENBLAS.id)
    world.probes[CPU_OPENBLAS.id] = good_probe(CPU_OPENBLAS)
    result = smoke.test_image(world.engine(), replace(CPU_OPENBLAS, compiler=False), "img", gpus=False)
    assert result.passed, [c for c in result.checks if c.verdict == "fail"]
    runs = world.ops("run_options")
    assert sorted(o.get("user", "") for _, o, _ in runs) == ["", "", "4242:4242"]
    assert sorted(json.dumps(o.get("entrypoint")) for _, o, _ in runs) == ['["python"]', '["python"]', "null"]
    assert checks.launches(result.checks) == {"docker": "pass", "bare": "pass", "hpc": "pass"}
    assert result.probe is not None and sorted(result.probe) == ["bare", "docker", "hpc"]
    assert "--- launch mode hpc ---" in result.stdout


def test_a_mode_whose_container_crashed_fails_alone_and_is_named():
    world = World()
    world.images["sha256:1"] = Image("sha256:1", {}, {"img"}, CPU_OPENBLAS.id)
    good = good_probe(CPU_OPENBLAS)
    world.probes[CPU_OPENBLAS.id] = lambda options, env: "crash" if "read_only" in options else good
    result = smoke.test_image(world.engine(), CPU_OPENBLAS, "img", gpus=False)
    assert not result.passed and result.probe is None  # nothing to cache
    assert checks.launches(result.checks) == {"docker": "pass", "bare": "pass", "hpc": "fail"}
    assert [(c.mode, c.name) for c in result.checks if c.verdict == "fail"] == [("hpc", "probe.ran")]


def test_unknown_modes_are_refused():
    with pytest.raises(ConfigError, match="allowed: docker, bare, hpc"):
        smoke.test_image(World().engine(), CPU_OPENBLAS, "img", gpus=False, modes=("docker", "k8s"))


# -- judging per mode -----------------------------------------------------------------------

def test_each_mode_is_judged_on_its_own_probe():
    probes = all_modes()
    probes["bare"]["env"]["OMP_NUM_THREADS"] = None  # the entrypoint set it; bypassed, nothing does
    found = smoke.judge(CPU_OPENBLAS, probes, gpu_required=False)
    assert [(c.mode, c.name) for c in found if c.verdict == "fail"] == [("bare", "env.OMP_NUM_THREADS")]
    assert checks.launches(found) == {"docker": "pass", "bare": "fail", "hpc": "pass"}
    per_mode = {m: by_name([c for c in found if c.mode == m]) for m in smoke.DEFAULT_MODES}
    assert set(per_mode["docker"]) == set(per_mode["hpc"])  # the same facts in every mode


def test_thread_expectations_follow_each_modes_cpu_budget():
    """threads: auto wants the budget of each mode's container: 8 CPUs under docker, 1 in hpc."""
    auto = replace(CPU_OPENBLAS, threads="auto")
    probes = all_modes(replace(CPU_OPENBLAS, threads=8))
    probes["hpc"]["env"].update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    probes["hpc"]["torch"]["num_threads"] = 1
    probes["hpc"]["numpy"]["blas"][0]["num_threads"] = 1
    found = smoke.judge(auto, probes, gpu_required=False)
    assert checks.passed(found), [c for c in found if c.verdict == "fail"]
    hpc = by_name([c for c in found if c.mode == "hpc"])
    assert hpc["env.OMP_NUM_THREADS"].expected == "1"
    # the docker value (8) in the 1-CPU hpc container is the oversubscription the modes catch
    probes["hpc"]["env"]["OMP_NUM_THREADS"] = "8"
    bad = smoke.judge(auto, probes, gpu_required=False)
    assert [(c.mode, c.name) for c in bad if c.verdict == "fail"] == [("hpc", "env.OMP_NUM_THREADS")]


def test_launch_conditions_catch_a_launch_that_did_not_happen():
    probes = all_modes()
    probes["hpc"]["user"].update(uid=1000, name="trainer")  # the engine ignored --user
    probes["hpc"]["launch"]["tmp_noexec"] = True  # and --tmpfs /tmp:exec
    found = smoke.judge(CPU_OPENBLAS, probes, gpu_required=False)
    bad = [c for c in found if c.verdict == "fail"]
    assert [(c.mode, c.name) for c in bad] == [("hpc", "launch.conditions")]
    assert "uid is 1000, the mode asks for 4242" in bad[0].detail and "/tmp noexec" in bad[0].detail
    docker = by_name([c for c in found if c.mode == "docker"])["launch.conditions"]
    assert docker.verdict == "info" and "uid: 1000" in docker.actual


def test_a_missing_or_garbage_mode_probe_fails_as_not_run():
    found = smoke.judge(CPU_OPENBLAS, {"docker": launched(mode="docker"), "hpc": "garbage", "k8s": {}},
                        gpu_required=False)
    bad = [(c.mode, c.name) for c in found if c.verdict == "fail"]
    assert bad == [("hpc", "probe.ran"), ("k8s", "probe.ran")]


# -- shm, distributed, compile place --------------------------------------------------------

def test_dataloader_shm_failure_names_the_size_and_the_fix():
    p = good_probe(CPU_OPENBLAS)
    p["launch"]["shm_bytes"] = 64 << 20
    p["compute"]["dataloader_shm"] = {"ok": False, "returncode": 0, "info": None,
                                      "error": "RuntimeError: DataLoader timed out after 20 seconds"}
    check = only_failure(CPU_OPENBLAS, p, "shm.dataloader")
    assert "64 MiB" in check.actual and "64 MiB" in check.detail
    for fix in ("--ipc=host", "--shm-size=", "emptyDir", "medium: Memory", "/dev/shm"):
        assert fix in check.detail, fix
    p["compute"].pop("dataloader_shm")  # a probe that never ran it fails too
    assert "not reported" in only_failure(CPU_OPENBLAS, p, "shm.dataloader").actual


def test_gloo_all_reduce_failure_is_caught():
    p = good_probe(CPU_OPENBLAS)
    p["compute"]["gloo_all_reduce"] = {"ok": False, "returncode": 0, "info": None,
                                       "error": "AssertionError: rank 0 got (1.0, 1.0), want 3.0 everywhere"}
    assert "want 3.0" in only_failure(CPU_OPENBLAS, p, "torch.distributed.gloo").detail


def test_nccl_is_judged_only_where_gpus_are_given():
    p = good_probe(CUDA_MKL, gpu=True)
    assert by_name(checks.judge(CUDA_MKL, p, gpu_required=True))["torch.distributed.nccl"].verdict == "pass"
    assert by_name(checks.judge(CUDA_MKL, p, gpu_required=False))["torch.distributed.nccl"].verdict == "skip"
    assert by_name(checks.judge(CPU_OPENBLAS, good_probe(CPU_OPENBLAS), gpu_required=True))[
        "torch.distributed.nccl"].verdict == "skip"
    p["compute"]["nccl_all_reduce"] = {"ok": False, "returncode": 0, "info": None,
                                       "error": "AssertionError: rank 0: exit 1: NCCL error: unhandled system error"}
    check = only_failure(CUDA_MKL, p, "torch.distributed.nccl", gpu_required=True)
    assert "NCCL error" in check.detail
    del p["compute"]["nccl_all_reduce"]  # a GPU probe that never ran NCCL
    assert only_failure(CUDA_MKL, p, "torch.distributed.nccl", gpu_required=True).actual == "not reported"


def test_compile_on_a_noexec_cache_place_names_the_fix():
    p = good_probe(CPU_OPENBLAS)
    p["compute"]["compile_place"]["info"].update(noexec=True)
    p["compute"]["torch_compile"] = {"ok": False, "returncode": 0, "info": None, "error":
                                     "InductorError: OSError: /tmp/x.so: failed to map segment from shared object"}
    check = only_failure(CPU_OPENBLAS, p, "torch.compile")
    for part in ("/tmp is mounted noexec", "--tmpfs /tmp:exec", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert part in check.detail, part
    p["compute"]["compile_place"]["info"].update(noexec=False, writable=False)
    assert "/tmp is not writable" in only_failure(CPU_OPENBLAS, p, "torch.compile").detail
    # a compile that failed for another reason says only that
    p["compute"]["compile_place"]["info"].update(writable=True)
    assert "--tmpfs" not in only_failure(CPU_OPENBLAS, p, "torch.compile").detail


# -- the report -----------------------------------------------------------------------------

def test_report_gives_each_cell_its_launches_and_names_failing_modes(tmp_path):
    probes = all_modes()
    probes["hpc"]["compute"]["gloo_all_reduce"]["ok"] = False
    r = report.CellReport("py3.11-cpu-openblas-pip", status=report.CHECK_FAILED,
                          checks=smoke.judge(CPU_OPENBLAS, probes, gpu_required=False))
    untested = report.CellReport("py3.12-cpu-openblas-pip", status=report.BUILD_FAILED)
    path, md = report.write([r, untested], tmp_path / "report.json", gpus=False)
    cells = json.loads(path.read_text())["cells"]
    assert cells[0]["launches"] == {"docker": "pass", "bare": "pass", "hpc": "fail"}
    assert cells[1]["launches"] == {}
    assert {c["mode"] for c in cells[0]["checks"]} == {"docker", "bare", "hpc"}
    text = md.read_text()
    # a column per launch mode, the failing check named with its mode, and in the cell's table
    # one row for the check, failing in hpc alone, listed first
    assert "| cell | status | docker | bare | hpc | publish | failing checks |" in text
    assert "| `py3.11-cpu-openblas-pip` | check-failed | ✅ | ✅ | ❌ | — | `torch.distributed.gloo` (hpc) |" in text
    table = text.split("## `py3.11-cpu-openblas-pip`: check-failed", 1)[1]
    first_row = [line for line in table.splitlines() if line.startswith("| ")][1]
    assert first_row.startswith("| torch.distributed.gloo | ✅ | ✅ | ❌") and table.count("| torch.distributed.gloo |") == 1


def test_good_probes_of_every_mode_pass_for_every_cell_shape():
    for cell, gpu in ((CPU_OPENBLAS, False), (CUDA_MKL, True)):
        found = smoke.judge(cell, all_modes(cell, gpu=gpu), gpu_required=gpu)
        assert checks.passed(found), [c for c in found if c.verdict == "fail"]
        assert copy.deepcopy(checks.launches(found)) == {m: "pass" for m in smoke.DEFAULT_MODES}


def test_probe_shm_option_is_checked_once_into_the_run_options():
    from imagefactory.run import context
    from tests.conftest import REPO

    golden = REPO / "tests" / "golden" / "matrix.yaml"
    inv = cli._invocation("test", {"matrix": golden, "only": None, "probe_shm": "host"}, {})
    assert inv.options.probe_shm == "host"
    with pytest.raises(ConfigError, match="--probe-shm"):
        cli._invocation("test", {"matrix": golden, "only": None, "probe_shm": "1g --privileged"}, {})
    assert context.Options().probe_shm == smoke.DEFAULT_SHM == "1g"


def test_the_cli_refuses_a_bad_probe_shm():
    import subprocess
    import sys

    from tests.conftest import REPO

    r = subprocess.run([sys.executable, "-m", "imagefactory", "test", "--matrix", str(REPO / "tests" / "golden" /
                        "matrix.yaml"), "--plain", "--probe-shm", "lots"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--probe-shm: 'lots' is not host, default or a size" in r.stderr + r.stdout


# -- moved from test_hardening_iii.py ----------------------------------------


@pytest.mark.parametrize("given, kept", [("1G", "1g"), ("1g", "1g"), ("512M", "512m"), ("2gb", "2g"),
                                         ("1Gb", "1g"), ("host", "host"), ("default", "default")])
def test_probe_shm_takes_what_docker_takes(given, kept):
    assert smoke.check_shm(given) == kept


@pytest.mark.parametrize("bad", ["1", "0g", "1t", "1 g", "-1g", "1g\n", "HOST", "1gib"])
def test_probe_shm_still_refuses_what_is_not_a_size(bad):
    with pytest.raises(ConfigError):
        smoke.check_shm(bad)
