"""Locks on the pip route, for real: resolved through PyPI, built by the real engine, probed.

One module-scoped build from a lock (the examples-like cell, `compiler: false`: packages are what
this module is about, and the torch.compile child would add ~10 s to each probe) serves most tests.
Its venv stage (installing from the lock) is its own. The tampered lock fails within seconds of its
first download; only the rebuild with the layer cache off is a second cold build (marked slow),
of the venv stage alone: that stage is where packages are installed.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import docker
import pytest

from imagefactory.lock import lockfile
from imagefactory.probe import smoke
from tests.integration.helpers import LEFTOVERS, RUN_LABEL, RUN_ID, TEST_REGISTRY, ModuleImages, matrix_text, run_cli

OWN = ModuleImages(__name__)  # the locked cells' images are this module's alone: removed as it ends

pytestmark = pytest.mark.docker

CELL = "py3.11-cpu-openblas-pip"


# The probe's own package listing (probe_packages: importlib.metadata, PEP 503 names), run alone:
# the rest of the probe (torch, BLAS, its children) is not what these tests compare.
PACKAGES = ("import json, sys\n"
            "probe = {'__name__': 'imagefactory_probe'}\n"
            "exec(compile(sys.argv[1], 'probe.py', 'exec'), probe)\n"
            "print(json.dumps(probe['probe_packages']()))\n")


def _installed(engine, image: str, python: str = "python") -> dict[str, str]:
    """`image`'s Python distributions, as the probe lists them (`python`: the interpreter; a venv
    stage has no PATH to the environment's)."""
    out = engine.client.containers.run(image, [python, "-c", PACKAGES, smoke.probe_source()],
                                       network_mode="none", remove=True, stderr=False)
    listing = json.loads(out.decode().strip().splitlines()[-1])
    assert listing["error"] is None and listing["python"], listing
    return listing["python"]


def _installed_in_venv_stage(engine, image: str) -> dict[str, str]:
    """What the venv stage `image` installed: its layer plan (resources/layers.py moved the
    environment into /imagefactory-layers/<layer>/, and plan.json lists each layer's
    distributions as name==version, the names PEP 503's, as the probe lists them)."""
    out = engine.client.containers.run(image, ["cat", "/imagefactory-layers/plan.json"], network_mode="none",
                                       remove=True, stderr=False)
    plan = json.loads(out.decode())
    return dict(pin.split("==", 1) for pins in plan.values() for pin in pins)


class Locked:
    def __init__(self, root: Path, image: str, wheelhouse: Path):
        self.root = root
        self.matrix = root / "matrix.yaml"
        self.matrix.write_text(matrix_text(image=image, wheelhouse=wheelhouse, labels=OWN.labels,
                                           extra="compiler: false\n"))
        self.lock = root / "locks" / f"{CELL}.txt"

    def build(self, tag: str = "build"):
        return run_cli("build", "--matrix", str(self.matrix), "--plain", "--gpus", "none",
                       "--report", str(self.root / f"{tag}.json"), "--work-dir", str(OWN.work_dir(self.root / tag)))

    def report(self, tag: str = "build") -> dict:
        return {c["cell"]: c for c in json.loads((self.root / f"{tag}.json").read_text())["cells"]}[CELL]


@pytest.fixture(scope="module")
def locked(tmp_path_factory, engine, base_registry, wheelhouse, session_id, created_images, cpu_build):
    """A real build from the lock (this run's label makes its content hash new to the engine)."""
    it = Locked(tmp_path_factory.mktemp("locked"), f"{TEST_REGISTRY}/lock-{session_id}/train", wheelhouse)
    it.lock_result = run_cli("lock", "--matrix", str(it.matrix))
    assert it.lock_result.returncode == 0, it.lock_result.stderr[-3000:]
    it.result = it.build()
    it.first = it.report()
    if it.first.get("candidate"):
        created_images.append(it.first["candidate"])
    return it


