"""How fast does the CLI answer: `imagefactory --help` and `imagefactory list` against Python's own
start-up, and a no-op `build` against a cached `docker build` of the same rendered context.

Each figure is the median of interleaved pairs (A, B, A, B, ...), so a drifting, shared machine
hits both sides alike; it prints one Markdown table. No timing is asserted anywhere: the tests
check what these commands import instead (tests/unit/cli/test_imports.py).

    python bench/cli.py [--pairs 15] [--no-engine] [--build-pairs 3] [--wheelhouse DIR] [--profile FILE]

Figures:
- `imagefactory --help` vs `python -c pass` (the floor: the same interpreter, started and stopped).
- `imagefactory list` of a two-cell matrix that an earlier run validated (the schema step skipped
  by its cache, matrix.py) vs `python -c pass`; and the first `list` of new bytes (a fresh cache
  folder each run: the schema validated, jsonschema imported) vs `python -c pass`.
- with a Docker engine (unless --no-engine): a no-op `imagefactory build` of bench/factory.py's
  cell (built once first) vs `docker build -q` of its rendered context, fully cached, with the
  Docker CLI's default builder (BuildKit where buildx is installed). Without an engine the table
  says so and has the first rows only.
All commands run as `python -m imagefactory` from this checkout, with a cache folder of the bench's
(`--help` keeps no page there: typer prints it each run) and
their bytecode written once, by the warm-up runs, into the bench's folder (PYTHONPYCACHEPREFIX).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from factory import GOOD, TORCH, Row, pairs, say, timed  # noqa: E402

MATRIX = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11", "3.12"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
torch: "2.13.0"
threads: 2
"""


def engine_reachable() -> str | None:
    """Why no engine can be used, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI"
    try:
        r = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True,
                           timeout=10)
    except subprocess.TimeoutExpired:
        return "the engine did not answer in 10 s"
    return None if r.returncode == 0 else f"no engine reachable ({r.stderr.strip()[:120]})"


def cli_rows(root: Path, n: int) -> list[Row]:
    # .pyc files written (into the bench's folder, not the checkout) even where the caller's
    # environment says PYTHONDONTWRITEBYTECODE: an installed imagefactory has its bytecode, and a
    # run that compiles every module from source measures the compiler, not the CLI
    env = {"IMAGEFACTORY_CACHE_DIR": str(root / "cache"), "PYTHONPATH": str(REPO), "COLUMNS": "100",
           "PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(root / "pycache")}
    matrix = root / "matrix.yaml"
    matrix.write_text(MATRIX)
    py = [sys.executable]
    floor = py + ["-c", "pass"]
    imagefactory = py + ["-m", "imagefactory"]
    listing = imagefactory + ["list", "--matrix", str(matrix)]
    timed(listing, env)  # validated once: its key is in the bench's cache folder now
    for warm in (floor, imagefactory + ["--help"]):  # the files in the page cache, the .pyc written
        timed(warm, env)
    fresh = iter(range(10**6))

    def first_list() -> float:  # a new cache folder each run: these bytes were never validated there
        return timed(listing, {**env, "IMAGEFACTORY_CACHE_DIR": str(root / f"fresh-{next(fresh)}")})

    say("--help vs python -c pass")
    a, b = pairs(n, lambda: timed(imagefactory + ["--help"], env), lambda: timed(floor, env))
    rows = [Row("`imagefactory --help`", "`imagefactory --help`", "`python -c pass`", a, b, "≤ 0.15 s absolute",
                note="B is the floor: the interpreter's own start-up")]
    say("list (validated before) vs python -c pass")
    a, b = pairs(n, lambda: timed(listing, env), lambda: timed(floor, env))
    rows.append(Row("`imagefactory list`, matrix validated before", "`imagefactory list`", "`python -c pass`", a, b,
                    "≤ 0.15 s absolute", note="two cells; the schema step skipped by its cache"))
    say("first list of new bytes vs python -c pass")
    a, b = pairs(max(3, n // 3), first_list, lambda: timed(floor, env))
    rows.append(Row("`imagefactory list`, first run of these bytes", "`imagefactory list` (schema validated)",
                    "`python -c pass`", a, b, "information",
                    note="a fresh cache folder each run: jsonschema imported and run"))
    return rows


def build_row(root: Path, n: int, wheelhouse: Path, profile: Path | None = None) -> Row:
    from factory import Bench

    from imagefactory.engine.docker import Engine

    if not list(wheelhouse.glob(f"torch-{TORCH}+cpu-*.whl")):
        raise SystemExit(f"no torch-{TORCH}+cpu wheel in {wheelhouse}: pip download --no-deps -d {wheelhouse} "
                         f"torch=={TORCH}+cpu (or --no-engine)")
    (root / "engine").mkdir()
    bench = Bench(root / "engine", wheelhouse.resolve(), Engine())
    try:
        bench.new_base()
        bench.cli("build")  # built and probed once; every later run is a no-op
        bench.report()  # its image is the bench's now: cleanup removes it, whatever fails next
        context = str(bench.root / "work" / "contexts" / GOOD)
        # --network host as imagefactory's builds: BuildKit keys a RUN step's cache by its network
        # too (and this engine has no default bridge), so without it nothing would be a cache hit
        docker = ["docker", "build", "-q", "--network", "host", context]
        r = subprocess.run(docker, capture_output=True, text=True)  # cached from here on
        if r.returncode != 0:
            raise SystemExit(f"failed ({r.returncode}): {' '.join(docker)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        if r.stdout.strip():  # the Docker CLI's builder (BuildKit) makes its own image of the context: removed with the rest
            bench.images.append(r.stdout.strip())
        say("no-op build vs cached docker build")
        a, b = pairs(n, lambda: bench.cli("build"), lambda: timed(docker))
        if bench.report()[GOOD]["cached"] is not True:
            raise SystemExit("the no-op build built something")
        if profile is not None:  # one more no-op build, under cProfile (not timed)
            bench.cli("build", python=("-m", "cProfile", "-o", str(profile.resolve())))
        return Row("no-op `build`, 1 cell", "`imagefactory build`", "`docker build -q` (cached, the CLI's default "
                   "builder)", a, b, "≤ 1.0x", note="the same rendered context")
    finally:
        bench.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=15, help="interleaved pairs per start-up figure (default 15)")
    ap.add_argument("--build-pairs", type=int, default=3, help="pairs of the no-op build figure (default 3)")
    ap.add_argument("--no-engine", action="store_true", help="leave out the engine row even if an engine answers")
    ap.add_argument("--profile", type=Path, help="also write a cProfile of one more no-op build to this file")
    ap.add_argument("--wheelhouse", type=Path,
                    default=Path(os.environ.get("IMAGEFACTORY_CI_CACHE", Path.home() / ".cache/imagefactory-ci"))
                    / "wheels")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="imagefactory-bench-cli-"))
    why = "left out (--no-engine)" if args.no_engine else engine_reachable()
    try:
        rows = cli_rows(root, args.pairs)
        if why is None:
            rows.append(build_row(root, args.build_pairs, args.wheelhouse, args.profile))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; `python bench/cli.py --pairs {args.pairs}"
          f"{' --no-engine' if args.no_engine else ''}`\n")
    print("| figure | A | B | A/B (median) | goal | runs |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(row.line())
    if why is not None:
        print(f"\nno-op `build` vs cached `docker build`: not measured: {why}")


if __name__ == "__main__":
    main()
