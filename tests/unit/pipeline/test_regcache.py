"""The registry as a cache (regcache.py) with the in-memory engine: when a run pulls a cell's
content-hash tag instead of building it, and when it builds anyway.

The real-engine counterpart is tests/integration/test_registry_cache.py."""

from __future__ import annotations


import pytest

from imagefactory.engine import logins
from imagefactory.pipeline import build
from imagefactory.config import matrix
from imagefactory.publish import push
from imagefactory.pipeline import regcache
from imagefactory.render import contexts
from imagefactory.config import tags
from imagefactory.run.results import PASSED
from imagefactory.report.summary import summary
from imagefactory.run.context import BuildOptions
from tests.fake_engine import Image, World
from tests.unit.helpers import BASE_DIGESTS, TWO_PIP_CELLS, good_probe
from tests.unit.helpers import hardening_project

MATRIX = TWO_PIP_CELLS.replace("registry.example.com/ml/train", "127.0.0.1:5001/it/fast")
BASES = BASE_DIGESTS


@pytest.fixture
def setup(tmp_path, write_matrix, monkeypatch):
    monkeypatch.setenv(logins.USER_ENV, "ci")
    monkeypatch.setenv(logins.PASSWORD_ENV, "s3cret")
    m = matrix.load(write_matrix(MATRIX))
    world = World(probes={c.id: good_probe(c, cpus=2) for c in m.cells}, registry=dict(BASES))

    def run(work: str = "w1", *, fresh: bool = False, **options):
        """One `build` run; `fresh`: on a new runner (no local image, no verdict cache)."""
        if fresh:
            world.images.clear()
        world.calls.clear()
        cache = tmp_path / (f"cache-{work}" if fresh else "cache")
        opts = BuildOptions(work_dir=tmp_path / work, verdicts_dir=cache, **options)
        outcome = build.build(m, list(m.cells), world.context(opts))
        if opts.push:
            push.publish(m, outcome.reports, world.context(opts))
        return {r.cell: r for r in outcome.reports}

    return m, world, run


def hash_refs(m, reports) -> dict[str, str]:
    return {cell: regcache.content_ref(m, m.cell(cell), r.content_hash) for cell, r in reports.items()}


def test_a_fresh_runner_with_an_unchanged_matrix_pulls_and_never_builds(setup):
    m, world, run = setup
    first = run(push=True)
    assert world.count("build") == sorted(first)
    again = run("w2", fresh=True, push=True)
    assert world.ops("build") == []
    refs = hash_refs(m, again)
    for cell, r in again.items():
        digest = world.registry[refs[cell]]
        assert r.pulled == f"{refs[cell]}@{digest}"  # pulled by the digest the registry gave
        assert (r.status, r.image_id, r.verdicts) == (PASSED, first[cell].image_id, "probed")
        assert f"`{cell}` | passed (pulled, not built)" in summary([r])
        log = open(r.log).read()
        assert "pulled" in log and "Step 1/" not in log
    assert world.count("pull") == sorted(again[c].pulled for c in again)
    # only the publish registry's credentials, and only for the content tags
    assert world.ops("pull_auth") == [{"username": "ci", "password": "s3cret"}] * 2
    # tagged locally under the content tag: the next run finds it without the registry
    third = run("w3", push=True)
    assert world.ops("pull") == [] and world.ops("build") == []
    assert all(r.cached and not r.pulled for r in third.values())


def test_verdicts_cached_for_the_pulled_image_are_used(setup):
    m, world, run = setup
    run(push=True)
    world.images.clear()  # the same runner's verdict cache, its images gone
    again = run("w2", push=True)
    assert world.ops("build") == [] and world.ops("probe") == []
    assert {r.verdicts for r in again.values()} == {"cached"}


def test_without_push_the_registry_is_not_asked_unless_told(setup):
    m, world, run = setup
    first = run(push=True)
    run("w2", fresh=True)
    assert world.count("build") == sorted(first) and world.ops("pull") == []
    assert not set(world.ops("registry_digest")) & set(hash_refs(m, first).values())
    run("w3", fresh=True, registry_cache=True)
    assert world.ops("build") == [] and len(world.ops("pull")) == 2
    run("w4", fresh=True, push=True, registry_cache=False)
    assert world.count("build") == sorted(first) and world.ops("pull") == []


def test_a_changed_cell_is_built(setup, write_matrix):
    m, world, run = setup
    run(push=True)
    changed = matrix.load(write_matrix(MATRIX.replace("threads: 2", "threads: 1"), "changed.yaml"))
    world.images.clear()
    world.calls.clear()
    opts = BuildOptions(work_dir=m.path.parent / "w5", verdicts_dir=m.path.parent / "c5", registry_cache=True)
    reports = build.build(changed, list(changed.cells), world.context(opts)).reports
    assert world.count("build") == sorted(r.cell for r in reports) and world.ops("pull") == []
    assert not any(r.pulled for r in reports)


@pytest.mark.parametrize("served", ["sha256:" + "A" * 64, "sha256:abc", "md5:" + "0" * 32,
                                    "sha256:" + "0" * 64 + "\nFROM evil", ""])
def test_a_digest_that_is_not_sha256_hex_is_not_pulled(setup, served):
    m, world, run = setup
    first = run(push=True)
    for ref in hash_refs(m, first).values():
        world.registry[ref] = served
    run("w2", fresh=True, push=True)
    assert world.ops("pull") == [] and world.count("build") == sorted(first)


