"""build.build/test with an in-memory engine: what is rebuilt, what is probed, in which order.

The real-engine counterpart is tests/integration/test_freshness.py."""

from __future__ import annotations

import re
import threading

import pytest

from imagefactory.pipeline import build
from imagefactory.pipeline import bases as freshness
from imagefactory.config import matrix
from imagefactory.pipeline import schedule
from tests.fake_engine import World
from imagefactory.report.summary import CACHED, NOT_BUILT, PASSED
from tests.unit.helpers import BASE_DIGESTS, TWO_PIP_CELLS, good_probe

MATRIX = TWO_PIP_CELLS.replace("registry.example.com/ml/train", "127.0.0.1:5001/it/fast")
BASES = BASE_DIGESTS


@pytest.fixture
def setup(tmp_path, write_matrix):
    m = matrix.load(write_matrix(MATRIX))
    engine = World(probes={c.id: good_probe(c, cpus=2) for c in m.cells}, registry=dict(BASES))

    def run(work="w1", command=build.build, **options):
        engine.calls.clear()
        opts = build.Options(work_dir=tmp_path / work, verdicts_dir=tmp_path / "cache", **options)
        reports = command(m, list(m.cells), engine.context(opts)).reports
        return {r.cell: r for r in reports}

    return m, engine, run


def test_unchanged_matrix_is_neither_rebuilt_nor_probed(setup):
    m, engine, run = setup
    first = run()
    assert engine.count("build") == engine.count("probe") == sorted(first)
    assert all(r.status == PASSED and r.verdicts == "probed" and r.verdicts_at for r in first.values())
    again = run(work="fresh-checkout")  # another work dir: the verdicts are not kept there
    assert engine.count("build") == engine.count("probe") == []
    for cell, r in again.items():
        assert (r.status, r.cached, r.verdicts, r.verdicts_at) == (PASSED, True, CACHED, first[cell].verdicts_at)
        assert r.checks and all(c.verdict != "fail" for c in r.checks)


def test_retest_probes_without_rebuilding(setup):
    m, engine, run = setup
    run()
    reports = run(retest=True)
    assert engine.count("build") == [] and engine.count("probe") == sorted(reports)
    assert all(r.verdicts == "probed" for r in reports.values())


def test_imagefactory_test_uses_the_verdicts_too(setup):
    m, engine, run = setup
    run()
    reports = run(command=build.test)
    assert engine.count("probe") == [] and {r.verdicts for r in reports.values()} == {CACHED}
    run(command=build.test, retest=True)
    assert engine.count("probe") == sorted(reports)


def test_a_failing_retest_is_not_forgotten_by_the_next_run(setup):
    m, engine, run = setup
    run()
    good = dict(engine.probes)
    engine.probes = {cell: "crash" for cell in good}
    failed = run(retest=True)
    assert {r.status for r in failed.values()} == {"check-failed"}
    engine.probes = good
    run()
    assert len(engine.count("probe")) == 2  # probed again, not passed on the old record


def test_a_corrupt_verdict_record_means_a_new_probe(setup, tmp_path):
    m, engine, run = setup
    run()
    for path in (tmp_path / "cache").iterdir():
        path.write_text('{"format": 1, "records": [{"key": "x"}]}')
    run()
    assert engine.count("build") == [] and len(engine.count("probe")) == 2


def test_base_digest_is_pinned_reported_and_hashed(setup, tmp_path):
    m, engine, run = setup
    reports = run()
    r = reports["py3.11-cpu-openblas-pip"]
    digest = BASES["python:3.11-slim-bookworm"]
    assert (r.base_digest, r.base_image) == (digest, f"python:3.11-slim-bookworm@{digest}")
    dockerfile = (tmp_path / "w1/contexts/py3.11-cpu-openblas-pip/Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", dockerfile, re.M) == [r.base_image] * 2
    assert f'org.opencontainers.image.base.digest="{digest}"' in dockerfile


