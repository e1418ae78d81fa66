"""The orchestration (build.py, smoke.py, publish.py, cli.py, engine.py's stream handling) on an
in-memory engine: each behaviour here was once broken by a one-line change no test caught.
The real-engine tests (tests/integration) cover the same paths against Docker."""

from __future__ import annotations

import io
import json
import re
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from imagefactory.files import fsutil
from imagefactory.engine import logins
from imagefactory.pipeline import build as build_mod
from imagefactory.cli import app
from imagefactory.engine import select as select_mod
from imagefactory.config import matrix as matrix_mod
from imagefactory.publish import push as push_mod
from imagefactory.render import contexts as contexts_mod
from imagefactory.engine.docker import Engine
from imagefactory.engine.api import BuildRequest
from imagefactory.errors import (BuildError, Cancelled, CellFailure, ConfigError, DockerUnavailable, EngineError,
                                 EngineGone, Interrupted)
from imagefactory.interrupt import Interrupt
from imagefactory.pipeline.progress import Plain
from imagefactory.run.results import BUILD_FAILED, CHECK_FAILED, INTERRUPTED, NOT_PUBLISHED, PASSED, PUBLISH_FAILED, PUBLISHED, SKIPPED
from tests.conftest import REPO
from tests.fake_engine import World
from tests.unit.helpers import CELL_A, CELL_B, TWO_PIP_CELLS, good_probe
from imagefactory.run.context import BuildOptions, PushOptions, RunContext
from imagefactory.engine.api import RunResult
from imagefactory.run.results import CACHED, NOT_BUILT
from tests.fake_engine import FakeEngine, Image
from imagefactory.pipeline import build
from imagefactory.pipeline import freshness
from imagefactory.config import matrix
from imagefactory.pipeline import schedule
from tests.unit.helpers import BASE_DIGESTS

MATRIX = TWO_PIP_CELLS
A, B = CELL_A, CELL_B
SECRET = "s3cret-Pa55word"


@pytest.fixture
def m(tmp_path):
    path = tmp_path / "matrix.yaml"
    path.write_text(MATRIX)
    return matrix_mod.load(path)


@pytest.fixture
def world(m) -> World:
    """Both cells build and pass unless a test says otherwise."""
    return World(probes={c.id: good_probe(c) for c in m.cells})


@pytest.fixture(autouse=True)
def no_credentials(monkeypatch):
    monkeypatch.delenv(logins.USER_ENV, raising=False)
    monkeypatch.delenv(logins.PASSWORD_ENV, raising=False)
    monkeypatch.delenv("GITHUB_SHA", raising=False)


def ui() -> Plain:
    return Plain(io.StringIO())


def run_build(m, world, tmp_path, **options):
    opts = BuildOptions(work_dir=tmp_path / "work", gpus="none", **options)
    return build_mod.build(m, list(m.cells), world.context(opts, ui()))


def run_publish(m, world, reports, the_ui=None, **options):
    opts = PushOptions(backoff=0, **options)
    push_mod.publish(m, reports, world.context(opts, the_ui or ui()))
    return {r.cell: r for r in reports}


def by_cell(outcome) -> dict:
    return {r.cell: r for r in outcome.reports}


def release(m, cell_id: str) -> str:
    return m.cell(cell_id).tags[0]


# -- build and test -------------------------------------------------------------------------------
def test_both_cells_build_and_pass_on_the_fake(m, world, tmp_path):
    reports = by_cell(run_build(m, world, tmp_path))
    assert {r.status for r in reports.values()} == {PASSED}
    assert world.ops("build") == [A, B]


def test_both_cells_pass_every_launch_mode_through_podman(m, world, tmp_path):
    """podman names an arbitrary UID after itself (the fake does as podman does); the hpc mode's
    expectation follows the engine, so the same images pass."""
    world.product = "podman"
    reports = by_cell(run_build(m, world, tmp_path))
    assert {r.status for r in reports.values()} == {PASSED}, [c for r in reports.values() for c in r.checks
                                                              if c.verdict == "fail"]
    assert all(r.launches == {"docker": "pass", "bare": "pass", "hpc": "pass"} for r in reports.values())


def test_fail_fast_skips_the_cells_after_a_failure(m, world, tmp_path):
    world.builds[A] = "error"
    reports = by_cell(run_build(m, world, tmp_path, fail_fast=True))
    assert reports[A].status == BUILD_FAILED and reports[B].status == SKIPPED
    assert world.ops("build") == [A]
    assert "fail-fast" in reports[B].error


def test_without_fail_fast_a_failure_does_not_stop_the_others(m, world, tmp_path):
    world.builds[A] = "error"
    reports = by_cell(run_build(m, world, tmp_path))
    assert reports[A].status == BUILD_FAILED and reports[B].status == PASSED
    assert reports[A].failed_step == "step 2/2: RUN pip install x"


def test_a_failing_cache_lookup_fails_each_cell_not_the_run(m, world, tmp_path):
    world.label_lookup_fails = True
    outcome = run_build(m, world, tmp_path)
    assert {r.status for r in outcome.reports} == {BUILD_FAILED}
    assert all("could not list the local images" in r.error for r in outcome.reports)
    assert outcome.engine_gone is None


def test_an_engine_that_goes_away_is_reported_and_the_others_still_run(m, world, tmp_path):
    world.builds[A] = "gone"
    outcome = run_build(m, world, tmp_path)
    reports = by_cell(outcome)
    assert reports[A].status == BUILD_FAILED and "connection refused" in reports[A].error
    assert reports[B].status == PASSED
    assert outcome.engine_gone and "lost the Docker engine" in outcome.engine_gone


