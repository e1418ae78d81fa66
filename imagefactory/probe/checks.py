"""Judge a probe report (resources/probe.py's JSON) against the cell it was built from.

Every expectation comes from the Cell, never from the image. judge() never raises:
a probe from a broken image (missing keys, wrong types, {}) yields failing checks.

A probe that ran emulated (binfmt/QEMU on a host of another platform, platforms.Emulated) is
judged the same, but for what only means something natively: its timings are NOT_JUDGED
("emulated: not judged"), never passed or failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Iterable, Literal

import math
import os

from imagefactory.config import platforms
from imagefactory.config.model import AUTO, Cell

Verdict = Literal["pass", "fail", "skip", "info", "not-judged"]
PASS: Final = "pass"
FAIL: Final = "fail"
SKIP: Final = "skip"  # not checked for this cell (openblas cell: no MKL check), with why
INFO: Final = "info"  # a measurement, never a verdict
NOT_JUDGED: Final = "not-judged"  # a measurement only a native run gives meaning (emulated: not judged)
EMULATED = "emulated: not judged"  # what a NOT_JUDGED check says, before what was measured


@dataclass(frozen=True)
class Check:
    name: str
    expected: str
    actual: str
    verdict: Verdict
    detail: str = ""  # one line, why, for failures
    mode: str = ""  # the launch mode whose probe this judges (smoke.MODES), "" when judged alone


def passed(checks: Iterable[Check]) -> bool:
    return all(c.verdict != FAIL for c in checks)


def launches(found: Iterable[Check]) -> dict[str, str]:
    """{launch mode: "pass" | "fail"} from checks tagged with their mode, in the order first seen."""
    out: dict[str, str] = {}
    for c in found:
        if c.mode:
            out[c.mode] = FAIL if c.verdict == FAIL or out.get(c.mode) == FAIL else PASS
    return out


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _check(name: str, expected: str, actual: Any, ok: bool, detail: str = "") -> Check:
    return Check(name, expected, _one_line(actual), PASS if ok else FAIL, "" if ok else _one_line(detail))


def _major_minor(version: Any) -> str | None:
    return ".".join(str(version).split(".")[:2]) if version else None


def _release(version: str) -> Any:
    """'2.7.1+cu126' -> (2, 7, 1); '2.7.0' == '2.7' (PEP 440 zero padding); odd strings stay strings."""
    base = version.split("+", 1)[0].strip()
    parts = base.split(".")
    if not all(p.isdigit() for p in parts):
        return base
    nums = [int(p) for p in parts]
    while len(nums) > 1 and nums[-1] == 0:
        nums.pop()
    return tuple(nums)


def _section_check(name: str, section: Any) -> Check:
    if not isinstance(section, dict):
        return _check(name, "imported", "missing from probe", False, "the probe reported no such section")
    error = section.get("error")
    return _check(name, "imported", error or "ok", not error, error or "")


def _torch_problem(torch: Any) -> str | None:
    """Why torch-derived checks cannot be judged, or None."""
    if not isinstance(torch, dict):
        return "torch not reported"
    if torch.get("error"):
        return "torch not importable"
    return None


def judge(cell: Cell, probe: dict, *, gpu_required: bool, emulation: platforms.Emulated | None = None) -> list[Check]:
    """Every check of `probe` against `cell`; under `emulation` the timings are not judged."""
    try:
        found = _judge(cell, probe if isinstance(probe, dict) else {}, gpu_required)
    except Exception as exc:  # a bug here must not hide the image's verdict
        return [_check("probe.judge", "judged", "crashed", False, f"{type(exc).__name__}: {exc}")]
    return [not_judged(c, emulation) if emulation and c.name in NATIVE_ONLY else c for c in found]


# The checks whose value is a speed: under emulation (about ten times slower, platforms.Emulation)
# it says nothing about the image. Every other check is functional and judged as natively.
NATIVE_ONLY = frozenset({"probe.import_time"})


def not_judged(c: Check, emulation: platforms.Emulated) -> Check:
    """`c` as an emulated run reports it: NOT_JUDGED, its measurement kept after the words."""
    return Check(c.name, c.expected, _one_line(f"{EMULATED} ({emulation}): {c.actual}"), NOT_JUDGED,
                 f"measured under {emulation}: speed only means something on a {emulation.target.oci} host",
                 c.mode)


def _machine(cell: Cell, python: Any) -> Check:
    """The machine the probe's interpreter runs on (`uname -m`) is the cell's platform's: an image
    of another platform fails here even where the engine ran it (under binfmt/QEMU)."""
    machine = _get(python, "machine")
    seen = platforms.native(machine) if isinstance(machine, str) and machine else None
    want = cell.platform.arch
    return _check("platform.machine", want, machine if isinstance(machine, str) and machine else "not reported",
                  seen == cell.platform,
                  f"the probe ran on {machine} (uname -m), the cell is {cell.platform.oci} ({want}): the image's "
                  f"binaries are not the cell's platform's" if machine else "the probe reported no machine")


def _judge(cell: Cell, probe: dict, gpu_required: bool) -> list[Check]:
    checks = [_section_check("probe.numpy", probe.get("numpy")), _section_check("probe.torch", probe.get("torch"))]
    torch: Any = probe.get("torch")
    no_torch = _torch_problem(torch)  # actual value of every torch-derived check when set
    torch_why = no_torch and (_get(torch, "error") or no_torch)  # its detail
    mkl = cell.blas == "mkl"

    py = _major_minor(_get(probe, "python", "version"))
    checks.append(_check("python.version", cell.python, py or "not reported", py == cell.python,
                         f"python {py} in the image, cell wants {cell.python}" if py else "no python version reported"))
    checks.append(_machine(cell, probe.get("python")))

    uid = _get(probe, "user", "uid")
    checks.append(_check("user.non_root", "uid != 0", f"uid {uid}" if uid is not None else "not reported",
                         isinstance(uid, int) and uid != 0, "the image runs as root" if uid == 0 else "no uid reported"))

    # torch build
    version = no_torch or str(torch.get("version"))
    checks.append(_check("torch.version", cell.torch, version,
                         not no_torch and _release(version) == _release(cell.torch),
                         torch_why or f"torch {version}, cell wants {cell.torch}"))
    cuda = None if no_torch else torch.get("cuda")
    if cell.cuda is None:
        checks.append(_check("torch.cuda_build", "none (CPU build)", no_torch or cuda or "none",
                             not no_torch and cuda is None, torch_why or f"CPU cell got a CUDA {cuda} build of torch"))
    else:
        seen = no_torch or (_major_minor(cuda) or "none (CPU build)")
        checks.append(_check("torch.cuda_build", cell.cuda, seen, not no_torch and seen == cell.cuda,
                             torch_why or f"torch built for CUDA {seen}, cell wants {cell.cuda}"))
    checks += _gpu_checks(cell, torch, no_torch, torch_why, gpu_required)

    # BLAS
    blas = _get(probe, "numpy", "blas")
    apis = sorted({str(_get(b, "internal_api")) for b in blas}) if isinstance(blas, list) else []
    libraries = _blas_libraries(blas)
    if len(apis) > 1:
        why = f"numpy's process loads {len(apis)} BLAS libraries: {', '.join(apis)} ({libraries})"
    elif apis:
        why = f"numpy's BLAS is {apis[0]} ({libraries}), cell wants {cell.blas}"
    else:
        why = f"no BLAS found for numpy ({_get(probe, 'numpy', 'error') or 'threadpoolctl saw none'})"
    checks.append(_check("numpy.blas", cell.blas, ", ".join(apis) or "none", apis == [cell.blas], why))
    if mkl:
        mkl_seen = None if no_torch else (torch.get("mkl_available") is True or torch.get("blas_info") == "mkl")
        actual = no_torch or f"mkl_available={torch.get('mkl_available')}, BLAS_INFO={torch.get('blas_info')}"
        checks.append(_check("torch.mkl", "True", actual, bool(mkl_seen), torch_why or "torch was not built with MKL"))
    else:
        checks.append(Check("torch.mkl", "not checked (openblas cell)", _one_line(no_torch or torch.get("mkl_available")), SKIP))

    # Environment: MKL's threading layer must match the OpenMP runtime actually loaded.
    env: dict[str, Any] = probe["env"] if isinstance(probe.get("env"), dict) else {}
    checks.append(_mkl_layer(mkl, env, probe.get("mkl"), probe.get("openmp")))
    checks.append(_activation(probe.get("activation")))
    checks.append(_bytecode(probe.get("bytecode")))
    want = str(_thread_budget(probe) if cell.threads == AUTO else cell.threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        value = env.get(var)
        checks.append(_check(f"env.{var}", want, value if value is not None else "unset", value == want,
                             f"{var} is {'unset' if value is None else repr(value)} in the image, cell wants {want}"))

    # Threads as the libraries see them
    allowed, expected = _thread_counts(cell, probe)
    n = None if no_torch else torch.get("num_threads")
    checks.append(_check("threads.torch", expected, no_torch or n, n in allowed,
                         torch_why or f"torch.get_num_threads() is {n}, cell wants {cell.threads}"))
    counts = [_get(b, "num_threads") for b in blas] if isinstance(blas, list) else []
    checks.append(_check("threads.numpy_blas", expected, ", ".join(map(str, counts)) or "no BLAS found",
                         bool(counts) and all(c in allowed for c in counts),
                         f"numpy's BLAS runs {counts} threads, cell wants {cell.threads}" if counts
                         else "threadpoolctl saw no BLAS in numpy"))
    checks.append(_openmp(probe.get("openmp")))
    checks += _compute(probe.get("compute"), no_torch, torch_why)
    checks.append(_torch_compile(cell, _get(probe, "compute", "torch_compile"), _get(probe, "compute", "compile_place"),
                                 no_torch, torch_why))
    checks.append(_dataloader_shm(_get(probe, "compute", "dataloader_shm"), _get(probe, "launch", "shm_bytes"),
                                  no_torch, torch_why))
    checks += _distributed(cell, probe.get("compute"), no_torch, torch_why, gpu_required)
    checks.append(_import_time(_get(probe, "numpy", "import_seconds"), _get(probe, "torch", "import_seconds")))
    checks.append(_locked_packages(cell, probe.get("packages")))
    return checks


# Installed by `python -m venv` itself, not from the lock (unless the lock pins them too).
VENV_SEED = frozenset({"pip", "setuptools", "wheel"})


def _locked_packages(cell: Cell, packages: Any) -> Check:
    """Every package of the cell's lock is installed at the locked version, and nothing else is."""
    name = "packages.locked"
    if not cell.locked:
        return Check(name, "not checked (the cell has no lock)", "not compared", SKIP)
    want = dict(cell.locked)
    expected = f"the {len(want)} packages of the lock"
    seen = _get(packages, "python" if cell.installer == "pip" else "conda")
    if _get(packages, "error") or not isinstance(seen, dict):
        why = _get(packages, "error") or "the probe listed no installed packages"
        return _check(name, expected, "not reported", False, why)
    wrong = [f"{n} {seen[n]} (lock: {v})" for n, v in sorted(want.items()) if n in seen and seen[n] != v]
    missing = [f"{n} {v}" for n, v in sorted(want.items()) if n not in seen]
    extra = [f"{n} {v}" for n, v in sorted(seen.items())
             if n not in want and not (cell.installer == "pip" and n in VENV_SEED)]
    parts = [f"{label}: {', '.join(items)}" for label, items in
             (("other version", wrong), ("missing", missing), ("not in the lock", extra)) if items]
    actual = "; ".join(parts) or f"{len(want)} packages at the locked versions"
    return _check(name, expected, actual, not parts, actual)


