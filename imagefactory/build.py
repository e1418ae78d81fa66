"""Step 3: build contexts -> candidate images, each proven by the smoke tests.

Cells build one at a time by default (-j N for more). A failing cell never stops
the others unless fail-fast is asked for; cells not started then are reported as
skipped. An image whose content hash is already present is reused, not rebuilt.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from imagefactory import freshness, render, schedule, smoke, tags, verdicts
from imagefactory.engine import BuildProgress, Engine
from imagefactory.errors import BuildError, ConfigError, ImageFactoryError
from imagefactory.model import Cell, Matrix
from imagefactory.report import (BUILD_FAILED, BUILT, CACHED, CHECK_FAILED, NOT_BUILT, PASSED, SKIPPED,
                                 CellReport)


BUILD_ENDED = 1 << 30  # a step number past any build's last: opens the cell's gate


@dataclass(frozen=True)
class Options:
    work_dir: Path = Path("build")
    jobs: int = 1
    fail_fast: bool = False
    gpus: str = "auto"  # none | all | auto
    network: str = "host"  # host | default
    probe_timeout: float = smoke.DEFAULT_TIMEOUT
    cache_from: tuple[str, ...] = ()  # images whose layers a build may reuse (e.g. the previous release)
    pull: str = "missing"  # always | missing | never: how base images are resolved (freshness.py)
    retest: bool = False  # probe even when a verdict for this image is cached (verdicts.py)
    verdicts_dir: Path | None = None  # None: verdicts.cache_dir()


def resolve_gpus(mode: str, engine: Engine) -> bool:
    if mode == "all":
        return True
    if mode == "none":
        return False
    if mode == "auto":
        return engine.gpus_available()
    raise ConfigError(f"--gpus {mode}: not allowed (allowed: none, all, auto)")


def find_built(engine: Engine, matrix: Matrix, cell: Cell, content_hash: str) -> str | None:
    """The local image built from exactly this content, if any.

    The content-hash label alone is not enough: every image built FROM a cell's image
    inherits its labels. So only an image that also carries one of the names this cell's
    image gets (its candidate name, its content-hash tag, a release tag, e.g. pulled from
    the registry as a cache source) counts."""
    names = {tags.candidate(cell, content_hash), *cell.tags,
             tags.hash_tag(matrix.hash_tag_template, matrix.image, cell, content_hash)}
    for image_id, image_tags in engine.images_with_label(render.HASH_LABEL, content_hash).items():
        if names & set(image_tags):
            return image_id
    return None


class _Cell:
    """The per-cell work: log file, cache lookup, build, smoke test."""

    def __init__(self, matrix: Matrix, ctx: render.Context, options: Options, ui, engine: Engine, gpus: bool):
        self.matrix, self.ctx, self.options, self.ui, self.engine, self.gpus = matrix, ctx, options, ui, engine, gpus
        cell = ctx.cell
        log_path = options.work_dir / "logs" / f"{cell.id}.log"
        self.report = CellReport(cell=cell.id, content_hash=ctx.content_hash,
                                 candidate=tags.candidate(cell, ctx.content_hash), log=str(log_path),
                                 base_image=cell.base_image, base_digest=cell.base_image.partition("@")[2])
        self.on_step: Callable[[int], None] = lambda step: None  # the scheduler's gate (schedule.py)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = log_path.open("w", encoding="utf-8")

    def log(self, line: str, *, show: bool = True) -> None:
        self.log_file.write(line + "\n")
        self.log_file.flush()
        if show:
            self.ui.log(self.report.cell, line)

    def _progress(self, p: BuildProgress) -> None:
        self.ui.step(self.ctx.cell.id, p)
        self.on_step(p.step)

    def build(self) -> bool:
        r, cell = self.report, self.ctx.cell
        self.ui.status(cell.id, "looking for a cached image")
        existing = find_built(self.engine, self.matrix, cell, self.ctx.content_hash)
        if existing:
            self.engine.tag(existing, r.candidate)
            r.image_id, r.cached, r.status = existing, True, CACHED
            self.log(f"cached: {existing} already carries content hash {self.ctx.content_hash[:12]}")
            return True
        self.ui.status(cell.id, "building")
        started = time.monotonic()
        try:
            network = "host" if self.options.network == "host" else None
            r.image_id = self.engine.build(str(self.ctx.path), r.candidate, network_mode=network,
                                           log=self.log, progress=self._progress,
                                           pull=self.options.pull == "always",
                                           cache_from=[ref for ref in self.options.cache_from
                                                       if self.engine.image_id(ref)])
        except BuildError as e:
            r.status, r.error, r.failed_step, r.log_tail = BUILD_FAILED, e.message, e.step or "", e.log_tail
            return False
        finally:
            r.build_seconds = round(time.monotonic() - started, 1)
        r.status = BUILT
        return True

    def test(self, image: str) -> bool:
        r, cell = self.report, self.ctx.cell
        vdir = self.options.verdicts_dir or verdicts.cache_dir()
        vkey = verdicts.key(r.image_id or self.engine.image_id(image) or "", cell, gpus=self.gpus)
        hit = None if self.options.retest else verdicts.lookup(vdir, vkey, cell)
        if hit is not None:
            r.checks, r.status, r.verdicts, r.verdicts_at = hit.checks, PASSED, CACHED, hit.at
            self.log(f"verdicts cached: image {vkey.image_id[:19]} passed probe {vkey.probe_version} at {hit.at}")
            return True
        self.ui.status(cell.id, "testing")
        result = smoke.test_image(self.engine, cell, image, gpus=self.gpus, timeout=self.options.probe_timeout)
        r.verdicts = "probed"
        if result.passed and result.probe is not None:
            r.verdicts_at = verdicts.store(vdir, vkey, result.probe) or ""
        else:
            verdicts.forget(vdir, vkey)
        self.log("--- probe stdout ---", show=False)
        self.log(result.stdout.rstrip(), show=False)
        self.log("--- probe stderr ---", show=False)
        self.log(result.stderr.rstrip(), show=False)
        r.checks = result.checks
        r.status = PASSED if result.passed else CHECK_FAILED
        return result.passed

    def close(self) -> None:
        self.log_file.close()


def _run(matrix: Matrix, cells: list[Cell], options: Options, ui, engine_factory: Callable[[], Engine],
         work: Callable[["_Cell"], bool]) -> tuple[list[CellReport], bool]:
    """Render the cells, then do `work` for each on a pool of workers; (reports, gpus given)."""
    first = engine_factory()
    gpus = resolve_gpus(options.gpus, first)
    bases = freshness.resolve(first, [c.base_image for c in cells], options.pull)
    contexts = render.render(matrix, options.work_dir / "contexts", cells,
                             bases={ref: b.pinned for ref, b in bases.items()})
    slots = schedule.plan_paths([ctx.path for ctx in contexts])
    gates = schedule.Gates(slots)
    stop = threading.Event()
    local = threading.local()

    def one(slot: schedule.Slot) -> CellReport:
        ctx = contexts[slot.index]
        try:
            gates.wait(slot.index)
            return one_cell(ctx, slot.index)
        finally:
            gates.release(slot.index)

    def one_cell(ctx: render.Context, index: int) -> CellReport:
        if stop.is_set():
            skipped = CellReport(cell=ctx.cell.id, status=SKIPPED, content_hash=ctx.content_hash,
                                 error="skipped: an earlier cell failed and --fail-fast is set")
            ui.finish(skipped)
            return skipped
        ui.start(ctx.cell.id, "starting")
        if not hasattr(local, "engine"):
            local.engine = engine_factory()  # one SDK client per worker thread
        c = _Cell(matrix, ctx, options, ui, local.engine, gpus)
        c.on_step = lambda step: gates.progress(index, step)
        try:
            ok = work(c)
        except ImageFactoryError as e:  # the engine failed us mid-cell: the cell fails, the run goes on
            built = c.report.status in (BUILT, CACHED)
            c.report.status, c.report.error, ok = (CHECK_FAILED if built else BUILD_FAILED), e.message, False
        finally:
            c.close()
        if not ok and options.fail_fast:
            stop.set()
        ui.finish(c.report)
        return c.report

    with ThreadPoolExecutor(max_workers=max(1, options.jobs)) as pool:
        done = dict(zip((s.index for s in slots), pool.map(one, slots)))
    return [done[i] for i in range(len(contexts))], gpus


def build(matrix: Matrix, cells: list[Cell], options: Options, ui,
          engine_factory: Callable[[], Engine] = Engine) -> tuple[list[CellReport], bool]:
    """Render, build (or reuse) and smoke-test every cell."""

    def work(c: _Cell) -> bool:
        built = c.build()
        c.on_step(BUILD_ENDED)  # the cells that share its layers may start now
        return built and c.test(c.report.candidate)

    return _run(matrix, cells, options, ui, engine_factory, work)


def test(matrix: Matrix, cells: list[Cell], options: Options, ui,
         engine_factory: Callable[[], Engine] = Engine) -> tuple[list[CellReport], bool]:
    """Re-test the images already built for the cells' current content."""

    def work(c: _Cell) -> bool:
        image = find_built(c.engine, matrix, c.ctx.cell, c.ctx.content_hash)
        if image is None:
            c.report.status = NOT_BUILT
            c.report.error = "no image for this cell's current content; run `imagefactory build` first"
            return False
        c.report.image_id, c.report.cached = image, True
        c.engine.tag(image, c.report.candidate)
        return c.test(image)

    return _run(matrix, cells, options, ui, engine_factory, work)
