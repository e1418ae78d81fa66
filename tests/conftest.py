"""Shared fixtures. Docker-backed fixtures live in tests/integration/conftest.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def write_matrix(tmp_path):
    """Write a matrix file from YAML text (dedented) and return its path."""

    def write(text: str, name: str = "matrix.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return write