def test_a_probe_killed_at_its_timeout_fails_even_if_it_printed_a_good_report(m, world, tmp_path):
    world.probes[A] = ("timeout", good_probe(m.cell(A)))
    reports = by_cell(run_build(m, world, tmp_path, probe_timeout=5))
    assert reports[A].status == CHECK_FAILED
    ran = {c.name: c for c in reports[A].checks}["probe.ran"]
    assert ran.verdict == "fail" and "killed after 5 s" in ran.actual
    assert reports[B].status == PASSED


def test_a_probe_that_crashes_fails_its_cell(m, world, tmp_path):
    world.probes[A] = "crash"
    reports = by_cell(run_build(m, world, tmp_path))
    assert reports[A].status == CHECK_FAILED


def test_an_unchanged_cell_is_cached_not_rebuilt(m, world, tmp_path):
    run_build(m, world, tmp_path)
    reports = by_cell(run_build(m, world, tmp_path))
    assert reports[A].status == PASSED and reports[A].cached and world.ops("build") == [A, B]


def test_a_re_test_keeps_the_build_log(m, world, tmp_path):
    world.builds[A] = "error"
    build = by_cell(run_build(m, world, tmp_path))
    opts = BuildOptions(work_dir=tmp_path / "work", gpus="none")
    retest = by_cell(build_mod.test(m, list(m.cells), world.context(opts, ui())))
    assert retest[A].status == "not-built"
    assert re.search(r"Step 1/\d+ : FROM python:3\.11-slim-bookworm@", Path(build[A].log).read_text())


def test_the_tested_image_is_the_one_published_even_if_its_candidate_name_moves(m, world, tmp_path):
    """Another run that builds the same content re-points the candidate name: this run still
    publishes the image it tested."""
    reports = run_build(m, world, tmp_path).reports
    tested = {r.cell: r.image_id for r in reports}
    other = World(probes=world.probes, images=world.images, interrupt=Interrupt())
    for r in reports:  # a rebuild of the same content under the same candidate name
        other.engine().build(BuildRequest(str(tmp_path / "work" / "contexts" / r.cell), r.candidate))
    assert {world.image_by_ref(r.candidate).id for r in reports}.isdisjoint(tested.values())
    published = run_publish(m, world, reports)
    for cell, r in published.items():
        assert r.publish == PUBLISHED
        assert world.image_by_ref(release(m, cell)).id == tested[cell]


# -- publish ---------------------------------------------------------------------------------------
def test_a_cell_that_failed_its_checks_is_never_pushed(m, world, tmp_path):
    world.probes[A] = "crash"
    reports = run_publish(m, world, run_build(m, world, tmp_path).reports)
    assert reports[A].publish == NOT_PUBLISHED and reports[A].pushed == []
    assert reports[B].publish == PUBLISHED
    assert not [ref for ref in world.ops("push") if "py3.11" in ref]
    assert not [ref for _, ref in world.ops("tag") if ref.startswith("registry.example.com") and "py3.11" in ref]


def test_atomic_publishes_nothing_unless_every_cell_passed(m, world, tmp_path):
    world.probes[A] = "crash"
    reports = run_publish(m, world, run_build(m, world, tmp_path).reports, atomic=True)
    assert world.ops("push") == [] and {r.publish for r in reports.values()} == {NOT_PUBLISHED}
    assert "--atomic" in reports[B].error


def test_atomic_publishes_everything_when_every_cell_passed(m, world, tmp_path):
    reports = run_publish(m, world, run_build(m, world, tmp_path).reports, atomic=True)
    assert {r.publish for r in reports.values()} == {PUBLISHED}
    assert {release(m, A), release(m, B)} <= set(world.registry)


def test_the_immutable_tag_is_pushed_before_the_release_tag(m, world, tmp_path):
    run_publish(m, world, run_build(m, world, tmp_path).reports)
    pushed = [ref for ref in world.ops("push") if "py3.11" in ref or ":sha-" in ref]
    assert pushed[0].split(":")[-1].startswith("sha-") and pushed[1] == release(m, A)


def test_a_pushed_digest_the_registry_does_not_serve_is_a_failure(m, world, tmp_path):
    world.wrong_digest.add(release(m, A))
    reports = run_publish(m, world, run_build(m, world, tmp_path).reports)
    assert reports[A].publish == PUBLISH_FAILED and "the registry serves sha256:000" in reports[A].error
    assert reports[B].publish == PUBLISHED
    assert world.ops("registry_digest")  # asked of the registry, not taken from the push


def test_unauthorized_is_not_retried_and_the_password_is_redacted(m, world, tmp_path, monkeypatch):
    monkeypatch.setenv(logins.USER_ENV, "ci")
    monkeypatch.setenv(logins.PASSWORD_ENV, SECRET)
    reports = run_build(m, world, tmp_path).reports
    immutable = push_mod.tags_for(m, A, reports[0].content_hash, PushOptions())[1]
    world.pushes[immutable] = ["unauthorized", "ok"]
    published = run_publish(m, world, reports)
    assert world.ops("push").count(immutable) == 1
    assert published[A].publish == PUBLISH_FAILED
    assert "unauthorized" in published[A].error and SECRET not in published[A].error and "***" in published[A].error


def test_transient_push_failures_are_retried_and_counted(m, world, tmp_path, monkeypatch):
    monkeypatch.setenv(logins.USER_ENV, "ci")
    monkeypatch.setenv(logins.PASSWORD_ENV, SECRET)
    reports = run_build(m, world, tmp_path).reports
    ref = release(m, A)
    world.pushes[ref] = ["transient", "transient", "ok"]
    the_ui = ui()
    published = run_publish(m, world, reports, the_ui=the_ui, attempts=4)
    assert world.ops("push").count(ref) == 3 and published[A].publish == PUBLISHED
    out = the_ui.stream.getvalue()
    assert "(try 1/4)" in out and "(try 2/4)" in out and "(try 3/4)" not in out
    assert SECRET not in out and "***" in out


