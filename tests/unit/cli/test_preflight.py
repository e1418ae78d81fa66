"""cli/preflight.py: what a run needs is checked after its options are parsed, before anything is
built, each failure an exit 2 (ConfigError) naming its flag, in a fixed order."""

from __future__ import annotations

import pytest

from imagefactory.cli import preflight
from imagefactory.config import matrix
from imagefactory.errors import ConfigError
from imagefactory.run import context
from tests.conftest import REPO

GOLDEN = REPO / "tests" / "golden" / "matrix.yaml"


@pytest.fixture
def m():
    return matrix.load(GOLDEN)


def test_checked_gives_the_options_of_the_settings(m, tmp_path):
    options = preflight.checked(m, list(m.cells), {"jobs": 2, "work_dir": tmp_path / "w", "probe_shm": "host",
                                                   "cache_from": None}, context.BuildOptions)
    assert options == context.BuildOptions(jobs=2, work_dir=tmp_path / "w", probe_shm="host", cache_from=())


def test_atomic_needs_push(m):
    with pytest.raises(ConfigError, match="--atomic: only meaningful with --push"):
        preflight.checked(m, list(m.cells), {"atomic": True}, context.BuildOptions)


def test_sign_needs_push(m):
    with pytest.raises(ConfigError, match="--sign: only meaningful with --push"):
        preflight._signing_key({"sign": "cosign.key"})


def test_the_first_failure_is_the_cache_from_one(m):
    """--cache-from is checked before --probe-shm, the outputs and --atomic (the order a run reported)."""
    with pytest.raises(ConfigError) as e:
        preflight.checked(m, list(m.cells), {"cache_from": ["a b"], "probe_shm": "1g --privileged",
                                             "work_dir": m.path, "atomic": True}, context.BuildOptions)
    assert "--cache-from" in str(e.value.problems)


def test_the_outputs_may_not_be_the_matrix(m):
    with pytest.raises(ConfigError, match="--report"):
        preflight.checked(m, list(m.cells), {"report": m.path}, context.BuildOptions)


def test_cache_from_takes_only_image_references():
    assert preflight._cache_from(("debian",)) == ("debian",)
    with pytest.raises(ConfigError, match="not an image reference"):
        preflight._cache_from(["--push"])


def test_a_bad_docker_host_stops_before_the_engine(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "tcp://a b")
    with pytest.raises(ConfigError, match="DOCKER_HOST"):
        preflight.engine_environment()
