"""engine/layer_sizes.py: an image's layers from a `docker save` stream, exact where the stream holds the
compressed blobs (the containerd store), gzip estimates where it holds layer.tar (graph driver),
estimates kept by diff id so the next measure of the same layers saves nothing."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile

import pytest

from imagefactory.engine import layer_sizes


def _tar(members: dict[str, bytes]) -> list[bytes]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    return [raw[i:i + 7000] for i in range(0, len(raw), 7000)]  # chunks, as the SDK streams them


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


HISTORY = [{"created_by": "FROM base"}, {"created_by": "ENV A=1", "empty_layer": True},
           {"created_by": "COPY /opt/venv /opt/venv # buildkit"}]
BASE, VENV = os.urandom(50_000), b"torch " * 40_000  # one that gzip cannot shrink, one it can


def _containerd() -> list[bytes]:
    blobs = [gzip.compress(BASE), gzip.compress(VENV)]
    config = json.dumps({"rootfs": {"diff_ids": [sha(BASE), sha(VENV)]}, "history": HISTORY}).encode()
    manifest = [{"Config": f"blobs/sha256/{sha(config)[7:]}", "Layers": [f"blobs/sha256/{sha(b)[7:]}" for b in blobs]}]
    members = {f"blobs/sha256/{sha(b)[7:]}": b for b in blobs + [config]}
    return _tar({**members, "index.json": b"{}", "manifest.json": json.dumps(manifest).encode()})


def _graph_driver() -> list[bytes]:
    config = json.dumps({"rootfs": {"diff_ids": [sha(BASE), sha(VENV)]}, "history": HISTORY}).encode()
    manifest = [{"Config": "c0ffee.json", "Layers": ["bbb/layer.tar", "aaa/layer.tar"]}]
    return _tar({"aaa/layer.tar": VENV, "aaa/json": b"{}", "bbb/layer.tar": BASE, "c0ffee.json": config,
                 "manifest.json": json.dumps(manifest).encode()})


def test_the_containerd_store_gives_the_blobs_sizes_exactly_with_their_steps():
    got = layer_sizes.measure(_containerd())
    assert got.exact and [x.size for x in got.layers] == [len(gzip.compress(BASE)), len(gzip.compress(VENV))]
    assert [x.diff_id for x in got.layers] == [sha(BASE), sha(VENV)]
    assert [x.digest for x in got.layers] == [sha(gzip.compress(BASE)), sha(gzip.compress(VENV))]
    assert [x.step for x in got.layers] == ["FROM base", "COPY /opt/venv /opt/venv # buildkit"]  # ENV: no layer


def test_the_graph_driver_store_is_estimated_by_gzip_in_manifest_order():
    got = layer_sizes.measure(_graph_driver())
    assert not got.exact and all(x.estimated and not x.digest for x in got.layers)
    assert [x.diff_id for x in got.layers] == [sha(BASE), sha(VENV)]  # manifest order, not the tar's
    expected = [len(gzip.compress(data, compresslevel=6, mtime=0)) for data in (BASE, VENV)]
    assert [x.size for x in got.layers] == expected and expected[1] < len(VENV) // 20
    assert got.total == sum(expected)


def test_estimates_are_kept_by_diff_id_and_the_next_measure_saves_nothing():
    calls = []

    def save():
        calls.append(1)
        return _graph_driver()

    first = layer_sizes.measured([sha(BASE), sha(VENV)], save, estimates=True)
    again = layer_sizes.measured([sha(BASE), sha(VENV)], save, estimates=True)
    assert calls == [1] and [x.size for x in again.layers] == [x.size for x in first.layers]
    assert again.layers[1].step == "COPY /opt/venv /opt/venv # buildkit" and not again.exact
    layer_sizes.measured([sha(BASE), sha(b"new")], save, estimates=True)  # one layer never measured: saved again
    assert calls == [1, 1]


def test_blob_sizes_are_never_taken_from_the_cache():
    calls = []

    def save():
        calls.append(1)
        return _containerd()

    layer_sizes.measured([sha(BASE), sha(VENV)], save, estimates=False)
    layer_sizes.measured([sha(BASE), sha(VENV)], save, estimates=False)
    assert calls == [1, 1]


@pytest.mark.parametrize("members", [{"x": b"1"}, {"manifest.json": b"[]"},
                                     {"manifest.json": json.dumps([{"Layers": ["gone/layer.tar"]}]).encode()}])
def test_a_stream_that_is_not_one_image_is_refused(members):
    with pytest.raises(ValueError):
        layer_sizes.measure(_tar(members))


def test_a_history_without_empty_layer_marks_is_read_by_its_nop_steps_or_not_at_all():
    """The classic builder on the containerd store marks no entry empty_layer: its metadata-only
    steps are `#(nop)` ones other than COPY/ADD. A history that still does not fit names no step."""
    sh = "/bin/bash -o pipefail -c "
    history = [{"created_by": ""}, {"created_by": sh + "#(nop)  SHELL [/bin/bash]"},
               {"created_by": sh + "#(nop) COPY dir:bf4 in /opt/venv"}, {"created_by": sh + "useradd x"},
               {"created_by": sh + "#(nop)  ENV A=1"}, {"created_by": sh + "#(nop) ADD file:1 in /"}]
    assert layer_sizes.steps({"history": history}, 4) == ["", sh + "#(nop) COPY dir:bf4 in /opt/venv", sh + "useradd x",
                                                     sh + "#(nop) ADD file:1 in /"]
    assert layer_sizes.steps({"history": history}, 3) == []  # does not fit: no step rather than a wrong one
    assert layer_sizes.steps({"history": "x"}, 1) == []


LIST = "opt/venv/etc/imagefactory/layers/3-torch.txt"
LISTED = b"filelock==3.20.0\ntorch==2.13.0\n\x1b[31mevil==1\nnot a package\npython=3.11.9=h1_0_cpython\n"


def _layer_tar(members: dict[str, bytes]) -> bytes:
    """A layer's tar in path order, as engines write one: folders, bin/, the list in etc/, then lib/."""
    return b"".join(_tar(members))