def test_transient_failures_give_up_after_the_last_try(m, world, tmp_path):
    reports = run_build(m, world, tmp_path).reports
    ref = release(m, A)
    world.pushes[ref] = ["transient"] * 5
    published = run_publish(m, world, reports, attempts=3)
    assert world.ops("push").count(ref) == 3 and published[A].publish == PUBLISH_FAILED


def test_a_failed_publish_makes_the_run_fail(m, world, tmp_path):
    world.wrong_digest.add(release(m, A))
    outcome = run_build(m, world, tmp_path)
    run_publish(m, world, outcome.reports)
    with pytest.raises(CellFailure) as e:
        app._finish(outcome, tmp_path / "report.json", Interrupt())
    assert e.value.exit_code == 1 and A in e.value.message
    assert (tmp_path / "report.json").exists()


def test_an_image_that_is_not_pushed_reports_its_size_and_the_catalogue_shows_it(m, world, tmp_path, monkeypatch):
    """Without --push (the quickstart) each built image still has a size: the engine's store's,
    in report.json's `sizes` and on the catalogue's page; a cached image on a second run too."""
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    world.sizes.update({A: 1_234_000_000, B: 987_000_000})
    for run in ("built", "cached"):
        outcome = run_build(m, world, tmp_path)
        assert {r.status for r in outcome.reports} == {PASSED} and all(r.publish == "" for r in outcome.reports)
        assert {r.cached for r in outcome.reports} == {run == "cached"}
        app._finish(outcome, tmp_path / "report.json", Interrupt())
        doc = json.loads((tmp_path / "report.json").read_text())
        assert {c["cell"]: c["sizes"] for c in doc["cells"]} == {A: {"local": {"size": 1_234_000_000}},
                                                                 B: {"local": {"size": 987_000_000}}}, run
        page = (tmp_path / "report.html").read_text()
        assert "1.23 GB in the engine&#39;s store" in page and "987 MB in the engine&#39;s store" in page, run
    assert not world.ops("push")


def test_a_run_that_published_everything_succeeds(m, world, tmp_path, capsys):
    """_finish raises nothing (exit 0), and its report and summary say every cell passed and
    was published; the registry serves each release tag at the digest the report names."""
    outcome = run_build(m, world, tmp_path)
    run_publish(m, world, outcome.reports)
    app._finish(outcome, tmp_path / "report.json", Interrupt())
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["ok"] is True
    assert [(c["cell"], c["status"], c["publish"]) for c in doc["cells"]] == [(A, PASSED, PUBLISHED),
                                                                              (B, PASSED, PUBLISHED)]
    for c in doc["cells"]:
        ref = release(m, c["cell"])
        assert {p["ref"]: p["digest"] for p in c["pushed"]}[ref] == world.registry[ref]
    assert "2 cell(s): 2 passed/published" in capsys.readouterr().err


def test_a_lost_engine_exits_3_after_writing_the_report(m, world, tmp_path):
    world.builds[A] = "gone"
    outcome = run_build(m, world, tmp_path)
    with pytest.raises(DockerUnavailable) as e:
        app._finish(outcome, tmp_path / "report.json", Interrupt())
    assert e.value.exit_code == 3 and (tmp_path / "report.json").exists()


# -- interrupts -------------------------------------------------------------------------------------
def interrupt_when(world: World, running: str, signum: int = signal.SIGINT) -> threading.Thread:
    def watch() -> None:
        for _ in range(400):
            if running in world.running:
                world.interrupt.cancel(signum)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_an_interrupt_before_the_build_starts_marks_every_cell_and_still_says_whether_gpus_were_there(m, world,
                                                                                                    tmp_path):
    """Stopped while the bases are pinned (render raises Cancelled): no cell is built, each is
    reported interrupted, and the outcome's GPUs are what `--gpus auto` found (asked after the
    bases, build._run)."""
    world.gpus = True
    world.interrupt.cancel()
    opts = BuildOptions(work_dir=tmp_path / "work", gpus="auto")
    outcome = build_mod.build(m, list(m.cells), world.context(opts, ui()))
    assert {r.status for r in outcome.reports} == {INTERRUPTED} and len(outcome.reports) == 2
    assert all(r.error == "interrupted before the build started" for r in outcome.reports)
    assert outcome.gpus is True and world.ops("build") == []


def test_an_interrupt_during_a_build_marks_it_and_skips_the_rest(m, world, tmp_path):
    world.builds[A] = "hang"
    interrupt_when(world, f"build-{A}")
    outcome = run_build(m, world, tmp_path)
    reports = by_cell(outcome)
    assert reports[A].status == INTERRUPTED and reports[B].status == SKIPPED
    assert "interrupted" in reports[B].error and world.ops("build") == [A]
    with pytest.raises(Interrupted) as e:
        app._finish(outcome, tmp_path / "report.json", world.interrupt)
    assert e.value.exit_code == 130 and '"interrupted"' in (tmp_path / "report.json").read_text()


def test_an_interrupt_during_a_probe_marks_the_cell_interrupted_and_sigterm_exits_143(m, world, tmp_path):
    world.probes[B] = "hang"
    interrupt_when(world, f"probe-{B}", signal.SIGTERM)
    outcome = run_build(m, world, tmp_path)
    reports = by_cell(outcome)
    assert reports[B].status == INTERRUPTED and reports[A].status == PASSED
    with pytest.raises(Interrupted) as e:
        app._finish(outcome, tmp_path / "report.json", world.interrupt)
    assert e.value.exit_code == 143


