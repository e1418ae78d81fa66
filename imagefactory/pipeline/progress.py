"""What a person sees during long builds: a live display per cell on a terminal,
plain lines prefixed with the cell id elsewhere (CI logs)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, TextIO

from imagefactory.engine.api import BuildProgress
from imagefactory.terminal import printable_text
from imagefactory.run.results import BUILD_FAILED, BUILT, CACHED, PASSED, CellReport

if TYPE_CHECKING:  # rich is imported only for the live display: start-up counts on CI
    from rich.console import Console
    from rich.progress import TaskID


class Plain:
    """One line per event, prefixed with the cell id; safe for interleaved parallel builds."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.lock = threading.Lock()
        self.started: dict[str, float] = {}

    def _say(self, cell: str, text: str) -> None:
        with self.lock:
            print(f"[{cell}] {text}", file=self.stream, flush=True)

    def __enter__(self) -> Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def start(self, cell: str, what: str) -> None:
        self.started[cell] = time.monotonic()
        self._say(cell, what)

    def step(self, cell: str, p: BuildProgress) -> None:
        pass  # the step line itself arrives through log()

    def log(self, cell: str, line: str) -> None:
        self._say(cell, line)

    def status(self, cell: str, text: str) -> None:
        self._say(cell, text)

    def finish(self, r: CellReport) -> None:
        elapsed = time.monotonic() - self.started.get(r.cell, time.monotonic())
        self._say(r.cell, f"{r.status}{' (cached)' if r.cached else ''} after {elapsed:.0f}s")
        failure_block(r, self.stream, self.lock)


class Live:
    """A rich live display: one row per cell with its step N of M and elapsed time."""

    def __init__(self, console: Console | None = None):
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        # the display's own codes go to the terminal itself, under the CLI's escaping stream
        self.console = console or Console(file=getattr(sys.stderr, "raw", sys.stderr))
        self.progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), TextColumn("{task.fields[state]}"),
            TimeElapsedColumn(), console=self.console, transient=False,
        )
        self.tasks: dict[str, TaskID] = {}
        self.lock = threading.Lock()

    def __enter__(self) -> Live:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def _task(self, cell: str) -> TaskID:
        with self.lock:
            if cell not in self.tasks:
                self.tasks[cell] = self.progress.add_task(cell, state="waiting", total=None)
            return self.tasks[cell]

    def start(self, cell: str, what: str) -> None:
        self.progress.update(self._task(cell), state=what)

    def step(self, cell: str, p: BuildProgress) -> None:
        self.progress.update(self._task(cell), state=f"step {p.step}/{p.steps}: {p.instruction[:60]}")

    def log(self, cell: str, line: str) -> None:
        pass

    def status(self, cell: str, text: str) -> None:
        self.progress.update(self._task(cell), state=text)

    def finish(self, r: CellReport) -> None:
        task = self._task(r.cell)
        mark = "[green]✔" if r.status in (PASSED, BUILT, CACHED) else "[red]✘"
        self.progress.update(task, state=f"{mark} {r.status}{' (cached)' if r.cached else ''}[/]",
                             total=1, completed=1)
        self.progress.stop_task(task)
        with self.lock:
            self.progress.console.print(printable_text(_failure_text(r)), markup=False, highlight=False, end="")


def failure_block(r: CellReport, stream, lock) -> None:
    text = _failure_text(r)
    if text:
        with lock:
            print(text, file=stream, end="", flush=True)


def _failure_text(r: CellReport) -> str:
    if r.status == BUILD_FAILED:
        lines = [f"✘ {r.cell}: build failed at {r.failed_step or 'start'}", f"  error: {r.error}",
                 f"  last {len(r.log_tail)} log lines ({r.log}):"]
        lines += [f"  | {line}" for line in r.log_tail]
        return "\n".join(lines) + "\n"
    failed = [c for c in r.checks if c.verdict == "fail"]
    if failed:
        lines = [f"✘ {r.cell}: {len(failed)} check(s) failed"]
        lines += [f"  {c.name}: expected {c.expected}, got {c.actual}" + (f" ({c.detail})" if c.detail else "")
                  for c in failed]
        return "\n".join(lines) + "\n"
    if r.error:
        return f"✘ {r.cell}: {r.error}\n"
    return ""


def make(live: bool | None = None) -> Plain | Live:
    """The display a run's UI protocol (context.UI) is given: Live on a terminal, else Plain."""
    if live is None:
        live = sys.stderr.isatty()
    return Live() if live else Plain()
