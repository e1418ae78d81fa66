"""Step 4: prove an image in-container.

The probe (resources/probe.py, standard library plus what it inspects) runs inside
the image as its default user, with no network and a timeout; the host parses its
JSON and judges it against the cell (checks.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from imagefactory import checks
from imagefactory.context import DEFAULT_PROBE_TIMEOUT
from imagefactory.engine_api import ContainerEngine, RunResult
from imagefactory.errors import EngineError, EngineGone
from imagefactory.model import Cell

DEFAULT_TIMEOUT = DEFAULT_PROBE_TIMEOUT  # defined once, in context.py


def probe_source() -> str:
    return resources.files("imagefactory").joinpath("resources/probe.py").read_text()


@dataclass(frozen=True)
class SmokeResult:
    checks: list[checks.Check]
    probe: dict | None
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return checks.passed(self.checks)


def parse_probe_output(stdout: str) -> dict | None:
    """The probe's JSON is the last non-empty line of stdout."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        data = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def run_probe(engine: ContainerEngine, image: str, *, timeout: float = DEFAULT_TIMEOUT,
              gpus: bool = False, compile_check: bool = True) -> RunResult:
    """Run the probe in `image`. Without `compile_check` the probe leaves out its
    torch.compile child (a cell built without a compiler: the check is skipped)."""
    args = [] if compile_check else ["--no-compile"]
    return engine.run(image, ["python", "-c", probe_source(), *args], timeout=timeout, gpus=gpus)


def test_image(engine: ContainerEngine, cell: Cell, image: str, *, gpus: bool, timeout: float = DEFAULT_TIMEOUT) -> SmokeResult:
    """Run the probe in `image` and judge it against `cell`. A probe that could not run
    (timeout, crash, no JSON, an engine error) is itself a failing check, never an exception;
    only a lost engine (EngineGone) is raised, for the run to report."""
    try:
        result = run_probe(engine, image, timeout=timeout, gpus=gpus, compile_check=cell.compiler)
    except EngineGone:  # not the image's fault: the run reports a lost engine (build.py, exit 3)
        raise
    except EngineError as e:  # e.g. no `python` in the image, or GPUs asked of a host without any
        failed = checks.Check("probe.ran", "probe JSON on stdout", e.message, checks.FAIL, e.message)
        return SmokeResult([failed], None, "", e.message)
    probe = parse_probe_output(result.stdout)
    why = None
    if result.exit_code is None:  # killed at the timeout: whatever it printed is not a verdict
        why = f"killed after {timeout:.0f} s"
    elif probe is None:
        tail = " | ".join(result.stderr.strip().splitlines()[-3:]) or "no output"
        why = f"exit code {result.exit_code}, no probe JSON: {tail}"
    if why is not None or probe is None:
        failed = checks.Check("probe.ran", "probe JSON on stdout", str(why), checks.FAIL, str(why))
        return SmokeResult([failed], None, result.stdout, result.stderr)
    return SmokeResult(checks.judge(cell, probe, gpu_required=gpus), probe, result.stdout, result.stderr)
