"""Real Docker engine, real registries, real images.

.ci/run (scripts/ci-setup.sh) starts the engine, the base-image registry on
127.0.0.1:5000 and the authenticated test registry on 127.0.0.1:5001. Without
them these tests fail in CI (CI=true) and are skipped locally with the command
to run.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import docker
import pytest
import requests

from imagefactory.engine import Engine
from imagefactory.errors import DockerUnavailable

BASE_REGISTRY = "127.0.0.1:5000"
TEST_REGISTRY = os.environ.get("IMAGEFACTORY_TEST_REGISTRY", "127.0.0.1:5001")
TEST_USER = os.environ.get("IMAGEFACTORY_TEST_REGISTRY_USER", "imagefactory")
TEST_PASSWORD = os.environ.get("IMAGEFACTORY_TEST_REGISTRY_PASSWORD", "ci-password")
CACHE = Path(os.environ.get("IMAGEFACTORY_CI_CACHE", Path.home() / ".cache" / "imagefactory-ci"))
TORCH_CPU = "2.13.0"
HOST_CAS = sorted(glob.glob("/usr/local/share/ca-certificates/*.crt"))


def _unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must provide it: .ci/run runs scripts/ci-setup.sh)")
    pytest.skip(f"{reason}; run `sudo bash scripts/ci-setup.sh` first")


@pytest.fixture(scope="session")
def engine() -> Engine:
    try:
        return Engine()
    except DockerUnavailable as e:
        _unavailable(str(e))


@pytest.fixture(scope="session")
def base_registry(engine) -> str:
    try:
        requests.get(f"http://{BASE_REGISTRY}/v2/", timeout=5).raise_for_status()
    except requests.RequestException as e:
        _unavailable(f"no base-image registry at {BASE_REGISTRY}: {e}")
    return BASE_REGISTRY


@pytest.fixture(scope="session")
def test_registry(engine) -> str:
    try:
        code = requests.get(f"http://{TEST_REGISTRY}/v2/", timeout=5).status_code
    except requests.RequestException as e:
        _unavailable(f"no test registry at {TEST_REGISTRY}: {e}")
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
    return uuid.uuid4().hex[:8]


def judged(cell):
    """A cell as tests about other checks judge it: without the torch.compile child (about
    10 s per probe here). test_train_fast's torch.compile tests judge cells as built."""
    from dataclasses import replace

    return replace(cell, compiler=False)


@pytest.fixture(scope="session")
def mkl_numpy(engine, base_registry, session_id, created_images) -> str:
    """tests/fixtures/mkl-numpy (Debian's NumPy on MKL), built once per session: its apt
    download is the slow part, and two modules judge it."""
    tag = f"imagefactory-test/mkl-numpy:{session_id}"
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "mkl-numpy"
    engine.client.images.build(path=str(fixture), tag=tag, rm=True, network_mode="host",
                               buildargs={"BASE": f"{base_registry}/library/python:3.11-slim-bookworm"})
    created_images.append(tag)
    return tag


@pytest.fixture(scope="session")
def created_images(engine):
    """Image references tests register for removal at the end of the session."""
    refs: list[str] = []
    yield refs
    if os.environ.get("IMAGEFACTORY_TEST_KEEP_IMAGES") == "1":
        return
    for ref in reversed(refs):
        try:
            engine.client.images.remove(ref, force=True)
        except docker.errors.APIError:
            pass
    # No engine-wide prune: another run on the same engine may be mid-build, and a classic
    # multi-stage build's earlier stage is a dangling image until the build ends.


def matrix_text(*, image: str, wheelhouse: Path, cells: str | None = None) -> str:
    """A pip-route matrix that builds here: base images from the local registry, torch's CPU
    wheel from the wheelhouse, the rest from PyPI through the proxy (whose CAs are added)."""
    cells = cells or """
        matrix:
          python: ["3.11"]
          cuda: ["none"]
          blas: [openblas]
          installer: [pip]
    """
    certs = json.dumps(HOST_CAS)
    text = textwrap.dedent(cells).strip() + "\n" + textwrap.dedent(f"""
        image: {image}
        torch: "{TORCH_CPU}"
        threads: 2
        base_registry: {BASE_REGISTRY}
        pip:
          torch_index_url: null
          wheelhouse: {wheelhouse}
    """).strip() + "\n"
    if HOST_CAS:
        text += f"ca_certificates: {certs}\n"
    return text


