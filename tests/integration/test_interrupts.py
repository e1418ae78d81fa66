"""issue: interrupts and engine faults. SIGINT / SIGTERM during build, test and push, and an engine
that goes away mid-build, on the real engine and registries.

Each test starts `python -m imagefactory` as a subprocess, waits (reading its --plain output and
asking the engine) until the phase it wants is under way, sends the signal, and then checks: the
exit code (130 / 143), that the process ended within 10 seconds, that the engine-side work it
started is gone, that the report marks the cell `interrupted`, and that no release tag reached
the registry.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import docker
import pytest

from imagefactory.pipeline import build
from imagefactory.config import matrix
from imagefactory.render import contexts
from imagefactory.config import tags
from imagefactory.engine.api import BuildRequest
from tests.integration.helpers import (BASE_REGISTRY, TEST_PASSWORD, TEST_REGISTRY, TEST_USER, Build,
                                      Registry, Run, matrix_text, registry_tags, report_of)

pytestmark = [pytest.mark.docker, pytest.mark.registry]

CREDS = {"IMAGEFACTORY_REGISTRY_USER": TEST_USER, "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD}
STOP_WITHIN = 10  # seconds from the signal to the exit


def gone(engine, container_id: str) -> bool:
    try:
        engine.client.containers.get(container_id)
    except docker.errors.NotFound:
        return True
    return False


@pytest.fixture
def own_wheelhouse(tmp_path, wheelhouse) -> Path:
    """The torch wheel (hard-linked) plus a wheel-named file unique to this test: the context
    differs from every other build's from the wheelhouse COPY on, so the venv step really runs."""
    path = tmp_path / "wheels"
    path.mkdir()
    for wheel in wheelhouse.glob("torch-*.whl"):
        try:
            os.link(wheel, path / wheel.name)
        except OSError:
            (path / wheel.name).write_bytes(wheel.read_bytes())
    (path / f"zz_interrupt_{os.urandom(6).hex()}-1.0-py3-none-any.whl").write_bytes(os.urandom(64))
    return path


def test_sigint_during_a_build(tmp_path, engine, base_registry, test_registry, own_wheelhouse, session_id):
    image = f"{TEST_REGISTRY}/it-{session_id}/interrupt-build"
    (tmp_path / "matrix.yaml").write_text(matrix_text(image=image, wheelhouse=own_wheelhouse))
    report = tmp_path / "report.json"
    run = Run("build", "--push", "--plain", "--matrix", str(tmp_path / "matrix.yaml"), "--report", str(report),
              "--work-dir", str(tmp_path / "work"), env=CREDS)
    run.wait_for(r"Step \d+/\d+ : RUN python3\.11 -m venv")
    container = run.wait_for(r" ---> Running in ([0-9a-f]{12,64})$")[1]
    time.sleep(2)  # well into pip install
    code, elapsed = run.stop(signal.SIGINT)
    assert code == 130, run.output()
    assert elapsed < STOP_WITHIN, f"took {elapsed:.1f}s to stop"
    assert gone(engine, container), "the build container is still there"
    cell = report_of(report)["py3.11-cpu-openblas-pip"]
    assert cell["status"] == "interrupted" and cell["publish"] == "not-published"
    assert registry_tags(TEST_REGISTRY, f"it-{session_id}/interrupt-build") == []
    assert "interrupted" in run.output()


def fake_cell_image(engine, tmp_path: Path, m, created_images) -> tuple[str, str]:
    """An image that find_built takes for the matrix's first cell (its content-hash label and
    candidate name) and whose `python` never returns: the probe hangs until it is stopped."""
    ctx = build.render_pinned(m, list(m.cells), tmp_path, engine, "missing")[0]  # as `imagefactory test` finds it
    context = tmp_path / "fake-image"
    context.mkdir()
    (context / "Dockerfile").write_text(
        f"FROM {BASE_REGISTRY}/library/debian:bookworm-slim\n"
        f'LABEL {contexts.HASH_LABEL}="{ctx.content_hash}"\n'
        "RUN printf '#!/bin/sh\\nexec sleep 600\\n' > /usr/local/bin/python && chmod 755 /usr/local/bin/python\n")
    candidate = tags.candidate(ctx.cell, ctx.content_hash)
    created_images.append(candidate)
    return engine.build(BuildRequest(str(context), candidate)), ctx.cell.id


