"""store.Store: the one way a result is kept between runs. A key is the inputs and the code that
used them; an entry is read bounded, never through a link, written atomically, the newest `limit`
staying; a cache folder that is missing or cannot be written costs the result, never the run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from imagefactory.files import store
from imagefactory.files.store import Store


def cache() -> Path:
    return Path(os.environ["IMAGEFACTORY_CACHE_DIR"])


def test_a_kept_value_is_read_back_under_its_key_only():
    s = Store("things", 8, 1024)
    key = s.key("a", {"b": [1, 2]})
    assert s.get(key) is None and not s.has(key)
    assert s.put(key, "value")
    assert s.get(key) == "value" and s.get_bytes(key) == b"value" and s.has(key)
    assert (cache() / "things" / f"{key}.txt").read_text() == "value"
    other = s.key("a", {"b": [1, 3]})
    assert other != key and s.get(other) is None  # another input: another key, no value
    assert s.get("0" * 64) is None
    s.put(key, b"bytes\xff")
    assert s.get_bytes(key) == b"bytes\xff" and s.get(key) is None  # not UTF-8: no text


def test_a_key_is_its_inputs_its_code_and_its_store():
    s = Store("things", 8, 1024)
    assert s.key("a", "b") == s.key("a", "b") and store.is_key(s.key("a", "b"))
    assert s.key("a", "b") != s.key("ab") != s.key(["a", "b"])
    assert s.key("a") != s.key(b"a")  # bytes and text are told apart
    assert s.key({"x": 1, "y": 2}) == s.key({"y": 2, "x": 1})  # a dict's order is no input
    assert s.key("a") != Store("others", 8, 1024).key("a")
    assert s.key("a", code=("imagefactory.files.store",)) != s.key("a")
    with pytest.raises(TypeError):
        s.key({1, 2})  # no JSON for a set: no key


def test_an_edit_to_the_code_is_a_new_key(tmp_path, monkeypatch):
    import importlib
    import sys

    mod = tmp_path / "store_code_probe.py"
    mod.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("store_code_probe")
    s = Store("things", 8, 1024)
    try:
        before = s.key("a", code=("store_code_probe",))
        mod.write_text("X = 2\n")
        store.code_digest.cache_clear()
        assert s.key("a", code=("store_code_probe",)) != before
    finally:
        sys.modules.pop("store_code_probe", None)
        store.code_digest.cache_clear()


def test_an_entry_is_never_read_through_a_link_nor_over_its_bound(tmp_path):
    s = Store("things", 8, 16)
    key = s.key("a")
    file = s.file(key)
    assert file is not None
    file.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("planted")
    file.symlink_to(elsewhere)
    assert s.get(key) is None and not s.has(key)
    file.unlink()
    file.write_text("x" * 17)
    assert s.get(key) is None  # over max_bytes
    file.unlink()
    os.mkfifo(file)
    assert s.get(key) is None  # a FIFO is not waited on
    file.unlink()
    file.mkdir()
    assert s.get(key) is None and not s.put(key, "v")
    file.rmdir()
    assert not s.put(key, "x" * 17)  # a value over the bound is not kept
    assert s.file("../" + "0" * 61) is None and s.get("not a key") is None and not s.put("not a key", "v")


def test_a_link_in_place_of_an_entry_is_replaced_not_written_through(tmp_path):
    s = Store("things", 8, 1024)
    key = s.key("a")
    file = s.file(key)
    assert file is not None
    file.parent.mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("theirs")
    file.symlink_to(target)
    assert s.put(key, "ours")
    assert target.read_text() == "theirs" and not file.is_symlink() and s.get(key) == "ours"


def test_the_newest_entries_stay(tmp_path):
    s = Store("things", 3, 1024)
    keys = [s.key(i) for i in range(5)]
    for i, key in enumerate(keys):
        s.put(key, str(i))
        file = s.file(key)
        assert file is not None
        os.utime(file, ns=(time.time_ns(), 1_000_000_000 * (i + 1)))  # in order, whatever the clock's grain
    assert [s.get(k) for k in keys] == [None, None, "2", "3", "4"]
    assert sorted(p.name for p in (cache() / "things").iterdir()) == sorted(f"{k}.txt" for k in keys[2:])


def test_writes_are_atomic_and_leave_no_temporary_file(monkeypatch):
    s = Store("things", 8, 1024)
    key = s.key("a")
    s.put(key, "old")
    from imagefactory.files import fsutil

    real = os.replace

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.put(key, "new")
    monkeypatch.setattr(os, "replace", real)
    assert s.get(key) == "old" and [p.name for p in (cache() / "things").iterdir()] == [f"{key}.txt"]
    assert fsutil.atomic_write  # the write is fsutil's


def test_an_unwritable_or_missing_cache_folder_is_never_fatal(tmp_path, monkeypatch):
    s = Store("things", 8, 1024)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be made
    key = s.key("a")
    assert not s.put(key, "v") and s.get(key) is None
    for name in ("IMAGEFACTORY_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("imagefactory.files.fsutil.home", lambda environ=None: None)  # no HOME, no passwd entry
    assert s.folder() is None and s.file(key) is None
    assert not s.put(key, "v") and s.get(key) is None
    s.delete(key)
    s.prune()


def test_delete_drops_one_entry():
    s = Store("things", 8, 1024)
    a, b = s.key("a"), s.key("b")
    s.put(a, "1")
    s.put(b, "2")
    s.delete(a)
    s.delete(a)  # gone already: nothing to say
    assert s.get(a) is None and s.get(b) == "2"


def test_a_store_name_is_one_folder_under_the_cache_folder():
    for bad in ("", "a/b", "..", ".hidden"):
        with pytest.raises(ValueError):
            Store(bad, 8, 1024)
    assert Store("things", 8, 1024).folder() == cache() / "things"


def test_a_store_at_a_folder_of_its_own_keeps_there(tmp_path):
    s = Store("verdicts", 8, 1024, suffix=".json", at=tmp_path / "v")
    key = s.key("a")
    assert s.folder() == tmp_path / "v" and s.put(key, "{}")
    assert [p.name for p in (tmp_path / "v").iterdir()] == [f"{key}.json"] and not (cache() / "verdicts").exists()


def test_the_kept_results_are_these_stores_and_the_dropped_caches_are_gone(tmp_path):
    """Every kept result of this lane goes through a Store; the checked-certificates cache and the
    schema-validated keys are gone (the matrix's kept data stands for the latter), and a matrix with
    a CA file still loads to the same cells twice."""
    from imagefactory.attest import sbom
    from imagefactory.config import cacerts, matrix
    from imagefactory.probe import verdicts
    from imagefactory.engine import layer_sizes
    from imagefactory.render import digests, rendered

    names = {s.name for s in (matrix.DATA, rendered.RENDERS, sbom.DOCUMENTS, sbom.VALIDATED, digests.DIGESTS,
                              verdicts.VERDICTS, verdicts._store(tmp_path), layer_sizes.SIZES)}
    assert names == {"matrix-data", "rendered", "sbom-documents", "sbom-validated", "file-digests", "verdicts",
                     "layer-sizes"}
    assert not hasattr(matrix, "SCHEMA_VALIDATED") and not hasattr(cacerts, "CERTS_CHECKED")
    from tests.unit.helpers import TWO_PIP_CELLS

    ca = Path(__file__).parents[2] / "golden" / "certs" / "corp-ca.pem"
    (tmp_path / "ca.pem").write_bytes(ca.read_bytes())
    path = tmp_path / "matrix.yaml"
    path.write_text(TWO_PIP_CELLS + "ca_certificates: [ca.pem]\n")
    first = matrix.load(path)
    assert matrix.load(path) == first and [c.id for c in first.cells] == [c.id for c in matrix.load(path).cells]
    assert sorted(p.name for p in cache().iterdir()) == ["matrix-data"]
