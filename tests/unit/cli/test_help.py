"""`--help` comes from typer each time, fast from lazy imports alone: no page is kept on disk or
read from it, and the page is the same bytes every run. What it imports: test_cli_imports.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

HELPS = [["--help"], ["list", "--help"], ["build", "--help"], ["lock", "--help"], ["no-such-command", "--help"]]

# Runs imagefactory's entry point (__main__.main) with ARGS; after it, on stderr: the modules loaded,
# the files opened and written, and the exit code.
RUN = """
import json, sys
opened = []
sys.addaudithook(lambda event, args: opened.append([str(args[0]), str(args[1])]) if event == "open" else None)
sys.argv = ["imagefactory", *json.loads(sys.argv[1])]
from imagefactory.__main__ import main
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
sys.__stderr__.write("\\nRAN " + json.dumps([sorted(sys.modules), opened, code]) + "\\n")
"""


def run(args: list[str], cache: Path) -> tuple[str, set[str], list[list[str]], int]:
    """stdout, the modules loaded, the files opened (path, mode), the exit code of `imagefactory ARGS`."""
    env = {**os.environ, "IMAGEFACTORY_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    r = subprocess.run([sys.executable, "-c", RUN, json.dumps(args)], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=120)
    tail = r.stderr.rsplit("\nRAN ", 1)
    assert len(tail) == 2, r.stderr
    modules, opened, code = json.loads(tail[1])
    return r.stdout, set(modules), opened, code


@pytest.mark.parametrize("args", HELPS, ids=lambda a: "-".join(a))
def test_help_keeps_no_page_on_disk(args, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    first, modules, _, code = run(args, cache)
    assert "typer" in modules and code == (2 if args[0] == "no-such-command" else 0)
    again, modules, _, _ = run(args, cache)
    assert again == first and "typer" in modules  # typer printed it again: nothing replayed
    assert list(cache.iterdir()) == []  # the cache folder stays empty


def test_the_help_opens_no_file_but_modules(tmp_path):
    """No page is read or written anywhere: every file `--help` opens is a module."""
    for args in (["--help"], ["build", "--help"]):
        _, _, opened, code = run(args, tmp_path)
        assert code == 0
        odd = [p for p, _ in opened if not p.endswith((".py", ".pyc", ".so")) and not p.isdigit()
               and ".pyc." not in p]
        assert odd == []


def test_python_dash_m_prints_the_same_bytes_each_time(tmp_path):
    env = {**os.environ, "IMAGEFACTORY_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    pages = [subprocess.run([sys.executable, "-m", "imagefactory", "--help"], capture_output=True, env=env, cwd=REPO,
                            timeout=120) for _ in range(2)]
    assert [p.returncode for p in pages] == [0, 0] and pages[0].stdout == pages[1].stdout
    assert b"Usage: python -m imagefactory" in pages[0].stdout and list(tmp_path.iterdir()) == []


def test_no_help_cache_module_is_left():
    assert not (REPO / "imagefactory" / "cli" / "helpcache.py").exists()
