"""Step 9 (publish/): tag and push the cells that passed, and nothing else.

Release tags are applied only to cells whose build and checks passed; with
`atomic`, nothing is published unless every cell passed. Pushes stream through
the SDK (whose failures arrive as stream events, not exceptions), transient
failures are retried with exponential backoff (tenacity), authentication
failures are not, and a tag counts as published only when the registry serves
the digest that was pushed. The immutable content-hash tag goes first and the
release tags after it, so an interrupted publish leaves no release tag behind
(the one being pushed when the interrupt came is removed locally too). After the per-arch
pushes, each list whose every platform passed is merged, put and read back (publish/lists.py).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from imagefactory.publish import budget as size_budget
from imagefactory.publish import lists as publish_lists
from imagefactory.publish import sizes
from imagefactory.config import refs
from imagefactory.config import registries
from imagefactory.config import tags
from imagefactory.run.context import UI, Publishing, Releasing, RunContext
from imagefactory.engine import identity
from imagefactory.engine.api import Builder, ContainerEngine, EngineFactory, PushOutcome
from imagefactory.engine.logins import Auth, auth_for, redact, registry_credentials
from imagefactory.errors import Cancelled, ConfigError, EngineError, PushError
from imagefactory.interrupt import Interrupt
from imagefactory.config.model import Matrix
from imagefactory.run.results import INTERRUPTED, NOT_PUBLISHED, PASSED, PUBLISH_FAILED, PUBLISHED, CellReport, ListReport

if TYPE_CHECKING:
    import tenacity

def git_sha() -> str | None:
    """The commit being published (GITHUB_SHA, else `git rev-parse HEAD`), checked before it
    can reach a tag."""
    sha = os.environ.get("GITHUB_SHA")
    if sha:
        if not re.fullmatch(r"[0-9a-f]{7,64}", sha):
            raise ConfigError(f"GITHUB_SHA={sha[:80]!r}: not a commit id (7 to 64 lowercase hex digits)")
        return sha
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{7,64}", sha) else None


def tags_for(matrix: Matrix, cell_id: str, content_hash: str, options: Publishing) -> list[str]:
    """Every tag a passing cell gets: release tag(s), the immutable content-hash tag, extras."""
    cell = matrix.cell(cell_id)
    release = list(cell.tags)
    immutable = tags.hash_tag(matrix.hash_tag_template, matrix.image, cell, content_hash)
    extras = [t for r in release for t in tags.extra_tags(r, matrix.extra_tags, today=options.today,
                                                             git_sha=options.git_sha)]
    return list(dict.fromkeys(release + [immutable] + extras))


def publish(matrix: Matrix, reports: list[CellReport], run: RunContext) -> list[ListReport]:
    """Tag and push every passing cell of `reports`, updating each report in place, then merge
    the lists whose every platform passed (publish/lists.py); the lists' reports. An interrupt
    stops at once: the cell being pushed is marked interrupted, later ones are not published.
    Reads the run's Publishing (attempts, backoff, git_sha, today) and Releasing (atomic, sign)."""
    creds = registry_credentials(matrix)
    options, release, ui, interrupt = run.settings(Publishing), run.settings(Releasing), run.ui, run.interrupt
    failing = [r.cell for r in reports if r.status != PASSED]
    if release.atomic and failing:
        return _refuse_all(matrix, reports, options,
                           f"not published: --atomic and {len(failing)} cell(s) failed ({', '.join(failing)})")
    make_engine = run.engines()
    engine, refused = _budgets_first(matrix, reports, make_engine, run, creds)
    if release.atomic and refused:
        return _refuse_all(matrix, reports, options, f"not published: --atomic and {len(refused)} cell(s) "
                                                     f"not within their size_budget ({', '.join(sorted(refused))})")
    pulled: dict[str, tuple[str, sizes.Pulled]] = {}  # cell -> (platform, the image as pushed)
    for r in reports:
        if r.cell in refused:
            continue
        if r.status != PASSED or interrupt.is_set():
            r.publish = NOT_PUBLISHED
            if r.status == PASSED:
                r.error = "not published: the run was interrupted"
            continue
        r.tags = tags_for(matrix, r.cell, r.content_hash, options)
        try:
            engine = engine or _can_compress(matrix, make_engine())
            immutable = tags.hash_tag(matrix.hash_tag_template, matrix.image, matrix.cell(r.cell),
                                         r.content_hash)
            order = [immutable] + [t for t in r.tags if t != immutable]
            target = _Target(creds, matrix, matrix.cell(r.cell).platform.oci)
            image = _publish_cell(engine, r, order, target, options, ui, interrupt)
            if image is not None:
                pulled[r.cell] = (matrix.cell(r.cell).platform.oci, image)
        except Cancelled:
            r.publish, r.error = INTERRUPTED, "publish interrupted"
            continue
        except (PushError, EngineError) as e:
            r.publish = PUBLISH_FAILED
            r.error = redact(e.message, creds)
            ui.status(r.cell, f"publish failed: {r.error}")
            continue
        r.publish = PUBLISHED
    fetch = sizes.siblings(pulled)  # what a node holding each sibling must fetch
    for r in reports:
        if r.cell in fetch and r.sizes:
            r.sizes["fetch_after"] = fetch[r.cell]
    lists = publish_lists.start(matrix, reports, options)  # after the per-arch pushes: their digests
    by_cell = {r.cell: r for r in reports}
    publish_lists.publish_lists(lists, run, lambda ref: auth_for(ref, creds), lambda t: redact(t, creds),
                                lambda lr: publish_lists.blocked(lr, by_cell))
    if release.sign and not interrupt.is_set():  # every push verified: sign what was published
        from imagefactory.attest import supply

        supply.sign_published(matrix, reports, run, lambda ref: auth_for(ref, creds))
    return lists


