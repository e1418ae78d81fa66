"""Benchmark workload, run INSIDE a built image (`python -c "<this text>" ARGS`) or natively
(`python workload.py [--budget S] [--sections gemm,dataloader,compile,gpu,oversub]`).

Standalone on purpose: standard library plus numpy and torch; it must not import
imagefactory. Each figure compares two settings side by side in this one
container and keeps both absolute values. Every measurement runs in its own child
process with its own timeout, so a crash, a hang or a missing compiler costs one
figure (recorded as its "error"), never the run. Exactly one JSON document is
printed, on one line, on stdout.

Sections and their figures (baseline -> candidate; "speedup" > 1 means the candidate wins):
  gemm        float32 GEMM GFLOP/s, NumPy and torch: 1 thread -> the image's threads
  oversub     the same GEMM: threads = host cores -> the CPU budget (meant to run under --cpus 1)
  dataloader  samples/s with a CPU-heavy transform: num_workers=0 -> 2 (pin_memory on a GPU)
  compile     small MLP training step, ms: eager -> torch.compile, on CPU
  gpu         conv net step ms: fp32 -> AMP (autocast + GradScaler); GEMM TFLOP/s: fp32 -> bf16
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

WORKLOAD_VERSION = 1
SECTIONS = ("gemm", "oversub", "dataloader", "compile", "gpu")
SHARE = {"gemm": 0.25, "oversub": 1.0, "dataloader": 0.25, "compile": 0.35, "gpu": 0.15}
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _read(path):
    with open(path) as f:
        return f.read().strip()


def cgroup_quota():
    """CPUs allowed by a CFS quota (docker --cpus), or None when unlimited/unknown."""
    try:  # cgroup v2: "max 100000" or "150000 100000"
        quota, period = _read("/sys/fs/cgroup/cpu.max").split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for d in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):  # cgroup v1
        try:
            quota, period = int(_read(d + "/cpu.cfs_quota_us")), int(_read(d + "/cpu.cfs_period_us"))
            return None if quota <= 0 else quota / period
        except (OSError, ValueError):
            continue
    return None


def cpu_budget():
    """The CPUs this process may really use: min(affinity, floor(quota)), at least 1."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    quota = cgroup_quota()
    limits = [affinity] + ([int(math.floor(quota))] if quota is not None else [])
    return {"os_cpu_count": os.cpu_count(), "affinity": affinity, "cgroup_quota": quota,
            "auto": max(1, min(limits))}


# -- child programs: each prints one JSON line --------------------------------------------------------

GEMM = r"""
import json, sys, time
lib, size, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if lib == "numpy":
    import numpy as np
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((size, size), dtype=np.float32)
    f = lambda: a @ b
    threads = None
    try:
        import threadpoolctl
        threads = max([e["num_threads"] for e in threadpoolctl.threadpool_info() if e["user_api"] == "blas"] or [0]) or None
    except Exception:
        pass
else:
    import torch
    a, b = torch.randn(size, size), torch.randn(size, size)
    f = lambda: a @ b
    threads = torch.get_num_threads()
f()
best, n, start = float("inf"), 0, time.perf_counter()
while n < 3 or (time.perf_counter() - start < seconds and n < 200):
    t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t); n += 1
print(json.dumps({"value": 2 * size ** 3 / best / 1e9, "threads": threads, "repeats": n}))
"""

DATALOADER = r"""
import json, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
workers, seconds, pin = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"

class Synthetic(Dataset):
    def __len__(self):
        return 1 << 20
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(3, 64, 64, generator=g)
        for _ in range(4):  # a CPU-heavy augmentation: blur, normalise, nonlinearity
            x = torch.nn.functional.avg_pool2d(x.unsqueeze(0), 3, 1, 1).squeeze(0)
            x = (x - x.mean()) / (x.std() + 1e-5)
            x = torch.tanh(x) * 1.5
        return x, i % 10

kwargs = {"num_workers": workers, "batch_size": 32, "pin_memory": pin}
if workers:
    import multiprocessing as mp
    kwargs["multiprocessing_context"] = mp.get_context("fork")
    kwargs["persistent_workers"] = False
it = iter(DataLoader(Synthetic(), **kwargs))
next(it)  # workers started, first batch ready
n, start = 0, time.perf_counter()
while time.perf_counter() - start < seconds:
    x, y = next(it); n += x.shape[0]
elapsed = time.perf_counter() - start
print(json.dumps({"value": n / elapsed, "samples": n, "pin_memory": pin}))
"""

