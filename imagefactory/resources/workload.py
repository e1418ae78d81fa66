"""Benchmark workload, run INSIDE a built image (`python -c "<this text>" ARGS`) or natively
(`python workload.py [--budget S] [--sections gemm,dataloader,compile,gpu,oversub]`).

Standalone on purpose: standard library plus numpy and torch; it must not import
imagefactory. Each figure compares two settings side by side in this one
container and keeps both absolute values. Every measurement runs in its own child
process with its own timeout, so a crash, a hang or a missing compiler costs one
figure (recorded as its "error"), never the run. On stdout: one line per finished
figure ({"figure": ...}, kept by the host if it has to kill the container), then the
whole result as one JSON document on the last line.

Sections and their figures (baseline -> candidate; "speedup" > 1 means the candidate wins):
  gemm        float32 GEMM GFLOP/s, NumPy and torch: 1 thread -> the image's threads
  oversub     the same GEMM: threads = host cores -> the CPU budget (meant to run under --cpus 1)
  dataloader  samples/s with a CPU-heavy transform: num_workers=0 -> 2 (pin_memory on a GPU)
  compile     small MLP training step, ms: eager -> torch.compile, on CPU
  gpu         conv net step ms: fp32 -> AMP (autocast + GradScaler); GEMM TFLOP/s: fp32 -> bf16
"""

import argparse
import json
import os
import stat
import subprocess
import sys
import time

WORKLOAD_VERSION = 1
SECTIONS = ("gemm", "oversub", "dataloader", "compile", "gpu")
SHARE = {"gemm": 0.3, "oversub": 1.0, "dataloader": 0.25, "compile": 0.3, "gpu": 0.15}
MEASURE_S = 2.0  # seconds each setting is measured for at most: a bigger budget buys slack, not length
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _count(text):
    """A positive integer of at most 18 ASCII digits without a leading zero, or None."""
    if not text or len(text) > 18 or text[:1] == b"0" or not text.isdigit():
        return None
    return int(text)


