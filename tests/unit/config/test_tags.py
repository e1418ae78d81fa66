"""Tag names computed from cells (publishing itself is tested against real registries)."""

from __future__ import annotations

import datetime

from imagefactory.config import tags
from imagefactory.engine.docker import is_transient, split_tag
from imagefactory.config.model import Cell

CELL = Cell(python="3.11", cuda="12.9", blas="mkl", installer="pip", torch="2.8.0", threads=4,
            base_image="python:3.11-slim-bookworm")


def test_default_release_and_hash_tags():
    assert tags.release_tag("{image}:{torch}-py{python}-{accel}-{blas}{installer_suffix}", "r.example.com/ml/t",
                            CELL) == "r.example.com/ml/t:2.8.0-py3.11-cu12.9-mkl-pip"
    assert tags.hash_tag("{image}:sha-{hash}", "r/t", CELL, "abcdef0123456789") == "r/t:sha-abcdef012345"


def test_extra_tags():
    out = tags.extra_tags("r/t:x", ("date", "git-sha"), today=datetime.date(2026, 11, 30), git_sha="1234567890ab")
    assert out == ["r/t:x-20261130", "r/t:x-g1234567"]
    assert tags.extra_tags("r/t:x", ("git-sha",), git_sha=None) == []


def test_candidate_name_is_local_and_per_content():
    assert tags.candidate(CELL, "f" * 64) == "imagefactory-candidate/py3_11-cu12_9-mkl-pip:ffffffffffff"


def test_split_tag_handles_registry_ports():
    assert split_tag("127.0.0.1:5001/a/b:t1") == ("127.0.0.1:5001/a/b", "t1")
    assert split_tag("127.0.0.1:5001/a/b") == ("127.0.0.1:5001/a/b", "latest")


def test_authentication_errors_are_not_transient():
    assert not is_transient("no basic auth credentials")
    assert not is_transient("unauthorized: authentication required")
    assert is_transient("Get http://127.0.0.1:5002/v2/: dial tcp: connect: connection refused")
