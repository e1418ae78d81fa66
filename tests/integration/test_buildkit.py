"""issue 16: BuildKit builds through `docker buildx build`, the package caches as cache mounts, and an
index login that reaches the build only as a secret.

One cold BuildKit build per session (`bk_build`, the shared pip CPU cell plus one small package from
a real password-protected index on loopback); every other test here derives from it or stops early.
BuildKit does not share the classic builder's layer cache, so that build is cold (~4 min here).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.integration.helpers import TEST_REGISTRY, Run, free_port, matrix_text, report_of, run_cli

pytestmark = [pytest.mark.docker]

CELL = "py3.11-cpu-openblas-pip"
PACKAGE = "imagefactory-netrc-probe"
USER = "ci-index"


def _buildx_or_skip() -> None:
    from imagefactory import buildkit

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
    url: str
    password: str
    proc: subprocess.Popen


@pytest.fixture(scope="session")
def auth_index(tmp_path_factory):
    """pypiserver on loopback with basic auth for every download and listing."""
    pytest.importorskip("pypiserver")
    from passlib.apache import HtpasswdFile

    root = tmp_path_factory.mktemp("auth-index")
    (root / "packages").mkdir()
    make_wheel(root / "packages")
    password = f"nEtrc-{uuid.uuid4().hex}"
    htpasswd = HtpasswdFile(str(root / "htpasswd"), new=True)
    htpasswd.set_password(USER, password)
    htpasswd.save()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pypiserver", "run", "-p", str(port), "-i", "127.0.0.1",
                             "-P", str(root / "htpasswd"), "-a", "download,list,update", str(root / "packages")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/simple/"
    for _ in range(100):
        try:
            if requests.get(url, timeout=1).status_code == 401:
                break
        except requests.RequestException:
            pass
        time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("pypiserver did not start")
    assert requests.get(url + PACKAGE + "/", auth=(USER, password), timeout=5).status_code == 200
    yield Index(url, password, proc)
    proc.kill()
    proc.wait(timeout=10)


def index_matrix(root: Path, wheelhouse: Path, index_url: str, session_id: str) -> Path:
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
    root: Path
    matrix: Path
    netrc: Path
    result: subprocess.CompletedProcess
    report_path: Path
    work_dir: Path

    def report(self) -> dict:
        return report_of(self.report_path)


def build_args(root: Path, matrix: Path, *extra: str) -> list[str]:
    return ["build", "--builder", "buildkit", "--plain", "--gpus", "none", "--matrix", str(matrix),
            "--report", str(root / "report.json"), "--work-dir", str(root / "work"), *extra]


@pytest.fixture(scope="session")
def bk_build(cpu_build, tmp_path_factory, engine, base_registry, wheelhouse, session_id, auth_index,
             created_images) -> BkBuild:
    """THE cold BuildKit build of the session: the shared pip CPU cell plus PACKAGE from the
    password-protected index, its login given as a netrc. After cpu_build (the classic build of
    the same cell, which the suite makes anyway): that fixture first removes every image of its
    cells, this one's included."""
    _buildx_or_skip()
    root = tmp_path_factory.mktemp("bk-build")
    matrix = index_matrix(root, wheelhouse, auth_index.url, session_id)
    netrc = root / "netrc"
    netrc.write_text(f"machine 127.0.0.1\n  login {USER}\n  password {auth_index.password}\n")
    netrc.chmod(0o600)
    result = run_cli(*build_args(root, matrix, "--netrc", str(netrc)), env={"HOME": str(root)}, timeout=1500)
    build = BkBuild(root, matrix, netrc, result, root / "report.json", root / "work")
    assert build.report_path.exists(), result.stdout[-2000:] + result.stderr[-3000:]
    for cell in build.report().values():
        if cell["candidate"]:
            created_images.append(cell["candidate"])
    return build


def test_buildkit_build_installs_from_the_protected_index_and_passes(bk_build):
    cell = bk_build.report()[CELL]
    assert bk_build.result.returncode == 0, bk_build.result.stderr[-3000:]
    assert cell["status"] == "passed" and cell["builder"] == "buildkit", cell
    log = Path(cell["log"]).read_text()
    assert "[venv " in log and "Successfully installed" in log and PACKAGE in log
    dockerfile = (bk_build.work_dir / "contexts" / CELL / "Dockerfile").read_text()
    assert "--mount=type=cache,id=imagefactory-pip" in dockerfile and "--mount=type=secret,id=netrc" in dockerfile


