"""`imagefactory bench`: measure training-relevant speed inside each built image.

The workload (resources/workload.py, standard library plus numpy and torch) runs in
the image the way the probe does: the image's default user, no network, a
timeout. It runs twice per image: once unconstrained (GEMM at 1 thread vs the
image's threads, DataLoader workers, torch.compile, the GPU figures), and once
under `--cpus 1` (GEMM at the host's core count vs the CPU budget the container
really has). Its JSON is checked field by field here; the figures go to a JSON
file and a Markdown table next to it (build/bench.json, build/bench.md).

A figure that fails inside the image (no C++ compiler for torch.compile, say) is
reported as failed; only a cell that could not be measured at all fails the run.

A cell of another platform than the engine's own would run emulated (binfmt/QEMU, about ten
times slower, and not evenly so): its ratios would say nothing about the image. It is not run:
its status is `not-judged`, its error says "emulated: not judged" and where to bench it.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from imagefactory.pipeline import build
from imagefactory.probe import checks
from imagefactory.files import fsutil
from imagefactory.render.contexts import Context
from imagefactory.probe import smoke
from imagefactory.run.context import DEFAULT_BENCH_BUDGET, BenchOptions, Pull, RunContext
from imagefactory.engine.api import ContainerEngine
from imagefactory.errors import Cancelled, EngineError
from imagefactory.config.model import Cell, Matrix

DEFAULT_BUDGET = DEFAULT_BENCH_BUDGET  # seconds of workload per image, both containers together
OVERSUB_SHARE = 0.3  # of the budget, for the --cpus 1 container
OVERSUB_CPUS = 1.0
GRACE = 30.0  # container start and interpreter start on top of the workload's own budget
MAIN_SECTIONS = "gemm,dataloader,compile,gpu"
MEASURED, NOT_BUILT, FAILED, INTERRUPTED = "measured", "not-built", "failed", "interrupted"
NOT_JUDGED = "not-judged"  # a foreign-platform cell: emulated figures would mean nothing (see above)
FIGURE_STATES = ("ok", "failed", "skipped")
UNITS = ("GFLOP/s", "TFLOP/s", "samples/s", "ms/step")
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,20}(?:\.[a-z0-9_]{1,20}){0,2}")
TEXT_MAX = 300


def workload_source() -> str:
    return resources.files("imagefactory").joinpath("resources/workload.py").read_text()


@dataclass(frozen=True)
class Side:
    label: str
    value: float  # in the figure's unit


@dataclass(frozen=True)
class Figure:
    name: str
    unit: str
    status: str  # ok | failed | skipped
    container: str  # "default" or "--cpus 1"
    baseline: Side | None = None
    candidate: Side | None = None
    speedup: float | None = None  # > 1: the candidate is faster; computed here, never read from the image
    error: str = ""


@dataclass
class CellBench:
    cell: str
    status: str = NOT_BUILT
    image: str = ""
    error: str = ""
    cpus: dict[str, Any] = field(default_factory=dict)  # what the workload saw (unconstrained run)
    figures: list[Figure] = field(default_factory=list)


# -- parsing the workload's JSON -------------------------------------------------------------------

def _text(value: Any) -> str:
    """A printable one-line string of bounded length, whatever came in."""
    text = value if isinstance(value, str) else ""
    return "".join(ch if ch.isprintable() else " " for ch in " ".join(text.split()))[:TEXT_MAX]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _side(raw: Any) -> Side | None:
    if not isinstance(raw, dict):
        return None
    value = _number(raw.get("value"))
    return None if value is None else Side(_text(raw.get("label")) or "?", value)


def parse_figure(raw: Any, container: str) -> Figure:
    """One figure from the workload, every field checked; a malformed one becomes a failed figure."""
    if not isinstance(raw, dict):
        return Figure("?", "?", "failed", container, error="malformed figure (not an object)")
    name = raw.get("name") if isinstance(raw.get("name"), str) and NAME_RE.fullmatch(raw["name"]) else None
    unit = raw.get("unit") if raw.get("unit") in UNITS else None
    status = raw.get("status") if raw.get("status") in FIGURE_STATES else None
    error = _text(raw.get("error"))
    if name is not None and status in ("failed", "skipped"):  # a section that broke may not know its unit
        return Figure(name, unit or "?", status, container, error=error or status)
    if name is None or unit is None or status is None:
        return Figure(name or "?", unit or "?", "failed", container,
                      error="malformed figure (name, unit or status not recognised)")
    base, cand = _side(raw.get("baseline")), _side(raw.get("candidate"))
    if base is None or cand is None:
        return Figure(name, unit, "failed", container, base, cand, error="a value is missing or not positive")
    higher_is_better = unit != "ms/step"
    speedup = cand.value / base.value if higher_is_better else base.value / cand.value
    return Figure(name, unit, "ok", container, base, cand, speedup)


def _progress_figures(stdout: str) -> list[Any]:
    """The {"figure": ...} lines the workload prints as it goes (all that is left of a killed run)."""
    out = []
    for line in stdout.splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "figure" in data:
            out.append(data["figure"])
    return out


def parse_workload(stdout: str, container: str) -> tuple[list[Figure], dict[str, Any], bool]:
    """(figures, what the workload saw of its CPUs, whether it finished). Without its final JSON
    (last stdout line) the figures it printed on the way are kept. ValueError: neither."""
    doc = smoke.parse_probe_output(stdout)  # same contract as the probe: JSON on the last stdout line
    if doc is None or not isinstance(doc.get("figures"), list):
        partial = _progress_figures(stdout)
        if not partial:
            raise ValueError("no workload JSON on stdout")
        return [parse_figure(f, container) for f in partial[:50]], {}, False
    raw = doc.get("cpus")
    cpus: dict[str, Any] = raw if isinstance(raw, dict) else {}
    clean = {k: v for k, v in cpus.items() if k in ("os_cpu_count", "affinity", "cgroup_quota", "auto")
             and (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))}
    return [parse_figure(f, container) for f in doc["figures"][:50]], clean, True


# -- running ----------------------------------------------------------------------------------------

def _command(budget: float, sections: str, extra: list[str]) -> list[str]:
    return ["python", "-c", workload_source(), "--budget", f"{budget:.0f}", "--sections", sections, *extra]


def _why(result, timeout: float) -> str:
    if result.exit_code is None:
        return f"killed after {timeout:.0f} s"
    tail = " | ".join(result.stderr.strip().splitlines()[-3:]) or "no output"
    return f"exit code {result.exit_code}, no workload JSON: {tail}"[:TEXT_MAX * 2]


def refuse_emulated(engine: ContainerEngine, cell: Cell) -> CellBench | None:
    """The `not-judged` result of a cell that would run emulated on `engine`; None natively."""
    emulation = smoke.emulation_of(engine, cell)
    if emulation is None:
        return None
    return CellBench(cell.id, NOT_JUDGED, error=f"{checks.EMULATED}: on this engine it would run under {emulation}, "
                     f"about {emulation.slowdown:g}x slower, so its ratios would not be the image's; bench "
                     f"{cell.platform.oci} cells on a {cell.platform.oci} host")


def bench_image(engine: ContainerEngine, cell: Cell, image: str, *, budget: float, gpus: bool,
                host_cores: int) -> CellBench:
    """Both containers for one image; the CellBench says what came out (`not-judged`, nothing
    run, for a cell of another platform than the engine's)."""
    refused = refuse_emulated(engine, cell)
    if refused is not None:
        return replace(refused, image=image)
    out = CellBench(cell.id, status=MEASURED, image=image)
    main_budget, oversub_budget = budget * (1 - OVERSUB_SHARE), budget * OVERSUB_SHARE
    runs: tuple[tuple[str, float, str, list[str], float | None], ...] = (
        ("default", main_budget, MAIN_SECTIONS, [], None),
        (f"--cpus {OVERSUB_CPUS:g}", oversub_budget, "oversub", ["--host-cores", str(host_cores)], OVERSUB_CPUS))
    for container, seconds, sections, extra, cpus in runs:
        timeout = seconds + GRACE
        try:
            result = engine.run(image, _command(seconds, sections, extra), timeout=timeout,
                                gpus=gpus and cell.cuda is not None, cpus=cpus)
        except EngineError as e:
            out.status, out.error = FAILED, e.message
            return out
        try:
            figures, seen, complete = parse_workload(result.stdout, container)
        except ValueError:
            out.status, out.error = FAILED, f"{container}: {_why(result, timeout)}"
            return out
        out.figures += figures
        if not complete:
            out.status, out.error = FAILED, f"{container}: {_why(result, timeout)} ({len(figures)} figure(s) kept)"
            return out
        if cpus is None:
            out.cpus = seen
    return out


def bench(matrix: Matrix, cells: list[Cell], run: RunContext, *,
          say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> tuple[list[CellBench], int]:
    """Bench the image built for each cell's current content (found as `imagefactory test` does).
    Reads the run's BenchOptions: work_dir, budget and gpus. Returns (results, the engine host's core
    count). Once interrupted, the cell being measured and those after it are `interrupted`."""
    options = run.settings(BenchOptions)
    engine = run.engines()()
    gpus = build.resolve_gpus(options.gpus, engine)
    host_cores = engine.describe().cpus or 1
    results: list[CellBench] = []
    try:
        contexts = build.render_pinned(matrix, cells, options.work_dir, engine, Pull.missing, run.interrupt)
    except Cancelled:
        return [CellBench(c.id, INTERRUPTED, error="interrupted") for c in cells], host_cores
    for ctx in contexts:
        try:
            results.append(_bench_cell(engine, matrix, ctx, options, gpus, host_cores, say))
        except Cancelled:
            results.append(CellBench(ctx.cell.id, INTERRUPTED, error="interrupted"))
        if run.interrupt.is_set():
            break
    done = {r.cell for r in results}
    results += [CellBench(c.id, INTERRUPTED, error="interrupted") for c in cells if c.id not in done]
    return results, host_cores


def _bench_cell(engine: ContainerEngine, matrix: Matrix, ctx: Context, options: BenchOptions, gpus: bool,
                host_cores: int, say: Callable[[str], None]) -> CellBench:
    refused = refuse_emulated(engine, ctx.cell)
    if refused is not None:
        say(f"{ctx.cell.id}: {refused.error}")
        return refused
    image = build.find_built(engine, matrix, ctx.cell, ctx.content_hash)
    if image is None:
        say(f"{ctx.cell.id}: not built")
        return CellBench(ctx.cell.id, NOT_BUILT,
                         error="no image for this cell's current content; run `imagefactory build` first")
    say(f"{ctx.cell.id}: running the workload in {image[:19]} (budget {options.budget:.0f} s)")
    return bench_image(engine, ctx.cell, image, budget=options.budget, gpus=gpus, host_cores=host_cores)


# -- the bench report -------------------------------------------------------------------------------

def _fmt(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def figure_line(f: Figure) -> tuple[str, str, str, str]:
    """(figure, baseline, candidate, speedup) as text."""
    name = f"{f.name} [{f.container}]" if f.container != "default" else f.name
    if f.status != "ok" or f.baseline is None or f.candidate is None:
        return name, f"{f.status}: {f.error}", "", ""
    return (name, f"{f.baseline.label}: {_fmt(f.baseline.value)} {f.unit}",
            f"{f.candidate.label}: {_fmt(f.candidate.value)} {f.unit}", f"×{f.speedup:.2f}")


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(results: list[CellBench], host_cores: int, budget: float) -> str:
    lines = ["# imagefactory bench", "",
             f"Engine host: {host_cores} CPU(s); workload budget {budget:.0f} s per image. "
             "Speedup > 1: the candidate setting is faster than the baseline, in the same container.", ""]
    for r in results:
        lines += [f"## `{r.cell}`: {r.status}", ""]
        if r.error:
            lines += [f"**{'not judged' if r.status == NOT_JUDGED else 'error'}**: {_md(r.error)}", ""]
            continue
        if r.cpus:
            lines += [f"CPUs seen by the workload: {_md(json.dumps(r.cpus))}", ""]
        lines += ["| figure | baseline | candidate | speedup |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(_md(x) for x in figure_line(f)) + " |" for f in r.figures]
        lines.append("")
    return "\n".join(lines)


def write(results: list[CellBench], path: Path, *, host_cores: int, budget: float) -> tuple[Path, Path]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"ok": all(r.status == MEASURED for r in results), "host_cores": host_cores, "budget_s": budget,
           "cells": [asdict(r) for r in results]}
    fsutil.atomic_write(path, json.dumps(doc, indent=2) + "\n")
    md = path.with_suffix(".md")
    md.write_text(markdown(results, host_cores, budget))
    return path, md