def _compute(compute: Any, no_torch: str | None, torch_why: str | None) -> list[Check]:
    """A small matmul through each library, in a child process of the probe: a BLAS that
    loads but aborts at its first call fails here rather than on the training node."""
    out = []
    for name, key in (("numpy.matmul", "numpy_matmul"), ("torch.matmul", "torch_matmul"),
                      ("numpy.complex_blas", "numpy_complex"), ("torch.complex_blas", "torch_complex")):
        result = _get(compute, key)
        if name.startswith("torch.") and no_torch:
            out.append(_check(name, "correct result", no_torch, False, torch_why or no_torch))
            continue
        ok = _get(result, "ok") is True
        actual = "correct result" if ok else (_get(result, "error") or "not reported")
        if ok and key == "numpy_complex":
            scipy = _get(result, "info", "scipy")
            actual += f" (with scipy {scipy} zdotc/zdotu)" if scipy else " (scipy not installed)"
        out.append(_check(name, "correct result", actual, ok, f"{key} failed: {actual}"))
    return out


COMPILE_FIX = ("launch with --tmpfs /tmp:exec (Kubernetes: an emptyDir at /tmp), or point TORCHINDUCTOR_CACHE_DIR "
               "and TRITON_CACHE_DIR at a writable directory on a mount that allows exec")


