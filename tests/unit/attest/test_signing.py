"""issue 24 without an engine or a registry: the SBOM (CycloneDX 1.6, same input -> same bytes,
well-formed purls), the provenance, the cosign command lines (no secret on them, the login in a
0700 temporary Docker config), cosign's version check, what `verify` says for cosign's answers,
and cosign's .sig/.att tags next to the tag, freshness and registry-cache logic.

The real-registry counterpart is tests/integration/test_signing.py."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from packageurl import PackageURL

from imagefactory.engine import logins
from imagefactory.pipeline import build
from imagefactory.config import matrix
from imagefactory.attest import provenance
from imagefactory.publish import push
from imagefactory.pipeline import regcache
from imagefactory.attest import sbom
from imagefactory.attest import signing
from imagefactory.attest import supply
from imagefactory.config import tags
from imagefactory.run.context import BuildOptions, PushOptions, TestOptions
from imagefactory.errors import ConfigError
from imagefactory.lock.lockfile import Lock, Pin
from imagefactory.run.results import PASSED, PUBLISHED, CellReport
from tests.fake_engine import World
from tests.unit.helpers import BASE_DIGESTS, CPU_OPENBLAS, TWO_PIP_CELLS, good_probe

REPO = Path(__file__).resolve().parents[3]
BASE = "127.0.0.1:5000/library/python:3.11-slim-bookworm@sha256:" + "c" * 64
SUBJECT = sbom.Subject("127.0.0.1:5001/ml/train", CPU_OPENBLAS.id, "a" * 64, "sha256:" + "b" * 64, BASE)


def inventory_probe(cell=CPU_OPENBLAS) -> dict:
    """good_probe plus what the probe's sbom section reports in a conda-free pip image."""
    probe = good_probe(cell)
    probe["packages"] = {"error": None, "python": {"torch": "2.13.0+cpu", "numpy": "2.2.1", "Jinja2": "3.1.6"},
                         "conda": None}
    probe["sbom"] = {"error": None, "dpkg": [
        {"name": "libc6", "version": "2.36-9+deb12u10", "arch": "amd64", "source": "glibc"},
        {"name": "tzdata", "version": "2025b-0+deb12u1", "arch": "all", "source": None}],
        "conda": [{"name": "libblas", "version": "3.9.0", "build": "31_h59b9bed_openblas", "channel":
                   "https://conda.anaconda.org/conda-forge", "subdir": "linux-64", "sha256": "d" * 64}],
        "libraries": {"cudart": ["/opt/venv/lib/libcudart.so.13"]},
        "versions": {"cuda": "13.0", "cudnn": "92400", "nccl": "2.27.7"}}
    return probe


# --------------------------------------------------------------------------- the SBOM

def test_the_sbom_validates_against_cyclonedx_1_6_and_is_byte_identical_for_the_same_input():
    probe = inventory_probe()
    text = sbom.document(SUBJECT, probe, None)
    doc = sbom.validate(text)
    assert doc["specVersion"] == "1.6" and "timestamp" not in doc["metadata"]
    assert sbom.document(SUBJECT, copy.deepcopy(probe), None) == text  # no time, no random serial
    changed = copy.deepcopy(probe)
    changed["packages"]["python"]["numpy"] = "2.2.2"
    other = sbom.document(SUBJECT, changed, None)
    assert other != text and json.loads(other)["serialNumber"] != doc["serialNumber"]  # derived from content
    assert sbom.described(doc) == {"content-hash": "a" * 64, "image-id": "sha256:" + "b" * 64,
                                   "cell": CPU_OPENBLAS.id}


def test_an_sbom_whose_bytes_passed_before_is_not_validated_again_one_that_failed_always_is(monkeypatch):
    """The no-op build's SBOM has the same bytes every run: the validator (seconds of jsonschema
    import) runs for new bytes only, and bytes that failed are never remembered as passing."""
    from cyclonedx.validation import json as cdx_json

    text = sbom.document(SUBJECT, inventory_probe(), None)  # validated once, remembered
    seen: list[str] = []
    real = cdx_json.JsonStrictValidator.validate_str
    monkeypatch.setattr(cdx_json.JsonStrictValidator, "validate_str", lambda self, t: seen.append(t) or real(self, t))
    assert sbom.validate(text)["specVersion"] == "1.6" and seen == []
    doc = json.loads(text)
    doc["components"][0]["type"] = "rootkit"
    for tries in (1, 2):
        with pytest.raises(sbom.SbomError, match="not a valid CycloneDX 1.6"):
            sbom.validate(json.dumps(doc))
        assert len(seen) == tries
    kept = sbom.VALIDATED.file(sbom.validation_key(text))
    assert kept is not None and kept.exists()
    kept.unlink()
    kept.symlink_to(Path(os.environ["IMAGEFACTORY_CACHE_DIR"]))  # a link is no pass: validated again
    sbom.validate(text)
    assert len(seen) == 3


