"""Unit-test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def own_verdict_cache(tmp_path, monkeypatch):
    """Each test its own verdict cache (verdicts.py): the in-memory engine reuses image ids
    from test to test, so a shared cache would let one test's pass answer for another."""
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "imagefactory-cache"))
