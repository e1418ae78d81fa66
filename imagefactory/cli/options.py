"""The CLI's option parsing: the shared flags, each declared once (`FLAGS`), added to the commands
that take them (`shared`), and parsed into an `Invocation`: the matrix, the selected cells and the
run's settings, of the command's own type (`TYPES`, run/context.py), checked before anything runs
(preflight.py). Imports typer and nothing of the pipeline: `--help` reads these declarations
(tests/unit/cli/test_imports.py)."""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, List, Optional

import typer

from imagefactory.errors import ConfigError
from imagefactory import terminal
from imagefactory.files import bounded, yamlfile
from imagefactory.run import context
from imagefactory.run.context import Builder, Gpus, Network, Pull

if TYPE_CHECKING:
    from imagefactory.config import matrix as matrix_mod
    from imagefactory.config.model import Cell


# -- the shared options: each declared once ---------------------------------------------------------
# name: (type, typer declaration). A command lists the names it takes (`@shared(...)`); they are
# added to its signature, resolved and checked once into an `Invocation` (the matrix, the selected
# cells, the command's settings type: TYPES), and printed as one summary line when a run starts.
FLAGS: dict[str, tuple[Any, Any]] = {
    # Each help fits a line or two of `--help` at 100 columns; the details: docs/builders.md#build-options.
    "matrix": (Path, typer.Option(Path("matrix.yaml"), "--matrix", "-m", help="The matrix file.", show_default=True)),
    "only": (Optional[List[str]], typer.Option(None, "--only", help="Only this cell id (repeatable); see "
                                                                     "`imagefactory list`.")),
    "jobs": (int, typer.Option(1, "--jobs", "-j", min=1, help="Cells built at the same time.")),
    "keep_going": (bool, typer.Option(True, "--keep-going/--fail-fast",
                                      show_default=False,
                                      help="Go on past a failing cell (default), or start none after one.")),
    "gpus": (Gpus, typer.Option(Gpus.auto, "--gpus", help="GPUs for the probe and bench containers: all (then "
                                                          "required), none, or auto (all with the NVIDIA runtime).")),
    "network": (Network, typer.Option(Network.host, "--network", help="Network of the build containers.")),
    "report": (Path, typer.Option(Path("build/report.json"), "--report",
                                  help="JSON report; the .md summary beside it.")),
    "work_dir": (Path, typer.Option(Path("build"), "--work-dir", help="Rendered contexts and per-cell logs.")),
    "probe_timeout": (float, typer.Option(context.DEFAULT_PROBE_TIMEOUT, "--probe-timeout", min=1.0,
                                          help="Seconds the in-image probe may run.")),
    "live": (Optional[bool], typer.Option(None, "--live/--plain", help="Live display (default on a terminal) or "
                                                                       "plain lines.")),
    "push": (bool, typer.Option(False, "--push", help="Tag and push the cells that passed (as `imagefactory push`).")),
    "atomic": (bool, typer.Option(False, "--atomic", help="Publish nothing unless every selected cell passed "
                                                          "(with --push).")),
    "push_tries": (int, typer.Option(context.DEFAULT_PUSH_TRIES, "--push-tries", min=1,
                                     help="Tries per tag (transient failures).")),
    "retry_delay": (float, typer.Option(context.DEFAULT_RETRY_DELAY, "--retry-delay", min=0.0,
                                        help="Seconds before the 1st retry; doubles.")),
    "cache_from": (Optional[List[str]], typer.Option(
        None, "--cache-from", help="A local image whose layers the builds may reuse (repeatable).")),
    "registry_cache": (Optional[bool], typer.Option(
        None, "--registry-cache/--no-registry-cache",
        help="Reuse the registry's content-hash tag (default: on with --push).")),
    "pull": (Pull, typer.Option(Pull.missing, "--pull", help="Bases, pinned by digest in FROM: always (re-pulled), "
                                                             "missing (registry, else local), never (local only).")),
    "retest": (bool, typer.Option(False, "--retest", help="Probe every image, even one whose passing verdicts are "
                                                          "cached.")),
    "probe_shm": (str, typer.Option(context.DEFAULT_PROBE_SHM, "--probe-shm",
                                    help="The probe's /dev/shm: a size (1g, 512m), host (--ipc=host) or default "
                                         "(Docker's 64 MB: too small).")),
    "builder": (Builder, typer.Option(Builder.auto, "--builder", metavar="KIND",
                                      help="auto (BuildKit if `docker buildx` answers), buildkit or classic; "
                                           "test/push find either's images.")),
    "buildx_builder": (Optional[str], typer.Option(None, "--buildx-builder", metavar="NAME",
                                                   help="With buildkit: the buildx builder (remote ones too).")),
    "sign": (Optional[str], typer.Option(None, "--sign", metavar="KEY",
                                         help="With a push: cosign-sign digests, attach SBOM, provenance.")),
    "netrc": (Optional[Path], typer.Option(None, "--netrc", metavar="PATH",
                                           help="Index logins (default $NETRC, ~/.netrc), a BuildKit-only "
                                                "secret.")),
}
def _finite(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """Every float flag: nan and inf pass a range check (nan < 1 is False), so refuse them here."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{param.opts[0]} {value}: not a finite number")
    return value


for _name, (_kind, _option) in FLAGS.items():
    if _kind is float:
        _option.callback = _finite

# flag name -> the settings field it sets (the same name where not listed)
FIELD = {"keep_going": "fail_fast", "push_tries": "attempts", "retry_delay": "backoff"}
NOT_OPTIONS = ("matrix", "only", "live")

# command -> its settings type, holding only what its flags set (and its type's NO_SHARED_FLAG);
# a command not listed (list, render, lock) drives no engine and gets context.Settings()
TYPES: dict[str, type[context.Settings]] = {
    "build": context.BuildOptions, "test": context.TestOptions, "push": context.PushOptions,
    "merge": context.MergeOptions, "bench": context.BenchOptions,
}


@dataclass
class Invocation:
    """One command's shared options, resolved and checked."""

    command: str
    matrix: matrix_mod.Matrix
    cells: list[Cell]
    options: context.Settings  # the command's type (TYPES)
    live: bool | None
    fields: tuple[str, ...]  # the settings fields this command has flags for
    notes: tuple[str, ...] = ()  # what the preflight checks said, printed after the summary

    def said(self) -> str:
        """The summary line, then each note of the preflight checks on a line of its own."""
        return "\n".join((self.summary(), *self.notes))

    def summary(self) -> str:
        return (f"imagefactory {self.command}: {len(self.cells)} cell(s) of {self.matrix.path}; "
                + self.options.summary(self.fields))



def shared(*names: str, **fixed: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Add the shared options `names` to a command; it receives them as `inv: Invocation`.
    `fixed`: settings fields the command sets without a flag (push: push=True)."""

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "inv"]
        added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=FLAGS[n][1], annotation=FLAGS[n][0])
                 for n in names]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> None:
            values = {n: kwargs.pop(n) for n in names}
            fn(inv=_invocation(fn.__name__.removesuffix("_cmd").replace("_cells", ""), values, fixed), **kwargs)

        command.__signature__ = inspect.Signature([*own, *added])  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in [*own, *added]}
        command.shared = (names, fixed)  # type: ignore[attr-defined]  # what the settings test reads
        return command

    return wrap



def _invocation(command: str, values: dict[str, Any], fixed: dict[str, Any]) -> Invocation:
    """The flags' `values` parsed (settings()), the matrix read and its cells selected, then every
    preflight check run (preflight.checked): exit 2 naming the flag before anything is built."""
    from imagefactory.cli import preflight
    from imagefactory.config import matrix as matrix_mod

    m = matrix_mod.load(values["matrix"])
    cells = select(m, values.get("only"))
    given = settings(values, fixed)
    notes: list[str] = []
    options = preflight.checked(m, cells, given, TYPES.get(command, context.Settings), notes)
    return Invocation(command, m, cells, options, values.get("live"), tuple(given), tuple(notes))


def settings(values: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """The settings fields the flags `values` set, by field name (FIELD), with `fixed` (the
    fields a command sets without a flag) last; --keep-going/--fail-fast becomes fail_fast."""
    out = {FIELD.get(n, n): v for n, v in values.items() if n not in NOT_OPTIONS}
    if "fail_fast" in out:
        out["fail_fast"] = not out["fail_fast"]
    out.update(fixed)
    return out


def select(m: matrix_mod.Matrix, only: Optional[List[str]]) -> list[Cell]:
    if not only:
        return list(m.cells)
    ids = [c.id for c in m.cells]
    unknown = list(dict.fromkeys(o for o in only if o not in ids))
    if unknown:
        allowed = terminal.listing(ids)
        raise ConfigError(yamlfile.capped([f"--only {bounded.short(u, 80)}: no such cell (allowed: {allowed}; "
                                         f"`imagefactory list` shows them all)" for u in unknown]))
    return [c for c in m.cells if c.id in only]