def test_an_sbom_made_before_from_the_same_input_is_read_back_not_made_again(monkeypatch):
    """The no-op build's SBOM: the same subject, probe and lock give the document kept in the cache
    folder, without cyclonedx-python-lib; any change to what it reads makes it anew."""
    probe = inventory_probe()
    text = sbom.document(SUBJECT, probe, None)
    made: list[sbom.Subject] = []
    real = sbom._made
    monkeypatch.setattr(sbom, "_made", lambda subject, p, lock: made.append(subject) or real(subject, p, lock))
    assert sbom.document(SUBJECT, copy.deepcopy(probe), None) == text and made == []
    changed = copy.deepcopy(probe)
    changed["packages"]["python"]["numpy"] = "2.2.2"
    assert sbom.document(SUBJECT, changed, None) != text and len(made) == 1
    lock = Lock(Path("locks/x.txt"), "pip", (), (Pin("torch", "2.13.0+cpu", ("e" * 64,), 3),), "")
    locked = sbom.document(SUBJECT, probe, lock)
    assert locked != text and len(made) == 2
    other = Lock(Path("locks/x.txt"), "pip", (), (Pin("torch", "2.13.0+cpu", ("f" * 64,), 3),), "")
    assert sbom.document(SUBJECT, probe, other) != locked and len(made) == 3  # another hash: another document


def test_an_edit_to_the_code_that_makes_a_kept_document_is_a_new_key(tmp_path, monkeypatch):
    """An editable install changes code without a new version: the kept SBOMs are keyed by their
    module's source too (store.code_digest). Checked certificates are kept no more: each run parses
    them, and nothing of theirs lands in the cache folder."""
    import importlib
    import sys

    from imagefactory.config import cacerts
    from imagefactory.files import store

    mod = tmp_path / "codedigest_probe.py"
    mod.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("codedigest_probe")
    try:
        before = store.code_digest("codedigest_probe")
        mod.write_text("X = 2\n")
        store.code_digest.cache_clear()
        assert store.code_digest("codedigest_probe") != before
    finally:
        sys.modules.pop("codedigest_probe", None)
        store.code_digest.cache_clear()
    probe = inventory_probe()
    key = sbom.document_key(SUBJECT, probe, None)
    real = store.code_digest
    monkeypatch.setattr(store, "code_digest", lambda *names: real(*names) + "-edited")
    assert sbom.document_key(SUBJECT, probe, None) != key
    assert not hasattr(cacerts, "_certificates_key") and not hasattr(cacerts, "CERTS_CHECKED")
    ca = Path(__file__).parents[2] / "golden" / "certs" / "corp-ca.pem"
    cache = Path(os.environ["IMAGEFACTORY_CACHE_DIR"])
    before = sorted(cache.rglob("*")) if cache.exists() else []
    assert cacerts.certificates(ca) == cacerts.certificates(ca)
    assert cacerts.certificates(ca).startswith(b"-----BEGIN CERTIFICATE-----\n")
    assert (sorted(cache.rglob("*")) if cache.exists() else []) == before


def test_a_kept_sbom_is_used_only_for_the_image_it_describes_and_only_while_it_validates(monkeypatch):
    probe = inventory_probe()
    text = sbom.document(SUBJECT, probe, None)
    kept = sbom._document_file(sbom.document_key(SUBJECT, probe, None))
    assert kept is not None and kept.read_text() == text
    other = sbom.Subject(SUBJECT.image, SUBJECT.cell, SUBJECT.content_hash, "sha256:" + "9" * 64, BASE)
    planted = sbom._document_file(sbom.document_key(other, probe, None))
    assert planted is not None
    planted.write_text(text)  # another image's document under this image's key
    doc = sbom.validate(sbom.document(other, probe, None))
    assert sbom.described(doc)["image-id"] == "sha256:" + "9" * 64
    broken = json.loads(text)
    broken["components"][0]["type"] = "rootkit"
    kept.write_text(json.dumps(broken))  # no longer valid CycloneDX: made again
    assert sbom.document(SUBJECT, probe, None) == text
    elsewhere = kept.parent.parent / "elsewhere.cdx.json"
    elsewhere.write_text(text)  # the right bytes, but behind a link: never followed
    kept.unlink()
    kept.symlink_to(elsewhere)
    monkeypatch.setattr(sbom, "_made", lambda *a: "made")
    monkeypatch.setattr(sbom, "keep_document", lambda *a: None)
    assert sbom.document(SUBJECT, probe, None) == "made"


