"""Runtime probe, run INSIDE a built image: `python probe.py` or `python -c "<this text>"`.

Standalone on purpose: standard library plus the packages it inspects (numpy,
threadpoolctl, torch); it must not import imagefactory. It never crashes: each
section records its own failure as "error": "ExcType: message". It prints exactly
one JSON document, on one line, on stdout; anything else (library chatter, warnings,
C-level prints) is sent to stderr.

Order matters: numpy's BLAS is read with threadpoolctl BEFORE torch is imported, so
it is numpy's BLAS we see and not one torch drags in; threadpool_info() is taken again
after torch to list every OpenMP runtime (by its real path: one runtime can be loaded
under several names) and MKL's threading layer as loaded in the process.

Work that could crash or hang the probe (a BLAS call, torch.compile, a DataLoader through
/dev/shm, a gloo all_reduce; NCCL where a GPU is visible) runs in child processes, started
early and run concurrently with the rest. The "launch" section says how the container was
started as seen from inside (HOME, read-only root, /tmp, the size of /dev/shm). The probe's own imports of
NumPy and torch are timed (information; the children run meanwhile).

    python probe.py [--no-compile] [--slowdown N]

--no-compile leaves out the torch.compile child (for an image built without a compiler,
whose check is skipped anyway: the child would only cost time). --slowdown N multiplies
every timeout of its own (the children's, the DataLoader's, gloo's): the host passes it when
the probe runs emulated (binfmt/QEMU), about ten times slower.
"""

import contextlib
import glob
import json
import math
import os
import platform
import re
import stat
import subprocess
import sys
import time

PROBE_VERSION = 5
ENV_VARS = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_THREADING_LAYER",
    "MKL_INTERFACE_LAYER", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "CXX", "CC",
    "QEMU_CPU",  # set by the host for an emulated probe: the CPU model qemu-user emulates
)
BLAS_KEYS = ("internal_api", "version", "num_threads", "threading_layer", "filepath", "architecture")
OPENMP_KEYS = ("prefix", "filepath", "version", "num_threads", "internal_api")
MKL_KEYS = ("filepath", "version", "threading_layer", "num_threads")


def _err(exc):
    return "%s: %s" % (type(exc).__name__, exc)