@dataclass(frozen=True)
class _Target:
    """Where one cell's tags go: each registry's credentials, the matrix (each registry's
    compression), the cell's platform (an index read back is resolved to it)."""

    creds: dict[str, Auth | None]
    matrix: Matrix
    platform: str

    def compression(self, ref: str) -> str:
        return registries.compression_for(self.matrix, ref)


def _can_compress(matrix: Matrix, engine: ContainerEngine) -> ContainerEngine:
    """`engine`, once it can push what the matrix asks: zstd and eStargz need BuildKit (buildx) and the
    containerd image store; ConfigError (exit 2) naming the fix otherwise, before anything is pushed."""
    asked = registries.recompressed(matrix)
    if not asked:
        return engine
    what = "; ".join(f"compression {how} (for {', '.join(where)})" for how, where in asked.items())
    kinds = " or ".join(asked)
    if engine.builder != Builder.buildkit:
        raise ConfigError(f"{what}: layers are recompressed by BuildKit; "
                          f"run with --builder buildkit (the classic builder cannot write {kinds})")
    if engine.describe().store != identity.CONTAINERD:
        raise ConfigError(f"{what}: this engine keeps its images in a graph-driver "
                          f"store (Docker 20.10 and overlay2), whose pushes are gzip only; use an engine with the "
                          f"containerd image store (Docker 23+ with containerd-snapshotter), or compression gzip")
    return engine


def _refuse_all(matrix: Matrix, reports: list[CellReport], options: Publishing, why: str) -> list[ListReport]:
    """--atomic: nothing is published; each passing cell says `why` unless it has its own reason."""
    for r in reports:
        r.publish = NOT_PUBLISHED
        if r.status == PASSED and not r.error:
            r.error = why
    lists = publish_lists.start(matrix, reports, options)
    publish_lists.refuse_all(lists, why)
    return lists


def _budgets_first(matrix: Matrix, reports: list[CellReport], make_engine: EngineFactory, run: RunContext,
                   creds: dict[str, Auth | None]) -> tuple[ContainerEngine | None, set[str]]:
    """Every passing cell with a size budget measured before anything is pushed (so --atomic can
    still refuse all): the engine, if one was made, and the cells that may not be pushed."""
    budgeted = [r for r in reports if r.status == PASSED and matrix.cell(r.cell).size_budget is not None]
    if not budgeted or run.interrupt.is_set():
        return None, set()
    engine = _can_compress(matrix, make_engine())
    return engine, _judge_budgets(matrix, budgeted, engine, run.ui, creds)


def _judge_budgets(matrix: Matrix, budgeted: list[CellReport], engine: ContainerEngine, ui: UI,
                   creds: dict[str, Auth | None]) -> set[str]:
    """The cells that may not be pushed: over budget (not-published), not measurable
    (publish-failed), or not measured because the run was interrupted."""
    refused = set()
    for r in budgeted:
        try:
            over = _over_budget(engine, r, matrix.cell(r.cell).size_budget or 0, ui)
        except Cancelled:
            r.publish, r.error, over = INTERRUPTED, "publish interrupted (measuring its size)", True
        except EngineError as e:
            r.publish, r.error = PUBLISH_FAILED, redact(f"size_budget: {e.message}", creds)
            ui.status(r.cell, f"publish failed: {r.error}")
            over = True
        if over:
            refused.add(r.cell)
    return refused