def test_a_tampered_sbom_fails_the_strict_validator():
    doc = json.loads(sbom.document(SUBJECT, inventory_probe(), None))
    doc["components"][0]["type"] = "rootkit"
    with pytest.raises(sbom.SbomError, match="not a valid CycloneDX 1.6"):
        sbom.validate(json.dumps(doc))


def test_purls_are_well_formed_for_pip_conda_deb_and_the_base_image():
    doc = sbom.validate(sbom.document(SUBJECT, inventory_probe(), None))
    purls = {c["purl"]: PackageURL.from_string(c["purl"]) for c in doc["components"] if "purl" in c}
    by_name = {(p.type, p.name): (p, s) for s, p in purls.items()}
    torch, text = by_name[("pypi", "torch")]
    assert torch.version == "2.13.0+cpu" and text == "pkg:pypi/torch@2.13.0%2Bcpu"
    assert ("pypi", "jinja2") in by_name  # PyPI names are lower case in a purl
    conda, text = by_name[("conda", "libblas")]
    assert conda.qualifiers == {"build": "31_h59b9bed_openblas", "channel": "https://conda.anaconda.org/conda-forge",
                                "subdir": "linux-64"}, text
    deb, text = by_name[("deb", "libc6")]
    assert deb.namespace == "debian" and deb.version == "2.36-9+deb12u10" and deb.qualifiers == {"arch": "amd64"}
    base, _ = by_name[("oci", "python")]
    assert base.version == "sha256:" + "c" * 64
    assert base.qualifiers == {"repository_url": "127.0.0.1:5000/library/python", "tag": "3.11-slim-bookworm"}
    for text, p in purls.items():
        assert PackageURL.from_string(p.to_string()).to_string() == text  # round trip


def test_native_libraries_with_versions_and_the_locks_hashes():
    lock = Lock(Path("locks/x.txt"), "pip", (), (Pin("torch", "2.13.0+cpu", ("e" * 64, "f" * 64), 3),), "")
    doc = sbom.validate(sbom.document(SUBJECT, inventory_probe(), lock))
    comps = {c["name"]: c for c in doc["components"]}
    assert {h["content"] for h in comps["torch"]["hashes"]} == {"e" * 64, "f" * 64}
    assert "hashes" not in comps["numpy"]  # not in the lock
    assert comps["openblas"]["version"] == "0.3.31"  # threadpoolctl's version of the loaded BLAS
    assert {"name": "imagefactory:path", "value": "/opt/lib/libopenblas.so"} in comps["openblas"]["properties"]
    assert comps["cudart"]["version"] == "13.0"
    assert comps["mkl"]["version"] == "unknown"  # torch's static MKL (BLAS_INFO=mkl)
    assert comps["libblas"]["hashes"] == [{"alg": "SHA-256", "content": "d" * 64}]


@pytest.mark.parametrize("hostile", ["1.0\nname: evil", "", "x" * 300, None, 7])
def test_values_from_the_image_are_kept_only_when_wholly_well_formed(hostile):
    probe = inventory_probe()
    probe["packages"]["python"]["evil"] = hostile
    doc = sbom.validate(sbom.document(SUBJECT, probe, None))
    assert "evil" not in {c["name"] for c in doc["components"]}


def test_an_sbom_needs_a_base_pinned_by_digest_and_an_image_id():
    with pytest.raises(sbom.SbomError, match="not pinned"):
        sbom.document(sbom.Subject("r/x", "c", "a" * 64, "sha256:" + "b" * 64, "python:3.11"), inventory_probe(), None)
    with pytest.raises(sbom.SbomError, match="no content hash or image id"):
        sbom.document(sbom.Subject("r/x", "c", "a" * 64, "", BASE), inventory_probe(), None)


# --------------------------------------------------------------------------- provenance

