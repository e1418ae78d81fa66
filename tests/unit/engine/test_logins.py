"""engine/logins.py: one credential variable pair per registry, never two registries on one pair."""

from __future__ import annotations

import pytest
from imagefactory.config import matrix
from tests.unit.helpers import HARDENING_PIP as PIP, hardening_project, list_refused as refused, write_matrix_text as write


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


def test_registries_that_map_to_one_credential_variable_are_refused(project, monkeypatch, capsys):
    line = refused(project, PIP + "tags:\n  registries: [reg-a.example.com, reg.a.example.com]\n", monkeypatch, capsys)
    assert "tags.registries" in line and "IMAGEFACTORY_REGISTRY_USER_REG_A_EXAMPLE_COM" in line


def test_the_credential_mapping_is_one_to_one_for_a_loaded_matrix(project):
    from imagefactory.config import registries

    m = matrix.load(write(project, PIP + "tags:\n  registries: [a.example.com, b.example.com:5000, Other.Example.NET]\n"))
    suffixes = [registries.Registry(r).env_suffix for r in registries.allowed_registries(m)[1:]]
    assert len(set(suffixes)) == len(suffixes)
