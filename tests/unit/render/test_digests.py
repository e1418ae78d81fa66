"""Remembered file digests: right, keyed by the file's stat data, and never trusted blindly."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from imagefactory.render import digests


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / digests.DIGESTS.name  # the store's folder


def big(tmp_path, content=b"x"):
    path = tmp_path / "big.whl"
    path.write_bytes(content * digests.MIN_SIZE)
    return path


def test_digest_is_remembered_and_right(tmp_path, cache):
    path = big(tmp_path)
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digests.file_digest(path) == want
    assert [p.read_text() for p in cache.iterdir()] == [want]
    os.link(path, tmp_path / "linked.whl")  # a context's hard link: same inode, same entry
    assert digests.file_digest(tmp_path / "linked.whl") == want and len(list(cache.iterdir())) == 1


def test_a_changed_file_is_hashed_again(tmp_path):
    path = big(tmp_path)
    first = digests.file_digest(path)
    st = path.stat()
    path.write_bytes(b"y" * digests.MIN_SIZE)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert digests.file_digest(path) == hashlib.sha256(path.read_bytes()).hexdigest() != first


def test_a_hostile_cache_is_ignored(tmp_path, cache):
    path = big(tmp_path)
    st = path.stat()
    entry = digests.DIGESTS.file(digests.DIGESTS.key(f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"))
    assert entry is not None
    cache.mkdir(parents=True)
    for doc in ("0" * 63, "../" + "0" * 64, json.dumps(["0" * 64]), "x", "0" * 65):
        entry.write_text(doc)
        assert digests.file_digest(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    entry.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("0" * 64)
    entry.symlink_to(elsewhere)  # never through a link
    assert digests.file_digest(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_small_files_are_not_cached(tmp_path, cache):
    path = tmp_path / "small"
    path.write_text("hello")
    assert digests.file_digest(path) == hashlib.sha256(b"hello").hexdigest() and not cache.exists()
