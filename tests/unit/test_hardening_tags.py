"""Where tags point and where credentials go (issue 18, part 4), and the one reference parser
(refs.py) every step uses."""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

import pytest

from imagefactory.engine import logins
from imagefactory.run.context import Options, RunContext
from imagefactory.config import matrix
from imagefactory.config import refs
from imagefactory.publish import push as publish_mod
from imagefactory.config import tags as tagging
from imagefactory.errors import ConfigError
from imagefactory.pipeline.progress import Plain
from imagefactory.report.summary import PASSED, PUBLISH_FAILED, PUBLISHED, CellReport
from tests.fake_engine import Image, World

ONE_CELL = """
image: registry.example.com/ml/train
matrix: {python: ["3.11"], cuda: ["none"], blas: [openblas], installer: [pip]}
torch: "2.13.0"
"""
CELL = "py3.11-cpu-openblas-pip"
HASH = "ab" * 32


def problems(write_matrix, text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(text))
    return e.value.problems


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


# -- where tags point ------------------------------------------------------------------------------
def test_a_tag_on_another_registry_is_refused(write_matrix):
    text = ONE_CELL + 'tags: {template: "other.example.net/x/{id}"}\n'
    [p] = problems(write_matrix, text)
    assert "tags.template" in p and "points at registry other.example.net" in p
    assert "not registry.example.com" in p and "tags.registries" in p


@pytest.mark.parametrize("key", ["template", "hash_template"])
def test_a_hub_tag_for_a_private_image_is_refused(write_matrix, key):
    value = "ml/{id}" if key == "template" else "ml/x:{hash}"
    [p] = problems(write_matrix, ONE_CELL + f'tags: {{{key}: "{value}"}}\n')
    assert f"tags.{key}" in p and "points at registry docker.io" in p


def test_a_registry_named_under_tags_registries_is_allowed(write_matrix):
    text = ONE_CELL + 'tags: {template: "Other.Example.NET/x/{id}", registries: [other.example.net]}\n'
    m = matrix.load(write_matrix(text))
    assert m.cell(CELL).tags == ("Other.Example.NET/x/" + CELL,)
    assert tagging.allowed_registries(m) == ("registry.example.com", "other.example.net")


def test_tags_registries_entries_are_hosts(write_matrix):
    [p] = problems(write_matrix, ONE_CELL + 'tags: {registries: ["evil.example/x"]}\n')
    assert "tags.registries[0]" in p and "malformed" in p


def test_the_hash_template_must_hold_the_hash(write_matrix):
    [p] = problems(write_matrix, ONE_CELL + 'tags: {hash_template: "{image}:stable"}\n')
    assert "tags.hash_template" in p and "{hash}" in p
    # the code refuses it too, whatever the schema lets through
    cell = matrix.load(write_matrix(ONE_CELL)).cell(CELL)
    with pytest.raises(tagging.TagTemplateError, match="has no {hash} field"):
        tagging.hash_tag("{image}:stable", "r.example/x", cell, HASH)
    assert tagging.hash_tag("{image}:h{hash}", "r.example/x", cell, HASH) == "r.example/x:h" + HASH[:12]


@pytest.mark.parametrize("key,value", [("template", "{image}:x@sha256:" + "0" * 64),
                                       ("hash_template", "{image}:{hash}@sha256:" + "0" * 64)])
def test_a_tag_with_a_digest_is_refused(write_matrix, key, value):
    [p] = problems(write_matrix, ONE_CELL + f'tags: {{{key}: "{value}"}}\n')
    assert f"tags.{key}" in p and "holds a digest" in p


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
    run = RunContext(Options(backoff=0), Plain(io.StringIO()), world.interrupt,
                     lambda: Recorder(world, sent))  # type: ignore[arg-type,return-value]
    publish_mod.publish(m, [report], run)
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
    assert logins.env_suffix("reg.example.com:5000") == "REG_EXAMPLE_COM_5000"
