"""What leaves with a passing image: its SBOM and provenance (written beside the report for every
cell that passes), and, with `--sign KEY`, a signature and both documents as attestations on
every digest it was pushed under.

- record.py writes both documents after a cell passed (the pipeline calls it after the probe).
- sign_published(): after publish/push.py verified each push, sign each distinct pushed digest once
  (signing.py runs cosign). With --atomic, nothing is signed unless every cell was published.
  A cell whose signing fails is reported publish-failed (exit 1), with cosign's reason.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

from imagefactory.config import refs
from imagefactory.attest import sbom
from imagefactory.attest import signing
from imagefactory.run.context import Releasing, RunContext
from imagefactory.errors import ImageFactoryError
from imagefactory.config.model import Matrix
from imagefactory.run.results import PASSED, PUBLISH_FAILED, PUBLISHED, CellReport

SIGNED, SIGN_FAILED, NOT_SIGNED = "signed", "sign-failed", "not-signed"


def _targets(r: CellReport) -> list[str]:
    """Each distinct repository@digest the cell was pushed as (its tags share digests)."""
    out = []
    for p in r.pushed:
        repo = refs.repository(str(p.get("ref", "")))
        digest = str(p.get("digest", ""))
        if repo and sbom.IMAGE_ID_RE.fullmatch(digest):
            out.append(f"{repo}@{digest}")
    return list(dict.fromkeys(out))


def sign_published(matrix: Matrix, reports: list[CellReport], run: RunContext,
                   auth_for: Callable[[str], dict[str, str] | None]) -> None:
    """Sign every published cell's digests with the run's Releasing.sign (a checked key reference).
    `auth_for(reference)`: the login of the registry that holds it (publish/push.py's own rule, handed
    in so this module never imports publish, which calls it)."""
    release = run.settings(Releasing)
    key = signing.Key(release.sign or "", kms=bool(signing.KMS_RE.fullmatch(release.sign or "")))
    unpublished = [r.cell for r in reports if r.status == PASSED and r.publish != PUBLISHED]
    if release.atomic and unpublished:
        for r in reports:
            if r.publish == PUBLISHED:
                r.signing = NOT_SIGNED
                r.error = f"not signed: --atomic and {len(unpublished)} cell(s) not published ({', '.join(unpublished)})"
        return
    engine = None
    for r in reports:
        if r.publish != PUBLISHED:
            continue
        try:
            engine = engine or run.engines()()
            for pinned in _targets(r):
                auth = auth_for(pinned.split("@", 1)[0])
                signed = _sign_one(key, pinned, r, auth)
                digests = {ref: engine.registry_digest(ref, auth_config=auth)
                           for ref in (signed.signature, signed.attestations)}
                r.signatures.append(signed.as_dict(digests))
                run.ui.status(r.cell, f"signed {pinned}")
            r.signing = SIGNED
        except ImageFactoryError as e:
            r.signing, r.publish = SIGN_FAILED, PUBLISH_FAILED
            r.error = f"signing failed: {e.message}"
            run.ui.status(r.cell, r.error)


def _sign_one(key: signing.Key, pinned: str, r: CellReport, auth: dict[str, str] | None) -> signing.Signed:
    if not r.sbom or not r.provenance:
        raise sbom.SbomError(f"cell {r.cell}: no SBOM or provenance was written for this image")
    statement = json.loads(Path(r.provenance).read_text())
    with tempfile.TemporaryDirectory(prefix="imagefactory-predicate-") as tmp:
        predicate = Path(tmp) / "provenance.json"
        predicate.write_text(json.dumps(statement["predicate"], sort_keys=True))
        return signing.sign(key, pinned, Path(r.sbom), predicate, auth)
