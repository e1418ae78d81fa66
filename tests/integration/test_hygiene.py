"""The suite's own clean-up: a run removes what it built (its stage images included) and
nothing that another run on the same engine made."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.helpers import (BASE_REGISTRY, LEGACY_HOST, RUN_ID, RUN_LABEL, TEST_PASSWORD, TEST_REGISTRY,
                                       TEST_USER, Leftovers, images_created, prune_build_cache, registry_tags,
                                       remove_run_pushes, run_repositories, remove_run_images, unavailable)

STREAM = """\
Step 1/6 : FROM 127.0.0.1:5000/library/debian:bookworm-slim AS stage
 ---> 17b6fd292922
Step 2/6 : RUN echo one > /one
 ---> Running in 0123456789ab
Removing intermediate container 0123456789ab
 ---> aaaaaaaaaaaa
Step 3/6 : ENV X=1
 ---> Using cache
 ---> bbbbbbbbbbbb
Step 4/6 : FROM 127.0.0.1:5000/library/debian:bookworm-slim
 ---> 17b6fd292922
Step 5/6 : COPY --from=stage /one /one
 ---> cccccccccccc
Step 6/6 : LABEL a=b
 ---> Running in 123456789abc
 ---> dddddddddddd
Successfully built dddddddddddd
"""


def test_a_build_stream_names_the_images_the_build_made_not_its_bases_or_cache_hits():
    assert images_created(STREAM.splitlines()) == ["aaaaaaaaaaaa", "cccccccccccc", "dddddddddddd"]


def _two_stage(tmp_path, marker: str) -> str:
    (tmp_path / "Dockerfile").write_text(
        f"FROM {BASE_REGISTRY}/library/debian:bookworm-slim AS stage\n"
        f"RUN echo {marker} > /marker\n"
        f"FROM {BASE_REGISTRY}/library/debian:bookworm-slim\n"
        "COPY --from=stage /marker /marker\n")
    return str(tmp_path)


def _dangling(client) -> set[str]:
    return {i.id.split(":")[1][:12] for i in client.images.list(filters={"dangling": True})}


@pytest.mark.docker
def test_a_runs_stage_images_are_removed_and_another_runs_are_not(engine, base_registry, tmp_path):
    client = engine.client
    mine, theirs = Leftovers(), Leftovers()
    other_run = f"other-{RUN_ID}"
    context = _two_stage(tmp_path, f"hygiene-{RUN_ID}")
    # "Another run" builds first; this run's build of the same context is all cache hits.
    tag_theirs = f"imagefactory-test/hygiene-theirs:{RUN_ID}"
    for _ in theirs.from_events(client.api.build(path=context, tag=tag_theirs, rm=True, decode=True,
                                                 network_mode="none", labels={RUN_LABEL: other_run})):
        pass
    stage = theirs.ids[0]  # the first stage's RUN: dangling once the build ends
    assert stage in _dangling(client)
    tag_mine = f"imagefactory-test/hygiene-mine:{RUN_ID}"
    for _ in mine.from_events(client.api.build(path=context, tag=tag_mine, rm=True, decode=True,
                                               network_mode="none", labels={RUN_LABEL: f"mine-{RUN_ID}"})):
        pass
    assert stage not in mine.ids  # a cache hit is the other run's image
    try:
        remove_run_images(client, [], f"mine-{RUN_ID}", mine)
        assert engine.image_id(tag_mine) is None
        assert engine.image_id(tag_theirs) is not None and stage in _dangling(client)
        remove_run_images(client, [], other_run, theirs)
        assert engine.image_id(tag_theirs) is None
        assert stage not in _dangling(client)
    finally:
        remove_run_images(client, [tag_mine, tag_theirs], other_run, theirs)


PODMAN_STREAM = """\
[1/2] STEP 1/3: FROM 127.0.0.1:5000/library/debian:bookworm-slim AS stage
[1/2] STEP 2/3: RUN echo one > /one
--> Using cache acc1c8501080cf54ffdacd2961a0f10b9d06dfa66d8fb06fd5adfbed14da4c43
--> acc1c850108
[1/2] STEP 3/3: RUN echo two > /two
--> 0c79bf36263
[2/2] STEP 1/2: FROM 127.0.0.1:5000/library/debian:bookworm-slim
[2/2] STEP 2/2: COPY --from=stage /two /two
--> 39e0a3f8843
"""


def test_a_podman_build_stream_names_the_images_the_build_made_not_its_cache_hits():
    assert images_created(PODMAN_STREAM.splitlines()) == ["0c79bf36263", "39e0a3f8843"]


def test_the_logs_under_a_tree_name_every_work_dirs_images(tmp_path):
    for name, stream in (("a", STREAM), ("b/c", PODMAN_STREAM)):
        (tmp_path / name / "work" / "logs").mkdir(parents=True)
        (tmp_path / name / "work" / "logs" / "cell.log").write_text(stream)
    (tmp_path / "d" / "logs").mkdir(parents=True)  # a directory named logs holding no log
    found = Leftovers()
    found.from_tree(tmp_path)
    assert sorted(found.ids) == sorted(images_created(STREAM.splitlines())
                                       + images_created(PODMAN_STREAM.splitlines()))


def _build_logged(client, context: Path, log: Path | None, **kwargs) -> list[str]:
    lines = [str(e.get("stream", "")) for e in client.api.build(path=str(context), rm=True, forcerm=True, decode=True,
                                                                 network_mode="none", **kwargs)]
    if log is not None:
        log.parent.mkdir(parents=True)
        log.write_text("".join(lines))
    return images_created("".join(lines).splitlines())


@pytest.mark.docker
def test_a_moved_tags_old_image_and_a_failed_builds_steps_go_with_the_run_on_either_store(
        engine, base_registry, tmp_path):
    """What a run leaves untagged: the image a rebuild moved its tag from (labelled; the first
    build here keeps no log, as a test's own SDK build doesn't) and a failed build's finished
    steps (unlabelled: the build's label is its last step; only its log names them)."""
    client = engine.client
    run, tag = f"moved-{RUN_ID}", f"imagefactory-test/hygiene-moved:{RUN_ID}"
    made: list[str] = []
    try:
        for n, tail in enumerate((f"echo one-{RUN_ID} > /one", f"echo two-{RUN_ID} > /one", "false")):
            context = tmp_path / f"context{n}"
            context.mkdir()
            (context / "Dockerfile").write_text(f"FROM {BASE_REGISTRY}/library/debian:bookworm-slim\n"
                                                f"RUN echo step-{n}-{RUN_ID} > /step\nRUN {tail}\n")
            log = tmp_path / "tree" / f"work{n}" / "logs" / "cell.log" if n else None
            made += _build_logged(client, context, log, tag=tag, labels={RUN_LABEL: run})
        assert len(made) == 2 * 3 + 1, made  # two whole builds (RUN, RUN, the label step), one RUN
        leftovers = Leftovers()
        leftovers.from_tree(tmp_path / "tree")
        remove_run_images(client, [tag], run, leftovers)
        left = {i.id.split(":")[1][:12] for i in client.images.list(all=True)} & {m[:12] for m in made}
        assert not left, (left, made)
    finally:
        if engine.image_id(tag):
            client.images.remove(tag, force=True)
        for image_id in reversed(made):
            try:
                client.images.remove(image_id, force=True)
            except Exception:  # noqa: BLE001 - gone already
                pass


@pytest.mark.docker
@pytest.mark.parametrize("host", ["current", "legacy"])
def test_a_runs_build_cache_records_are_pruned_even_those_an_image_still_shares(host, base_registry, tmp_path):
    """BuildKit marks a record shared while an image holds its layer; an id filter alone removes
    none of those (the helper reclaimed 0 bytes a run that way). Records made before stay."""
    import docker

    base_url = LEGACY_HOST if host == "legacy" else os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        client = docker.DockerClient(base_url=base_url, timeout=120)
        before = {r["ID"] for r in client.df().get("BuildCache") or []}
    except (docker.errors.DockerException, OSError) as e:
        unavailable(f"no {host} engine at {base_url} (scripts/ci-setup.sh starts both): {e}")
    tag = f"imagefactory-test/hygiene-cache:{RUN_ID}-{host}"
    (tmp_path / "Dockerfile").write_text(f"FROM {BASE_REGISTRY}/library/debian:bookworm-slim\n"
                                         f"RUN echo cache-{uuid.uuid4().hex} > /marker && head -c 1000000 /dev/zero > /pad\n")
    time.sleep(1.1)  # the helper takes records from a second before `since`: none of `before`
    since = time.time()
    try:
        subprocess.run(["docker", "build", "--network", "none", "-q", "-t", tag, str(tmp_path)], check=True,
                       capture_output=True, env={**os.environ, "DOCKER_HOST": base_url, "DOCKER_BUILDKIT": "1"})
        made = {r["ID"] for r in client.df().get("BuildCache") or []} - before
        assert made, "the BuildKit build made no cache record"
        assert prune_build_cache(client, since) >= 1_000_000  # the RUN's record, shared with the image
        left = {r["ID"] for r in client.df().get("BuildCache") or []}
        assert not made & left, made & left
        assert before <= left, "a record made before went"
    finally:
        try:
            client.images.remove(tag, force=True)
        except docker.errors.ImageNotFound:
            pass
        client.close()


@pytest.mark.docker
@pytest.mark.registry
def test_a_runs_pushes_are_deleted_from_the_registry_and_another_runs_are_not(engine, test_registry):
    client = engine.client
    auth = {"username": TEST_USER, "password": TEST_PASSWORD}
    token = uuid.uuid4().hex[:8]  # not this run's id: the run's own pushes are in the registry too
    mine, theirs = f"m{token}", f"t{token}"
    base = f"{BASE_REGISTRY}/library/debian:bookworm-slim"
    repos = {run: f"{TEST_REGISTRY}/hygiene-{run}/x" for run in (mine, theirs)}
    try:
        for repo in repos.values():
            client.images.get(base).tag(repo, "1")
            for event in client.api.push(repo, "1", auth_config=auth, stream=True, decode=True):
                assert "error" not in event, event
        # a name that only contains the id inside a word is another run's
        assert run_repositories(TEST_REGISTRY, token, (TEST_USER, TEST_PASSWORD)) == []
        assert remove_run_pushes(mine) == 1
        assert registry_tags(TEST_REGISTRY, f"hygiene-{mine}/x") == []
        assert registry_tags(TEST_REGISTRY, f"hygiene-{theirs}/x") == ["1"]
    finally:
        remove_run_pushes(theirs)
        for repo in repos.values():
            try:
                client.images.remove(f"{repo}:1")
            except Exception:  # noqa: BLE001 - never made
                pass
