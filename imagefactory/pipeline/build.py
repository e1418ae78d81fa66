"""Step 10 (pipeline/): build contexts -> candidate images, each proven by the smoke tests.

Cells build one at a time by default (-j N for more). A failing cell never stops
the others unless fail-fast is asked for; cells not started then are reported as
skipped. An image whose content hash is already present is reused, not rebuilt.
An engine error is the failing cell's error; an interrupt (SIGINT/SIGTERM, see
interrupt.py) stops the cells in flight, which are then reported as interrupted.
Each image is tested and published by its id, so another run that reuses a candidate
name cannot swap the image under this one.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from imagefactory.pipeline import freshness
from imagefactory.render.contexts import HASH_LABEL, Context, Variant, render, variants
from imagefactory.pipeline import schedule
from imagefactory.probe import smoke
from imagefactory.config import tags
from imagefactory.probe import verdicts
from imagefactory.config import netrc as netrc_mod
from imagefactory.probe.checks import FAIL, Check
from imagefactory.run.context import (UI, Building, Gpus, Network, Probing, Publishing, Pull, Reporting, RunContext,
                                      Settings, Testing, Workspace, need, or_defaults)
from imagefactory.engine.api import Builder, BuildProgress, BuildRequest, ContainerEngine
from imagefactory.errors import BuildError, Cancelled, EngineError, EngineGone, ImageFactoryError
from imagefactory.interrupt import GRACE_SECONDS, Interrupt
from imagefactory.config.model import Cell, Matrix
from imagefactory.run.results import BUILD_FAILED, BUILT, CACHED, CHECK_FAILED, INTERRUPTED, NOT_BUILT, PASSED, SKIPPED, CellReport, ListReport


BUILD_ENDED = 1 << 30  # a step number past any build's last: opens the cell's gate


@dataclass
class Outcome:
    reports: list[CellReport]
    gpus: bool  # whether the smoke tests were given GPUs
    engine_gone: str | None = None  # the error, when the engine stopped answering mid-run
    lists: list[ListReport] = field(default_factory=list)  # what publishing did with each list (publish/lists.py)


def resolve_gpus(mode: Gpus, engine: ContainerEngine) -> bool:
    """all / none, or auto: whether the engine has the NVIDIA runtime (the value was checked
    when the settings were made)."""
    return mode is Gpus.all or (mode is Gpus.auto and engine.gpus_available())


def find_built(engine: ContainerEngine, matrix: Matrix, cell: Cell, content_hash: str) -> str | None:
    """The local image built from exactly this content, if any.

    The content-hash label alone is not enough: every image built FROM a cell's image
    inherits its labels. So only an image that also carries one of the names this cell's
    image gets (its candidate name, its content-hash tag, a release tag, e.g. pulled from
    the registry as a cache source) counts. The candidate name is asked first (one inspect);
    every image with the label is listed only when it gives none."""
    candidate = tags.candidate(cell, content_hash)
    found = engine.labelled_image(candidate, HASH_LABEL, content_hash)
    if found is not None:  # the name an earlier run gave this content's image: no listing of every image
        return found
    names = {candidate, *cell.tags, tags.hash_tag(matrix.hash_tag_template, matrix.image, cell, content_hash)}
    for image_id, image_tags in engine.images_with_label(HASH_LABEL, content_hash).items():
        if names & set(image_tags):
            return image_id
    return None


# What pip and conda print when an index gave them nothing: a refused login looks the same.
_NOTHING_FOUND = ("No matching distribution found", "from versions: none", "401", "403", "PackagesNotFoundError",
                  "HTTP 000 CONNECTION FAILED", "UnavailableInvalidChannel")


def _index_failure(e: BuildError) -> bool:
    # the whole tail: after pip's last line, BuildKit quotes the failed RUN (many lines since the
    # install and the layer split are one step)
    return any(w in line for line in e.log_tail + [e.message] for w in _NOTHING_FOUND)


class _Cell:
    """The per-cell work: log file, cache lookup, build, smoke test. Reads the settings groups of
    the probe (Probing; Testing, whose defaults for push), the report (Reporting) and, in a build
    only, Building and Publishing."""

    def __init__(self, matrix: Matrix, ctx: Context, options: Settings, ui: UI, engine: ContainerEngine,
                 gpus: bool, keep_log: bool = False):
        self.matrix, self.ctx, self.options, self.ui, self.engine, self.gpus = matrix, ctx, options, ui, engine, gpus
        self.probing, self.testing = need(options, Probing), or_defaults(options, Testing)
        cell = ctx.cell
        log_path = need(options, Workspace).work_dir / "logs" / f"{cell.id}.log"
        self.report = CellReport(cell=cell.id, content_hash=ctx.content_hash,
                                 candidate=tags.candidate(cell, ctx.content_hash), log=str(log_path),
                                 base_image=cell.base_image, base_digest=cell.base_image.partition("@")[2])
        self.on_step: Callable[[int], None] = lambda step: None  # the scheduler's gate (schedule.py)
        self.passing_probe: dict | None = None  # the probe that passed the image: what attest() records
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # a re-test (test, push) appends: the build's log stays readable after it
        self.log_file = log_path.open("a" if keep_log else "w", encoding="utf-8")

    @property
    def registry_cache(self) -> bool:
        """Whether to look for the cell's content tag in the target registry (regcache.py):
        --registry-cache, else whenever the run pushes."""
        chosen = need(self.options, Building).registry_cache
        return need(self.options, Publishing).push if chosen is None else chosen

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
        # the content hash covers the Dockerfile, which differs by builder: a cached image was
        # built by the same kind of builder as this run's
        r.builder = self.engine.builder.value
        self.ui.status(cell.id, "looking for a cached image")
        existing = find_built(self.engine, self.matrix, cell, self.ctx.content_hash)
        if existing:
            self.engine.tag(existing, r.candidate)
            r.image_id, r.cached, r.status = existing, True, CACHED
            self.log(f"cached: {existing} already carries content hash {self.ctx.content_hash[:12]}")
            return True
        if self.registry_cache:
            self.ui.status(cell.id, "looking in the registry")
            from imagefactory.engine import logins  # the registry cache's: only a run that uses it
            from imagefactory.pipeline import regcache

            pulled = regcache.pull_content(self.engine, self.matrix, cell, self.ctx.content_hash,
                                           logins.registry_credentials(self.matrix), self.log)
            if pulled:
                self.engine.tag(pulled.image_id, r.candidate)
                r.image_id, r.cached, r.pulled, r.status = pulled.image_id, True, pulled.ref, CACHED
                return True
        self.ui.status(cell.id, "building")
        started = time.monotonic()
        try:
            r.image_id = self.engine.build(self.request(), log=self.log, progress=self._progress)
        except BuildError as e:
            r.status, r.error, r.failed_step, r.log_tail = BUILD_FAILED, e.message, e.step or "", e.log_tail
            netrc = need(self.options, Building).netrc
            refused = (netrc_mod.refused_indexes(self.matrix, cell, netrc.path if netrc else None)
                       if _index_failure(e) else [])
            if refused:
                r.error = f"{e.message}; index login refused: {'; '.join(refused)}"
                self.log(f"index login refused: {'; '.join(refused)}")
            return False
        finally:
            r.build_seconds = round(time.monotonic() - started, 1)
        r.status = BUILT
        return True

    def request(self) -> BuildRequest:
        """What the engine is asked to build: the cell's context, for the cell's platform."""
        building = need(self.options, Building)
        return BuildRequest(context=str(self.ctx.path), tag=self.report.candidate, platform=self.ctx.cell.platform,
                            network="host" if building.network is Network.host else None,
                            pull=self.testing.pull is Pull.always,
                            cache_from=tuple(self.cache_sources(self.engine.builder is Builder.buildkit)),
                            secrets=tuple(sorted((self.secrets() or {}).items())))

    def cache_sources(self, buildkit: bool) -> list[str]:
        """The images a build may take layers from. The classic builder reuses local images
        only; BuildKit reads a registry image's inline cache, so it also gets the cell's images
        in the target registry when the registry cache is on (regcache.py)."""
        if not buildkit:
            return [ref for ref in need(self.options, Building).cache_from if self.engine.image_id(ref)]
        refs = list(need(self.options, Building).cache_from)
        if self.registry_cache:
            from imagefactory.pipeline import regcache  # only a run that uses the registry cache

            refs += regcache.cache_sources(self.ctx.cell)
        refs = list(dict.fromkeys(refs))
        if refs:
            self.log(f"registry cache: cache from {', '.join(refs)}")
        return refs

    def secrets(self) -> dict[str, Path] | None:
        """The BuildKit secrets this cell's build mounts: the netrc, when it has a login for a host
        the cell installs from (netrc.py). Never logged: only the secret's id is."""
        netrc = need(self.options, Building).netrc
        if netrc is None or not netrc_mod.needs(netrc, self.matrix, self.ctx.cell):
            return None
        self.log(f"secret: {netrc_mod.SECRET_ID} (a netrc login, mounted at {netrc_mod.SECRET_PATH} in the install "
                 "step only)", show=False)
        return {netrc_mod.SECRET_ID: netrc.path}

    def wrong_platform(self, image: str) -> Check | None:
        """The failed image.platform check when `image` is not of the cell's platform (its config's
        os/architecture); None when it is."""
        want = self.ctx.cell.platform.oci
        actual = self.engine.image_platform(image)
        if actual == want:
            return None
        return Check("image.platform", want, actual or "none", FAIL,
                     f"image {image[:19]} is {actual or 'not inspectable'}, not {want} (the cell's platform): "
                     f"not probed, never tagged")

    def test(self, image: str) -> bool:
        r, cell = self.report, self.ctx.cell
        wrong = self.wrong_platform(image)
        if wrong:  # before the verdict cache and the probe: a wrong-arch image cannot pass
            r.checks, r.status, r.error = [wrong], CHECK_FAILED, wrong.detail
            self.log(wrong.detail)
            return False
        emulation = smoke.emulation_of(self.engine, cell)  # a foreign cell: probed through binfmt/QEMU
        r.emulated = str(emulation or "")
        if emulation:
            self.log(f"probed emulated: {emulation}; speed checks not judged")
        vdir = self.testing.verdicts_dir  # None: the cache folder's (verdicts.VERDICTS)
        vkey = verdicts.key(r.image_id or self.engine.image_id(image) or "", cell, gpus=self.gpus,
                            shm=self.testing.probe_shm, emulation=emulation, product=self.engine.product())
        hit = None if self.testing.retest else verdicts.lookup(vdir, vkey, cell)
        if hit is not None:
            r.checks, r.status, r.verdicts, r.verdicts_at = hit.checks, PASSED, CACHED, hit.at
            self.log(f"verdicts cached: image {vkey.image_id[:19]} passed probe {vkey.probe_version} at {hit.at}")
            self.passing_probe = hit.probe
            return True
        self.ui.status(cell.id, "testing")
        result = smoke.test_image(self.engine, cell, image, gpus=self.gpus, timeout=self.probing.probe_timeout,
                                  shm=self.testing.probe_shm, emulation=emulation)
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
        if result.passed:
            self.passing_probe = result.probe
        if result.probe is None:  # it never judged the image: say why (an engine error, a crash, the timeout)
            r.error = "the probe did not run: " + next((c.detail or c.actual for c in result.checks
                                                        if c.name == "probe.ran"), "no probe JSON")
        return result.passed

    def attest(self) -> None:
        """The attest step, once the probe passed, in a run that publishes (build --push, push):
        the image's SBOM and provenance (attest/record.py), from the probe that passed it, for
        signing them onto the pushed digest; their paths go into the cell's report. A run that
        pushes nothing writes neither and loads no attest code."""
        if not or_defaults(self.options, Publishing).push:
            return
        from imagefactory.attest import record  # only a run that publishes loads the attest step

        self.log(record.record(self.matrix, self.ctx.cell, self.report, self.passing_probe,
                               need(self.options, Reporting).report),
                 show=False)

    def record_size(self, image: str) -> None:
        """The image's size in the engine's store, in the report (sizes.local) whether or not it is
        pushed; an engine that will not say leaves it out, never failing the cell."""
        try:
            found = self.engine.local_image(image)
        except EngineGone:
            raise
        except EngineError:
            return
        if found is not None:
            self.report.sizes["local"] = {"size": found.size}

    def close(self) -> None:
        self.log_file.close()


