"""Helpers the integration tests share (constants, the CLI runner, matrices, registries, the
shared two-cell build, and this run's clean-up). Fixtures live in conftest.py; test modules
import from here, never from conftest.py or from each other."""

from __future__ import annotations

import atexit
import base64
import contextlib
import glob
import hashlib
import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
BASE_REGISTRY = "127.0.0.1:5000"
TEST_REGISTRY = os.environ.get("IMAGEFACTORY_TEST_REGISTRY", "127.0.0.1:5001")
TEST_USER = os.environ.get("IMAGEFACTORY_TEST_REGISTRY_USER", "imagefactory")
TEST_PASSWORD = os.environ.get("IMAGEFACTORY_TEST_REGISTRY_PASSWORD", "ci-password")
CACHE = Path(os.environ.get("IMAGEFACTORY_CI_CACHE", Path.home() / ".cache" / "imagefactory-ci"))
# The legacy engine (Debian 12's Docker 20.10, the graph-driver store) that ci-setup.sh runs beside
# the current one: tests/integration/test_legacy_engine.py.
LEGACY_HOST = os.environ.get("IMAGEFACTORY_LEGACY_DOCKER_HOST", "unix:///run/imagefactory-legacy/docker.sock")
# podman's Docker API (podman system service), also started by ci-setup.sh: tests/integration/test_podman.py.
PODMAN_HOST = os.environ.get("IMAGEFACTORY_PODMAN_HOST", "unix:///run/imagefactory-podman/podman.sock")
TORCH_CPU = "2.13.0"
HOST_CAS = sorted(glob.glob("/usr/local/share/ca-certificates/*.crt"))

# One id per pytest process (one run). Every matrix the tests write carries it as a label, so
# (1) each cell's content hash is new to the engine: a build is a real build without removing
# anybody's images first (the layer cache still serves the heavy steps), and (2) everything
# this run built, and everything built FROM it, is found by that label at the end of the run.
RUN_ID = uuid.uuid4().hex[:8]
RUN_STARTED = time.time()  # build-cache records made after this are this run's (prune_build_cache)
RUN_LABEL = "io.imagefactory-test.run"

# No test reads the machine's Docker config (~/.docker: its registry logins, its buildx builder,
# its context): the run gets an empty one of its own, so nothing done on the machine before the
# run (a `docker login` after the quickstart) decides a result, and the product finds exactly the
# logins a test gives it. A test that needs a login makes a config of its own (the `logged_in`
# fixture). Removed when the run ends.
DOCKER_CONFIG = Path(tempfile.mkdtemp(prefix=f"imagefactory-test-docker-config-{RUN_ID}-"))
(DOCKER_CONFIG / "config.json").write_text("{}\n")
os.environ["DOCKER_CONFIG"] = str(DOCKER_CONFIG)
atexit.register(shutil.rmtree, DOCKER_CONFIG, True)


def unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must provide it: .ci/run runs scripts/ci-setup.sh)")
    pytest.skip(f"{reason}; run `sudo bash scripts/ci-setup.sh` first")


# A test of one check runs the probe in one launch mode, not the build's three (three containers
# that import torch at once); test_launch_modes.py proves the modes themselves.
ONE_MODE = ("docker",)


def judged(cell):
    """A cell as tests about other checks judge it: without the torch.compile child (about
    10 s per probe here). test_train_fast's torch.compile tests judge cells as built."""
    return replace(cell, compiler=False)


def matrix_text(*, image: str, wheelhouse: Path, cells: str | None = None, labels: dict[str, str] | None = None,
                extra: str = "") -> str:
    """A pip-route matrix that builds here: base images from the local registry, torch's CPU
    wheel from the wheelhouse, the rest from PyPI through the proxy (whose CAs are added).
    It carries this run's label (RUN_LABEL) besides `labels`; `extra` is appended as is."""
    cells = cells or """
        matrix:
          python: ["3.11"]
          cuda: ["none"]
          blas: [openblas]
          installer: [pip]
    """
    all_labels = {RUN_LABEL: RUN_ID, **(labels or {})}
    text = textwrap.dedent(cells).strip() + "\n" + textwrap.dedent(f"""
        image: {image}
        torch: "{TORCH_CPU}"
        threads: 2
        base_registry: {BASE_REGISTRY}
        pip:
          torch_index_url: null
          wheelhouse: {wheelhouse}
    """).strip() + "\n"
    text += f"labels: {json.dumps(all_labels)}\n"
    if HOST_CAS:
        text += f"ca_certificates: {json.dumps(HOST_CAS)}\n"
    return text + extra


# --------------------------------------------------------------------------- this run's leftovers

_STEP_RE = re.compile(r"^Step \d+/\d+ : (\S+)")
_IMAGE_RE = re.compile(r"^ ---> ([0-9a-f]{12,64})$")
# podman's classic build: "[1/2] STEP 2/9: SHELL ...", "--> Using cache <id>", "--> <id>"
_PODMAN_STEP_RE = re.compile(r"^(?:\[\d+/\d+\] )?STEP \d+/\d+: (\S+)")
_PODMAN_IMAGE_RE = re.compile(r"^--> ([0-9a-f]{11,64})$")


