"""publish/push.py: each push carries only its own registry's credentials, and a tag that escaped validation is not pushed."""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any
import pytest
from imagefactory.config import registries
from imagefactory.engine import logins
from imagefactory.run.context import PushOptions, RunContext
from imagefactory.config import matrix
from imagefactory.publish import push
from imagefactory.errors import ConfigError
from imagefactory.pipeline.progress import Plain
from imagefactory.run.results import PASSED, PUBLISH_FAILED, PUBLISHED, CellReport
from tests.fake_engine import Image, World


ONE_CELL = """
image: registry.example.com/ml/train
matrix: {python: ["3.11"], cuda: ["none"], blas: [openblas], installer: [pip]}
torch: "2.13.0"
"""


CELL = "py3.11-cpu-openblas-pip"


HASH = "ab" * 32


# -- where credentials go --------------------------------------------------------------------------
class Recorder:
    """The fake engine, noting the credentials each push and digest query carried."""

    def __init__(self, world: World, sent: list[tuple[str, str, Any]]):
        self.inner, self.sent = world.engine(), sent

    def push(self, ref, *, auth_config=None, **kw):
        self.sent.append(("push", ref, auth_config))
        return self.inner.push(ref, auth_config=auth_config, **kw)

    def registry_digest(self, ref, *, auth_config=None):
        self.sent.append(("digest", ref, auth_config))
        return self.inner.registry_digest(ref, auth_config=auth_config)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _publish(m, sent) -> CellReport:
    world = World()
    world.images["img1"] = Image("img1", {}, cell=CELL)
    report = CellReport(cell=CELL, status=PASSED, content_hash=HASH, image_id="img1")
    run = RunContext(PushOptions(backoff=0), Plain(io.StringIO()), world.interrupt,
                     lambda: Recorder(world, sent))  # type: ignore[arg-type,return-value]
    push.publish(m, [report], run)
    return report


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("", "_OTHER_EXAMPLE_NET", "_THIRD_EXAMPLE_NET_5000"):
        monkeypatch.delenv(logins.USER_ENV + name, raising=False)
        monkeypatch.delenv(logins.PASSWORD_ENV + name, raising=False)
    return monkeypatch


def test_each_registry_gets_only_its_own_credentials(write_matrix, clean_env):
    text = ONE_CELL + ('tags: {template: "other.example.net/x:{id}", hash_template: "third.example.net:5000/x:{hash}",\n'
                       '       registries: [other.example.net, "third.example.net:5000"]}\n')
    m = matrix.load(write_matrix(text))
    clean_env.setenv(logins.USER_ENV, "own")
    clean_env.setenv(logins.PASSWORD_ENV, "own-secret")
    clean_env.setenv(logins.USER_ENV + "_OTHER_EXAMPLE_NET", "other")
    clean_env.setenv(logins.PASSWORD_ENV + "_OTHER_EXAMPLE_NET", "other-secret")
    sent: list[tuple[str, str, Any]] = []
    report = _publish(m, sent)
    assert report.publish == PUBLISHED
    by_ref = {(op, ref): auth for op, ref, auth in sent}
    other = "other.example.net/x:" + CELL
    third = "third.example.net:5000/x:" + HASH[:12]
    assert by_ref[("push", other)] == {"username": "other", "password": "other-secret"}
    assert by_ref[("digest", other)] == {"username": "other", "password": "other-secret"}
    # no credentials of its own: None (docker login's), never image's or another's
    assert by_ref[("push", third)] is None and by_ref[("digest", third)] is None


def test_image_registry_credentials_stay_there(write_matrix, clean_env):
    m = matrix.load(write_matrix(ONE_CELL))
    clean_env.setenv(logins.USER_ENV, "own")
    clean_env.setenv(logins.PASSWORD_ENV, "own-secret")
    sent: list[tuple[str, str, Any]] = []
    assert _publish(m, sent).publish == PUBLISHED
    assert sent and all(auth == {"username": "own", "password": "own-secret"} for _, _, auth in sent)


def test_a_tag_that_escaped_validation_is_not_pushed_nor_given_credentials(write_matrix, clean_env):
    m = matrix.load(write_matrix(ONE_CELL))
    cell = replace(m.cell(CELL), tags=("evil.example.net/steal:" + CELL,))
    m = replace(m, cells=(cell,))
    clean_env.setenv(logins.USER_ENV, "own")
    clean_env.setenv(logins.PASSWORD_ENV, "own-secret")
    sent: list[tuple[str, str, Any]] = []
    report = _publish(m, sent)
    assert report.publish == PUBLISH_FAILED and "points at registry evil.example.net" in report.error
    assert not any(ref.startswith("evil.") for _, ref, _ in sent)


def test_half_the_credentials_of_an_extra_registry_is_a_config_error(write_matrix, clean_env):
    m = matrix.load(write_matrix(ONE_CELL + 'tags: {registries: [other.example.net]}\n'))
    clean_env.setenv(logins.USER_ENV + "_OTHER_EXAMPLE_NET", "other")
    with pytest.raises(ConfigError, match="IMAGEFACTORY_REGISTRY_PASSWORD_OTHER_EXAMPLE_NET"):
        logins.registry_credentials(m)
    assert registries.env_suffix("reg.example.com:5000") == "REG_EXAMPLE_COM_5000"
