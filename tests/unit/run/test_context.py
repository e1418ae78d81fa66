"""The run context the CLI gives build, test, push, bench and lock: shared options resolved once and
printed when a run starts, the work-dir lock held, signals turned into a clean stop. The CLI runs
in this process on the in-memory engine (tests/fake_engine.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import pytest

from imagefactory.files import fsutil
from imagefactory.cli import app
from imagefactory.engine import select
from imagefactory.config import matrix as matrix_mod
from imagefactory.run.context import Gpus, TestOptions
from imagefactory.errors import Cancelled, ConfigError
from imagefactory.interrupt import Interrupt
from tests.fake_engine import World
from tests.unit.helpers import TWO_PIP_CELLS, good_probe

MATRIX = TWO_PIP_CELLS


@pytest.fixture
def world(tmp_path, monkeypatch) -> World:
    """The CLI's engines are this world's; os._exit (an interrupted run) becomes SystemExit."""
    (tmp_path / "matrix.yaml").write_text(MATRIX)
    m = matrix_mod.load(tmp_path / "matrix.yaml")
    w = World(probes={c.id: good_probe(c) for c in m.cells})

    def engine(interrupt: Interrupt, **kwargs):
        w.interrupt = interrupt
        return w.engine()

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(select, "docker_engine", engine)
    monkeypatch.setattr(app.os, "_exit", exit_now)
    monkeypatch.chdir(tmp_path)
    return w


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["imagefactory", *args])
    try:
        app.main()
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_run_starts_by_printing_its_resolved_settings(world, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "build", "--plain", "--fail-fast", "--gpus", "none", "-j", "2",
                           "--only", "py3.12-cpu-openblas-pip", "--cache-from", "a:1", "--cache-from", "b:2")
    assert code == 0, err
    first = err.splitlines()[0]
    assert first.startswith("imagefactory build: 1 cell(s) of ") and first.count("matrix.yaml") == 1
    for setting in ("jobs=2", "fail-fast=True", "gpus=none", "network=host", "pull=missing",
                    "probe-timeout=300.0", "cache-from=a:1,b:2", "push=False", "atomic=False", "attempts=4"):
        assert f" {setting}" in first, first
    assert world.ops("build") == ["py3.12-cpu-openblas-pip"]


def test_choices_are_checked_once_into_enums():
    assert TestOptions(gpus="none").gpus is Gpus.none  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^--gpus some: not allowed \(allowed: none, all, auto\)$"):
        TestOptions(gpus="some")  # type: ignore[arg-type]


def test_bench_holds_the_work_dir_lock(world, tmp_path, monkeypatch, capsys):
    with fsutil.locked(tmp_path / "build", tmp_path / "build" / "report.json"):  # a build is running
        code, _, err = run_cli(monkeypatch, capsys, "bench", "--work-dir", "build")
    assert code == 2 and "--work-dir build: another imagefactory run" in err, err
    assert world.calls == []


def test_sigterm_during_bench_stops_it_with_143_and_writes_what_it_has(world, tmp_path, monkeypatch, capsys):
    assert run_cli(monkeypatch, capsys, "build", "--plain", "--gpus", "none")[0] == 0
    first, second = sorted(world.probes)
    world.probes[first] = "hang"  # the workload container of the first cell never ends

    def sigterm_when_running() -> None:
        for _ in range(500):
            if f"probe-{first}" in world.running:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            threading.Event().wait(0.01)

    threading.Thread(target=sigterm_when_running, daemon=True).start()
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--gpus", "none", "--budget", "10")
    assert code == 143, err
    results = {r["cell"]: r["status"] for r in json.loads((tmp_path / "build" / "bench.json").read_text())["cells"]}
    assert results == {first: "interrupted", second: "interrupted"}
    assert not world.running  # the container was stopped


def test_raising_scope_turns_sigterm_into_cancelled_in_the_main_thread():
    interrupt = Interrupt()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Cancelled):
        with interrupt.raising():
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(5)
    assert interrupt.signum == signal.SIGTERM and interrupt.is_set()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_lock_of_the_same_matrix_stops_before_resolving(world, tmp_path, monkeypatch, capsys):
    with fsutil.exclusive(tmp_path / "matrix.yaml", "a running lock", own_file=False):
        code, _, err = run_cli(monkeypatch, capsys, "lock")
    assert code == 2 and "another imagefactory run" in err and "resolving" not in err, err
    assert not (tmp_path / "locks").exists() and (tmp_path / "matrix.yaml").read_text() == MATRIX


def test_a_step_reads_only_the_settings_groups_its_command_takes():
    """run.settings(group): a command's type holds only its groups, so bench's run has no push
    settings; or_defaults gives a group's defaults where a command has no flag for it (push's probe)."""
    from pathlib import Path

    from imagefactory.run.context import (BenchOptions, Publishing, PushOptions, RunContext, Testing, Workspace,
                                          or_defaults)

    run = RunContext(BenchOptions(budget=40))
    assert run.settings(Workspace).work_dir == Path("build") and run.settings(BenchOptions).budget == 40
    with pytest.raises(TypeError, match="^BenchOptions holds no Publishing settings$"):
        run.settings(Publishing)
    assert or_defaults(PushOptions(), Testing) == Testing() and or_defaults(TestOptions(jobs=2), Testing).jobs == 2


def test_fail_fast_through_the_cli_skips_the_cells_after_a_failure(world, monkeypatch, capsys):
    """`build --fail-fast` end to end on the fake engine (the integration suite's real-engine copy
    rebuilt a failing cell's cold torch step for this alone): the cell after a failure is never
    built, and the report says why."""
    first, second = (c.id for c in matrix_mod.load("matrix.yaml").cells)
    world.builds[first] = "error"
    code, _, err = run_cli(monkeypatch, capsys, "build", "--plain", "--gpus", "none", "--fail-fast")
    assert code == 1, err
    cells = {c["cell"]: c for c in json.loads(open("build/report.json").read())["cells"]}
    assert cells[first]["status"] == "build-failed" and cells[second]["status"] == "skipped"
    assert "--fail-fast" in cells[second]["error"] and world.ops("build") == [first]
