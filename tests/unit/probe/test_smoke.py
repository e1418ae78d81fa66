"""Launch modes (smoke.MODES), judged on crafted probes and run through an in-memory engine:
each mode is judged on its own, names its failing checks, and gives the report its launches;
the shm, distributed and torch.compile-place checks fail where they must and name the fix."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from imagefactory.probe import checks
from imagefactory.report import summary
from imagefactory.run import results
from imagefactory.probe import smoke
from imagefactory.errors import ConfigError
from tests.fake_engine import Image, World, as_launched
from tests.unit.helpers import CPU_OPENBLAS, CUDA_MKL, by_name, good_probe, only_failure
from pathlib import Path
from imagefactory.tools import bench
from imagefactory.pipeline import build
from imagefactory.config import matrix
from imagefactory.config import platforms
from imagefactory.render import contexts
from imagefactory.config import tags
from imagefactory.probe import verdicts
from imagefactory.run.results import PASSED, CellReport
from imagefactory.engine.docker import Engine
from imagefactory.engine.api import RunResult
from imagefactory.run.context import BenchOptions, BuildOptions
from tests.fake_engine import ENGINE_INFO
from tests.unit.helpers import AMD, ARM, pip_both_project


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
    r = results.CellReport("py3.11-cpu-openblas-pip", status=results.CHECK_FAILED,
                          checks=smoke.judge(CPU_OPENBLAS, probes, gpu_required=False))
    untested = results.CellReport("py3.12-cpu-openblas-pip", status=results.BUILD_FAILED)
    path, md = summary.write([r, untested], tmp_path / "report.json", gpus=False)
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
    from imagefactory.cli.options import _invocation
    from imagefactory.run import context
    from tests.conftest import REPO

    golden = REPO / "tests" / "golden" / "matrix.yaml"
    inv = _invocation("test", {"matrix": golden, "only": None, "probe_shm": "host"}, {})
    assert inv.options.probe_shm == "host"
    with pytest.raises(ConfigError, match="--probe-shm"):
        _invocation("test", {"matrix": golden, "only": None, "probe_shm": "1g --privileged"}, {})
    assert context.TestOptions().probe_shm == smoke.DEFAULT_SHM == "1g"


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


# -- moved from test_smoke_emulation.py ----------------------------------------
# Probes under emulation: a cell of another platform than the engine's own is probed through
# binfmt/QEMU (its containers created with its platform and QEMU_CPU, its timeouts scaled), its
# speed is "emulated: not judged", everything functional is judged as natively, and the report
# says it ran emulated. A native cell is probed exactly as before. All against the in-memory
# engine (tests/fake_engine.py) and crafted probe reports; tests/integration/test_emulated_probe.py
# runs the same path on a real engine.


ARM_CELL = replace(CPU_OPENBLAS, platform=platforms.ARM64)


ON_AMD64 = platforms.emulated(platforms.ARM64, platforms.AMD64)


def test_a_foreign_platform_is_emulated_with_the_tables_cpu_model_and_a_native_one_is_not():
    assert ON_AMD64 is not None and ON_AMD64.target == platforms.ARM64 and ON_AMD64.host == platforms.AMD64
    assert ON_AMD64.environment == {"QEMU_CPU": "neoverse-n1"}
    assert str(ON_AMD64) == "qemu-aarch64 (QEMU_CPU=neoverse-n1) on linux/amd64"
    assert ON_AMD64.slowdown == platforms.ARM64.emulation.slowdown == 10.0
    assert platforms.emulated(platforms.ARM64, platforms.ARM64) is None
    assert platforms.emulated(platforms.AMD64, platforms.AMD64) is None
    assert platforms.emulated(platforms.AMD64, None) is None  # an unknown host counts as the default
    amd_on_arm = platforms.emulated(platforms.AMD64, platforms.ARM64)
    assert amd_on_arm is not None and amd_on_arm.environment == {}  # no model measured: QEMU's default
    assert str(amd_on_arm) == "qemu-x86_64 (QEMU default CPU) on linux/arm64"


def _probed(cell, *, arch: str = "x86_64", timeout: float = 300.0):
    world = World(info=replace(ENGINE_INFO, architecture=arch))
    world.images["sha256:img"] = Image("sha256:img", {}, {"img:1"}, cell.id, cell.platform.oci)
    world.probes[cell.id] = good_probe(cell)
    engine = world.engine()
    result = smoke.test_image(engine, cell, "img:1", gpus=False, timeout=timeout,
                              emulation=smoke.emulation_of(engine, cell))
    return world, result


def test_a_foreign_cells_probe_containers_carry_its_platform_qemu_cpu_and_a_scaled_timeout():
    world, result = _probed(ARM_CELL)
    assert result.emulation == ON_AMD64 and result.passed, [c for c in result.checks if c.verdict == "fail"]
    assert len(world.run_calls) == len(smoke.DEFAULT_MODES)
    for call in world.run_calls:  # every launch mode
        assert call["platform"] == platforms.ARM64
        assert call["environment"]["QEMU_CPU"] == "neoverse-n1"
        assert call["timeout"] == 300.0 * 10
        assert call["command"][-2:] == ["--slowdown", "10"]
    hpc = next(c for c in world.run_calls if (c["options"] or {}).get("user"))
    assert hpc["environment"] == {"HOME": "/nonexistent", "QEMU_CPU": "neoverse-n1"}  # the mode's own kept


def test_a_native_cell_is_probed_as_before():
    world, result = _probed(CPU_OPENBLAS)
    assert result.emulation is None and result.passed
    for call in world.run_calls:
        assert call["platform"] is None and "QEMU_CPU" not in (call["environment"] or {})
        assert call["timeout"] == 300.0 and "--slowdown" not in call["command"]
    # an arm64 cell on an arm64 engine is native too
    world, result = _probed(ARM_CELL, arch="aarch64")
    assert result.emulation is None and {c["platform"] for c in world.run_calls} == {None}


def test_a_timed_out_emulated_probe_says_the_scaled_timeout():
    world = World()
    world.images["sha256:img"] = Image("sha256:img", {}, {"img:1"}, ARM_CELL.id, "linux/arm64")
    world.probes[ARM_CELL.id] = ("timeout", good_probe(ARM_CELL))
    result = smoke.test_image(world.engine(), ARM_CELL, "img:1", gpus=False, timeout=30, modes=("docker",),
                              emulation=ON_AMD64)
    (ran,) = [c for c in result.checks if c.name == "probe.ran"]
    assert ran.verdict == "fail" and ran.actual == "killed after 300 s"


def test_speed_is_not_judged_under_emulation_and_everything_else_is_judged_as_natively():
    probe = good_probe(ARM_CELL)
    native = by_name(checks.judge(ARM_CELL, probe, gpu_required=False))
    emulated = by_name(checks.judge(ARM_CELL, probe, gpu_required=False, emulation=ON_AMD64))
    timing = emulated["probe.import_time"]
    assert native["probe.import_time"].verdict == checks.INFO
    assert timing.verdict == checks.NOT_JUDGED and timing.verdict != checks.PASS
    assert timing.actual.startswith("emulated: not judged (qemu-aarch64 (QEMU_CPU=neoverse-n1) on linux/amd64): ")
    assert "torch 1.83 s" in timing.actual  # the measurement is kept, not judged
    assert {n for n, c in emulated.items() if c.verdict == checks.NOT_JUDGED} == set(checks.NATIVE_ONLY)
    assert {n: c for n, c in emulated.items() if n not in checks.NATIVE_ONLY} == \
        {n: c for n, c in native.items() if n not in checks.NATIVE_ONLY}
    assert checks.passed(emulated.values()) and emulated["platform.machine"].verdict == checks.PASS


def test_emulated_functional_failures_still_fail():
    probe = good_probe(ARM_CELL)
    probe["numpy"]["blas"][0]["internal_api"] = "mkl"
    found = by_name(checks.judge(ARM_CELL, probe, gpu_required=False, emulation=ON_AMD64))
    assert found["numpy.blas"].verdict == "fail" and not checks.passed(found.values())


def test_the_machine_check_fails_for_an_image_of_another_arch():
    probe = good_probe(ARM_CELL)
    assert probe["python"]["machine"] == "aarch64"
    probe["python"]["machine"] = "x86_64"  # an amd64 image probed for the arm64 cell
    c = only_failure(ARM_CELL, probe, "platform.machine")
    assert c.expected == "aarch64" and c.actual == "x86_64" and "linux/arm64" in c.detail
    probe["python"].pop("machine")
    assert only_failure(ARM_CELL, probe, "platform.machine").actual == "not reported"
    amd = good_probe(CPU_OPENBLAS)
    amd["python"]["machine"] = "aarch64"
    assert only_failure(CPU_OPENBLAS, amd, "platform.machine").expected == "x86_64"
    # emulated or not: a wrong machine is a wrong image
    probe["python"]["machine"] = "x86_64"
    found = by_name(checks.judge(ARM_CELL, probe, gpu_required=False, emulation=ON_AMD64))
    assert found["platform.machine"].verdict == "fail"


def test_every_mode_of_an_emulated_probe_is_judged_so():
    probes = {m: as_launched(good_probe(ARM_CELL), smoke.MODES[m].options("1g"), smoke.MODES[m].environment())
              for m in smoke.DEFAULT_MODES}
    found = smoke.judge(ARM_CELL, probes, gpu_required=False, emulation=ON_AMD64)
    timing = [c for c in found if c.name == "probe.import_time"]
    assert [c.mode for c in timing] == list(smoke.DEFAULT_MODES)
    assert {c.verdict for c in timing} == {checks.NOT_JUDGED}
    assert checks.launches(found) == {m: "pass" for m in smoke.DEFAULT_MODES}


@pytest.fixture
def both(tmp_path: Path):
    return tmp_path, matrix.load(pip_both_project(tmp_path) / "matrix.yaml")


def _build(project: Path, m, world: World, command=build.build):
    opts = BuildOptions(work_dir=project / "work", gpus="none", verdicts_dir=project / "verdicts")
    return {r.cell: r for r in command(m, list(m.cells), world.context(opts)).reports}


def test_a_build_probes_the_foreign_cell_emulated_and_the_report_says_so(both):
    project, m = both
    world = World(probes={c.id: good_probe(c) for c in m.cells}, builder="buildkit")
    reports = _build(project, m, world)
    arm, amd = reports[ARM], reports[AMD]
    assert arm.status == amd.status == PASSED
    assert arm.emulated == "qemu-aarch64 (QEMU_CPU=neoverse-n1) on linux/amd64" and amd.emulated == ""
    by_image = {world.image_by_ref(c["image"]).cell: c for c in world.run_calls}
    assert by_image[ARM]["platform"] == platforms.ARM64 and by_image[AMD]["platform"] is None
    assert "QEMU_CPU" not in (by_image[AMD]["environment"] or {})
    assert {c.verdict for c in arm.checks if c.name == "probe.import_time"} == {checks.NOT_JUDGED}
    assert {c.verdict for c in amd.checks if c.name == "probe.import_time"} == {checks.INFO}

    path, md = summary.write(list(reports.values()), project / "report.json", gpus=False)
    doc = {c["cell"]: c for c in json.loads(path.read_text())["cells"]}
    assert doc[ARM]["emulated"] == arm.emulated and doc[AMD]["emulated"] == ""
    text = md.read_text()
    assert f"| `{ARM}` | passed (emulated) |" in text and f"| `{AMD}` | passed |" in text
    assert f"probed emulated: {arm.emulated}; its speed is not judged" in text
    assert "ℹ️ information · ❔ not judged (a speed measured under emulation, binfmt/QEMU), per launch mode" in text
    assert "| probe.import_time | ❔ | ❔ | ❔ | emulated: not judged (qemu-aarch64" in text


def test_a_native_only_report_is_as_before():
    r = CellReport(AMD, PASSED, checks=checks.judge(CPU_OPENBLAS, good_probe(CPU_OPENBLAS), gpu_required=False))
    text = summary.summary([r])
    assert "emulated" not in text and "❔" not in text and f"| `{AMD}` | passed |" in text


def test_emulated_verdicts_are_cached_apart_and_judged_again_as_emulated(both, tmp_path):
    project, m = both
    world = World(probes={c.id: good_probe(c) for c in m.cells}, builder="buildkit")
    _build(project, m, world)
    again = _build(project, m, world, command=build.test)
    assert again[ARM].verdicts == "cached" and again[ARM].emulated.startswith("qemu-aarch64")
    assert {c.verdict for c in again[ARM].checks if c.name == "probe.import_time"} == {checks.NOT_JUDGED}
    native = verdicts.key("sha256:" + "1" * 64, CPU_OPENBLAS, gpus=False)
    assert "emulated" not in native.as_dict()  # a native key is the shape it always was
    foreign = verdicts.key("sha256:" + "1" * 64, ARM_CELL, gpus=False, emulation=ON_AMD64)
    assert foreign.as_dict()["emulated"] == str(ON_AMD64) and foreign.as_dict() != native.as_dict()


@pytest.fixture
def golden(tmp_path):
    m = matrix.load(Path(__file__).resolve().parents[2] / "golden" / "matrix.yaml")
    cell = m.cell("py3.11-cpu-openblas-pip")
    base = World(registry={cell.base_image: "sha256:" + "1" * 64})
    ctx = build.render_pinned(m, [cell], tmp_path / "pre", base.engine(), "missing")[0]
    return m, cell, ctx.content_hash


def test_bench_refuses_to_judge_a_cell_it_would_run_emulated(golden, tmp_path):
    m, cell, content_hash = golden
    world = World(registry={cell.base_image: "sha256:" + "1" * 64}, info=replace(ENGINE_INFO, architecture="aarch64"),
                  run_outputs=[RunResult(0, "{}", "")] * 2)
    world.images["sha256:abc"] = Image("sha256:abc", {contexts.HASH_LABEL: content_hash},
                                       {tags.candidate(cell, content_hash)}, cell.id)
    said: list[str] = []
    (r,), _ = bench.bench(m, [cell], world.context(BenchOptions(work_dir=tmp_path)), say=said.append)
    assert r.status == bench.NOT_JUDGED != bench.MEASURED and r.figures == []
    assert r.error.startswith("emulated: not judged: on this engine it would run under qemu-x86_64")
    assert "bench linux/amd64 cells on a linux/amd64 host" in r.error and said == [f"{cell.id}: {r.error}"]
    assert world.run_calls == []  # nothing ran: no ratio to misread
    direct = bench.bench_image(world.engine(), cell, "sha256:abc", budget=40, gpus=False, host_cores=16)
    assert direct.status == bench.NOT_JUDGED and world.run_calls == []
    text = bench.markdown([r], 16, 40)
    assert f"**not judged**: {r.error}" in text and "×" not in text


class _Container:
    id = "c1"

    def start(self):
        pass

    def wait(self, timeout):
        return {"StatusCode": 0}

    def logs(self, stdout, stderr):
        return b"aarch64\n" if stdout else b""


class _Containers:
    def __init__(self):
        self.created: list[dict] = []

    def create(self, image, **kwargs):
        self.created.append(kwargs)
        return _Container()


class _API:
    hooks: dict = {"response": []}

    def remove_container(self, container, force=False):
        pass


class _Client:
    def __init__(self):
        self.api, self.containers = _API(), _Containers()

    def ping(self):
        return True


def test_the_engine_creates_an_emulated_container_with_its_platform_and_a_native_one_without():
    client = _Client()
    engine = Engine(client)  # type: ignore[arg-type]
    assert engine.run("img", ["uname", "-m"], timeout=5, platform=platforms.ARM64,
                      environment={"QEMU_CPU": "neoverse-n1"}).stdout == "aarch64\n"
    engine.run("img", ["uname", "-m"], timeout=5)
    emulated, native = client.containers.created
    assert emulated["platform"] == "linux/arm64" and emulated["environment"] == {"QEMU_CPU": "neoverse-n1"}
    assert "platform" not in native and native["environment"] == {}


def test_the_probe_scales_its_own_timeouts_by_the_slowdown(monkeypatch):
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "imagefactory" / "resources" / "probe.py"
    spec = importlib.util.spec_from_file_location("probe_under_test", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.slowdown(["--no-compile", "--slowdown", "10"]) == 10.0
    assert probe.slowdown([]) == probe.slowdown(["--slowdown"]) == probe.slowdown(["--slowdown", "x"]) == 1.0
    assert probe.slowdown(["--slowdown", "0.1"]) == 1.0  # never faster than native
    started: list[float] = []
    monkeypatch.setattr(probe, "SLOWDOWN", 10.0)
    probe._start([], {}, lambda sections, timeout: started.append(timeout), "compile")
    assert started == [probe.CHILD_TIMEOUT["compile"] * 10]
    assert "SLOWDOWN = 10.0\n" in probe.child_code(probe.CHILDREN["launch"])
    assert "timeout=20 * SLOWDOWN" in probe.SECTIONS["dataloader_shm"]
    assert "seconds=60 * SLOWDOWN" in probe.SECTIONS["gloo_all_reduce"]