def test_provenance_names_the_matrix_cell_content_base_lock_builder_and_commit(tmp_path):
    m = tmp_path / "matrix.yaml"
    m.write_text("image: x\n")
    lock = tmp_path / "locks" / "c.txt"
    lock.parent.mkdir()
    lock.write_text("torch==2.13.0\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.email=t@e", "-c", "user.name=t", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    git = provenance.git_commit(tmp_path, m)
    assert git is not None and git["dirty"] is True  # matrix.yaml is not committed
    pred = provenance.predicate(matrix_path=m, cell="c", content_hash="a" * 64, builder="buildkit", base_image=BASE,
                                lock_path=lock, sbom_sha256="9" * 64, git=git)
    bd = pred["buildDefinition"]
    assert bd["externalParameters"]["matrix"]["sha256"] == provenance.sha256_text("image: x\n")
    assert bd["externalParameters"]["cell"] == "c" and provenance.content_hash_of(pred) == "a" * 64
    deps = {d["name"]: d for d in bd["resolvedDependencies"]}
    assert deps["base-image"]["digest"] == {"sha256": "c" * 64}
    assert deps["lock"]["digest"] == {"sha256": provenance.sha256_text("torch==2.13.0\n")}
    assert deps["matrix-repository"]["digest"]["gitCommit"] == git["commit"]
    assert pred["runDetails"]["builder"]["id"] == "urn:imagefactory:builder:buildkit"
    statement = provenance.statement("r/x", "sha256:" + "b" * 64, pred)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    assert provenance.git_commit(tmp_path / "locks", lock) is not None


def test_provenance_outside_a_repository_has_no_commit(tmp_path):
    m = tmp_path / "matrix.yaml"
    m.write_text("image: x\n")
    assert provenance.git_commit(tmp_path, m) is None
    pred = provenance.predicate(matrix_path=m, cell="c", content_hash="a" * 64, builder="classic", base_image=BASE,
                                lock_path=None, sbom_sha256=None, git=None)
    assert [d["name"] for d in pred["buildDefinition"]["resolvedDependencies"]] == ["base-image"]


# --------------------------------------------------------------------------- cosign

FAKE_COSIGN = """#!/bin/sh
# a stand-in cosign: records its arguments, environment and Docker config, answers as told
printf '%s\\n' "$*" >> "{log}"
env | sort > "{log}.env.$$"
if [ -n "$DOCKER_CONFIG" ]; then stat -c '%a' "$DOCKER_CONFIG" >> "{log}.mode"; cat "$DOCKER_CONFIG/config.json" >> "{log}.config"; fi
case "$1" in
  version) echo '{{"gitVersion": "{version}"}}' ;;
  sign) [ "$2" = "--help" ] && echo "{sign_help}" ;;
  triangulate) d=$(printf '%s' "$4" | sed 's/.*@sha256:/sha256-/'); s=att; [ "$3" = signature ] && s=sig
    echo "127.0.0.1:5001/ml/train:$d.$s" ;;
esac
exit {code}
"""


@pytest.fixture
def fake_cosign(tmp_path, monkeypatch):
    def make(version: str = "v2.5.0", code: int = 0, sign_help: str = "--tlog-upload=true:") -> Path:
        log = tmp_path / "calls.log"
        exe = tmp_path / f"cosign-{version}-{code}"
        exe.write_text(FAKE_COSIGN.format(log=log, version=version, code=code, sign_help=sign_help))
        exe.chmod(0o755)
        monkeypatch.setenv(signing.COSIGN_ENV, str(exe))
        signing.check_version.cache_clear()
        return log

    return make


@pytest.fixture
def keys(tmp_path):
    key = tmp_path / "cosign.key"
    key.write_text("-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\nabc\n-----END ENCRYPTED SIGSTORE PRIVATE KEY-----\n")
    pub = tmp_path / "cosign.pub"
    pub.write_text("-----BEGIN PUBLIC KEY-----\nabc\n-----END PUBLIC KEY-----\n")
    return key, pub


def test_the_cosign_command_lines_carry_no_secret_and_the_login_goes_through_a_0700_config(
        fake_cosign, keys, tmp_path, monkeypatch):
    log = fake_cosign()
    monkeypatch.setenv(signing.PASSWORD_ENV, "key-pass-XYZ")
    key = signing.check_key(str(keys[0]), private=True, flag="--sign")
    sbom_file, pred = tmp_path / "sbom.json", tmp_path / "prov.json"
    sbom_file.write_text("{}")
    pred.write_text("{}")
    pinned = "127.0.0.1:5001/ml/train@sha256:" + "a" * 64
    signed = signing.sign(key, pinned, sbom_file, pred, {"username": "ci", "password": "reg-pass-ABC"})
    calls = log.read_text()
    assert "reg-pass-ABC" not in calls and "key-pass-XYZ" not in calls
    assert f"sign --key {keys[0]} --tlog-upload=false -y {pinned}" in calls
    assert "--type cyclonedx --predicate" in calls and "--type slsaprovenance1 --predicate" in calls
    assert set(Path(str(log) + ".mode").read_text().split()) == {"700"}
    assert "reg-pass-ABC" not in Path(str(log) + ".config").read_text()  # base64 in config.json, as Docker keeps it
    assert '"127.0.0.1:5001"' in Path(str(log) + ".config").read_text()
    envs = [p.read_text() for p in tmp_path.glob("calls.log.env.*")]
    assert all("COSIGN_PASSWORD=key-pass-XYZ" in e for e in envs)
    assert not any("IMAGEFACTORY_REGISTRY" in e for e in envs)
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("imagefactory-cosign-*"))  # removed after
    assert signed.signature == f"127.0.0.1:5001/ml/train:sha256-{'a' * 64}.sig"
    assert signed.attestations == f"127.0.0.1:5001/ml/train:sha256-{'a' * 64}.att"


