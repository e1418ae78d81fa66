"""The command line. Each command is a thin shell over one pipeline step: its options parsed by
options.py, checked by preflight.py, then the step run here."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional

import typer

from imagefactory.cli.options import Invocation, _finite, select, shared
from imagefactory.cli.preflight import engine_environment as _engine_environment
from imagefactory.run import context
from imagefactory.files import bounded
from imagefactory.engine import environment
from imagefactory import terminal
from imagefactory.files import yamlfile
from imagefactory.run.context import BenchOptions, Builders, Publishing, Reporting, RunContext, Workspace
from imagefactory.run.context import need, or_defaults
from imagefactory.errors import Cancelled, CellFailure, ConfigError, DockerUnavailable, ImageFactoryError, Interrupted
from imagefactory.interrupt import Interrupt

if TYPE_CHECKING:
    from imagefactory.pipeline import build as build_mod
    from imagefactory.config import matrix as matrix_mod  # imported by the commands that read a matrix, not by --help
    from imagefactory.engine.api import ContainerEngine
    from imagefactory.config.model import Cell
    from imagefactory.run.results import CellReport, ListReport

# Each command imports the pipeline steps it runs (build, render, publish, lock, the engine, Jinja2,
# tenacity) when it runs: `imagefactory --help` and `imagefactory list` import none of them, and
# answer at once (docs/performance.md#the-cli-itself-benchclipy, tests/unit/cli/test_imports.py).

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
    epilog="Example: imagefactory list --matrix examples/matrix.yaml",
    context_settings={"max_content_width": 100},
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# What `imagefactory` alone prints (exit 0): the three commands of a first run, in their order
# (see the cells, review the Dockerfiles, build and test), then where the rest is.
FIRST_STEPS = """\
imagefactory: one matrix file in; tested, tagged Docker images out. First steps:

  imagefactory list   --matrix matrix.yaml        the cells: id, torch, base image, release tag
  imagefactory render --matrix matrix.yaml        one build context (Dockerfile) per cell, to review
  imagefactory build  --matrix matrix.yaml        build and smoke-test every cell (--push publishes)

All commands: imagefactory --help. One command: imagefactory COMMAND --help.
"""


@app.callback(invoke_without_command=True)
def _first_steps(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand is None:
        print(FIRST_STEPS, end="")


def example(line: str) -> str:
    """A command's epilog: the one example line every `--help` ends with (tests/unit/cli/test_app.py)."""
    return f"Example: {line}"


class ListFormat(str, Enum):
    table = "table"
    json = "json"
    github = "github"


def _cell_row(c: Cell) -> dict:
    return {
        "id": c.id, "python": c.python, "cuda": c.cuda or "none", "blas": c.blas,
        "installer": c.installer, "variant": c.variant, "torch": c.torch, "threads": c.threads,
        "base_image": c.base_image, "tag": c.tags[0] if c.tags else "", "platform": c.platform.oci,
    }


@app.command("list", epilog=example("imagefactory list --matrix matrix.yaml --format github"))
@shared("matrix", "only")
def list_cells(
    inv: Invocation,
    format: ListFormat = typer.Option(ListFormat.table, "--format", "-f",
                                      help="table for people; json for scripts; github for a job matrix "
                                           "(`fromJSON` of {\"include\": [...]})."),
) -> None:
    """Show the expanded cells: id, base image, release tag, platform and key settings."""
    rows = [_cell_row(c) for c in inv.cells]
    if format is ListFormat.json:
        print(json.dumps(rows, indent=2))
    elif format is ListFormat.github:
        print(json.dumps({"include": [{"cell": r["id"], **r} for r in rows]}, separators=(",", ":")))
    else:
        print(table([list(TABLE_COLUMNS), *([str(r[c]) for c in TABLE_COLUMNS] for r in rows)]), end="")


TABLE_COLUMNS = ("id", "torch", "threads", "base_image", "tag", "platform")  # platform last: the rest stay put


