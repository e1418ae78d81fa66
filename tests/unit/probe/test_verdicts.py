"""The verdict cache: a pass is remembered per image, probe version, GPU and thread mode;
anything else in the cache directory is ignored (and the image is probed again)."""

from __future__ import annotations

import dataclasses
import json
import os

from imagefactory.probe import checks
from imagefactory.probe import smoke
from imagefactory.probe import verdicts
from tests.fake_engine import as_launched
from tests.unit.helpers import CPU_OPENBLAS, good_probe

IMAGE = "sha256:" + "ab" * 32


def probes(cell, **kw) -> dict:
    """Every launch mode's probe of a good image, as each mode's container reports it."""
    return {m: as_launched(good_probe(cell, **kw), smoke.MODES[m].options(smoke.DEFAULT_SHM),
                           smoke.MODES[m].environment()) for m in smoke.DEFAULT_MODES}


def key(**changes) -> verdicts.Key:
    return dataclasses.replace(verdicts.key(IMAGE, CPU_OPENBLAS, gpus=False), **changes)


def test_a_stored_pass_is_found_with_its_time(tmp_path):
    at = verdicts.store(tmp_path, key(), probes(CPU_OPENBLAS))
    hit = verdicts.lookup(tmp_path, key(), CPU_OPENBLAS)
    assert hit is not None and hit.at == at and verdicts.checks.passed(hit.checks)
    assert [p.name for p in tmp_path.iterdir()] == ["ab" * 32 + ".json"]  # no temporary file left


def test_every_part_of_the_key_matters(tmp_path):
    verdicts.store(tmp_path, key(), probes(CPU_OPENBLAS))
    for other in (key(probe_version="2+0"), key(gpus=True), key(threads=8)):
        assert verdicts.lookup(tmp_path, other, CPU_OPENBLAS) is None
    assert verdicts.lookup(tmp_path, key(image_id="sha256:" + "cd" * 32), CPU_OPENBLAS) is None


def test_modes_of_one_image_are_kept_side_by_side(tmp_path):
    verdicts.store(tmp_path, key(), probes(CPU_OPENBLAS))
    verdicts.store(tmp_path, key(gpus=True), probes(CPU_OPENBLAS, gpu=True))
    assert verdicts.lookup(tmp_path, key(), CPU_OPENBLAS) is not None
    assert verdicts.lookup(tmp_path, key(gpus=True), CPU_OPENBLAS) is not None


def test_probe_version_is_read_from_the_probe_text():
    number, digest = verdicts.probe_version().split("+")
    assert number == str(good_probe(CPU_OPENBLAS)["probe_version"]) and len(digest) == 16


def test_launch_modes_and_shm_are_part_of_the_key(tmp_path):
    verdicts.store(tmp_path, key(), probes(CPU_OPENBLAS))
    hit = verdicts.lookup(tmp_path, key(), CPU_OPENBLAS)
    assert hit is not None and checks.launches(hit.checks) == {"docker": "pass", "bare": "pass", "hpc": "pass"}
    for other in (key(modes=("docker",)), key(modes=("docker", "bare")), key(shm="host")):
        assert verdicts.lookup(tmp_path, other, CPU_OPENBLAS) is None, other


def test_a_record_from_before_the_launch_modes_is_probed_again(tmp_path):
    """Format 1 records of probe 3 had no modes in their key and one probe: never a hit."""
    old_key = {k: v for k, v in key().as_dict().items() if k not in ("modes", "shm")}
    doc = {"format": 1, "records": [{"key": old_key, "at": "2026-11-30T10:00:00+00:00",
                                     "probe": good_probe(CPU_OPENBLAS)}]}
    _file(tmp_path).write_text(json.dumps(doc))
    assert verdicts.lookup(tmp_path, key(), CPU_OPENBLAS) is None
    # nor a record whose key names the modes but whose probes miss one
    partial = probes(CPU_OPENBLAS)
    del partial["hpc"]
    verdicts.store(tmp_path, key(), partial)
    assert verdicts.lookup(tmp_path, key(), CPU_OPENBLAS) is None


def test_a_stored_mode_that_fails_todays_checks_is_no_hit(tmp_path):
    stored = probes(CPU_OPENBLAS)
    stored["hpc"]["user"]["uid"] = 1000  # as if the hpc container had not run as 4242
    verdicts.store(tmp_path, key(), stored)
    assert verdicts.lookup(tmp_path, key(), CPU_OPENBLAS) is None


def test_stored_probe_is_judged_again_by_todays_checks(tmp_path):
    verdicts.store(tmp_path, key(), probes(CPU_OPENBLAS))
    stricter = dataclasses.replace(CPU_OPENBLAS, torch="2.14.0")  # as if the checks now wanted more
    assert verdicts.lookup(tmp_path, key(), stricter) is None


