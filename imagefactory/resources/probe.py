"""Runtime probe, run INSIDE a built image: `python probe.py` or `python -c "<this text>"`.

Standalone on purpose: standard library plus the packages it inspects (numpy,
threadpoolctl, torch); it must not import imagefactory. It never crashes: each
section records its own failure as "error": "ExcType: message". It prints exactly
one JSON document, on one line, on stdout; anything else (library chatter, warnings,
C-level prints) is sent to stderr.

Order matters: numpy's BLAS is read with threadpoolctl BEFORE torch is imported, so
it is numpy's BLAS we see and not one torch drags in; threadpool_info() is taken again
after torch to list every OpenMP runtime loaded in the process.
"""

import contextlib
import glob
import json
import math
import os
import platform
import re
import sys

PROBE_VERSION = 1
ENV_VARS = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_THREADING_LAYER",
    "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
)
BLAS_KEYS = ("internal_api", "version", "num_threads", "threading_layer", "filepath", "architecture")
OPENMP_KEYS = ("prefix", "filepath", "version", "num_threads", "internal_api")


def _err(exc):
    return "%s: %s" % (type(exc).__name__, exc)


def _quiet(fn, *args):
    """Call fn with Python-level stdout sent to stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        return fn(*args)


def _pick(entry, keys):
    return {k: entry.get(k) for k in keys}


def probe_python():
    return {"version": platform.python_version(), "executable": sys.executable}


def probe_user():
    out = {"uid": os.getuid(), "gid": os.getgid(), "name": None}
    try:
        import pwd
        out["name"] = pwd.getpwuid(out["uid"]).pw_name
    except Exception:  # an arbitrary uid without a passwd entry has no name
        pass
    return out


def _read(path):
    with open(path) as f:
        return f.read().strip()


def cgroup_quota():
    """CPUs allowed by a CFS quota (docker --cpus), or None when unlimited/unknown."""
    try:  # cgroup v2: "max 100000" or "150000 100000"
        quota, period = _read("/sys/fs/cgroup/cpu.max").split()[:2]
        return None if quota == "max" else round(int(quota) / int(period), 3)
    except (OSError, ValueError):
        pass
    for d in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):  # cgroup v1
        try:
            quota, period = int(_read(d + "/cpu.cfs_quota_us")), int(_read(d + "/cpu.cfs_period_us"))
            return None if quota <= 0 else round(quota / period, 3)
        except (OSError, ValueError):
            continue
    return None


def physical_cores():
    """Distinct (package, core) pairs: MKL sizes its default pool by these, not by affinity."""
    cores = set()
    for d in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology"):
        try:
            cores.add((_read(d + "/physical_package_id"), _read(d + "/core_id")))
        except OSError:
            continue
    return len(cores) or None


def probe_cpus():
    out = {"os_cpu_count": os.cpu_count(), "affinity": None, "cgroup_quota": None,
           "physical_cores": None, "error": None}
    try:
        out["affinity"] = len(os.sched_getaffinity(0))
        out["cgroup_quota"] = cgroup_quota()
        out["physical_cores"] = physical_cores()
    except Exception as exc:
        out["error"] = _err(exc)
    return out


def probe_numpy():
    out = {"error": None, "version": None, "blas": None}
    try:
        import numpy
        out["version"] = numpy.__version__
        import threadpoolctl
        info = _quiet(threadpoolctl.threadpool_info)
        out["blas"] = [_pick(e, BLAS_KEYS) for e in info if e.get("user_api") == "blas"]
    except Exception as exc:
        out["error"] = _err(exc)
    return out


def gpu_matmul(torch):
    """256x256 float32 matmul on cuda:0 against a float64 CPU reference, TF32 off."""
    out = {"ok": False, "max_abs_err": None, "tolerance": None, "tf32": None, "error": None}
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        out["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
        # Full fp32 over k=256 with N(0,1) inputs errs ~1e-5; TF32 (10-bit mantissa) ~1e-2;
        # a broken kernel or device gives errors of order 1 and more.
        out["tolerance"] = 1e-1 if out["tf32"] else 1e-3
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
        got = (a.to("cuda:0") @ b.to("cuda:0")).cpu()
        torch.cuda.synchronize()
        err = float((got.double() - a.double() @ b.double()).abs().max())
        out["max_abs_err"] = err if math.isfinite(err) else str(err)
        out["ok"] = math.isfinite(err) and err <= out["tolerance"]
    except Exception as exc:
        out["error"] = _err(exc)
    return out


def probe_torch():
    out = {"error": None, "version": None, "cuda": None, "cudnn": None, "cuda_available": False,
           "device_count": 0, "devices": [], "blas_info": None, "mkl_available": None,
           "num_threads": None, "gpu_matmul": None}
    try:
        torch = _quiet(__import__, "torch")
    except Exception as exc:
        out["error"] = _err(exc)
        return out
    steps = (
        ("version", lambda: str(torch.__version__)),
        ("cuda", lambda: torch.version.cuda),
        ("cudnn", lambda: torch.backends.cudnn.version() if out["cuda"] else None),
        ("mkl_available", lambda: bool(torch.backends.mkl.is_available())),
        ("blas_info", lambda: _blas_info(torch)),
        ("num_threads", lambda: torch.get_num_threads()),
        ("cuda_available", lambda: bool(torch.cuda.is_available())),
        ("device_count", lambda: torch.cuda.device_count() if out["cuda_available"] else 0),
        ("devices", lambda: [torch.cuda.get_device_name(i) for i in range(out["device_count"])]),
        ("gpu_matmul", lambda: gpu_matmul(torch) if out["cuda_available"] else None),
    )
    errors = []
    for key, fn in steps:  # one broken attribute must not hide the others
        try:
            out[key] = _quiet(fn)
        except Exception as exc:
            errors.append("%s: %s" % (key, _err(exc)))
    out["field_errors"] = errors
    return out


def _blas_info(torch):
    m = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return m.group(1) if m else None


# Each runs in a child process: a BLAS that aborts (MKL's GNU threading layer without
# libgomp loaded dies with "undefined symbol: omp_get_num_procs") must not take the
# probe down with it.
COMPUTE = {
    "numpy_matmul": (
        "import numpy as np\n"
        "a = np.arange(96 * 96, dtype=np.float64).reshape(96, 96) % 7\n"
        "c = a @ a.T\n"
        "r = [sum(a[i, k] * a[j, k] for k in range(96)) for i, j in ((0, 0), (5, 90), (95, 3))]\n"
        "assert all(abs(c[i, j] - x) < 1e-9 for (i, j), x in zip(((0, 0), (5, 90), (95, 3)), r)), c\n"
        "print('ok')\n"
    ),
    "torch_matmul": (
        "import numpy, torch\n"
        "a = torch.arange(96 * 96, dtype=torch.float64).reshape(96, 96) % 7\n"
        "c = a @ a.T\n"
        "x = float(sum(a[5, k] * a[90, k] for k in range(96)))\n"
        "assert abs(float(c[5, 90]) - x) < 1e-9, (float(c[5, 90]), x)\n"
        "print('ok')\n"
    ),
}


def probe_compute():
    import subprocess
    out = {}
    for name, code in COMPUTE.items():
        try:
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            tail = " | ".join(r.stderr.strip().splitlines()[-3:])
            out[name] = {"ok": r.returncode == 0 and r.stdout.strip() == "ok", "returncode": r.returncode,
                         "error": None if r.returncode == 0 else (tail or "exit %d" % r.returncode)}
        except Exception as exc:
            out[name] = {"ok": False, "returncode": None, "error": _err(exc)}
    return out


def probe_packages():
    """What is installed: Python distributions (importlib.metadata, PEP 503 names) and, in a
    conda environment, its conda packages (conda-meta/*.json). The host compares both with
    the cell's lock."""
    out = {"error": None, "python": None, "conda": None}
    try:
        from importlib import metadata
        found = {}
        for dist in metadata.distributions():
            name = dist.metadata["Name"]
            if name:
                found.setdefault(re.sub(r"[-_.]+", "-", name).lower(), dist.version)  # first on sys.path wins
        out["python"] = found
        records = glob.glob(os.path.join(sys.prefix, "conda-meta", "*.json"))
        if records:
            conda = {}
            for path in records:
                with open(path) as f:
                    record = json.load(f)
                conda[record["name"]] = record["version"]
            out["conda"] = conda
    except Exception as exc:
        out["error"] = _err(exc)
    return out


def probe_threadpools():
    """threadpool_info() with numpy and torch both imported: (openmp list, full list, error)."""
    try:
        import threadpoolctl
        info = _quiet(threadpoolctl.threadpool_info)
        return [_pick(e, OPENMP_KEYS) for e in info if e.get("user_api") == "openmp"], info, None
    except Exception as exc:
        return None, None, _err(exc)


def run():
    result = {"probe_version": PROBE_VERSION}
    for key, fn in (("python", probe_python), ("user", probe_user), ("cpus", probe_cpus),
                    ("env", lambda: {k: os.environ.get(k) for k in ENV_VARS}),
                    ("numpy", probe_numpy),  # before torch, see module docstring
                    ("torch", probe_torch),
                    ("compute", probe_compute),
                    ("packages", probe_packages)):
        try:
            result[key] = fn()
        except Exception as exc:
            result[key] = {"error": _err(exc)}
    result["openmp"], result["threadpool_info"], result["threadpool_error"] = probe_threadpools()
    return result


def main():
    sys.stdout.flush()
    real_stdout = None
    try:  # route fd 1 to stderr so C-level prints cannot pollute the JSON
        real_stdout = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        pass
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = run()
    except BaseException as exc:  # last resort: still one JSON document
        result = {"probe_version": PROBE_VERSION, "error": _err(exc)}
    text = json.dumps(result, default=str, sort_keys=True) + "\n"
    if real_stdout is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        data = text.encode("utf-8")
        while data:
            data = data[os.write(real_stdout, data):]


if __name__ == "__main__":
    main()
