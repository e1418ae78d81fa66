"""Step 5: tag and push the cells that passed, and nothing else.

Release tags are applied only to cells whose build and checks passed; with
`atomic`, nothing is published unless every cell passed. Pushes stream through
the SDK (whose failures arrive as stream events, not exceptions), transient
failures are retried with exponential backoff (tenacity), authentication
failures are not, and a tag counts as published only when the registry serves
the digest that was pushed.
"""

from __future__ import annotations

import datetime as _dt
import os
import subprocess
from dataclasses import dataclass

import tenacity

from imagefactory import tags as tagging
from imagefactory.engine import Engine, PushOutcome
from imagefactory.errors import EngineError, ImageFactoryError, PushError
from imagefactory.model import Matrix
from imagefactory.report import NOT_PUBLISHED, PASSED, PUBLISH_FAILED, PUBLISHED, CellReport

USER_ENV = "IMAGEFACTORY_REGISTRY_USER"
PASSWORD_ENV = "IMAGEFACTORY_REGISTRY_PASSWORD"


@dataclass(frozen=True)
class Options:
    atomic: bool = False
    attempts: int = 4  # tries per tag, the first included
    backoff: float = 2.0  # seconds before the first retry; doubles each time, at most 60 s
    git_sha: str | None = None
    today: _dt.date | None = None


def credentials() -> dict[str, str] | None:
    """Credentials from the environment, else None: the SDK then uses the Docker config
    and its credential helpers (`docker login`). Never printed or stored."""
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if user and password:
        return {"username": user, "password": password}
    if user or password:
        raise ImageFactoryError(f"set both {USER_ENV} and {PASSWORD_ENV}, or neither (to use `docker login`)")
    return None


def git_sha() -> str | None:
    sha = os.environ.get("GITHUB_SHA")
    if sha:
        return sha
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def tags_for(matrix: Matrix, cell_id: str, content_hash: str, options: Options) -> list[str]:
    """Every tag a passing cell gets: release tag(s), the immutable content-hash tag, extras."""
    cell = matrix.cell(cell_id)
    release = list(cell.tags)
    immutable = tagging.hash_tag(matrix.hash_tag_template, matrix.image, cell, content_hash)
    extras = [t for r in release for t in tagging.extra_tags(r, matrix.extra_tags, today=options.today,
                                                             git_sha=options.git_sha)]
    return list(dict.fromkeys(release + [immutable] + extras))


def _redact(text: str, auth: dict[str, str] | None) -> str:
    if auth and auth.get("password"):
        text = text.replace(auth["password"], "***")
    return text


def publish(matrix: Matrix, reports: list[CellReport], *, options: Options, ui) -> None:
    """Tag and push every passing cell of `reports`, updating each report in place."""
    auth = credentials()
    failing = [r.cell for r in reports if r.status != PASSED]
    if options.atomic and failing:
        for r in reports:
            r.publish = NOT_PUBLISHED
            if r.status == PASSED:
                r.error = f"not published: --atomic and {len(failing)} cell(s) failed ({', '.join(failing)})"
        return
    engine = Engine()
    for r in reports:
        if r.status != PASSED:
            r.publish = NOT_PUBLISHED
            continue
        r.tags = tags_for(matrix, r.cell, r.content_hash, options)
        try:
            for ref in r.tags:
                engine.tag(r.candidate, ref)
            for ref in r.tags:
                outcome = _push_with_retries(engine, ref, auth, options, ui, r.cell)
                r.pushed.append({"ref": ref, "digest": outcome.digest,
                                 "layers_pushed": outcome.layers_pushed,
                                 "layers_existing": outcome.layers_existing})
                ui.status(r.cell, f"pushed {ref} {outcome.digest}"
                          + ("" if outcome.layers_pushed else " (registry had every layer)"))
        except (PushError, EngineError) as e:
            r.publish = PUBLISH_FAILED
            r.error = _redact(e.message, auth)
            ui.status(r.cell, f"publish failed: {r.error}")
            continue
        r.publish = PUBLISHED


def _push_with_retries(engine: Engine, ref: str, auth, options: Options, ui, cell: str) -> PushOutcome:
    def announce(state: tenacity.RetryCallState) -> None:
        e = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0
        ui.status(cell, f"push of {ref} failed (try {state.attempt_number}/{options.attempts}): "
                        f"{_redact(str(e), auth)}; retrying in {wait:.0f}s")

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
        reraise=True,
    )
    outcome = retrying(engine.push, ref, auth_config=auth, progress=on_event)
    served = engine.registry_digest(ref, auth_config=auth)
    if served != outcome.digest:
        raise PushError(f"the registry serves {served or 'nothing'} for {ref}, not the pushed "
                        f"{outcome.digest}", transient=False)
    return outcome
