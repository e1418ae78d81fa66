"""Every command's --help fits one screen and ends with an example; `imagefactory` alone names the
three commands of a first run and exits 0 (docs/builders.md#build-options)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from imagefactory.cli import app as cli

WIDTH = 100  # columns
SCREEN = 40  # lines
FIRST = ("list", "render", "build")  # the README's first run: see the cells, review the Dockerfiles, build


def commands() -> list[str]:
    group = typer.main.get_command(cli.app)
    return sorted(group.commands)  # type: ignore[attr-defined]


def run(*args: str):
    return CliRunner().invoke(cli.app, list(args), env={"COLUMNS": str(WIDTH)}, terminal_width=WIDTH)


def test_every_command_is_checked():
    assert {"list", "render", "build", "test", "push", "doctor", "bench", "lock", "schema", "verify",
            "report"} <= set(commands())


@pytest.mark.parametrize("command", [None, *commands()])
def test_help_fits_one_screen_and_has_an_example(command):
    r = run(*([command] if command else []), "--help")
    assert r.exit_code == 0, r.output
    lines = r.output.rstrip("\n").splitlines()
    assert len(lines) <= SCREEN, f"{command or 'imagefactory'} --help: {len(lines)} lines\n{r.output}"
    assert max(map(len, lines)) <= WIDTH, r.output
    examples = [line.strip() for line in lines if line.strip().startswith("Example: imagefactory ")]
    assert len(examples) == 1, r.output
    if command:
        assert examples[0].startswith(f"Example: imagefactory {command}"), examples


def test_bare_imagefactory_names_the_first_three_commands():
    r = run()
    assert r.exit_code == 0, r.output
    assert "Usage" not in r.output  # not the usage error
    lines = r.output.splitlines()
    assert len(lines) <= SCREEN and max(map(len, lines)) <= WIDTH
    named = [w for line in lines for w in line.split()[1:2] if line.strip().startswith("imagefactory ")]
    assert named[:3] == list(FIRST), r.output
    assert "imagefactory --help" in r.output


def test_the_installed_entry_point_agrees(monkeypatch, capsys):
    """cli.main (what `imagefactory` runs) prints the same first steps, exit 0."""
    from tests.unit.helpers import run_cli

    code, out, _ = run_cli([], monkeypatch, capsys)
    assert code == 0 and out == cli.FIRST_STEPS
