"""What a lock costs or saves: a cold build of one pip cell from its lock against a cold build
of the same cell resolved in the image, measured side by side.

Both contexts are rendered from one matrix: one with the cell's lock (locks/<cell-id>.txt,
made with `imagefactory lock`), one without (the matrix read as if it had no locks/). Each
pair builds both with the layer cache off (`nocache`), in alternating order, so drift on a
shared machine hits both sides alike. Prints the median of each side and their ratio.

    python bench/lock.py [--matrix examples/matrix.yaml] [--cell ID] [--repeat 3]

(with this checkout installed, or PYTHONPATH=. from its root).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from imagefactory.lock import lockfile
from imagefactory.config import matrix
from imagefactory.render import contexts as render
from imagefactory.engine.api import BuildRequest, ContainerEngine
from imagefactory.engine.select import docker_engine
from imagefactory.errors import BuildError


def cold_build(engine: ContainerEngine, context: Path, tag: str) -> float:
    started = time.monotonic()
    try:
        engine.build(BuildRequest(str(context), tag, nocache=True))
    except BuildError as e:
        raise SystemExit(f"build of {context} failed: {e.message}") from None
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrix", type=Path, default=Path("examples/matrix.yaml"))
    ap.add_argument("--cell", help="a pip cell id (default: the first pip cell)")
    ap.add_argument("--repeat", type=int, default=3, help="pairs of cold builds")
    args = ap.parse_args()
    m = matrix.load(args.matrix)
    cell = next((c for c in m.cells if c.installer == "pip" and (args.cell in (None, c.id))), None)
    if cell is None:
        raise SystemExit(f"no pip cell {args.cell or ''} in {args.matrix}")
    if not lockfile.path_for(m, cell).is_file():
        raise SystemExit(f"no lock for {cell.id}: run `imagefactory lock --matrix {args.matrix} --only {cell.id}`")
    engine = docker_engine()
    times: dict[str, list[float]] = {"locked": [], "unlocked": []}
    with tempfile.TemporaryDirectory(prefix="bench-lock-") as tmp:
        root = Path(tmp)
        # Every path in a loaded matrix is absolute already; only the lock lookup reads m.path.
        no_locks = dataclasses.replace(m, path=root / "no-locks" / "matrix.yaml")
        contexts = {"locked": render.render(m, root / "locked", [cell])[0].path,
                    "unlocked": render.render(no_locks, root / "unlocked", [cell])[0].path}
        assert (contexts["locked"] / lockfile.CONTEXT_NAME).is_file()
        assert not (contexts["unlocked"] / lockfile.CONTEXT_NAME).exists()
        tags = []
        try:
            for i in range(args.repeat):
                order = ["locked", "unlocked"] if i % 2 == 0 else ["unlocked", "locked"]
                for side in order:
                    tag = f"imagefactory-bench/lock:{side}-{i}"
                    tags.append(tag)
                    times[side].append(cold_build(engine, contexts[side], tag))
                    print(f"  pair {i + 1}: {side:8s} {times[side][-1]:6.1f} s", file=sys.stderr)
        finally:
            for tag in tags:
                engine.remove_image(tag)
    locked, unlocked = statistics.median(times["locked"]), statistics.median(times["unlocked"])
    print(f"cell {cell.id}, cold builds (no layer cache), median of {args.repeat} interleaved pairs")
    print(f"  from the lock   {locked:7.1f} s   (pip install --require-hashes --no-deps, no resolver)")
    print(f"  without a lock  {unlocked:7.1f} s   (pip resolves in the image)")
    print(f"  ratio locked/unlocked {locked / unlocked:.2f}x")


if __name__ == "__main__":
    main()
