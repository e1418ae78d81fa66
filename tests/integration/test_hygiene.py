"""The suite's own clean-up: a run removes what it built (its stage images included) and
nothing that another run on the same engine made."""

from __future__ import annotations

import pytest

from tests.integration.helpers import (BASE_REGISTRY, RUN_ID, RUN_LABEL, Leftovers, images_created,
                                       remove_run_images)

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