def _run(matrix: Matrix, cells: list[Cell], run: RunContext, work: Callable[[_Cell], bool], *,
         keep_log: bool = False) -> Outcome:
    """Render the cells (base images pinned by digest, freshness.py), then do `work` for each
    on a pool of workers, in the order schedule.py gives: a cell that shares leading steps
    with an earlier one waits until that one has built them."""
    options, ui, interrupt, engine_factory = run.options, run.ui, run.interrupt, run.engines()
    where, testing = run.settings(Workspace), or_defaults(options, Testing)  # push: Testing's defaults
    first = engine_factory()
    contexts: list[Context] | None = None
    try:
        netrc = or_defaults(options, Building).netrc  # test, push: no netrc (they build nothing)
        contexts = render_pinned(matrix, cells, where.work_dir, first, testing.pull, interrupt,
                                 builder=first.builder, netrc_cells=netrc_cells(matrix, cells, netrc))
    except Cancelled:  # stopped while pinning base images or rendering: no cell started
        pass
    gpus = resolve_gpus(where.gpus, first)  # after the bases: the engine answered `docker info` meanwhile
    if contexts is None:
        return Outcome([CellReport(cell=c.id, status=INTERRUPTED, error="interrupted before the build started")
                        for c in cells], gpus)
    slots = schedule.plan_paths([ctx.path for ctx in contexts])
    gates = schedule.Gates(slots)
    stop = threading.Event()
    local = threading.local()
    gone: list[str] = []

    def one(index: int) -> CellReport:
        try:
            gates.wait(index)
            return one_cell(contexts[index], index)
        finally:
            gates.release(index)

    def one_cell(ctx: Context, index: int) -> CellReport:
        if stop.is_set() or interrupt.is_set():
            why = "the run was interrupted" if interrupt.is_set() else "an earlier cell failed and --fail-fast is set"
            skipped = CellReport(cell=ctx.cell.id, status=SKIPPED, content_hash=ctx.content_hash,
                                 error=f"skipped: {why}")
            ui.finish(skipped)
            return skipped
        ui.start(ctx.cell.id, "starting")
        c = None
        try:
            if not hasattr(local, "engine"):
                local.engine = engine_factory()  # one SDK client per worker thread
            c = _Cell(matrix, ctx, options, ui, local.engine, gpus, keep_log)
            c.on_step = lambda step: gates.progress(index, step)
            ok = work(c)
        except Cancelled:
            ok = False
            if c is not None:
                c.report.status, c.report.error = INTERRUPTED, "interrupted"
        except ImageFactoryError as e:  # the engine failed us mid-cell: the cell fails, the run goes on
            ok = False
            if isinstance(e, EngineGone):
                gone.append(e.message)
            if c is not None:
                built = c.report.status in (BUILT, CACHED)
                c.report.status, c.report.error = (CHECK_FAILED if built else BUILD_FAILED), e.message
        finally:
            if c is not None:
                c.close()
        report = c.report if c is not None else _unfinished(ctx, BUILD_FAILED, gone[-1] if gone else "no engine")
        if not ok and testing.fail_fast:
            stop.set()
        ui.finish(report)
        return report

    reports = _pool(contexts, [s.index for s in slots], one, testing.jobs, interrupt)
    return Outcome(reports, gpus, gone[0] if gone else None)