def table(lines: list[list[str]]) -> str:
    """`list`'s table: the first line the header, each column as wide as its widest value, one space
    either side (what rich's Table(box=None) prints, without importing rich: 60 ms of `list`)."""
    widths = [max(len(v) for v in column) for column in zip(*lines)]
    return "".join("".join(f" {v.ljust(w)} " for v, w in zip(line, widths)) + "\n" for line in lines)


@app.command(epilog=example("imagefactory render --matrix matrix.yaml --out build/contexts"))
@shared("matrix", "only")
def render(
    inv: Invocation,
    out: Path = typer.Option(Path("build/contexts"), "--out", "-o", help="Folder for the build contexts."),
) -> None:
    """Write one build context per cell to OUT/<cell-id>/ (Dockerfile and every file it copies).

    Same matrix in, same bytes out; nothing is written unless every cell renders."""
    from imagefactory.render import contexts as contexts_mod

    bounded.check_output(out, "--out", folder=True, keep=(inv.matrix.path,))
    interrupt = Interrupt()
    try:
        with interrupt.signals():
            contexts = contexts_mod.render(inv.matrix, out, inv.cells, interrupt=interrupt)
    except Cancelled:
        print("interrupted: render wrote nothing", file=sys.stderr)
        raise typer.Exit(128 + (interrupt.signum or signal.SIGINT)) from None
    for ctx in contexts:
        print(f"{ctx.cell.id}\t{ctx.path}\t{ctx.content_hash[:12]}")


def _finish(outcome: build_mod.Outcome, report_path: Path, interrupt: Interrupt) -> None:
    from imagefactory.report import summary as summary_mod

    reports = outcome.reports
    json_path, md_path = summary_mod.write(reports, report_path, gpus=outcome.gpus, lists=outcome.lists)
    failed = [r for r in reports if not r.ok]
    lists = [lr.ref for lr in outcome.lists if not lr.ok]  # a list that failed to merge (publish/lists.py)
    print(f"report: {json_path} and {md_path}", file=sys.stderr)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(Counter(
        r.status + (f"/{r.publish}" if r.publish else "") for r in reports).items()))
    print(f"{len(reports)} cell(s): {counts}", file=sys.stderr)
    if interrupt.signum is not None:
        raise Interrupted(interrupt.signum)
    if outcome.engine_gone:
        raise DockerUnavailable(outcome.engine_gone)
    if failed or lists:
        why = [f"{len(failed)} of {len(reports)} cell(s) failed: " + ", ".join(r.cell for r in failed)] if failed else []
        raise CellFailure("; ".join(why + ([f"list(s) not published: {', '.join(lists)}"] if lists else [])))


@contextmanager
def _run(inv: Invocation, output: Path) -> Iterator[RunContext]:
    """The run context of an engine-driving command: the work dir and `output` locked (a second
    run on either stops at once), the engine reached, the settings printed, SIGINT/SIGTERM
    turned into the run's cancellation while the block runs."""
    from imagefactory.files import fsutil
    from imagefactory.engine import select as select_mod
    from imagefactory.pipeline import progress as progress_mod

    interrupt = Interrupt()
    _engine_environment()
    # merge and bench have no flag for some of these: the groups' defaults (build/, the classic builder)
    work_dir = or_defaults(inv.options, Workspace).work_dir
    builders = or_defaults(inv.options, Builders)
    with fsutil.locked(work_dir, output):
        factory = select_mod.docker_factory(interrupt, builder=builders.builder,
                                             buildx_builder=builders.buildx_builder)
        first: list[ContainerEngine] = [factory()]  # DockerUnavailable before anything is printed

        def engines() -> ContainerEngine:
            return first.pop() if first else factory()

        print(inv.said(), file=sys.stderr)  # the builder choice too, only once an engine answered
        with progress_mod.make(inv.live) as ui, interrupt.signals():
            yield RunContext(inv.options, ui, interrupt, engines)


def _pipeline(inv: Invocation, steps: Callable[[RunContext], build_mod.Outcome]) -> None:
    """Run `steps` in the run context; the report is written however they end (passed,
    failed, interrupted)."""
    report = need(inv.options, Reporting).report
    with _run(inv, report) as run:
        outcome = steps(run)
    _finish(outcome, report, run.interrupt)


