"""Deliberate bugs the unit suite once let through (issue 17, part 5), one test each.

Thirty one-line bugs (mutants) were put into the code one at a time; these are the ones
no test caught. Each test below fails on its mutant (named in the test's docstring) and
passes on the code as it should be.
"""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from imagefactory.engine import logins
from imagefactory.pipeline import build as build_mod
from imagefactory.tools import doctor
from imagefactory.config import matrix as matrix_mod
from imagefactory.publish import push as publish_mod
from imagefactory.render import contexts as render
from imagefactory.probe.checks import judge, passed
from imagefactory.run.context import Options, RunContext
from imagefactory.tools.doctor import CANNOT, LIMITS, RUNS, Driver, EngineFacts
from imagefactory.engine.api import RunResult
from imagefactory.errors import EngineError, EngineGone
from imagefactory.config.model import Cell
from imagefactory.pipeline.progress import Plain
from imagefactory.report.summary import BUILD_FAILED, CACHED, CHECK_FAILED, NOT_BUILT, NOT_PUBLISHED, PASSED, PUBLISHED
from tests.fake_engine import FakeEngine, Image, World
from tests.unit.helpers import CELL_A, CELL_B, CPU_OPENBLAS, TWO_PIP_CELLS, good_probe

MATRIX = TWO_PIP_CELLS
A, B = CELL_A, CELL_B


@pytest.fixture
def m(tmp_path):
    path = tmp_path / "matrix.yaml"
    path.write_text(MATRIX)
    return matrix_mod.load(path)


@pytest.fixture
def world(m) -> World:
    return World(probes={c.id: good_probe(c) for c in m.cells})


@pytest.fixture(autouse=True)
def no_credentials(monkeypatch):
    for name in (logins.USER_ENV, logins.PASSWORD_ENV, "GITHUB_SHA"):
        monkeypatch.delenv(name, raising=False)


def run(step, m, world, tmp_path, engine_factory=None, **options):
    opts = Options(work_dir=tmp_path / "work", gpus="none", **options)
    return step(m, list(m.cells), RunContext(opts, Plain(io.StringIO()), world.interrupt,
                                             engine_factory or world.engine))


def by_cell(reports) -> dict:
    return {r.cell: r for r in reports}


def publish(m, world, reports, **options) -> dict:
    publish_mod.publish(m, reports, world.context(Options(backoff=0, **options), Plain(io.StringIO())))
    return by_cell(reports)


# -- the cache: an image built FROM a cell's image is not that cell's image ----------------------------

def derive_from(world: World, image_id: str, name: str) -> Image:
    """What `FROM <cell image>` + one more layer gives: every label inherited, its own name."""
    parent = world.images[image_id]
    child = Image("sha256:" + "d" * 64, dict(parent.labels), {name}, cell=parent.cell)
    world.images[child.id] = child
    return child


def test_an_image_that_only_inherits_the_content_hash_label_is_not_reused(m, world, tmp_path):
    """Mutant: find_built() takes any image with the cell's content-hash label (README: it must
    also carry one of the cell's own names). A user's image built FROM the cell's image, left
    after the cell's own image was removed, was then tested, tagged and pushed as the release."""
    first = by_cell(run(build_mod.build, m, world, tmp_path).reports)
    derived = derive_from(world, first[A].image_id, "someone/finetune:latest")
    assert derived.labels[render.HASH_LABEL] == first[A].content_hash
    del world.images[first[A].image_id]  # `docker rmi` of the cell's own image

    assert build_mod.find_built(world.engine(), m, m.cell(A), first[A].content_hash) is None
    again = by_cell(run(build_mod.build, m, world, tmp_path).reports)
    assert world.ops("build") == [A, B, A]  # rebuilt, not taken from the derived image
    assert again[A].status == PASSED and not again[A].cached and again[A].image_id != derived.id
    assert again[B].status == PASSED and again[B].cached and again[B].verdicts == CACHED
    published = publish(m, world, list(again.values()))
    assert published[A].publish == PUBLISHED
    assert world.image_by_ref(m.cell(A).tags[0]).id == again[A].image_id
    assert derived.tags == {"someone/finetune:latest"}  # never named as the release


