"""Why imagefactory bakes thread limits: oversubscription under a CPU quota, measured.

Runs one built image twice, side by side in one run, under `--cpus QUOTA`:
once with the thread variables at the host's core count (what a library picks
when nothing is set, since a CFS quota is invisible to os.cpu_count()), once at
the quota. Prints GFLOP/s of a float32 matmul in NumPy and torch, and their ratio.

    python bench/threads.py IMAGE [--cpus 1] [--size 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json

from imagefactory.engine.api import ContainerEngine
from imagefactory.engine.select import docker_engine

TIMEOUT = 600.0  # seconds one workload container may run

WORKLOAD = r"""
import json, time, numpy as np
out = {}
a = np.random.default_rng(0).standard_normal((N, N), dtype=np.float32)
def rate(f):
    f(); best = 1e9
    for _ in range(7):
        t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
    return 2 * N ** 3 / best / 1e9
out["numpy"] = rate(lambda: a @ a)
try:
    import torch
    t = torch.from_numpy(a)
    out["torch"] = rate(lambda: t @ t)
except ImportError:
    pass
print(json.dumps(out))
"""


def run(engine: ContainerEngine, image: str, cpus: float, threads: int, size: int) -> dict[str, float]:
    env = {k: str(threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    code = WORKLOAD.replace("N, N", f"{size}, {size}").replace("N ** 3", f"{size} ** 3")
    result = engine.run(image, ["python", "-c", code], timeout=TIMEOUT, environment=env, cpus=cpus)
    if result.exit_code != 0:
        raise SystemExit(f"workload in {image} failed (exit {result.exit_code}): {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("image")
    ap.add_argument("--cpus", type=float, default=1.0)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    engine = docker_engine()
    host = engine.describe().cpus or 1  # the engine host's cores: what an unlimited library would pick
    limited = max(1, int(args.cpus))
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.repeat):  # interleaved, so drift on a shared machine hits both sides alike
        over = run(engine, args.image, args.cpus, host, args.size)
        fit = run(engine, args.image, args.cpus, limited, args.size)
        for lib in over:
            rows.setdefault(lib, []).append((over[lib], fit[lib]))
    print(f"image {args.image}, --cpus {args.cpus}, {args.size}x{args.size} float32 matmul, "
          f"threads {host} (host cores) vs {limited} (quota), best of 7, median of {args.repeat} pairs")
    for lib, pairs in rows.items():
        pairs.sort(key=lambda p: p[1] / p[0])
        o, f = pairs[len(pairs) // 2]
        print(f"  {lib:6s} {o:8.1f} GFLOP/s at {host} threads   {f:8.1f} GFLOP/s at {limited}   "
              f"ratio {f / o:.2f}x")


if __name__ == "__main__":
    main()