BUILD_FLAGS = ("matrix", "only", "jobs", "keep_going", "gpus", "network", "report", "work_dir", "probe_timeout",
               "live", "push", "atomic", "push_tries", "retry_delay", "cache_from", "registry_cache", "pull", "retest",
               "probe_shm", "builder", "buildx_builder", "netrc", "sign")


@app.command(epilog=example("imagefactory build --matrix matrix.yaml -j 2 --push"))
@shared(*BUILD_FLAGS)
def build(inv: Invocation) -> None:
    """Build every cell, then smoke-test each image in a container; an unchanged cell is cached.

    Release tags only with --push, on the cells that passed. Logs: WORK_DIR/logs/<cell>.log;
    every option explained: docs/builders.md#build-options."""

    from imagefactory.pipeline import build as build_mod

    def steps(run: RunContext) -> build_mod.Outcome:
        outcome = build_mod.build(inv.matrix, inv.cells, run)
        if run.settings(Publishing).push:  # after an interrupt: marks every cell not published
            outcome = build_mod.publish_step(inv.matrix, outcome, run)  # a build that pushes nothing loads no publish code
        return outcome

    _pipeline(inv, steps)


@app.command(epilog=example("imagefactory push --matrix matrix.yaml --atomic"))
@shared("matrix", "only", "atomic", "gpus", "report", "work_dir", "probe_timeout", "live", "push_tries",
        "retry_delay", "builder", "sign", push=True)
def push(inv: Invocation) -> None:
    """Smoke-test the built images again, then tag and push those that pass.

    Tags: the release tag from the matrix (tags.template), an immutable tag with the content
    hash (tags.hash_template) and the optional date / git-sha tags (tags.extra). Credentials:
    IMAGEFACTORY_REGISTRY_USER and IMAGEFACTORY_REGISTRY_PASSWORD, else `docker login`'s config
    and credential helpers."""

    from imagefactory.pipeline import build as build_mod

    def steps(run: RunContext) -> build_mod.Outcome:
        return build_mod.publish_step(inv.matrix, build_mod.test(inv.matrix, inv.cells, run), run)

    _pipeline(inv, steps)


@app.command("merge", epilog=example("imagefactory merge --matrix matrix.yaml --reports reports/ "
                                     "--report build/report-merge.json"))
@shared("matrix", "report", "live", "push_tries", "retry_delay", push=True)
def merge_cmd(
    inv: Invocation,
    reports: List[Path] = typer.Option(..., "--reports", metavar="PATH",
                                       help="A cell job's report.json, or a folder of them (repeatable)."),
) -> None:
    """Publish the matrix's lists from the reports of per-cell jobs (`build --only CELL --push`).

    A list is merged only when, for every platform it declares, one report shows its cell passed
    and pushed the per-arch tag this matrix plans (a digest, the same under its content-hash tag);
    otherwise it is refused in one line naming the cell. Exit codes: 0 every list published; 1 a
    list refused or not merged; 2 bad configuration or an unreadable report; 3 no Docker engine."""
    from imagefactory.publish import merge as merge_mod

    found = merge_mod.load(inv.matrix, reports)  # every report checked before the registry is asked
    report = need(inv.options, Reporting).report
    with _run(inv, report) as run:
        lists = merge_mod.merge(inv.matrix, found, run)
    _merged(merge_mod.members(found), lists, report, run.interrupt)


def _merged(cells: list[CellReport], lists: list[ListReport], report_path: Path, interrupt: Interrupt) -> None:
    """`merge`'s report (the member cells as read, and the lists), a line per list, its exit."""
    from imagefactory.report import summary as summary_mod

    json_path, md_path = summary_mod.write(cells, report_path, gpus=False, lists=lists)
    for lr in lists:
        print(f"{lr.ref}\t{lr.publish}\t{lr.digest if lr.publish == 'published' else lr.reason}")
    print(f"report: {json_path} and {md_path}", file=sys.stderr)
    if interrupt.signum is not None:
        raise Interrupted(interrupt.signum, "the report says which lists were published")
    unpublished = [lr.ref for lr in lists if lr.publish != "published"]
    if unpublished:
        raise CellFailure(f"{len(unpublished)} of {len(lists)} list(s) not published: {', '.join(unpublished)}")
    if not lists:
        print("merge: the matrix has no lists (no release tag is shared by cells of several platforms)",
              file=sys.stderr)