def _torch_compile(cell: Cell, result: Any, place: Any, no_torch: str | None, torch_why: str | None) -> Check:
    """torch.compile (Inductor: C++ on CPU, Triton on GPU) compiled a function that matches eager.
    Inductor maps the code it compiles from its cache directory: when that place is not
    writable or is mounted noexec (a read-only root and Docker's --tmpfs /tmp), the failure
    says so and names the fix."""
    ok = _get(result, "ok") is True and not no_torch
    if ok:
        info = _get(result, "info") or {}
        actual = f"matches eager on {', '.join(map(str, info.get('devices') or ['cpu']))} in {info.get('seconds')} s"
    else:
        actual = no_torch or _get(result, "error") or "not reported"
    if not cell.compiler:  # the probe was told not to run it (--no-compile)
        return Check("torch.compile", "not checked (compiler: false: no C/C++ compiler in the image)",
                     _one_line(actual) if result is not None else "not run", SKIP)
    detail = torch_why or f"torch.compile failed: {actual}"
    where = _get(place, "info", "dir")
    problems = [p for p, bad in (("not writable", _get(place, "info", "writable") is False),
                                 ("mounted noexec", _get(place, "info", "noexec") is True)) if bad]
    if not ok and problems:
        detail = (f"Inductor's cache directory {where} is {' and '.join(problems)}: torch.compile has nowhere "
                  f"to write and load its kernels; {COMPILE_FIX} ({actual})")
    return _check("torch.compile", "compiles and matches eager", actual, ok, detail)


