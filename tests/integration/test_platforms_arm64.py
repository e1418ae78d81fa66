"""issue 23: arm64 cells on this x86_64 host. An arm64 pip CPU cell (PyPI's torch 2.10.0, the last
CPU-only aarch64 wheel there) is built with BuildKit under QEMU, probed emulated in every launch
mode, and published with the shared amd64 cell as one multi-arch list; `docker pull --platform`
then gets each probed image. A failing arm64 cell keeps its list from being published, and the
classic builder never yields an arm64 cell's image at all.

The two-platform build is conftest's `arm64_background` (started once cpu_build is done, judged
at the end of the session): it takes ~10 minutes of one core, most of it emulated pip and
compileall. What emulation cannot prove (Grace performance, SVE2 code paths, CUDA on arm64) is
in docs/platforms.md."""

from __future__ import annotations

import json

import pytest

from tests.integration.helpers import (ARM64_CELL, LIST_TEMPLATE, RUN_ID, TEST_PASSWORD, TEST_REGISTRY, TEST_USER,
                                      arm64_matrix_text, containerd_store, report_of, run_cli, served_list)

pytestmark = [pytest.mark.docker, pytest.mark.registry]

AMD64_CELL = "py3.11-cpu-openblas-pip"
CREDS = {"IMAGEFACTORY_REGISTRY_USER": TEST_USER, "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD}
MISSING = "imagefactory-no-such-package-4b1d"


def _list_tag(image: str) -> str:
    return LIST_TEMPLATE.format(image=image, python="3.11", accel="cpu", blas="openblas", installer_suffix="-pip")


def _served_list(ref: str) -> dict | None:
    """The index the test registry serves under `ref`, or None (404)."""
    r = served_list(ref)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


@pytest.fixture(scope="module")
def arm64_run(arm64_background, created_images):
    done = arm64_background.wait(timeout=3600)
    report = report_of(arm64_background.report_path) if arm64_background.report_path.exists() else {}
    for cell in report.values():
        created_images.extend([cell["candidate"], *cell.get("tags", [])] if cell.get("candidate") else [])
    assert report, done.stdout[-3000:] + done.stderr[-3000:]
    return done, report, json.loads(arm64_background.report_path.read_text())


def _by_mode(cell: dict, name: str) -> dict[str, dict]:
    return {c["mode"]: c for c in cell["checks"] if c["name"] == name}


def test_the_arm64_cell_is_an_arm64_image_probed_emulated_in_every_launch_mode(arm64_run, engine):
    done, report, _ = arm64_run
    cell = report[ARM64_CELL]
    failing = [c for c in cell["checks"] if c["verdict"] == "fail"]
    assert cell["status"] == "passed", (cell["status"], cell["error"], failing, done.stderr[-2000:])
    assert cell["builder"] == "buildkit", cell["builder"]
    assert engine.image_platform(cell["image_id"]) == "linux/arm64"
    assert cell["emulated"] == "qemu-aarch64 (QEMU_CPU=neoverse-n1) on linux/amd64", cell["emulated"]
    modes = set(cell["launches"])
    assert modes == {"docker", "bare", "hpc"}, cell["launches"]
    for name in ("platform.machine", "numpy.blas", "threads.torch", "shm.dataloader"):
        judged = _by_mode(cell, name)
        assert set(judged) == modes and all(c["verdict"] == "pass" for c in judged.values()), (name, judged)
    assert all(c["actual"] == "aarch64" for c in _by_mode(cell, "platform.machine").values())
    assert all("openblas" in c["actual"].lower() for c in _by_mode(cell, "numpy.blas").values())
    # what only means something natively is not judged; compiler: false says why compile did not run
    assert {c["verdict"] for c in _by_mode(cell, "probe.import_time").values()} == {"not-judged"}
    compile_checks = [c for c in cell["checks"] if c["name"] == "torch.compile"]
    assert compile_checks and all(c["verdict"] == "skip" and "compiler: false" in c["expected"]
                                  for c in compile_checks), compile_checks
    amd64 = report[AMD64_CELL]
    assert amd64["status"] == "passed" and amd64["emulated"] == "", amd64["emulated"]
    assert engine.image_platform(amd64["image_id"]) == "linux/amd64"


def test_the_list_is_published_and_each_platform_pulls_the_image_that_was_probed(arm64_run, engine, created_images):
    _, report, whole = arm64_run
    (entry,) = whole["lists"]
    assert entry["publish"] == "published", entry
    served = _served_list(entry["ref"])
    assert served is not None, f"the registry serves no list under {entry['ref']}"
    members = {f"{m['platform']['os']}/{m['platform']['architecture']}": m["digest"] for m in served["manifests"]}
    assert set(members) == {"linux/amd64", "linux/arm64"}, members
    for cell_id, platform, arch in ((AMD64_CELL, "linux/amd64", "x86_64"), (ARM64_CELL, "linux/arm64", "aarch64")):
        cell = report[cell_id]
        (arch_ref,) = [p for p in cell["pushed"] if p["ref"].rsplit(":", 1)[1].startswith(arch + "-")]
        assert members[platform] == arch_ref["digest"], (platform, members, cell["pushed"])
        repo, tag = entry["ref"].rsplit(":", 1)
        engine.client.api.pull(repo, tag, platform=platform, auth_config={"username": TEST_USER,
                                                                          "password": TEST_PASSWORD})
        created_images.append(entry["ref"])
        # the image the pull gave is the image that was probed: in the graph-driver store the name
        # then holds that image (its id the config's digest); the containerd store holds the list
        # under the name, and an image's id there is its manifest digest, the one the list names
        if containerd_store():
            assert cell["image_id"] == members[platform], platform
        else:
            assert engine.client.images.get(entry["ref"]).id == cell["image_id"], platform


def test_a_failing_arm64_cell_keeps_its_list_from_being_published(arm64_run, tmp_path, wheelhouse, created_images):
    """The arm64 cell fails at its packages step (after torch, a cache hit on the background
    build); the amd64 cell is a cache hit too. Its per-arch tag is pushed, the list is not."""
    image = f"{TEST_REGISTRY}/it-fail-{RUN_ID}/multiarch"  # this run's own repository: no earlier run's tags
    path = tmp_path / "matrix.yaml"
    path.write_text(arm64_matrix_text(wheelhouse, image, arm64_extra=f', packages: ["{MISSING}"]'))
    report_path = tmp_path / "report.json"
    result = run_cli("build", "--matrix", str(path), "--plain", "--builder", "buildkit", "--push", "--gpus", "none",
                     "--report", str(report_path), "--work-dir", str(tmp_path / "work"), env=CREDS, timeout=3600)
    report = report_of(report_path)
    for cell in report.values():
        created_images.extend([cell["candidate"], *cell.get("tags", [])] if cell.get("candidate") else [])
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert report[ARM64_CELL]["status"] != "passed" and report[ARM64_CELL]["pushed"] == []
    assert report[AMD64_CELL]["publish"] == "published", report[AMD64_CELL]
    assert [p["ref"] for p in report[AMD64_CELL]["pushed"]][-1].split(":")[-1].startswith("x86_64-")
    (entry,) = json.loads(report_path.read_text())["lists"]
    assert entry["publish"] == "not-published" and ARM64_CELL in entry["reason"], entry
    assert _served_list(_list_tag(image)) is None


def test_the_classic_builder_refuses_an_arm64_cell_and_makes_no_image(arm64_background, tmp_path, wheelhouse, engine):
    """(It asks for arm64_background only to run with the module's other tests, last: a module
    whose tests are split ends twice, and its first end would remove the background's images.)"""
    path = tmp_path / "matrix.yaml"
    path.write_text(arm64_matrix_text(wheelhouse, f"{TEST_REGISTRY}/it-classic-{RUN_ID}/multiarch"))
    report_path = tmp_path / "report.json"
    result = run_cli("build", "--matrix", str(path), "--plain", "--builder", "classic", "--only", ARM64_CELL,
                     "--report", str(report_path), "--work-dir", str(tmp_path / "work"))
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    cell = report_of(report_path)[ARM64_CELL]
    assert cell["status"] == "build-failed" and not cell["image_id"], cell
    assert "the classic builder builds only for the engine's own platform (linux/amd64), not linux/arm64" in cell["error"]
    assert not cell["candidate"] or not engine.client.images.list(filters={"reference": cell["candidate"]})


def test_the_registry_cache_pulls_the_arm64_cells_content_tag_instead_of_building_it(arm64_run, arm64_background,
                                                                                    engine):
    """Content tags are per platform: with the arm64 image gone from the engine, a second
    `build --push` of that cell pulls its content-hash tag (an arm64 image on this amd64
    engine) instead of building it, and its platform is checked before it is judged."""
    _, report, _ = arm64_run
    cell = report[ARM64_CELL]
    engine.client.images.remove(cell["image_id"], force=True)
    work = arm64_background.root / "again"
    result = run_cli("build", "--matrix", str(arm64_background.matrix), "--plain", "--builder", "buildkit", "--push",
                     "--only", ARM64_CELL, "--gpus", "none", "--report", str(work / "report.json"),
                     "--work-dir", str(work), env=CREDS, timeout=3600)
    again = report_of(work / "report.json")[ARM64_CELL]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert again["status"] == "passed" and again["pulled"], again
    assert again["content_hash"] == cell["content_hash"] and again["image_id"] == cell["image_id"]
    assert engine.image_platform(again["image_id"]) == "linux/arm64"
    assert again["pulled"].split("@", 1)[0].rsplit(":", 1)[1].startswith("sha-")
