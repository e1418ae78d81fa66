"""Issue 23 item 7 against the real engine and the real authenticated registry: two cell jobs (one
per platform) are simulated by pushing a tiny FROM-scratch image of each architecture under the
per-arch tag and content-hash tag the matrix plans, and writing the report each job would; then
`python3 -m imagefactory merge` runs as the merge job does. The registry then serves the list, and
`docker pull --platform` of each platform gets the digest that cell's report named. With the arm64
report missing, the list is refused naming that cell, and nothing is put."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from imagefactory.config import matrix as matrix_mod
from imagefactory.config import tags
from tests.integration.helpers import (RUN_ID, TEST_PASSWORD, TEST_REGISTRY, TEST_USER, assert_pulls_its_cell, docker_cli,
                                       registry_digest,
                                       run_cli, served_list)

pytestmark = [pytest.mark.docker, pytest.mark.registry]

MATRIX = """\
image: {image}
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
  platform: [linux/amd64, linux/arm64]
torch: "2.10.0"
threads: 1
pip: {{torch_index_url: null, wheelhouse: wheels}}
"""


def _project(tmp_path: Path, repo: str) -> matrix_mod.Matrix:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.10.0+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"x")
    (tmp_path / "matrix.yaml").write_text(MATRIX.format(image=f"{TEST_REGISTRY}/{repo}"))
    return matrix_mod.load(tmp_path / "matrix.yaml")


def _cell_job(m: matrix_mod.Matrix, cell_id: str, image_id: str, config: Path, reports: Path) -> str:
    """What `build --only CELL --push --report reports/report-CELL.json` leaves: the image pushed under its
    content-hash tag and its per-arch tag, and a report naming both with the digest the registry serves."""
    cell = m.cell(cell_id)
    content_hash = hashlib.sha256(f"{RUN_ID}{cell_id}".encode()).hexdigest()
    pushed = []
    for ref in (tags.hash_tag(m.hash_tag_template, m.image, cell, content_hash), cell.tags[0]):
        docker_cli("tag", image_id, ref)
        docker_cli("push", ref, config=config)
        repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
        pushed.append({"ref": ref, "digest": registry_digest(TEST_REGISTRY, repo, tag)})
    assert pushed[0]["digest"] == pushed[1]["digest"] and pushed[0]["digest"]
    doc = {"ok": True, "gpus": False, "lists": [],
           "cells": [{"cell": cell_id, "status": "passed", "content_hash": content_hash, "publish": "published",
                      "image_id": image_id, "pushed": pushed, "checks": []}]}
    path = reports / f"report-{cell_id}" / f"report-{cell_id}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc, indent=2))
    return pushed[1]["digest"]


def _merge(tmp_path: Path) -> subprocess.CompletedProcess:
    return run_cli("merge", "--matrix", str(tmp_path / "matrix.yaml"), "--reports", str(tmp_path / "reports"),
                   "--report", str(tmp_path / "out" / "report-merge.json"), "--plain", "--retry-delay", "0",
                   env={"IMAGEFACTORY_REGISTRY_USER": TEST_USER, "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD},
                   timeout=300)


def test_the_merge_job_publishes_the_list_of_two_cell_jobs_and_each_platform_pulls_its_cell(
        tiny, test_registry, logged_in, tmp_path):
    m = _project(tmp_path, f"merge-{RUN_ID}/hello")
    (taglist,) = m.lists
    digests = {platform: _cell_job(m, cell, tiny[platform], logged_in, tmp_path / "reports")
               for cell, platform, _ in taglist.members}
    assert served_list(taglist.ref).status_code == 404  # no cell job put the list
    done = _merge(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    served = served_list(taglist.ref)
    assert served.status_code == 200
    index = served.json()
    assert {f"{d['platform']['os']}/{d['platform']['architecture']}": d["digest"] for d in index["manifests"]} == digests
    (lr,) = json.loads((tmp_path / "out" / "report-merge.json").read_text())["lists"]
    assert lr["publish"] == "published" and served.headers["Docker-Content-Digest"] == lr["digest"]
    for platform, image_id in tiny.items():
        assert_pulls_its_cell(taglist.ref, platform, image_id, digests, logged_in)


def test_without_the_arm64_report_the_list_is_refused_naming_the_cell_and_not_put(tiny, test_registry, logged_in,
                                                                                 tmp_path):
    m = _project(tmp_path, f"merge-{RUN_ID}/half")
    (taglist,) = m.lists
    amd = next(cell for cell, platform, _ in taglist.members if platform == "linux/amd64")
    arm = next(cell for cell, platform, _ in taglist.members if platform == "linux/arm64")
    _cell_job(m, amd, tiny["linux/amd64"], logged_in, tmp_path / "reports")
    done = _merge(tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"{arm} (linux/arm64) has no report" in done.stdout
    assert served_list(taglist.ref).status_code == 404
