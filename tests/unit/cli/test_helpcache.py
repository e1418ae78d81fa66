"""helpcache.py: a help page typer printed is replayed, byte for byte, only while every input it
was printed from is unchanged; anything else runs typer. No timing here (bench/cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from imagefactory.cli import app as cli
from imagefactory.cli import helpcache
from tests.conftest import REPO

HELPS = [["--help"], ["list", "--help"], ["build", "--help"], ["lock", "--help"]]

# Runs imagefactory's entry point (__main__.main) with ARGS; after it, on stderr: the modules loaded,
# the files opened and the exit code.
RUN = """
import json, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
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


def run(args: list[str], cache: Path, **env: str) -> tuple[str, set[str], list[str], int]:
    """stdout, the modules loaded, the files opened, the exit code of `imagefactory ARGS`."""
    full = {**os.environ, "IMAGEFACTORY_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO), "COLUMNS": "100", **env}
    r = subprocess.run([sys.executable, "-c", RUN, json.dumps(args)], capture_output=True, text=True, cwd=REPO,
                       env=full, timeout=120)
    tail = r.stderr.rsplit("\nRAN ", 1)
    assert len(tail) == 2, r.stderr
    modules, opened, code = json.loads(tail[1])
    return r.stdout, set(modules), opened, code


@pytest.mark.parametrize("args", HELPS, ids=lambda a: "-".join(a))
def test_a_replayed_page_is_what_typer_printed(args, tmp_path):
    first, modules, _, code = run(args, tmp_path)
    assert code == 0 and "Usage:" in first and "typer" in modules
    again, modules, _, code = run(args, tmp_path)
    assert code == 0 and again == first
    assert "typer" not in modules and "imagefactory.cli.app" not in modules  # replayed: the CLI never imported


def test_python_dash_m_replays_the_same_bytes(tmp_path):
    env = {**os.environ, "IMAGEFACTORY_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    pages = [subprocess.run([sys.executable, "-m", "imagefactory", "--help"], capture_output=True, env=env, cwd=REPO,
                            timeout=120) for _ in range(2)]
    assert [p.returncode for p in pages] == [0, 0] and pages[0].stdout == pages[1].stdout
    assert b"Usage: python -m imagefactory" in pages[0].stdout and len(list((tmp_path / "help").iterdir())) == 1


def test_the_help_reads_no_file_but_modules(tmp_path):
    """The premise of the witness: what typer prints depends on no file besides the modules it
    loaded (and the page itself)."""
    for args in (["--help"], ["build", "--help"]):
        _, _, opened, code = run(args, tmp_path)
        assert code == 0
        odd = [p for p in opened if not p.endswith((".py", ".pyc", ".so")) and not p.isdigit()
               and not p.startswith(str(tmp_path)) and ".pyc." not in p]
        assert odd == []


def test_another_environment_runs_typer(tmp_path):
    page, _, _, _ = run(["build", "--help"], tmp_path)
    narrow, modules, _, _ = run(["build", "--help"], tmp_path, COLUMNS="60")
    assert "typer" in modules and narrow != page
    again, modules, _, _ = run(["build", "--help"], tmp_path, COLUMNS="60")
    assert "typer" not in modules and again == narrow


def test_a_failing_help_is_never_recorded(tmp_path):
    _, _, _, code = run(["no-such-command", "--help"], tmp_path)
    assert code == 2 and not (tmp_path / "help").exists()
    _, modules, _, code = run(["no-such-command", "--help"], tmp_path)
    assert code == 2 and "typer" in modules


# -- in process: the key, the witness, the file ------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_only_help_shapes_are_cacheable():
    assert helpcache.cacheable(["--help"]) and helpcache.cacheable(["build", "--help"])
    for args in ([], ["list"], ["--help", "x"], ["-m", "--help"], ["build", "--help", "-j"], ["build", "-h"]):
        assert not helpcache.cacheable(args)