COMPILE = r"""
import json, sys, time
import torch
mode, seconds = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                            torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
def step(m):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward(); opt.step()
    return loss
m = torch.compile(model) if mode == "compiled" else model
t0 = time.perf_counter(); step(m); first = time.perf_counter() - t0
times, start = [], time.perf_counter()
while len(times) < 5 or (time.perf_counter() - start < seconds and len(times) < 500):
    t = time.perf_counter(); step(m); times.append(time.perf_counter() - t)
times.sort()
print(json.dumps({"value": 1000 * times[len(times) // 2], "first_step_ms": 1000 * first, "steps": len(times)}))
"""

GPU_AMP = r"""
import json, sys, time
import torch
mode, seconds = sys.argv[1], float(sys.argv[2])
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
    torch.nn.Conv2d(64, 128, 3, padding=1, stride=2), torch.nn.BatchNorm2d(128), torch.nn.ReLU(),
    torch.nn.Conv2d(128, 256, 3, padding=1, stride=2), torch.nn.BatchNorm2d(256), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(256, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cuda", enabled=(mode == "amp"))
x, y = torch.randn(128, 3, 64, 64, device=dev), torch.randint(0, 10, (128,), device=dev)
def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16, enabled=(mode == "amp")):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
for _ in range(3):
    step()
torch.cuda.synchronize()
n, start = 0, time.perf_counter()
while n < 5 or (time.perf_counter() - start < seconds and n < 1000):
    step(); n += 1
torch.cuda.synchronize()
print(json.dumps({"value": 1000 * (time.perf_counter() - start) / n, "steps": n,
                  "device": torch.cuda.get_device_name(0)}))
"""

GPU_GEMM = r"""
import json, sys, time
import torch
dtype, seconds = getattr(torch, sys.argv[1]), float(sys.argv[2])
torch.backends.cuda.matmul.allow_tf32 = False
size = 8192
a = torch.randn(size, size, device="cuda", dtype=dtype)
b = torch.randn(size, size, device="cuda", dtype=dtype)
a @ b; torch.cuda.synchronize()
n, start = 0, time.perf_counter()
while n < 3 or (time.perf_counter() - start < seconds and n < 1000):
    a @ b; n += 1
torch.cuda.synchronize()
print(json.dumps({"value": 2 * size ** 3 * n / (time.perf_counter() - start) / 1e12, "repeats": n,
                  "device": torch.cuda.get_device_name(0)}))
"""


def _err(exc):
    return "%s: %s" % (type(exc).__name__, exc)


