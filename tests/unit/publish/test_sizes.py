"""publish/sizes.py and what publish records of each pushed image: size, layers, largest layer, and the
bytes a node holding a sibling or the replaced release must fetch (FakeRegistry's manifests)."""

from __future__ import annotations

import hashlib
import io
import json

import pytest

from imagefactory.config import matrix
from imagefactory.engine.api import Manifest
from imagefactory.engine.layer_sizes import Layer, Measured
from imagefactory.engine.api import DOCKER_MANIFEST, OCI_INDEX
from imagefactory.pipeline.progress import Plain
from imagefactory.publish import push
from imagefactory.publish import sizes
from imagefactory.run.results import PASSED, PUBLISHED, CellReport
from imagefactory.run.context import PushOptions, RunContext
from tests.fake_engine import FakeRegistry, Image, World

TWO_CELLS = """
image: registry.example.com/ml/train
matrix: {python: ["3.11"], cuda: ["none"], blas: [openblas], installer: [pip], variant: [a, b]}
torch: "2.13.0"
"""


def d(n: int) -> str:
    return "sha256:" + f"{n:064x}"


def pulled(*layers: tuple[int, int]) -> sizes.Pulled:
    return sizes.Pulled(d(999), tuple(sizes.Blob(d(n), size) for n, size in layers))


def test_fetch_bytes_counts_only_the_blobs_the_held_image_lacks_each_once():
    image = pulled((1, 100), (2, 50), (3, 7), (3, 7))
    assert sizes.fetch_bytes(image, pulled((1, 100))) == 57  # 2 and 3, 3 once
    assert sizes.fetch_bytes(image, pulled()) == 157 == image.total
    assert sizes.fetch_bytes(image, image) == 0
    assert sizes.fetch_bytes(pulled(), image) == 0


def test_siblings_are_judged_against_every_other_cell_of_their_platform_only():
    a, b, c = pulled((1, 100), (2, 10)), pulled((1, 100), (3, 30)), pulled((4, 5))
    got = sizes.siblings({"a": ("linux/amd64", a), "b": ("linux/amd64", b), "c": ("linux/arm64", c)})
    assert got == {"a": {"b": 10}, "b": {"a": 30}, "c": {}}


def test_the_record_names_size_layers_and_largest_layer():
    image = sizes.Pulled(d(9), (sizes.Blob(d(1), 100, "application/vnd.oci.image.layer.v1.tar+zstd"),
                                sizes.Blob(d(2), 300, "application/vnd.oci.image.layer.v1.tar+zstd")))
    rec = sizes.record(image)
    assert (rec["compressed"], rec["layers"], rec["largest_layer"], rec["largest_layer_digest"], rec["compression"]) \
        == (400, 2, 300, d(2), "zstd")
    assert sizes.with_previous(rec, image, None) == rec
    assert sizes.with_previous(rec, image, pulled((1, 100)))["previous"] == {"digest": d(999), "fetch": 300}


@pytest.mark.parametrize("layer", [{"digest": "sha256:xyz", "size": 1}, {"digest": d(1), "size": -1},
                                   {"digest": d(1), "size": True}, {"digest": d(1)}, "nope"])
def test_a_malformed_layer_descriptor_is_refused(layer):
    body = json.dumps({"schemaVersion": 2, "layers": [layer]}).encode()
    with pytest.raises(ValueError):
        sizes.layers_of(Manifest(DOCKER_MANIFEST, d(5), body))


def test_an_index_is_resolved_to_the_platforms_manifest():
    world = World()
    child = json.dumps({"schemaVersion": 2, "layers": [{"digest": d(1), "size": 42}]}).encode()
    child_digest = "sha256:" + hashlib.sha256(child).hexdigest()
    index = json.dumps({"manifests": [
        {"digest": d(7), "platform": {"os": "unknown", "architecture": "unknown"}},
        {"digest": child_digest, "platform": {"os": "linux", "architecture": "amd64"}}]}).encode()
    world.manifests["r.example.com/x:t"] = Manifest(OCI_INDEX, d(8), index)
    world.manifests[f"r.example.com/x@{child_digest}"] = Manifest(DOCKER_MANIFEST, child_digest, child)
    got = sizes.read(FakeRegistry(world), "r.example.com/x:t", "linux/amd64", None)
    assert got is not None and got.total == 42 and got.digest == child_digest
    assert sizes.read(FakeRegistry(world), "r.example.com/x:t", "linux/arm64", None) is None


