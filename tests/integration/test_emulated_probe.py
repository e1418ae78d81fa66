"""An arm64 image probed on this (amd64) engine through binfmt/QEMU, as imagefactory probes a
cell of another platform: the container is created as linux/arm64 with QEMU_CPU set, `uname -m`
inside says aarch64, and QEMU_CPU is what the emulated CPU is (neoverse-n1 has no SVE; QEMU's
default `max` CPU has it). The probe itself runs there too: its machine check passes and its
timings are not judged.

The image is this module's own: the arm64 member of the base registry's two-arch
`python:3.11-slim-bookworm` list (scripts/ci-setup.sh pushes it), built FROM with buildx and
labelled for this module (helpers.ModuleImages). Outside CI, IMAGEFACTORY_TEST_ARM64_BASE may
name a local arm64 image to build FROM instead. Skipped only where binfmt has no qemu-aarch64
handler (or the engine is arm64 itself: nothing to emulate)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from imagefactory.probe import checks
from imagefactory.config import platforms
from imagefactory.probe import smoke
from imagefactory.config.model import Cell
from tests.integration.helpers import BASE_REGISTRY, FIXTURES, RUN_ID, buildx_or_skip, unavailable

ARM64 = platforms.ARM64
BINFMT = Path("/proc/sys/fs/binfmt_misc") / ARM64.emulation.binfmt
BASE = f"{BASE_REGISTRY}/library/python:3.11-slim-bookworm"
LISTS = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
# uname -m, and whether the CPU the process runs on has SVE (AT_HWCAP bit 22 on aarch64, from the
# auxiliary vector qemu-user gives the process: its /proc/cpuinfo is the host's)
HWCAP = ("import platform, struct\n"
         "aux = dict(struct.iter_unpack('<QQ', open('/proc/self/auxv', 'rb').read()))\n"
         "print(platform.machine(), 'sve' if aux.get(16, 0) & (1 << 22) else 'no-sve')\n")
CELL = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.13.0", threads=2,
            base_image=BASE, compiler=False, platform=ARM64)


def _binfmt_or_skip() -> None:
    try:
        state = BINFMT.read_text().split("\n", 1)[0]
    except OSError:
        pytest.skip(f"no binfmt handler {BINFMT} (apt-get install qemu-user-static binfmt-support): "
                    "arm64 binaries cannot run here")
    if state != "enabled":
        pytest.skip(f"{BINFMT} is {state} (update-binfmts --enable {ARM64.emulation.binfmt})")


def _has_arm64(ref: str) -> bool:
    """Whether the base registry serves `ref` as a list with a linux/arm64 image."""
    name, tag = ref.split("/", 1)[1].rsplit(":", 1)
    try:
        r = requests.get(f"http://{BASE_REGISTRY}/v2/{name}/manifests/{tag}", headers={"Accept": ", ".join(LISTS)},
                         timeout=10)
        manifests = r.json().get("manifests") or [] if r.ok else []
    except (requests.RequestException, ValueError):
        return False
    return any((m.get("platform") or {}).get("architecture") == ARM64.architecture for m in manifests)


def _base() -> str:
    if _has_arm64(BASE):
        return BASE
    local = os.environ.get("IMAGEFACTORY_TEST_ARM64_BASE")
    if local and not os.environ.get("CI"):
        return local
    unavailable(f"{BASE} is no list with a linux/arm64 image in the base registry (scripts/ci-setup.sh pushes "
                "one); outside CI IMAGEFACTORY_TEST_ARM64_BASE may name a local arm64 image")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def emulation(engine) -> platforms.Emulated:
    _binfmt_or_skip()
    found = smoke.emulation_of(engine, CELL)
    if found is None:
        pytest.skip("the engine is linux/arm64 itself: nothing to emulate")
    return found


@pytest.fixture(scope="module")
def arm64_image(engine, emulation, module_images) -> str:
    buildx_or_skip()
    tag = f"imagefactory-test/emulated:{RUN_ID}"
    labels = [arg for k, v in module_images.labels.items() for arg in ("--label", f"{k}={v}")]
    done = subprocess.run(["docker", "buildx", "build", "--platform", ARM64.oci, "--load", "--network", "none",
                           "--build-arg", f"BASE={_base()}", *labels, "-t", tag, str(FIXTURES / "emulated")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert engine.image_platform(tag) == ARM64.oci
    return tag


def test_the_engine_runs_an_arm64_container_with_its_platform_and_qemu_cpu(engine, emulation, arm64_image):
    assert emulation.environment == {"QEMU_CPU": "neoverse-n1"}
    told = engine.run(arm64_image, ["python", "-c", HWCAP], timeout=120, platform=ARM64,
                      environment=emulation.environment)
    assert (told.exit_code, told.stdout.split()) == (0, ["aarch64", "no-sve"]), told.stderr
    # the control: without QEMU_CPU, QEMU's default CPU (max) advertises SVE
    default = engine.run(arm64_image, ["python", "-c", HWCAP], timeout=120, platform=ARM64)
    assert (default.exit_code, default.stdout.split()) == (0, ["aarch64", "sve"]), default.stderr


def test_the_probe_runs_emulated_its_machine_judged_and_its_timings_not(engine, emulation, arm64_image):
    result = smoke.test_image(engine, CELL, arm64_image, gpus=False, timeout=120, modes=("bare",),
                              emulation=emulation)
    assert result.emulation == emulation and result.probe is not None, result.stderr[-2000:]
    probe = result.probe["bare"]
    assert probe["python"]["machine"] == "aarch64" and probe["env"]["QEMU_CPU"] == "neoverse-n1"
    found = {c.name: c for c in result.checks}
    assert found["platform.machine"].verdict == checks.PASS and found["python.version"].verdict == checks.PASS
    assert found["probe.import_time"].verdict == checks.NOT_JUDGED
    assert found["probe.import_time"].actual.startswith(f"{checks.EMULATED} ({emulation})")
    assert found["probe.numpy"].verdict == checks.FAIL  # a bare Python image: functional checks still judge
    # the same image judged as an amd64 cell's: its machine says it is not
    wrong = checks.judge(replace(CELL, platform=platforms.AMD64), probe, gpu_required=False)
    assert {c.name: c.verdict for c in wrong}["platform.machine"] == checks.FAIL