@app.command("test", epilog=example("imagefactory test --only py3.11-cpu-openblas-pip --retest"))
@shared("matrix", "only", "jobs", "keep_going", "gpus", "report", "work_dir", "probe_timeout", "live", "pull",
        "retest", "probe_shm", "builder")
def test_cmd(inv: Invocation) -> None:
    """Re-run the smoke tests on the images already built for the matrix's current content.

    An image that already passed this probe version (same GPU and thread mode) is reported
    with its cached verdicts; --retest probes it again."""
    from imagefactory.pipeline import build as build_mod

    _pipeline(inv, lambda run: build_mod.test(inv.matrix, inv.cells, run))


class DoctorFormat(str, Enum):
    text = "text"
    json = "json"


@app.command(epilog=example("imagefactory doctor --matrix matrix.yaml --format json"))
def doctor(
    matrix: Optional[Path] = typer.Option(None, "--matrix", "-m", help="The matrix file (default: matrix.yaml "
                                                                        "when it exists, else host facts only)."),
    format: DoctorFormat = typer.Option(DoctorFormat.text, "--format", "-f", help="text for people; json for scripts."),
    verify_key: Optional[str] = typer.Option(None, "--verify", metavar="KEY",
                                             help="Also verify each cell's release tags against this cosign public "
                                                  "key (signature, SBOM, provenance; see `imagefactory verify`)."),
) -> None:
    """Can this host run the matrix's images? Engine, NVIDIA runtime or CDI, driver and GPUs, then
    for each cell: runs here, runs with limits (CUDA minor-version compatibility) or cannot run,
    with the reason and the fix, and the release tag this node should pull.

    Exit codes: 0 every cell can run here; 1 some cannot; 2 bad matrix; 3 no Docker engine."""
    from imagefactory.tools import doctor as doctor_mod
    from imagefactory.config import matrix as matrix_mod

    path = doctor_mod.default_matrix(matrix)
    m = matrix_mod.load(path) if path is not None else None
    environment.docker_host()
    environment.check_docker_config()
    report = doctor_mod.diagnose(m)
    if verify_key is not None:
        report.verification = _verified(m, verify_key, flag="--verify")
    if format is DoctorFormat.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(doctor_mod.text(report), end="")
    raise typer.Exit(report.exit_code)


def _verified(m: matrix_mod.Matrix | None, key_ref: str, *, flag: str, only: Optional[List[str]] = None,
              image: str | None = None) -> list[dict]:
    """verify.py's verdicts for one image or the selected cells' release tags."""
    from imagefactory.attest import signing
    from imagefactory.attest import verify as verify_mod

    key = signing.ready(key_ref, private=False, flag=flag)
    if image is not None:
        targets = verify_mod.one_target(image)
    elif m is None:
        raise ConfigError(f"{flag}: no matrix (give --matrix, or run where matrix.yaml is)")
    else:
        targets = verify_mod.matrix_targets(m, select(m, only))
    return [v.as_dict() for v in verify_mod.verify_refs(targets, key)]


@app.command("verify", epilog=example("imagefactory verify registry.example.com/ml/train:TAG --key cosign.pub"))
def verify_cmd(
    image: Optional[str] = typer.Argument(None, metavar="[IMAGE]", help="One image reference (default: the "
                                                                          "matrix's release tags)."),
    key: str = typer.Option(..., "--key", metavar="KEY", help="The cosign public key (a file or a KMS URI)."),
    matrix: Path = typer.Option(Path("matrix.yaml"), "--matrix", "-m", help="The matrix file."),
    only: Optional[List[str]] = typer.Option(None, "--only", help="Only this cell id (repeatable)."),
) -> None:
    """Check, offline, that each image carries a signature made with KEY, a CycloneDX SBOM and a SLSA
    provenance attestation signed with it, and that both name the image's own content hash.

    One line per image. Exit codes: 0 every image verified; 1 one failed (no signature, another
    key, an SBOM for another image, a tampered attestation); 2 bad configuration."""
    from imagefactory.attest import verify as verify_mod
    from imagefactory.config import matrix as matrix_mod

    if image is not None and only:
        raise ConfigError("--only: selects cells of the matrix; not with an IMAGE reference")
    m = matrix_mod.load(matrix) if image is None else None
    results = _verified(m, key, flag="--key", only=only, image=image)
    for r in results:
        print(terminal.escaped(r["line"]))
    failed = [r for r in results if not r["ok"]]
    if failed or not results:
        raise verify_mod.VerifyFailed(f"{len(failed)} of {len(results)} image(s) failed verification"
                                      if results else "no image to verify (the cells have no release tags)")


