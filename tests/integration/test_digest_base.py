"""issue 11: a base image pinned by digest builds for real.

The digest is read from the base-image registry, so the test pins exactly what is there."""

from __future__ import annotations

import json

import pytest

from imagefactory.config import matrix
from tests.integration.helpers import TEST_REGISTRY, matrix_text, registry_digest, run_cli

pytestmark = pytest.mark.docker


def test_a_digest_pinned_base_image_builds_and_passes(tmp_path, engine, base_registry, wheelhouse, session_id,
                                                     created_images, cpu_build):
    """The shared cpu_build's good cell, its base named by digest: every layer is shared."""
    digest = registry_digest(base_registry, "library/python", "3.11-slim-bookworm", auth=None)
    assert digest and digest.startswith("sha256:"), "the base-image registry serves no python:3.11-slim-bookworm"
    path = tmp_path / "matrix.yaml"
    path.write_text(matrix_text(image=f"{TEST_REGISTRY}/it-{session_id}/digest", wheelhouse=wheelhouse)
                    + f'base_images: {{pip: "python:3.11-slim-bookworm@{digest}"}}\n')
    pinned = f"{base_registry}/library/python:3.11-slim-bookworm@{digest}"
    (cell,) = matrix.load(path).cells
    assert cell.base_image == pinned

    report, work = tmp_path / "report.json", tmp_path / "work"
    result = run_cli("build", "--matrix", str(path), "--plain", "--report", str(report), "--work-dir", str(work))
    cells = {c["cell"]: c for c in json.loads(report.read_text())["cells"]} if report.exists() else {}
    for c in cells.values():
        if c.get("candidate"):
            created_images.append(c["candidate"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert cells[cell.id]["status"] == "passed", cells[cell.id]

    dockerfile = (work / "contexts" / cell.id / "Dockerfile").read_text()
    assert [line.split()[1] for line in dockerfile.splitlines() if line.startswith("FROM ")] == [pinned] * 3  # venv, launch, final
    labels = engine.client.images.get(cells[cell.id]["candidate"]).labels
    assert labels["org.opencontainers.image.base.name"] == pinned