def test_a_changed_input_misses(cache, monkeypatch):
    args = ["build", "--help"]
    helpcache.record(args, helpcache.key(args), "the page\n")
    assert helpcache.lookup(args) == "the page\n"
    assert helpcache.lookup(["list", "--help"]) is None
    monkeypatch.setenv("TYPER_USE_RICH", "1")
    assert helpcache.lookup(args) is None
    monkeypatch.delenv("TYPER_USE_RICH")
    assert helpcache.lookup(args) == "the page\n"
    monkeypatch.chdir(cache)
    assert helpcache.lookup(args) is None


def test_a_changed_module_file_misses(cache, monkeypatch):
    module = cache / "planted_module.py"
    module.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(cache))
    import planted_module  # noqa: F401  (a loaded module: in the witness)

    args = ["--help"]
    helpcache.record(args, helpcache.key(args), "the page\n")
    assert helpcache.lookup(args) == "the page\n"
    module.write_text("X = 22\n")
    assert helpcache.lookup(args) is None
    sys.modules.pop("planted_module")


def test_a_new_module_beside_a_loaded_one_misses(cache, monkeypatch):
    args = ["--help"]
    monkeypatch.syspath_prepend(str(cache))
    helpcache.record(args, helpcache.key(args), "the page\n")
    assert helpcache.lookup(args) == "the page\n"
    os.utime(cache, ns=(1, 1))  # what adding typer.py to a folder on sys.path does to it
    assert helpcache.lookup(args) is None


def test_an_odd_page_file_misses(cache):
    args = ["--help"]
    k = helpcache.digest(helpcache.key(args))
    path = Path(helpcache.page_path(k) or "")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": k, "out": "a page\n\tindented\n", "witness": []}))
    assert helpcache.lookup(args) == "a page\n\tindented\n"  # what a well-formed file gives (the misses below can fail)
    for odd in ("{not json", json.dumps([1]), json.dumps({"key": k, "out": 1, "witness": []}),
                json.dumps({"key": k, "out": "x", "witness": [["a"]]}), json.dumps({"key": "0" * 64, "out": "x",
                                                                                    "witness": []}),
                json.dumps({"key": k, "out": "red \x1b[31m", "witness": []}),
                json.dumps({"key": k, "out": "bidi \u202e", "witness": []})):
        path.write_text(odd)
        assert helpcache.lookup(args) is None
    target = cache / "elsewhere.json"
    target.write_text(json.dumps({"key": k, "out": "x", "witness": []}))
    path.unlink()
    path.symlink_to(target)
    assert helpcache.lookup(args) is None  # a link is never followed


def test_a_page_file_holds_no_environment_value(cache, monkeypatch):
    monkeypatch.setenv("IMAGEFACTORY_REGISTRY_PASSWORD", "s3cret-value-42")
    helpcache.record(["--help"], helpcache.key(["--help"]), "p")
    (page,) = (cache / "cache" / helpcache.FOLDER).iterdir()
    assert "s3cret-value-42" not in page.read_text() and helpcache.lookup(["--help"]) == "p"


def test_pages_are_bounded(cache, monkeypatch):
    monkeypatch.setattr(helpcache, "MAX_PAGES", 3)
    for width in range(6):
        monkeypatch.setenv("COLUMNS", str(60 + width))
        helpcache.record(["--help"], helpcache.key(["--help"]), "p")
    assert len(list((cache / "cache" / helpcache.FOLDER).iterdir())) == 3


def test_no_cache_folder_no_page(monkeypatch):
    for name in ("IMAGEFACTORY_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    helpcache.record(["--help"], helpcache.key(["--help"]), "p")
    assert helpcache.lookup(["--help"]) is None


def test_the_cli_records_what_it_printed(cache, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["imagefactory", "schema", "--help"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "Print the JSON Schema" in printed and helpcache.lookup(["schema", "--help"]) == printed


def test_a_help_that_raises_is_never_recorded(cache, monkeypatch):
    def boom() -> None:
        print("half a page")
        raise RuntimeError("typer failed")

    monkeypatch.setattr(cli, "_main", boom)
    monkeypatch.setattr(sys, "argv", ["imagefactory", "--help"])
    with pytest.raises(RuntimeError):
        cli.main()
    assert helpcache.lookup(["--help"]) is None