def _env_layer(big: int = 200_000) -> bytes:
    return _layer_tar({"opt/venv/bin/torchrun": b"#!/bin/sh\n", LIST: LISTED,
                       "opt/venv/lib/python3.11/site-packages/torch/lib.so": os.urandom(big)})


def _image(layer: bytes, *, blob: bool) -> list[bytes]:
    config = json.dumps({"rootfs": {"diff_ids": [sha(layer)]}, "history": [{"created_by": "COPY x / # buildkit"}]}).encode()
    if blob:
        data = gzip.compress(layer)
        path = f"blobs/sha256/{sha(data)[7:]}"
        manifest = [{"Config": f"blobs/sha256/{sha(config)[7:]}", "Layers": [path]}]
        return _tar({path: data, f"blobs/sha256/{sha(config)[7:]}": config, "manifest.json": json.dumps(manifest).encode()})
    manifest = [{"Config": "c.json", "Layers": ["aaa/layer.tar"]}]
    return _tar({"aaa/layer.tar": layer, "c.json": config, "manifest.json": json.dumps(manifest).encode()})


@pytest.mark.parametrize("blob", [True, False], ids=["containerd-blob", "graph-driver-tar"])
def test_an_environment_layers_packages_are_read_from_the_list_it_carries(blob):
    """Only whole package lines: a terminal escape or a stray line never reaches a message."""
    got = layer_sizes.measure(_image(_env_layer(), blob=blob))
    assert got.layers[0].packages == ("filelock==3.20.0", "torch==2.13.0", "python=3.11.9=h1_0_cpython")
    assert got.exact is blob


def test_a_list_past_the_peek_a_misnamed_list_or_a_cut_tar_gives_no_packages(monkeypatch):
    monkeypatch.setattr(layer_sizes, "PEEK", 4096)
    monkeypatch.setattr(layer_sizes, "CHUNK", 1024)  # many reads, so the peek must stop itself
    late = _layer_tar({"opt/venv/bin/python": os.urandom(8192), LIST: LISTED})
    assert layer_sizes.measure(_image(late, blob=True)).layers[0].packages == ()
    assert layer_sizes.measure(_image(late, blob=False)).layers[0].packages == ()
    monkeypatch.setattr(layer_sizes, "PEEK", 64 << 20)
    assert layer_sizes.measure(_image(late, blob=True)).layers[0].packages != ()
    elsewhere = _layer_tar({"opt/venv/etc/imagefactory/layers/../../x.txt": LISTED,
                            "tmp/etc/imagefactory/layers/3-torch.txt.bak": LISTED})
    assert layer_sizes.measure(_image(elsewhere, blob=False)).layers[0].packages == ()
    assert layer_sizes.packages(_env_layer()[:700]) == ()  # cut inside the list's header
    assert layer_sizes.packages(b"\0" * 10) == () and layer_sizes.packages(b"") == ()


def test_a_kept_estimate_keeps_its_packages():
    calls, layer = [], _env_layer()

    def save():
        calls.append(1)
        return _image(layer, blob=False)

    first = layer_sizes.measured([sha(layer)], save, estimates=True)
    again = layer_sizes.measured([sha(layer)], save, estimates=True)
    assert calls == [1] and again.layers[0].packages == first.layers[0].packages != ()


def test_a_step_is_kept_long_enough_to_reach_a_settled_apt_steps_packages():
    long = "RUN /bin/bash -o pipefail -c touch /tmp/imagefactory-stamp  && printf x" + " " * 600 + \
        "&& apt-get install -y g++" + "x" * 2000
    (step,) = layer_sizes.steps({"history": [{"created_by": long}]}, 1)
    assert len(step) == layer_sizes.STEP_CHARS and "apt-get install -y g++" in step