def _quiet(fn, *args):
    """Call fn with Python-level stdout sent to stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        return fn(*args)


def _pick(entry, keys):
    return {k: entry.get(k) for k in keys}


def probe_python():
    """The interpreter, and the machine it runs on (`uname -m`: aarch64 under qemu-aarch64 too)."""
    return {"version": platform.python_version(), "executable": sys.executable, "machine": platform.machine()}


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
    """CPUs allowed by a CFS quota (docker --cpus), unrounded, or None when unlimited/unknown. Its
    floor is the rule's floor(quota / period): where the float rounds up to the next integer
    (18-digit values: 199999999999999999 / 10**17 is 2.0), the integer below is reported."""
    limit = cgroup_limit(root)
    if limit is None:
        return None
    quota, whole = limit[0] / limit[1], limit[0] // limit[1]
    return float(whole) if math.floor(quota) > whole else quota


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
        started = time.perf_counter()
        import numpy
        out["import_seconds"] = round(time.perf_counter() - started, 3)
        out["version"] = numpy.__version__
        import threadpoolctl
        info = _quiet(threadpoolctl.threadpool_info)
        # realpath: behind conda's libblas.so.3 switch is the library that really answers
        out["blas"] = [dict(_pick(e, BLAS_KEYS), realpath=_realpath(e.get("filepath")))
                       for e in info if e.get("user_api") == "blas"]
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


def import_torch():
    """(torch module or None, the probe's "torch" section so far)."""
    out = {"error": None, "version": None, "cuda": None, "cudnn": None, "cuda_available": False,
           "device_count": 0, "devices": [], "blas_info": None, "mkl_available": None,
           "num_threads": None, "gpu_matmul": None}
    try:
        started = time.perf_counter()
        torch = _quiet(__import__, "torch")
        out["import_seconds"] = round(time.perf_counter() - started, 3)
    except Exception as exc:
        out["error"] = _err(exc)
        return None, out
    return torch, out


def probe_torch(torch, out):
    if torch is None:
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


# The compute work runs in child processes, concurrently with the rest of the probe: a BLAS
# that aborts (MKL's GNU threading layer without libgomp loaded dies with "undefined
# symbol: omp_get_num_procs") or hangs must not take the probe down with it. Each child runs
# its SECTIONS in order, each in its own try block, and writes one JSON line per finished
# section; a section that a crash or a timeout cut short reports the child's exit status
# and the tail of its stderr.
#
# The NumPy and torch children are forked from the probe itself, right after it imported
# NumPy (before torch: NumPy's BLAS is exercised in a process where torch never loaded)
# and right after it imported torch (before CUDA is touched). A fork inherits the imported
# libraries in the state the probe judges, and costs milliseconds where a fresh process
# would import torch again (seconds). torch.compile runs in a fresh interpreter: Inductor's
# settings are read from the environment when it is first imported.
_REPORT = (
    "import json, sys\n"
    "def report(**kw):\n"
    "    print(json.dumps(dict(ok=True, section=SECTION, info=kw)), flush=True)\n"
    "def failed(exc):\n"
    "    msg = '%s: %s' % (type(exc).__name__, exc)\n"
    "    print(json.dumps(dict(ok=False, section=SECTION, error=msg)), flush=True)\n"
)
# Complex values whose real and imaginary parts are small integers: every product and sum
# is exact in float64, so a result must equal the pure-Python reference exactly.
_COMPLEX_DATA = (
    "def cvec(n, s):\n"
    "    return [complex((i * s) % 7 - 3, (i * (s + 2)) % 5 - 2) for i in range(n)]\n"
    "def ref_dot(x, y, conj):\n"
    "    return sum((a.conjugate() if conj else a) * b for a, b in zip(x, y))\n"
    "x, y = cvec(37, 3), cvec(37, 5)\n"
    "A = [cvec(24, 3 + r) for r in range(24)]\n"
    "def ref_mm(i, j):\n"
    "    return sum(A[i][k] * A[j][k] for k in range(24))\n"
    "def same(got, want, what):\n"
    "    assert complex(got) == want, '%s: got %r, want %r' % (what, complex(got), want)\n"
)
# One NCCL rank (argv: rank, world size, rendezvous file), run as `python -c`.
_NCCL_RANK = (
    "import datetime, sys, torch, torch.distributed as dist\n"
    "rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
    "torch.cuda.set_device(rank)\n"
    "dist.init_process_group('nccl', init_method='file://' + store, rank=rank, world_size=world,\n"
    "                        timeout=datetime.timedelta(seconds=90))\n"
    "t = torch.full((1024,), float(rank + 1), device='cuda')\n"
    "dist.all_reduce(t)\n"
    "torch.cuda.synchronize()\n"
    "got, want = (float(t.min()), float(t.max())), world * (world + 1) / 2.0\n"
    "dist.destroy_process_group()\n"
    "assert got == (want, want), 'rank %d got %r, want %r' % (rank, got, want)\n"
)
SECTIONS = {
    "numpy_matmul": (
        "import numpy as np\n"
        "a = np.arange(96 * 96, dtype=np.float64).reshape(96, 96) % 7\n"
        "c = a @ a.T\n"
        "r = [sum(a[i, k] * a[j, k] for k in range(96)) for i, j in ((0, 0), (5, 90), (95, 3))]\n"
        "assert all(abs(c[i, j] - x) < 1e-9 for (i, j), x in zip(((0, 0), (5, 90), (95, 3)), r)), c\n"
        "report()\n"
    ),
    # zdotc/zdotu return a complex value, and how depends on the Fortran ABI: MKL without
    # MKL_INTERFACE_LAYER=GNU under gfortran-built NumPy/SciPy gets it wrong.
    "numpy_complex": _COMPLEX_DATA + (
        "import numpy as np\n"
        "xv, yv = np.array(x, dtype=np.complex128), np.array(y, dtype=np.complex128)\n"
        "same(np.vdot(xv, yv), ref_dot(x, y, True), 'numpy.vdot (zdotc)')\n"
        "same(np.dot(xv, yv), ref_dot(x, y, False), 'numpy.dot (zdotu)')\n"
        "m = np.array(A, dtype=np.complex128)\n"
        "c = m @ m.T\n"
        "for i, j in ((0, 0), (3, 17), (23, 5)):\n"
        "    same(c[i, j], ref_mm(i, j), 'numpy.matmul (zgemm) [%d,%d]' % (i, j))\n"
        "try:\n"
        "    from scipy.linalg import blas\n"
        "except ImportError:\n"
        "    report(scipy=None)\n"
        "else:\n"
        "    same(blas.zdotc(xv, yv), ref_dot(x, y, True), 'scipy.linalg.blas.zdotc')\n"
        "    same(blas.zdotu(xv, yv), ref_dot(x, y, False), 'scipy.linalg.blas.zdotu')\n"
        "    import scipy\n"
        "    report(scipy=scipy.__version__)\n"
    ),
    "torch_matmul": (
        "import numpy, torch\n"
        "a = torch.arange(96 * 96, dtype=torch.float64).reshape(96, 96) % 7\n"
        "c = a @ a.T\n"
        "x = float(sum(a[5, k] * a[90, k] for k in range(96)))\n"
        "assert abs(float(c[5, 90]) - x) < 1e-9, (float(c[5, 90]), x)\n"
        "report()\n"
    ),
    "torch_complex": _COMPLEX_DATA + (
        "import numpy, torch\n"
        "xt, yt = torch.tensor(x, dtype=torch.complex128), torch.tensor(y, dtype=torch.complex128)\n"
        "same(torch.dot(xt, yt), ref_dot(x, y, False), 'torch.dot')\n"
        "same(torch.vdot(xt, yt), ref_dot(x, y, True), 'torch.vdot')\n"
        "m = torch.tensor(A, dtype=torch.complex128)\n"
        "c = m @ m.T\n"
        "for i, j in ((0, 0), (3, 17), (23, 5)):\n"
        "    same(c[i, j].item(), ref_mm(i, j), 'torch.matmul [%d,%d]' % (i, j))\n"
        "report()\n"
    ),
    # torch.compile's Inductor backend writes and compiles C++ (CPU) or Triton kernels (GPU,
    # with a C launcher built against Python's headers): it needs a working compiler. The
    # check is about the toolchain, so it buys the cheapest real compile: scalar kernels,
    # no compile-worker pool, no precompiled header (building one costs more than the one
    # kernel it would serve), and an empty cache of its own so nothing compiled earlier on
    # this machine can stand in for the compiler.
    # Where Inductor (and Triton) would write and then map compiled code from: the image's
    # TORCHINDUCTOR_CACHE_DIR, else the temporary directory. A read-only root with a noexec
    # /tmp (Docker's --tmpfs default) leaves torch.compile nowhere to load a kernel from.
    "compile_place": (
        "import os, tempfile\n"
        "base = os.environ.get('TORCHINDUCTOR_CACHE_DIR') or tempfile.gettempdir()\n"
        "probe = base\n"
        "while probe and not os.path.exists(probe):\n"
        "    probe = os.path.dirname(probe)\n"
        "flags = os.statvfs(probe or '/').f_flag\n"
        "report(dir=base, env=os.environ.get('TORCHINDUCTOR_CACHE_DIR'), triton=os.environ.get('TRITON_CACHE_DIR'),\n"
        "       writable=os.access(probe or '/', os.W_OK | os.X_OK) and not flags & os.ST_RDONLY,\n"
        "       noexec=bool(flags & os.ST_NOEXEC))\n"
    ),
    "torch_compile": (
        "import os, shutil, tempfile, time\n"
        "os.environ.setdefault('TORCHINDUCTOR_VEC_ISA_OK', '0')\n"
        "os.environ.setdefault('TORCHINDUCTOR_COMPILE_THREADS', '1')\n"
        "os.environ.setdefault('TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS', '0')\n"
        "base = os.environ.get('TORCHINDUCTOR_CACHE_DIR') or tempfile.gettempdir()\n"
        "os.makedirs(base, exist_ok=True)\n"
        "cache = tempfile.mkdtemp(prefix='probe-inductor-', dir=base)\n"
        "os.environ['TORCHINDUCTOR_CACHE_DIR'] = cache\n"
        "os.environ['TRITON_CACHE_DIR'] = os.path.join(cache, 'triton')\n"
        "try:\n"
        "    import numpy, torch\n"
        "    def f(x, w):\n"
        "        return torch.relu(x @ w).sum(dim=1) * 0.5 + torch.tanh(x).mean()\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    x, w = torch.randn(32, 16, generator=g), torch.randn(16, 8, generator=g)\n"
        "    devices = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])\n"
        "    cxx = os.environ.get('CXX') or 'g++'\n"
        "    t = time.perf_counter()\n"
        "    for dev in devices:\n"
        "        torch._dynamo.reset()\n"
        "        xd, wd = x.to(dev), w.to(dev)\n"
        "        got = torch.compile(f, backend='inductor', fullgraph=True)(xd, wd)\n"
        "        torch.testing.assert_close(got, f(xd, wd), rtol=1e-4, atol=1e-4)\n"
        "    report(devices=devices, seconds=round(time.perf_counter() - t, 2), cxx=shutil.which(cxx))\n"
        "finally:\n"
        "    shutil.rmtree(cache, ignore_errors=True)\n"
    ),
    # DataLoader workers hand their batches to the loader through shared memory (/dev/shm):
    # one batch of 80 MiB from each of 2 workers outgrows Docker's default 64 MB. A worker
    # that cannot allocate its batch there fails in its queue's feeder thread and the loader
    # would wait forever: hence the loader's own timeout.
    "dataloader_shm": (
        "import multiprocessing as mp\n"
        "import torch\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "MIB = 80\n"
        "class Big(Dataset):\n"
        "    def __len__(self):\n"
        "        return 2\n"
        "    def __getitem__(self, i):\n"
        "        return torch.full((MIB << 18,), float(i + 1))\n"
        "loader = DataLoader(Big(), batch_size=None, num_workers=2, prefetch_factor=1, timeout=20 * SLOWDOWN,\n"
        "                    multiprocessing_context=mp.get_context('fork'))\n"
        "got = sorted(float(b[0]) + float(b[-1]) for b in loader)\n"
        "assert got == [2.0, 4.0], 'batches came back as %r' % (got,)\n"
        "report(workers=2, batch_mib=MIB)\n"
    ),
    # Two processes (this one and a fork of it) all_reduce over gloo, rendezvous through a
    # file: what a CPU DDP job does, on loopback only (probe containers have no network).
    "gloo_all_reduce": (
        "import datetime, os, tempfile\n"
        "import torch, torch.distributed as dist\n"
        "store = os.path.join(tempfile.mkdtemp(prefix='probe-dist-'), 'store')\n"
        "WORLD = 2\n"
        "def rank_main(rank):\n"
        "    dist.init_process_group('gloo', init_method='file://' + store, rank=rank, world_size=WORLD,\n"
        "                            timeout=datetime.timedelta(seconds=60 * SLOWDOWN))\n"
        "    try:\n"
        "        t = torch.full((1024,), float(rank + 1))\n"
        "        dist.all_reduce(t)\n"
        "        return float(t.min()), float(t.max())\n"
        "    finally:\n"
        "        dist.destroy_process_group()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    code = 1\n"
        "    try:\n"
        "        code = 0 if rank_main(1) == (3.0, 3.0) else 2\n"
        "    finally:\n"
        "        os._exit(code)\n"
        "try:\n"
        "    got = rank_main(0)\n"
        "except BaseException:\n"
        "    os.kill(pid, 9)\n"
        "    raise\n"
        "finally:\n"
        "    status = os.waitpid(pid, 0)[1]\n"
        "assert got == (3.0, 3.0), 'rank 0 got %r, want 3.0 everywhere' % (got,)\n"
        "assert status == 0, 'rank 1 ended with wait status %d' % status\n"
        "report(backend='gloo', world_size=WORLD)\n"
    ),
    # NCCL (GPU only): each rank a fresh interpreter on its own device (NCCL refuses two ranks
    # on one GPU, so one GPU gives a 1-rank all_reduce: still NCCL's init and a kernel).
    "nccl_all_reduce": "RANK_CODE = %r\n" % _NCCL_RANK + (
        "import os, subprocess, sys, tempfile\n"
        "import torch\n"
        "devices = torch.cuda.device_count()\n"
        "world = min(2, devices)\n"
        "assert world >= 1, 'no CUDA device visible'\n"
        "store = os.path.join(tempfile.mkdtemp(prefix='probe-nccl-'), 'store')\n"
        "procs = [subprocess.Popen([sys.executable, '-c', RANK_CODE, str(r), str(world), store],\n"
        "                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)\n"
        "         for r in range(world)]\n"
        "try:\n"
        "    outs = [p.communicate(timeout=150)[0].decode(errors='replace') for p in procs]\n"
        "finally:\n"
        "    for p in procs:\n"
        "        if p.poll() is None:\n"
        "            p.kill()\n"
        "bad = ['rank %d: exit %s: %s' % (r, p.returncode, (out.strip().splitlines() or [''])[-1])\n"
        "       for r, (p, out) in enumerate(zip(procs, outs)) if p.returncode]\n"
        "assert not bad, '; '.join(bad)\n"
        "report(backend='nccl', world_size=world, devices=devices)\n"
    ),
}
# Which child runs which sections, in order.
CHILDREN = {
    "numpy": ("numpy_matmul", "numpy_complex"),
    "torch": ("torch_matmul", "torch_complex"),
    "compile": ("compile_place", "torch_compile"),
    "launch": ("dataloader_shm", "gloo_all_reduce"),
    "nccl": ("nccl_all_reduce",),
}
CHILD_TIMEOUT = {"numpy": 120, "torch": 120, "compile": 240, "launch": 150, "nccl": 180}
SLOWDOWN = 1.0  # --slowdown: every timeout of the probe's own is multiplied by it (emulated runs)


def slowdown(argv):
    """The factor after --slowdown (at least 1; 1 when absent or not a number)."""
    args = list(argv)
    try:
        return max(1.0, float(args[args.index("--slowdown") + 1]))
    except (ValueError, IndexError):
        return 1.0


def child_code(sections):
    """A fresh interpreter's program: every section in its own try block, in order."""
    parts = [_REPORT, "SLOWDOWN = %r\n" % SLOWDOWN]
    for name in sections:
        body = "".join("    " + line + "\n" for line in SECTIONS[name].splitlines())
        parts.append("SECTION = %r\ntry:\n%sexcept BaseException as exc:\n    failed(exc)\n" % (name, body))
    return "".join(parts)


class Child(object):
    """One child process running sections; its stdout and stderr go to unnamed temporary
    files (no pipe to fill up, no thread to drain it)."""

    def __init__(self, sections, timeout):
        import tempfile
        self.sections, self.timeout = tuple(sections), timeout
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.deadline = time.monotonic() + timeout
        self.pid, self.popen, self.returncode, self.why = None, None, None, None

    @classmethod
    def spawn(cls, sections, timeout):
        """A fresh interpreter (`python -c`)."""
        child = cls(sections, timeout)
        try:
            child.popen = subprocess.Popen([sys.executable, "-c", child_code(sections)], stdin=subprocess.DEVNULL,
                                           stdout=child.out, stderr=child.err)
        except Exception as exc:
            child.why = _err(exc)
        return child

    @classmethod
    def fork(cls, sections, timeout):
        """A fork of this process: the sections run with what the probe has imported so far."""
        child = cls(sections, timeout)
        if not hasattr(os, "fork"):
            return cls.spawn(sections, timeout)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except Exception as exc:
            child.why = _err(exc)
            return child
        if pid == 0:  # the child: run the sections, never return into the probe
            try:
                os.dup2(child.err.fileno(), 2)
                os.dup2(child.err.fileno(), 1)
                sys.stdout = sys.stderr = open(2, "w", buffering=1, closefd=False)  # whatever they were
                _run_sections(sections, child.out.fileno())
            finally:
                os._exit(0)
        child.pid = pid
        return child

    def poll(self):
        """True once the child has ended (or could not start)."""
        if self.why is not None or self.returncode is not None:
            return True
        if self.popen is not None:
            code = self.popen.poll()
        else:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            code = None if done == 0 else (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                                           else os.WEXITSTATUS(status))
        if code is not None:
            self.returncode = code
            return True
        if time.monotonic() > self.deadline:
            self.kill()
            self.why = "timed out after %d s" % self.timeout
            return True
        return False

    def kill(self):
        try:
            if self.popen is not None:
                self.popen.kill()
                self.popen.wait()
            elif self.pid is not None:
                os.kill(self.pid, 9)
                os.waitpid(self.pid, 0)
        except Exception:
            pass

    def results(self):
        """{section: {"ok", "returncode", "error", "info"}} for every section."""
        reported = {}
        for line in _read_file(self.out).splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("section") in self.sections:
                reported[doc["section"]] = doc
        stderr = _read_file(self.err).strip()
        errors = [line for line in stderr.splitlines() if "Error" in line or "error" in line]
        tail = " | ".join((errors or stderr.splitlines())[-3:])
        out = {}
        for name in self.sections:
            doc = reported.get(name)
            if doc is None:
                cut = self.why or ("exit %s" % self.returncode)
                out[name] = {"ok": False, "returncode": self.returncode, "info": None,
                             "error": "%s before this section finished%s" % (cut, ": " + tail if tail else "")}
                continue
            ok = doc.get("ok") is True and isinstance(doc.get("info"), dict)
            out[name] = {"ok": ok, "returncode": self.returncode, "info": doc.get("info") if ok else None,
                         "error": None if ok else (doc.get("error") or "no result")}
        return out


def _read_file(f):
    try:
        f.seek(0)
        return f.read().decode("utf-8", "replace")
    except Exception:
        return ""


def _run_sections(sections, fd):
    """In a forked child: each section's code in a fresh namespace, one JSON line each."""
    def write(doc):
        data = (json.dumps(doc) + "\n").encode("utf-8")
        while data:
            data = data[os.write(fd, data):]
    for name in sections:
        def report(name=name, **kw):
            write(dict(ok=True, section=name, info=kw))
        try:
            exec(compile(SECTIONS[name], "<probe section %s>" % name, "exec"), {"report": report, "SLOWDOWN": SLOWDOWN})
        except BaseException as exc:
            write(dict(ok=False, section=name, error=_err(exc)))
        finally:
            sys.stderr.flush()


def collect(children):
    """Wait for every child (each until its own deadline) and merge their sections."""
    while not all([c.poll() for c in children]):
        time.sleep(0.02)
    out = {}
    for child in children:
        out.update(child.results())
    return out


def _realpath(path):
    try:
        return os.path.realpath(path) if path else None
    except Exception:
        return None


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


# -- the SBOM's inventory (host side: sbom.py), gathered in this same container run ---------------
DPKG_STATUS = "/var/lib/dpkg/status"
DPKG_FIELDS = ("Package", "Version", "Architecture", "Source", "Status")
# the native libraries an SBOM names when this process has them mapped (/proc/self/maps)
NATIVE_LIBS = (
    ("openblas", r"libopenblas[^/]*\.so[^/]*|libscipy_openblas[^/]*\.so[^/]*"),
    ("mkl", r"libmkl_[a-z0-9_]+\.so[^/]*"), ("blas", r"libblas\.so[^/]*"), ("lapack", r"liblapack\.so[^/]*"),
    ("openmp", r"libgomp[^/]*\.so[^/]*|libiomp5\.so[^/]*|libomp\.so[^/]*"),
    ("cudart", r"libcudart\.so[^/]*"), ("cudnn", r"libcudnn[a-z_]*\.so[^/]*"), ("nccl", r"libnccl\.so[^/]*"),
    ("cublas", r"libcublas(?:Lt)?\.so[^/]*"),
)


def dpkg_packages(path=DPKG_STATUS):
    """[{name, version, arch, source}] of every installed package in dpkg's status file."""
    out, entry = [], {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
    except OSError:
        return None
    for line in lines + [""]:
        if not line.strip():
            if entry.get("Package") and entry.get("Version") and entry.get("Status", "").endswith(" installed"):
                out.append({"name": entry["Package"], "version": entry["Version"],
                            "arch": entry.get("Architecture"), "source": entry.get("Source")})
            entry = {}
        elif not line[:1].isspace() and ":" in line:
            key, _, value = line.partition(":")
            if key in DPKG_FIELDS:
                entry[key] = value.strip()
    return sorted(out, key=lambda e: (e["name"], e.get("arch") or ""))


def conda_records():
    """[{name, version, build, channel, subdir, sha256}] of the environment's conda-meta records."""
    out = []
    for path in sorted(glob.glob(os.path.join(sys.prefix, "conda-meta", "*.json"))):
        with open(path) as f:
            r = json.load(f)
        out.append({k: r.get(k) for k in ("name", "version", "build", "channel", "subdir", "sha256")})
    return out or None


def mapped_libraries():
    """{kind: sorted real paths} of the shared libraries this process has mapped."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            part = line.split(None, 5)
            if len(part) == 6 and part[5].startswith("/"):
                paths.add(part[5].strip())
    out = {}
    for kind, pattern in NATIVE_LIBS:
        found = sorted(p for p in paths if re.fullmatch(pattern, os.path.basename(p)))
        if found:
            out[kind] = found
    return out


def native_versions():
    """Versions of the CUDA runtime, cuDNN and NCCL as the loaded torch reports them."""
    torch = sys.modules.get("torch")
    out = {"cuda": None, "cudnn": None, "nccl": None}
    if torch is None:
        return out
    for key, fn in (("cuda", lambda: torch.version.cuda),
                    ("cudnn", lambda: torch.backends.cudnn.version() if torch.version.cuda else None),
                    ("nccl", lambda: ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None)):
        try:
            value = _quiet(fn)
            out[key] = None if value is None else str(value)
        except Exception:
            pass
    return out


def probe_sbom():
    """What an SBOM lists besides the Python distributions (packages.python): Debian packages,
    conda records with their build and channel, and the native libraries mapped right now."""
    out = {"dpkg": None, "conda": None, "libraries": None, "versions": None, "error": None}
    errors = []
    for key, fn in (("dpkg", dpkg_packages), ("conda", conda_records), ("libraries", mapped_libraries),
                    ("versions", native_versions)):  # one unreadable source must not hide the others
        try:
            out[key] = fn()
        except Exception as exc:  # e.g. conda-meta records only their owner may read
            errors.append("%s: %s" % (key, _err(exc)))
    out["error"] = "; ".join(errors) or None
    return out


def probe_threadpools():
    """threadpool_info() with numpy and torch both imported: (openmp list, mkl list, full list, error).
    OpenMP libraries carry their real path: conda-forge's libgomp.so.1 and libiomp5.so are
    symlinks to LLVM's libomp.so, one runtime under three names."""
    try:
        import threadpoolctl
        info = _quiet(threadpoolctl.threadpool_info)
        openmp = [dict(_pick(e, OPENMP_KEYS), realpath=_realpath(e.get("filepath")))
                  for e in info if e.get("user_api") == "openmp"]
        mkl = [_pick(e, MKL_KEYS) for e in info if e.get("internal_api") == "mkl"]
        return openmp, mkl, info, None
    except Exception as exc:
        return None, None, None, _err(exc)


def probe_bytecode():
    """Modules imported so far whose bytecode is missing or stale: each of them would be
    compiled again by every process that imports it (and cannot be cached by a user who
    cannot write to the environment)."""
    import importlib.util
    checked, missing, stale = 0, [], []
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        origin, cached = getattr(spec, "origin", None), getattr(spec, "cached", None)
        if not (origin and cached and origin.endswith(".py") and os.path.isfile(origin)):
            continue
        checked += 1
        try:
            with open(cached, "rb") as f:
                header = f.read(16)
        except OSError:
            missing.append(name)
            continue
        if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
            stale.append(name)
            continue
        flags = int.from_bytes(header[4:8], "little")
        if flags == 0:  # timestamp-based: source mtime and size must match
            st = os.stat(origin)
            if (int.from_bytes(header[8:12], "little") != int(st.st_mtime) & 0xFFFFFFFF
                    or int.from_bytes(header[12:16], "little") != st.st_size & 0xFFFFFFFF):
                stale.append(name)
    return {"checked": checked, "missing": len(missing), "stale": len(stale),
            "examples": sorted(missing + stale)[:5], "dont_write": bool(sys.dont_write_bytecode)}


def probe_activation():
    """What the environment's activate.d scripts export, compared with this process's
    environment: conda sets some variables (MKL_INTERFACE_LAYER for conda-forge's MKL) only
    there, and an image that merely puts the environment on PATH never runs them."""
    prefix = sys.prefix
    folder = os.path.join(prefix, "etc", "conda", "activate.d")
    scripts = sorted(glob.glob(os.path.join(folder, "*.sh")))
    out = {"prefix": prefix, "scripts": [os.path.basename(s) for s in scripts], "exported": {},
           "missing": [], "different": [], "error": None}
    if not scripts:
        return out
    start = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/"), "CONDA_PREFIX": prefix}
    code = 'for f in "$CONDA_PREFIX"/etc/conda/activate.d/*.sh; do . "$f" >&2; done; env -0'
    try:
        r = subprocess.run(["bash", "-c", code], env=start, capture_output=True, timeout=60)
        after = dict(item.split("=", 1) for item in r.stdout.decode(errors="replace").split("\0") if "=" in item)
    except Exception as exc:
        out["error"] = _err(exc)
        return out
    for key, value in sorted(after.items()):
        if key in ("_", "SHLVL", "PWD", "OLDPWD") or start.get(key) == value:
            continue
        out["exported"][key] = value
        have = os.environ.get(key)
        if have is None:
            out["missing"].append(key)
        elif key.endswith("PATH"):  # list-valued: every entry activation adds must be there
            added = [p for p in value.split(":") if p and p not in start.get(key, "").split(":")]
            if any(p not in have.split(":") for p in added):
                out["different"].append(key)
        elif have != value:
            out["different"].append(key)
    return out


def _mount(path):
    """(read-only, noexec, size in bytes) of the filesystem holding `path`."""
    st = os.statvfs(path)
    return bool(st.f_flag & os.ST_RDONLY), bool(st.f_flag & os.ST_NOEXEC), st.f_blocks * st.f_frsize


def probe_launch():
    """How this container was launched, as the process sees it: the launch mode's checks
    compare it with what the mode asked for (an engine that ignored an option shows here).
    /dev/shm's size is what DataLoader workers can hand over at once."""
    import tempfile
    out = {"home": os.environ.get("HOME"), "home_writable": None, "root_read_only": None,
           "tmp": tempfile.gettempdir(), "tmp_writable": None, "tmp_noexec": None, "shm_bytes": None, "error": None}
    try:
        home = out["home"]
        out["home_writable"] = bool(home) and os.path.isdir(home) and os.access(home, os.W_OK)
        out["root_read_only"] = _mount("/")[0]
        read_only, out["tmp_noexec"], _ = _mount(out["tmp"])
        out["tmp_writable"] = not read_only and os.access(out["tmp"], os.W_OK)
        out["shm_bytes"] = _mount("/dev/shm")[2] if os.path.isdir("/dev/shm") else 0
    except Exception as exc:
        out["error"] = _err(exc)
    return out


def probe_compiler():
    import shutil
    names = [os.environ.get("CXX"), os.environ.get("CC"), "g++", "gcc", "cc", "c++"]
    return {n: shutil.which(n) for n in names if n}


def _sections(result, steps):
    for key, fn in steps:  # one failing section must not hide the others
        try:
            result[key] = fn()
        except Exception as exc:
            result[key] = {"error": _err(exc)}


def _start(children, result, how, name):
    try:
        children.append(how(CHILDREN[name], CHILD_TIMEOUT[name] * SLOWDOWN))
    except Exception as exc:
        result.setdefault("compute_errors", []).append("%s: %s" % (name, _err(exc)))


def run(argv=()):
    global SLOWDOWN
    SLOWDOWN = slowdown(argv)
    result = {"probe_version": PROBE_VERSION}
    children = []
    if "--no-compile" not in argv:  # the longest child starts first
        _start(children, result, Child.spawn, "compile")
    _sections(result, (("python", probe_python), ("user", probe_user), ("cpus", probe_cpus),
                       ("launch", probe_launch),
                       ("env", lambda: {k: os.environ.get(k) for k in ENV_VARS}),
                       ("numpy", probe_numpy)))  # before torch, see module docstring
    _start(children, result, Child.fork, "numpy")  # NumPy is loaded, torch is not
    torch, result["torch"] = import_torch()
    _start(children, result, Child.fork, "torch")  # torch is loaded, CUDA untouched
    _start(children, result, Child.fork, "launch")  # DataLoader workers, gloo ranks: forks too
    _sections(result, (("torch", lambda: probe_torch(torch, result["torch"])),
                       ("bytecode", probe_bytecode),  # after the imports it inspects
                       ("activation", probe_activation),
                       ("compiler", probe_compiler),
                       ("packages", probe_packages),
                       ("sbom", probe_sbom)))  # after every import: the libraries it maps are loaded
    if isinstance(result.get("torch"), dict) and result["torch"].get("cuda_available") is True:
        _start(children, result, Child.spawn, "nccl")  # CUDA is in use here now: fresh interpreters
    result["openmp"], result["mkl"], result["threadpool_info"], result["threadpool_error"] = probe_threadpools()
    result["compute"] = collect(children)
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
            result = run(sys.argv[1:])
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
