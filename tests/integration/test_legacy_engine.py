"""The legacy image store stays supported: Debian 12's Docker 20.10 (overlay2, the graph-driver
store, BuildKit v0.8), which scripts/ci-setup.sh runs beside the current engine on a socket of
its own (IMAGEFACTORY_LEGACY_DOCKER_HOST). The rest of the suite drives the current engine
(Debian 13's 26.x, the containerd image store), where an image's id is its manifest digest; here
it is its config digest, and everything that asks for an image's id must hold in both.

One pip cell and one conda cell (locked from the test channel, tests/conda_channel) are built,
probed in every launch mode and pushed: the pip cell by each builder, the conda cell by the
classic builder (the conda route by BuildKit is test_conda's, on the current engine: each
builder's conda route is proven once, not on both engines). The engine's own answers are
the proof: the report's image id is the id the legacy engine gives the candidate tag (a config
digest there), the pushed digest is what the registry serves under the tag.

Cost: three cold builds on an engine with no cache (about 1-2 minutes each on 2 cores); the
module removes its images and the BuildKit records it made from the legacy engine as it ends.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.conda_channel import build as channel_build
from tests.conda_channel.server import ChannelServer
from tests.integration.helpers import (
    LEGACY_HOST, TEST_PASSWORD, build_record_ids, TEST_REGISTRY, TEST_USER, ModuleImages, buildx_or_skip, matrix_text, registry_digest,
    report_of, run_cli, unavailable)

pytestmark = pytest.mark.docker

PIP, CONDA = "py3.11-cpu-openblas-pip", "py3.11-cpu-openblas-conda"
ALL_PASS = {"docker": "pass", "bare": "pass", "hpc": "pass"}
OWN = ModuleImages("legacy-engine", build_cache=True)  # removed from the legacy engine, not the default one


@pytest.fixture(scope="module")
def legacy():
    """A Docker SDK client of the legacy engine; fails in CI (skips locally) when it is not there
    or is not a graph-driver store."""
    import docker

    since = time.time()
    try:
        client = docker.DockerClient(base_url=LEGACY_HOST, timeout=120)
        info = client.info()
    except (docker.errors.DockerException, OSError) as e:
        unavailable(f"no legacy engine at {LEGACY_HOST} (scripts/ci-setup.sh starts one): {e}")
    status = dict(tuple(pair) for pair in info.get("DriverStatus") or [] if len(pair) == 2)
    assert str(info.get("ServerVersion", "")).startswith("20.10"), info.get("ServerVersion")
    assert info.get("Driver") == "overlay2" and "driver-type" not in status, (info.get("Driver"), status)
    keep = build_record_ids(client)
    yield client
    OWN.remove(client, since, keep)
    client.close()


@pytest.fixture(scope="module")
def project(tmp_path_factory, legacy, base_registry, test_registry, wheelhouse, session_id) -> Path:
    """A pip cell and a conda cell, the conda one locked against the test channel (served for the
    module's builds)."""
    info = channel_build.build()
    with ChannelServer(info.root) as server:
        root = tmp_path_factory.mktemp("legacy")
        cells = """
            matrix:
              python: ["3.11"]
              cuda: ["none"]
              blas: [openblas]
              installer: [pip, conda]
            compiler: false
        """
        conda = (f"conda:\n  version: \"0.1.0-0\"\n  sha256: {info.installer_sha256}\n"
                 f"  installer_url: {info.installer_url(server.url)}\n"
                 f"  channels: {json.dumps([info.channel_url(server.url)])}\n")
        text = matrix_text(image=f"{TEST_REGISTRY}/it-{session_id}/legacy", wheelhouse=wheelhouse, cells=cells,
                           labels=OWN.labels, extra=conda)
        assert f'torch: "{info.torch}"' in text, "the channel's torch is the wheelhouse's"
        (root / "matrix.yaml").write_text(text)
        r = run_cli("lock", "--only", CONDA, "--matrix", str(root / "matrix.yaml"))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        yield root


CELLS = {"classic": (PIP, CONDA), "buildkit": (PIP,)}


def _build(project: Path, builder: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = project / f"report-{builder}.json"
    only = [arg for cell in CELLS[builder] for arg in ("--only", cell)]
    r = run_cli("build", "--builder", builder, "--push", "--plain", "--gpus", "none", *only,
                "--matrix", str(project / "matrix.yaml"), "--report", str(report),
                "--work-dir", str(OWN.work_dir(project / f"work-{builder}")),
                env={"DOCKER_HOST": LEGACY_HOST, "IMAGEFACTORY_REGISTRY_USER": TEST_USER,
                     "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD})
    return r, report_of(report) if report.exists() else {}


@pytest.fixture(scope="module")
def built(project):
    """Each builder's build of the module's cells, once (the tests after the first read it)."""
    done: dict[str, tuple[subprocess.CompletedProcess, dict]] = {}

    def get(builder: str) -> tuple[subprocess.CompletedProcess, dict]:
        if builder == "buildkit":
            buildx_or_skip()
        if builder not in done:
            done[builder] = _build(project, builder)
        return done[builder]

    return get


@pytest.mark.parametrize("builder", ["classic", "buildkit"])
def test_cells_build_probe_and_push_on_the_graph_driver_store(built, legacy, builder):
    r, cells = built(builder)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(cells) == sorted(CELLS[builder])
    for name in CELLS[builder]:
        cell = cells[name]
        assert cell["status"] == "passed" and cell["builder"] == builder, (name, cell["status"], cell["error"])
        # its size as the graph-driver store lists it (`docker images`), pushed or not
        (listed,) = legacy.api.images(name=cell["candidate"])
        assert cell["sizes"]["local"]["size"] == listed["Size"] > 5 * 10**8, (name, cell["sizes"], listed["Size"])
        assert cell["launches"] == ALL_PASS, [c for c in cell["checks"] if c["verdict"] == "fail"]
        # the id is the legacy engine's own for the candidate: its config digest in this store
        image = legacy.images.get(cell["candidate"])
        assert cell["image_id"] == image.id == image.attrs["Id"]
        assert image.attrs["Config"]["Labels"]["io.imagefactory.content-hash"] == cell["content_hash"]
        assert cell["publish"] == "published" and cell["pushed"], cell["publish"]
        # no step deletes a file of a layer below it: 20.10 dates a whiteout with the build, so
        # one would make the layer differ between two engines (partials/apt_tidy.j2)
        # pulled, not looked up: BuildKit resolves FROM without naming the base in the engine's
        # images, so what the engine held before the run must not decide this
        base = legacy.images.pull(image.attrs["Config"]["Labels"]["org.opencontainers.image.base.name"])
        assert _whiteouts(image.attrs, len(base.attrs["RootFS"]["Layers"])) == [], name
        for pushed in cell["pushed"]:
            repo, tag = pushed["ref"].split("/", 1)[1].rsplit(":", 1)
            assert registry_digest(TEST_REGISTRY, repo, tag) == pushed["digest"]


def test_bench_on_the_conda_image(built, project, tmp_path):
    """bench finds the classic builder's image (it has no --builder) and measures a conda image."""
    r, cells = built("classic")
    assert cells[CONDA]["status"] == "passed", r.stderr[-2000:]
    out = tmp_path / "bench.json"
    r = run_cli("bench", "--only", CONDA, "--matrix", str(project / "matrix.yaml"), "--work-dir",
                str(tmp_path / "work"), "--out", str(out), "--budget", "20", env={"DOCKER_HOST": LEGACY_HOST},
                timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [measured] = json.loads(out.read_text())["cells"]
    assert measured["status"] == "measured", measured
    gemm = {f["name"]: f for f in measured["figures"] if f["container"] == "default"}["gemm.numpy"]
    assert gemm["status"] == "ok" and gemm["candidate"]["value"] > 0, gemm


def _whiteouts(attrs: dict, base_layers: int) -> list[str]:
    """The files a layer of the image deletes from the layers below it: overlay2's whiteouts (a
    character device 0/0) in each layer's folder on disk, the base image's `base_layers` layers
    (the lowest) left out."""
    data = attrs["GraphDriver"]["Data"]
    assert attrs["GraphDriver"]["Name"] == "overlay2", attrs["GraphDriver"]
    folders = [data["UpperDir"], *(d for d in data.get("LowerDir", "").split(":") if d)]  # the top layer's first
    assert len(folders) == len(attrs["RootFS"]["Layers"]) > base_layers >= 1, (len(folders), base_layers)
    folders = folders[:-base_layers]
    found = []
    for folder in folders:
        for top, dirs, files in os.walk(folder):
            for name in files + dirs:
                st = os.lstat(os.path.join(top, name))
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    found.append(os.path.relpath(os.path.join(top, name), folder))
    return found