def test_verify_gets_no_key_password_and_maps_cosigns_exit_codes(fake_cosign, keys, tmp_path, monkeypatch):
    monkeypatch.setenv(signing.PASSWORD_ENV, "key-pass-XYZ")
    pub = signing.check_key(str(keys[1]), private=False, flag="--key")
    pinned = "127.0.0.1:5001/ml/train@sha256:" + "a" * 64
    for code, message in ((10, "no signature"), (12, f"not signed with key {keys[1]}")):
        fake_cosign(code=code)
        with pytest.raises(signing.Refused, match=message):
            signing.verify_signature(pub, pinned, None)
    assert not any("COSIGN_PASSWORD" in p.read_text() for p in tmp_path.glob("calls.log.env.*"))


@pytest.mark.parametrize("version, sign_help, ok", [
    ("v2.5.0", "", True), ("2.4.1", "", True), ("v3.0.1", "", False), ("v1.13.6", "", False),
    ("devel", "--tlog-upload=true:", True), ("devel", "--tlog-upload=true: --use-signing-config=true:", False),
    ("devel", "", False)])
def test_cosign_versions_other_than_2_are_refused(fake_cosign, version, sign_help, ok):
    fake_cosign(version=version, sign_help=sign_help)
    if ok:
        assert signing.check_version(signing.executable())
        return
    with pytest.raises(ConfigError) as e:
        signing.check_version(signing.executable())
    assert "install cosign 2.x" in str(e.value)
    if version.startswith("v3"):
        assert "cosign v3.0.1" in str(e.value) and "cosign 3 changed the signing flags" in str(e.value)


def test_keys_are_checked_before_anything_runs(keys, tmp_path, monkeypatch):
    monkeypatch.delenv(signing.PASSWORD_ENV, raising=False)
    with pytest.raises(ConfigError, match="set COSIGN_PASSWORD"):
        signing.check_key(str(keys[0]), private=True, flag="--sign")
    monkeypatch.setenv(signing.PASSWORD_ENV, "")  # a key made without a password
    assert signing.check_key(str(keys[0]), private=True, flag="--sign").ref == str(keys[0].resolve())
    with pytest.raises(ConfigError, match="not an encrypted cosign private key"):
        signing.check_key(str(keys[1]), private=True, flag="--sign")
    with pytest.raises(ConfigError, match="cannot read the key file"):
        signing.check_key(str(tmp_path / "nope.key"), private=True, flag="--sign")
    with pytest.raises(ConfigError, match="not a key file, and not a KMS URI"):
        signing.check_key("ftp://kms/key", private=True, flag="--sign")
    kms = signing.check_key("awskms:///alias/imagefactory", private=True, flag="--sign")
    assert kms.kms and kms.ref == "awskms:///alias/imagefactory"
    with pytest.raises(ConfigError):
        signing.check_key("awskms:///alias/x\n--key evil", private=True, flag="--sign")


def test_cosigns_output_reaches_the_user_as_one_bounded_escaped_line():
    text = "WARNING: x\nError: bad \x1b[31mthing\x1b[0m with reg-pass " + "y" * 500 + "\nerror during command execution"
    line = signing.tail(text, ("reg-pass",))
    assert "\x1b" not in line and "reg-pass" not in line and len(line) <= signing.TAIL_CHARS
    assert line.startswith("bad ")


# --------------------------------------------------------------------------- signing in the pipeline

def test_atomic_signs_nothing_when_a_cell_was_not_published(tmp_path, write_matrix, fake_cosign, keys, monkeypatch):
    log = fake_cosign()
    m = matrix.load(write_matrix(TWO_PIP_CELLS))
    reports = [CellReport(cell=c.id, status=PASSED, publish=PUBLISHED if i == 0 else "publish-failed",
                          pushed=[{"ref": c.tags[0], "digest": "sha256:" + "1" * 64}]) for i, c in enumerate(m.cells)]
    world = World()
    supply.sign_published(m, reports, world.context(PushOptions(push=True, atomic=True, sign=str(keys[0]))),
                          lambda ref: logins.auth_for(ref, logins.registry_credentials(m)))
    assert not log.exists()
    assert reports[0].signing == "not-signed" and "--atomic" in reports[0].error


