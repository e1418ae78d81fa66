"""terminal.py: what reaches the terminal is escaped and bounded (listings, paths, warnings)."""

from __future__ import annotations

import pytest
from imagefactory.cli import app
from imagefactory import terminal
from tests.unit.helpers import run_cli
from tests.unit.helpers import hardening_project


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


def test_listing_takes_names_never_one_string():
    assert terminal.listing(["a", "b"]) == "a, b"
    assert terminal.listing([], empty="nothing") == "nothing"
    assert terminal.listing([str(i) for i in range(20)], limit=3) == "0, 1, 2 and 17 more"
    with pytest.raises(TypeError):
        terminal.listing("its indexes")  # type: ignore[arg-type]


def test_the_warning_itself_reaches_the_terminal_escaped(project, monkeypatch, capsys):
    bad = project / "n\x1b[31m\x07"
    bad.write_text("machine other.example.com login a password b\n")
    monkeypatch.setattr(app, "_run", _no_engine)
    code, out, err = run_cli(["build", "--builder", "classic", "--netrc", str(bad)], monkeypatch, capsys)
    assert "warning: netrc" in err and "names no host" in err
    assert "\x1b" not in err + out and "\x07" not in err + out and "\\x1b[31m\\x07" in err


def _no_engine(*args, **kwargs):
    from imagefactory.errors import ImageFactoryError

    raise ImageFactoryError("stopped before the engine (test)")


def test_render_prints_its_out_path_escaped(project, monkeypatch, capsys):
    out_dir = project / "o\x1b]0;owned\x07x"
    code, out, err = run_cli(["render", "--out", str(out_dir)], monkeypatch, capsys)
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;owned\\x07x" in out and "\t" in out


def test_the_escaping_stream_keeps_newlines_and_tabs_and_escapes_the_rest():
    assert terminal.printable_text("a\tb\nc") == "a\tb\nc"
    assert terminal.printable_text("\x1b[31mx\u202e\r") == "\\x1b[31mx\\u202e\\r"