def test_the_next_run_resumes_with_the_finished_cells_cached(m, world, tmp_path):
    world.probes[B] = "hang"
    interrupt_when(world, f"probe-{B}")
    run_build(m, world, tmp_path)
    world.interrupt = Interrupt()
    world.probes[B] = good_probe(m.cell(B))
    reports = by_cell(run_build(m, world, tmp_path))
    assert reports[A].cached and reports[A].status == PASSED and reports[B].status == PASSED
    assert world.ops("build") == [A, B]  # B's image was built before its probe was stopped


def test_an_interrupt_during_a_push_leaves_no_release_tag(m, world, tmp_path):
    reports = run_build(m, world, tmp_path).reports
    world.pushes[release(m, A)] = ["hang"]

    def hang_marker(op, arg):
        if op == "push" and arg == release(m, A):
            threading.Timer(0.1, world.interrupt.cancel).start()

    world.on_call = hang_marker
    published = run_publish(m, world, reports)
    assert published[A].publish == INTERRUPTED and published[B].publish == NOT_PUBLISHED
    assert release(m, A) not in world.registry and release(m, B) not in world.registry
    assert release(m, A) in world.ops("untag")
    assert world.image_by_ref(release(m, A)) is None  # the local release tag was taken back
    assert not [ref for ref in world.ops("push") if "py3.12" in ref]


def test_a_run_interrupted_before_publishing_publishes_nothing(m, world, tmp_path):
    reports = run_build(m, world, tmp_path).reports
    world.interrupt.cancel()
    published = run_publish(m, world, reports)
    assert world.ops("push") == [] and {r.publish for r in published.values()} == {NOT_PUBLISHED}


def test_a_stuck_worker_is_given_up_after_the_grace_period(m, tmp_path, monkeypatch):
    """A worker that ignores the interrupt does not hold the run: it is reported as interrupted."""
    monkeypatch.setattr(build_mod, "GRACE_SECONDS", 0.3)
    interrupt = Interrupt()
    release_worker = threading.Event()
    contexts = contexts_mod.render(m, tmp_path / "ctx")

    def stuck(index):
        interrupt.cancel()
        release_worker.wait(10)
        raise AssertionError("never reported")

    started = time.monotonic()
    reports = build_mod._pool(contexts, list(range(len(contexts))), stuck, 1, interrupt)
    release_worker.set()
    assert time.monotonic() - started < 5
    assert {r.status for r in reports} == {INTERRUPTED}


# -- engine.py's stream handling, on a fake SDK ---------------------------------------------------
class FakeAPI:
    def __init__(self, events, on_event=None):
        self.events, self.on_event = events, on_event or (lambda e: None)
        self.hooks: dict = {"response": []}
        self.removed: list[str] = []

    def build(self, **kwargs):
        for event in self.events:
            self.on_event(event)
            yield event

    def remove_container(self, container, force=False):
        self.removed.append(container)

    def inspect_image(self, ref):
        raise AssertionError("not used")


class FakeClient:
    def __init__(self, api):
        self.api = api

    def ping(self):
        return True

    def info(self):
        return {"Architecture": "x86_64"}  # the classic builder builds for the engine's own platform


def test_a_build_stream_error_event_fails_the_build():
    api = FakeAPI([{"stream": "Step 1/2 : FROM base\n"}, {"stream": "Step 2/2 : RUN false\n"},
                   {"stream": " ---> Running in 0123456789ab\n"},
                   {"error": "The command '/bin/sh -c false' returned a non-zero code: 1\n"},
                   {"aux": {"ID": "sha256:" + "1" * 64}}])
    with pytest.raises(BuildError) as e:
        Engine(FakeClient(api)).build(BuildRequest("/ctx", "x:1"))
    assert e.value.step == "step 2/2: RUN false"
    assert "non-zero code: 1" in e.value.message and e.value.log_tail[-1].startswith("ERROR:")


def test_a_clean_build_stream_returns_the_image_id():
    api = FakeAPI([{"stream": "Step 1/1 : FROM base\n"}, {"aux": {"ID": "sha256:" + "1" * 64}}])
    assert Engine(FakeClient(api)).build(BuildRequest("/ctx", "x:1")) == "sha256:" + "1" * 64


def test_an_interrupt_mid_build_kills_the_build_container_and_cancels():
    interrupt = Interrupt()

    def on_event(event):
        if "Running in" in event.get("stream", ""):
            interrupt.cancel()

    api = FakeAPI([{"stream": "Step 1/2 : RUN sleep 600\n"}, {"stream": " ---> Running in 0123456789ab\n"},
                   {"stream": "still going\n"}, {"aux": {"ID": "sha256:" + "1" * 64}}], on_event)
    with pytest.raises(Cancelled):
        Engine(FakeClient(api), interrupt=interrupt).build(BuildRequest("/ctx", "x:1"))
    assert api.removed == ["0123456789ab"]


class FailingImages:
    def __init__(self, error: Exception):
        self.error = error

    def list(self, **kwargs):
        raise self.error


class FakeClientWithImages(FakeClient):
    def __init__(self, api, error: Exception, alive: bool):
        super().__init__(api)
        self.images, self.alive = FailingImages(error), alive

    def ping(self):
        if getattr(self, "alive", True):
            return True
        raise requests.exceptions.ConnectionError("connection refused")


def test_an_sdk_error_in_the_cache_lookup_is_an_engine_error():
    import docker.errors

    client = FakeClientWithImages(FakeAPI([]), docker.errors.APIError("500 Server Error: boom"), alive=True)
    with pytest.raises(EngineError, match="could not list the local images") as e:
        Engine(client).images_with_label("k", "v")
    assert not isinstance(e.value, EngineGone)


