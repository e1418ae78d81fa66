"""Shared fixtures. Docker-backed fixtures live in tests/integration/conftest.py."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def write_matrix(tmp_path):
    """Write a matrix file from YAML text (dedented) and return its path."""

    def write(text: str, name: str = "matrix.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return write


# -- the disk the run has -----------------------------------------------------------------------
# A CI run once failed with "no space left on device" mid-suite and said nothing of how much
# disk it had had. The header says what the engine's disk had free at the start, and the summary
# the least it had free during the run (sampled every 5 s), so such a failure reads at once.

class _Disk:
    path = "/var/lib/docker" if Path("/var/lib/docker").is_dir() else "/"
    start: int | None = None
    least: int | None = None
    stop = None


def _free() -> int:
    import shutil

    return shutil.disk_usage(_Disk.path).free


def _sample(stop) -> None:
    while not stop.wait(5):
        free = _free()
        _Disk.least = free if _Disk.least is None else min(_Disk.least, free)


def pytest_sessionstart(session):
    import threading

    from tests import leaks

    leaks.Check.start(engines=False)  # /tmp now; the engines once the session is known to reach them

    _Disk.start = _Disk.least = _free()
    _Disk.stop = threading.Event()
    threading.Thread(target=_sample, args=(_Disk.stop,), name="disk-sampler", daemon=True).start()


def pytest_report_header(config):
    if _Disk.start is not None:
        return f"disk: {_Disk.start / 2**30:.1f} GiB free on {_Disk.path}"
    return None


def pytest_terminal_summary(terminalreporter):
    for line in _Leaks.found:
        terminalreporter.write_line(f"LEFT BEHIND: {line}", red=True)
    import sys

    helpers = sys.modules.get("tests.integration.helpers")
    if helpers is not None:
        terminalreporter.write_line(helpers.BUILDS.line())
    if _Disk.start is None or _Disk.least is None:
        return
    if _Disk.stop is not None:
        _Disk.stop.set()
    least = min(_Disk.least, _free())
    terminalreporter.write_line(f"disk: {_Disk.start / 2**30:.1f} GiB free at the start on {_Disk.path}, "
                                f"{least / 2**30:.1f} GiB at the least, {_free() / 2**30:.1f} GiB at the end "
                                f"(the run used {(_Disk.start - least) / 2**30:.1f} GiB at its peak)")


# -- nothing left behind (tests/leaks.py) ---------------------------------------------------------

def pytest_collection_finish(session):
    from tests import leaks

    if os.environ.get("IMAGEFACTORY_TEST_KEEP_IMAGES") != "1" and any(
            item.nodeid.startswith("tests/integration/") for item in session.items):
        leaks.Check.start(engines=True)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """After every fixture's teardown: what the run left fails it (exit 1), however its tests ended."""
    from tests import leaks

    _Leaks.found = leaks.Check.finish()
    if _Leaks.found and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


class _Leaks:
    found: list[str] = []
