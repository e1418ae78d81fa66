"""podman, as HPC sites run it: Debian 12's podman 4.3 serving the Docker API (`podman system
service`, started by scripts/ci-setup.sh on IMAGEFACTORY_PODMAN_HOST).

- The classic route end to end through podman's socket: the base's digest (podman's Docker API
  has no /distribution, so the registry is asked directly), the build, the probe in every
  launch mode (podman names an arbitrary UID after itself: the hpc mode's expectation there).
- BuildKit through podman's socket is refused before anything is built, in one line naming the
  engine.
- The built image under `podman run --cpus 1`, a launch users have: a `threads: auto` cell
  sizes OpenMP/MKL/OpenBLAS to the quota.

Cost: one cold classic build on podman (no compiler layer; buildah's commits are slower than
Docker's: about 3-4 minutes here) and three probes. The module removes its images from podman.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.helpers import (PODMAN_HOST, TEST_REGISTRY, Leftovers, matrix_text, report_of, run_cli,
                                       unavailable)

pytestmark = pytest.mark.docker

CELL = "py3.11-cpu-openblas-pip"
ALL_PASS = {"docker": "pass", "bare": "pass", "hpc": "pass"}
LABEL = "io.imagefactory-test.podman"


@pytest.fixture(scope="module")
def podman(session_id):
    """A Docker SDK client of podman's service; fails in CI (skips locally) without one."""
    import docker

    try:
        client = docker.DockerClient(base_url=PODMAN_HOST, timeout=300)
        components = {c.get("Name") for c in client.version().get("Components") or []}
    except (docker.errors.DockerException, OSError) as e:
        unavailable(f"no podman service at {PODMAN_HOST} (scripts/ci-setup.sh starts one): {e}")
    assert "Podman Engine" in components, components
    yield client
    for image in client.images.list(filters={"label": f"{LABEL}={session_id}"}):
        try:
            client.images.remove(image.id, force=True)
        except docker.errors.APIError:
            pass
    client.close()


@pytest.fixture(scope="module")
def project(tmp_path_factory, podman, base_registry, wheelhouse, session_id) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("podman")
    text = matrix_text(image=f"{TEST_REGISTRY}/it-{session_id}/podman", wheelhouse=wheelhouse,
                       labels={LABEL: session_id}).replace("threads: 2\n", "threads: auto\n")
    assert "threads: auto\n" in text
    # no compiler layer and no torch.compile child: what this module proves is the engine, and the
    # compile check is proven on Docker (test_train_fast); a g++ layer is a minute more on podman
    text += "compiler: false\n"
    (root / "matrix.yaml").write_text(text)
    yield root
    steps = Leftovers()  # the build's steps before its LABEL, which only its logs name
    steps.from_tree(root)
    steps.remove(podman)


def _cli(project: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, "--matrix", str(project / "matrix.yaml"), "--plain", "--gpus", "none",
                   "--work-dir", str(project / "work"), env={"DOCKER_HOST": PODMAN_HOST})


def test_buildkit_through_podman_is_refused_before_building(project, podman):
    r = _cli(project, "build", "--builder", "buildkit", "--report", str(project / "refused.json"))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "podman" in errors[0] and "--builder classic" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (project / "refused.json").exists()
    assert not podman.images.list(filters={"label": f"{LABEL}"}), "nothing was built"


@pytest.fixture(scope="module")
def built(project, podman) -> dict:
    r = _cli(project, "build", "--builder", "classic", "--report", str(project / "report.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return report_of(project / "report.json")[CELL]


def test_the_classic_route_builds_and_passes_every_launch_mode_through_podman(built, podman):
    assert built["status"] == "passed" and built["builder"] == "classic", built["error"]
    assert built["launches"] == ALL_PASS, [c for c in built["checks"] if c["verdict"] == "fail"]
    # the base was pinned to the digest the registry serves (podman's API could not say it)
    assert "@sha256:" in built["base_image"] and built["base_digest"]
    # hpc mode ran as the arbitrary UID; podman named it after itself, and the check expected that
    hpc = [c for c in built["checks"] if c["name"] == "launch.conditions" and c.get("mode") == "hpc"]
    assert hpc and "user name: 4242" in hpc[0]["expected"], hpc
    assert podman.images.get(built["candidate"]).id == built["image_id"]


def test_podman_run_with_a_cpu_quota_sizes_a_threads_auto_image(built):
    podman_cli = shutil.which("podman")
    assert podman_cli, "podman is installed by scripts/ci-setup.sh"
    script = ("import json, os, torch; print(json.dumps({v: os.environ.get(v) for v in "
              "('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS')} | {'torch': torch.get_num_threads()}))")
    for entry in ([], ["--entrypoint", "python"]):  # through the ENTRYPOINT, and past it (`podman run --entrypoint`)
        command = [podman_cli, "run", "--rm", "--network", "none", "--cpus", "1", *entry, built["candidate"]]
        command += ["-c", script] if entry else ["python", "-c", script]
        r = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "torch": 1}, (entry, seen)