@app.command("bench", epilog=example("imagefactory bench --only py3.11-cpu-openblas-pip --budget 400"))
@shared("matrix", "only", "gpus", "work_dir", "live")
def bench_cmd(
    inv: Invocation,
    budget: float = typer.Option(context.DEFAULT_BENCH_BUDGET, "--budget", min=10.0, max=3600.0, callback=_finite,
                                 help="Seconds of workload per image (both containers together)."),
    out: Path = typer.Option(Path("build/bench.json"), "--out", help="The JSON results; the Markdown table is "
                                                                      "written next to it (.md)."),
) -> None:
    """Run a short workload in each built image and print side-by-side speed ratios: GEMM at 1 thread
    vs the image's threads; under --cpus 1, threads = host cores vs the CPU budget; DataLoader
    workers; torch.compile; on a GPU, AMP and GEMM TFLOP/s.

    Exit codes: 0 every image was measured (single figures may still have failed, see the table);
    1 a cell has no built image or its workload gave no results; 2 bad configuration; 3 no engine;
    130 / 143 interrupted (the results measured so far are still written)."""
    from imagefactory.tools import bench as bench_mod

    for path in (out, out.with_suffix(".md")):
        bounded.check_output(path, "--out", folder=False, keep=(inv.matrix.path,))
    inv = dataclasses.replace(inv, options=dataclasses.replace(need(inv.options, BenchOptions), budget=budget),
                              fields=(*inv.fields, "budget"))
    with _run(inv, out) as run:
        results, host_cores = bench_mod.bench(inv.matrix, inv.cells, run)
    json_path, md_path = bench_mod.write(results, out, host_cores=host_cores, budget=budget)
    for r in results:
        print(f"{r.cell}: {r.status}" + (f": {r.error}" if r.error else ""))
        for f in r.figures:
            print("  " + "  ".join(x for x in bench_mod.figure_line(f) if x))
    print(f"bench: {json_path} and {md_path}", file=sys.stderr)
    if run.interrupt.signum is not None:
        raise Interrupted(run.interrupt.signum)
    failed = [r.cell for r in results if r.status != bench_mod.MEASURED]
    if failed:
        raise CellFailure(f"{len(failed)} of {len(results)} cell(s) not measured: " + ", ".join(failed))