def netrc_cells(matrix: Matrix, cells: list[Cell], netrc: netrc_mod.Netrc | None) -> frozenset[str]:
    """The ids of the cells whose install steps mount the netrc secret."""
    return frozenset(c.id for c in cells if netrc_mod.needs(netrc, matrix, c))


def render_pinned(matrix: Matrix, cells: list[Cell], work_dir: Path, engine: ContainerEngine,
                  pull: Pull | str, interrupt: Interrupt | None = None, *, builder: Builder = Builder.classic,
                  netrc_cells: frozenset[str] = frozenset()) -> list[Context]:
    """The cells' contexts with each base image pinned to the digest it resolves to now
    (freshness.py): the content hashes every step that looks for a cell's image must use.
    Raises Cancelled once `interrupt` is set."""
    bases = freshness.resolve(engine, [c.base_image for c in cells], Pull(pull))
    return render(matrix, work_dir / "contexts", cells, bases={ref: b.pinned for ref, b in bases.items()},
                         interrupt=interrupt, builder=builder, netrc_cells=netrc_cells)


def _pool(contexts: list[Context], order: list[int], one: Callable[[int], CellReport], jobs: int,
          interrupt: Interrupt) -> list[CellReport]:
    """`one(index)` for each context, started in `order`, on `jobs` worker threads. Once
    interrupted, the workers get GRACE_SECONDS to wind down; cells still running then are
    reported as interrupted."""
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    futures: dict[int, Future[CellReport]] = {i: pool.submit(one, i) for i in order}
    deadline = None
    pending = set(futures.values())
    while pending:
        _, pending = wait_futures(pending, timeout=0.2, return_when=FIRST_COMPLETED)
        if interrupt.is_set():
            deadline = deadline or time.monotonic() + GRACE_SECONDS
            if time.monotonic() > deadline:
                break
    pool.shutdown(wait=not pending, cancel_futures=True)
    return [futures[i].result() if futures[i].done() and not futures[i].cancelled()
            else _unfinished(ctx, INTERRUPTED, "interrupted") for i, ctx in enumerate(contexts)]


