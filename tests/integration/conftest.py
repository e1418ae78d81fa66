"""Real Docker engine, real registries, real images: the session fixtures.

.ci/run (scripts/ci-setup.sh) starts the engine, the base-image registry on
127.0.0.1:5000 and the authenticated test registry on 127.0.0.1:5001. Without
them these tests fail in CI (CI=true) and are skipped locally with the command
to run. Helpers shared by the test modules are in helpers.py.

Cost: every cold build costs minutes on a 2-core CI machine, so the heavy image is built
once per run (cpu_build) and modules derive what they need from it: cells that differ
only in runtime settings (labels, env, threads) share every heavy layer, and a fixture
Dockerfile FROM the shared image builds in seconds.

Scope: everything the run builds carries its own label (helpers.RUN_LABEL) and is removed
by that label at the end, with the dangling stage images its builds left (their ids come
from the build streams); nothing another run on the same engine made is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from imagefactory.engine.docker import Engine
from imagefactory.errors import DockerUnavailable
from tests.integration import services
from tests.integration.helpers import (
    BASE_REGISTRY, CACHE, FIXTURES, INDEX_USER, PACKAGE, Background, BkBuild, DyingPush, Index, LEFTOVERS, Leftovers, ModuleImages, RUN_ID, RUN_LABEL, RUN_STARTED,
    TEST_PASSWORD, TEST_REGISTRY, TEST_USER, TORCH_CPU, Build, arm64_matrix_text, matrix_text, binfmt_or_unavailable, buildkit_args,
    buildx_or_skip, cuda_matrix_text, docker_cli, tiny_images,
    build_record_ids, index_matrix, prune_build_cache, remove_run_images, remove_run_pushes, run_cli,
    unavailable)


@pytest.fixture(scope="session")
def engine() -> Engine:
    try:
        return Engine()
    except DockerUnavailable as e:
        unavailable(str(e))


@pytest.fixture(scope="session")
def base_registry(engine) -> str:
    try:
        requests.get(f"http://{BASE_REGISTRY}/v2/", timeout=5).raise_for_status()
    except requests.RequestException as e:
        unavailable(f"no base-image registry at {BASE_REGISTRY}: {e}")
    return BASE_REGISTRY


@pytest.fixture(scope="session")
def service_files(tmp_path_factory) -> services.Files:
    """What the test services read (tests/integration/services.py), written for this session."""
    return services.write_files(tmp_path_factory.mktemp("services"))


@pytest.fixture(scope="session")
def docker_compose_file() -> str:
    return str(services.COMPOSE_FILE)


@pytest.fixture(scope="session")
def docker_compose_project_name() -> str:
    return f"imagefactory-test-{RUN_ID}"


@pytest.fixture(scope="session")
def docker_setup(engine, base_registry, service_files):
    """pytest-docker's `up`, once the services' images are here (built once per machine) and
    compose.yaml's variables name them and this session's files."""
    images = {name: services.image(engine.client, name) for name in ("registry", "index")}
    os.environ.update(service_files.env(images))
    return ["up -d"]


@pytest.fixture(scope="session", autouse=True)
def test_services(request, service_files):
    """The registry and the index of tests/services/compose.yaml, up and answering for the whole
    session (pytest-docker's docker_services; `down -v` removes them and their data after the
    session's last test). A session of unit tests alone, or with no engine, starts nothing."""
    if not any(item.nodeid.startswith("tests/integration/") for item in request.session.items):
        yield None
        return
    try:
        Engine().client.close()
    except DockerUnavailable as e:
        unavailable(str(e))
    try:
        docker_services = request.getfixturevalue("docker_services")
    except BaseException:  # pytest-docker downs only what came up: a half-started project goes here
        subprocess.run(["docker", "compose", "-f", str(services.COMPOSE_FILE), "-p", f"imagefactory-test-{RUN_ID}",
                        "down", "-v"], capture_output=True, timeout=300)
        raise

    def answers(url: str) -> bool:
        try:
            return requests.get(url, timeout=2).status_code == 401
        except requests.RequestException:
            return False

    for url in (f"http://{TEST_REGISTRY}/v2/", service_files.index_url):
        docker_services.wait_until_responsive(check=lambda url=url: answers(url), timeout=60.0, pause=0.2)
    yield docker_services


@pytest.fixture(scope="session")
def test_registry(engine, test_services) -> str:
    code = requests.get(f"http://{TEST_REGISTRY}/v2/", timeout=5).status_code
    assert code == 401, f"the test registry at {TEST_REGISTRY} must require authentication (got {code})"
    return TEST_REGISTRY


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """torch's CPU wheel, fetched once and kept between runs."""
    path = CACHE / "wheels"
    if not list(path.glob(f"torch-{TORCH_CPU}+cpu-*.whl")):
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(path),
                        f"torch=={TORCH_CPU}+cpu"], check=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def verdict_cache(tmp_path_factory):
    """The runs of a session share a verdict cache of their own, never the user's ~/.cache."""
    path = tmp_path_factory.mktemp("verdict-cache")
    before = os.environ.get("IMAGEFACTORY_CACHE_DIR")
    os.environ["IMAGEFACTORY_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("IMAGEFACTORY_CACHE_DIR", None)
    else:
        os.environ["IMAGEFACTORY_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def session_id() -> str:
    return RUN_ID


@pytest.fixture(scope="session")
def created_images(engine, tmp_path_factory):
    """Image references tests register for removal at the end of the session (with everything
    else this run built: see remove_run_images, and each step image its builds' logs name)."""
    refs: list[str] = []
    yield refs
    for background in (_Started.build, _Started.arm64):  # a session that ends before its test waited
        if background is not None:
            background.stop()
    if _Started.dying_push is not None:
        _Started.dying_push.stop()
    if os.environ.get("IMAGEFACTORY_TEST_KEEP_IMAGES") == "1":
        return
    # No engine-wide prune: another run on the same engine may be mid-build, and a classic
    # multi-stage build's earlier stage is a dangling image until the build ends.
    LEFTOVERS.from_tree(tmp_path_factory.getbasetemp())
    remove_run_images(engine.client, refs, RUN_ID, LEFTOVERS)
    try:
        remove_run_pushes(RUN_ID)
    except requests.RequestException:  # a registry a test stopped: its data stays, nothing else
        pass


@pytest.fixture(scope="session", autouse=True)
def run_build_cache():
    """The BuildKit records this session made, pruned as it ends, whichever tests it ran (a
    session of one module too, that never asked for created_images). Set up first, so it is torn
    down last: after the session's images are gone, when their records are no longer in use.
    The session's records are those the engine did not hold as it started (their dates do not
    tell: a layer of fixed time makes a record dated 1980)."""
    try:
        engine = Engine()
    except DockerUnavailable:  # no engine: nothing will be built on it
        yield
        return
    keep = build_record_ids(engine.client)
    yield
    try:
        if os.environ.get("IMAGEFACTORY_TEST_KEEP_IMAGES") != "1":
            prune_build_cache(engine.client, RUN_STARTED, keep)
    finally:
        engine.client.close()


@pytest.fixture(scope="module", autouse=True)
def module_images(request):
    """The module's own images (helpers.ModuleImages), removed as it ends."""
    since = time.time()
    images = ModuleImages(request.module.__name__)
    keep = None
    if images.prunes_build_cache:
        try:
            client = Engine().client
            keep = build_record_ids(client)
            client.close()
        except DockerUnavailable:  # its tests say why
            pass
    yield images
    if images.used and os.environ.get("IMAGEFACTORY_TEST_KEEP_IMAGES") != "1":
        import docker

        client = docker.from_env()
        try:
            images.remove(client, since, keep)
        finally:
            client.close()


def _build_mkl_numpy(client, tag: str) -> None:
    client.images.build(path=str(FIXTURES / "mkl-numpy"), tag=tag, rm=True, network_mode="host",
                        labels={RUN_LABEL: RUN_ID},
                        buildargs={"BASE": f"{BASE_REGISTRY}/library/python:3.11-slim-bookworm"})


@pytest.fixture(scope="session", autouse=True)
def mkl_numpy_start(request):
    """Start the MKL NumPy fixture's build with the session, in a thread, if a selected test
    uses it: it spends most of its time downloading MKL from Debian's mirror, which overlaps
    the shared build's CPU work. Without an engine nothing starts (the tests say why)."""
    if not any("mkl_numpy" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    try:
        client = Engine().client
    except DockerUnavailable:
        yield None
        return
    tag = f"imagefactory-test/mkl-numpy:{RUN_ID}"
    errors: list[BaseException] = []

    def build() -> None:
        try:
            _build_mkl_numpy(client, tag)
        except BaseException as e:  # handed to the test that needs it
            errors.append(e)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    yield thread, tag, errors
    thread.join(timeout=600)
    if os.environ.get("IMAGEFACTORY_TEST_KEEP_IMAGES") != "1":  # a session that failed before its test came
        import docker

        try:
            client.images.remove(tag, force=True)
        except docker.errors.APIError:  # removed with the session's images already, or never built
            pass


@pytest.fixture(scope="session")
def mkl_numpy(engine, base_registry, created_images, mkl_numpy_start) -> str:
    """tests/fixtures/mkl-numpy (Debian's NumPy on MKL), built once per session: its apt
    download is the slow part, and two modules judge it."""
    tag = f"imagefactory-test/mkl-numpy:{RUN_ID}"
    created_images.append(tag)
    if mkl_numpy_start is None:
        _build_mkl_numpy(engine.client, tag)
        return tag
    thread, tag, errors = mkl_numpy_start
    thread.join()
    if errors:
        raise errors[0]
    return tag


@pytest.fixture(scope="session")
def cpu_build(request, tmp_path_factory, engine, base_registry, wheelhouse, session_id, created_images) -> Build:
    """The shared image: the one cold pip CPU build of the run (py3.11-cpu-openblas-pip),
    beside a cell that fails midway. A real build, not a leftover: this run's label gives
    both cells content hashes no earlier run had (so nothing needs removing first)."""
    build = Build(tmp_path_factory.mktemp("cpu-build"), f"{TEST_REGISTRY}/it-{session_id}/train", wheelhouse)
    build.result = build.run("build")
    assert build.report_path.exists(), build.result.stdout[-2000:] + build.result.stderr[-2000:]
    build.first_report = build.report()
    # later runs in the same work dir rewrite the logs: keep this build's
    build.first_logs = {cell: Path(c["log"]).read_text() for cell, c in build.first_report.items() if c.get("log")}
    for cell in build.first_report.values():
        if cell["candidate"]:
            created_images.append(cell["candidate"])
    if any(item.name == CUDA_TEST for item in request.session.items):
        # The slow CUDA cell downloads ~3 GB: it builds beside the rest of the session, from
        # now on (its first steps are cache hits on this build's), and its test runs last.
        _start_cuda(tmp_path_factory, wheelhouse)
    if any("arm64_background" in getattr(item, "fixturenames", ()) for item in request.session.items):
        # The arm64 cell's emulated build and probes take ~10 minutes of one core: beside the rest too.
        # Without QEMU or buildx only the arm64 tests skip (or fail, in CI), when they ask for it.
        try:
            _start_arm64(tmp_path_factory, wheelhouse)
        except (pytest.skip.Exception, pytest.fail.Exception):
            pass
    return build


@pytest.fixture(scope="session")
def derive(engine, created_images):
    """Build tests/fixtures/<name> FROM `base` (a few seconds: one or two small layers on top
    of an image already here); returns the tag."""

    def make(name: str, base: str, tag: str | None = None, **buildargs: str) -> str:
        tag = tag or f"imagefactory-test/{name}:{RUN_ID}-{abs(hash((base, tuple(sorted(buildargs.items()))))) % 10**8}"
        engine.client.images.build(path=str(FIXTURES / name), tag=tag, rm=True, network_mode="none",
                                   buildargs={"BASE": base, **buildargs})
        created_images.append(tag)
        return tag

    return make


CUDA_TEST = "test_pip_cuda_cell_builds_and_its_cuda_build_is_verified"
DYING_PUSH_TEST = "test_registry_dying_during_a_push_is_retried_and_nothing_is_reported_published"


BACKGROUNDS = ("cuda_background", "arm64_background")


def pytest_collection_modifyitems(items):
    """Tests that judge a background build run last: by then it has had the whole session."""
    items.sort(key=lambda item: any(b in getattr(item, "fixturenames", ()) for b in BACKGROUNDS))


class _Started:
    """The background CUDA build of this session, once started."""

    build: Background | None = None
    arm64: Background | None = None
    dying_push: DyingPush | None = None


def _start_dying_push(tmp_path_factory, build: Build) -> DyingPush:
    if _Started.dying_push is None:
        _Started.dying_push = DyingPush(tmp_path_factory.mktemp("dying-push"), build)
    return _Started.dying_push


@pytest.fixture(scope="session")
def dying_push(cpu_build, tmp_path_factory) -> DyingPush:
    """The push to a registry that dies mid-upload, started by bk_build (or now)."""
    return _start_dying_push(tmp_path_factory, cpu_build)


def _reclaim_cuda(build: Background) -> None:
    """The CUDA cell's image (~6 GB) and its venv stage (as much again), removed the moment its
    build ends: its test judges the report alone, and kept to the end of the session they
    filled CI's disk."""
    import docker

    client = docker.from_env()
    try:
        for cell in build.report() if build.report_path.exists() else []:
            if cell["candidate"]:
                try:
                    # noprune: its untagged parents up to the first step it made are cpu_build's (the
                    # final stage's SHELL step is the venv stage's too), and the containerd store
                    # removes a parent that still has children: pruned, they made every later classic
                    # build of the shared cell rebuild torch's step cold (198 s for test_digest_base).
                    # The steps it made itself are the stage leftovers below.
                    client.images.remove(cell["candidate"], force=True, noprune=True)
                except docker.errors.NotFound:
                    pass
        stage = Leftovers()
        stage.from_work_dir(build.root / "work")
        stage.remove(client)
    finally:
        client.close()


def _start_cuda(tmp_path_factory, wheels: Path) -> Background:
    if _Started.build is None:
        _Started.build = Background(tmp_path_factory.mktemp("cuda-build"), cuda_matrix_text(wheels), "--gpus", "none",
                                    on_exit=_reclaim_cuda)
    return _Started.build


@pytest.fixture(scope="session")
def cuda_background(engine, base_registry, tmp_path_factory, wheelhouse, created_images) -> Background:
    """The pip CUDA cell's build, started by cpu_build once the shared image is built (so
    that both do not race through their common steps: two builds of the same step at once
    leave two copies, and later builds pick either one as their cache), or now."""
    return _start_cuda(tmp_path_factory, wheelhouse)


@pytest.fixture
def logged_in(tmp_path) -> Path:
    """A Docker config of the test's own, logged in to the test registry (the machine's stays as it is)."""
    config = tmp_path / "docker-config"
    config.mkdir()
    docker_cli("login", "-u", TEST_USER, "--password-stdin", TEST_REGISTRY, config=config, stdin=TEST_PASSWORD)
    return config


@pytest.fixture(scope="module")
def tiny(module_images, request, tmp_path_factory) -> dict[str, str]:
    """helpers.tiny_images, made once per module that asks, as that module's own images."""
    name = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    return tiny_images(module_images, tmp_path_factory.mktemp("tiny"), name)


ARM64_MODULE = ModuleImages("tests.integration.test_platforms_arm64", build_cache=True)


def _start_arm64(tmp_path_factory, wheels: Path) -> Background:
    if _Started.arm64 is None:
        binfmt_or_unavailable()
        buildx_or_skip()
        text = arm64_matrix_text(wheels, f"{TEST_REGISTRY}/it-{RUN_ID}/multiarch", labels=ARM64_MODULE.labels)
        _Started.arm64 = Background(tmp_path_factory.mktemp("arm64-build"), text, "--builder", "buildkit",
                                    "--push", "--gpus", "none",
                                    env={"IMAGEFACTORY_REGISTRY_USER": TEST_USER,
                                         "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD})
    return _Started.arm64


@pytest.fixture(scope="session")
def arm64_background(engine, base_registry, test_registry, tmp_path_factory, wheelhouse, created_images) -> Background:
    """The two-platform build of test_platforms_arm64.py (an arm64 pip CPU cell under QEMU and
    the shared amd64 cell, with BuildKit, pushed as one list), started by cpu_build, or now."""
    return _start_arm64(tmp_path_factory, wheelhouse)


@pytest.fixture(scope="session")
def threads_auto(tmp_path_factory, cpu_build, wheelhouse, session_id, created_images) -> dict:
    """The report of cpu_build's good cell with `threads: auto`, built and probed once for the session
    (test_launch.py and test_train_fast.py judge the same image; each built its own copy before). Only
    the runtime layers differ from cpu_build's, so it builds in seconds from its layers."""
    root = tmp_path_factory.mktemp("threads-auto")
    text = matrix_text(image=f"{TEST_REGISTRY}/it-{session_id}/auto", wheelhouse=wheelhouse)
    assert "\nthreads: 2\n" in text
    (root / "matrix.yaml").write_text(text.replace("\nthreads: 2\n", "\nthreads: auto\n"))
    result = run_cli("build", "--matrix", str(root / "matrix.yaml"), "--plain", "--report", str(root / "report.json"),
                     "--work-dir", str(root / "w"))
    assert (root / "report.json").exists(), result.stdout[-3000:] + result.stderr[-3000:]
    [cell] = json.loads((root / "report.json").read_text())["cells"]
    if cell["candidate"]:
        created_images.append(cell["candidate"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {**cell, "matrix": str(root / "matrix.yaml")}


@pytest.fixture(scope="session")
def cpu_auto_image(threads_auto) -> tuple:
    """(cell, image) of threads_auto (tests/integration/test_launch.py)."""
    from imagefactory.config import matrix

    [cell] = matrix.load(Path(threads_auto["matrix"])).cells
    assert cell.threads == "auto"
    return cell, threads_auto["candidate"]


@pytest.fixture(scope="session")
def auth_index(test_services, service_files) -> Index:
    """The package index of tests/services/compose.yaml: pypiserver on loopback with basic auth
    for every download and listing, serving PACKAGE."""
    url, password = service_files.index_url, service_files.index_password
    assert requests.get(url + PACKAGE + "/", auth=(INDEX_USER, password), timeout=5).status_code == 200
    return Index(url, password)


@pytest.fixture(scope="session")
def bk_build(request, cpu_build, tmp_path_factory, engine, base_registry, wheelhouse, session_id, auth_index,
             created_images) -> BkBuild:
    """THE cold BuildKit build of the session: the shared pip CPU cell plus PACKAGE from the
    password-protected index, its login given as a netrc. BuildKit does not share the classic
    builder's layer cache, so this is the one cold build of its kind; test_buildkit inspects it,
    and test_registry_cache's BuildKit builds take its venv stage from BuildKit's cache."""
    buildx_or_skip()
    if any(item.name == DYING_PUSH_TEST for item in request.session.items):
        # its ~50 s of engine-side retries pass beside this build and the BuildKit tests, which
        # push nothing (test_build's would race it: one untags the shared image for a while)
        _start_dying_push(tmp_path_factory, cpu_build)
    root = tmp_path_factory.mktemp("bk-build")
    matrix = index_matrix(root, wheelhouse, auth_index.url, session_id)
    netrc = root / "netrc"
    netrc.write_text(f"machine 127.0.0.1\n  login {INDEX_USER}\n  password {auth_index.password}\n")
    netrc.chmod(0o600)
    result = run_cli(*buildkit_args(root, matrix, "--netrc", str(netrc)), env={"HOME": str(root)}, timeout=1500)
    build = BkBuild(root, matrix, netrc, result, root / "report.json", root / "work")
    assert build.report_path.exists(), result.stdout[-2000:] + result.stderr[-3000:]
    for cell in build.report().values():
        if cell["candidate"]:
            created_images.append(cell["candidate"])
    return build