def run_cli(*args: str, env: dict | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    for key in ("IMAGEFACTORY_REGISTRY_USER", "IMAGEFACTORY_REGISTRY_PASSWORD"):
        if env is None or key not in env:
            full_env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "imagefactory", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


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
            _unavailable("docker-registry is not installed")
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


def registry_digest(registry: str, repo: str, tag: str, auth=(TEST_USER, TEST_PASSWORD)) -> str | None:
    r = requests.head(f"http://{registry}/v2/{repo}/manifests/{tag}", auth=auth, timeout=10, headers={
        "Accept": "application/vnd.docker.distribution.manifest.v2+json, "
                  "application/vnd.oci.image.manifest.v1+json"})
    return r.headers.get("Docker-Content-Digest") if r.status_code == 200 else None


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

    def run(self, *args: str, env: dict | None = None, matrix: Path | None = None):
        return run_cli(*args, "--matrix", str(matrix or self.matrix), "--plain", "--report",
                       str(self.report_path), "--work-dir", str(self.work_dir), env=env)

    def report(self) -> dict:
        return {c["cell"]: c for c in json.loads(self.report_path.read_text())["cells"]}

    def with_image(self, image: str) -> Path:
        """The same cells (same content hashes) published under another name."""
        path = self.root / f"matrix-{abs(hash(image))}.yaml"
        path.write_text(self.matrix.read_text().replace(f"image: {self.image}\n", f"image: {image}\n"))
        return path


@pytest.fixture(scope="session")
def cpu_build(tmp_path_factory, engine, base_registry, wheelhouse, session_id, created_images):
    from imagefactory import matrix, render

    build = Build(tmp_path_factory.mktemp("cpu-build"), f"{TEST_REGISTRY}/it-{session_id}/train", wheelhouse)
    # A real build, not a leftover: remove the images earlier runs made for these cells. (By
    # cell, not by content hash: the build's hash covers the base image's digest, which
    # only the build resolves.)
    for cell in matrix.load(build.matrix).cells:
        for image in engine.client.images.list(filters={"label": f"{render.LABEL_PREFIX}.cell={cell.id}"}):
            try:
                engine.client.images.remove(image.id, force=True)
            except docker.errors.APIError:
                pass  # already gone with another one, or in use by a running container
    build.result = build.run("build")
    assert build.report_path.exists(), build.result.stdout[-2000:] + build.result.stderr[-2000:]
    build.first_report = build.report()
    for cell in build.first_report.values():
        if cell["candidate"]:
            created_images.append(cell["candidate"])
    return build


@pytest.fixture(scope="session")
def cpu_auto_image(tmp_path_factory, engine, cpu_build, session_id, created_images) -> tuple:
    """(cell, image): cpu_build's good cell with `threads: auto`. Only the runtime layers differ, so
    it builds in seconds from cpu_build's layers (tests/integration/test_launch.py)."""
    from imagefactory import matrix, render

    root = tmp_path_factory.mktemp("cpu-auto")
    path = root / "matrix.yaml"
    path.write_text(cpu_build.matrix.read_text().replace("\nthreads: 2\n", "\nthreads: auto\n"))
    cell = matrix.load(path).cell(Build.GOOD)
    assert cell.threads == "auto"
    (ctx,) = render.render(matrix.load(path), root / "contexts", cells=[cell])
    tag = f"imagefactory-test/cpu-auto:{session_id}"
    engine.client.images.build(path=str(ctx.path), tag=tag, rm=True, network_mode="host")
    created_images.append(tag)
    return ctx.cell, tag