def test_a_cached_cell_is_found_by_its_candidate_name_without_listing_every_image(m, world, tmp_path):
    """One inspect of the name an earlier run gave the cell's image, not a listing of every image
    with the label (on an engine of many images, the slow question). Mutant: the candidate's
    image taken whatever its content-hash label says."""
    from imagefactory.config import tags

    first = by_cell(run(build_mod.build, m, world, tmp_path).reports)
    cell, content_hash = m.cell(A), first[A].content_hash
    candidate = tags.candidate(cell, content_hash)
    world.calls.clear()
    assert build_mod.find_built(world.engine(), m, cell, content_hash) == first[A].image_id
    assert world.ops("labelled_image") == [candidate] and world.ops("images_with_label") == []
    # the name moved to an image of other content (a user's `docker tag`): not this cell's image
    world.images[first[A].image_id].tags.discard(candidate)
    other = Image("sha256:" + "e" * 64, {render.HASH_LABEL: "0" * 64}, {candidate}, cell=cell.id)
    world.images[other.id] = other
    assert build_mod.find_built(world.engine(), m, cell, content_hash) != other.id
    assert world.ops("images_with_label") == [content_hash]  # looked further, by the label


def test_test_and_push_find_nothing_built_when_only_a_derived_image_carries_the_label(m, world, tmp_path):
    first = by_cell(run(build_mod.build, m, world, tmp_path).reports)
    derive_from(world, first[A].image_id, "someone/finetune:latest")
    del world.images[first[A].image_id]
    retest = by_cell(run(build_mod.test, m, world, tmp_path).reports)
    assert retest[A].status == NOT_BUILT and retest[B].status == PASSED


# -- thread counts: the cap excuses fewer threads, never more than the cell asked for ------------------

def test_a_blas_running_every_host_cpu_fails_a_cell_that_asked_for_fewer():
    """Mutant: the allowed counts use the CPU cap itself instead of min(threads, cap). On a
    64-CPU host a threads: 4 cell whose BLAS and torch run 64 threads then passed."""
    assert CPU_OPENBLAS.threads == 4
    p = good_probe(CPU_OPENBLAS, cpus=64)
    assert passed(judge(CPU_OPENBLAS, p, gpu_required=False))
    p["numpy"]["blas"][0]["num_threads"] = 64
    p["torch"]["num_threads"] = 64
    checks = {c.name: c for c in judge(CPU_OPENBLAS, p, gpu_required=False)}
    assert {n for n, c in checks.items() if c.verdict == "fail"} == {"threads.numpy_blas", "threads.torch"}
    assert checks["threads.torch"].expected == "4"  # no capping excuse: 64 CPUs are plenty


@pytest.mark.parametrize("cpus, allowed", [(64, {4}), (4, {4}), (3, {3, 4}), (1, {1, 4})])
def test_allowed_thread_counts_are_the_request_and_the_request_capped(cpus, allowed):
    for n in range(1, 70):
        p = good_probe(CPU_OPENBLAS, cpus=cpus)
        p["numpy"]["blas"][0]["num_threads"] = p["torch"]["num_threads"] = n
        assert passed(judge(CPU_OPENBLAS, p, gpu_required=False)) == (n in allowed), n


# -- --atomic: any cell that did not pass stops every push, a failed build included --------------------

@pytest.mark.parametrize("setup", ["build-error", "engine-gone", "push-of-an-unbuilt-cell"])
def test_atomic_publishes_nothing_when_a_build_fails(m, world, tmp_path, setup):
    """Mutant: --atomic counted only check failures. A cell whose BUILD failed (or, for `push
    --atomic`, was never built) let the others be pushed. (publish.py is right: any status
    but passed stops it.)"""
    world.builds[B] = "gone" if setup == "engine-gone" else "error"
    reports = run(build_mod.build, m, world, tmp_path).reports
    if setup == "push-of-an-unbuilt-cell":  # `imagefactory push --atomic` re-tests, then publishes
        reports = run(build_mod.test, m, world, tmp_path).reports
    assert [r.status for r in reports] == [PASSED, NOT_BUILT if setup.startswith("push") else BUILD_FAILED]
    published = publish(m, world, reports, atomic=True)
    assert world.ops("push") == [] and {r.publish for r in published.values()} == {NOT_PUBLISHED}
    assert not [ref for _, ref in world.ops("tag") if ref.startswith("registry.example.com")]
    assert f"--atomic and 1 cell(s) failed ({B})" in published[A].error
    # the same run without --atomic publishes the cell that passed
    assert publish(m, world, reports)[A].publish == PUBLISHED


# -- doctor: driver versions compare as numbers --------------------------------------------------------