def test_lock_pins_every_file_by_hash_torch_from_the_wheelhouse(locked, wheelhouse):
    lock = lockfile.parse(locked.lock, "pip")
    pins = {p.name: p for p in lock.pins}
    assert {"torch", "numpy", "threadpoolctl"} <= set(pins)
    assert all(p.hashes for p in lock.pins)
    wheel = next(wheelhouse.glob("torch-2.13.0+cpu-*.whl"))
    assert pins["torch"].version == "2.13.0+cpu"
    assert pins["torch"].hashes == (hashlib.sha256(wheel.read_bytes()).hexdigest(),)
    assert dict(i[:2] for i in lock.inputs)["torch"] == "2.13.0"
    assert f"{CELL}: written" in locked.lock_result.stdout and "+ numpy " in locked.lock_result.stdout


def test_build_from_the_lock_passes_the_locked_versions_check(locked):
    assert locked.result.returncode == 0, locked.result.stdout[-3000:] + locked.result.stderr[-3000:]
    dockerfile = (locked.root / "build" / "contexts" / CELL / "Dockerfile").read_text()
    assert "--require-hashes --no-deps" in dockerfile and "-r /tmp/imagefactory-lock.txt" in dockerfile
    checks = {c["name"]: c for c in locked.first["checks"]}
    assert checks["packages.locked"]["verdict"] == "pass", checks["packages.locked"]
    assert locked.first["status"] == "passed"


def test_lock_check_and_a_second_lock_leave_a_current_lock_alone(locked):
    before = locked.lock.read_text()
    check = run_cli("lock", "--check", "--matrix", str(locked.matrix))
    assert check.returncode == 0, check.stderr
    assert f"{CELL}\tcurrent" in check.stdout
    again = run_cli("lock", "--matrix", str(locked.matrix))
    assert again.returncode == 0 and f"{CELL}: unchanged" in again.stdout
    assert locked.lock.read_text() == before


def test_a_tampered_hash_fails_the_build_naming_the_file(locked, tmp_path, created_images):
    shutil.copy(locked.matrix, tmp_path / "matrix.yaml")
    (tmp_path / "locks").mkdir()
    text = locked.lock.read_text()
    first = lockfile.parse(locked.lock, "pip").pins[0]  # pip fetches in file order: the first fails first
    good = first.hashes[0]
    bad = ("0" if good[0] != "0" else "1") + good[1:]
    (tmp_path / "locks" / f"{CELL}.txt").write_text(text.replace(good, bad))
    tampered = Locked.__new__(Locked)
    tampered.root, tampered.matrix = tmp_path, tmp_path / "matrix.yaml"
    result = tampered.build()
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    report = tampered.report()
    if report.get("candidate"):
        created_images.append(report["candidate"])
    assert report["status"] == "build-failed"
    tail = "\n".join(report["log_tail"])
    assert "DO NOT MATCH THE HASHES" in tail, tail
    assert re.search(rf"{re.escape(first.name)}-{re.escape(first.version)}-\S+\.whl", tail, re.I), tail
    assert bad in tail and good in tail


def test_a_lock_for_another_torch_is_refused_before_building(locked, tmp_path):
    """The lock was made for torch 2.12 (say, copied from another branch); the cell wants 2.13."""
    (tmp_path / "locks").mkdir()
    text = locked.lock.read_text()
    other = text.replace("# input torch: 2.13.0", "# input torch: 2.12.0").replace("torch==2.13.0+cpu",
                                                                                 "torch==2.12.0+cpu")
    assert other.count("2.12.0") == 3  # the input, the recorded resolution, the pin: a lock made for 2.12
    (tmp_path / "locks" / f"{CELL}.txt").write_text(other)
    shutil.copy(locked.matrix, tmp_path / "matrix.yaml")
    result = run_cli("build", "--matrix", str(tmp_path / "matrix.yaml"), "--plain", "--gpus", "none",
                     "--report", str(tmp_path / "report.json"), "--work-dir", str(tmp_path / "work"))
    assert result.returncode == 2, result.stderr
    assert (f"input.torch: cell {CELL} changed: the lock was made for torch '2.12.0', the cell now has "
            f"'2.13.0'") in result.stderr
    assert f"torch: cell {CELL} wants torch 2.13.0, the lock pins 2.12.0+cpu" in result.stderr
    assert not (tmp_path / "work" / "logs").exists() and not (tmp_path / "report.json").exists()
    check = run_cli("lock", "--check", "--matrix", str(tmp_path / "matrix.yaml"))
    assert check.returncode == 2 and f"{CELL}\tstale" in check.stdout