SHM_FIX = ("launch with --ipc=host or --shm-size=1g (or more); on Kubernetes mount an emptyDir with "
           "medium: Memory at /dev/shm")


def _mib(n: Any) -> str:
    return f"{n / 2**20:.0f} MiB" if isinstance(n, int) and not isinstance(n, bool) else "size unknown"


def _dataloader_shm(result: Any, shm_bytes: Any, no_torch: str | None, torch_why: str | None) -> Check:
    """A DataLoader with 2 workers whose batches (80 MiB each) outgrow Docker's default 64 MB
    /dev/shm: workers hand batches over through shared memory."""
    name, expected = "shm.dataloader", "2 workers pass 80 MiB batches through /dev/shm"
    where = f"/dev/shm: {_mib(shm_bytes)}"
    if no_torch:
        return _check(name, expected, no_torch, False, torch_why or no_torch)
    ok = _get(result, "ok") is True
    info = _get(result, "info") or {}
    actual = (f"{info.get('workers')} workers, {info.get('batch_mib')} MiB batches ({where})" if ok
              else f"{_get(result, 'error') or 'not reported'} ({where})")
    return _check(name, expected, actual, ok,
                  f"DataLoader workers could not hand over their batches through /dev/shm ({_mib(shm_bytes)}): "
                  f"{SHM_FIX} ({_get(result, 'error') or 'not reported'})")


def _distributed(cell: Cell, compute: Any, no_torch: str | None, torch_why: str | None, gpu_required: bool) -> list[Check]:
    """A 2-process torch.distributed all_reduce: gloo on CPU always, NCCL where GPUs are given."""
    out = []
    for backend, key, wanted in (("gloo", "gloo_all_reduce", True),
                                 ("nccl", "nccl_all_reduce", cell.cuda is not None and gpu_required)):
        name, result = f"torch.distributed.{backend}", _get(compute, key)
        if not wanted:
            why = "CPU cell" if cell.cuda is None else "no GPU requested"
            out.append(Check(name, f"not checked ({why})", "not run" if result is None else
                             _one_line(_get(result, "error") or "ran"), SKIP))
            continue
        if no_torch:
            out.append(_check(name, "all_reduce sums across ranks", no_torch, False, torch_why or no_torch))
            continue
        info = _get(result, "info") or {}
        ok = _get(result, "ok") is True
        actual = (f"{info.get('world_size')} ranks agree" if ok else _get(result, "error") or "not reported")
        out.append(_check(name, "all_reduce sums across ranks", actual, ok,
                          f"{backend} all_reduce failed: {actual}"))
    return out


