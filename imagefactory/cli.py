"""The command line. Each command is a thin shell over one pipeline step."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from imagefactory import matrix as matrix_mod
from imagefactory import render as render_mod
from imagefactory.errors import ConfigError, ImageFactoryError

app = typer.Typer(
    name="imagefactory",
    help=(
        "Turn one matrix file into tested, tagged, published Docker images for deep-learning training.\n\n"
        "Typical use: `imagefactory list` to see the cells, `imagefactory render` to review the "
        "Dockerfiles, `imagefactory build --push` to build, smoke-test and publish them.\n\n"
        "Exit codes: 0 success; 1 a cell failed to build, failed a check or failed to publish; "
        "2 bad configuration; 3 no Docker engine reachable."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, highlight=False)

MatrixOpt = typer.Option(Path("matrix.yaml"), "--matrix", "-m", help="The matrix file.", show_default=True)
OnlyOpt = typer.Option(None, "--only", help="Only this cell id (repeatable). See `imagefactory list`.")


class ListFormat(str, Enum):
    table = "table"
    json = "json"
    github = "github"


def _load(path: Path, only: Optional[List[str]] = None):
    m = matrix_mod.load(path)
    cells = select(m, only)
    return m, cells


def select(m, only):
    if not only:
        return list(m.cells)
    ids = [c.id for c in m.cells]
    unknown = [o for o in only if o not in ids]
    if unknown:
        raise ConfigError([f"--only {u}: no such cell (allowed: {', '.join(ids)})" for u in unknown])
    return [c for c in m.cells if c.id in only]


def _cell_row(c) -> dict:
    return {
        "id": c.id, "python": c.python, "cuda": c.cuda or "none", "blas": c.blas,
        "installer": c.installer, "torch": c.torch, "threads": c.threads,
        "base_image": c.base_image, "tag": c.tags[0] if c.tags else "",
    }


@app.command("list")
def list_cells(
    matrix: Path = MatrixOpt,
    only: Optional[List[str]] = OnlyOpt,
    format: ListFormat = typer.Option(ListFormat.table, "--format", "-f",
                                      help="table for people; json for scripts; github for a job matrix "
                                           "(`fromJSON` of {\"include\": [...]})."),
) -> None:
    """Show the expanded cells: id, base image, release tag and key settings."""
    m, cells = _load(matrix, only)
    rows = [_cell_row(c) for c in cells]
    if format is ListFormat.json:
        print(json.dumps(rows, indent=2))
    elif format is ListFormat.github:
        print(json.dumps({"include": [{"cell": r["id"], **r} for r in rows]}, separators=(",", ":")))
    else:
        table = Table(show_header=True, header_style="bold", box=None)
        for col in ("id", "torch", "threads", "base_image", "tag"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["id"], r["torch"], str(r["threads"]), r["base_image"], r["tag"])
        Console(highlight=False, width=200).print(table)


@app.command()
def render(
    matrix: Path = MatrixOpt,
    out: Path = typer.Option(Path("build/contexts"), "--out", "-o", help="Folder for the build contexts."),
    only: Optional[List[str]] = OnlyOpt,
) -> None:
    """Write one build context per cell to OUT/<cell-id>/ (Dockerfile and every file it copies).

    Same matrix in, same bytes out; nothing is written unless every cell renders."""
    m, cells = _load(matrix, only)
    contexts = render_mod.render(m, out, cells)
    for ctx in contexts:
        print(f"{ctx.cell.id}\t{ctx.path}\t{ctx.content_hash[:12]}")


@app.command()
def schema() -> None:
    """Print the JSON Schema of the matrix file (for editors and CI linting)."""
    print(json.dumps(matrix_mod.schema(), indent=2))


def main() -> None:
    try:
        app()
    except ConfigError as e:
        for line in e.problems:
            print(f"error: {line}", file=sys.stderr)
        sys.exit(e.exit_code)
    except ImageFactoryError as e:
        print(f"error: {e.message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        sys.exit(130)
