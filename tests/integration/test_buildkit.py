"""issue 16: BuildKit builds through `docker buildx build`, the package caches as cache mounts, and an
index login that reaches the build only as a secret.

One cold BuildKit build per session (conftest's `bk_build`, the shared pip CPU cell plus one small
package from a real password-protected index on loopback); every other test here derives from it or
stops early. BuildKit does not share the classic builder's layer cache, so that build is cold.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.integration.helpers import PACKAGE, Run, buildkit_args, buildx_or_skip, index_matrix, report_of, run_cli

pytestmark = [pytest.mark.docker]

CELL = "py3.11-cpu-openblas-pip"


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
    result = run_cli(*buildkit_args(tmp_path, bk_build.matrix), env={"HOME": str(tmp_path)}, timeout=900)
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
    buildx_or_skip()
    silent = Silent()
    try:
        matrix = index_matrix(tmp_path, wheelhouse, f"http://127.0.0.1:{silent.port}/simple/", session_id)
        report = tmp_path / "report.json"
        run = Run(*buildkit_args(tmp_path, matrix))
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
