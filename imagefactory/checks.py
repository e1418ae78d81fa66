"""Judge a probe report (resources/probe.py's JSON) against the cell it was built from.

Every expectation comes from the Cell, never from the image. judge() never raises:
a probe from a broken image (missing keys, wrong types, {}) yields failing checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from imagefactory.model import Cell

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass(frozen=True)
class Check:
    name: str
    expected: str
    actual: str
    verdict: str  # "pass" | "fail" | "skip"
    detail: str = ""  # one line, why, for failures


def passed(checks: Iterable[Check]) -> bool:
    return all(c.verdict != FAIL for c in checks)


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


def judge(cell: Cell, probe: dict, *, gpu_required: bool) -> list[Check]:
    try:
        return _judge(cell, probe if isinstance(probe, dict) else {}, gpu_required)
    except Exception as exc:  # a bug here must not hide the image's verdict
        return [_check("probe.judge", "judged", "crashed", False, f"{type(exc).__name__}: {exc}")]


def _judge(cell: Cell, probe: dict, gpu_required: bool) -> list[Check]:
    checks = [_section_check("probe.numpy", probe.get("numpy")), _section_check("probe.torch", probe.get("torch"))]
    torch: Any = probe.get("torch")
    no_torch = _torch_problem(torch)  # actual value of every torch-derived check when set
    torch_why = no_torch and (_get(torch, "error") or no_torch)  # its detail
    mkl = cell.blas == "mkl"

    py = _major_minor(_get(probe, "python", "version"))
    checks.append(_check("python.version", cell.python, py or "not reported", py == cell.python,
                         f"python {py} in the image, cell wants {cell.python}" if py else "no python version reported"))

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
    if len(apis) > 1:
        why = f"numpy's process loads {len(apis)} BLAS libraries: {', '.join(apis)}"
    elif apis:
        why = f"numpy's BLAS is {apis[0]}, cell wants {cell.blas}"
    else:
        why = f"no BLAS found for numpy ({_get(probe, 'numpy', 'error') or 'threadpoolctl saw none'})"
    checks.append(_check("numpy.blas", cell.blas, ", ".join(apis) or "none", apis == [cell.blas], why))
    if mkl:
        mkl_seen = None if no_torch else (torch.get("mkl_available") is True or torch.get("blas_info") == "mkl")
        actual = no_torch or f"mkl_available={torch.get('mkl_available')}, BLAS_INFO={torch.get('blas_info')}"
        checks.append(_check("torch.mkl", "True", actual, bool(mkl_seen), torch_why or "torch was not built with MKL"))
    else:
        checks.append(Check("torch.mkl", "not checked (openblas cell)", _one_line(no_torch or torch.get("mkl_available")), SKIP))

    # Environment. MKL next to GNU OpenMP (libgomp, as torch uses) needs MKL_THREADING_LAYER=GNU.
    env: dict[str, Any] = probe["env"] if isinstance(probe.get("env"), dict) else {}
    layer = env.get("MKL_THREADING_LAYER")
    if mkl:
        checks.append(_check("env.MKL_THREADING_LAYER", "GNU", layer or "unset", layer == "GNU",
                             "MKL shares the process with libgomp and needs MKL_THREADING_LAYER=GNU"))
    else:
        checks.append(Check("env.MKL_THREADING_LAYER", "not checked (openblas cell)", layer or "unset", SKIP))
    want = str(cell.threads)
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
    return checks


def _compute(compute: Any, no_torch: str | None, torch_why: str | None) -> list[Check]:
    """A small matmul through each library, in a child process of the probe: a BLAS that
    loads but aborts at its first call fails here rather than on the training node."""
    out = []
    for name, key in (("numpy.matmul", "numpy_matmul"), ("torch.matmul", "torch_matmul")):
        result = _get(compute, key)
        if name == "torch.matmul" and no_torch:
            out.append(_check(name, "correct result", no_torch, False, torch_why or no_torch))
            continue
        ok = _get(result, "ok") is True
        actual = "correct result" if ok else (_get(result, "error") or "not reported")
        out.append(_check(name, "correct result", actual, ok, f"{key} failed: {actual}"))
    return out


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
    caps = [_get(cpus, k) for k in ("affinity", "os_cpu_count", "physical_cores")]
    allowed = sorted({cell.threads} | {min(cell.threads, c) for c in caps if isinstance(c, int) and c > 0})
    expected = " or ".join(map(str, allowed)) + (" (capped at visible CPUs)" if len(allowed) > 1 else "")
    return allowed, expected


def _openmp(openmp: Any) -> Check:
    # Two OpenMP runtimes in one process (say libgomp from torch, libiomp from MKL) give
    # "OMP: Error #15" or silent oversubscription.
    if not isinstance(openmp, list):
        return _check("openmp.single_runtime", "at most one OpenMP runtime", "not reported", False,
                      "the probe could not list OpenMP runtimes (threadpoolctl missing?)")
    prefixes = sorted({str(_get(e, "prefix")) for e in openmp})
    malformed = any(not isinstance(_get(e, "prefix"), str) for e in openmp)
    return _check("openmp.single_runtime", "at most one OpenMP runtime", ", ".join(prefixes) or "none loaded",
                  len(prefixes) <= 1 and not malformed,
                  "malformed OpenMP entry in the probe" if malformed
                  else f"{len(prefixes)} OpenMP runtimes loaded: {', '.join(prefixes)}")
