"""files/fsutil.py: hashing, atomic writes, the run lock file and the home folder."""

from __future__ import annotations

import pytest
from imagefactory.files import fsutil
import os
import stat
from imagefactory.cli import app
from imagefactory.config import netrc
from imagefactory.errors import ConfigError
from tests.unit.helpers import run_cli
from tests.unit.helpers import hardening_project, one_error


def test_sha256_file_and_atomic_write(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    fsutil.atomic_write(path, "{}")
    fsutil.atomic_write(path, b"new", durable=True)
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]
    assert fsutil.sha256_file(path) == "11507a0e2f5e69d5dfa40a62a1bd7b6ee57e6bcd85c67c9b8431b36fff21c437"

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(fsutil.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fsutil.atomic_write(path, "half")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]


# -- moved from test_hardening_iii.py ----------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


@pytest.mark.parametrize("which", ["build/.imagefactory.lock", "build/.report.json.lock"])
def test_a_planted_lock_link_never_truncates_its_target(project, monkeypatch, capsys, which):
    victim = project / "precious.txt"
    victim.write_text("do not empty me\n")
    (project / "build").mkdir()
    os.symlink(victim, project / which)
    monkeypatch.setattr(app, "_engine_environment", lambda: None)
    line = one_error(["build", "--builder", "classic"], monkeypatch, capsys)
    assert "symbolic link" in line and victim.read_text() == "do not empty me\n"


def test_a_lock_file_that_holds_something_else_is_not_truncated(tmp_path):
    other = tmp_path / "lock"
    other.write_text("someone's notes\n")
    with pytest.raises(ConfigError, match="not one imagefactory made"):
        fsutil.open_lock(other, "--work-dir x")
    assert other.read_text() == "someone's notes\n"
    os.link(other, tmp_path / "second-name")
    other.write_text("")
    with pytest.raises(ConfigError, match="hard link"):
        fsutil.open_lock(other, "--work-dir x")


def test_a_lock_file_a_run_left_is_reused(tmp_path):
    path = tmp_path / "lock"
    os.close(fsutil.open_lock(path, "x"))
    path.write_text("4242\n")
    os.close(fsutil.open_lock(path, "x"))
    assert stat.S_ISREG(os.lstat(path).st_mode)


def test_home_unset_for_a_uid_without_passwd_entry_is_exit_2_not_a_traceback(project, monkeypatch, capsys):
    import pwd

    monkeypatch.delenv("HOME")
    monkeypatch.delenv("IMAGEFACTORY_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    assert fsutil.home() is None and netrc.default_path() is None
    line = one_error(["build", "--builder", "classic"], monkeypatch, capsys)
    assert "$HOME is not set" in line and "IMAGEFACTORY_CACHE_DIR" in line
    code, out, err = run_cli(["list"], monkeypatch, capsys)  # a command that needs no cache still runs
    assert code == 0, err
