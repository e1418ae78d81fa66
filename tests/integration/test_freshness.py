"""Fresh bases and cached verdicts on the real engine and the real base registry, judged by
outcome: which cell was rebuilt, which was probed, which digest was built on.

The base is this session's own name, it-<session>/python:3.11-slim-bookworm, holding the shared
base (127.0.0.1:5000/library/python:3.11-slim-bookworm), and the cell is bk_build's (BuildKit, the
protected index), so the first build takes its venv stage from bk_build's records. Then the tag
moves: the registry is given a new manifest for it (the same image, its manifest written out
anew), so the tag names a new digest, as after any re-push of a base. What this module proves is
imagefactory's side: the new digest is pinned in FROM, the cell's content hash changes, the cell
is built again and probed again. Which steps the engine can then take from its cache is the
engine's business: BuildKit keys a base by its layers, so here all of them (the classic builder
on the containerd store keys it by the new manifest's id and would install torch again, ~150 s).
The module makes no cold build. The shared library/* bases are never overwritten."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from tests.integration.helpers import BASE_REGISTRY, MANIFEST_TYPES, buildkit_steps, run_cli

pytestmark = [pytest.mark.docker, pytest.mark.registry]

BASE_TAG = "3.11-slim-bookworm"
BUILT = "load build definition"  # in a BuildKit build's log


def push_shared_base(engine, ref: str) -> str:
    """Give the shared base image this session's name; push it; its manifest digest."""
    engine.tag(f"{BASE_REGISTRY}/library/python:{BASE_TAG}", ref)
    return engine.push(ref).digest


def move_tag(registry: str, repo: str, tag: str) -> str:
    """Point `tag` at a new manifest of the same image: the manifest it has, re-encoded (other
    whitespace, so other bytes and another digest; the same config and layers). Returns the new
    manifest digest, as the registry computed it."""
    url = f"http://{registry}/v2/{repo}/manifests/{tag}"
    got = requests.get(url, timeout=10, headers={"Accept": ", ".join(MANIFEST_TYPES)})
    got.raise_for_status()
    body = json.dumps(json.loads(got.content), indent=7).encode()
    assert body != got.content
    # the type it is served as: Docker's manifest from the graph-driver store, an OCI index of the
    # shared base's two platforms from the containerd image store
    put = requests.put(url, data=body, timeout=10, headers={"Content-Type": got.headers["Content-Type"]})
    assert put.status_code == 201, put.text
    return put.headers["Docker-Content-Digest"]


class Runs:
    def __init__(self, root: Path, matrix: Path, cache: Path, netrc: Path):
        self.root, self.matrix, self.env, self.n = root, matrix, {"IMAGEFACTORY_CACHE_DIR": str(cache)}, 0
        self.netrc = netrc

    def __call__(self, command: str, *args: str, work: str = "work") -> tuple[dict, str]:
        self.n += 1
        report = self.root / f"report-{self.n}.json"
        logins = ("--netrc", str(self.netrc)) if command == "build" else ()
        result = run_cli(command, "--builder", "buildkit", "--matrix", str(self.matrix), "--plain", "--report",
                         str(report), "--work-dir", str(self.root / work), *logins, *args, env=self.env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        (cell,) = json.loads(report.read_text())["cells"]
        return cell, result.stdout + result.stderr


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, engine, base_registry, session_id, created_images, bk_build):
    root = tmp_path_factory.mktemp("fresh")
    repo = f"it-{session_id}/python"
    ref = f"{base_registry}/{repo}:{BASE_TAG}"
    created_images.append(ref)
    matrix = root / "matrix.yaml"
    # compiler: false: the module probes three times, and the torch.compile child (about 10 s a
    # probe) is not what it is about. The venv stage still comes from bk_build's records.
    text = re.sub(r"(?m)^image: .*$", f"image: 127.0.0.1:5001/it-{session_id}/fresh", bk_build.matrix.read_text())
    matrix.write_text(text + f"base_images:\n  pip: {repo}:{BASE_TAG}\ncompiler: false\n")
    digest = push_shared_base(engine, ref)
    created_images.append(f"{base_registry}/{repo}@{digest}")  # the pull's record of the digest
    yield engine, root, ref, digest, Runs(root, matrix, root / "cache", bk_build.netrc), created_images
    _delete_from_registry(base_registry, repo)


def _delete_from_registry(registry: str, repo: str) -> None:
    """Best effort: registries without storage.delete.enabled answer 405 (the name is unique anyway)."""
    try:
        r = requests.head(f"http://{registry}/v2/{repo}/manifests/{BASE_TAG}", timeout=10, headers={
            "Accept": ", ".join(MANIFEST_TYPES)})
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
    assert re.findall(r"^FROM (\S+)", dockerfile, re.M) == [f"{ref}@{digest_a}"] * 3  # venv, launch, final

    # Unchanged, from a fresh checkout (another work dir): not rebuilt, not probed.
    again, out = run("build", work="fresh-checkout")
    assert (again["cached"], again["verdicts"], again["verdicts_at"]) == (True, "cached", first["verdicts_at"])
    assert again["content_hash"] == first["content_hash"] and BUILT not in Path(again["log"]).read_text()
    assert "verdicts cached" in Path(again["log"]).read_text()

    retested, _ = run("test", "--retest")
    assert (retested["status"], retested["verdicts"]) == ("passed", "probed")

    # The base tag moves: the same matrix now rebuilds, on the new digest.
    repo = ref.split("/", 1)[1].rsplit(":", 1)[0]
    digest_b = move_tag(BASE_REGISTRY, repo, BASE_TAG)
    created.append(f"{BASE_REGISTRY}/{repo}@{digest_b}")
    assert digest_b != digest_a
    moved, out = run("build")
    created.append(moved["candidate"])
    assert (moved["status"], moved["cached"], moved["verdicts"]) == ("passed", False, "probed"), moved
    assert moved["base_digest"] == digest_b and moved["content_hash"] != first["content_hash"]
    assert moved["image_id"] != first["image_id"]
    dockerfile = (root / "work/contexts" / moved["cell"] / "Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", dockerfile, re.M) == [f"{ref}@{digest_b}"] * 3  # venv, launch, final
    # built, its steps from BuildKit's cache (the image behind the new digest is the same)
    log = Path(moved["log"]).read_text()
    assert BUILT in log and buildkit_steps(log), log[-3000:]
    torch_steps = [cached for step, cached in buildkit_steps(log).items() if "torch==" in step]
    assert torch_steps and all(torch_steps), log[-3000:]

    # --pull never: the local copy's digest, no registry; still cached. The local name is first
    # pulled anew, as a user would: the build's pull of the new digest left it where it was in the
    # containerd image store (a record per name, the tag still on the old digest); the graph-driver
    # store keeps one image with a record of every digest it came under, of which the old one goes,
    # as it would had the new digest brought a new image.
    engine.client.images.pull(f"{BASE_REGISTRY}/{repo}", tag=BASE_TAG)
    if f"{BASE_REGISTRY}/{repo}@{digest_a}" in engine.local_repo_digests(ref):
        engine.client.images.remove(f"{BASE_REGISTRY}/{repo}@{digest_a}")
    assert engine.local_repo_digests(ref) == [f"{BASE_REGISTRY}/{repo}@{digest_b}"]
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
