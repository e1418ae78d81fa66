"""The conda route for real: conda cells locked with `imagefactory lock` (py-rattler, no conda
on this machine), built from their locks by BuildKit, and probed in every launch mode. The classic
builder's conda route is test_legacy_engine's (the OpenBLAS cell, on 20.10, with bench on it): each
builder's route once, not both builders on both engines.

conda-forge cannot be reached here, so the channel is made from this machine's packages
(tests/conda_channel: its README says how faithful each package is and what it cannot prove)
and served over loopback HTTP by a server in this process, which counts every request. The
channel is built once and cached like the base images (a second run takes well under a second).

Cost: the MKL and OpenBLAS cells share the base, the installer and its OS packages;
BuildKit installs each environment once (about 30-60 s a cell cold). The failing cases
(wrong installer digest, a tampered lock line) stop within seconds of their step; the broken
libblas switch is one more environment (BuildKit, from the cache mount). Cells are
`compiler: false`: the conda route's torch is the same wheel the pip route compiles with
(test_train_fast), and a g++ layer per builder would add about a minute.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conda_channel import build as channel_build
from tests.conda_channel.server import ChannelServer
from imagefactory.config import recipe
from tests.integration.helpers import (
    TEST_REGISTRY, ModuleImages, buildkit_args, buildx_or_skip, channel_matrix_text, cold_engine, containerd_store,
    image_layers, NO_CONDA_PATH, report_of, run_cli, unavailable)

pytestmark = pytest.mark.docker

MKL, OPENBLAS = "py3.11-cpu-mkl-conda", "py3.11-cpu-openblas-conda"
ALL_PASS = {"docker": "pass", "bare": "pass", "hpc": "pass"}
OWN = ModuleImages(__name__, build_cache=True)  # every conda image and BuildKit record is this module's alone


@pytest.fixture(scope="module")
def channel():
    info = channel_build.build()
    with ChannelServer(info.root) as server:
        yield info, server


class Project:
    """A conda matrix pointed at the test channel, with its locks, reports and work dirs."""

    def __init__(self, root: Path, info, server: ChannelServer, *, image: str, sha256: str | None = None,
                 broken: bool = False, extra: str = ""):
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.matrix = root, root / "matrix.yaml"
        channels = [info.channel_url(server.url, broken=True)] if broken else []
        channels.append(info.channel_url(server.url))
        text = channel_matrix_text(info, server, image=image, labels=OWN.labels, sha256=sha256, channels=channels)
        self.matrix.write_text(text + extra)

    @classmethod
    def beside(cls, root: Path, text: str) -> "Project":
        """Another project whose matrix is `text` (a copy or an edit of one above)."""
        project = cls.__new__(cls)
        root.mkdir(parents=True, exist_ok=True)
        project.root, project.matrix = root, root / "matrix.yaml"
        project.matrix.write_text(text)
        return project

    def cli(self, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
        return run_cli(*args, "--matrix", str(self.matrix), env={"PATH": NO_CONDA_PATH}, timeout=timeout)

    def build(self, tag: str, *args: str) -> subprocess.CompletedProcess:
        return self.cli("build", "--plain", "--gpus", "none", "--report", str(self.report_path(tag)),
                        "--work-dir", str(OWN.work_dir(self.root / tag)), *args)

    def report_path(self, tag: str) -> Path:
        return self.root / f"{tag}.json"

    def report(self, tag: str) -> dict:
        return report_of(self.report_path(tag))

    def lock_text(self, cell: str) -> str:
        return (self.root / "locks" / f"{cell}.txt").read_text()

    def log(self, tag: str, cell: str) -> str:
        return (self.root / tag / "logs" / f"{cell}.log").read_text(errors="replace")


def _out(r: subprocess.CompletedProcess) -> str:
    return (r.stdout[-3000:] + "\n" + r.stderr[-3000:]).strip()


@pytest.fixture(scope="module")
def locked(tmp_path_factory, channel, base_registry, session_id) -> Project:
    info, server = channel
    assert shutil.which("conda", path=NO_CONDA_PATH) is None and shutil.which("mamba", path=NO_CONDA_PATH) is None
    project = Project(tmp_path_factory.mktemp("conda"), info, server, image=f"{TEST_REGISTRY}/it-{session_id}/conda")
    r = project.cli("lock")
    assert r.returncode == 0, _out(r)
    return project


def _build(project: Project, builder: str) -> Project:
    buildx_or_skip()
    r = project.build(builder, "--builder", builder)
    assert r.returncode == 0, _out(r)
    return project


@pytest.fixture(scope="module")
def built_buildkit(locked, engine, created_images) -> Project:
    """Both cells from their locks, by BuildKit (its cache mount holds every package after it)."""
    return _build(locked, "buildkit")


def test_lock_solves_without_conda_and_pins_the_channel_files(locked, channel):
    info, _ = channel
    for cell, blas, torch_build in ((MKL, "mkl", "cpu_mkl"), (OPENBLAS, "openblas", "cpu_generic")):
        text = locked.lock_text(cell)
        assert "# resolver: py-rattler" in text and "@EXPLICIT" in text
        lines = [line for line in text.splitlines() if line.startswith("http://")]
        for name, build in (("pytorch", torch_build), ("libblas", blas), ("numpy", "")):
            pkg = info.find(name, build)
            assert f"/{pkg.subdir}/{pkg.file}#{pkg.sha256}" in text, (name, build)
        assert all(line.startswith(info.channel_url(channel[1].url) + "/") for line in lines)
    assert "/mkl-" not in locked.lock_text(OPENBLAS) and "nomkl" not in locked.lock_text(MKL)
    r = locked.cli("lock", "--check")
    assert r.returncode == 0, _out(r)
    assert f"{MKL}\tcurrent" in r.stdout and f"{OPENBLAS}\tcurrent" in r.stdout


def test_both_cells_pass_every_launch_mode_from_their_locks(built_buildkit):
    built, builder = built_buildkit, "buildkit"
    report = built.report(builder)
    for cell in (MKL, OPENBLAS):
        r = report[cell]
        assert r["status"] == "passed" and r["builder"] == builder, (cell, r["status"], r["error"])
        assert r["launches"] == ALL_PASS, [c for c in r["checks"] if c["verdict"] == "fail"]
        locked = {c["name"]: c for c in r["checks"] if c["mode"] == "docker"}["packages.locked"]
        assert locked["verdict"] == "pass", locked
        log = built.log(builder, cell)
        assert "--file /tmp/imagefactory-lock.txt" in log or "imagefactory-lock" in log


def _checks(report: dict, cell: str, mode: str) -> dict[str, dict]:
    return {c["name"]: c for c in report[cell]["checks"] if c["mode"] == mode}


@pytest.mark.parametrize("mode", ["docker", "bare", "hpc"])
def test_the_mkl_cell_is_mkl_through_the_libblas_switch_with_one_intel_openmp(built_buildkit, mode):
    found = _checks(built_buildkit.report("buildkit"), MKL, mode)
    assert found["numpy.blas"]["verdict"] == "pass" and found["numpy.blas"]["actual"] == "mkl", found["numpy.blas"]
    layer = next(c for name, c in found.items() if "threading_layer" in name)
    assert layer["verdict"] == "pass" and layer["actual"].lower().startswith("intel"), layer
    omp = next(c for name, c in found.items() if "openmp" in name.lower())
    assert omp["verdict"] == "pass" and "libiomp5" in omp["actual"], omp
    activation = next(c for name, c in found.items() if name.startswith("conda.activation") or "activat" in name)
    assert activation["verdict"] == "pass" and "MKL_INTERFACE_LAYER" in activation["expected"], activation


def test_the_openblas_cell_loads_openblas_through_the_switch(built_buildkit, engine):
    found = _checks(built_buildkit.report("buildkit"), OPENBLAS, "bare")
    assert found["numpy.blas"]["actual"] == "openblas", found["numpy.blas"]
    image = built_buildkit.report("buildkit")[OPENBLAS]["candidate"]
    out = engine.client.containers.run(image, ["python", "-c", (
        "import numpy, threadpoolctl, os; "
        "print([(i['internal_api'], os.path.realpath(i['filepath'])) "
        "for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas'])")],
        network_mode="none", remove=True, entrypoint=[]).decode()
    assert "openblas" in out and "libopenblas" in out and "mkl" not in out, out


def test_buildkit_cache_mount_a_changed_cell_downloads_no_cached_package(built_buildkit, channel, tmp_path):
    """A changed conda cell (one more package the environment already has: the lock's header
    changes, so its environment is installed again) takes every package from BuildKit's cache
    mount: the channel serves no .conda file for it. It runs before the tests whose builds fail
    on purpose (a download that fails its sha256 is not kept in the cache)."""
    _, server = channel
    changed = Project.beside(tmp_path, built_buildkit.matrix.read_text() + "packages: [threadpoolctl]\n")
    assert changed.cli("lock", "--only", MKL).returncode == 0
    server.clear()
    r = changed.build("build", "--builder", "buildkit", "--only", MKL)
    assert r.returncode == 0, _out(r)
    log = changed.log("build", MKL)
    assert "conda create -y -p /opt/env" in log and changed.report("build")[MKL]["status"] == "passed"
    assert server.paths(".conda") == [], server.paths(".conda")
    assert not any(p.endswith("installer.sh") for p in server.paths())  # the installer layer: cached


def test_a_broken_libblas_switch_fails_numpy_blas_naming_the_library(channel, tmp_path, session_id, created_images):
    """An MKL cell locked against a channel whose libblas *_mkl build points at OpenBLAS: the lock
    is consistent (every name and build says mkl), the image is not, and the probe says so."""
    buildx_or_skip()
    info, server = channel
    project = Project(tmp_path, info, server, image=f"{TEST_REGISTRY}/it-{session_id}/conda-broken", broken=True)
    assert project.cli("lock", "--only", MKL).returncode == 0
    assert info.channel_url(server.url, broken=True) + "/linux-64/libblas-" in project.lock_text(MKL)
    r = project.build("build", "--builder", "buildkit", "--only", MKL)
    assert r.returncode == 1, _out(r)
    cell = project.report("build")[MKL]
    assert cell["status"] == "check-failed"
    blas = _checks(project.report("build"), MKL, "docker")["numpy.blas"]
    # libblas.so.3 now answers with OpenBLAS while liblapack.so.3 still switches to MKL: numpy's
    # process loads both, and the check names the libraries it found
    assert blas["verdict"] == "fail" and "openblas" in blas["actual"].split(", "), blas
    assert "libopenblas" in blas["detail"], blas


def test_a_wrong_installer_sha256_fails_the_build_naming_the_download_and_both_digests(channel, tmp_path, session_id):
    info, server = channel
    wrong = "badc0ffee" * 7 + "0"  # 64 hex digits that are not the installer's
    project = Project(tmp_path, info, server, image=f"{TEST_REGISTRY}/it-{session_id}/conda-sha", sha256=wrong)
    r = project.build("build", "--builder", "buildkit", "--only", MKL)  # unlocked: fails before any solve
    assert r.returncode == 1, _out(r)
    cell = project.report("build")[MKL]
    tail = "\n".join(cell["log_tail"])
    assert cell["status"] == "build-failed"
    assert f"checksum mismatch for {info.installer_url(server.url)}: expected {wrong}, " \
           f"got {info.installer_sha256}" in tail, tail


def test_a_tampered_lock_line_fails_the_build_naming_the_download_and_both_digests(locked, tmp_path, session_id):
    shutil.copytree(locked.root / "locks", tmp_path / "locks")
    project = Project.beside(tmp_path, locked.matrix.read_text())
    lock = tmp_path / "locks" / f"{OPENBLAS}.txt"
    text = lock.read_text()
    line = next(x for x in text.splitlines() if "/numpy-" in x)
    url, real = line.split("#")
    forged = "f" * 64
    lock.write_text(text.replace(line, f"{url}#{forged}"))
    r = project.build("build", "--builder", "buildkit", "--only", OPENBLAS)
    assert r.returncode == 1, _out(r)
    cell = project.report("build")[OPENBLAS]
    tail = "\n".join(cell["log_tail"])
    assert cell["status"] == "build-failed"
    assert url in tail and forged in tail and real in tail, tail


def test_doctor_on_the_conda_cells(built_buildkit):
    """(bench on a conda image: test_legacy_engine, which has the classic builder's, bench's image)"""
    r = built_buildkit.cli("doctor", "--format", "json")
    assert r.returncode == 0, _out(r)
    cells = {c["cell"]: c for c in json.loads(r.stdout)["cells"]}
    assert cells[MKL]["verdict"] == cells[OPENBLAS]["verdict"] == "runs", cells


def test_the_conda_meta_records_are_readable_by_the_image_user(built_buildkit, engine):
    image = built_buildkit.report("buildkit")[MKL]["candidate"]
    # rattler writes conda-meta/*.json mode 0600; a foreign UID (the hpc launch mode's) must read them
    out = engine.client.containers.run(image, ["sh", "-c", "cat /opt/env/conda-meta/*.json >/dev/null && id -u"],
                                       network_mode="none", remove=True, entrypoint=[], user="4242:4242").decode()
    assert out.strip() == "4242"



def test_the_environment_is_split_and_a_cold_engine_builds_the_same_layers(built_buildkit, tmp_path):
    """The OpenBLAS cell's layers by rate of change (torch and the BLAS apart from the rest), and
    the same cell from the same lock on a cold engine (a dockerd of its own: no image, no build
    cache) gives every layer the same diff id, the small ones too (the CA files, .condarc). The
    pip route's comparison is test_layers'."""
    if not containerd_store():
        unavailable("the default engine is not Debian 13's with the containerd image store")
    first = built_buildkit.report("buildkit")[OPENBLAS]
    main_layers = image_layers(first["image_id"])
    copies = [s for _, _, s in main_layers if "/imagefactory-layers/" in s and "plan.json" not in s]
    assert [s.split("/imagefactory-layers/")[1].split("/")[0] for s in copies] == list(recipe.CONDA_LAYERS)
    sizes = {step.split("/imagefactory-layers/")[1].split("/")[0]: size for _, size, step in main_layers
             if step in copies}
    assert sizes["4-torch"] > 100 * (1 << 20) and sizes["3-blas"] > (1 << 20)  # torch and the BLAS apart
    with cold_engine() as host:
        r = run_cli(*buildkit_args(tmp_path, built_buildkit.matrix, "--only", OPENBLAS),
                    env={"DOCKER_HOST": host, "PATH": NO_CONDA_PATH}, timeout=1500)
        assert r.returncode == 0, _out(r)
        cold = report_of(tmp_path / "report.json")[OPENBLAS]
        assert cold["status"] == "passed", cold["error"]
        cold_layers = image_layers(cold["image_id"], host)
    assert len(main_layers) == len(cold_layers)
    differ = [(m[2], m[1]) for m, c in zip(main_layers, cold_layers) if m[0] != c[0]]
    assert not differ, differ