def test_a_cell_without_an_sbom_is_not_signed_and_fails(tmp_path, write_matrix, fake_cosign, keys, monkeypatch):
    monkeypatch.setenv(signing.PASSWORD_ENV, "")
    log = fake_cosign()
    m = matrix.load(write_matrix(TWO_PIP_CELLS))
    c = m.cells[0]
    r = CellReport(cell=c.id, status=PASSED, publish=PUBLISHED, pushed=[{"ref": c.tags[0], "digest": "sha256:" + "1" * 64}])
    supply.sign_published(m, [r], World().context(PushOptions(push=True, sign=str(keys[0]))),
                          lambda ref: logins.auth_for(ref, logins.registry_credentials(m)))
    assert not log.exists() and r.signing == "sign-failed" and r.publish == "publish-failed" and not r.ok
    assert "no SBOM" in r.error


def test_a_passing_build_that_pushes_writes_the_sbom_and_provenance_beside_the_report(tmp_path, write_matrix):
    m = matrix.load(write_matrix(TWO_PIP_CELLS))
    probes = {c.id: inventory_probe(c) for c in m.cells}
    world = World(probes=probes, registry=dict(BASE_DIGESTS))
    opts = BuildOptions(work_dir=tmp_path / "w", report=tmp_path / "out" / "report.json", verdicts_dir=tmp_path / "v",
                        push=True)
    reports = build.build(m, list(m.cells), world.context(opts)).reports
    assert {r.status for r in reports} == {PASSED}, [r.error for r in reports]
    first = {}
    for r in reports:
        assert Path(r.sbom) == tmp_path / "out" / "sbom" / f"{r.cell}.cdx.json"
        doc = sbom.validate(Path(r.sbom).read_text())
        assert sbom.described(doc)["image-id"] == r.image_id
        assert json.loads(Path(r.provenance).read_text())["subject"][0]["digest"]["sha256"] == r.image_id[7:]
        first[r.cell] = Path(r.sbom).read_bytes()
    again = build.build(m, list(m.cells), world.context(opts)).reports  # cached image, cached verdicts
    assert {r.verdicts for r in again} == {"cached"}
    assert {r.cell: Path(r.sbom).read_bytes() for r in again} == first


def test_a_build_or_test_that_pushes_nothing_writes_no_sbom_or_provenance(tmp_path, write_matrix):
    m = matrix.load(write_matrix(TWO_PIP_CELLS))
    world = World(probes={c.id: inventory_probe(c) for c in m.cells}, registry=dict(BASE_DIGESTS))
    out = tmp_path / "out"
    common = dict(work_dir=tmp_path / "w", report=out / "report.json", verdicts_dir=tmp_path / "v")
    built = build.build(m, list(m.cells), world.context(BuildOptions(**common))).reports
    tested = build.test(m, list(m.cells), world.context(TestOptions(**common))).reports
    for reports in (built, tested):
        assert {r.status for r in reports} == {PASSED}, [r.error for r in reports]
        assert {(r.sbom, r.provenance) for r in reports} == {("", "")}
    assert not (out / "sbom").exists() and not (out / "provenance").exists()


# --------------------------------------------------------------------------- cosign's tags stay apart

def test_a_release_tag_shaped_like_a_cosign_tag_is_refused():
    for suffix in ("sig", "att", "sbom"):
        why = tags.refusal(f"127.0.0.1:5001/ml/train:sha256-{'a' * 64}.{suffix}", ("127.0.0.1:5001",))
        assert why and "cosign" in why
    assert tags.refusal(f"127.0.0.1:5001/ml/train:sha256-{'a' * 12}", ("127.0.0.1:5001",)) is None


def test_cosign_tags_in_the_registry_do_not_confuse_the_registry_cache_or_freshness(tmp_path, write_matrix,
                                                                                    monkeypatch):
    monkeypatch.setenv(logins.USER_ENV, "ci")
    monkeypatch.setenv(logins.PASSWORD_ENV, "s3cret")
    m = matrix.load(write_matrix(TWO_PIP_CELLS.replace("registry.example.com/ml/train", "127.0.0.1:5001/it/fast")))
    world = World(probes={c.id: good_probe(c, cpus=2) for c in m.cells}, registry=dict(BASE_DIGESTS))
    opts = BuildOptions(work_dir=tmp_path / "w1", verdicts_dir=tmp_path / "c1", push=True)
    first = build.build(m, list(m.cells), world.context(opts)).reports
    push.publish(m, first, world.context(opts))
    for ref, digest in list(world.registry.items()):  # what `cosign sign` and `attest` leave beside each digest
        repo = ref.rsplit(":", 1)[0]
        for kind in ("sig", "att"):
            world.registry[f"{repo}:{digest.replace(':', '-')}.{kind}"] = "sha256:" + "5" * 64
        for base in BASE_DIGESTS:
            world.registry[f"{base.split(':')[0]}:{BASE_DIGESTS[base].replace(':', '-')}.sig"] = "sha256:" + "6" * 64
    world.images.clear()
    world.calls.clear()
    opts2 = BuildOptions(work_dir=tmp_path / "w2", verdicts_dir=tmp_path / "c2", push=True)
    again = {r.cell: r for r in build.build(m, list(m.cells), world.context(opts2)).reports}
    assert world.ops("build") == []  # pulled by content tag, as without signatures
    for r in first:
        ref = regcache.content_ref(m, m.cell(r.cell), r.content_hash)
        assert again[r.cell].pulled == f"{ref}@{world.registry[ref]}"
        assert again[r.cell].base_digest == r.base_digest  # freshness: the base tag, not a .sig beside it
    assert not [ref for ref in world.ops("registry_digest") if ref.endswith((".sig", ".att"))]
    push.publish(m, list(again.values()), world.context(opts2))
    assert not [ref for r in again.values() for ref in r.tags if signing.cosign_tag(ref.rsplit(":", 1)[1])]