def test_an_engine_that_stopped_answering_is_engine_gone():
    client = FakeClientWithImages(FakeAPI([]), requests.exceptions.ConnectionError("refused"), alive=True)
    engine = Engine(client)
    client.alive = False
    with pytest.raises(EngineGone) as e:
        engine.images_with_label("k", "v")
    assert e.value.exit_code == 3


def test_an_sdk_error_after_an_interrupt_is_a_cancellation():
    client = FakeClientWithImages(FakeAPI([]), requests.exceptions.ConnectionError("reset"), alive=True)
    interrupt = Interrupt()
    engine = Engine(client, interrupt=interrupt)
    interrupt.cancel()
    with pytest.raises(Cancelled):
        engine.images_with_label("k", "v")


# -- checked before anything is built ----------------------------------------------------------------
def _cli(*args, env=None, cwd=REPO):
    full = {k: v for k, v in os.environ.items()
            if k not in (logins.USER_ENV, logins.PASSWORD_ENV, "GITHUB_SHA")}
    return subprocess.run([sys.executable, "-m", "imagefactory", *args], capture_output=True, text=True,
                          cwd=cwd, env={**full, "PYTHONPATH": str(REPO), **(env or {})}, timeout=120)


@pytest.mark.parametrize("variable", [logins.USER_ENV, logins.PASSWORD_ENV])
def test_half_the_credentials_stop_the_run_before_any_build(tmp_path, variable):
    (tmp_path / "matrix.yaml").write_text(MATRIX)
    r = _cli("build", "--push", "--plain", "--matrix", str(tmp_path / "matrix.yaml"), "--work-dir",
             str(tmp_path / "work"), "--report", str(tmp_path / "report.json"), env={variable: "x"})
    assert r.returncode == 2, r.stderr
    assert f"set both {logins.USER_ENV} and {logins.PASSWORD_ENV}" in r.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "report.json").exists()


def test_a_bad_github_sha_stops_the_run_before_any_build(tmp_path):
    (tmp_path / "matrix.yaml").write_text(MATRIX)
    r = _cli("push", "--plain", "--matrix", str(tmp_path / "matrix.yaml"), "--work-dir", str(tmp_path / "work"),
             env={"GITHUB_SHA": "deadbeef; rm -rf /"})
    assert r.returncode == 2 and "GITHUB_SHA" in r.stderr and not (tmp_path / "work").exists()


def test_a_second_run_on_the_same_work_dir_stops_at_once(tmp_path):
    (tmp_path / "matrix.yaml").write_text(MATRIX)
    work, report = tmp_path / "work", tmp_path / "report.json"
    with fsutil.locked(work, report):
        with pytest.raises(ConfigError, match="another imagefactory run"):
            with fsutil.locked(work, tmp_path / "other.json"):
                pass
        with pytest.raises(ConfigError, match="--report"):
            with fsutil.locked(tmp_path / "other-work", report):
                pass
        r = _cli("test", "--plain", "--matrix", str(tmp_path / "matrix.yaml"), "--work-dir", str(work),
                 "--report", str(tmp_path / "r2.json"))
        assert r.returncode == 2 and f"pid {os.getpid()}" in r.stderr, r.stderr
    with fsutil.locked(work, report):  # released with the run
        pass


# -- render and matrix rules the orchestration relies on ---------------------------------------------
def test_render_writes_nothing_unless_every_cell_renders(tmp_path):
    golden = REPO / "tests" / "golden"
    for sub in ("certs", "wheels"):
        (tmp_path / sub).mkdir()
        for f in (golden / sub).iterdir():
            (tmp_path / sub / f.name).write_bytes(f.read_bytes())
    (tmp_path / "matrix.yaml").write_text((golden / "matrix.yaml").read_text())
    m = matrix_mod.load(tmp_path / "matrix.yaml")
    out = tmp_path / "out"
    first = m.cells[0].id
    (out / first).mkdir(parents=True)
    (out / first / "old").write_text("kept")
    for f in (tmp_path / "wheels").iterdir():  # the pip cells cannot render any more
        f.unlink()
    (tmp_path / "wheels").rmdir()
    with pytest.raises(ConfigError, match="pip.wheelhouse: cannot be read"):  # exit 2, one line
        contexts_mod.render(m, out)
    assert sorted(p.name for p in out.iterdir()) == [first]
    assert [p.name for p in (out / first).iterdir()] == ["old"]


@pytest.mark.parametrize("where", ["env: {PATH: /tmp/evil}\n",
                                   "env: {VIRTUAL_ENV: /tmp/evil}\n"])
def test_env_cannot_override_what_the_cell_bakes(tmp_path, where):
    (tmp_path / "matrix.yaml").write_text(MATRIX + where)
    with pytest.raises(ConfigError) as e:
        matrix_mod.load(tmp_path / "matrix.yaml")
    assert "is set by imagefactory" in e.value.message


def test_signal_scope_ends_at_once_and_still_turns_a_signal_into_a_cancel():
    """Leaving the scope does not wait out a polling interval (every CLI run pays it), and
    a signal that arrived inside it cancels the run."""
    quiet = Interrupt()
    started = time.perf_counter()
    with quiet.signals():
        pass
    assert time.perf_counter() - started < 0.1
    assert not quiet.is_set()
    hit = Interrupt()
    with hit.signals():
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not hit.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert hit.is_set() and hit.signum == signal.SIGTERM