def test_a_moved_base_rebuilds_only_its_cells(setup):
    m, engine, run = setup
    before = run()
    engine.registry["python:3.12-slim-bookworm"] = "sha256:" + "9" * 64
    after = run()
    assert engine.count("build") == engine.count("probe") == ["py3.12-cpu-openblas-pip"]
    moved, kept = after["py3.12-cpu-openblas-pip"], after["py3.11-cpu-openblas-pip"]
    assert moved.status == PASSED and not moved.cached and moved.base_digest == "sha256:" + "9" * 64
    assert moved.content_hash != before["py3.12-cpu-openblas-pip"].content_hash
    assert kept.cached and kept.content_hash == before["py3.11-cpu-openblas-pip"].content_hash


def test_test_after_a_moved_base_finds_nothing_built(setup):
    m, engine, run = setup
    run()
    engine.registry["python:3.11-slim-bookworm"] = "sha256:" + "9" * 64
    reports = run(command=build.test)
    assert reports["py3.11-cpu-openblas-pip"].status == NOT_BUILT and engine.count("probe") == []


def test_pull_never_uses_local_digests_and_always_pulls(setup):
    m, engine, run = setup
    engine.registry.clear()
    engine.local = {ref: [f"{ref.split(':')[0]}@{d}"] for ref, d in BASES.items()}
    reports = run(pull="never")
    assert {r.base_digest for r in reports.values()} == set(BASES.values())
    engine.registry.update(BASES)
    run(pull="always", retest=True)
    assert engine.count("build") == []  # same digests: same content, still cached
    engine.images.clear()
    run(pull="always")
    assert {args["pull"] for args in engine.ops("build_args")} == {True}


def test_pull_always_without_a_registry_fails_before_any_build(setup):
    m, engine, run = setup
    engine.registry.clear()
    with pytest.raises(freshness.BaseImageError, match="--pull always"):
        run(pull="always")
    assert engine.ops("build") == [] and engine.ops("run") == []


def test_cells_sharing_layers_wait_for_the_leader(setup, write_matrix, tmp_path):
    m, engine, run = setup
    shared_base = MATRIX.replace('cuda: ["none"]', 'cuda: ["none", "13.0"]').replace('python: ["3.11", "3.12"]', 'python: ["3.11"]')
    m2 = matrix.load(write_matrix(shared_base + "base_images: {pip: 'python:3.11-slim-bookworm'}\n"))
    leader, follower = (c.id for c in m2.cells)
    engine.probes.update({c.id: good_probe(c, cpus=2) for c in m2.cells})
    engine.hold[leader] = threading.Event()
    threading.Timer(0.3, engine.hold[leader].set).start()  # the leader dawdles before its step 2
    opts = build.Options(work_dir=tmp_path / "j2", verdicts_dir=tmp_path / "c", jobs=2)
    reports = build.build(m2, list(m2.cells), engine.context(opts)).reports
    assert [r.cell for r in reports] == [leader, follower]  # matrix order, whatever the schedule
    shared = schedule.plan_paths([tmp_path / "j2/contexts" / c for c in (leader, follower)])[1].shared_steps
    assert shared >= 2
    start = engine.calls.index(("build", follower))
    assert ("step", (leader, shared + 1)) in engine.calls[:start]  # its shared steps were done


def test_without_shared_layers_no_one_waits(setup, tmp_path):
    m, engine, run = setup  # 3.11 and 3.12 bases: nothing in common but the FROM keyword
    first = m.cells[0].id
    engine.hold[first] = threading.Event()
    try:
        opts = build.Options(work_dir=tmp_path / "j2", verdicts_dir=tmp_path / "c", jobs=2)
        thread = threading.Thread(target=build.build, args=(m, list(m.cells), engine.context(opts)))
        thread.start()
        for _ in range(200):  # the other cell builds to its end while the first is held
            if ("probe", m.cells[1].id) in engine.calls:
                break
            threading.Event().wait(0.05)
        assert ("probe", m.cells[1].id) in engine.calls
    finally:
        engine.hold[first].set()
        thread.join()
