"""Issue 23 part 5 against the real engine and the real authenticated registry: two tiny images of
two architectures (FROM scratch + one file, built with buildx), pushed per-arch by publish.py,
merged into one list by publish_lists.py; `docker pull --platform` of the list then gets, for each
platform, the image whose digest was pushed for that cell. A list with a failed member is not put."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from imagefactory.engine import select
from imagefactory.config import platforms
from imagefactory.publish import push
from imagefactory.config import tags
from imagefactory.run.context import PushOptions, RunContext, Silent
from imagefactory.interrupt import Interrupt
from imagefactory.config.model import Cell, Matrix
from imagefactory.run.results import CHECK_FAILED, PASSED, CellReport
from tests.integration.helpers import (RUN_ID, TEST_PASSWORD, TEST_REGISTRY, TEST_USER, assert_pulls_its_cell, served_list)

pytestmark = [pytest.mark.docker, pytest.mark.registry]


def _matrix(tmp_path: Path, repo: str) -> Matrix:
    cells = [Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.10.0", threads=1,
                  base_image="scratch", platform=p) for p in (platforms.AMD64, platforms.ARM64)]
    image = f"{TEST_REGISTRY}/{repo}"
    template = Matrix(tmp_path / "matrix.yaml", image, ()).tag_template
    own, lists = tags.plan([(c, tags.release_tag(template, image, c)) for c in cells])
    cells = [Cell(**{**c.__dict__, "tags": (t,)}) for c, t in zip(cells, own)]
    return Matrix(tmp_path / "matrix.yaml", image, tuple(cells), lists=lists)


def _publish(matrix: Matrix, tiny: dict[str, str], status: dict[str, str], monkeypatch, *, env_login: bool = True):
    if env_login:
        monkeypatch.setenv("IMAGEFACTORY_REGISTRY_USER", TEST_USER)
        monkeypatch.setenv("IMAGEFACTORY_REGISTRY_PASSWORD", TEST_PASSWORD)
    reports = [CellReport(c.id, status=status.get(c.platform.oci, PASSED), image_id=tiny[c.platform.oci],
                          content_hash=hashlib.sha256(f"{RUN_ID}{c.id}".encode()).hexdigest()) for c in matrix.cells]
    interrupt = Interrupt()
    run = RunContext(PushOptions(backoff=0), Silent(), interrupt, select.docker_factory(interrupt))
    return {r.cell: r for r in reports}, push.publish(matrix, reports, run)


def test_a_list_of_two_real_architectures_is_merged_and_each_platform_pulls_its_cell(
        tiny, test_registry, logged_in, tmp_path, monkeypatch):
    matrix = _matrix(tmp_path, f"lists-{RUN_ID}/hello")
    reports, (lr,) = _publish(matrix, tiny, {}, monkeypatch)
    assert all(r.publish == "published" for r in reports.values()), [r.error for r in reports.values()]
    assert lr.publish == "published", lr.reason
    pushed = {m["platform"]: m["digest"] for m in lr.members}
    served = served_list(lr.ref)
    assert served.status_code == 200 and served.headers["Docker-Content-Digest"] == lr.digest
    index = served.json()
    assert {f"{d['platform']['os']}/{d['platform']['architecture']}": d["digest"] for d in index["manifests"]} == pushed
    for platform, image_id in tiny.items():
        assert_pulls_its_cell(lr.ref, platform, image_id, pushed, logged_in)


def test_a_list_whose_arm64_cell_failed_is_not_put_and_amd64_keeps_its_tag(tiny, test_registry, tmp_path,
                                                                          monkeypatch):
    matrix = _matrix(tmp_path, f"lists-{RUN_ID}/half")
    reports, (lr,) = _publish(matrix, tiny, {"linux/arm64": CHECK_FAILED}, monkeypatch)
    amd, arm = matrix.cells
    assert reports[amd.id].publish == "published" and served_list(amd.tags[0]).status_code == 200
    assert lr.publish == "not-published" and arm.id in lr.reason
    assert served_list(lr.ref).status_code == 404 and served_list(arm.tags[0]).status_code == 404


def test_with_docker_login_only_the_list_gets_the_login_the_pushes_got(tiny, test_registry, logged_in, tmp_path,
                                                                       monkeypatch):
    for name in ("IMAGEFACTORY_REGISTRY_USER", "IMAGEFACTORY_REGISTRY_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(logged_in))
    matrix = _matrix(tmp_path, f"lists-{RUN_ID}/login")
    reports, (lr,) = _publish(matrix, tiny, {}, monkeypatch, env_login=False)
    assert all(r.publish == "published" for r in reports.values()), [r.error for r in reports.values()]
    assert lr.publish == "published", lr.reason
    assert served_list(lr.ref).headers["Docker-Content-Digest"] == lr.digest