def test_sigterm_while_build_is_still_rendering_exits_143_with_a_report(m, tmp_path, monkeypatch, capsys):
    """The CLI owns the signals for the whole run: a SIGTERM that lands while `build` is
    rendering is a cancellation like any other (143, a report marking the cells), not a
    KeyboardInterrupt that skips the report (130)."""
    world = World(probes={c.id: good_probe(c) for c in m.cells})

    def engine(interrupt: Interrupt, **kwargs):  # the engines the CLI makes share its run's interrupt
        world.interrupt = interrupt
        return world.engine()

    monkeypatch.setattr(select_mod, "docker_engine", engine)
    real_render_cell = contexts_mod.render_cell

    def render_cell_then_sigterm(*args, **kwargs):
        ctx = real_render_cell(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs at once: before the next cell renders
        return ctx

    monkeypatch.setattr(contexts_mod, "render_cell", render_cell_then_sigterm)

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(app.os, "_exit", exit_now)
    report = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["imagefactory", "build", "--matrix", str(m.path), "--plain", "--gpus", "none",
                                      "--work-dir", str(tmp_path / "work"), "--report", str(report)])
    with pytest.raises(SystemExit) as e:
        app.main()
    assert e.value.code == 143, capsys.readouterr().err
    cells = {c["cell"]: c["status"] for c in json.loads(report.read_text())["cells"]}
    assert set(cells) == {A, B} and set(cells.values()) <= {INTERRUPTED, SKIPPED}
    assert world.ops("build") == []
    assert not [p for p in (tmp_path / "work" / "contexts").iterdir() if p.name.startswith(".render-")]


# -- moved from test_caught_mutants.py ----------------------------------------


def run(step, m, world, tmp_path, engine_factory=None, **options):
    opts = BuildOptions(work_dir=tmp_path / "work", gpus="none", **options)
    return step(m, list(m.cells), RunContext(opts, Plain(io.StringIO()), world.interrupt,
                                             engine_factory or world.engine))


def by_cell_CM(reports) -> dict:
    return {r.cell: r for r in reports}


def publish(m, world, reports, **options) -> dict:
    push_mod.publish(m, reports, world.context(PushOptions(backoff=0, **options), Plain(io.StringIO())))
    return by_cell_CM(reports)


def derive_from(world: World, image_id: str, name: str) -> Image:
    """What `FROM <cell image>` + one more layer gives: every label inherited, its own name."""
    parent = world.images[image_id]
    child = Image("sha256:" + "d" * 64, dict(parent.labels), {name}, cell=parent.cell)
    world.images[child.id] = child
    return child


def test_an_image_that_only_inherits_the_content_hash_label_is_not_reused(m, world, tmp_path):
    """Mutant: find_built() takes any image with the cell's content-hash label (README: it must
    also carry one of the cell's own names). A user's image built FROM the cell's image, left
    after the cell's own image was removed, was then tested, tagged and pushed as the release."""
    first = by_cell_CM(run(build_mod.build, m, world, tmp_path).reports)
    derived = derive_from(world, first[A].image_id, "someone/finetune:latest")
    assert derived.labels[contexts_mod.HASH_LABEL] == first[A].content_hash
    del world.images[first[A].image_id]  # `docker rmi` of the cell's own image

    assert build_mod.find_built(world.engine(), m, m.cell(A), first[A].content_hash) is None
    again = by_cell_CM(run(build_mod.build, m, world, tmp_path).reports)
    assert world.ops("build") == [A, B, A]  # rebuilt, not taken from the derived image
    assert again[A].status == PASSED and not again[A].cached and again[A].image_id != derived.id
    assert again[B].status == PASSED and again[B].cached and again[B].verdicts == CACHED
    published = publish(m, world, list(again.values()))
    assert published[A].publish == PUBLISHED
    assert world.image_by_ref(m.cell(A).tags[0]).id == again[A].image_id
    assert derived.tags == {"someone/finetune:latest"}  # never named as the release


def test_a_cached_cell_is_found_by_its_candidate_name_without_listing_every_image(m, world, tmp_path):
    """One inspect of the name an earlier run gave the cell's image, not a listing of every image
    with the label (on an engine of many images, the slow question). Mutant: the candidate's
    image taken whatever its content-hash label says."""
    from imagefactory.config import tags

    first = by_cell_CM(run(build_mod.build, m, world, tmp_path).reports)
    cell, content_hash = m.cell(A), first[A].content_hash
    candidate = tags.candidate(cell, content_hash)
    world.calls.clear()
    assert build_mod.find_built(world.engine(), m, cell, content_hash) == first[A].image_id
    assert world.ops("labelled_image") == [candidate] and world.ops("images_with_label") == []
    # the name moved to an image of other content (a user's `docker tag`): not this cell's image
    world.images[first[A].image_id].tags.discard(candidate)
    other = Image("sha256:" + "e" * 64, {contexts_mod.HASH_LABEL: "0" * 64}, {candidate}, cell=cell.id)
    world.images[other.id] = other
    assert build_mod.find_built(world.engine(), m, cell, content_hash) != other.id
    assert world.ops("images_with_label") == [content_hash]  # looked further, by the label


def test_test_and_push_find_nothing_built_when_only_a_derived_image_carries_the_label(m, world, tmp_path):
    first = by_cell_CM(run(build_mod.build, m, world, tmp_path).reports)
    derive_from(world, first[A].image_id, "someone/finetune:latest")
    del world.images[first[A].image_id]
    retest = by_cell_CM(run(build_mod.test, m, world, tmp_path).reports)
    assert retest[A].status == NOT_BUILT and retest[B].status == PASSED