def child(code, args, *, timeout, env=None):
    """Run one child program; its JSON dict, or {"error": ...}."""
    timeout = max(1.0, timeout)
    try:
        r = subprocess.run([sys.executable, "-c", code] + [str(a) for a in args], capture_output=True,
                           text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after %.0f s" % timeout}
    except Exception as exc:
        return {"error": _err(exc)}
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    if r.returncode == 0 and lines:
        try:
            data = json.loads(lines[-1])
            if isinstance(data, dict) and isinstance(data.get("value"), (int, float)):
                return data
        except ValueError:
            pass
    errors = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
    key = [ln for ln in errors if "Error" in ln or "error" in ln]  # the exception line, not the traceback
    return {"error": "exit %d: %s" % (r.returncode, (key or errors or ["no output"])[-1][:400])}


def thread_env(n):
    env = dict(os.environ)
    if n is not None:
        for k in THREAD_VARS:
            env[k] = str(n)
    return env


class Budget:
    """Wall-clock budget of one section, shared by its measurements."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        return self.end - time.monotonic()

    def slice(self, parts):
        """Seconds to measure for, out of `parts` measurements still to come (import time included)."""
        return max(0.2, self.left() / parts / 3)


def figure(name, unit, higher_is_better, base_label, base, cand_label, cand):
    fig = {"name": name, "unit": unit, "higher_is_better": higher_is_better,
           "baseline": dict(base, label=base_label), "candidate": dict(cand, label=cand_label),
           "speedup": None, "error": base.get("error") or cand.get("error"), "status": "ok"}
    b, c = base.get("value"), cand.get("value")
    if fig["error"] or not b or not c:
        fig["status"] = "failed"
        fig["error"] = fig["error"] or "no measurement"
    else:
        fig["speedup"] = (c / b) if higher_is_better else (b / c)
    return fig


def skipped(name, unit, why):
    return {"name": name, "unit": unit, "status": "skipped", "error": why, "speedup": None,
            "baseline": None, "candidate": None}


def _gemm_pair(name, budget, base_threads, cand_threads, base_label, cand_label, size, parts):
    out = []
    for lib in ("numpy", "torch"):
        base = child(GEMM, [lib, size, budget.slice(parts)], timeout=budget.left(), env=thread_env(base_threads))
        parts -= 1
        cand = child(GEMM, [lib, size, budget.slice(parts)], timeout=budget.left(), env=thread_env(cand_threads))
        parts -= 1
        out.append(figure("%s.%s" % (name, lib), "GFLOP/s", True, base_label, base, cand_label, cand))
    return out


def section_gemm(budget, args, cpus):
    image = os.environ.get("OMP_NUM_THREADS") or "library default"
    return _gemm_pair("gemm", budget, 1, None, "1 thread", "image threads (%s)" % image, args.size, 4)


def section_oversub(budget, args, cpus):
    host = args.host_cores or cpus["os_cpu_count"] or 1
    return _gemm_pair("oversub", budget, host, cpus["auto"], "threads = host cores (%d)" % host,
                      "threads = CPU budget (%d)" % cpus["auto"], args.size, 4)


def _cuda_available():
    r = child("import json, torch; print(json.dumps({'value': int(torch.cuda.is_available())}))", [], timeout=60)
    return bool(r.get("value")), r.get("error")


def section_dataloader(budget, args, cpus):
    pin = "1" if args.cuda else "0"
    base = child(DATALOADER, [0, budget.slice(2), pin], timeout=budget.left() / 2)
    cand = child(DATALOADER, [2, budget.slice(1), pin], timeout=budget.left())
    label = " (pin_memory)" if args.cuda else ""
    return [figure("dataloader", "samples/s", True, "num_workers=0" + label, base, "num_workers=2" + label, cand)]


def section_compile(budget, args, cpus):
    base = child(COMPILE, ["eager", 1.0], timeout=min(budget.left() / 3, 60))
    cand = child(COMPILE, ["compiled", 1.0], timeout=budget.left())
    return [figure("compile", "ms/step", False, "eager", base, "torch.compile", cand)]


def section_gpu(budget, args, cpus):
    if not args.cuda:
        why = "no CUDA device" + (" (%s)" % args.cuda_error if args.cuda_error else "")
        return [skipped("gpu.amp", "ms/step", why), skipped("gpu.gemm", "TFLOP/s", why)]
    out = []
    base = child(GPU_AMP, ["fp32", budget.slice(4)], timeout=budget.left() / 4)
    cand = child(GPU_AMP, ["amp", budget.slice(3)], timeout=budget.left() / 3)
    out.append(figure("gpu.amp", "ms/step", False, "fp32", base, "AMP (fp16 autocast + GradScaler)", cand))
    base = child(GPU_GEMM, ["float32", budget.slice(2)], timeout=budget.left() / 2)
    cand = child(GPU_GEMM, ["bfloat16", budget.slice(1)], timeout=budget.left())
    out.append(figure("gpu.gemm", "TFLOP/s", True, "float32 (TF32 off)", base, "bfloat16", cand))
    return out


RUNNERS = {"gemm": section_gemm, "oversub": section_oversub, "dataloader": section_dataloader,
           "compile": section_compile, "gpu": section_gpu}


def parse_args(argv):
    p = argparse.ArgumentParser(description="imagefactory benchmark workload")
    p.add_argument("--budget", type=float, default=50.0, help="seconds for all sections together")
    p.add_argument("--sections", default="gemm,dataloader,compile,gpu,oversub")
    p.add_argument("--host-cores", type=int, default=None, help="threads for the oversubscribed GEMM")
    p.add_argument("--size", type=int, default=1024, help="GEMM size")
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error("unknown section(s): %s (allowed: %s)" % (", ".join(unknown), ", ".join(SECTIONS)))
    return args


def run(argv):
    args = parse_args(argv)
    started = time.monotonic()
    cpus = cpu_budget()
    args.cuda, args.cuda_error = False, None
    if "gpu" in args.sections or "dataloader" in args.sections:
        args.cuda, args.cuda_error = _cuda_available()
    result = {"workload_version": WORKLOAD_VERSION, "python": sys.version.split()[0], "cpus": cpus,
              "env": {k: os.environ.get(k) for k in THREAD_VARS}, "cuda_available": args.cuda,
              "budget_s": args.budget, "sections": {}, "figures": []}
    shares = sum(SHARE[s] for s in args.sections) or 1.0
    for name in args.sections:
        left = args.budget - (time.monotonic() - started)
        budget = Budget(max(1.0, left * SHARE[name] / shares))
        shares -= SHARE[name]
        t0 = time.monotonic()
        try:
            figs = RUNNERS[name](budget, args, cpus)
        except Exception as exc:  # a bug in a section costs that section only
            figs = [{"name": name, "status": "failed", "error": _err(exc), "speedup": None,
                     "baseline": None, "candidate": None}]
        result["sections"][name] = round(time.monotonic() - t0, 2)
        result["figures"] += figs
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def main():
    result = run(sys.argv[1:])
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
