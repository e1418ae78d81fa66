"""The documents that go with a passing image: its SBOM, from the probe's inventory (sbom.py), and
its provenance statement (provenance.py), written under build/sbom/ and build/provenance/ beside
the report. The pipeline calls record() after a cell passed its probe (probed now, or its verdicts
cached); signing them onto pushed digests is supply.py's, after publish.
"""

from __future__ import annotations

import json
from pathlib import Path

from imagefactory.attest import provenance, sbom
from imagefactory.config.model import Cell, Matrix
from imagefactory.files import fsutil
from imagefactory.lock import lockfile
from imagefactory.run.results import CellReport


def record(matrix: Matrix, cell: Cell, report: CellReport, probes: dict | None, report_path: Path) -> str:
    """Write the SBOM and the provenance of a cell that passed; their paths go into `report`.
    Returns what the cell's log says. An image without the probe's inventory (a probe from before
    it) or without an image id gets none, and cannot be signed; an SBOM that does not validate
    is an error."""
    probe = sbom.probe_for_sbom(probes or {})
    if probe is None or not sbom.IMAGE_ID_RE.fullmatch(report.image_id):
        return "sbom: none (the probe gave no inventory, or the image has no id)"
    lock = lockfile.load(matrix, cell)
    subject = sbom.Subject(image=matrix.image, cell=cell.id, content_hash=report.content_hash,
                           image_id=report.image_id, base_image=cell.base_image)
    text = sbom.document(subject, probe, lock)
    sbom_path = sbom.write(sbom.path_for(report_path, cell.id), text)
    pred = provenance.predicate(
        matrix_path=matrix.path, cell=cell.id, content_hash=report.content_hash, builder=report.builder or "classic",
        base_image=cell.base_image, lock_path=lockfile.path_for(matrix, cell) if lock is not None else None,
        sbom_sha256=provenance.sha256_text(text), git=provenance.git_commit(matrix.directory, matrix.path))
    prov_path = provenance.path_for(report_path, cell.id)
    prov_path.parent.mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write(prov_path, provenance.text(provenance.statement(matrix.image, report.image_id, pred)))
    report.sbom, report.provenance = str(sbom_path), str(prov_path)
    return f"sbom: {sbom_path} ({len(json.loads(text).get('components') or ())} components); provenance: {prov_path}"