def _over_budget(engine: ContainerEngine, r: CellReport, budget: int, ui: UI) -> bool:
    """Measure the image before any push (publish/budget.py): True, the cell marked not published
    and why, when it is over its budget. The measure is the local image's compressed size too."""
    measured = engine.layer_sizes(r.image_id or r.candidate)
    base = size_budget.base_of(measured, r.base_image, _base_layers(engine, r.base_image))
    local = r.sizes.get("local")
    local = local if isinstance(local, dict) else {}
    r.sizes = {**r.sizes, "budget": size_budget.verdict(measured, budget, base),
               "local": {**local, "compressed": measured.total, "how": "exact" if measured.exact else "estimated"}}
    why = size_budget.refusal(measured, budget, base)
    if why:
        r.publish, r.error = NOT_PUBLISHED, why
        ui.status(r.cell, why)
    return why is not None


def _base_layers(engine: ContainerEngine, ref: str) -> tuple[str, ...] | None:
    """The diff ids of the local base image `ref`; None when it is not here or the engine will not
    say (a budget's message then names no base, never fails for it)."""
    if not ref:
        return None
    try:
        found = engine.local_image(ref)
    except EngineError:
        return None
    return found.diff_ids if found is not None else None


def _publish_cell(engine: ContainerEngine, r: CellReport, order: list[str], target: _Target,
                  options: Publishing, ui: UI, interrupt: Interrupt) -> sizes.Pulled | None:
    """Tag the tested image (by id: a candidate name may since name another image) and push
    each tag in `order`: the immutable hash tag first, release tags after it. The release tag's
    image before the push and the pushed one are read from the registry (publish/sizes.py): the
    pushed image as its registry serves it, or None when it will not say."""
    creds = target.creds
    release = order[1] if len(order) > 1 else order[0]
    previous = sizes.read_quietly(engine.registry, release, target.platform, auth_for(release, creds))
    for ref in order:
        auth = auth_for(ref, creds)  # before the tag is applied: a refused ref is never tagged
        engine.tag(r.image_id or r.candidate, ref)
        try:
            outcome = _push_with_retries(engine, ref, auth, options, ui, r.cell, interrupt, target.compression(ref))
        except Cancelled:
            engine.untag(ref)  # a release tag that was not pushed must not stay applied
            raise
        r.pushed.append({"ref": ref, "digest": outcome.digest,
                         "layers_pushed": outcome.layers_pushed,
                         "layers_existing": outcome.layers_existing})
        ui.status(r.cell, f"pushed {ref} {outcome.digest}"
                  + ("" if outcome.layers_pushed else " (registry had every layer)"))
    return _measure_pushed(engine, r, target.platform, creds, previous)


def _measure_pushed(engine: ContainerEngine, r: CellReport, platform: str, creds: dict[str, Auth | None],
                    previous: sizes.Pulled | None) -> sizes.Pulled | None:
    """The first pushed tag's image read back by digest, its figures put in the report."""
    first = r.pushed[0]
    parsed = refs.parse(first["ref"])
    if parsed is None:
        return None
    image = sizes.read_quietly(engine.registry, f"{parsed.repository}@{first['digest']}", platform,
                               auth_for(first["ref"], creds))
    if image is not None:
        r.sizes = {**sizes.with_previous(sizes.record(image), image, previous), **r.sizes}
    return image


def _push_with_retries(engine: ContainerEngine, ref: str, auth: dict[str, str] | None, options: Publishing, ui: UI,
                       cell: str, interrupt: Interrupt, compression: str = "gzip") -> PushOutcome:
    import tenacity  # a push's only: a build that pushes nothing never imports it

    def announce(state: tenacity.RetryCallState) -> None:
        e = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0
        ui.status(cell, f"push of {ref} failed (try {state.attempt_number}/{options.attempts}): "
                        f"{redact(str(e), {ref: auth})}; retrying in {wait:.0f}s")

    layers: set[str] = set()

    def on_event(event: dict) -> None:
        if event.get("status") == "Pushed" and event.get("id") not in layers:
            layers.add(event.get("id", ""))
            ui.status(cell, f"pushing {ref}: {len(layers)} layer(s) uploaded")

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(options.attempts),
        wait=tenacity.wait_exponential(multiplier=options.backoff, max=60),
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, PushError) and e.transient),
        before_sleep=announce,
        sleep=interrupt.wait,  # an interrupt ends the wait between tries (raises Cancelled)
        reraise=True,
    )
    outcome = retrying(engine.push, ref, auth_config=auth, progress=on_event, compression=compression)
    served = engine.registry_digest(ref, auth_config=auth)
    if served != outcome.digest:
        raise PushError(f"the registry serves {served or 'nothing'} for {ref}, not the pushed "
                        f"{outcome.digest}", transient=False)
    return outcome