def test_upgrade_one_package_prints_its_diff_and_holds_the_rest(tmp_path, wheelhouse):
    """A real resolve through PyPI: lock with an old NumPy, then let only NumPy move."""
    path = tmp_path / "matrix.yaml"
    text = matrix_text(image=f"{TEST_REGISTRY}/lock-upgrade/train", wheelhouse=wheelhouse)
    path.write_text(text + 'numpy: "2.3.1"\n')
    assert run_cli("lock", "--matrix", str(path)).returncode == 0
    lock = tmp_path / "locks" / f"{CELL}.txt"
    before = {p.name: p.version for p in lockfile.parse(lock, "pip").pins}
    assert before["numpy"] == "2.3.1"
    path.write_text(text)  # numpy unpinned: the lock is stale until locked again
    stale = run_cli("lock", "--check", "--matrix", str(path))
    assert stale.returncode == 2 and "input.numpy" in stale.stderr
    lock.write_text(lock.read_text().replace("# input numpy: 2.3.1", "# input numpy: any"))
    result = run_cli("lock", "--upgrade", "numpy", "--matrix", str(path))
    assert result.returncode == 0, result.stderr[-2000:]
    after = {p.name: p.version for p in lockfile.parse(lock, "pip").pins}
    assert after["numpy"] != "2.3.1"
    assert f"numpy 2.3.1 -> {after['numpy']}" in result.stdout
    assert {n: v for n, v in after.items() if n != "numpy"} == {n: v for n, v in before.items() if n != "numpy"}


@pytest.mark.slow
def test_rebuild_after_a_cache_wipe_installs_the_same_packages(locked, engine, session_id, created_images):
    """A second cold build of the same context, with the layer cache off (no other test's cache is
    pruned), installs exactly the packages of the first: the lock's, at the lock's versions."""
    assert locked.first["status"] == "passed"
    first = _installed(engine, locked.first["candidate"])
    tag = f"imagefactory-test/lock-rebuild:{session_id}"
    created_images.append(tag)
    context = locked.root / "build" / "contexts" / CELL
    # The venv stage installs every package (the final stage copies /opt/venv as it is).
    events = engine.client.api.build(path=str(context), tag=tag, target="venv", nocache=True, rm=True,
                                     forcerm=True, decode=True, network_mode="host", labels={RUN_LABEL: RUN_ID})
    try:
        _check_rebuild(locked, engine, tag, first, events)
    finally:
        # Now, not at the end of the run: the classic builder takes the NEWEST matching child as
        # a step's cache, so while this chain (base -> SHELL -> ... -> COPY lock.txt) exists,
        # every later build of the shared cell follows it and misses from its 7th step on (a
        # venv install, about a minute, each). Removing the tag prunes the chain with it.
        try:
            engine.client.images.remove(tag, force=True)
        except docker.errors.APIError:  # not built (the build failed): nothing to prune
            pass


def _check_rebuild(locked, engine, tag: str, first: dict[str, str], events) -> None:
    stream = []
    for event in LEFTOVERS.from_events(events):
        assert "error" not in event, event
        stream += str(event.get("stream", "")).splitlines()
    assert not [line for line in stream if "Using cache" in line]
    # a new image, none of the first build's (its log names every image it made or reused)
    first_log = (locked.root / "build" / "logs" / f"{CELL}.log").read_text()
    rebuilt = engine.image_id(tag)
    assert rebuilt and re.findall(r"^ ---> ([0-9a-f]{12})$", first_log, re.M)
    assert rebuilt.split(":")[-1][:12] not in first_log
    again = _installed_in_venv_stage(engine, tag)
    assert again == first
    pins = dict(lockfile.parse(locked.lock, "pip").versions())
    assert {n: v for n, v in again.items() if n in pins} == pins
    assert set(again) - set(pins) <= {"pip", "setuptools", "wheel"}
