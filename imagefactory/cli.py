"""The command line. Each command is a thin shell over one pipeline step."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from enum import Enum
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from imagefactory import build as build_mod
from imagefactory import lock as lock_mod
from imagefactory import matrix as matrix_mod
from imagefactory import progress as progress_mod
from imagefactory import publish as publish_mod
from imagefactory import render as render_mod
from imagefactory import report as report_mod
from imagefactory.errors import CellFailure, ConfigError, DockerUnavailable, ImageFactoryError, Interrupted
from imagefactory.interrupt import Interrupt

app = typer.Typer(
    name="imagefactory",
    help=(
        "Turn one matrix file into tested, tagged, published Docker images for deep-learning training.\n\n"
        "Typical use: `imagefactory list` to see the cells, `imagefactory render` to review the "
        "Dockerfiles, `imagefactory build --push` to build, smoke-test and publish them.\n\n"
        "Exit codes: 0 success; 1 a cell failed to build, failed a check or failed to publish; "
        "2 bad configuration; 3 no Docker engine reachable (or it stopped answering); "
        "130 / 143 interrupted by SIGINT / SIGTERM (the report is still written)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

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
        from rich.console import Console
        from rich.table import Table

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


class Gpus(str, Enum):
    none = "none"
    all = "all"
    auto = "auto"


class Network(str, Enum):
    host = "host"
    default = "default"


def _finish(outcome: build_mod.Outcome, report_path: Path, interrupt: Interrupt) -> None:
    reports = outcome.reports
    json_path, md_path = report_mod.write(reports, report_path, gpus=outcome.gpus)
    failed = [r for r in reports if not r.ok]
    print(f"report: {json_path} and {md_path}", file=sys.stderr)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(Counter(
        r.status + (f"/{r.publish}" if r.publish else "") for r in reports).items()))
    print(f"{len(reports)} cell(s): {counts}", file=sys.stderr)
    if interrupt.signum is not None:
        raise Interrupted(interrupt.signum)
    if outcome.engine_gone:
        raise DockerUnavailable(outcome.engine_gone)
    if failed:
        raise CellFailure(f"{len(failed)} of {len(reports)} cell(s) failed: " + ", ".join(r.cell for r in failed))


def _pipeline(work_dir: Path, report: Path, live: Optional[bool],
              steps: Callable[[Any, Interrupt], build_mod.Outcome]) -> None:
    """Run `steps` with this run's work dir and report locked and SIGINT/SIGTERM turned into a
    cancellation; the report is written however the steps end (passed, failed, interrupted)."""
    interrupt = Interrupt()
    with build_mod.locked(work_dir, report):
        with progress_mod.make(live) as ui, interrupt.signals():
            outcome = steps(ui, interrupt)
        _finish(outcome, report, interrupt)


JobsOpt = typer.Option(1, "--jobs", "-j", min=1, help="Cells built at the same time.")
KeepGoingOpt = typer.Option(True, "--keep-going/--fail-fast",
                            help="Keep going past a failing cell (default), or stop starting new cells.")
GpusOpt = typer.Option(Gpus.auto, "--gpus", help="Give the smoke tests GPUs: all (a GPU is then required), "
                                                 "none, or auto (all when the engine has the NVIDIA runtime).")
NetworkOpt = typer.Option(Network.host, "--network", help="Network of the build containers.")
ReportOpt = typer.Option(Path("build/report.json"), "--report",
                         help="Where the JSON report goes; the Markdown summary is written next to it (.md).")
WorkDirOpt = typer.Option(Path("build"), "--work-dir", help="Rendered contexts and per-cell logs go here.")
TimeoutOpt = typer.Option(300.0, "--probe-timeout", min=1.0, help="Seconds the in-image probe may run.")
RetriesOpt = typer.Option(4, "--push-tries", min=1, help="Tries per tag when a push fails for a transient "
                                                         "reason (authentication errors are never retried).")
RetryDelayOpt = typer.Option(2.0, "--retry-delay", min=0.0, help="Seconds before the first retry; doubles each time.")


LiveOpt = typer.Option(None, "--live/--plain", help="Live display (default on a terminal) or plain lines.")


class Pull(str, Enum):
    always = "always"
    missing = "missing"
    never = "never"


PullOpt = typer.Option(Pull.missing, "--pull", help="Base images are resolved to a digest that is pinned in FROM: "
                                                    "always (from the registry, and re-pulled), missing (from the "
                                                    "registry, else the local copy), never (the local copy only).")
RetestOpt = typer.Option(False, "--retest", help="Probe every image, even one whose passing verdicts are "
                                                 "cached for this probe version, GPU and thread mode.")


def _options(work_dir, jobs, keep_going, gpus, network, probe_timeout, cache_from=(), *,
             pull: Pull = Pull.missing, retest: bool = False) -> build_mod.Options:
    return build_mod.Options(work_dir=work_dir, jobs=jobs, fail_fast=not keep_going, gpus=gpus.value,
                             network=network.value, probe_timeout=probe_timeout, cache_from=tuple(cache_from or ()),
                             pull=pull.value, retest=retest)


@app.command()
def build(
    matrix: Path = MatrixOpt,
    only: Optional[List[str]] = OnlyOpt,
    jobs: int = JobsOpt,
    keep_going: bool = KeepGoingOpt,
    gpus: Gpus = GpusOpt,
    network: Network = NetworkOpt,
    report: Path = ReportOpt,
    work_dir: Path = WorkDirOpt,
    probe_timeout: float = TimeoutOpt,
    live: Optional[bool] = LiveOpt,
    push: bool = typer.Option(False, "--push", help="Tag and push the cells that passed (see `imagefactory push`)."),
    atomic: bool = typer.Option(False, "--atomic", help="With --push: publish nothing unless every cell passed."),
    push_tries: int = RetriesOpt,
    retry_delay: float = RetryDelayOpt,
    cache_from: Optional[List[str]] = typer.Option(
        None, "--cache-from", help="A local image whose layers the builds may reuse, e.g. the previous "
                                   "release pulled from the registry (repeatable)."),
    pull: Pull = PullOpt,
    retest: bool = RetestOpt,
) -> None:
    """Build every cell through the Docker SDK, then smoke-test each image in a container.

    An image whose rendered context is unchanged is reused (reported as cached). Built images
    get a local candidate name (imagefactory-candidate/...); release tags are applied only by
    --push, and only to cells that passed. Full logs: WORK_DIR/logs/<cell>.log."""
    m, cells = _load(matrix, only)
    options = _options(work_dir, jobs, keep_going, gpus, network, probe_timeout, cache_from, pull=pull, retest=retest)
    if atomic and not push:
        raise ConfigError("--atomic: only meaningful with --push")
    publish_options = _publish_options(m, cells, atomic, push_tries, retry_delay) if push else None

    def steps(ui, interrupt: Interrupt) -> build_mod.Outcome:
        outcome = build_mod.build(m, cells, options, ui, interrupt=interrupt)
        if publish_options is not None:  # after an interrupt: marks every cell not published
            publish_mod.publish(m, outcome.reports, ui=ui, options=publish_options, interrupt=interrupt)
        return outcome

    _pipeline(work_dir, report, live, steps)


def _publish_options(m, cells, atomic: bool, tries: int, delay: float) -> publish_mod.Options:
    """Check everything publishing needs before anything is built: the credentials, the commit
    id, every tag of every cell."""
    publish_mod.registry_credentials(m)
    options = publish_mod.Options(atomic=atomic, git_sha=publish_mod.git_sha(), attempts=tries, backoff=delay)
    for cell in cells:
        publish_mod.tags_for(m, cell.id, "0" * 64, options)
    return options


@app.command()
def push(
    matrix: Path = MatrixOpt,
    only: Optional[List[str]] = OnlyOpt,
    atomic: bool = typer.Option(False, "--atomic", help="Publish nothing unless every selected cell passes."),
    gpus: Gpus = GpusOpt,
    report: Path = ReportOpt,
    work_dir: Path = WorkDirOpt,
    probe_timeout: float = TimeoutOpt,
    live: Optional[bool] = LiveOpt,
    push_tries: int = RetriesOpt,
    retry_delay: float = RetryDelayOpt,
) -> None:
    """Smoke-test the built images again, then tag and push those that pass.

    Tags: the release tag from the matrix (tags.template), an immutable tag with the content
    hash (tags.hash_template) and the optional date / git-sha tags (tags.extra). Credentials:
    IMAGEFACTORY_REGISTRY_USER and IMAGEFACTORY_REGISTRY_PASSWORD, else `docker login`'s config
    and credential helpers."""
    m, cells = _load(matrix, only)
    options = _options(work_dir, 1, True, gpus, Network.host, probe_timeout)
    publish_options = _publish_options(m, cells, atomic, push_tries, retry_delay)

    def steps(ui, interrupt: Interrupt) -> build_mod.Outcome:
        outcome = build_mod.test(m, cells, options, ui, interrupt=interrupt)
        publish_mod.publish(m, outcome.reports, ui=ui, options=publish_options, interrupt=interrupt)
        return outcome

    _pipeline(work_dir, report, live, steps)


@app.command("test")
def test_cmd(
    matrix: Path = MatrixOpt,
    only: Optional[List[str]] = OnlyOpt,
    jobs: int = JobsOpt,
    keep_going: bool = KeepGoingOpt,
    gpus: Gpus = GpusOpt,
    report: Path = ReportOpt,
    work_dir: Path = WorkDirOpt,
    probe_timeout: float = TimeoutOpt,
    live: Optional[bool] = LiveOpt,
    pull: Pull = PullOpt,
    retest: bool = RetestOpt,
) -> None:
    """Re-run the smoke tests on the images already built for the matrix's current content.

    An image that already passed this probe version (same GPU and thread mode) is reported
    with its cached verdicts; --retest probes it again."""
    m, cells = _load(matrix, only)
    options = _options(work_dir, jobs, keep_going, gpus, Network.host, probe_timeout, pull=pull, retest=retest)
    _pipeline(work_dir, report, live, lambda ui, interrupt: build_mod.test(m, cells, options, ui,
                                                                           interrupt=interrupt))


class DoctorFormat(str, Enum):
    text = "text"
    json = "json"


@app.command()
def doctor(
    matrix: Optional[Path] = typer.Option(None, "--matrix", "-m", help="The matrix file (default: matrix.yaml "
                                                                        "when it exists, else host facts only)."),
    format: DoctorFormat = typer.Option(DoctorFormat.text, "--format", "-f", help="text for people; json for scripts."),
) -> None:
    """Can this host run the matrix's images? Engine, NVIDIA runtime or CDI, driver and GPUs, then
    for each cell: runs here, runs with limits (CUDA minor-version compatibility) or cannot run,
    with the reason and the fix, and the release tag this node should pull.

    Exit codes: 0 every cell can run here; 1 some cannot; 2 bad matrix; 3 no Docker engine."""
    from imagefactory import doctor as doctor_mod

    path = doctor_mod.default_matrix(matrix)
    m = matrix_mod.load(path) if path is not None else None
    report = doctor_mod.diagnose(m)
    if format is DoctorFormat.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(doctor_mod.text(report), end="")
    raise typer.Exit(report.exit_code)


@app.command("bench")
def bench_cmd(
    matrix: Path = MatrixOpt,
    only: Optional[List[str]] = OnlyOpt,
    budget: float = typer.Option(50.0, "--budget", min=10.0, max=3600.0,
                                 help="Seconds of workload per image (both containers together)."),
    gpus: Gpus = typer.Option(Gpus.auto, "--gpus", help="Give CUDA cells' workloads GPUs: all, none, or auto "
                                                         "(all when the engine has the NVIDIA runtime)."),
    out: Path = typer.Option(Path("build/bench.json"), "--out", help="The JSON results; the Markdown table is "
                                                                      "written next to it (.md)."),
    work_dir: Path = WorkDirOpt,
) -> None:
    """Run a short workload in each built image and print side-by-side speed ratios: GEMM at 1 thread
    vs the image's threads; under --cpus 1, threads = host cores vs the CPU budget; DataLoader
    workers; torch.compile; on a GPU, AMP and GEMM TFLOP/s.

    Exit codes: 0 every image was measured (single figures may still have failed, see the table);
    1 a cell has no built image or its workload gave no results; 2 bad configuration; 3 no engine."""
    from imagefactory import bench as bench_mod

    m, cells = _load(matrix, only)
    results, host_cores = bench_mod.bench(m, cells, bench_mod.Options(work_dir=work_dir, budget=budget,
                                                                     gpus=gpus.value))
    json_path, md_path = bench_mod.write(results, out, host_cores=host_cores, budget=budget)
    for r in results:
        print(f"{r.cell}: {r.status}" + (f": {r.error}" if r.error else ""))
        for f in r.figures:
            print("  " + "  ".join(x for x in bench_mod.figure_line(f) if x))
    print(f"bench: {json_path} and {md_path}", file=sys.stderr)
    failed = [r.cell for r in results if r.status != bench_mod.MEASURED]
    if failed:
        raise CellFailure(f"{len(failed)} of {len(results)} cell(s) not measured: " + ", ".join(failed))


@app.command("lock")
def lock_cmd(
    packages: Optional[List[str]] = typer.Argument(None, metavar="PKG",
                                                   help="With --upgrade: only these packages may move."),
    matrix: Path = MatrixOpt,
    only: Optional[List[str]] = OnlyOpt,
    upgrade: bool = typer.Option(False, "--upgrade", help="Resolve again and move to the newest allowed "
                                                          "versions (all packages, or only PKG...)."),
    check: bool = typer.Option(False, "--check", help="Resolve nothing: exit 2 if a lock is stale or "
                                                      "malformed, 1 if a cell has none, 0 if all are current."),
) -> None:
    """Resolve every cell on this machine and write locks/<cell-id>.txt next to the matrix.

    Missing and stale locks are written; current ones are left alone unless --upgrade is given.
    Prints, per cell, the versions that changed. A cell with a lock is built from it: pip with
    --require-hashes --no-deps, conda from an @EXPLICIT file, without a solve."""
    m, cells = _load(matrix, only)
    if check:
        if upgrade or packages:
            raise ConfigError("--check: resolves nothing, so it cannot be combined with --upgrade or PKG")
        outcomes = lock_mod.check(m, cells)
        for o in outcomes:
            print(f"{o.cell}\t{o.status}\t{o.path}")
        lock_mod.check_exit(outcomes)
        return

    def progress(line: str) -> None:  # progress on stderr; the per-cell diff on stdout
        print(line, file=sys.stderr)

    options = lock_mod.Options(upgrade=upgrade, packages=tuple(packages or ()))
    for o in lock_mod.lock(m, cells, options, say=progress):
        print(f"{o.cell}: {o.status} {o.path}" + ("" if o.changes or o.status == "unchanged" else " (no version changed)"))
        for change in o.changes:
            print(f"    {change}")


@app.command()
def schema() -> None:
    """Print the JSON Schema of the matrix file (for editors and CI linting)."""
    print(json.dumps(matrix_mod.schema(), indent=2))


def main() -> None:
    try:
        app()
    except Interrupted as e:
        print(f"{e.message}: the report marks the cells that were stopped; the next run resumes "
              "(finished cells are cached)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.exit_code)  # do not wait for a worker still stuck in the engine
    except ConfigError as e:
        for line in e.problems:
            print(f"error: {line}", file=sys.stderr)
        sys.exit(e.exit_code)
    except ImageFactoryError as e:
        print(f"error: {e.message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except OSError as e:  # a path the user gave cannot be written or read
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