def _world(m) -> tuple[World, list[CellReport]]:
    world = World()
    shared = Layer(1000, d(100), d(1), "FROM base")
    for n, cell in enumerate(c.id for c in m.cells):
        image = f"img{n}"
        world.images[image] = Image(image, {}, cell=cell)
        world.layers[image] = Measured((shared, Layer(200 + n, d(200 + n), d(2 + n), f"COPY /opt/venv {n}")))
    reports = [CellReport(cell=c.id, status=PASSED, content_hash=f"{n:02x}" * 32, image_id=f"img{n}")
               for n, c in enumerate(m.cells)]
    return world, reports


def _run(world: World, m, reports: list[CellReport]) -> str:
    out = io.StringIO()
    push.publish(m, reports, RunContext(PushOptions(backoff=0), Plain(out), world.interrupt, world.engine))
    return out.getvalue()


def test_publish_records_sizes_and_what_a_node_holding_a_sibling_fetches(write_matrix):
    m = matrix.load(write_matrix(TWO_CELLS))
    world, reports = _world(m)
    _run(world, m, reports)
    a, b = reports
    assert a.publish == b.publish == PUBLISHED
    assert (a.sizes["compressed"], a.sizes["layers"], a.sizes["largest_layer"]) == (1200, 2, 1000)
    assert a.sizes["fetch_after"] == {b.cell: 200} and b.sizes["fetch_after"] == {a.cell: 201}
    assert "previous" not in a.sizes  # the release tag was new
    assert not world.ops("layer_sizes")  # no budget: nothing measured before the push


def test_publish_records_what_a_node_holding_the_replaced_release_fetches(write_matrix):
    m = matrix.load(write_matrix(TWO_CELLS))
    world, reports = _world(m)
    release = m.cells[0].tags[0]
    old = d(4242)
    world.registry[release] = old
    world.blobs[old] = Image("old", {})
    world.layers["old"] = Measured((Layer(1000, d(100), d(1)), Layer(300, d(300), d(77))))
    _run(world, m, reports)
    assert reports[0].sizes["previous"] == {"digest": old, "fetch": 200}


def test_an_estargz_layer_is_a_gzip_layer_whose_descriptor_names_its_table_of_contents():
    from imagefactory.engine.api import Manifest

    gz = "application/vnd.oci.image.layer.v1.tar+gzip"

    def manifest(*annotations: dict) -> Manifest:
        body = json.dumps({"schemaVersion": 2, "layers": [
            {"mediaType": gz, "digest": d(i + 1), "size": 10, "annotations": a} for i, a in enumerate(annotations)]})
        return Manifest("application/vnd.oci.image.manifest.v1+json", "sha256:" + "0" * 64, body.encode())

    toc = {sizes.ESTARGZ_TOC: d(50), "io.containers.estargz.uncompressed-size": "99"}
    lazy = sizes.layers_of(manifest(toc, toc))
    assert [b.estargz for b in lazy] == [True, True]
    assert sizes.record(sizes.Pulled(d(9), lazy))["compression"] == "estargz"
    mixed = sizes.layers_of(manifest(toc, {}))
    assert sizes.record(sizes.Pulled(d(9), mixed))["compression"] == "estargz+gzip"
    for bad in ({sizes.ESTARGZ_TOC: "sha256:short"}, {sizes.ESTARGZ_TOC: 5}, {"other": d(50)}):
        assert sizes.layers_of(manifest(bad))[0].estargz is False, bad
