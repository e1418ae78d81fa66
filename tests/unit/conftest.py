"""Unit-test fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def own_verdict_cache(tmp_path, monkeypatch):
    """Each test its own verdict cache (verdicts.py): the in-memory engine reuses image ids
    from test to test, so a shared cache would let one test's pass answer for another."""
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "imagefactory-cache"))


@pytest.fixture(scope="session")
def _no_buildx_docker(tmp_path_factory):
    """A `docker` CLI that answers as a fresh machine's does: no buildx plugin, no engine."""
    folder = tmp_path_factory.mktemp("docker-cli")
    script = folder / "docker"
    script.write_text("#!/bin/sh\n"
                      "if [ \"$1 $2\" = 'buildx version' ]; then\n"
                      "  echo \"docker: unknown command: docker buildx\" >&2; exit 1\n"
                      "fi\n"
                      "echo 'Cannot connect to the Docker daemon (a unit test drives no engine)' >&2; exit 1\n")
    script.chmod(0o755)
    return folder


@pytest.fixture(autouse=True)
def machine_docker_cli(_no_buildx_docker, monkeypatch):
    """Unit tests never ask this machine which builder it has: the `docker` first on PATH (in
    this process and the CLI processes tests start) is a fresh machine's, with no buildx plugin
    and no engine, whatever client the machine has. A test that needs another answer puts its own
    first (test_buildkit's fake_docker)."""
    monkeypatch.setenv("PATH", f"{_no_buildx_docker}{os.pathsep}{os.environ.get('PATH', '')}")
