"""issue 34 items 4-5 on a real engine and registry: the shared CPU image (cpu_build, built once per
session) pushed under names of this module's own, its recorded sizes checked against the registry's
own manifest (read here with plain HTTP), and the same image over a size budget never pushed."""

from __future__ import annotations

import pytest
import requests

from tests.integration.helpers import (BASE_REGISTRY, LEGACY_HOST, RUN_ID, TEST_PASSWORD, TEST_REGISTRY, TEST_USER,
                                       Build, buildx_or_skip, containerd_store, registry_tags)

pytestmark = [pytest.mark.docker, pytest.mark.registry]

CREDS = {"IMAGEFACTORY_REGISTRY_USER": TEST_USER, "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD}
ACCEPT = "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"


def _manifest(repo: str, reference: str) -> dict:
    r = requests.get(f"http://{TEST_REGISTRY}/v2/{repo}/manifests/{reference}", auth=(TEST_USER, TEST_PASSWORD),
                     headers={"Accept": ACCEPT}, timeout=10)
    r.raise_for_status()
    return r.json()


def _push(cpu_build: Build, name: str, budget: str, created_images: list[str]):
    image = f"{TEST_REGISTRY}/sizes-{RUN_ID}-{name}/train"  # "train" as cpu_build's: it is in a label
    matrix = cpu_build.with_image(image)
    matrix.write_text(matrix.read_text() + f"size_budget: {budget}\n")
    result = cpu_build.run("push", "--only", Build.GOOD, env=CREDS, matrix=matrix, default_builder=True)
    good = cpu_build.report()[Build.GOOD]
    created_images.extend(good["tags"])
    return image.split("/", 1)[1], result, good


def test_an_image_over_its_budget_is_not_pushed_and_its_largest_layers_are_named(cpu_build, created_images):
    repo, result, good = _push(cpu_build, "over", "10MB", created_images)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert good["publish"] == "not-published" and good["pushed"] == []
    assert "over its size_budget of 10 MB" in good["error"] and "largest layers: " in good["error"]
    largest = good["sizes"]["budget"]["largest"]
    assert good["sizes"]["budget"]["over"] is True and largest[0]["size"] >= largest[1]["size"] > 10**7
    # the torch layer of the environment (docs/layers.md), named by the packages in it (its list)
    assert "COPY" in largest[0]["step"] and any(p.startswith("torch==") for p in largest[0]["packages"])
    assert "torch==" in good["error"].split("largest layers: ", 1)[1]
    # the toolchain's settled apt step, named by what it installs (not by its stamp)
    assert "(apt-get install g++ libc6-dev" in good["error"] and "imagefactory-stamp" not in good["error"], good["error"]
    assert registry_tags(TEST_REGISTRY, repo) == []  # not even the immutable tag
    assert "over its size_budget" in cpu_build.report_path.with_suffix(".md").read_text()


def test_recorded_sizes_are_the_registrys_and_a_second_push_names_the_release_it_replaced(cpu_build, created_images):
    repo, result, good = _push(cpu_build, "within", "5GB", created_images)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    first = good["pushed"][0]
    served = _manifest(repo, first["digest"])
    blobs = {layer["digest"]: layer["size"] for layer in served["layers"]}
    sizes = good["sizes"]
    assert sizes["digest"] == first["digest"]
    assert (sizes["compressed"], sizes["layers"]) == (sum(blobs.values()), len(served["layers"]))
    assert (sizes["largest_layer"], blobs[sizes["largest_layer_digest"]]) == (max(blobs.values()),) * 2
    assert sizes["budget"]["over"] is False and "previous" not in sizes
    if containerd_store():  # the blobs measured before the push are the ones pushed
        assert (sizes["budget"]["how"], sizes["budget"]["measured"]) == ("exact", sizes["compressed"])
    again = _push(cpu_build, "within", "5GB", created_images)[2]
    assert again["sizes"]["previous"] == {"digest": first["digest"], "fetch": 0}  # the same image: nothing to fetch
    assert "pull size" in cpu_build.report_path.with_suffix(".md").read_text()


AUTH = {"username": TEST_USER, "password": TEST_PASSWORD}


def _recompressed(how: str, created_images: list[str]) -> tuple[str, dict]:
    """A small base image from the local store pushed with `how` layers through buildx (no rebuild):
    its ref and the manifest the registry serves for the digest the push reported."""
    from imagefactory.engine.buildkit import BuildxBuilder
    from imagefactory.engine.docker import Engine

    buildx_or_skip()
    if not containerd_store():
        pytest.skip(f"{how} pushes need the containerd image store; this engine has a graph driver")
    engine = Engine(builder=BuildxBuilder())
    ref = f"{TEST_REGISTRY}/sizes-{RUN_ID}/{how}:base"
    engine.tag(f"{BASE_REGISTRY}/library/debian:bookworm-slim", ref)
    created_images.append(ref)
    outcome = engine.push(ref, auth_config=AUTH, compression=how)
    assert engine.registry_digest(ref, auth_config=AUTH) == outcome.digest
    served = _manifest(ref.split("/", 1)[1].split(":")[0], outcome.digest)
    assert served["mediaType"] == "application/vnd.oci.image.manifest.v1+json" and served["layers"]
    return ref, served


def test_zstd_is_pushed_with_oci_media_types_and_refused_where_it_cannot_be(base_registry, created_images):
    """The classic builder and the 20.10 engine refuse before anything is sent."""
    import docker

    from imagefactory.engine.buildkit import BuildxBuilder
    from imagefactory.engine.docker import Engine
    from imagefactory.errors import PushError

    ref, served = _recompressed("zstd", created_images)
    assert {x["mediaType"] for x in served["layers"]} == {"application/vnd.oci.image.layer.v1.tar+zstd"}
    with pytest.raises(PushError, match="classic builder"):
        Engine().push(ref, auth_config=AUTH, compression="zstd")
    legacy = Engine(docker.DockerClient(base_url=LEGACY_HOST, timeout=60), builder=BuildxBuilder())
    with pytest.raises(PushError, match="containerd image store"):
        legacy.push(ref, compression="zstd")


def test_estargz_is_pushed_with_a_table_of_contents_per_layer_and_the_old_engine_pulls_it(base_registry,
                                                                                            created_images):
    """eStargz (docs/layers.md#lazy-pulling-estargz): every layer gzip under OCI media types naming its
    table of contents, and Debian 12's 20.10 engine, which cannot pull zstd, pulls it whole and runs it."""
    import docker

    from imagefactory.publish import sizes

    ref, served = _recompressed("estargz", created_images)
    assert {x["mediaType"] for x in served["layers"]} == {"application/vnd.oci.image.layer.v1.tar+gzip"}
    assert all(sizes.ESTARGZ_TOC in (x.get("annotations") or {}) for x in served["layers"])
    legacy = docker.DockerClient(base_url=LEGACY_HOST, timeout=120)
    try:
        legacy.login(TEST_USER, TEST_PASSWORD, registry=TEST_REGISTRY)
        pulled = legacy.images.pull(ref)
        out = legacy.containers.run(pulled.id, ["cat", "/etc/debian_version"], remove=True)
        assert out.decode().strip().startswith("12"), out
    finally:
        try:
            legacy.images.remove(ref, force=True)
        except docker.errors.NotFound:
            pass
        legacy.close()
