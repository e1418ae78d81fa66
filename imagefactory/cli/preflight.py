"""The CLI's preflight checks: what a run needs, checked after its options are parsed
(options.py) and before anything is built, each failure an exit 2 naming its flag: the output
paths, --cache-from, --probe-shm, the builder and its netrc, --atomic, the signing key, what a
push needs, and the environment the Docker SDK reads."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from imagefactory.engine import environment
from imagefactory.errors import ConfigError
from imagefactory import terminal
from imagefactory.files import bounded
from imagefactory.run import context
from imagefactory.run.context import Builder

if TYPE_CHECKING:
    from imagefactory.config import matrix as matrix_mod
    from imagefactory.config.model import Cell


P = TypeVar("P", bound=context.Publishing)


def checked(m: matrix_mod.Matrix, cells: list[Cell], settings: dict[str, Any],
            kind: type[context.Settings], notes: list[str] | None = None) -> context.Settings:
    """The run's settings, of the command's type `kind`, from the parsed `settings` (updated in place with what the checks
    resolve: --cache-from, --probe-shm, the builder, the netrc, the signing key), every check
    run in this order, so the first failure is the one a run always reported. What the checks
    only say of the engine (auto's builder choice) goes to `notes`, printed once the engine
    answered: a user with no engine reads the engine's error alone (stderr when `notes` is None)."""
    if "cache_from" in settings:
        settings["cache_from"] = _cache_from(settings["cache_from"] or ())
    if "probe_shm" in settings:
        from imagefactory.probe import smoke

        settings["probe_shm"] = smoke.check_shm(settings["probe_shm"])
    _outputs(m, settings)
    if "builder" in settings:
        settings.update(_builder(m, cells, settings, notes))
    if settings.get("atomic") and not settings.get("push"):
        raise ConfigError("--atomic: only meaningful with --push")
    if settings.get("sign"):
        settings["sign"] = _signing_key(settings)
    options = kind(**settings)
    if isinstance(options, context.Publishing) and options.push:
        options = _publishing(m, cells, options)
    return options


def _outputs(m: matrix_mod.Matrix, settings: dict[str, Any]) -> None:
    """--work-dir and --report (and the report's .md) can be written, and none is the matrix file:
    exit 2 naming the flag before anything is built."""
    keep = (m.path,)
    if "work_dir" in settings:
        bounded.check_output(Path(settings["work_dir"]), "--work-dir", folder=True, keep=keep)
    if "report" in settings:
        report = Path(settings["report"])
        for path in (report, report.with_suffix(".md")):
            bounded.check_output(path, "--report", folder=False, keep=keep)


def _cache_from(values: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Each --cache-from is an image reference (refs.parse, the whole string): it becomes a word of
    buildx's command line, so a newline, an option word or an empty string never passes."""
    from imagefactory.config import refs

    bad = [v for v in values if refs.parse(v) is None]
    if bad:
        raise ConfigError([f"--cache-from {terminal.show(v)}: not an image reference (e.g. "
                           f"registry.example.com/ml/train:2.13.0-py3.11-cpu-openblas)" for v in bad])
    return tuple(values)


def _signing_key(settings: dict[str, Any]) -> str:
    """--sign checked before anything is built: a push asked for, cosign 2.x present, the key usable."""
    from imagefactory.attest import signing

    if not settings.get("push"):
        raise ConfigError("--sign: only meaningful with --push (what is signed is the pushed digest)")
    return signing.ready(settings["sign"], private=True, flag="--sign").ref


def _builder(m: matrix_mod.Matrix, cells: list[Cell], settings: dict[str, Any],
             notes: list[str] | None) -> dict[str, Any]:
    """Resolve --builder to buildkit or classic (buildkit.select: exit 2 when buildkit is asked for
    and buildx cannot build; auto falls back to classic and says so), check --buildx-builder, and
    load the netrc the builds mount (netrc.resolve: exit 2 for a bad file, or for a cell that needs
    a login under the classic builder)."""
    from imagefactory.engine import buildkit
    from imagefactory.config import netrc as netrc_mod

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    def note(line: str) -> None:
        if notes is None:
            say(line)
        else:
            notes.append(line)

    builder = buildkit.select(settings["builder"], note)
    name = buildkit.check_builder_name(settings.get("buildx_builder"))
    if name is not None and builder is not Builder.buildkit:
        raise ConfigError(f"--buildx-builder {name}: names a buildx builder, but this run builds with the classic "
                          f"builder, which would ignore it; build with --builder buildkit")
    out: dict[str, Any] = {"builder": builder, "buildx_builder": name}  # test, push too: their summary shows it
    if "netrc" in settings:
        loaded = netrc_mod.resolve(settings["netrc"], m, cells, buildkit=builder is Builder.buildkit, warn=say)
        out["netrc"] = loaded
    return out


def _publishing(m: matrix_mod.Matrix, cells: list[Cell], options: P) -> P:
    """Check everything publishing needs before anything is built: the credentials, the commit
    id, every tag of every cell."""
    from imagefactory.engine import logins
    from imagefactory.publish import push

    logins.registry_credentials(m)
    options = dataclasses.replace(options, git_sha=push.git_sha())
    for cell in cells:
        push.tags_for(m, cell.id, "0" * 64, options)
    return options



def engine_environment() -> None:
    """What the Docker SDK reads from the environment, checked before it does (exit 2 naming it,
    never the SDK's traceback or hang): $DOCKER_HOST well formed, the Docker config.json a
    bounded regular file, and a cache folder (HOME or IMAGEFACTORY_CACHE_DIR)."""
    from imagefactory.files import fsutil

    environment.docker_host()
    environment.check_docker_config()
    fsutil.cache_root()