def launch_conditions(expect: dict[str, Any], probe: Any) -> Check:
    """What the launch mode asked of the container, as the probe saw it from inside: an engine
    (or a runtime) that ignored an option would otherwise prove a launch that never happened."""
    name = "launch.conditions"
    launch = _get(probe, "launch")
    seen: dict[str, Any] = {
        "uid": _get(probe, "user", "uid"), "user name": _get(probe, "user", "name"),
        "root read-only": _get(launch, "root_read_only"), "/tmp writable": _get(launch, "tmp_writable"),
        "/tmp noexec": _get(launch, "tmp_noexec"), "HOME writable": _get(launch, "home_writable"),
        "CPUs (affinity)": _get(probe, "cpus", "affinity"),
    }
    actual = ", ".join(f"{k}: {seen[k]}" for k in (expect or seen))
    if not expect:
        return Check(name, "as the image declares (information)", _one_line(actual), INFO)
    wrong = [f"{k} is {seen.get(k)!r}, the mode asks for {v!r}" for k, v in expect.items() if seen.get(k) != v]
    return _check(name, ", ".join(f"{k}: {v}" for k, v in expect.items()), actual, not wrong,
                  "the container did not run as this launch mode asks: " + "; ".join(wrong))


def _import_time(numpy_s: Any, torch_s: Any) -> Check:
    """How long the probe's own `import numpy` then `import torch` took (information: the
    compute children run meanwhile, so on a busy machine it is an upper bound)."""
    parts = [(name, s) for name, s in (("numpy", numpy_s), ("torch", torch_s)) if _is_seconds(s)]
    if len(parts) == 2:
        actual = f"{numpy_s + torch_s:.2f} s (numpy {numpy_s:.2f} s, torch {torch_s:.2f} s)"
    else:
        actual = "not measured" + (f" (only {parts[0][0]}: {parts[0][1]:.2f} s)" if parts else "")
    return Check("probe.import_time", "import numpy, torch in the probe's process (information)",
                 _one_line(actual), INFO)


def _is_seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _openmp_libraries(openmp: Any) -> dict[str, list[str]]:
    """Loaded OpenMP runtimes by real path, each with the names it was loaded under."""
    out: dict[str, list[str]] = {}
    for e in openmp if isinstance(openmp, list) else []:
        path = _get(e, "realpath") or _get(e, "filepath") or _get(e, "prefix")
        name = _get(e, "filepath") or _get(e, "prefix")
        out.setdefault(str(path), []).append(os.path.basename(str(name)))
    return out


def _runtime_kind(path: str) -> str:
    """gnu (libgomp), llvm (libomp) or intel (libiomp5), from a runtime's real file name."""
    base = os.path.basename(path)
    for prefix, kind in (("libgomp", "gnu"), ("libiomp", "intel"), ("libomp", "llvm")):
        if base.startswith(prefix):
            return kind
    return "unknown"


# The MKL threading layer each OpenMP runtime needs (Intel: GNU only with libgomp; INTEL,
# MKL's default, with LLVM's libomp or Intel's libiomp5, which are ABI-compatible).
LAYER_FOR_RUNTIME = {"gnu": "gnu", "llvm": "intel", "intel": "intel"}


def _blas_libraries(blas: Any) -> str:
    """The BLAS libraries numpy's process loaded, by the path it loaded and, behind a switch
    (conda's libblas.so.3), the file that answers: `/opt/env/lib/libblas.so.3 -> libopenblas.so.0`."""
    out = []
    for entry in blas if isinstance(blas, list) else []:
        path, real = _get(entry, "filepath"), _get(entry, "realpath")
        if not isinstance(path, str):
            continue
        shown = path if not isinstance(real, str) or real == path else f"{path} -> {os.path.basename(real)}"
        out.append(_one_line(shown))
    return ", ".join(out) or "no library path reported"


