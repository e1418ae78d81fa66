"""Step 5: tag and push the cells that passed, and nothing else.

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
from typing import TYPE_CHECKING

from imagefactory.publish import lists as publish_lists
from imagefactory.config import tags as tagging
from imagefactory.run.context import UI, Publishing, Releasing, RunContext
from imagefactory.engine.api import ContainerEngine, PushOutcome
from imagefactory.engine.logins import Auth, auth_for, redact, registry_credentials
from imagefactory.errors import Cancelled, ConfigError, EngineError, PushError
from imagefactory.interrupt import Interrupt
from imagefactory.config.model import Matrix
from imagefactory.report.summary import (INTERRUPTED, NOT_PUBLISHED, PASSED, PUBLISH_FAILED, PUBLISHED, CellReport,
                                 ListReport)

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
    immutable = tagging.hash_tag(matrix.hash_tag_template, matrix.image, cell, content_hash)
    extras = [t for r in release for t in tagging.extra_tags(r, matrix.extra_tags, today=options.today,
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
        why = f"not published: --atomic and {len(failing)} cell(s) failed ({', '.join(failing)})"
        for r in reports:
            r.publish = NOT_PUBLISHED
            if r.status == PASSED:
                r.error = why
        lists = publish_lists.start(matrix, reports, options)
        publish_lists.refuse_all(lists, why)
        return lists
    make_engine = run.engines()
    engine: ContainerEngine | None = None  # made when the first cell is published
    for r in reports:
        if r.status != PASSED or interrupt.is_set():
            r.publish = NOT_PUBLISHED
            if r.status == PASSED:
                r.error = "not published: the run was interrupted"
            continue
        r.tags = tags_for(matrix, r.cell, r.content_hash, options)
        try:
            engine = engine or make_engine()
            immutable = tagging.hash_tag(matrix.hash_tag_template, matrix.image, matrix.cell(r.cell),
                                         r.content_hash)
            order = [immutable] + [t for t in r.tags if t != immutable]
            _publish_cell(engine, r, order, creds, options, ui, interrupt)
        except Cancelled:
            r.publish, r.error = INTERRUPTED, "publish interrupted"
            continue
        except (PushError, EngineError) as e:
            r.publish = PUBLISH_FAILED
            r.error = redact(e.message, creds)
            ui.status(r.cell, f"publish failed: {r.error}")
            continue
        r.publish = PUBLISHED
    lists = publish_lists.start(matrix, reports, options)  # after the per-arch pushes: their digests
    by_cell = {r.cell: r for r in reports}
    publish_lists.publish_lists(lists, run, lambda ref: auth_for(ref, creds), lambda t: redact(t, creds),
                                lambda lr: publish_lists.blocked(lr, by_cell))
    if release.sign and not interrupt.is_set():  # every push verified: sign what was published
        from imagefactory.attest import supply

        supply.sign_published(matrix, reports, run, lambda ref: auth_for(ref, creds))
    return lists


def _publish_cell(engine: ContainerEngine, r: CellReport, order: list[str], creds: dict[str, Auth | None],
                  options: Publishing, ui: UI, interrupt: Interrupt) -> None:
    """Tag the tested image (by id: a candidate name may since name another image) and push
    each tag in `order`: the immutable hash tag first, release tags after it."""
    for ref in order:
        auth = auth_for(ref, creds)  # before the tag is applied: a refused ref is never tagged
        engine.tag(r.image_id or r.candidate, ref)
        try:
            outcome = _push_with_retries(engine, ref, auth, options, ui, r.cell, interrupt)
        except Cancelled:
            engine.untag(ref)  # a release tag that was not pushed must not stay applied
            raise
        r.pushed.append({"ref": ref, "digest": outcome.digest,
                         "layers_pushed": outcome.layers_pushed,
                         "layers_existing": outcome.layers_existing})
        ui.status(r.cell, f"pushed {ref} {outcome.digest}"
                  + ("" if outcome.layers_pushed else " (registry had every layer)"))


def _push_with_retries(engine: ContainerEngine, ref: str, auth: dict[str, str] | None, options: Publishing, ui: UI,
                       cell: str, interrupt: Interrupt) -> PushOutcome:
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
    outcome = retrying(engine.push, ref, auth_config=auth, progress=on_event)
    served = engine.registry_digest(ref, auth_config=auth)
    if served != outcome.digest:
        raise PushError(f"the registry serves {served or 'nothing'} for {ref}, not the pushed "
                        f"{outcome.digest}", transient=False)
    return outcome