def test_an_image_without_the_cells_content_hash_is_not_used(setup):
    """A registry whose content tag names another image (overwritten, hostile): built instead."""
    m, world, run = setup
    first = run(push=True)
    for cell, ref in hash_refs(m, first).items():
        digest = world.registry[ref]
        world.blobs[digest] = Image(world.blobs[digest].id, {contexts.HASH_LABEL: "0" * 64}, set(), cell)
    again = run("w2", fresh=True, push=True)
    assert len(world.ops("pull")) == 2 and world.count("build") == sorted(first)
    assert not any(r.pulled for r in again.values())
    assert "does not carry content hash" in open(again[m.cells[0].id].log).read()


def test_a_failing_pull_builds(setup):
    m, world, run = setup
    first = run(push=True)
    world.pull_fails = True
    again = run("w2", fresh=True, push=True)
    assert world.count("build") == sorted(first)
    assert all(r.status == PASSED and not r.pulled for r in again.values())
    assert "could not pull" in open(again[m.cells[0].id].log).read()


def test_cache_sources_are_the_cells_release_tags(setup):
    m, world, run = setup
    cell = m.cells[0]
    assert regcache.cache_sources(cell) == list(cell.tags)
    assert regcache.content_ref(m, cell, "f" * 64) == tags.hash_tag(m.hash_tag_template, m.image, cell, "f" * 64)


def test_buildkit_builds_take_the_cells_registry_images_as_cache_and_classic_ones_do_not(setup):
    m, world, run = setup
    world.builder = "buildkit"
    run(push=True, cache_from=("reg.example.com/prev:1",))
    for args in world.ops("build_args"):
        cell = m.cell(args["cell"])
        assert args["cache_from"] == ["reg.example.com/prev:1", *cell.tags]  # a registry ref: not looked up locally
        assert f"registry cache: cache from reg.example.com/prev:1, {cell.tags[0]}" in open(
            world_log(m, args["cell"])).read()
    world.builder = "classic"
    run("w2", fresh=True, push=True, registry_cache=False, cache_from=("reg.example.com/prev:1",))
    assert [a["cache_from"] for a in world.ops("build_args")] == [[], []]  # classic: local images only
    run("w3", fresh=True, registry_cache=False)
    world.builder = "buildkit"
    run("w4", fresh=True, registry_cache=False)  # no registry cache: no registry images as cache
    assert [a["cache_from"] for a in world.ops("build_args")] == [[], []]


def world_log(m, cell: str):
    return m.path.parent / "w1" / "logs" / f"{cell}.log"


def test_the_content_tag_lookup_gets_only_its_own_registrys_credentials(tmp_path, write_matrix, monkeypatch):
    """A content-hash tag under tags.registries is looked up and pulled with that registry's
    credentials (IMAGEFACTORY_REGISTRY_*_<HOST>), never with `image`'s (issue 18, part 4)."""
    third = "third.example.net:5000"
    text = MATRIX + f'tags: {{hash_template: "{third}/it/fast:{{hash}}", registries: ["{third}"]}}\n'
    m = matrix.load(write_matrix(text))
    monkeypatch.setenv(logins.USER_ENV, "own")
    monkeypatch.setenv(logins.PASSWORD_ENV, "own-secret")
    monkeypatch.setenv(logins.USER_ENV + "_THIRD_EXAMPLE_NET_5000", "third")
    monkeypatch.setenv(logins.PASSWORD_ENV + "_THIRD_EXAMPLE_NET_5000", "third-secret")
    world = World(probes={c.id: good_probe(c, cpus=2) for c in m.cells}, registry=dict(BASES))
    opts = BuildOptions(work_dir=tmp_path / "w1", verdicts_dir=tmp_path / "cache", push=True)
    push.publish(m, build.build(m, list(m.cells), world.context(opts)).reports, world.context(opts))
    world.images.clear()
    world.calls.clear()
    opts = BuildOptions(work_dir=tmp_path / "w2", verdicts_dir=tmp_path / "cache2", push=True)
    reports = build.build(m, list(m.cells), world.context(opts)).reports
    assert all(r.pulled.startswith(f"{third}/it/fast:") for r in reports)
    mine = {"username": "third", "password": "third-secret"}
    looked_up = [auth for ref, auth in world.ops("digest_auth") if ref.startswith(third)]
    assert looked_up == [mine, mine] and world.ops("pull_auth") == [mine, mine]


# -- moved from test_hardening_iii.py ----------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


class _CacheEngine:
    """A registry that serves the content tag, and a local image (another one) with the label."""

    def __init__(self, pulled: str, labelled: list[str]):
        self.pulled, self.labelled, self.tagged = pulled, labelled, []

    def registry_digest(self, ref, *, auth_config=None):
        return "sha256:" + "a" * 64

    def pull(self, ref, *, auth_config=None):
        return self.pulled

    def images_with_label(self, key, value):
        return {i: [] for i in self.labelled}

    def tag(self, image, ref):
        self.tagged.append((image, ref))


def test_the_registry_cache_refuses_a_pulled_image_without_the_label_even_if_another_has_it(project):
    from imagefactory.pipeline import regcache

    m = matrix.load(project / "matrix.yaml")
    cell, lines = m.cells[0], []
    creds = {r: None for r in ("registry.example.com",)}
    other = _CacheEngine(pulled="sha256:pulled", labelled=["sha256:some-other-local-image"])
    assert regcache.pull_content(other, m, cell, "f" * 64, creds, lines.append) is None
    assert other.tagged == [] and "does not carry content hash" in lines[-1]
    same = _CacheEngine(pulled="sha256:pulled", labelled=["sha256:pulled"])
    assert regcache.pull_content(same, m, cell, "f" * 64, creds, lines.append) is not None