@app.command("lock", epilog=example("imagefactory lock --matrix matrix.yaml --upgrade numpy"))
@shared("matrix", "only")
def lock_cmd(
    inv: Invocation,
    packages: Optional[List[str]] = typer.Argument(None, metavar="PKG",
                                                   help="With --upgrade: only these packages may move."),
    upgrade: bool = typer.Option(False, "--upgrade", help="Resolve again and move to the newest allowed "
                                                          "versions (all packages, or only PKG...)."),
    check: bool = typer.Option(False, "--check", help="Resolve nothing: exit 2 if a lock is stale or "
                                                      "malformed, 1 if a cell has none, 0 if all are current."),
    netrc: Optional[Path] = typer.Option(None, "--netrc", metavar="PATH",
                                         help="Logins for the conda channels the solve reads (default: $NETRC, "
                                              "then ~/.netrc). pip cells: pip reads its own netrc."),
) -> None:
    """Resolve every cell on this machine and write locks/<cell-id>.txt next to the matrix.

    Missing and stale locks are written; current ones are left alone unless --upgrade is given.
    Prints, per cell, the versions that changed. A cell with a lock is built from it: pip with
    --require-hashes --no-deps, conda from an @EXPLICIT file, without a solve. A second `lock`
    of the same matrix stops at once (exit 2); SIGINT/SIGTERM stop the resolver and write no
    lock (exit 130 / 143)."""
    from imagefactory.files import fsutil
    from imagefactory.lock import resolve as resolve_mod

    m, cells = inv.matrix, inv.cells
    if check:
        if upgrade or packages:
            raise ConfigError("--check: resolves nothing, so it cannot be combined with --upgrade or PKG")
        outcomes = resolve_mod.check(m, cells)
        for o in outcomes:
            print(f"{o.cell}\t{o.status}\t{terminal.printable(str(o.path))}")  # a path may hold escapes
        resolve_mod.check_exit(outcomes)
        return

    def progress(line: str) -> None:  # progress on stderr; the per-cell diff on stdout
        print(line, file=sys.stderr)

    from imagefactory.config import netrc as netrc_mod

    found = netrc_mod.locate(netrc)  # the conda solve's logins, checked as a build's netrc is
    options = resolve_mod.Options(upgrade=upgrade, packages=tuple(packages or ()), netrc=found.path if found else None)
    interrupt = Interrupt()
    try:  # two `lock` runs on one matrix would write the same locks: the second stops at once
        with fsutil.exclusive(m.path, f"--matrix {m.path}", own_file=False, hint="lock another matrix"), \
                interrupt.raising():
            outcomes = resolve_mod.lock(m, cells, options, say=progress)
    except Cancelled:
        raise Interrupted(interrupt.signum or signal.SIGINT, "no lock was written") from None
    for o in outcomes:
        print(f"{o.cell}: {o.status} {o.path}" + ("" if o.changes or o.status == "unchanged" else " (no version changed)"))
        for change in o.changes:
            print(f"    {change}")


@app.command(epilog=example("imagefactory schema > matrix.schema.json"))
def schema() -> None:
    """Print the JSON Schema of the matrix file (for editors and CI linting)."""
    from imagefactory.config import matrix as matrix_mod

    print(json.dumps(matrix_mod.schema(), indent=2))


@app.command("report", epilog=example("imagefactory report --html --report build/report.json"))
def report_cmd(
    html: bool = typer.Option(False, "--html", help="Write the image catalogue (report.html) beside the report."),
    report: Path = typer.Option(Path("build/report.json"), "--report", help="The report.json of an earlier "
                                                                           "build, test or push."),
) -> None:
    """Read an existing report.json: print its Markdown summary, or with --html write the image
    catalogue (one self-contained page: the matrix grid, pull commands, launch lines) beside it.

    Exit codes: 0 written; 2 the file is not a readable report."""
    from imagefactory.report import catalog
    from imagefactory.report import summary as summary_mod

    reports = catalog.read_report(report)
    if html:
        print(f"catalogue: {catalog.write(reports, report)}", file=sys.stderr)
    else:
        print(summary_mod.summary(reports), end="")


def _error(text: str) -> None:
    """An error line on stderr, every control character escaped: messages carry paths, URLs and
    engine answers, and none of them may drive the terminal."""
    print(terminal.escaped(text), file=sys.stderr)


@contextmanager
def _escaped_output() -> Iterator[None]:
    """Every line the CLI prints, whoever prints it (a command, a warning, the plain progress
    lines), goes through terminal.EscapingStream: paths, URLs, DOCKER_HOST and engine answers can
    hold terminal escapes, and none of them may reach the terminal raw."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = terminal.EscapingStream(saved[0]), terminal.EscapingStream(saved[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def main() -> None:
    with _escaped_output():
        _main()


def _main() -> None:
    try:
        app()
    except Interrupted as e:
        _error(f"{e.message}: {e.note}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.exit_code)  # do not wait for a worker still stuck in the engine
    except ConfigError as e:
        for line in yamlfile.capped(e.problems):  # thousands of problems are 20 lines and a count
            _error(f"error: {line}")
        sys.exit(e.exit_code)
    except ImageFactoryError as e:
        _error(f"error: {e.message}")
        sys.exit(e.exit_code)
    except OSError as e:  # a path the user gave cannot be written or read
        _error(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "))
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
