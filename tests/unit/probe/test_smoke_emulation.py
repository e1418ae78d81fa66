"""Probes under emulation: a cell of another platform than the engine's own is probed through
binfmt/QEMU (its containers created with its platform and QEMU_CPU, its timeouts scaled), its
speed is "emulated: not judged", everything functional is judged as natively, and the report
says it ran emulated. A native cell is probed exactly as before. All against the in-memory
engine (tests/fake_engine.py) and crafted probe reports; tests/integration/test_emulated_probe.py
runs the same path on a real engine."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from imagefactory.tools import bench
from imagefactory.pipeline import build
from imagefactory.probe import checks
from imagefactory.config import matrix
from imagefactory.config import platforms
from imagefactory.render import contexts as render
from imagefactory.report import summary as report
from imagefactory.probe import smoke
from imagefactory.config import tags
from imagefactory.probe import verdicts
from imagefactory.report.cell import PASSED, CellReport
from imagefactory.engine.docker import Engine
from imagefactory.engine.api import RunResult
from tests.fake_engine import ENGINE_INFO, Image, World, as_launched
from tests.unit.helpers import AMD, ARM, CPU_OPENBLAS, by_name, good_probe, only_failure, pip_both_project

ARM_CELL = replace(CPU_OPENBLAS, platform=platforms.ARM64)
ON_AMD64 = platforms.emulated(platforms.ARM64, platforms.AMD64)


# -- the platform table says how -----------------------------------------------------------------

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


# -- the probe's containers ------------------------------------------------------------------------

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


# -- the checks -------------------------------------------------------------------------------------

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


# -- the pipeline: report, verdict cache ------------------------------------------------------------

@pytest.fixture
def both(tmp_path: Path):
    return tmp_path, matrix.load(pip_both_project(tmp_path) / "matrix.yaml")


def _build(project: Path, m, world: World, command=build.build):
    opts = build.Options(work_dir=project / "work", gpus="none", verdicts_dir=project / "verdicts")
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

    path, md = report.write(list(reports.values()), project / "report.json", gpus=False)
    doc = {c["cell"]: c for c in json.loads(path.read_text())["cells"]}
    assert doc[ARM]["emulated"] == arm.emulated and doc[AMD]["emulated"] == ""
    text = md.read_text()
    assert f"| `{ARM}` | passed (emulated) |" in text and f"| `{AMD}` | passed |" in text
    assert f"probed emulated: {arm.emulated}; its speed is not judged" in text
    assert "ℹ️ information · ❔ not judged (a speed measured under emulation, binfmt/QEMU), per launch mode" in text
    assert "| probe.import_time | ❔ | ❔ | ❔ | emulated: not judged (qemu-aarch64" in text


def test_a_native_only_report_is_as_before():
    r = CellReport(AMD, PASSED, checks=checks.judge(CPU_OPENBLAS, good_probe(CPU_OPENBLAS), gpu_required=False))
    text = report.summary([r])
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


# -- bench -----------------------------------------------------------------------------------------

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
    world.images["sha256:abc"] = Image("sha256:abc", {render.HASH_LABEL: content_hash},
                                       {tags.candidate(cell, content_hash)}, cell.id)
    said: list[str] = []
    (r,), _ = bench.bench(m, [cell], world.context(bench.Options(work_dir=tmp_path)), say=said.append)
    assert r.status == bench.NOT_JUDGED != bench.MEASURED and r.figures == []
    assert r.error.startswith("emulated: not judged: on this engine it would run under qemu-x86_64")
    assert "bench linux/amd64 cells on a linux/amd64 host" in r.error and said == [f"{cell.id}: {r.error}"]
    assert world.run_calls == []  # nothing ran: no ratio to misread
    direct = bench.bench_image(world.engine(), cell, "sha256:abc", budget=40, gpus=False, host_cores=16)
    assert direct.status == bench.NOT_JUDGED and world.run_calls == []
    text = bench.markdown([r], 16, 40)
    assert f"**not judged**: {r.error}" in text and "×" not in text


# -- the engine's create request -------------------------------------------------------------------

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


# -- the probe's own timeouts ----------------------------------------------------------------------

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