def _first_line(path):
    """The first line of a regular file's first 4096 bytes, as it is: the launch hook's rule (a FIFO
    or a folder cannot be read; a NUL byte stays, a non-digit)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file: %s" % path)
        return os.read(fd, 4096).split(b"\n", 1)[0]
    finally:
        os.close(fd)


def cgroup_limit(root="/sys/fs/cgroup"):
    """(quota, period) of this process's CFS quota, or None. The one rule of README's Threads
    section (the image's launch hook and shell script apply it too; a unit test runs every copy):
    cgroup v2's cpu.max when it can be read (first line, exactly two fields), else the first v1
    folder whose cpu.cfs_quota_us and cpu.cfs_period_us can both be read; quota and period must
    be positive integers (no leading zero, at most 18 digits), anything else is no quota."""
    try:
        fields = [f for f in _first_line(root + "/cpu.max").replace(b"\t", b" ").split(b" ") if f]
    except OSError:
        pass
    else:
        pair = (_count(fields[0]), _count(fields[1])) if len(fields) == 2 else (None, None)
        return pair if pair[0] and pair[1] else None
    for d in ("cpu", "cpu,cpuacct"):
        try:
            quota = _first_line("%s/%s/cpu.cfs_quota_us" % (root, d)).strip(b" \t")
            period = _first_line("%s/%s/cpu.cfs_period_us" % (root, d)).strip(b" \t")
        except OSError:
            continue
        pair = (_count(quota), _count(period))
        return pair if pair[0] and pair[1] else None
    return None


def cgroup_quota(root="/sys/fs/cgroup"):
    """CPUs allowed by a CFS quota (docker --cpus), unrounded, or None when unlimited/unknown."""
    limit = cgroup_limit(root)
    return None if limit is None else limit[0] / limit[1]


def cpu_budget(root="/sys/fs/cgroup"):
    """The CPUs this process may really use: min(affinity, floor(quota/period)), at least 1."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    limit = cgroup_limit(root)
    auto = affinity if limit is None else min(affinity, limit[0] // limit[1])
    return {"os_cpu_count": os.cpu_count(), "affinity": affinity, "cgroup_quota": cgroup_quota(root),
            "auto": max(1, auto)}


# -- child programs -------------------------------------------------------------------------------
# Each prints one JSON object on its last stdout line: {setting: {"value": ...} or {"error": ...}, ...}.
# Settings compared in one figure are measured in ONE child where the library allows it (torch
# threads, DataLoader workers, eager vs compiled, fp32 vs AMP), so both see the same process.

GEMM = r"""
import json, sys, time
lib, size, seconds, settings = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
if lib == "numpy":
    import numpy as np
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((size, size), dtype=np.float32)
    set_threads = None
else:
    import torch
    a, b = torch.randn(size, size), torch.randn(size, size)
    set_threads = torch.set_num_threads
def rate():
    a @ b
    best, n, start = float("inf"), 0, time.perf_counter()
    while n < 3 or (time.perf_counter() - start < seconds and n < 200):
        t = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - t); n += 1
    return 2 * size ** 3 / best / 1e9
out = []
for s in settings:  # "env": as the environment says; a number: torch.set_num_threads(n)
    if s != "env":
        set_threads(int(s))
    out.append({"value": rate(), "threads": torch.get_num_threads() if set_threads else None})
print(json.dumps({"results": out}))
"""

DATALOADER = r"""
import json, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
seconds = float(sys.argv[1])
pin = torch.cuda.is_available()

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

def rate(workers):
    kwargs = {"num_workers": workers, "batch_size": 32, "pin_memory": pin}
    if workers:
        import multiprocessing as mp
        kwargs["multiprocessing_context"] = mp.get_context("fork")
    it = iter(DataLoader(Synthetic(), **kwargs))
    next(it)  # workers started, first batch ready
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        x, y = next(it); n += x.shape[0]
    return {"value": n / (time.perf_counter() - start), "samples": n, "pin_memory": pin}
print(json.dumps({"0": rate(0), "2": rate(2)}))
"""

COMPILE = r"""
import json, sys, time
import torch
seconds = float(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                            torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
def step(m):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward(); opt.step()
def timed(m):
    t0 = time.perf_counter(); step(m); first = time.perf_counter() - t0
    times, start = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < seconds and len(times) < 500):
        t = time.perf_counter(); step(m); times.append(time.perf_counter() - t)
    times.sort()
    return {"value": 1000 * times[len(times) // 2], "first_step_ms": 1000 * first, "steps": len(times)}
out = {"eager": timed(model)}
print(json.dumps(out), flush=True)  # eager stands even if compiling dies hard
try:
    out["compiled"] = timed(torch.compile(model))
except Exception as exc:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    out["compiled"] = {"error": "%s: %s" % (type(exc).__name__, (lines or [""])[0][:300])}
print(json.dumps(out))
"""

GPU = r"""
import json, sys, time
import torch
seconds = float(sys.argv[1])
if not torch.cuda.is_available():
    print(json.dumps({"skip": "no CUDA device (torch %s, built for CUDA %s)" % (torch.__version__, torch.version.cuda)}))
    sys.exit(0)
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
name = torch.cuda.get_device_name(0)

def amp_step_ms(amp):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 128, 3, padding=1, stride=2), torch.nn.BatchNorm2d(128), torch.nn.ReLU(),
        torch.nn.Conv2d(128, 256, 3, padding=1, stride=2), torch.nn.BatchNorm2d(256), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(256, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    x, y = torch.randn(128, 3, 64, 64, device=dev), torch.randint(0, 10, (128,), device=dev)
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while n < 5 or (time.perf_counter() - start < seconds and n < 1000):
        step(); n += 1
    torch.cuda.synchronize()
    return {"value": 1000 * (time.perf_counter() - start) / n, "steps": n, "device": name}

def gemm_tflops(dtype):
    size = 8192
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    a @ b; torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while n < 3 or (time.perf_counter() - start < seconds and n < 1000):
        a @ b; n += 1
    torch.cuda.synchronize()
    return {"value": 2 * size ** 3 * n / (time.perf_counter() - start) / 1e12, "repeats": n, "device": name}

out = {}
for key, fn in (("fp32", lambda: amp_step_ms(False)), ("amp", lambda: amp_step_ms(True)),
                ("gemm_float32", lambda: gemm_tflops(torch.float32)), ("gemm_bfloat16", lambda: gemm_tflops(torch.bfloat16))):
    try:
        out[key] = fn()
    except Exception as exc:
        out[key] = {"error": "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")}
print(json.dumps(out))
"""


def _err(exc):
    return "%s: %s" % (type(exc).__name__, exc)


class Deadline:
    """The workload's wall-clock budget. No child outlives it, so the host's timeout is never needed."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        return self.end - time.monotonic()


DEADLINE = Deadline(3600.0)  # the whole workload's; replaced in run()
SECTION = Deadline(3600.0)  # the running section's share of what is left; replaced in run()


def _last_json(stdout):
    for line in reversed([ln for ln in stdout.splitlines() if ln.strip()]):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        return data if isinstance(data, dict) else None
    return None


def child(code, args, *, timeout, env=None):
    """Run one child program; its JSON dict, or {"error": ...}. The timeout never passes the
    workload's deadline nor the section's, so a slow section cannot starve the next ones."""
    left = min(DEADLINE.left(), SECTION.left())
    if left < 1.0:
        return {"error": "no time left in this section's budget"}
    timeout = min(max(timeout, 2.0), left)
    partial = None
    try:
        r = subprocess.run([sys.executable, "-c", code] + [str(a) for a in args], capture_output=True,
                           text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        partial = _last_json(out)
        return dict(partial or {}, error="timed out after %.0f s" % timeout)
    except Exception as exc:
        return {"error": _err(exc)}
    data = _last_json(r.stdout)
    if r.returncode == 0 and data is not None:
        return data
    errors = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
    key = [ln for ln in errors if "Error" in ln or "error" in ln]  # the exception line, not the traceback
    return dict(data or {}, error="exit %d: %s" % (r.returncode, (key or errors or ["no output"])[-1][:400]))


def setting(result, key):
    """One setting's measurement out of a child's result (or the child's error)."""
    got = result.get(key)
    if isinstance(got, dict) and (got.get("value") is not None or got.get("error")):
        return got
    return {"error": result.get("error") or "no measurement for %s" % key}


def nth(result, i):
    """The i-th measurement of a child that measured several settings in order."""
    got = result.get("results")
    if isinstance(got, list) and len(got) > i and isinstance(got[i], dict):
        return got[i]
    return {"error": result.get("error") or "no measurement"}


def thread_env(n):
    env = dict(os.environ)
    if n is not None:
        for k in THREAD_VARS:
            env[k] = str(n)
    return env


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


def _gemm(name, seconds, size, base, cand, labels):
    """numpy: one child per thread count (set through the environment, before the BLAS loads);
    torch: one child, torch.set_num_threads between the two. `base`/`cand`: a thread count or None (env)."""
    slice_s = max(0.2, min(MEASURE_S, seconds / 12))
    # Children stop measuring on their own after `slice_s`; the timeout (the section's time) is for hangs.
    nb = child(GEMM, ["numpy", size, slice_s, "env"], timeout=DEADLINE.left(), env=thread_env(base))
    nc = child(GEMM, ["numpy", size, slice_s, "env"], timeout=DEADLINE.left(), env=thread_env(cand))
    tr = child(GEMM, ["torch", size, slice_s] + ["env" if t is None else str(t) for t in (base, cand)],
               timeout=DEADLINE.left())
    return [figure(name + ".numpy", "GFLOP/s", True, labels[0], nth(nb, 0), labels[1], nth(nc, 0)),
            figure(name + ".torch", "GFLOP/s", True, labels[0], nth(tr, 0), labels[1], nth(tr, 1))]


def section_gemm(seconds, args, cpus):
    image = os.environ.get("OMP_NUM_THREADS") or "library default"
    return _gemm("gemm", seconds, args.size, 1, None, ("1 thread", "image threads (%s)" % image))


def section_oversub(seconds, args, cpus):
    host = args.host_cores or cpus["os_cpu_count"] or 1
    return _gemm("oversub", seconds, args.size, host, cpus["auto"],
                 ("threads = host cores (%d)" % host, "threads = CPU budget (%d)" % cpus["auto"]))


def section_dataloader(seconds, args, cpus):
    r = child(DATALOADER, [max(0.5, min(MEASURE_S, seconds / 6))], timeout=DEADLINE.left())
    pin = " (pin_memory)" if setting(r, "0").get("pin_memory") else ""
    return [figure("dataloader", "samples/s", True, "num_workers=0" + pin, setting(r, "0"),
                   "num_workers=2" + pin, setting(r, "2"))]


def section_compile(seconds, args, cpus):
    r = child(COMPILE, [1.0], timeout=seconds)  # compiling has no natural end: its share of the budget
    return [figure("compile", "ms/step", False, "eager", setting(r, "eager"), "torch.compile", setting(r, "compiled"))]


def section_gpu(seconds, args, cpus):
    r = child(GPU, [max(0.5, min(MEASURE_S, seconds / 10))], timeout=DEADLINE.left())
    if r.get("skip"):
        return [skipped("gpu.amp", "ms/step", r["skip"]), skipped("gpu.gemm", "TFLOP/s", r["skip"])]
    return [figure("gpu.amp", "ms/step", False, "fp32", setting(r, "fp32"),
                   "AMP (fp16 autocast + GradScaler)", setting(r, "amp")),
            figure("gpu.gemm", "TFLOP/s", True, "float32 (TF32 off)", setting(r, "gemm_float32"),
                   "bfloat16", setting(r, "gemm_bfloat16"))]


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


def run(argv, emit=lambda fig: None):
    global DEADLINE, SECTION
    args = parse_args(argv)
    started = time.monotonic()
    DEADLINE = Deadline(args.budget)
    cpus = cpu_budget()
    result = {"workload_version": WORKLOAD_VERSION, "python": sys.version.split()[0], "cpus": cpus,
              "env": {k: os.environ.get(k) for k in THREAD_VARS}, "budget_s": args.budget,
              "sections": {}, "figures": []}
    shares = sum(SHARE[s] for s in args.sections) or 1.0
    for name in args.sections:
        seconds = max(1.0, DEADLINE.left() * SHARE[name] / shares)
        SECTION = Deadline(seconds)
        shares -= SHARE[name]
        t0 = time.monotonic()
        try:
            figs = RUNNERS[name](seconds, args, cpus)
        except Exception as exc:  # a bug in a section costs that section only
            figs = [{"name": name, "status": "failed", "error": _err(exc), "speedup": None,
                     "baseline": None, "candidate": None}]
        result["sections"][name] = round(time.monotonic() - t0, 2)
        for fig in figs:
            emit(fig)
        result["figures"] += figs
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def main():
    def emit(fig):  # progress, one figure per line: what the host keeps if it must kill the container
        sys.stdout.write(json.dumps({"figure": fig}) + "\n")
        sys.stdout.flush()
    result = run(sys.argv[1:], emit)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