@pytest.mark.parametrize("setup", ["build-error", "engine-gone", "push-of-an-unbuilt-cell"])
def test_atomic_publishes_nothing_when_a_build_fails(m, world, tmp_path, setup):
    """Mutant: --atomic counted only check failures. A cell whose BUILD failed (or, for `push
    --atomic`, was never built) let the others be pushed. (publish.py is right: any status
    but passed stops it.)"""
    world.builds[B] = "gone" if setup == "engine-gone" else "error"
    reports = run(build_mod.build, m, world, tmp_path).reports
    if setup == "push-of-an-unbuilt-cell":  # `imagefactory push --atomic` re-tests, then publishes
        reports = run(build_mod.test, m, world, tmp_path).reports
    assert [r.status for r in reports] == [PASSED, NOT_BUILT if setup.startswith("push") else BUILD_FAILED]
    published = publish(m, world, reports, atomic=True)
    assert world.ops("push") == [] and {r.publish for r in published.values()} == {NOT_PUBLISHED}
    assert not [ref for _, ref in world.ops("tag") if ref.startswith("registry.example.com")]
    assert f"--atomic and 1 cell(s) failed ({B})" in published[A].error
    # the same run without --atomic publishes the cell that passed
    assert publish(m, world, reports)[A].publish == PUBLISHED


class ProbeFails(FakeEngine):
    """The engine fails the probe's container (e.g. `could not create a container`)."""

    error: EngineError = EngineError("could not run a container of x: 500 Server Error: no space left")

    def run(self, image: str, command: list[str], *, timeout: float, gpus: bool = False,
            environment: dict[str, str] | None = None, cpus: float | None = None,
            options: dict | None = None, platform=None) -> RunResult:
        self.world.record("run", image)
        raise self.error


def test_a_probe_engine_error_fails_the_cell_with_that_error(m, world, tmp_path):
    """Mutant: the cell kept status `built` when the probe's container could not run. And the
    report gave no error for it: the engine's message was only in the probe.ran check."""
    outcome = run(build_mod.build, m, world, tmp_path, engine_factory=lambda: ProbeFails(world))
    for r in outcome.reports:
        assert r.status == CHECK_FAILED and not r.ok
        assert r.error == "the probe did not run: " + ProbeFails.error.message
        assert {c.name: c.verdict for c in r.checks} == {"probe.ran": "fail"}
    assert outcome.engine_gone is None
    # nothing was cached as passed: with the engine healthy again, the images are probed
    retest = by_cell_CM(run(build_mod.test, m, world, tmp_path).reports)
    assert {r.status for r in retest.values()} == {PASSED} and {r.verdicts for r in retest.values()} == {"probed"}


def test_an_engine_lost_during_the_probe_is_the_runs_error(m, world, tmp_path):
    class Gone(ProbeFails):
        error = EngineGone("could not run a container of x: the Docker engine stopped answering")

    outcome = run(build_mod.build, m, world, tmp_path, engine_factory=lambda: Gone(world))
    assert outcome.engine_gone == Gone.error.message  # exit 3, as for a build that loses it
    for r in outcome.reports:
        assert r.status == CHECK_FAILED and r.error == Gone.error.message


# -- moved from test_build_cache.py ----------------------------------------
# build.build/test with an in-memory engine: what is rebuilt, what is probed, in which order.
#
# The real-engine counterpart is tests/integration/test_freshness.py.


MATRIX_CACHE = TWO_PIP_CELLS.replace("registry.example.com/ml/train", "127.0.0.1:5001/it/fast")


BASES = BASE_DIGESTS


@pytest.fixture
def setup(tmp_path, write_matrix):
    m = matrix.load(write_matrix(MATRIX_CACHE))
    engine = World(probes={c.id: good_probe(c, cpus=2) for c in m.cells}, registry=dict(BASES))

    def run(work="w1", command=build.build, **options):
        engine.calls.clear()
        opts = BuildOptions(work_dir=tmp_path / work, verdicts_dir=tmp_path / "cache", **options)
        reports = command(m, list(m.cells), engine.context(opts)).reports
        return {r.cell: r for r in reports}

    return m, engine, run


def test_unchanged_matrix_is_neither_rebuilt_nor_probed(setup):
    m, engine, run = setup
    first = run()
    assert engine.count("build") == engine.count("probe") == sorted(first)
    assert all(r.status == PASSED and r.verdicts == "probed" and r.verdicts_at for r in first.values())
    again = run(work="fresh-checkout")  # another work dir: the verdicts are not kept there
    assert engine.count("build") == engine.count("probe") == []
    for cell, r in again.items():
        assert (r.status, r.cached, r.verdicts, r.verdicts_at) == (PASSED, True, CACHED, first[cell].verdicts_at)
        assert r.checks and all(c.verdict != "fail" for c in r.checks)


def test_retest_probes_without_rebuilding(setup):
    m, engine, run = setup
    run()
    reports = run(retest=True)
    assert engine.count("build") == [] and engine.count("probe") == sorted(reports)
    assert all(r.verdicts == "probed" for r in reports.values())


def test_imagefactory_test_uses_the_verdicts_too(setup):
    m, engine, run = setup
    run()
    reports = run(command=build.test)
    assert engine.count("probe") == [] and {r.verdicts for r in reports.values()} == {CACHED}
    run(command=build.test, retest=True)
    assert engine.count("probe") == sorted(reports)


def test_a_failing_retest_is_not_forgotten_by_the_next_run(setup):
    m, engine, run = setup
    run()
    good = dict(engine.probes)
    engine.probes = {cell: "crash" for cell in good}
    failed = run(retest=True)
    assert {r.status for r in failed.values()} == {"check-failed"}
    engine.probes = good
    run()
    assert len(engine.count("probe")) == 2  # probed again, not passed on the old record