def _mkl_layer(mkl: bool, env: dict, mkl_libs: Any, openmp: Any) -> Check:
    name = "mkl.threading_layer"
    var = env.get("MKL_THREADING_LAYER")
    seen = sorted({str(_get(e, "threading_layer")).lower() for e in mkl_libs}) if isinstance(mkl_libs, list) else []
    if seen:
        layer, source = seen[0] if len(seen) == 1 else "/".join(seen), "threadpoolctl"
    else:  # MKL linked statically (PyPI torch) is invisible to threadpoolctl: judge the setting
        layer, source = (var or "intel (MKL's default)").lower(), f"MKL_THREADING_LAYER={var or 'unset'}"
    runtimes = _openmp_libraries(openmp)
    kinds = sorted({_runtime_kind(p) for p in runtimes})
    described = "; ".join(f"{os.path.basename(p)}" + (f" (as {', '.join(sorted(set(n)))})" if sorted(set(n)) != [os.path.basename(p)] else "")
                          for p, n in sorted(runtimes.items())) or "no OpenMP runtime"
    actual = f"{layer} ({source}); loaded: {described}"
    if not mkl:
        return Check(name, "not checked (openblas cell)", _one_line(actual), SKIP)
    if len(kinds) > 1:
        return _check(name, "one OpenMP runtime", actual, False, f"two OpenMP runtimes loaded: {described}")
    if not kinds:
        return _check(name, "sequential (no OpenMP runtime loaded)", actual, layer.startswith("sequential"),
                      f"MKL's {layer} layer needs an OpenMP runtime and none is loaded")
    want = LAYER_FOR_RUNTIME.get(kinds[0])
    expected = f"{want} (for {kinds[0]} OpenMP: {described})" if want else f"a layer for {described}"
    return _check(name, expected, actual, want is not None and layer.split(" ")[0] == want,
                  f"MKL uses its {layer} threading layer but the process runs {kinds[0]} OpenMP ({described}); "
                  f"set MKL_THREADING_LAYER={(want or '?').upper()}")


def _activation(act: Any) -> Check:
    name = "env.activation"
    if not isinstance(act, dict):
        return _check(name, "activate.d exports in effect", "not reported", False, "the probe reported no activation")
    if act.get("error"):
        return _check(name, "activate.d exports in effect", act["error"], False, f"activation scripts failed: {act['error']}")
    scripts = act.get("scripts") or []
    if not scripts:
        return Check(name, "activate.d exports in effect", f"no activate.d scripts in {act.get('prefix')}", SKIP)
    missing, different = act.get("missing") or [], act.get("different") or []
    exported = sorted(act.get("exported") or {})
    actual = (f"missing: {', '.join(missing)}" if missing else "") + \
             (f"{'; ' if missing else ''}different: {', '.join(different)}" if different else "")
    return _check(name, f"set as activation sets them ({', '.join(exported) or 'nothing exported'})",
                  actual or f"all set ({', '.join(exported) or 'none'})", not missing and not different,
                  f"activation ({', '.join(scripts)}) exports {', '.join(missing + different)}, "
                  f"which the container's environment lacks or has otherwise: the entrypoint did not activate")


def _bytecode(bc: Any) -> Check:
    name = "python.bytecode"
    if not isinstance(bc, dict) or bc.get("error"):
        return _check(name, "every imported module has bytecode", _get(bc, "error") or "not reported", False,
                      "the probe could not inspect bytecode")
    missing, stale, checked = bc.get("missing"), bc.get("stale"), bc.get("checked")
    ok = missing == 0 and stale == 0 and isinstance(checked, int) and checked > 0
    actual = f"{checked} modules: {missing} without bytecode, {stale} stale"
    examples = ", ".join(map(str, bc.get("examples") or []))
    return _check(name, "every imported module has current bytecode", actual, ok,
                  f"{actual} (e.g. {examples}): every process compiles them again at import")


