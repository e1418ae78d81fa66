"""identity.py: what identifies an image in either image store (the graph-driver store names an
image by its config digest, the containerd store by its manifest or index digest)."""

from __future__ import annotations

from imagefactory.engine import identity

CONFIG, MANIFEST, OTHER = ("sha256:" + c * 64 for c in "123")


def test_store_from_docker_info():
    containerd = {"Driver": "overlayfs", "DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"]]}
    graph = {"Driver": "overlay2", "DriverStatus": [["Backing Filesystem", "extfs"], ["Supports d_type", "true"]]}
    assert identity.store(containerd) == identity.CONTAINERD
    assert identity.store(graph) == identity.GRAPH_DRIVER
    assert identity.store({}) == identity.GRAPH_DRIVER
    # a planted or odd answer is not taken for the containerd store
    assert identity.store({"DriverStatus": [["driver-type", "io.containerd.snapshotter.v1x"]]}) == identity.GRAPH_DRIVER
    assert identity.store({"DriverStatus": "io.containerd.snapshotter.v1"}) == identity.GRAPH_DRIVER


def test_built_takes_the_engines_id_in_either_store():
    made = identity.builder_digests({"containerimage.config.digest": CONFIG, "containerimage.digest": MANIFEST})
    # graph-driver store: the engine names the image by its config digest
    assert identity.built(CONFIG, made) == CONFIG
    # containerd store: by its manifest digest; the config digest names no image there
    assert identity.built(MANIFEST, made) == MANIFEST


def test_built_refuses_a_name_that_holds_another_image():
    made = {CONFIG, MANIFEST}
    assert identity.built(OTHER, made) is None
    assert identity.built(None, made) is None
    assert identity.built("sha256:short", made) is None
    # a builder that said nothing: the engine's id stands
    assert identity.built(OTHER, ()) == OTHER


def test_builder_digests_take_only_whole_digests():
    assert identity.builder_digests({"containerimage.digest": MANIFEST + "\n"}) == set()
    assert identity.builder_digests({"containerimage.digest": ["x"], "containerimage.config.digest": CONFIG}) == {CONFIG}