def test_sigterm_during_the_smoke_test(tmp_path, engine, base_registry, own_wheelhouse, session_id,
                                       created_images):
    (tmp_path / "matrix.yaml").write_text(matrix_text(image=f"{TEST_REGISTRY}/it-{session_id}/interrupt-test",
                                                      wheelhouse=own_wheelhouse))
    image_id, cell_id = fake_cell_image(engine, tmp_path, matrix.load(tmp_path / "matrix.yaml"), created_images)
    report = tmp_path / "report.json"
    run = Run("test", "--plain", "--matrix", str(tmp_path / "matrix.yaml"), "--report", str(report),
              "--work-dir", str(tmp_path / "work"))
    run.wait_for(rf"\[{re.escape(cell_id)}\] testing")
    deadline = time.monotonic() + 60
    while not engine.client.containers.list(filters={"ancestor": image_id}) and time.monotonic() < deadline:
        time.sleep(0.2)
    probes = engine.client.containers.list(filters={"ancestor": image_id})
    assert probes, "the probe container never started"
    code, elapsed = run.stop(signal.SIGTERM)
    assert code == 143, run.output()
    assert elapsed < STOP_WITHIN, f"took {elapsed:.1f}s to stop"
    assert engine.client.containers.list(all=True, filters={"ancestor": image_id}) == []
    assert report_of(report)[cell_id]["status"] == "interrupted"


def test_sigint_during_a_push_then_the_next_run_resumes(cpu_build, tmp_path, engine, created_images):
    registry = Registry(tmp_path)
    try:
        image = f"{registry.address}/interrupted/train"
        repo = "interrupted/train"
        matrix_path = cpu_build.with_image(image)
        release = f"{image}:2.13.0-py3.11-cpu-openblas-pip"
        created_images.append(release)
        report = tmp_path / "report.json"
        args = ("build", "--push", "--only", Build.GOOD, "--plain", "--matrix", str(matrix_path),
                "--report", str(report), "--work-dir", str(cpu_build.work_dir))
        run = Run(*args)
        run.wait_for(r"passed")  # cached and tested: the push starts next
        deadline = time.monotonic() + 120
        while not registry.receiving() and run.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert registry.receiving(), "the push never reached the registry:\n" + run.output()
        code, elapsed = run.stop(signal.SIGINT)
        assert code == 130, run.output()
        assert elapsed < STOP_WITHIN, f"took {elapsed:.1f}s to stop"
        good = report_of(report)[Build.GOOD]
        created_images.extend(good["tags"])
        assert good["status"] == "passed" and good["publish"] == "interrupted"
        time.sleep(3)  # an upload the engine went on with would finish its manifest about now
        assert "2.13.0-py3.11-cpu-openblas-pip" not in registry_tags(registry.address, repo, auth=None)
        assert engine.image_id(release) is None, "the release tag was applied locally"

        again = Run(*args)
        code = again.proc.wait(timeout=900)
        good = report_of(report)[Build.GOOD]
        assert code == 0, again.output()
        assert good["cached"] and good["publish"] == "published"
        assert "2.13.0-py3.11-cpu-openblas-pip" in registry_tags(registry.address, repo, auth=None)
    finally:
        registry.stop()


class EngineProxy:
    """A unix socket that forwards to the Docker engine's. Stopping it is, for a run that uses it
    (DOCKER_HOST), the engine going away mid-run: open connections are cut and new ones refused,
    while the engine itself, which other tests share, keeps running."""

    def __init__(self, path: Path, target: str = "/var/run/docker.sock"):
        self.path, self.target = path, target
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(64)
        self.open: list[socket.socket] = []
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.target)
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopped = True
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone would not)
        except OSError:
            pass
        self.server.close()  # the socket file stays: a new connection is refused
        for s in self.open:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_an_engine_that_goes_away_mid_build_exits_3_with_a_report(tmp_path, engine, base_registry, own_wheelhouse,
                                                                   session_id):
    proxy = EngineProxy(tmp_path / "docker.sock")
    (tmp_path / "matrix.yaml").write_text(matrix_text(image=f"{TEST_REGISTRY}/it-{session_id}/engine-gone",
                                                      wheelhouse=own_wheelhouse))
    report = tmp_path / "report.json"
    run = Run("build", "--plain", "--gpus", "none", "--matrix", str(tmp_path / "matrix.yaml"), "--report",
              str(report), "--work-dir", str(tmp_path / "work"), env={"DOCKER_HOST": f"unix://{proxy.path}"})
    try:
        run.wait_for(r"Step \d+/\d+ : RUN python3\.11 -m venv")
        run.wait_for(r" ---> Running in ([0-9a-f]{12,64})$")
        proxy.stop()
        code = run.proc.wait(timeout=120)
    finally:
        proxy.stop()
        if run.proc.poll() is None:
            run.proc.kill()
    out = run.output()
    assert code == 3, out
    cell = report_of(report)["py3.11-cpu-openblas-pip"]
    assert cell["status"] == "build-failed" and "Docker engine" in cell["error"], cell["error"]
    assert "error: " in out and "Traceback" not in out