TABLE = doctor.load_table()
ENGINE_OK = EngineFacts(reachable=True, version="27.3.1", api_version="1.47", nvidia_runtime=True)


def gpu_cell(cuda: str | None) -> Cell:
    accel = "cpu" if cuda is None else f"cu{cuda}"
    return Cell(python="3.11", cuda=cuda, blas="mkl", installer="conda", torch="2.7.1", threads=4,
                base_image="debian:bookworm-slim", tags=(f"reg.example/ml/train:py3.11-{accel}",))


def test_a_driver_field_with_more_digits_is_newer():
    """Mutant: versions compared as strings: '580.105.08' < '580.65.06', so a driver newer than
    CUDA 13.0's minimum was judged too old (limits only) and another tag recommended."""
    cells = [gpu_cell(None), gpu_cell("12.9"), gpu_cell("13.0")]
    assert TABLE.toolkits["13.0"] == "580.65.06"
    v = {x.cuda: x for x in doctor.judge(cells, Driver("580.105.08", ["NVIDIA H200"]), ENGINE_OK, TABLE)}
    assert v["13.0"].verdict == RUNS and v["13.0"].reason == "driver 580.105.08 >= 580.65.06 needed by CUDA 13.0"
    assert doctor.recommend(cells, list(v.values())) == "reg.example/ml/train:py3.11-cu13.0"
    older = {x.cuda: x for x in doctor.judge(cells, Driver("580.9.1", ["NVIDIA H200"]), ENGINE_OK, TABLE)}
    assert older["13.0"].verdict == LIMITS  # 580.9 < 580.65 as numbers, '580.9' > '580.65' as text


def test_the_newest_cuda_is_the_numerically_newest():
    """Mutant: CUDA versions compared as strings ('12.9' > '12.10') names an older cell's tag."""
    table = replace(TABLE, toolkits={**TABLE.toolkits, "12.10": "580.65.06"})
    cells = [gpu_cell("12.9"), gpu_cell("12.10"), gpu_cell("13.0")]
    v = doctor.judge(cells, Driver("580.65.06", ["NVIDIA H200"]), ENGINE_OK, table)
    assert {x.verdict for x in v} == {RUNS}
    assert doctor.recommend(cells[:2], v[:2]) == "reg.example/ml/train:py3.11-cu12.10"
    too_old = {x.cuda: x for x in doctor.judge(cells, Driver("450.80.02", ["T4"]), ENGINE_OK, table)}
    assert too_old["12.10"].verdict == CANNOT


# -- a probe that hits an engine error fails its cell, with the engine's message -----------------------

class ProbeFails(FakeEngine):
    """The engine fails the probe's container (e.g. `could not create a container`)."""

    error: EngineError = EngineError("could not run a container of x: 500 Server Error: no space left")

    def run(self, image: str, command: list[str], *, timeout: float, gpus: bool = False,
            environment: dict[str, str] | None = None, cpus: float | None = None,
            options: dict | None = None, platform=None) -> RunResult:
        self.world.record("run", image)
        raise self.error


def test_a_probe_engine_error_fails_the_cell_with_that_error(m, world, tmp_path):
    """Mutant: the cell kept status `built` when the probe's container could not run. And the
    report gave no error for it: the engine's message was only in the probe.ran check."""
    outcome = run(build_mod.build, m, world, tmp_path, engine_factory=lambda: ProbeFails(world))
    for r in outcome.reports:
        assert r.status == CHECK_FAILED and not r.ok
        assert r.error == "the probe did not run: " + ProbeFails.error.message
        assert {c.name: c.verdict for c in r.checks} == {"probe.ran": "fail"}
    assert outcome.engine_gone is None
    # nothing was cached as passed: with the engine healthy again, the images are probed
    retest = by_cell(run(build_mod.test, m, world, tmp_path).reports)
    assert {r.status for r in retest.values()} == {PASSED} and {r.verdicts for r in retest.values()} == {"probed"}


def test_an_engine_lost_during_the_probe_is_the_runs_error(m, world, tmp_path):
    class Gone(ProbeFails):
        error = EngineGone("could not run a container of x: the Docker engine stopped answering")

    outcome = run(build_mod.build, m, world, tmp_path, engine_factory=lambda: Gone(world))
    assert outcome.engine_gone == Gone.error.message  # exit 3, as for a build that loses it
    for r in outcome.reports:
        assert r.status == CHECK_FAILED and r.error == Gone.error.message