def _file(tmp_path):
    return tmp_path / ("ab" * 32 + ".json")


def test_corrupt_or_hostile_records_are_ignored(tmp_path):
    verdicts.store(tmp_path, key(), probes(CPU_OPENBLAS))
    good = json.loads(_file(tmp_path).read_text())
    record = good["records"][0]
    bad_docs = [
        "{not json", "[]", json.dumps({**good, "format": 99}), json.dumps({**good, "records": "x"}),
        json.dumps({**good, "records": [{**record, "at": "yesterday; rm -rf /"}]}),
        json.dumps({**good, "records": [{**record, "probe": "passed"}]}),
        json.dumps({**good, "records": [{k: v for k, v in record.items() if k != "at"}]}),
        "[" * 100000,
    ]
    for text in bad_docs:
        _file(tmp_path).write_text(text)
        assert verdicts.lookup(tmp_path, key(), CPU_OPENBLAS) is None, text[:60]


def test_a_symlinked_record_is_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    verdicts.store(tmp_path, key(), probes(CPU_OPENBLAS))
    _file(tmp_path).rename(elsewhere)
    os.symlink(elsewhere, _file(tmp_path))
    assert verdicts.lookup(tmp_path, key(), CPU_OPENBLAS) is None


def test_an_image_id_that_is_not_a_digest_never_becomes_a_path(tmp_path):
    for image_id in ("../../etc/passwd", "sha256:" + "ab" * 32 + "/x", "", "sha256:AB" + "ab" * 31):
        assert verdicts.store(tmp_path, key(image_id=image_id), probes(CPU_OPENBLAS)) is None
        assert verdicts.lookup(tmp_path, key(image_id=image_id), CPU_OPENBLAS) is None
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_cache_is_not_fatal(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert verdicts.store(blocker / "verdicts", key(), probes(CPU_OPENBLAS)) is None


def test_the_verdicts_folder_follows_the_environment(tmp_path, monkeypatch):
    """No --verdicts-dir: the Store's own folder, the same path the verdicts always had."""
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path))
    assert verdicts.VERDICTS.folder() == tmp_path / "verdicts"
    assert verdicts.store(None, key(), probes(CPU_OPENBLAS)) is not None
    assert [p.name for p in (tmp_path / "verdicts").iterdir()] == [key().image_id.split(":")[1] + ".json"]
    assert verdicts.lookup(None, key(), CPU_OPENBLAS) is not None
    monkeypatch.delenv("IMAGEFACTORY_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert verdicts.VERDICTS.folder() == tmp_path / "xdg" / "imagefactory" / "verdicts"


def test_a_failed_probe_forgets_the_earlier_pass(tmp_path):
    verdicts.store(tmp_path, key(), probes(CPU_OPENBLAS))
    verdicts.store(tmp_path, key(gpus=True), probes(CPU_OPENBLAS, gpu=True))
    verdicts.forget(tmp_path, key())
    assert verdicts.lookup(tmp_path, key(), CPU_OPENBLAS) is None
    assert verdicts.lookup(tmp_path, key(gpus=True), CPU_OPENBLAS) is not None
    verdicts.forget(tmp_path / "none", key())  # nothing recorded: nothing written
    assert not (tmp_path / "none").exists()


def test_a_verdict_is_the_engines_that_probed_it(tmp_path):
    """podman's probes (a user name for the hpc mode's UID) are judged as podman's when read back,
    and found only by a podman run; Docker's key is as it always was."""
    assert "engine" not in key().as_dict()
    on_podman = {m: as_launched(good_probe(CPU_OPENBLAS), smoke.MODES[m].options(smoke.DEFAULT_SHM),
                                smoke.MODES[m].environment(), "podman") for m in smoke.DEFAULT_MODES}
    podman = key(product="podman")
    verdicts.store(tmp_path, podman, on_podman)
    hit = verdicts.lookup(tmp_path, podman, CPU_OPENBLAS)
    assert hit is not None and verdicts.checks.passed(hit.checks)
    assert verdicts.lookup(tmp_path, key(), CPU_OPENBLAS) is None


def test_a_switch_of_image_store_finds_no_verdict_for_the_same_image(tmp_path):
    """The graph-driver store names an image by its config digest, the containerd store by its
    manifest digest (identity.py): a pass kept under one is not found under the other, so the
    image is probed again, and never trusted for another image."""
    config, manifest = IMAGE, "sha256:" + "cd" * 32
    verdicts.store(tmp_path, key(image_id=config), probes(CPU_OPENBLAS))
    assert verdicts.lookup(tmp_path, key(image_id=config), CPU_OPENBLAS) is not None
    assert verdicts.lookup(tmp_path, key(image_id=manifest), CPU_OPENBLAS) is None
