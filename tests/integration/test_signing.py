"""issue 24: signed images with an SBOM and provenance, verified before a node trusts them.

On the shared built image (cpu_build's good cell) and the authenticated registry (127.0.0.1:5001):
`push --sign` signs the pushed digest and attaches the SBOM and provenance; `verify` passes with
the key, fails naming another key, fails for other content under the tag, for a tampered SBOM
attestation and for a properly signed SBOM of another image; an image pushed without the signing
step fails. cosign runs through a wrapper that records its arguments and the modes of the Docker
config it was given, for the leak scan.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import requests

from tests.integration.helpers import (RUN_ID, TEST_PASSWORD, TEST_REGISTRY, TEST_USER, Build, registry_digest,
                                       run_cli)

pytestmark = [pytest.mark.docker, pytest.mark.registry]

AUTH = (TEST_USER, TEST_PASSWORD)
CREDS = {"IMAGEFACTORY_REGISTRY_USER": TEST_USER, "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD}
KEY_PASSWORD = f"kEy-pAss-{uuid.uuid4().hex[:12]}"
WRAPPER = """#!/bin/sh
# records each cosign call: its arguments, and the mode of the Docker config folder it was given
{{ printf '%s\\n' "$*"; if [ -n "$DOCKER_CONFIG" ]; then stat -c 'config %a %n' "$DOCKER_CONFIG"; fi; }} >> {log}
exec {cosign} "$@"
"""


def _cosign() -> str:
    exe = subprocess.run(["sh", "-c", "command -v cosign"], capture_output=True, text=True).stdout.strip()
    if not exe:
        if os.environ.get("CI"):
            pytest.fail("cosign is not installed (scripts/ci-setup.sh installs it)")
        pytest.skip("cosign is not installed; run `sudo bash scripts/ci-setup.sh` first")
    return exe


class Signed:
    """The shared image pushed to a repository of its own with `push --sign`."""

    def __init__(self, build: Build, name: str, keys: dict[str, Path], env: dict):
        self.image = f"{TEST_REGISTRY}/{name}-{RUN_ID}/train"
        self.matrix = build.with_image(self.image)
        self.env = env
        self.result = build.run("push", "--only", Build.GOOD, "--sign", str(keys["key"]), matrix=self.matrix, env=env)
        self.report_path = build.report_path
        self.cell = build.report()[Build.GOOD]
        failed = [f"{c['mode']}: {c['name']}: {c['actual']}" for c in self.cell["checks"] if c["verdict"] == "fail"]
        assert self.cell["pushed"], (self.cell["status"], self.cell["error"], failed, self.result.stderr[-2000:])
        self.release = next(p["ref"] for p in self.cell["pushed"] if ":sha-" not in p["ref"])
        self.digest = self.cell["pushed"][0]["digest"]
        self.repo = self.image.split("/", 1)[1]

    def verify(self, key: Path, *args: str) -> subprocess.CompletedProcess:
        return run_cli("verify", *(args or ("--matrix", str(self.matrix), "--only", Build.GOOD)), "--key", str(key),
                       env=CREDS)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    cosign = _cosign()
    root = tmp_path_factory.mktemp("keys")
    for prefix, password in (("one", KEY_PASSWORD), ("other", "another-password")):
        subprocess.run([cosign, "generate-key-pair", "--output-key-prefix", str(root / prefix)], cwd=root, check=True,
                       capture_output=True, env={**os.environ, "COSIGN_PASSWORD": password})
    log = root / "cosign-calls.log"
    wrapper = root / "cosign"
    wrapper.write_text(WRAPPER.format(log=log, cosign=cosign))
    wrapper.chmod(0o755)
    return {"key": root / "one.key", "pub": root / "one.pub", "other": root / "other.pub", "wrapper": wrapper,
            "log": log}


@pytest.fixture(scope="module")
def signer_env(keys) -> dict[str, str]:
    return {**CREDS, "COSIGN_PASSWORD": KEY_PASSWORD, "IMAGEFACTORY_COSIGN": str(keys["wrapper"])}


@pytest.fixture(scope="module")
def signed(cpu_build, test_registry, keys, signer_env, tmp_path_factory, created_images) -> Signed:
    s = Signed(cpu_build, "signed", keys, signer_env)
    created_images.extend(s.cell["tags"])
    assert s.result.returncode == 0, s.result.stdout[-3000:] + s.result.stderr[-3000:]
    return s


def test_push_sign_records_signature_and_attestations_and_verify_passes(signed, keys):
    cell = signed.cell
    assert cell["publish"] == "published" and cell["signing"] == "signed", cell
    (sig,) = cell["signatures"]  # every tag of the cell shares one digest: signed once
    assert sig["image"] == f"{signed.image}@{signed.digest}"
    hexdigest = signed.digest.split(":", 1)[1]
    assert sig["signature"] == f"{signed.image}:sha256-{hexdigest}.sig"
    assert sig["attestations"] == f"{signed.image}:sha256-{hexdigest}.att"
    for tag in ("sig", "att"):  # the digests the report gives are the ones the registry serves
        key = "signature_digest" if tag == "sig" else "attestations_digest"
        assert registry_digest(TEST_REGISTRY, signed.repo, f"sha256-{hexdigest}.{tag}") == sig[key]
    result = signed.verify(keys["pub"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{signed.release}: verified {signed.digest}" in result.stdout, result.stdout


def test_doctor_verify_checks_the_cells_it_judges(signed, keys):
    result = run_cli("doctor", "--matrix", str(signed.matrix), "--verify", str(keys["pub"]), env=CREDS)
    out = result.stdout
    assert f"verify:   {signed.release}: verified {signed.digest}" in out, out + result.stderr
    bad = next(line for line in out.splitlines() if line.startswith("verify:") and "mkl" in line)
    assert "FAILED: the registry does not serve it" in bad  # the failed cell was never pushed
    assert result.returncode == 1


def test_verify_with_another_key_fails_naming_the_key(signed, keys):
    result = signed.verify(keys["other"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{signed.release}: FAILED: not signed with key {keys['other']}" in result.stdout, result.stdout


def test_the_sbom_lists_torch_numpy_the_probed_blas_and_the_base_digest(signed, cpu_build, engine):
    from imagefactory.attest import sbom

    path = Path(signed.cell["sbom"])
    assert path == cpu_build.report_path.parent / "sbom" / f"{Build.GOOD}.cdx.json"
    doc = sbom.validate(path.read_text())
    purls = {c.get("purl", "") for c in doc["components"]}
    assert any(p.startswith("pkg:pypi/torch@2.13.0") for p in purls), sorted(purls)[:20]
    assert any(p.startswith("pkg:pypi/numpy@") for p in purls)
    assert any(p.startswith("pkg:deb/debian/libc6@") for p in purls)
    blas = [c for c in doc["components"] if c["name"] == "openblas"]
    paths = {p["value"] for c in blas for p in c.get("properties", ()) if p["name"] == "imagefactory:path"}
    # the library numpy really loads in the image (its log may hold no probe output: verdicts
    # cached from an earlier build of the same image are not probed again)
    loaded = engine.client.containers.run(signed.cell["image_id"], ["python", "-c", (
        "import json, numpy, threadpoolctl; "
        "print(json.dumps([i['filepath'] for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas']))")],
        network_mode="none", remove=True).decode().strip().splitlines()[-1]
    assert blas and paths and paths <= set(json.loads(loaded)), (blas, loaded)
    base = [c for c in doc["components"] if c.get("purl", "").startswith("pkg:oci/")]
    assert [c["version"] for c in base] == [signed.cell["base_digest"]], base
    assert sbom.described(doc) == {"content-hash": signed.cell["content_hash"], "image-id": signed.cell["image_id"],
                                   "cell": Build.GOOD}
    statement = json.loads(Path(signed.cell["provenance"]).read_text())
    pred = statement["predicate"]
    assert pred["buildDefinition"]["internalParameters"]["contentHash"] == signed.cell["content_hash"]
    assert pred["runDetails"]["byproducts"][0]["digest"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_same_image_gives_the_same_sbom_bytes(signed, cpu_build):
    before = Path(signed.cell["sbom"]).read_bytes()
    Path(signed.cell["sbom"]).unlink()  # made again by the next run that publishes, not left from this one
    result = cpu_build.run("push", "--only", Build.GOOD, matrix=signed.matrix, env=CREDS)  # the same digest again
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert Path(cpu_build.report()[Build.GOOD]["sbom"]).read_bytes() == before


def test_a_tampered_sbom_attestation_is_refused(signed, keys):
    repo, hexdigest = signed.repo, signed.digest.split(":", 1)[1]
    att_tag = f"sha256-{hexdigest}.att"
    manifest = _get_manifest(repo, att_tag)
    layer = next(x for x in manifest["layers"] if "cyclonedx" in json.dumps(x.get("annotations", {})))
    envelope = json.loads(_blob(repo, layer["digest"]))
    statement = json.loads(base64.b64decode(envelope["payload"]))
    torch = next(c for c in statement["predicate"]["components"] if c["name"] == "torch")
    torch["version"] = "2.13.0+evil"
    envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()  # the signature is kept
    body = json.dumps(envelope).encode()
    layer["digest"], layer["size"] = _upload(repo, body), len(body)
    _put_manifest(repo, att_tag, manifest)
    result = signed.verify(keys["pub"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{signed.release}: FAILED: " in result.stdout and "cyclonedx attestation" in result.stdout, result.stdout


def test_a_signed_sbom_of_another_image_is_refused(cpu_build, test_registry, keys, signer_env, tmp_path_factory,
                                                   created_images):
    other = Signed(cpu_build, "othersbom", keys, signer_env)
    created_images.extend(other.cell["tags"])
    assert other.result.returncode == 0, other.result.stderr[-3000:]
    doc = json.loads(Path(other.cell["sbom"]).read_text())
    for p in doc["metadata"]["component"]["properties"]:
        if p["name"] == "imagefactory:content-hash":
            p["value"] = hashlib.sha256(b"another image").hexdigest()
    forged = tmp_path_factory.mktemp("forged") / "sbom.json"
    forged.write_text(json.dumps(doc))
    _cosign_attest(keys, forged, f"{other.image}@{other.digest}")
    result = other.verify(keys["pub"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{other.release}: FAILED: SBOM for another image" in result.stdout, result.stdout


def test_an_image_pushed_without_the_signing_step_fails_verify(cpu_build, test_registry, keys, created_images):
    image = f"{TEST_REGISTRY}/unsigned-{RUN_ID}/train"
    result = cpu_build.run("push", "--only", Build.GOOD, matrix=cpu_build.with_image(image), env=CREDS)
    created_images.extend(cpu_build.report()[Build.GOOD]["tags"])
    assert result.returncode == 0, result.stderr[-3000:]
    release = next(t for t in cpu_build.report()[Build.GOOD]["tags"] if ":sha-" not in t)
    verdict = run_cli("verify", release, "--key", str(keys["pub"]), env=CREDS)
    assert verdict.returncode == 1 and f"{release}: FAILED: no signature" in verdict.stdout, verdict.stdout


def test_other_content_pushed_under_the_tag_fails_verify(signed, keys, engine, derive):
    """Last of the module's checks on `signed`: it moves the release tag."""
    other = derive("no-entrypoint", signed.cell["candidate"])
    engine.client.images.get(other).tag(signed.release)
    repo, tag = signed.release.rsplit(":", 1)
    for line in engine.client.api.push(repo, tag, auth_config={"username": TEST_USER, "password": TEST_PASSWORD},
                                       stream=True, decode=True):
        assert "error" not in line, line
    assert registry_digest(TEST_REGISTRY, signed.repo, tag) not in (None, signed.digest)
    result = signed.verify(keys["pub"])
    assert result.returncode == 1 and f"{signed.release}: FAILED: no signature" in result.stdout, result.stdout
    pinned = run_cli("verify", f"{signed.image}@{signed.digest}", "--key", str(keys["pub"]), env=CREDS)
    assert pinned.returncode == 1, pinned.stdout  # that digest's SBOM was tampered with above


