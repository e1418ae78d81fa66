"""Base images resolved to digests: which side is asked in each --pull mode, and what is refused."""

from __future__ import annotations

import pytest

from imagefactory.pipeline import freshness
from imagefactory.run.context import Pull, TestOptions
from imagefactory.errors import ConfigError

REF = "127.0.0.1:5000/library/python:3.11-slim-bookworm"
D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


class Source:
    def __init__(self, registry=None, local=()):
        self.registry, self.local, self.asked = registry, list(local), []

    def registry_digest(self, ref, *, auth_config=None):
        self.asked.append(("registry", ref))
        return self.registry

    def local_repo_digests(self, ref):
        self.asked.append(("local", ref))
        return self.local


LOCAL = [f"127.0.0.1:5000/library/python@{D2}"]


def test_missing_asks_the_registry_first():
    src = Source(registry=D1, local=LOCAL)
    base = freshness.resolve_one(src, REF, Pull.missing)
    assert (base.digest, base.source, base.pinned) == (D1, "registry", f"{REF}@{D1}")
    assert src.asked == [("registry", REF)]


def test_missing_falls_back_to_the_local_copy():
    assert freshness.resolve_one(Source(None, LOCAL), REF, Pull.missing).digest == D2


def test_never_does_not_touch_the_registry():
    src = Source(registry=D1, local=LOCAL)
    assert freshness.resolve_one(src, REF, Pull.never).digest == D2
    assert all(side == "local" for side, _ in src.asked)


def test_always_needs_the_registry():
    with pytest.raises(freshness.BaseImageError, match="--pull always"):
        freshness.resolve_one(Source(None, LOCAL), REF, Pull.always)


def test_no_digest_anywhere_is_an_error():
    with pytest.raises(freshness.BaseImageError, match="no local copy"):
        freshness.resolve_one(Source(None, []), REF, Pull.never)
    with pytest.raises(freshness.BaseImageError, match="no local copy"):
        freshness.resolve_one(Source(None, []), REF, Pull.missing)


@pytest.mark.parametrize("served", [
    "sha256:" + "1" * 63, "sha256:" + "1" * 64 + "\nRUN evil", "sha512:" + "1" * 128, "SHA256:" + "1" * 64,
    "sha256:" + "G" * 64, 42,
])
def test_a_registry_digest_is_checked_whole(served):
    with pytest.raises(freshness.BaseImageError, match="not sha256"):
        freshness.resolve_one(Source(served), REF, Pull.missing)


def test_local_digests_of_other_repositories_or_malformed_are_ignored():
    local = [f"127.0.0.1:5000/other/python@{D1}", "127.0.0.1:5000/library/python@sha256:xyz",
             f"127.0.0.1:5000/library/python@{D2}\nFROM x"]
    with pytest.raises(freshness.BaseImageError):
        freshness.resolve_one(Source(None, local), REF, Pull.never)


def test_docker_hub_names_are_normalised_when_matching_local_digests():
    assert freshness.local_digest(Source(None, [f"python@{D1}"]), "docker.io/library/python:3.11") == D1
    assert freshness.repository("python:3.11@" + D1) == "python"
    assert freshness.repository("host:5000/a/b") == "host:5000/a/b"


def test_a_reference_pinned_in_the_matrix_is_kept_and_not_looked_up():
    src = Source(D1, LOCAL)
    base = freshness.resolve_one(src, f"{REF}@{D2}", Pull.always)
    assert (base.pinned, base.source, src.asked) == (f"{REF}@{D2}", "matrix", [])


def test_each_distinct_reference_is_resolved_once():
    src = Source(D1)
    assert set(freshness.resolve(src, [REF, REF, "debian:12"], Pull.missing)) == {REF, "debian:12"}
    assert len(src.asked) == 2


def test_an_unknown_pull_mode_is_refused_once_when_the_options_are_made():
    with pytest.raises(ConfigError, match=r"^--pull sometimes: not allowed \(allowed: always, missing, never\)$"):
        TestOptions(pull="sometimes")  # type: ignore[arg-type]
    assert TestOptions(pull="never").pull is Pull.never  # type: ignore[arg-type]