# --------------------------------------------------------------------------- ci-setup

def _ci_setup_functions() -> str:
    text = (REPO / "scripts" / "ci-setup.sh").read_text()
    out = []
    for name in ("cosign_major", "check_cosign"):
        start = text.index(f"{name}() {{")
        out.append(text[start:text.index("\n}\n", start) + 3])
    return "\n".join(out)


@pytest.mark.parametrize("answer, deb, ok", [("GitVersion:    v2.5.0", "", True), ("GitVersion:    v3.0.1", "", False),
                                            ("GitVersion:    devel", "2.5.0-2+b5", True),
                                            ("GitVersion:    devel", "3.0.2-1", False),
                                            ("GitVersion:    devel", "", False)])
def test_ci_setup_refuses_a_cosign_that_is_not_2(tmp_path, answer, deb, ok):
    fake = tmp_path / "cosign"
    fake.write_text(f"#!/bin/sh\necho '{answer}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    script = ('set -euo pipefail\nCOSIGN_STAMP=/nonexistent\nCOSIGN_MAJOR=2\n'
              'die() { echo "FAILED: $*" >&2; exit 1; }\n' + _ci_setup_functions() + f'\ncheck_cosign {fake} "{deb}"\n')
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert (r.returncode == 0) == ok, r.stderr
    if "v3" in answer or deb.startswith("3"):
        assert "is cosign 3.x" in r.stderr and "cosign 3 changed the signing flags" in r.stderr


# --------------------------------------------------------------------------- verify's judgement

def _statements(sbom_text: str, content: str) -> dict[str, list[dict]]:
    digest = {"sha256": "a" * 64}
    pred = provenance.predicate(matrix_path=REPO / "pyproject.toml", cell="c", content_hash=content, builder="classic",
                                base_image=BASE, lock_path=None, sbom_sha256=None, git=None)
    return {"cyclonedx": [{"subject": [{"name": "r", "digest": digest}], "predicate": json.loads(sbom_text)}],
            "slsaprovenance1": [{"subject": [{"name": "r", "digest": digest}], "predicate": pred}]}


@pytest.mark.parametrize("case, expect", [
    ("ok", "verified"), ("other-content", "FAILED: SBOM for another image"),
    ("other-config", "FAILED: SBOM for another image"), ("no-label", "FAILED: the image has no"),
    ("provenance", "FAILED: provenance for another image"), ("subject", "attestation for another digest"),
    ("invalid", "FAILED: SBOM attestation: not a valid CycloneDX"),
    # the containerd image store names the image by its manifest digest, the one verified: the same image
    ("manifest-id", "verified"), ("other-manifest-id", "FAILED: SBOM for another image")])
def test_verify_refuses_attestations_that_do_not_describe_the_image(monkeypatch, case, expect):
    from imagefactory.attest import verify

    content, config = "a" * 64, "sha256:" + "b" * 64
    statements = _statements(sbom.document(SUBJECT, inventory_probe(), None), content)
    labels = {} if case == "no-label" else {"io.imagefactory.content-hash": content}
    if case in ("other-content", "other-config"):
        other = sbom.Subject(SUBJECT.image, SUBJECT.cell, "e" * 64 if case == "other-content" else content,
                             "sha256:" + "f" * 64 if case == "other-config" else config, BASE)
        statements["cyclonedx"].append({"subject": statements["cyclonedx"][0]["subject"],
                                        "predicate": json.loads(sbom.document(other, inventory_probe(), None))})
    if case in ("manifest-id", "other-manifest-id"):
        by_manifest = sbom.Subject(SUBJECT.image, SUBJECT.cell, content,
                                   "sha256:" + ("a" if case == "manifest-id" else "c") * 64, BASE)
        statements["cyclonedx"][0]["predicate"] = json.loads(sbom.document(by_manifest, inventory_probe(), None))
    if case == "provenance":
        statements["slsaprovenance1"][0]["predicate"]["buildDefinition"]["internalParameters"]["contentHash"] = "9" * 64
    if case == "subject":
        statements["slsaprovenance1"][0]["subject"][0]["digest"]["sha256"] = "0" * 64
    if case == "invalid":
        statements["cyclonedx"][0]["predicate"]["components"][0]["type"] = "rootkit"
    monkeypatch.setattr(verify, "manifest_digest", lambda ref, auth: "sha256:" + "a" * 64)
    monkeypatch.setattr(verify, "image_config", lambda pinned, auth: (config, labels))
    monkeypatch.setattr(signing, "verify_signature", lambda key, pinned, auth: None)
    monkeypatch.setattr(signing, "verified_statements", lambda key, pinned, kind, auth: statements[kind])
    v = verify.verify_ref("127.0.0.1:5001/ml/train:1", signing.Key("/k.pub", False), None)
    assert expect in v.line and v.ok == (case in ("ok", "manifest-id")), v.line
    assert "\n" not in v.line