def test_no_secret_reaches_cosign_arguments_reports_sboms_logs_or_signatures(signed, keys, cpu_build):
    calls = keys["log"].read_text()
    assert "sign --key" in calls and "attest --key" in calls, calls
    configs = [line.split() for line in calls.splitlines() if line.startswith("config ")]
    assert configs and all(mode == "700" for _, mode, _ in configs), configs  # a 0700 temporary Docker config
    assert not any(Path(path).exists() for _, _, path in configs)  # removed after
    places = {"cosign arguments": calls, "console": signed.result.stdout + signed.result.stderr}
    for f in sorted(p for p in cpu_build.report_path.parent.rglob("*") if p.is_file() and not p.is_symlink()):
        if f.stat().st_size < 16 << 20:  # reports, SBOMs, provenance, logs, contexts (not the wheels they link)
            places[str(f)] = f.read_text(errors="replace")
    assert any(name.endswith(".cdx.json") for name in places) and any("intoto" in n for n in places), sorted(places)
    hexdigest = signed.digest.split(":", 1)[1]
    places["docker history"] = subprocess.run(["docker", "history", "--no-trunc", signed.cell["image_id"]],
                                              capture_output=True, text=True, check=True).stdout
    image = _get_manifest(signed.repo, signed.digest)  # the image as the registry serves it: config and layers
    places["registry config"] = json.dumps(image) + _blob(signed.repo, image["config"]["digest"]).decode()
    for tag in ("sig", "att"):
        manifest = _get_manifest(signed.repo, f"sha256-{hexdigest}.{tag}")
        places[f".{tag}"] = json.dumps(manifest) + "".join(_blob(signed.repo, x["digest"]).decode(errors="replace")
                                                           for x in manifest["layers"])
    found = [(where, s) for where, text in places.items() for s in (KEY_PASSWORD, TEST_PASSWORD) if s in text]
    assert not found, found


