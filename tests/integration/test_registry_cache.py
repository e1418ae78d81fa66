"""issue 16, item 4: the registry as a cache, on the real engine and the real auth registry
(127.0.0.1:5001).

Each test runs its second half as a fresh CI runner would: the cell is made unique to the test
(an `env:` value no other image has), so nothing local matches it but what the test built; the
test then removes its own images (never anyone else's: the shared engine is not wiped) and
gives the run a verdict cache of its own."""

from __future__ import annotations

import datetime as dt
import json
import random
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.helpers import (TEST_PASSWORD, TEST_REGISTRY, TEST_USER, Build, Registry, buildkit_steps,
                                        registry_digest, run_cli)

pytestmark = [pytest.mark.docker, pytest.mark.registry]

CREDS = {"IMAGEFACTORY_REGISTRY_USER": TEST_USER, "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD}


def unique_matrix(source: Path, root: Path, image: str, token: str) -> Path:
    """The good cell of the matrix at `source` under `image`, made unique by an env value (its heavy
    layers are the source build's), judged without the torch.compile child."""
    text = re.sub(r"(?m)^image: .*$", f"image: {image}", source.read_text())
    path = root / "matrix.yaml"
    path.write_text(text + f"compiler: false\nenv: {{IMAGEFACTORY_TEST_RUN: \"{token}\"}}\n")
    return path


def run(matrix, root, name: str, *args: str):
    """`build --push` of the good cell, as runner `name`: its own work dir, report and verdict cache."""
    env = {**CREDS, "IMAGEFACTORY_CACHE_DIR": str(root / f"verdicts-{name}")}
    report = root / f"report-{name}.json"
    result = run_cli("build", "--matrix", str(matrix), "--only", Build.GOOD, "--push", "--plain", "--report",
                     str(report), "--work-dir", str(root / f"work-{name}"), *args, env=env)
    assert report.exists(), result.stdout[-2000:] + result.stderr[-2000:]
    cell = {c["cell"]: c for c in json.loads(report.read_text())["cells"]}[Build.GOOD]
    return result, cell, open(cell["log"]).read(), report.with_suffix(".md").read_text()


def forget_locally(engine, cell: dict) -> None:
    """Remove the test's own image (every name it has): the engine no longer has this cell."""
    # noprune: its untagged parents are the shared build's cached steps up to its own env step (the
    # containerd store removes a parent that still has children, and every later classic build of the
    # shared cell rebuilt torch's step cold); its own steps go with the run's leftovers
    engine.client.images.remove(cell["image_id"], force=True, noprune=True)
    assert engine.image_id(cell["image_id"]) is None


def test_a_pushed_content_tag_is_pulled_on_a_fresh_runner_not_built(cpu_build, test_registry, engine, tmp_path,
                                                                     session_id, created_images):
    image = f"{TEST_REGISTRY}/regcache-{session_id}/train"
    matrix = unique_matrix(cpu_build.matrix, tmp_path, image, uuid.uuid4().hex)
    result, first, log, _ = run(matrix, tmp_path, "first")
    created_images.extend(first["tags"])
    assert first["status"] == "passed" and first["publish"] == "published", result.stdout + result.stderr
    assert not first["pulled"] and "Step 1/" in log  # nothing to pull yet: built
    hash_ref = first["pushed"][0]["ref"]
    digest = registry_digest(TEST_REGISTRY, image.split("/", 1)[1], hash_ref.rsplit(":", 1)[1])

    forget_locally(engine, first)
    result, again, log, summary = run(matrix, tmp_path, "fresh")
    assert again["status"] == "passed" and again["publish"] == "published", result.stdout + result.stderr
    assert again["pulled"] == f"{hash_ref}@{digest}"
    assert again["image_id"] == first["image_id"]  # the very image the first runner built and tested
    assert again["build_seconds"] == 0 and "Step " not in log and f"registry cache: pulled {hash_ref}@" in log
    assert again["verdicts"] == "probed"  # a fresh runner's verdict cache is empty: probed
    assert all(p["layers_pushed"] == [] for p in again["pushed"])
    assert "passed (pulled, not built)" in summary


def prune_build_cache_since(started: float) -> int:
    """Remove the BuildKit cache records made since `started` (this test's builds: the docker
    lock keeps other builds out), one id at a time (buildx takes one id per filter), children
    before parents. The records other builds made stay."""
    first: set[str] | None = None
    left: set[str] | None = None
    while True:  # a round removes the records nothing else uses: the chain shortens each round
        out = subprocess.run(["docker", "buildx", "du", "--verbose"], capture_output=True, text=True, check=True)
        ids = {rec["ID"] for rec in _records(out.stdout) if _created(rec) >= started}
        first = ids if first is None else first
        if not ids:
            return len(first)
        if ids == left:  # `buildx prune` exits 0 having removed nothing: progress is the only sign
            raise AssertionError(f"could not prune this test's build cache records: {sorted(ids)}")
        left = ids
        for record in sorted(ids):
            # -a: a record marked shared (the launch stage's RUN, whose tree the final stage copies)
            # goes only with --all; the id filter still limits it to this one record
            subprocess.run(["docker", "buildx", "prune", "-af", "--filter", f"id={record}"],
                           capture_output=True, text=True)


def _records(text: str) -> list[dict[str, str]]:
    records, current = [], {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not line.strip():
            if current:
                records.append(current)
            current = {}
        elif sep and key.strip() in ("ID", "Created at", "Description"):
            current[key.strip()] = value.strip()
    return records + ([current] if current else [])


def _created(record: dict[str, str]) -> float:
    stamp = re.fullmatch(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)? \+0000 UTC", record.get("Created at", ""))
    assert stamp, record
    return dt.datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc).timestamp()


def _warm_venv_stage(bk_build, root: Path, image: str, netrc: tuple[str, ...], created_images: list) -> None:
    """Make sure BuildKit holds the venv stage's records before the test starts its clock: a
    build of the cell with a final stage of its own (another env value), not pushed. With
    bk_build's records still there it is cache hits up to the final stage; without them (on the
    containerd-store engine another module's BuildKit work had dropped them by the time this
    test ran, in two full runs) it builds the stage again, before the clock, not after."""
    root.mkdir()
    matrix = unique_matrix(bk_build.matrix, root, image, uuid.uuid4().hex)
    report = root / "report.json"
    result = run_cli("build", "--matrix", str(matrix), "--only", Build.GOOD, "--plain", "--report", str(report),
                     "--work-dir", str(root / "work"), "--builder", "buildkit", *netrc,
                     env={"IMAGEFACTORY_CACHE_DIR": str(root / "verdicts")})
    assert report.exists(), result.stdout[-2000:] + result.stderr[-2000:]
    cell = {c["cell"]: c for c in json.loads(report.read_text())["cells"]}[Build.GOOD]
    created_images.extend(cell["tags"] + ([cell["candidate"]] if cell.get("candidate") else []))
    assert cell["status"] == "passed", result.stdout[-2000:] + result.stderr[-2000:]


def test_a_changed_cell_reuses_the_registrys_inline_cache_on_a_fresh_runner(bk_build, engine, tmp_path,
                                                                            created_images):
    """BuildKit: the first runner pushes the cell with inline cache metadata; a fresh runner builds
    the cell changed (threads) and reuses the unchanged steps of the final stage from the
    registry's image.

    The cell is bk_build's (same venv stage: that stage comes from BuildKit's cache in both builds,
    so this test makes no cold build) with a uid and an env value of its own: its final stage's
    layers from the user's on exist nowhere else. Between the runners the first runner's image and
    every BuildKit cache record made since this test started are removed, so those layers can
    only come from the registry. (Inline cache holds the final stage's layers only: a fresh runner
    without bk_build's records would build the venv stage again.)"""
    (tmp_path / "registry").mkdir()
    registry = Registry(tmp_path / "registry")  # no auth: buildx reads only `docker login` credentials
    netrc = ("--netrc", str(bk_build.netrc))
    try:
        image = f"{registry.address}/regcache/train"
        _warm_venv_stage(bk_build, tmp_path / "warm", f"{registry.address}/regcache/warm", netrc, created_images)
        started = time.time() - 1
        matrix = unique_matrix(bk_build.matrix, tmp_path, image, uuid.uuid4().hex)
        matrix.write_text(matrix.read_text() + f"user: {{uid: {random.randint(20000, 60000)}}}\n")
        result, first, log, _ = run(matrix, tmp_path, "first", "--builder", "buildkit", *netrc)
        created_images.extend(first["tags"])
        assert first["status"] == "passed" and first["publish"] == "published", result.stdout + result.stderr
        assert first["builder"] == "buildkit"
        assert any("[venv " in s for s, cached in buildkit_steps(log).items() if cached), log  # bk_build's venv stage
        forget_locally(engine, first)
        assert prune_build_cache_since(started) > 0

        changed = tmp_path / "changed.yaml"
        changed.write_text(matrix.read_text().replace("threads: 2", "threads: 1"))
        result, again, log, _ = run(changed, tmp_path, "fresh", "--builder", "buildkit", *netrc)
        created_images.extend(again["tags"])
        assert again["status"] == "passed" and not again["pulled"], result.stdout + result.stderr
        assert again["content_hash"] != first["content_hash"]
        built = buildkit_steps(log)
        reused = [s for s, cached in built.items() if cached]
        # the user's layer exists only in the registry now (its uid is this test's): reused from the
        # pushed image's inline cache, and the venv copy after it too
        assert any("useradd" in s for s in reused), built
        assert any(re.search(r"COPY (--link )?--from=venv", s) for s in reused), built
        assert not all(built.values()), built  # the changed steps did run
        assert f"registry cache: cache from {image}:2.13.0-py3.11-cpu-openblas-pip" in log
    finally:
        registry.stop()
