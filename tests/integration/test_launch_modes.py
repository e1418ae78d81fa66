"""issue 15: the probe proves every cell in three launch modes -- docker (through the
ENTRYPOINT), bare (entrypoint bypassed, as Kubernetes `command:`, pyxis and `apptainer exec`)
and hpc (bare, UID 4242 without a passwd entry, read-only root, exec tmpfs /tmp, HOME
unwritable, a 1-CPU cpuset) -- on the session's shared image (cpu_build), plus the shm,
distributed and torch.compile-place checks, each also seen failing on a real container."""

from __future__ import annotations

from dataclasses import replace

import pytest

from imagefactory.probe import checks
from imagefactory.config import matrix
from imagefactory.probe import smoke
from tests.conftest import REPO
from tests.integration.helpers import Build, judged

pytestmark = pytest.mark.docker

ALL_PASS = {"docker": "pass", "bare": "pass", "hpc": "pass"}


def good(cpu_build: Build) -> tuple:
    return matrix.load(cpu_build.matrix).cell(Build.GOOD), cpu_build.first_report[Build.GOOD]["candidate"]


def failing(result: smoke.SmokeResult) -> list[tuple[str, str, str]]:
    return [(c.mode, c.name, c.detail) for c in result.checks if c.verdict == "fail"]


def of_mode(found, mode: str) -> dict[str, checks.Check]:
    return {c.name: c for c in found if c.mode == mode}


def test_the_build_proved_the_shared_image_in_every_mode_with_the_compile(cpu_build):
    """The build's own probe ran all three modes with torch.compile: it compiles as UID 4242
    on a read-only root (Inductor's cache on the exec tmpfs /tmp)."""
    cell = cpu_build.first_report[Build.GOOD]
    assert cell["launches"] == ALL_PASS, [c for c in cell["checks"] if c["verdict"] == "fail"]
    hpc = {c["name"]: c for c in cell["checks"] if c["mode"] == "hpc"}
    assert hpc["torch.compile"]["verdict"] == "pass" and hpc["torch.compile"]["actual"].startswith("matches eager")
    assert hpc["launch.conditions"]["verdict"] == "pass", hpc["launch.conditions"]
    assert "uid: 4242" in hpc["launch.conditions"]["actual"] and "CPUs (affinity): 1" in hpc["launch.conditions"]["actual"]


def test_shared_image_passes_every_mode_with_gloo_and_shm(engine, cpu_build):
    cell, image = good(cpu_build)
    result = smoke.test_image(engine, judged(cell), image, gpus=False)
    assert checks.launches(result.checks) == ALL_PASS, failing(result)
    for mode in smoke.DEFAULT_MODES:
        found = of_mode(result.checks, mode)
        assert found["torch.distributed.gloo"].verdict == "pass", found["torch.distributed.gloo"]
        assert found["torch.distributed.gloo"].actual == "2 ranks agree"
        assert found["shm.dataloader"].verdict == "pass" and "1024 MiB" in found["shm.dataloader"].actual
    hpc = of_mode(result.checks, "hpc")
    assert hpc["threads.torch"].verdict == "pass" and hpc["env.OMP_NUM_THREADS"].actual == "2"


def test_shm_check_fails_under_dockers_default_and_passes_with_ipc_host(engine, cpu_build):
    cell, image = good(cpu_build)
    default = smoke.test_image(engine, judged(cell), image, gpus=False, modes=("docker",), shm="default")
    assert [(m, n) for m, n, _ in failing(default)] == [("docker", "shm.dataloader")], failing(default)
    detail = failing(default)[0][2]
    assert "/dev/shm (64 MiB)" in detail and "--ipc=host" in detail and "--shm-size=" in detail
    assert "emptyDir" in detail
    host = smoke.test_image(engine, judged(cell), image, gpus=False, modes=("docker",), shm="host")
    assert host.passed, failing(host)
    assert of_mode(host.checks, "docker")["shm.dataloader"].verdict == "pass"


def test_compile_on_a_read_only_root_with_a_noexec_tmp_names_the_fix(engine, cpu_build, monkeypatch):
    """hpc, but /tmp as Docker's --tmpfs gives it (noexec) and nothing else writable."""
    monkeypatch.setitem(smoke.MODES, "noexec", replace(smoke.MODES["hpc"], name="noexec", tmp_exec=False))
    cell, image = good(cpu_build)
    result = smoke.test_image(engine, cell, image, gpus=False, modes=("noexec",))
    bad = {n: d for _, n, d in failing(result)}
    assert set(bad) == {"torch.compile"}, failing(result)
    assert "/tmp is mounted noexec" in bad["torch.compile"] and "--tmpfs /tmp:exec" in bad["torch.compile"]
    assert "TORCHINDUCTOR_CACHE_DIR" in bad["torch.compile"]


@pytest.fixture(scope="module")
def entrypoint_only(engine, cpu_build, created_images) -> str:
    _, image = good(cpu_build)
    tag = f"imagefactory-test/entrypoint-only:{abs(hash(image)) % 10**8}"
    engine.client.images.build(path=str(REPO / "tests" / "fixtures" / "entrypoint-only"), tag=tag, rm=True,
                               network_mode="none", buildargs={"BASE": image})
    created_images.append(tag)
    return tag


def test_a_setting_only_the_entrypoint_makes_fails_the_modes_that_bypass_it(engine, cpu_build, entrypoint_only):
    cell, _ = good(cpu_build)
    result = smoke.test_image(engine, judged(cell), entrypoint_only, gpus=False)
    assert checks.launches(result.checks) == {"docker": "pass", "bare": "fail", "hpc": "fail"}
    assert sorted((m, n) for m, n, _ in failing(result)) == [("bare", "env.OMP_NUM_THREADS"),
                                                            ("hpc", "env.OMP_NUM_THREADS")]
    assert "'7'" in failing(result)[0][2]


def test_doctor_prints_this_nodes_launch_flags(engine, tmp_path):
    """On this real host (an engine, no GPU): shm flags, no GPU flag, a cpuset within its CPUs."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "imagefactory", "doctor", "--format", "json"], capture_output=True,
                       text=True, cwd=tmp_path, timeout=120)
    launch = json.loads(r.stdout)["launch"]
    cpus = engine.client.info()["NCPU"]
    assert launch["shm"] == ["--ipc=host"] and launch["gpus"] == []
    assert launch["cpus"] == ([f"--cpuset-cpus=0-{cpus // 2 - 1}"] if cpus >= 4 else ["--cpuset-cpus=0"])
    assert launch["line"] == "docker run --ipc=host IMAGE python train.py"
    assert any("--shm-size=" in n and "emptyDir" in n for n in launch["notes"])