def test_doctor_verify_fails_the_exit_code_and_prints_each_line():
    from imagefactory.tools import doctor

    report = doctor.Report(engine=doctor.EngineFacts(reachable=True), driver=doctor.Driver(), matrix="m.yaml",
                           cells=[], recommended=None)
    assert report.exit_code == 0
    report.verification = [{"ok": False, "line": "r:1: FAILED: no signature"}]
    assert report.exit_code == 1 and "verify:   r:1: FAILED: no signature" in doctor.text(report)
    assert report.to_json()["verification"] == report.verification


@pytest.mark.parametrize("registry, scheme", [("127.0.0.1:5001", "http"), ("localhost:5000", "http"),
                                              ("[::1]:5000", "http"), ("ghcr.io", "https"),
                                              ("127.0.0.1.evil.example:5000", "https"), ("localhost.evil", "https")])
def test_verify_reads_plain_http_only_from_loopback_registries(registry, scheme):
    from imagefactory.config.registries import Registry

    assert Registry(registry).scheme == scheme


def test_the_probes_inventory_survives_an_unreadable_conda_meta(tmp_path, monkeypatch):
    """rattler writes conda-meta records 0600: an image user that cannot read them still gets the
    Debian packages and the libraries in its SBOM, and the error says what was missing."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("probe_under_test", REPO / "imagefactory/resources/probe.py")
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    meta = tmp_path / "conda-meta"
    meta.mkdir()
    (meta / "x.json").write_text("{not json")  # stands for a record it may not read
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    got = probe.probe_sbom()
    assert got["conda"] is None and got["error"].startswith("conda: ")
    assert isinstance(got["libraries"], dict) and isinstance(got["versions"], dict)
    status = tmp_path / "status"
    status.write_text("Package: libc6\nStatus: install ok installed\nArchitecture: amd64\nVersion: 2.36-9\n"
                      "Description: the C library\n with a continuation: line\n\n"
                      "Package: gone\nStatus: deinstall ok config-files\nVersion: 1\n")
    assert probe.dpkg_packages(str(status)) == [{"name": "libc6", "version": "2.36-9", "arch": "amd64",
                                                 "source": None}]
    assert probe.dpkg_packages(str(tmp_path / "none")) is None


# --------------------------------------------------------------------------- the command line

def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run([sys.executable, "-m", "imagefactory", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DOCKER_HOST": "unix:///nonexistent.sock", **(env or {})})


def test_sign_needs_a_push_and_a_cosign_2_before_anything_is_built(write_matrix, keys, fake_cosign):
    path = str(write_matrix(TWO_PIP_CELLS))
    r = _cli("build", "--matrix", path, "--sign", str(keys[0]), env={"COSIGN_PASSWORD": ""})
    assert r.returncode == 2 and "error: --sign: only meaningful with --push" in r.stderr, r.stderr
    fake_cosign(version="v3.0.1")
    r = _cli("push", "--matrix", path, "--sign", str(keys[0]), env={"COSIGN_PASSWORD": ""})
    assert r.returncode == 2 and "cosign v3.0.1" in r.stderr and "install cosign 2.x" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one line, before any engine was asked (none is reachable)
    fake_cosign()
    r = _cli("push", "--matrix", path, "--sign", str(keys[0]), env={"COSIGN_PASSWORD": ""})
    assert r.returncode == 3, r.stderr  # everything checked: only now the missing engine stops it


def test_verify_needs_a_public_key(write_matrix, keys, fake_cosign):
    fake_cosign()
    path = str(write_matrix(TWO_PIP_CELLS))
    r = _cli("verify", "--matrix", path, "--key", str(keys[0]))
    assert r.returncode == 2 and "not a PEM public key" in r.stderr, r.stderr
    r = _cli("verify", "--matrix", path)
    assert r.returncode == 2 and "--key" in r.stderr
