"""Tag names computed from cells (publishing itself is tested against real registries)."""

from __future__ import annotations

import datetime

from imagefactory.config import registries
from imagefactory.config import tags
from imagefactory.engine.docker import is_transient, split_tag
from imagefactory.config.model import Cell
import pytest
from imagefactory.config import matrix
from imagefactory.config.tags import TagTemplateError, hash_tag
from imagefactory.errors import ConfigError
from tests.unit.helpers import HARDENING_PIP as PIP, hardening_project, list_refused as refused, write_matrix_text as write

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


# -- moved from test_hardening_tags.py ----------------------------------------


ONE_CELL = """
image: registry.example.com/ml/train
matrix: {python: ["3.11"], cuda: ["none"], blas: [openblas], installer: [pip]}
torch: "2.13.0"
"""


CELL_HT = "py3.11-cpu-openblas-pip"


HASH = "ab" * 32


def problems(write_matrix, text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(text))
    return e.value.problems


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
    assert m.cell(CELL_HT).tags == ("Other.Example.NET/x/" + CELL_HT,)
    assert registries.allowed_registries(m) == ("registry.example.com", "other.example.net")


def test_tags_registries_entries_are_hosts(write_matrix):
    [p] = problems(write_matrix, ONE_CELL + 'tags: {registries: ["evil.example/x"]}\n')
    assert "tags.registries[0]" in p and "malformed" in p


def test_the_hash_template_must_hold_the_hash(write_matrix):
    [p] = problems(write_matrix, ONE_CELL + 'tags: {hash_template: "{image}:stable"}\n')
    assert "tags.hash_template" in p and "{hash}" in p
    # the code refuses it too, whatever the schema lets through
    cell = matrix.load(write_matrix(ONE_CELL)).cell(CELL_HT)
    with pytest.raises(TagTemplateError, match="has no {hash} field"):
        hash_tag("{image}:stable", "r.example/x", cell, HASH)
    assert hash_tag("{image}:h{hash}", "r.example/x", cell, HASH) == "r.example/x:h" + HASH[:12]


@pytest.mark.parametrize("key,value", [("template", "{image}:x@sha256:" + "0" * 64),
                                       ("hash_template", "{image}:{hash}@sha256:" + "0" * 64)])
def test_a_tag_with_a_digest_is_refused(write_matrix, key, value):
    [p] = problems(write_matrix, ONE_CELL + f'tags: {{{key}: "{value}"}}\n')
    assert f"tags.{key}" in p and "holds a digest" in p


# -- moved from test_hardening_iii.py ----------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


def test_an_extra_tag_of_one_cell_equal_to_another_cells_release_tag_is_refused(project, monkeypatch, capsys):
    """Cell `a` gets a-g0000000 as its git-sha tag (the check's stand-in sha); cell `a-g0000000`
    has that as its release tag: one push would overwrite the other."""
    text = PIP.replace("  installer: [pip]", "  installer: [pip]\n  variant: [a, a-g0000000]") + (
        'tags:\n  template: "{image}:{variant}"\n  extra: [git-sha]\n')
    line = refused(project, text, monkeypatch, capsys)
    assert "would both be tagged 'registry.example.com/ml/train:a-g0000000'" in line


def test_tags_registries_names_are_normalised(project):
    from imagefactory.config import tags

    assert registries.allowed("registry.example.com/ml/train", ("Other.Example.NET", "index.docker.io")) == (
        "registry.example.com", "other.example.net", "docker.io")
    text = PIP + ('tags:\n  registries: [Other.Example.NET, index.docker.io]\n'
                  '  template: "other.example.net/ml/train:{torch}-py{python}"\n')
    m = matrix.load(write(project, text))
    assert m.cells[0].tags == ("other.example.net/ml/train:2.13.0-py3.11",)
    assert tags.refusal("docker.io/ml/train:x", registries.allowed_registries(m)) is None
    assert tags.refusal("OTHER.example.net/ml/train:x", registries.allowed_registries(m)) is None
