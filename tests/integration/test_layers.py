"""Layers by rate of change, for real (issue 34): the pip cell built with BuildKit on the current
engine, then again on a cold second engine (a dockerd of its own: its own data root, no build
cache, its own containerd namespace), compared layer by layer; a sibling cell (other threads)
and the next release (one package added) pushed beside it, and what a node holding the first
would fetch for each measured from the registry's manifests. The conda route the same way is
test_conda's (its BuildKit OpenBLAS cell rebuilt on a cold engine): the same cell is not built
again here.

The cold engine's build is the one cold build here (about two minutes of torch's install); the
main engine's three take their venv stage's first step from the session's BuildKit cache.
"""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

from imagefactory.config import recipe
from imagefactory.engine import registry
from imagefactory.render.contexts import environment
from tests.integration.helpers import (RUN_ID, TEST_PASSWORD, TEST_REGISTRY, TEST_USER, ModuleImages, buildkit_args,
                                       buildx_or_skip, cold_engine, containerd_store, image_layers, matrix_text,
                                       run_cli, unavailable)

OWN = ModuleImages(__name__)
pytestmark = pytest.mark.docker

CELL = "py3.11-cpu-openblas-pip"
PUSH_ENV = {"IMAGEFACTORY_REGISTRY_USER": TEST_USER, "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD}
ONE_MB = 1 << 20


def _manifest(ref: str) -> tuple[str, list[tuple[str, int]]]:
    """The amd64 image manifest's digest of the pushed `ref`, and (digest, compressed size) of
    each of its layers, from the registry."""
    auth = {"username": TEST_USER, "password": TEST_PASSWORD}
    manifest = registry.get_manifest(ref, auth)
    assert manifest is not None, ref
    doc = json.loads(manifest.body)
    if "manifests" in doc:  # an index (with BuildKit's attestation beside the image): the amd64 image
        digest = next(m["digest"] for m in doc["manifests"] if m.get("platform", {}).get("architecture") == "amd64")
        return _manifest(f"{ref.rsplit(':', 1)[0]}@{digest}")
    return manifest.digest, [(layer["digest"], layer["size"]) for layer in doc["layers"]]


INLINE_CACHE = "moby.buildkit.cache.v0"


def _config(ref: str) -> dict:
    """The image config of the pushed `ref` (amd64), from the registry."""
    auth = {"username": TEST_USER, "password": TEST_PASSWORD}
    digest, _ = _manifest(ref)
    doc = json.loads(registry.get_manifest(f"{ref.rsplit(':', 1)[0]}@{digest}", auth).body)
    host, _, repo = ref.rsplit(":", 1)[0].partition("/")
    request = urllib.request.Request(f"http://{host}/v2/{repo}/blobs/{doc['config']['digest']}")
    token = base64.b64encode(f"{TEST_USER}:{TEST_PASSWORD}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read(4 << 20))


def fetched(image: list[tuple[str, int]], held: list[tuple[str, int]]) -> float:
    """The share of `image`'s compressed bytes a node holding `held` must still fetch."""
    have = {digest for digest, _ in held}
    total = sum(size for _, size in image)
    return sum(size for digest, size in image if digest not in have) / total




class Built:
    def __init__(self, root: Path, text: str, *extra: str, host: str | None = None, env: dict | None = None):
        root.mkdir(parents=True, exist_ok=True)
        self.root = OWN.work_dir(root)
        (root / "matrix.yaml").write_text(text)
        env = dict(PUSH_ENV, **(env or {}), **({"DOCKER_HOST": host} if host else {}))
        self.result = run_cli(*buildkit_args(root, root / "matrix.yaml", *extra), env=env, timeout=1500)
        report = json.loads((root / "report.json").read_text()) if (root / "report.json").exists() else None
        assert report and self.result.returncode == 0, self.result.stdout[-3000:] + self.result.stderr[-3000:]
        cell = report["cells"][0]
        assert cell["status"] in ("passed", "published"), cell
        self.image_id, self.cell = cell["image_id"], cell


@pytest.fixture(scope="module")
def builds(tmp_path_factory, base_registry, test_registry, wheelhouse):
    buildx_or_skip()
    if not containerd_store():
        unavailable("the default engine is not Debian 13's with the containerd image store")
    root = tmp_path_factory.mktemp("layers")
    image = f"{TEST_REGISTRY}/it-{RUN_ID}/layers"

    def text(threads: int = 2, packages: str = "") -> str:
        return matrix_text(image=image, wheelhouse=wheelhouse, labels=OWN.labels,
                           extra=f"packages: [{packages}]\n").replace("threads: 2", f"threads: {threads}")

    first = Built(root / "first", text(), "--push")
    sibling = Built(root / "sibling", text(threads=3), "--push")
    release = Built(root / "release", text(packages="six"), "--push")
    with cold_engine() as host:  # pushed to a repository of its own (the title label names only "layers")
        cold_image = f"{TEST_REGISTRY}/it-{RUN_ID}-cold/layers"
        cold = Built(root / "cold", text().replace(f"image: {image}", f"image: {cold_image}"), "--push", host=host)
        cold_layers = image_layers(cold.image_id, host)
    return first, sibling, release, cold, cold_layers, image


def test_a_cold_build_on_another_engine_gives_the_same_image(builds):
    first, _, _, cold, cold_layers, _ = builds
    main_layers = image_layers(first.image_id)
    differ = [(m[2], m[1]) for m, c in zip(main_layers, cold_layers) if m[0] != c[0]]
    assert len(main_layers) == len(cold_layers) and not differ, differ  # every layer the same
    # and the image as pushed: the same layer blobs (compressed bytes), and the same config but for
    # BuildKit's inline-cache record (its cache graph and build times, which --registry-cache
    # reads back): docs/layers.md
    main_ref, cold_ref = first.cell["pushed"][0]["ref"], cold.cell["pushed"][0]["ref"]
    assert _manifest(main_ref)[1] == _manifest(cold_ref)[1]
    main_config, cold_config = _config(main_ref), _config(cold_ref)
    assert INLINE_CACHE in main_config
    assert {k: v for k, v in main_config.items() if k != INLINE_CACHE} == \
        {k: v for k, v in cold_config.items() if k != INLINE_CACHE}


def test_the_environment_is_split_by_rate_of_change(builds):
    first = builds[0]
    steps = [step for _, _, step in image_layers(first.image_id)]
    copies = [s for s in steps if "/imagefactory-layers/" in s and "plan.json" not in s]
    assert [s.split("/imagefactory-layers/")[1].split("/")[0] for s in copies] == list(recipe.VENV_LAYERS)
    torch_layer = next(size for _, size, step in image_layers(first.image_id) if "3-torch" in step)
    assert torch_layer > 200 * ONE_MB  # torch is in its own layer, not in the packages'


def test_a_sibling_and_the_next_release_move_fewsize_bytes(builds):
    first, sibling, release, _, _, image = builds
    refs = {name: b.cell["pushed"][0]["ref"] for name, b in (("first", first), ("sibling", sibling),
                                                              ("release", release))}
    assert all(ref.startswith(image + ":") for ref in refs.values()), refs
    first_m = _manifest(refs["first"])[1]
    sibling_share = fetched(_manifest(refs["sibling"])[1], first_m)
    release_share = fetched(_manifest(refs["release"])[1], first_m)
    assert sibling_share <= 0.20, sibling_share  # issue 34's goals
    assert release_share <= 0.05, release_share
    assert release_share > 0  # the added package is in a layer of its own making


def test_a_step_that_writes_at_once_still_gets_the_fixed_time(base_registry):
    """partials/stamp.j2 ... partials/settle.j2 in a real container: a step whose first write
    comes right after the stamp, within one tick of the kernel's coarse clock (4 ms here), gets
    that write's time fixed too. Without a pause after the stamp, the folder it changed kept the
    stamp's own time (not `-newer`), and a real build time stayed in the layer (the installer's
    `/opt` at stop 42's CI). Twenty tries in one container."""
    step = environment().from_string('{% include "partials/stamp.j2" %}mkdir "/opt/x$i" \\\n'
                                     '{% include "partials/settle.j2" %}')
    script = (f'for i in $(seq 20); do {step.render(source_date_epoch=recipe.SOURCE_DATE_EPOCH).rstrip()}'
              ' && stat -c %Y /opt || exit 1; done')
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", f"{base_registry}/library/debian:bookworm-slim",
                          "bash", "-o", "pipefail", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    times = out.stdout.split()
    assert times == [str(recipe.SOURCE_DATE_EPOCH)] * 20, times