def images_created(lines: Iterable[str]) -> list[str]:
    """The image ids a classic-builder build stream says it created: each step's result that
    was not a cache hit, in order. FROM steps (the base) and cached steps (another build's
    images) are left out, so these are this build's own. A multi-stage build's earlier stage
    ends as a dangling image that nothing else removes; its ids are among these."""
    created: list[str] = []
    step, cached = None, False
    for line in lines:
        m = _STEP_RE.match(line) or _PODMAN_STEP_RE.match(line)
        if m:
            step, cached = m[1].upper(), False
            continue
        if line.strip() == "---> Using cache" or line.startswith("--> Using cache "):
            cached = True
            continue
        m = _IMAGE_RE.match(line) or _PODMAN_IMAGE_RE.match(line)
        if m and step not in (None, "FROM") and not cached:
            created.append(m[1])
    return created


class Leftovers:
    """The images this run's builds created, for removal at the end of the run."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def add(self, ids: Iterable[str]) -> None:
        self.ids += [i for i in ids if i not in self.ids]

    def from_work_dir(self, work_dir: Path) -> None:
        """Read every build log of an `imagefactory ... --work-dir` run (a later build in the
        same work dir rewrites them, so read them after each command)."""
        for log in sorted((work_dir / "logs").glob("*.log")):
            self.add(images_created(log.read_text(errors="replace").splitlines()))

    def from_tree(self, root: Path) -> None:
        """Every build log under `root` (the session's temporary tree: each work dir its
        `imagefactory` runs used). A failed build's finished steps and a multi-stage build's
        earlier stage have no child whose removal prunes them: left to the engine, runs on the
        containerd-store engine here kept ~17 GB of them, and the next CI run filled the disk."""
        for logs in sorted(root.glob("**/logs")):
            if logs.is_dir() and not logs.is_symlink():
                self.from_work_dir(logs.parent)

    def from_events(self, events: Iterable[dict]) -> Iterable[dict]:
        """Pass a decoded build stream through, noting what it created."""
        lines: list[str] = []
        for event in events:
            lines += str(event.get("stream", "")).splitlines()
            yield event
        self.add(images_created(lines))

    def remove(self, client) -> list[str]:
        """Remove the untagged ones, newest first, one image each (noprune): an image that
        another build has since used as its parent keeps its child and is refused, as is a
        tagged one. Returns the ids removed."""
        import docker

        removed = []
        for image_id in reversed(self.ids):
            try:
                if client.images.get(image_id).tags:
                    continue
                client.images.remove(image_id, noprune=True)
                removed.append(image_id)
            except docker.errors.APIError:  # gone already (pruned with its child), or in use
                pass
        return removed


LEFTOVERS = Leftovers()


def _engine_time(stamp: str) -> float:
    """An engine timestamp (RFC 3339, nanoseconds, Z) as seconds since the epoch."""
    from datetime import datetime, timezone

    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(head).replace(tzinfo=timezone.utc).timestamp() + float("0." + (frac or "0"))


def build_record_ids(client) -> set[str]:
    """The ids of the BuildKit records the engine holds now."""
    return {r["ID"] for r in client.df().get("BuildCache") or []}


def prune_build_cache(client, since: float, keep: set[str] | None = None) -> int:
    """Remove the BuildKit cache records made since `since` (this run's, or one module's) that
    nothing uses now; records an earlier run or the quickstart made are kept even where this
    run reused them. With `keep` (the ids the engine held when the run or module started), a
    record is this run's when its id is new: BuildKit dates a record made from a layer of fixed
    time (SOURCE_DATE_EPOCH) with that time, 1980, so `since` alone kept those, and their parents
    with them (8 records after a full run, 2026-12-06). Returns the bytes reclaimed. (BuildKit
    keeps its cache beside the images: a run's records were 11 GB here, and nothing else ever
    removed them.)"""
    import docker

    def ours(record: dict) -> bool:
        if keep is not None:
            return record["ID"] not in keep
        return _engine_time(record["CreatedAt"]) >= since - 1

    reclaimed = 0
    left: set[str] | None = None
    for _ in range(6):  # a record whose child was still there is refused; the next pass takes it
        records = [r for r in client.df().get("BuildCache") or [] if not r.get("InUse") and ours(r)]
        ids = {r["ID"] for r in records}
        if not ids or ids == left:  # nothing left, or a pass that removed nothing: stop
            break
        left = ids
        # newest first (a child is newer than its parent); the engine takes one id per call.
        # all=True: a record marked shared (a stage tree a later COPY took, or an image's layer)
        # goes only with it, and the id filter still limits the call to that one record
        for record in sorted(records, key=lambda r: r["CreatedAt"], reverse=True):
            try:
                reply = client.api.prune_builds(filters={"id": record["ID"]}, all=True)
                reclaimed += int(reply.get("SpaceReclaimed") or 0)
            except docker.errors.APIError:
                pass
    return reclaimed


MODULE_LABEL = "io.imagefactory-test.module"


class ModuleImages:
    """What one test module builds for itself alone (its own cells; never the session's shared
    images): the images that carry its label (`labels`, in its matrices) and the stage images
    its classic builds left in the work dirs it registered. conftest removes them when the
    module ends, so the run's disk holds one module's own images at a time, not every
    module's until the end (CI's disk ran out that way). Keyed by module and run, so a
    module can make one at import and conftest finds the same one."""

    _used: dict[str, list[Path]] = {}
    _build_cache: set[str] = set()

    def __init__(self, module: str, *, build_cache: bool = False):
        """`build_cache`: every BuildKit build the module makes is its own (none of a session
        fixture's), so the cache records made while it ran go with it too."""
        self.key = f"{module.rsplit('.', 1)[-1]}-{RUN_ID}"
        if build_cache:
            self._build_cache.add(self.key)

    @property
    def labels(self) -> dict[str, str]:
        self._used.setdefault(self.key, [])
        return {RUN_LABEL: RUN_ID, MODULE_LABEL: self.key}

    def work_dir(self, path: Path) -> Path:
        self._used.setdefault(self.key, []).append(path)
        return path

    @property
    def used(self) -> bool:
        return self.key in self._used

    @property
    def prunes_build_cache(self) -> bool:
        return self.key in self._build_cache

    def remove(self, client, since: float | None = None, keep: set[str] | None = None) -> int:
        """Remove them (images built FROM them carry the label too: newest first), and, for a
        `build_cache` module, the BuildKit cache records made since it started (`since`, or every
        record not in `keep`, the ids the engine held then). Returns how many images went."""
        import docker

        if self.key in self._build_cache and since is not None:
            prune_build_cache(client, since, keep)

        stages = Leftovers()
        for work_dir in self._used.pop(self.key, []):
            if (work_dir / "logs").is_dir():
                stages.from_work_dir(work_dir)
        labelled = client.images.list(all=True, filters={"label": f"{MODULE_LABEL}={self.key}"})
        status = str(client.info().get("DriverStatus") or "")
        noprune = "io.containerd.snapshotter" in status  # a graph-driver store keeps a parent with children
        removed = 0
        for image in sorted(labelled, key=lambda i: i.attrs.get("Created", ""), reverse=True):
            try:
                # noprune: an untagged parent may be a cached step of the session's shared build (the
                # containerd store removes a parent that still has children); the module's own steps
                # are the stage leftovers below
                client.images.remove(image.id, force=True, noprune=noprune)
                removed += 1
            except docker.errors.APIError:
                pass
        return removed + len(stages.remove(client))


def remove_run_images(client, refs: list[str], run_id: str, leftovers: Leftovers) -> None:
    """A run's images: the references its tests registered, every image carrying its label
    (its builds, and images built FROM them), then the untagged images its builds created
    (a multi-stage build's earlier stage, a failed build's last step). Nothing else."""
    import docker

    def remove_refs() -> None:
        for ref in reversed(refs):
            try:
                client.images.remove(ref, force=True)
            except docker.errors.APIError:
                pass

    remove_refs()
    # all=True: in the containerd store a build's labelled steps can outlive the image they led
    # to, as images only an `all` listing shows (a full run left 15 such, 1.66 GB each in name)
    labelled = client.images.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"})
    # children before parents: an image built FROM another is newer
    for image in sorted(labelled, key=lambda i: i.attrs.get("Created", ""), reverse=True):
        try:
            client.images.remove(image.id, force=True)
        except docker.errors.APIError:
            pass
    leftovers.remove(client)
    # again: an image registered by id (a base a test built and moved its tag from) that a
    # build's earlier stage was FROM could not go before that stage's images did
    remove_refs()


def _work_dir(args: tuple[str, ...]) -> Path | None:
    for flag, value in zip(args, args[1:]):
        if flag == "--work-dir":
            return Path(value)
    return None


def cli_env(env: dict | None = None) -> dict[str, str]:
    """The environment of an `imagefactory` run: this process's, without any registry login
    (IMAGEFACTORY_REGISTRY_*: a test passes the ones it means), plus `env`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("IMAGEFACTORY_REGISTRY_")}, **(env or {})}


BUILDER_COMMANDS = ("build", "test", "push")

_BUILT_RE = re.compile(r"^(?:\[[^]]+\] )?(?:Step \d+/\d+ : (?!FROM)|#\d+ \[)", re.M)  # a step that ran or was looked up
_CACHE_HIT_RE = re.compile(r"(?:^(?:\[[^]]+\] )? ---> Using cache| CACHED)$", re.M)  # classic's, BuildKit's


class BuildCount:
    """What the run built through `imagefactory` (issue 45: every run says what it built): each
    cell whose build ran (its log names steps; a cell found in a cache or a registry has none),
    and of those the cold ones (no step taken from the layer cache). Read from each command's
    work dir once it ends; printed in the session's summary (tests/conftest.py)."""

    def __init__(self) -> None:
        self.builds = self.cold = 0
        self._lock = threading.Lock()

    def note(self, work_dir: Path, since: float) -> None:
        for log in (work_dir / "logs").glob("*.log") if (work_dir / "logs").is_dir() else ():
            if log.stat().st_mtime < since:
                continue
            text = log.read_text(errors="replace")
            if _BUILT_RE.search(text):
                with self._lock:
                    self.builds += 1
                    self.cold += _CACHE_HIT_RE.search(text) is None

    def line(self) -> str:
        return (f"builds: {self.builds} cell build(s) by imagefactory, {self.cold} of them cold (no step from a "
                f"cache); fixture images built with the SDK are not counted")


BUILDS = BuildCount()


def pinned_builder(args: tuple[str, ...]) -> tuple[str, ...]:
    """`args` with `--builder classic` added to a build, test or push that names no builder. The
    default is auto (BuildKit here); the suite's shared images are built by name instead, classic
    ones (cpu_build) and BuildKit ones (bk_build) apart, so that each module's reruns find them.
    test_default_builder.py runs the default itself (default_builder=True)."""
    if args and args[0] in BUILDER_COMMANDS and "--builder" not in args:
        return (args[0], "--builder", "classic", *args[1:])
    return args


def run_cli(*args: str, env: dict | None = None, timeout: float = 1800,
            default_builder: bool = False) -> subprocess.CompletedProcess:
    """`python -m imagefactory ARGS`; `default_builder`: leave a missing --builder missing."""
    argv = args if default_builder else pinned_builder(args)
    since = time.time()
    try:
        return subprocess.run([sys.executable, "-m", "imagefactory", *argv], capture_output=True, text=True,
                              env=cli_env(env), timeout=timeout)
    finally:
        work = _work_dir(args)
        if work is not None:
            LEFTOVERS.from_work_dir(work)
            BUILDS.note(work, since)


class Background:
    """An `imagefactory build` (or `command`) started now, in the background, and judged later:
    a cold build that mostly waits on the network and the disk (the CUDA cell downloads ~3 GB)
    overlaps the CPU-bound tests instead of adding its whole time to the run.

    `on_exit(self)` runs in the collecting thread as soon as the command ends, before any test
    waits for it: the CUDA cell's ~12 GB (image and venv stage) go then, not at the end of the
    session, since its test judges only the report (CI's disk ran out with them kept)."""

    def __init__(self, root: Path, text: str, *args: str, command: str = "build",
                 on_exit: Callable[["Background"], None] | None = None, env: dict | None = None):
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.matrix, self.report_path = root, root / "matrix.yaml", root / "report.json"
        self.matrix.write_text(text)
        self.args = pinned_builder((command, "--matrix", str(self.matrix), "--plain", "--report",
                                    str(self.report_path), "--work-dir", str(root / "work"), *args))
        self.started = time.monotonic()
        self._since = time.time()
        self.proc = subprocess.Popen([sys.executable, "-m", "imagefactory", *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=cli_env(env))
        self._done: subprocess.CompletedProcess | None = None
        self._on_exit = on_exit
        self.exit_error: BaseException | None = None  # what on_exit raised, for the test to show
        self._collector = threading.Thread(target=self._collect, name="background-" + command, daemon=True)
        self._collector.start()

    def _collect(self) -> None:
        out, err = self.proc.communicate()
        LEFTOVERS.from_work_dir(self.root / "work")
        BUILDS.note(self.root / "work", self._since)
        self._done = subprocess.CompletedProcess(self.args, self.proc.returncode, out, err)
        if self._on_exit is not None:
            try:
                self._on_exit(self)
            except BaseException as e:  # noqa: BLE001 - reported by wait(), not lost in a thread
                self.exit_error = e

    def wait(self, timeout: float = 1800) -> subprocess.CompletedProcess:
        self._collector.join(timeout)
        if self._collector.is_alive():
            self.proc.kill()
            self._collector.join()
        assert self._done is not None
        return self._done

    def stop(self) -> None:
        """A session that ends without waiting (the test deselected on the way, or failed
        before): interrupt the build as a user would, so it cleans up after itself."""
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            self._collector.join(60)
            if self._collector.is_alive():
                self.proc.kill()
        self._collector.join()

    def report(self) -> list[dict]:
        return json.loads(self.report_path.read_text())["cells"]


class DyingPush:
    """`imagefactory push` of the shared build's good cell (in the Background) to a throwaway
    registry that is stopped once the upload has begun. The engine then retries each layer on its
    own (about 50 s of waiting, holding its upload slots), so it is started where no other push
    runs (conftest) and judged later by test_publish."""

    repo = "midpush/train"

    def __init__(self, root: Path, build: "Build"):
        root.mkdir(parents=True, exist_ok=True)
        self.registry = Registry(root)
        text = build.with_image(f"{self.registry.address}/{self.repo}").read_text()
        self.push = Background(root / "push", text, "--only", Build.GOOD, "--push-tries", "3",
                               "--retry-delay", "0.5", command="push")
        try:
            deadline = time.monotonic() + 120
            while not self.registry.receiving() and self.push.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            self.reached = self.registry.receiving()
        finally:
            self.registry.stop()  # mid-upload

    def stop(self) -> None:
        self.push.stop()
        self.registry.stop()


def cuda_matrix_text(wheelhouse: Path) -> str:
    """The pip CUDA cell: torch 2.14.1 (CUDA 13.0, with its nvidia-* wheels) from PyPI."""
    cells = """
        matrix:
          python: ["3.11"]
          cuda: ["13.0"]
          blas: [openblas]
          installer: [pip]
    """
    return (matrix_text(image=f"{TEST_REGISTRY}/it-{RUN_ID}/cuda", wheelhouse=wheelhouse, cells=cells)
            .replace(f'torch: "{TORCH_CPU}"', 'torch: "2.14.1"'))


# --------------------------------------------------------------------------- arm64 under QEMU

ARM64_TORCH = "2.10.0"  # PyPI's last CPU-only aarch64 torch (2.11 on are CUDA 13 builds there)
ARM64_CELL = "py3.11-cpu-openblas-pip-arm64"
# One release tag for both platforms: a template without {torch}, since each platform installs
# the torch it can get here (the wheelhouse's 2.13.0+cpu on amd64, PyPI's 2.10.0 on arm64).
LIST_TEMPLATE = "{image}:py{python}-{accel}-{blas}{installer_suffix}"


def arm64_matrix_text(wheelhouse: Path, image: str, *, arm64_extra: str = "",
                      labels: dict[str, str] | None = None) -> str:
    """The shared pip CPU cell and its arm64 twin, one list tag for both. The arm64 cell has
    `compiler: false`: g++ installed by an emulated apt and an emulated Inductor compile would
    take longer than the rest of its build; its compile check says so."""
    cells = f"""
        matrix:
          python: ["3.11"]
          cuda: ["none"]
          blas: [openblas]
          installer: [pip]
          platform: [linux/amd64, linux/arm64]
          include:
            - {{platform: linux/arm64, torch: "{ARM64_TORCH}", compiler: false{arm64_extra}}}
    """
    return matrix_text(image=image, wheelhouse=wheelhouse, cells=cells, labels=labels,
                       extra=f'tags: {{template: "{LIST_TEMPLATE}"}}\n')


def binfmt_or_unavailable() -> None:
    """QEMU registered for aarch64 binaries with binfmt_misc (scripts/ci-setup.sh does it)."""
    handler = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    try:
        enabled = handler.read_text().splitlines()[0] == "enabled"
    except (OSError, IndexError):
        enabled = False
    if not enabled:
        unavailable("binfmt_misc has no enabled qemu-aarch64 handler: arm64 images cannot run here")


# --------------------------------------------------------------------------- tiny images and lists

def docker_cli(*args: str, config: Path | None = None, stdin: str | None = None) -> str:
    """`docker ARGS` (with `--config CONFIG`: a login of the test's own); its stdout, asserted to succeed."""
    head = ["docker", "--config", str(config)] if config else ["docker"]
    r = subprocess.run([*head, *args], capture_output=True, text=True, timeout=120, input=stdin)
    assert r.returncode == 0, f"docker {' '.join(args)}: {r.stderr[-2000:]}"
    return r.stdout


def tiny_images(module: "ModuleImages", root: Path, name: str) -> dict[str, str]:
    """platform -> image id of a FROM-scratch image holding one file, built with buildx for each of
    linux/amd64 and linux/arm64 (no RUN: nothing runs emulated), labelled as `module`'s own, so
    conftest removes it, and every tag given to it, when the module ends."""
    buildx_or_skip()
    out = {}
    for platform in ("linux/amd64", "linux/arm64"):
        context = root / platform.replace("/", "-")
        context.mkdir(parents=True)
        (context / "hello.txt").write_text(f"{name} {platform} ({RUN_ID})\n")
        (context / "Dockerfile").write_text("FROM scratch\nCOPY hello.txt /\n")
        tag = f"imagefactory-test/{name}-{RUN_ID}:{platform.split('/')[1]}"
        labels = [a for k, v in module.labels.items() for a in ("--label", f"{k}={v}")]
        # no attestations: in the containerd image store they would make each image an index of two
        # manifests, where a cell's image is one manifest
        docker_cli("buildx", "build", "--platform", platform, "--provenance=false", "--sbom=false", "--load", "-t", tag,
                   *labels, str(context))
        out[platform] = docker_cli("image", "inspect", "--format", "{{.Id}}", tag).strip()
        assert docker_cli("image", "inspect", "--format", "{{.Os}}/{{.Architecture}}", tag).strip() == platform
    return out


def containerd_store() -> bool:
    """Whether the default engine keeps its images in the containerd image store (docker info's
    DriverStatus names containerd's snapshotter), where an image's id is its manifest digest."""
    return "io.containerd.snapshotter.v1" in docker_cli("info", "--format", "{{json .DriverStatus}}")


def assert_pulls_its_cell(ref: str, platform: str, image_id: str, digests: dict[str, str], config: Path) -> None:
    """`docker pull --platform PLATFORM` of the list `ref` gives that platform's cell image (`image_id`,
    pushed as `digests[platform]`) and not the other's. The graph-driver store then holds that very
    image under the name; the containerd store holds the list, and an image's id is its manifest
    digest, so the cell's id is the digest the list names for the platform."""
    docker_cli("pull", "--platform", platform, ref, config=config)
    got = json.loads(docker_cli("image", "inspect", ref))[0]
    repo = ref.rsplit(":", 1)[0]
    others = [d for p, d in digests.items() if p != platform]
    if containerd_store():
        assert image_id == digests[platform] and image_id not in others
        assert any(d.startswith(f"{repo}@sha256:") for d in got["RepoDigests"]), got["RepoDigests"]
        return
    assert got["Id"] == image_id and f"{got['Os']}/{got['Architecture']}" == platform
    assert f"{repo}@{digests[platform]}" in got["RepoDigests"], got["RepoDigests"]
    assert not any(f"{repo}@{d}" in got["RepoDigests"] for d in others)


def served_list(ref: str) -> requests.Response:
    """GET of `ref` on the test registry (with its login), asking for a list (an index)."""
    from imagefactory.engine.registry import INDEX_TYPES

    repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
    return requests.get(f"http://{TEST_REGISTRY}/v2/{repo}/manifests/{tag}", auth=(TEST_USER, TEST_PASSWORD),
                        headers={"Accept": ", ".join(INDEX_TYPES)}, timeout=10)


# --------------------------------------------------------------------------- registries

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    """A throwaway CNCF distribution registry on loopback, started and stopped by a test."""

    def __init__(self, root: Path):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        config = root / "config.yml"
        config.write_text(textwrap.dedent(f"""
            version: 0.1
            storage:
              filesystem: {{rootdirectory: {root / 'data'}}}
              delete: {{enabled: true}}
            http: {{addr: {self.address}}}
        """))
        self.config = config
        self.data = root / "data"
        self.start()

    def start(self) -> None:
        exe = shutil.which("docker-registry")
        if exe is None:
            unavailable("docker-registry is not installed")
        self.proc = subprocess.Popen([exe, "serve", str(self.config)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        for _ in range(100):
            try:
                requests.get(f"http://{self.address}/v2/", timeout=1)
                return
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError("the throwaway registry did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def receiving(self) -> bool:
        """Whether an upload has started (the registry keeps partial uploads under _uploads)."""
        return any(p.name == "_uploads" for p in self.data.rglob("_uploads"))


def registry_tags(registry: str, repo: str, auth=(TEST_USER, TEST_PASSWORD)) -> list[str]:
    r = requests.get(f"http://{registry}/v2/{repo}/tags/list", auth=auth, timeout=10)
    if r.status_code == 404:
        return []
    r.raise_for_status()
    return sorted(r.json().get("tags") or [])


# Every media type a tag may name: an image's manifest (Docker's, or OCI's as the containerd image
# store pushes it) or a list (Docker's manifest list, OCI's index). A registry answers 404 for a
# tag whose manifest's type the request does not accept.
MANIFEST_TYPES = ("application/vnd.docker.distribution.manifest.v2+json", "application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.list.v2+json",
                  "application/vnd.oci.image.index.v1+json")


def registry_digest(registry: str, repo: str, tag: str, auth=(TEST_USER, TEST_PASSWORD)) -> str | None:
    r = requests.head(f"http://{registry}/v2/{repo}/manifests/{tag}", auth=auth, timeout=10, headers={
        "Accept": ", ".join(MANIFEST_TYPES)})
    return r.headers.get("Docker-Content-Digest") if r.status_code == 200 else None


def run_repositories(registry: str, run_id: str, auth=None) -> list[str]:
    """The repositories of `registry` whose name has `run_id` as a whole word (it-RUN/train,
    lists-RUN/x, ...): what a run pushed there, and nothing another run did."""
    word = re.compile(rf"(?:^|[-/]){re.escape(run_id)}(?:$|[-/])")
    repos: list[str] = []
    url: str | None = f"http://{registry}/v2/_catalog?n=1000"
    while url:  # the registry pages its answer (a Link header names the next page)
        r = requests.get(url, auth=auth, timeout=30)
        r.raise_for_status()
        repos += [repo for repo in r.json().get("repositories") or [] if word.search(repo)]
        following = r.links.get("next", {}).get("url")
        url = f"http://{registry}{following}" if following else None
    return sorted(repos)


def remove_run_pushes(run_id: str) -> int:
    """Delete the manifests of every tag in this run's repositories on both registries (their
    blobs are freed by the garbage collection scripts/ci-setup.sh runs before it starts a
    registry): each run pushed ~1.3 GB that no one removed, and CI runs on the same disk as the
    sessions before it. Returns how many manifests went."""
    deleted = 0
    for registry, auth in ((TEST_REGISTRY, (TEST_USER, TEST_PASSWORD)), (BASE_REGISTRY, None)):
        for repo in run_repositories(registry, run_id, auth):
            for tag in registry_tags(registry, repo, auth):
                digest = registry_digest(registry, repo, tag, auth)
                if digest and requests.delete(f"http://{registry}/v2/{repo}/manifests/{digest}", auth=auth,
                                              timeout=30).status_code == 202:
                    deleted += 1
    return deleted


# --------------------------------------------------------------------------- the shared build

class Build:
    """One real `imagefactory build` of a two-cell matrix, shared by the tests that inspect it:
    py3.11-cpu-openblas-pip builds and passes; py3.11-cpu-mkl-pip fails midway (its extra
    package does not exist)."""

    GOOD = "py3.11-cpu-openblas-pip"
    BAD = "py3.11-cpu-mkl-pip"
    MISSING_PACKAGE = "imagefactory-no-such-package-4b1d"

    def __init__(self, root: Path, image: str, wheelhouse: Path):
        self.root = root
        self.image = image
        self.wheelhouse = wheelhouse
        self.matrix = root / "matrix.yaml"
        self.matrix.write_text(self.text(image, wheelhouse))
        self.report_path = root / "report.json"
        self.work_dir = root / "work"

    @classmethod
    def text(cls, image: str, wheelhouse: Path) -> str:
        cells = """
            matrix:
              python: ["3.11"]
              cuda: ["none"]
              blas: [mkl, openblas]
              installer: [pip]
              include:
                - {blas: mkl, packages: [%s]}
        """ % cls.MISSING_PACKAGE
        text = matrix_text(image=image, wheelhouse=wheelhouse, cells=cells)
        # a pip + mkl cell needs an index that serves MKL NumPy; this one never gets that far.
        return text.replace("  torch_index_url: null\n",
                            "  torch_index_url: null\n  numpy_index_url: https://pypi.org/simple\n")

    def run(self, *args: str, env: dict | None = None, matrix: Path | None = None, default_builder: bool = False):
        return run_cli(*args, "--matrix", str(matrix or self.matrix), "--plain", "--report",
                       str(self.report_path), "--work-dir", str(self.work_dir), env=env,
                       default_builder=default_builder)

    def report(self) -> dict:
        return {c["cell"]: c for c in json.loads(self.report_path.read_text())["cells"]}

    def with_image(self, image: str) -> Path:
        """The same cells (same content hashes) published under another name."""
        path = self.root / f"matrix-{abs(hash(image))}.yaml"
        path.write_text(self.matrix.read_text().replace(f"image: {self.image}\n", f"image: {image}\n"))
        return path

    @property
    def good_image(self) -> str:
        return self.first_report[self.GOOD]["candidate"]


class Run:
    """`python -m imagefactory ARGS` in the background, its output read line by line."""

    def __init__(self, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "imagefactory", *pinned_builder(args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(env))
        self.lines: list[str] = []
        self.work = next((Path(v) for k, v in zip(args, args[1:]) if k == "--work-dir"), None)
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 600) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "exited early:\n" + "\n".join(self.lines[-40:])
                continue
            self.lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matched {pattern!r}:\n" + "\n".join(self.lines[-40:]))

    def stop(self, signum: int) -> tuple[int, float]:
        """Send `signum`; (exit code, seconds until the process ended)."""
        sent = time.monotonic()
        self.proc.send_signal(signum)
        try:
            code = self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        elapsed = time.monotonic() - sent
        time.sleep(0.5)
        self.note_leftovers()
        return code, elapsed

    def note_leftovers(self) -> None:
        """What the interrupted build had made (its finished steps) is this run's to remove."""
        if self.work is not None:
            LEFTOVERS.from_work_dir(self.work)

    def output(self) -> str:
        self.note_leftovers()
        while not self._queue.empty():
            self.lines.append(self._queue.get())
        return "\n".join(self.lines)


def report_of(path: Path) -> dict:
    return {c["cell"]: c for c in json.loads(path.read_text())["cells"]}


# --------------------------------------------------------------------------- BuildKit and a protected index

PACKAGE = "imagefactory-netrc-probe"  # served only by the password-protected index
INDEX_USER = "ci-index"


def buildx_or_skip() -> None:
    from imagefactory.engine import buildkit

    version, why = buildkit.buildx_version()
    if version is None:
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI must provide it: scripts/ci-setup.sh installs buildx)")
        pytest.skip(f"{why}; run `sudo bash scripts/ci-setup.sh` first")


def make_wheel(folder: Path) -> Path:
    """A tiny pure-Python wheel, written by hand (no build backend needed)."""
    name, version = PACKAGE.replace("-", "_"), "1.0"
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": b"VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: imagefactory-tests\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = [f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b'=').decode()},{len(v)}"
              for k, v in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


@dataclass
class Index:
    """A password-protected package index on loopback (pypiserver; conftest's auth_index)."""

    url: str
    password: str


def index_matrix(root: Path, wheelhouse: Path, index_url: str, session_id: str) -> Path:
    """The shared pip CPU cell plus PACKAGE, which only the index at `index_url` serves."""
    cells = f"""
        matrix:
          python: ["3.11"]
          cuda: ["none"]
          blas: [openblas]
          installer: [pip]
          include:
            - {{blas: openblas, packages: [{PACKAGE}]}}
    """
    text = matrix_text(image=f"{TEST_REGISTRY}/it-{session_id}/buildkit", wheelhouse=wheelhouse, cells=cells)
    text = text.replace("  torch_index_url: null\n", f"  torch_index_url: null\n  extra_index_urls: [\"{index_url}\"]\n")
    path = root / "matrix.yaml"
    path.write_text(text)
    return path


@dataclass
class BkBuild:
    """The session's cold BuildKit build (conftest's bk_build)."""

    root: Path
    matrix: Path
    netrc: Path
    result: subprocess.CompletedProcess
    report_path: Path
    work_dir: Path

    def report(self) -> dict:
        return report_of(self.report_path)


def buildkit_steps(log: str) -> dict[str, bool]:
    """Each Dockerfile step of a BuildKit log (`#N [stage k/n] INSTRUCTION[ CACHED]`) -> cached."""
    found = {}
    for m in re.finditer(r"^#\d+ (\[[^\]]*\d+/\d+\] .*?)( CACHED)?$", log, re.M):
        found[m[1]] = found.get(m[1], False) or bool(m[2])
    return found


def buildkit_args(root: Path, matrix: Path, *extra: str) -> list[str]:
    """`imagefactory build --builder buildkit` of `matrix`, with its report and work dir under `root`."""
    return ["build", "--builder", "buildkit", "--plain", "--gpus", "none", "--matrix", str(matrix),
            "--report", str(root / "report.json"), "--work-dir", str(root / "work"), *extra]


# --------------------------------------------------------------------------- a cold second engine

CURRENT_BIN = Path("/opt/imagefactory/engine-current/bin")
CONTAINERD_SOCK = Path("/run/imagefactory-engine/containerd/containerd.sock")


@contextlib.contextmanager
def cold_engine():
    """A throwaway dockerd beside the current one (the same binaries and containerd, a namespace
    and data root of its own): no image, no build cache. Yields its DOCKER_HOST; removed after."""
    if not (CURRENT_BIN / "dockerd").exists() or not CONTAINERD_SOCK.exists():
        unavailable("the current engine (Debian 13's dockerd and its containerd) is not running")
    name = f"ifl{RUN_ID}"
    root = Path(tempfile.mkdtemp(prefix="imagefactory-cold-", dir="/var/lib"))
    run = Path(f"/run/{name}")  # short: a unix socket path has a length limit
    run.mkdir()
    (run / "daemon.json").write_text('{"features": {"containerd-snapshotter": true}}\n')
    host = f"unix://{run}/docker.sock"
    env = dict(os.environ, PATH=f"{CURRENT_BIN}:{os.environ['PATH']}")
    log = open(run / "log", "wb")
    proc = subprocess.Popen([str(CURRENT_BIN / "dockerd"), "--config-file", str(run / "daemon.json"),
                             "--containerd", str(CONTAINERD_SOCK), "-H", host, "--data-root", str(root),
                             "--exec-root", str(run / "exec"), "--pidfile", str(run / "dockerd.pid"),
                             "--containerd-namespace", name, "--containerd-plugins-namespace", f"{name}-plugins",
                             "--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        for _ in range(120):
            if subprocess.run(["docker", "-H", host, "version"], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the cold engine did not answer: {(run / 'log').read_text()[-2000:]}")
        yield host
    finally:
        # its images and build cache live in the shared containerd: pruned through it, or they stay
        subprocess.run(["docker", "-H", host, "system", "prune", "-af"], capture_output=True, timeout=300)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        subprocess.run(["umount", str(run / "exec" / "netns" / "default")], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)


def image_layers(image_id: str, host: str | None = None) -> list[tuple[str, int, str]]:
    """(diff id, size in bytes, step) of each layer of `image_id`, oldest first (sizes from the history)."""
    cli = ["docker"] + (["-H", host] if host else [])
    diff_ids = json.loads(subprocess.run(cli + ["image", "inspect", image_id, "--format", "{{json .RootFS.Layers}}"],
                                         capture_output=True, text=True, check=True).stdout)
    rows = subprocess.run(cli + ["history", "--no-trunc", "--format", "{{json .}}", image_id],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    steps = [json.loads(r) for r in reversed(rows)]
    sized = [s for s in steps if not s["CreatedBy"].startswith(("ENV", "LABEL", "USER", "CMD", "ENTRYPOINT",
                                                                 "SHELL", "ARG"))]
    return [(d, size_bytes(s["Size"]), s["CreatedBy"][:90]) for d, s in zip(diff_ids, sized[-len(diff_ids):])]


def size_bytes(size: str) -> int:
    units = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}
    for unit in ("kB", "MB", "GB", "B"):
        if size.endswith(unit):
            return int(float(size[:-len(unit)]) * units[unit])
    return 0


# --------------------------------------------------------------------------- the conda test channel

NO_CONDA_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"  # the host's tools, and no conda anywhere on it

def channel_matrix_text(info, server, *, image: str, labels: dict[str, str], blas: str = "[mkl, openblas]",
                        sha256: str | None = None, channels: list[str] | None = None) -> str:
    """A conda CPU matrix on the test channel (tests/conda_channel, served by `server`): its
    installer, its torch, `compiler: false`, the host's CA files where it has any."""
    text = textwrap.dedent(f"""\
        image: {image}
        matrix:
          python: ["3.11"]
          cuda: ["none"]
          blas: {blas}
          installer: [conda]
        torch: "{info.torch}"
        threads: 2
        compiler: false
        base_registry: {BASE_REGISTRY}
        conda:
          version: "0.1.0-0"
          sha256: {sha256 or info.installer_sha256}
          installer_url: {info.installer_url(server.url)}
          channels: {json.dumps(channels or [info.channel_url(server.url)])}
        labels: {json.dumps(labels)}
    """)
    return text + (f"ca_certificates: {json.dumps(HOST_CAS)}\n" if HOST_CAS else "")
