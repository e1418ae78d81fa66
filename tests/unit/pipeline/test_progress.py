"""The progress displays, rendered to strings (no terminal, no Docker)."""

from __future__ import annotations

import io

from rich.console import Console

from imagefactory.probe.checks import Check
from imagefactory.engine.docker import BuildProgress
from imagefactory.pipeline.progress import Live, Plain
from imagefactory.run.results import CellReport


def failed_build() -> CellReport:
    return CellReport(cell="py3.11-cpu-mkl-pip", status="build-failed", error="The command returned 1",
                      failed_step="step 7/21: RUN pip install x", log_tail=["ERROR: No matching distribution"],
                      log="build/logs/py3.11-cpu-mkl-pip.log")


def test_plain_lines_carry_the_cell_and_failures_show_step_error_and_tail():
    out = io.StringIO()
    ui = Plain(out)
    ui.start("py3.11-cpu-mkl-pip", "starting")
    ui.log("py3.11-cpu-mkl-pip", "Step 7/21 : RUN pip install x")
    ui.finish(failed_build())
    text = out.getvalue()
    assert "[py3.11-cpu-mkl-pip] Step 7/21 : RUN pip install x" in text
    assert "✘ py3.11-cpu-mkl-pip: build failed at step 7/21: RUN pip install x" in text
    assert "  | ERROR: No matching distribution" in text


def test_live_display_shows_step_n_of_m_then_the_verdict():
    console = Console(file=io.StringIO(), force_terminal=True, width=120, record=True)
    with Live(console) as ui:
        ui.start("py3.11-cpu-openblas-pip", "building")
        ui.step("py3.11-cpu-openblas-pip", BuildProgress(3, 21, "RUN python3.11 -m venv /opt/venv"))
        console.print(ui.progress.get_renderable())
        ui.finish(CellReport(cell="py3.11-cpu-openblas-pip", status="check-failed", checks=[
            Check("numpy.blas", "mkl", "openblas", "fail", "numpy's BLAS is openblas")]))
    text = console.export_text()
    assert "step 3/21: RUN python3.11 -m venv" in text
    assert "✘ check-failed" in text
    assert "numpy.blas: expected mkl, got openblas" in text