def _unfinished(ctx: Context, status: str, error: str) -> CellReport:
    return CellReport(cell=ctx.cell.id, status=status, content_hash=ctx.content_hash,
                      candidate=tags.candidate(ctx.cell, ctx.content_hash), error=error)


# -- the pipeline, step by step ------------------------------------------------------------------
# Each cell: build_step (`build`; `test` and `push` take found_step instead) -> probe_step ->
# attest_step, on the workers _run starts. Then, once every cell has its report, publish_step
# (build --push, push). A failed step ends the cell's sequence; its report says why.


def build_step(c: _Cell) -> bool:
    """Build the cell's image, or reuse it (a local image of this content, or the registry's);
    the cells that share its leading layers may start once it ends. True: an image to probe."""
    built = c.build()
    c.on_step(BUILD_ENDED)  # the cells that share its layers may start now
    if built:
        c.record_size(c.report.image_id)
    return built


def found_step(matrix: Matrix, c: _Cell) -> str | None:
    """`test` and `push` build nothing: the image already built for the cell's current content,
    by either builder (find_built_by_any), given its candidate name; None: not built."""
    r, found = c.report, find_built_by_any(c.engine, matrix, c.ctx)
    if found is None:
        r.status = NOT_BUILT
        r.error = "no image for this cell's current content; run `imagefactory build` first"
        return None
    image, how = found
    if how.content_hash != r.content_hash:  # built by the other builder: its hash names it
        r.content_hash, r.candidate = how.content_hash, tags.candidate(c.ctx.cell, how.content_hash)
        c.log(f"found the image the {how.builder.value} builder built (content hash {how.content_hash[:12]})")
    r.image_id, r.cached, r.builder = image, True, how.builder.value
    c.engine.tag(image, r.candidate)
    c.record_size(image)
    return image


