"""config/refs.py: image references matched whole, and their parts."""

from __future__ import annotations

import pytest
from imagefactory.config import refs


# -- refs.py ---------------------------------------------------------------------------------------
def test_a_reference_is_matched_whole():
    assert refs.is_reference("debian:bookworm")
    for bad in ("debian:bookworm\n", " debian", "debian/X", "a//b", "x:" + "t" * 129, "x@sha256:abc"):
        assert not refs.is_reference(bad), bad


def test_parts_of_a_reference():
    ref = refs.parse("Host.example:5000/a/b:t1@sha256:" + "0" * 64)
    assert ref is not None
    assert (ref.domain, ref.path, ref.tag, ref.registry) == ("Host.example:5000", "a/b", "t1", "host.example:5000")
    # a first component without '.', ':' or localhost is a Docker Hub namespace, not a registry
    assert refs.registry("library/debian:12") == "docker.io" and refs.registry("localhost/x") == "localhost"
    assert refs.registry("index.docker.io/library/debian") == "docker.io"
    assert refs.canonical_repository("docker.io/library/python:3.11") == "python"
    assert refs.canonical_repository("127.0.0.1:5000/library/python") == "127.0.0.1:5000/library/python"
    assert refs.split_tag("127.0.0.1:5001/a/b") == ("127.0.0.1:5001/a/b", "latest")
    assert refs.split_tag("a/b:x@sha256:" + "1" * 64) == ("a/b", "sha256:" + "1" * 64)
    with pytest.raises(ValueError):
        refs.split_tag("a/b:x\n")
    assert refs.with_registry("debian:12@sha256:" + "2" * 64, "m:5000") == "m:5000/library/debian:12@sha256:" + "2" * 64
    assert refs.with_registry("ghcr.io/a/b:1", "m:5000") == "ghcr.io/a/b:1"
