"""engine/environment.py: DOCKER_HOST and the Docker config, checked before any engine is reached."""

from __future__ import annotations

import os
import pytest
from imagefactory.engine import environment
from tests.unit.helpers import hardening_project, one_error


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


@pytest.mark.parametrize("value", ["tcp://[::1", "tcp://127.0.0.1:65536", "tcp://host:0", "unix://", "tcp://a b:1",
                                   "http://x:99999999", "ssh://", "tcp://h:1\n", "\x1b[31m"])
def test_a_malformed_docker_host_is_exit_2_naming_it(project, monkeypatch, capsys, value):
    monkeypatch.setenv("DOCKER_HOST", value)
    for args in (["build", "--builder", "classic"], ["doctor"]):
        line = one_error(args, monkeypatch, capsys)
        assert line.startswith("error: $DOCKER_HOST ") and "not an engine address" in line
    assert not (project / "build").exists()


@pytest.mark.parametrize("value", ["unix:///var/run/docker.sock", "tcp://127.0.0.1:2375", "tcp://[::1]:2375",
                                   "ssh://me@build-host", "ssh://build-host:2222", "tcp://docker:2376/"])
def test_a_well_formed_docker_host_passes(value):
    assert environment.docker_host({"DOCKER_HOST": value}) == value
    assert environment.docker_host({}) is None


@pytest.mark.parametrize("make", [lambda p: os.mkfifo(p), lambda p: p.write_bytes(b" " * (2 << 20)),
                                  lambda p: os.symlink("/dev/zero", p)])
def test_a_fifo_or_huge_docker_config_is_exit_2_not_a_hang(project, monkeypatch, capsys, make):
    folder = project / "dockercfg"
    folder.mkdir()
    make(folder / "config.json")
    monkeypatch.setenv("DOCKER_CONFIG", str(folder))
    line = one_error(["build", "--builder", "classic"], monkeypatch, capsys)
    assert line.startswith("error: $DOCKER_CONFIG/config.json ")
    assert not (project / "build").exists()