def probe_step(c: _Cell, image: str) -> bool:
    """Smoke-test the image in every launch mode (probe/smoke.py), or take the verdicts kept for
    it (probe/verdicts.py). True: it passed."""
    return c.test(image)


def attest_step(c: _Cell) -> None:
    """The passing image's SBOM and provenance, in a run that publishes (attest/record.py)."""
    c.attest()


def publish_step(matrix: Matrix, outcome: Outcome, run: RunContext) -> Outcome:
    """After every cell: tag and push the cells that passed, then the lists (publish/push.py);
    after an interrupt, every cell marked not published. Only a run that pushes calls it, and
    only it loads the publish code."""
    from imagefactory.publish import push

    outcome.lists = push.publish(matrix, outcome.reports, run)
    return outcome


def build(matrix: Matrix, cells: list[Cell], run: RunContext) -> Outcome:
    """Render, build (or reuse) and smoke-test every cell."""

    def work(c: _Cell) -> bool:
        if not build_step(c) or not probe_step(c, c.report.image_id):
            return False
        attest_step(c)
        return True

    return _run(matrix, cells, run, work)


def find_built_by_any(engine: ContainerEngine, matrix: Matrix, ctx: Context) -> \
        tuple[str, Variant] | None:
    """The local image built from the cell's current content by either builder (variants:
    the hash this run's builder renders first), and how it was built; None when there is none."""
    for variant in variants(matrix, ctx):
        image = find_built(engine, matrix, ctx.cell, variant.content_hash)
        if image is not None:
            return image, variant
    return None


def test(matrix: Matrix, cells: list[Cell], run: RunContext) -> Outcome:
    """Re-test the images already built for the cells' current content, whichever builder built them."""

    def work(c: _Cell) -> bool:
        image = found_step(matrix, c)
        if image is None or not probe_step(c, image):
            return False
        attest_step(c)
        return True

    return _run(matrix, cells, run, work, keep_log=True)