def test_a_corrupt_verdict_record_means_a_new_probe(setup, tmp_path):
    m, engine, run = setup
    run()
    for path in (tmp_path / "cache").iterdir():
        path.write_text('{"format": 1, "records": [{"key": "x"}]}')
    run()
    assert engine.count("build") == [] and len(engine.count("probe")) == 2


def test_base_digest_is_pinned_reported_and_hashed(setup, tmp_path):
    m, engine, run = setup
    reports = run()
    r = reports["py3.11-cpu-openblas-pip"]
    digest = BASES["python:3.11-slim-bookworm"]
    assert (r.base_digest, r.base_image) == (digest, f"python:3.11-slim-bookworm@{digest}")
    dockerfile = (tmp_path / "w1/contexts/py3.11-cpu-openblas-pip/Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", dockerfile, re.M) == [r.base_image] * 3  # venv, launch, final
    assert f'org.opencontainers.image.base.digest="{digest}"' in dockerfile


def test_a_moved_base_rebuilds_only_its_cells(setup):
    m, engine, run = setup
    before = run()
    engine.registry["python:3.12-slim-bookworm"] = "sha256:" + "9" * 64
    after = run()
    assert engine.count("build") == engine.count("probe") == ["py3.12-cpu-openblas-pip"]
    moved, kept = after["py3.12-cpu-openblas-pip"], after["py3.11-cpu-openblas-pip"]
    assert moved.status == PASSED and not moved.cached and moved.base_digest == "sha256:" + "9" * 64
    assert moved.content_hash != before["py3.12-cpu-openblas-pip"].content_hash
    assert kept.cached and kept.content_hash == before["py3.11-cpu-openblas-pip"].content_hash


def test_test_after_a_moved_base_finds_nothing_built(setup):
    m, engine, run = setup
    run()
    engine.registry["python:3.11-slim-bookworm"] = "sha256:" + "9" * 64
    reports = run(command=build.test)
    assert reports["py3.11-cpu-openblas-pip"].status == NOT_BUILT and engine.count("probe") == []


def test_pull_never_uses_local_digests_and_always_pulls(setup):
    m, engine, run = setup
    engine.registry.clear()
    engine.local = {ref: [f"{ref.split(':')[0]}@{d}"] for ref, d in BASES.items()}
    reports = run(pull="never")
    assert {r.base_digest for r in reports.values()} == set(BASES.values())
    engine.registry.update(BASES)
    run(pull="always", retest=True)
    assert engine.count("build") == []  # same digests: same content, still cached
    engine.images.clear()
    run(pull="always")
    assert {args["pull"] for args in engine.ops("build_args")} == {True}


def test_pull_always_without_a_registry_fails_before_any_build(setup):
    m, engine, run = setup
    engine.registry.clear()
    with pytest.raises(freshness.BaseImageError, match="--pull always"):
        run(pull="always")
    assert engine.ops("build") == [] and engine.ops("run") == []


def test_cells_sharing_layers_wait_for_the_leader(setup, write_matrix, tmp_path):
    m, engine, run = setup
    shared_base = MATRIX_CACHE.replace('cuda: ["none"]', 'cuda: ["none", "13.0"]').replace('python: ["3.11", "3.12"]', 'python: ["3.11"]')
    m2 = matrix.load(write_matrix(shared_base + "base_images: {pip: 'python:3.11-slim-bookworm'}\n"))
    leader, follower = (c.id for c in m2.cells)
    engine.probes.update({c.id: good_probe(c, cpus=2) for c in m2.cells})
    engine.hold[leader] = threading.Event()
    threading.Timer(0.3, engine.hold[leader].set).start()  # the leader dawdles before its step 2
    opts = BuildOptions(work_dir=tmp_path / "j2", verdicts_dir=tmp_path / "c", jobs=2)
    reports = build.build(m2, list(m2.cells), engine.context(opts)).reports
    assert [r.cell for r in reports] == [leader, follower]  # matrix order, whatever the schedule
    shared = schedule.plan_paths([tmp_path / "j2/contexts" / c for c in (leader, follower)])[1].shared_steps
    assert shared >= 2
    start = engine.calls.index(("build", follower))
    assert ("step", (leader, shared + 1)) in engine.calls[:start]  # its shared steps were done


def test_without_shared_layers_no_one_waits(setup, tmp_path):
    m, engine, run = setup  # 3.11 and 3.12 bases: nothing in common but the FROM keyword
    first = m.cells[0].id
    engine.hold[first] = threading.Event()
    try:
        opts = BuildOptions(work_dir=tmp_path / "j2", verdicts_dir=tmp_path / "c", jobs=2)
        thread = threading.Thread(target=build.build, args=(m, list(m.cells), engine.context(opts)))
        thread.start()
        for _ in range(200):  # the other cell builds to its end while the first is held
            if ("probe", m.cells[1].id) in engine.calls:
                break
            threading.Event().wait(0.05)
        assert ("probe", m.cells[1].id) in engine.calls
    finally:
        engine.hold[first].set()
        thread.join()


def test_an_index_failure_is_found_anywhere_in_the_log_tail():
    """pip's "No matching distribution" line can be 20 lines before the end: BuildKit quotes the
    whole failed RUN after it (the install and the layer split are one step)."""
    from imagefactory.errors import BuildError
    from imagefactory.pipeline.build import _index_failure

    quoted = [f"  {n} | >>>  && something" for n in range(33, 52)] + ["ERROR: failed to solve: process ..."]
    tail = ["Collecting numpy", "ERROR: No matching distribution found for imagefactory-netrc-probe", *quoted]
    assert _index_failure(BuildError("failed to solve", log_tail=tail[-30:]))
    assert not _index_failure(BuildError("failed to solve", log_tail=["Collecting numpy", *quoted]))