# --------------------------------------------------------------------------- registry helpers

ACCEPT = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"


def _get_manifest(repo: str, ref: str) -> dict:
    r = requests.get(f"http://{TEST_REGISTRY}/v2/{repo}/manifests/{ref}", auth=AUTH, headers={"Accept": ACCEPT},
                     timeout=30)
    r.raise_for_status()
    return r.json()


def _put_manifest(repo: str, ref: str, manifest: dict) -> None:
    r = requests.put(f"http://{TEST_REGISTRY}/v2/{repo}/manifests/{ref}", auth=AUTH, data=json.dumps(manifest),
                     headers={"Content-Type": manifest["mediaType"]}, timeout=30)
    r.raise_for_status()


def _blob(repo: str, digest: str) -> bytes:
    r = requests.get(f"http://{TEST_REGISTRY}/v2/{repo}/blobs/{digest}", auth=AUTH, timeout=60)
    r.raise_for_status()
    return r.content


def _upload(repo: str, body: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    start = requests.post(f"http://{TEST_REGISTRY}/v2/{repo}/blobs/uploads/", auth=AUTH, timeout=30)
    start.raise_for_status()
    location = start.headers["Location"]
    url = location if location.startswith("http") else f"http://{TEST_REGISTRY}{location}"
    done = requests.put(url, params={"digest": digest}, data=body, auth=AUTH, timeout=30,
                        headers={"Content-Type": "application/octet-stream"})
    done.raise_for_status()
    return digest


def _cosign_attest(keys: dict, predicate: Path, pinned: str) -> None:
    config = predicate.parent / "docker-config"
    config.mkdir(mode=0o700)
    token = base64.b64encode(f"{TEST_USER}:{TEST_PASSWORD}".encode()).decode()
    (config / "config.json").write_text(json.dumps({"auths": {TEST_REGISTRY: {"auth": token}}}))
    r = subprocess.run([_cosign(), "attest", "--key", str(keys["key"]), "--tlog-upload=false", "-y", "--type",
                        "cyclonedx", "--predicate", str(predicate), pinned], capture_output=True, text=True,
                       env={**os.environ, "COSIGN_PASSWORD": KEY_PASSWORD, "DOCKER_CONFIG": str(config)})
    assert r.returncode == 0, r.stderr
