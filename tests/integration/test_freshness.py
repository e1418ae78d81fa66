"""Fresh bases and cached verdicts on the real engine and the real base registry, judged by
outcome: which cell was rebuilt, which was probed, which digest was built on.

The base is this session's own name, it-<session>/python:3.11-slim-bookworm. It first
holds the shared base itself (127.0.0.1:5000/library/python:3.11-slim-bookworm, the base of
the shared cpu_build), so the first build takes its venv stage from the shared image's layers;
then it moves to a new image (the same plus a label), and everything after FROM is built
again: the one cold build of this module. The shared library/* bases are never overwritten."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from tests.integration.helpers import BASE_REGISTRY, matrix_text, run_cli

pytestmark = [pytest.mark.docker, pytest.mark.registry]

BASE_TAG = "3.11-slim-bookworm"


def push_shared_base(engine, ref: str) -> str:
    """Give the shared base image this session's name; push it; its manifest digest."""
    engine.tag(f"{BASE_REGISTRY}/library/python:{BASE_TAG}", ref)
    return engine.push(ref).digest


def push_base(engine, ref: str, variant: str, root: Path) -> str:
    """Build a base that differs from library/python by one label; push it; its manifest digest."""
    context = root / f"base-{variant}"
    context.mkdir()
    (context / "Dockerfile").write_text(
        f"FROM {BASE_REGISTRY}/library/python:{BASE_TAG}\nLABEL io.imagefactory.test.variant={variant}\n")
    engine.build(str(context), ref, network_mode="host")
    return engine.push(ref).digest


class Runs:
    def __init__(self, root: Path, matrix: Path, cache: Path):
        self.root, self.matrix, self.env, self.n = root, matrix, {"IMAGEFACTORY_CACHE_DIR": str(cache)}, 0

    def __call__(self, command: str, *args: str, work: str = "work") -> tuple[dict, str]:
        self.n += 1
        report = self.root / f"report-{self.n}.json"
        result = run_cli(command, "--matrix", str(self.matrix), "--plain", "--report", str(report),
                         "--work-dir", str(self.root / work), *args, env=self.env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        (cell,) = json.loads(report.read_text())["cells"]
        return cell, result.stdout + result.stderr


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, engine, base_registry, wheelhouse, session_id, created_images, cpu_build):
    root = tmp_path_factory.mktemp("fresh")
    repo = f"it-{session_id}/python"
    ref = f"{base_registry}/{repo}:{BASE_TAG}"
    created_images.append(ref)
    matrix = root / "matrix.yaml"
    # compiler: false: the build on the moved base starts from a new image, so nothing after
    # FROM is cached there; the toolchain layer and the torch.compile child would add minutes
    # and are not what this module is about. (The venv stage, which does not depend on it,
    # still comes from cpu_build's layers on the first base.)
    matrix.write_text(matrix_text(image=f"127.0.0.1:5001/it-{session_id}/fresh", wheelhouse=wheelhouse)
                      + f"base_images:\n  pip: {repo}:{BASE_TAG}\ncompiler: false\n")
    digest = push_shared_base(engine, ref)
    yield engine, root, ref, digest, Runs(root, matrix, root / "cache"), created_images
    _delete_from_registry(base_registry, repo)


def _delete_from_registry(registry: str, repo: str) -> None:
    """Best effort: registries without storage.delete.enabled answer 405 (the name is unique anyway)."""
    try:
        r = requests.head(f"http://{registry}/v2/{repo}/manifests/{BASE_TAG}", timeout=10, headers={
            "Accept": "application/vnd.docker.distribution.manifest.v2+json"})
        if r.status_code == 200:
            requests.delete(f"http://{registry}/v2/{repo}/manifests/{r.headers['Docker-Content-Digest']}",
                            timeout=10)
    except requests.RequestException:
        pass


def test_base_digest_decides_rebuilds_and_passes_are_not_probed_twice(fresh):
    engine, root, ref, digest_a, run, created = fresh

    first, out = run("build")
    created.append(first["candidate"])
    assert (first["status"], first["cached"], first["verdicts"]) == ("passed", False, "probed"), first
    assert first["base_digest"] == digest_a and first["base_image"] == f"{ref}@{digest_a}"
    dockerfile = (root / "work/contexts" / first["cell"] / "Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", dockerfile, re.M) == [f"{ref}@{digest_a}"] * 2

    # Unchanged, from a fresh checkout (another work dir): not rebuilt, not probed.
    again, out = run("build", work="fresh-checkout")
    assert (again["cached"], again["verdicts"], again["verdicts_at"]) == (True, "cached", first["verdicts_at"])
    assert again["content_hash"] == first["content_hash"] and "Step 1/" not in out
    assert "verdicts cached" in Path(again["log"]).read_text()

    retested, _ = run("test", "--retest")
    assert (retested["status"], retested["verdicts"]) == ("passed", "probed")

    # The base tag moves: the same matrix now rebuilds, on the new digest.
    digest_b = push_base(engine, ref, "b", root)
    created.append(engine.image_id(ref))  # the moved base: untagged once the next step moves the tag again
    assert digest_b != digest_a
    moved, out = run("build")
    created.append(moved["candidate"])
    assert (moved["status"], moved["cached"], moved["verdicts"]) == ("passed", False, "probed"), moved
    assert moved["base_digest"] == digest_b and moved["content_hash"] != first["content_hash"]
    assert moved["image_id"] != first["image_id"]

    # --pull never: the local copy's digest (the one just pushed), no registry; still cached.
    offline, _ = run("build", "--pull", "never", work="offline")
    assert (offline["cached"], offline["verdicts"], offline["base_digest"]) == (True, "cached", digest_b)
    assert offline["content_hash"] == moved["content_hash"]


def test_pull_never_without_a_local_copy_fails_before_building(fresh, session_id):
    engine, root, ref, digest, run, _ = fresh
    missing = root / "missing.yaml"
    missing.write_text(run.matrix.read_text().replace(f"it-{session_id}/python:", f"it-{session_id}/nothing:"))
    result = run_cli("build", "--matrix", str(missing), "--plain", "--pull", "never",
                     "--work-dir", str(root / "missing"), "--report", str(root / "missing.json"), env=run.env)
    assert result.returncode == 1 and "no local copy with a registry digest" in result.stderr, result.stderr
    assert "Step 1/" not in result.stdout