def _scan_stream(chunks, needle: bytes) -> bool:
    tail = b""
    for chunk in chunks:
        window = tail + chunk
        if needle in window:
            return True
        tail = window[-len(needle):]
    return False


def test_the_password_is_in_no_layer_history_config_context_log_or_report(bk_build, engine, auth_index):
    cell = bk_build.report()[CELL]
    needle = auth_index.password.encode()
    image = engine.client.images.get(cell["image_id"])
    assert not _scan_stream(image.save(chunk_size=4 << 20), needle), "the password is in a layer"
    assert auth_index.password not in json.dumps(engine.client.api.history(cell["image_id"]))
    assert auth_index.password not in json.dumps(engine.client.api.inspect_image(cell["image_id"]))
    places = [bk_build.report_path, bk_build.report_path.with_suffix(".md"), Path(cell["log"]),
              *(p for p in (bk_build.work_dir / "contexts").rglob("*") if p.is_file())]
    for path in places:
        assert needle not in path.read_bytes(), path
    assert auth_index.password not in bk_build.result.stdout + bk_build.result.stderr


def test_cache_mounts_leave_nothing_in_the_image(bk_build, engine, cpu_build):
    """Same size as the classic build of the same cell, within 2% (PACKAGE is a few hundred bytes)."""
    built = engine.client.images.get(bk_build.report()[CELL]["image_id"]).attrs["Size"]
    classic = engine.client.images.get(cpu_build.first_report[CELL]["image_id"]).attrs["Size"]
    assert abs(built - classic) / classic < 0.02, (built, classic)


def test_without_the_netrc_the_build_fails_naming_the_index_and_the_401(bk_build, tmp_path, auth_index):
    result = run_cli(*build_args(tmp_path, bk_build.matrix), env={"HOME": str(tmp_path)}, timeout=900)
    assert result.returncode == 1, result.stderr[-3000:]
    cell = report_of(tmp_path / "report.json")[CELL]
    assert cell["status"] == "build-failed" and cell["builder"] == "buildkit"
    assert auth_index.url in cell["error"] and "401" in cell["error"], cell["error"]
    assert auth_index.password not in cell["error"]


class Silent:
    """A TCP server on loopback that accepts connections and never answers: a pip install that
    asks it for an index page hangs there."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def _processes_naming(text: str) -> list[str]:
    """The command lines (every process on the host: a build step's too) that contain `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name == str(os.getpid()):
            continue
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in line:
            found.append(f"{entry.name} {line[:300]}")
    return found


def test_sigint_stops_buildx_and_its_build_within_seconds(tmp_path, base_registry, wheelhouse, session_id):
    _buildx_or_skip()
    silent = Silent()
    try:
        matrix = index_matrix(tmp_path, wheelhouse, f"http://127.0.0.1:{silent.port}/simple/", session_id)
        report = tmp_path / "report.json"
        run = Run(*build_args(tmp_path, matrix))
        run.wait_for(r"\[venv \d+/\d+\] RUN --mount=type=cache")
        deadline = time.monotonic() + 120
        while not silent.held and time.monotonic() < deadline:  # pip is now waiting on the silent index
            time.sleep(0.2)
        assert silent.held, run.output()
        assert _processes_naming(f"127.0.0.1:{silent.port}"), "no pip process asks the silent index:\n" + "\n".join(
            _processes_naming("pip")) + "\n" + run.output()[-3000:]
        code, elapsed = run.stop(signal.SIGINT)
        assert code == 130, run.output()
        assert elapsed < 15, f"took {elapsed:.1f}s to stop"
        cell = report_of(report)[CELL]
        assert cell["status"] == "interrupted" and cell["builder"] == "buildkit"
        for _ in range(50):  # the build in the engine ends with buildx's session
            if not _processes_naming(f"127.0.0.1:{silent.port}"):
                break
            time.sleep(0.2)
        assert _processes_naming(f"127.0.0.1:{silent.port}") == [], "the build's pip still runs"
        assert [p for p in _processes_naming("buildx build") if str(tmp_path) in p] == []
    finally:
        silent.close()