def _gpu_checks(cell: Cell, torch: Any, no_torch: str | None, torch_why: str | None, gpu_required: bool) -> list[Check]:
    available = None if no_torch else torch.get("cuda_available")
    devices = _get(torch, "devices") or []
    seen = no_torch or (f"available ({', '.join(map(str, devices)) or 'no device name'})" if available is True
                        else "not available")
    matmul = _get(torch, "gpu_matmul")
    mm_seen = no_torch or ("not run" if not isinstance(matmul, dict) else
                           f"ok={matmul.get('ok')}, max_abs_err={matmul.get('max_abs_err')}, tolerance={matmul.get('tolerance')}")
    if cell.cuda is None or not gpu_required:
        why = "CPU cell" if cell.cuda is None else "no GPU requested"
        return [Check("torch.gpu_available", f"not checked ({why})", f"{seen} ({why})", SKIP),
                Check("torch.gpu_matmul", f"not checked ({why})", f"{mm_seen} ({why})", SKIP)]
    mm_error = _get(matmul, "error")
    return [
        _check("torch.gpu_available", "True", seen, available is True,
               torch_why or "torch.cuda.is_available() is False: driver, toolkit or --gpus missing"),
        _check("torch.gpu_matmul", "ok", mm_seen, _get(matmul, "ok") is True,
               torch_why or mm_error or ("no GPU to run on" if available is not True else "GPU result differs from the CPU's")),
    ]


def _thread_counts(cell: Cell, probe: dict) -> tuple[list[int], str]:
    """Thread counts that honour cell.threads, and how to say so.

    OpenBLAS and MKL cap the count asked for (OMP/MKL/OPENBLAS_NUM_THREADS) at the CPUs
    they see: OpenBLAS at the affinity mask / CPU count, MKL (and so torch built with
    MKL: PyPI torch links it statically) at the physical core count, ignoring affinity.
    So OMP_NUM_THREADS=4 on a 2-CPU machine reports 2, and both 4 and 2 are right. A CFS
    quota (docker --cpus) is not an affinity mask and caps nothing.
    """
    cpus = _get(probe, "cpus")
    threads = _thread_budget(probe) if isinstance(cell.threads, str) else cell.threads  # str: "auto"
    caps = [_get(cpus, k) for k in ("affinity", "os_cpu_count", "physical_cores")]
    allowed = sorted({threads} | {min(threads, c) for c in caps if isinstance(c, int) and c > 0})
    expected = " or ".join(map(str, allowed)) + (" (capped at visible CPUs)" if len(allowed) > 1 else "")
    return allowed, expected


def _thread_budget(probe: dict) -> int:
    """The CPU budget `threads: auto` must give, by README's one rule (the image's launch hook and
    shell script apply it at start): min(affinity CPUs, floor(quota/period)), at least 1. The probe
    reports the quota unrounded (quota/period) or None; tests/unit/resources/test_launch.py runs this
    on the probe's figures against every other copy of the rule."""
    cpus = _get(probe, "cpus")
    limits = [c for c in (_get(cpus, "affinity"),) if isinstance(c, int) and c > 0]
    quota = _get(cpus, "cgroup_quota")
    if isinstance(quota, (int, float)) and not isinstance(quota, bool) and quota > 0:
        limits.append(math.floor(quota))
    return max(1, min(limits)) if limits else 1


def _openmp(openmp: Any) -> Check:
    # Two OpenMP runtimes in one process (say libgomp from torch, libiomp from MKL) give
    # "OMP: Error #15" or silent oversubscription. One runtime under several names
    # (conda-forge: libgomp.so.1 and libiomp5.so are symlinks to libomp.so) is one runtime.
    name, expected = "openmp.single_runtime", "at most one OpenMP runtime (by real path)"
    if not isinstance(openmp, list):
        return _check(name, expected, "not reported", False,
                      "the probe could not list OpenMP runtimes (threadpoolctl missing?)")
    if any(not isinstance(_get(e, "filepath") or _get(e, "prefix"), str) for e in openmp):
        return _check(name, expected, "malformed", False, "malformed OpenMP entry in the probe")
    runtimes = _openmp_libraries(openmp)
    seen = "; ".join(f"{p} (as {', '.join(sorted(set(n)))})" for p, n in sorted(runtimes.items()))
    return _check(name, expected, seen or "none loaded", len(runtimes) <= 1,
                  f"{len(runtimes)} OpenMP runtimes loaded: {seen}")
