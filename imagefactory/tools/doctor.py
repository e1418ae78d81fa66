"""`imagefactory doctor`: can this host run the matrix's images, and which tag should it pull?

Host facts (Docker engine, NVIDIA runtime or CDI, driver and GPUs) are read here;
each cell is judged against the driver table in resources/cuda_drivers.json:

- runs here: the driver is at least the toolkit's minimum (or the cell is CPU-only);
- runs with limits: older than that, but new enough for the CUDA major's
  minor-version compatibility (prebuilt kernels run, newer PTX does not JIT);
- cannot run: no GPU, a driver too old, or no way to give containers a GPU; or an image of
  another platform than this host's (linux/arm64 on an x86_64 machine runs only under QEMU).

Every value read from nvidia-smi, NVML or the engine is matched whole
(`re.fullmatch`) before it is compared or printed; other lines are ignored.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform as _host
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

from imagefactory.engine import select
from imagefactory.engine import identity
from imagefactory.config import platforms
from imagefactory.engine.api import EngineFactory
from imagefactory.errors import ImageFactoryError
from imagefactory.config.model import Cell, Matrix

RUNS, LIMITS, CANNOT = "runs", "runs-with-limits", "cannot-run"
VERDICT_TEXT = {RUNS: "runs here", LIMITS: "runs with limits", CANNOT: "cannot run"}
DRIVER_RE = re.compile(r"[0-9]{2,4}(?:\.[0-9]{1,4}){0,2}")
GPU_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._()/+\-]{0,99}")
MACHINE_RE = re.compile(r"[A-Za-z0-9_.-]{1,32}")  # `uname -m`
ENGINE_VERSION_RE = re.compile(r"[0-9]+\.[0-9]+(?:\.[0-9]+)?(?:[-+~][A-Za-z0-9.+~-]{1,40})?")
NVIDIA_SMI_ARGS = ("--query-gpu=driver_version,name", "--format=csv,noheader")
NVIDIA_SMI_TIMEOUT = 20.0
CONTAINER_TOOLKIT_FIX = ("install the NVIDIA Container Toolkit and run `nvidia-ctk runtime configure "
                         "--runtime=docker` (or `nvidia-ctk cdi generate`), then restart the engine")


def version_tuple(text: str) -> tuple[int, ...] | None:
    """'575.51.03' -> (575, 51, 3); anything that is not a whole driver version -> None."""
    text = text.strip()
    if not DRIVER_RE.fullmatch(text):
        return None
    return tuple(int(p) for p in text.split("."))


# -- the driver table ----------------------------------------------------------------------------

@dataclass(frozen=True)
class DriverTable:
    toolkits: dict[str, str]  # "12.9" -> "575.51.03"
    compat: dict[str, str]  # CUDA major "12" -> oldest driver with minor-version compatibility
    sources: dict[str, str]
    limits: str

    def source(self, key: str) -> str:
        return self.sources.get(key, key)


def load_table(text: str | None = None) -> DriverTable:
    """The shipped table (or `text`, for tests). A malformed table is a bug in imagefactory."""
    if text is None:
        text = resources.files("imagefactory").joinpath("resources/cuda_drivers.json").read_text()
    data = json.loads(text)

    def versions(section: str, key_re: str) -> dict[str, str]:
        out = {}
        for key, entry in data[section].items():
            if not re.fullmatch(key_re, key) or not DRIVER_RE.fullmatch(str(entry["min_driver"])):
                raise ValueError(f"cuda_drivers.json: {section}.{key}: bad entry {entry!r}")
            if entry["source"] not in data["sources"]:
                raise ValueError(f"cuda_drivers.json: {section}.{key}: unknown source {entry['source']!r}")
            out[key] = entry["min_driver"]
        return out

    return DriverTable(toolkits=versions("toolkits", r"[0-9]{2}\.[0-9]"),
                       compat=versions("minor_version_compatibility", r"[0-9]{2}"),
                       sources=dict(data["sources"]), limits=str(data["limits"]))


# -- host facts ----------------------------------------------------------------------------------

@dataclass
class Driver:
    version: str | None = None  # None: no usable NVIDIA driver found
    gpus: list[str] = field(default_factory=list)
    source: str = ""  # nvidia-smi | nvml
    error: str = ""  # why there is no version
    ignored_lines: int = 0  # lines of nvidia-smi output that did not parse


def parse_nvidia_smi(stdout: str) -> Driver:
    """`nvidia-smi --query-gpu=driver_version,name --format=csv,noheader`: one
    `VERSION, NAME` line per GPU. Lines that do not parse whole are counted, not trusted."""
    driver = Driver(source="nvidia-smi")
    for line in stdout.splitlines():
        if not line.strip():
            continue
        version, sep, name = line.partition(",")
        name = name.strip()
        if not sep or version_tuple(version) is None:
            driver.ignored_lines += 1
            continue
        if driver.version is None:
            driver.version = version.strip()
        elif version.strip() != driver.version:  # one kernel module serves every GPU: not plausible
            driver.ignored_lines += 1
            continue
        driver.gpus.append(name if GPU_NAME_RE.fullmatch(name) else "(unreadable GPU name)")
    if driver.version is None:
        driver.error = f"nvidia-smi printed no driver version ({driver.ignored_lines} line(s) did not parse)"
    return driver


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[0].split())[:200] if lines else ""


def query_nvidia_smi(run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Driver:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return Driver(source="nvidia-smi", error="nvidia-smi: not found")
    try:
        r = run([exe, *NVIDIA_SMI_ARGS], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as e:
        return Driver(source="nvidia-smi", error=f"nvidia-smi: {type(e).__name__}: {e}"[:300])
    if r.returncode != 0:
        why = _first_line(r.stdout) or _first_line(r.stderr) or "no output"
        return Driver(source="nvidia-smi", error=f"nvidia-smi exited {r.returncode}: {why}")
    return parse_nvidia_smi(r.stdout)


def query_nvml(library: str = "libnvidia-ml.so.1") -> Driver:
    """The same facts through NVML (ctypes), for hosts with the driver but no nvidia-smi."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return Driver(source="nvml", error=f"NVML: {library} not loadable")
    if nvml.nvmlInit_v2() != 0:
        return Driver(source="nvml", error="NVML: nvmlInit failed (no driver loaded?)")
    try:
        buf = ctypes.create_string_buffer(96)
        if nvml.nvmlSystemGetDriverVersion(buf, 96) != 0:
            return Driver(source="nvml", error="NVML: no driver version")
        lines = []
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
        for i in range(min(count.value, 64)):
            handle, name = ctypes.c_void_p(), ctypes.create_string_buffer(96)
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) == 0 and \
                    nvml.nvmlDeviceGetName(handle, name, 96) == 0:
                lines.append(f"{buf.value.decode(errors='replace')}, {name.value.decode(errors='replace')}")
        driver = parse_nvidia_smi("\n".join(lines) or f"{buf.value.decode(errors='replace')}, ")
        driver.source = "nvml"
        return driver
    finally:
        nvml.nvmlShutdown()


def query_driver() -> Driver:
    """nvidia-smi first, then NVML; without either, a Driver whose error says what was tried."""
    smi = query_nvidia_smi()
    if smi.version is not None:
        return smi
    nvml = query_nvml()
    if nvml.version is not None:
        return nvml
    return Driver(error=f"{smi.error}; {nvml.error}", ignored_lines=smi.ignored_lines)


@dataclass
class EngineFacts:
    reachable: bool = False
    version: str = ""
    api_version: str = ""
    nvidia_runtime: bool = False
    cdi: bool = False
    cpus: int = 0  # CPUs of the engine's host (0: not said)
    store: str = ""  # identity.CONTAINERD or identity.GRAPH_DRIVER ("": not said)
    driver: str = ""  # overlay2, overlayfs, ... ("(unreadable)" when the engine said something odd)
    multi_platform: bool = False  # the store holds a multi-platform image under one local name
    zstd_pulls: bool = False  # the engine unpacks zstd layers (containerd store, or Docker 23 and later)
    lazy_pulls: bool = False  # the containerd store's snapshotter is stargz: eStargz layers are pulled lazily
    error: str = ""


def _cdi_specs(dirs: tuple[str, ...]) -> bool:
    """Whether a CDI spec for NVIDIA devices is in one of the engine's CDI directories."""
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        if any("nvidia" in n.lower() and n.endswith((".yaml", ".yml", ".json")) for n in names):
            return True
    return False


def engine_facts(engine_factory: EngineFactory | None = None) -> EngineFacts:
    try:
        info = (engine_factory or select.docker_engine)().describe()
    except ImageFactoryError as e:  # DockerUnavailable, or an engine that will not say
        return EngineFacts(error=e.message)
    version = info.version if ENGINE_VERSION_RE.fullmatch(info.version) else "(unreadable)"
    api = info.api_version if re.fullmatch(r"[0-9]+\.[0-9]+", info.api_version) else "(unreadable)"
    cpus = info.cpus if isinstance(info.cpus, int) and 0 < info.cpus <= 4096 else 0
    store = info.store if info.store in (identity.CONTAINERD, identity.GRAPH_DRIVER) else ""
    driver = info.driver if STORAGE_DRIVER_RE.fullmatch(info.driver) else "(unreadable)"
    containerd = store == identity.CONTAINERD
    return EngineFacts(reachable=True, version=version, api_version=api,
                       nvidia_runtime="nvidia" in info.runtimes, cdi=_cdi_specs(info.cdi_spec_dirs), cpus=cpus,
                       store=store, driver=driver, multi_platform=containerd,
                       zstd_pulls=containerd or _major(version) >= ZSTD_SINCE,
                       lazy_pulls=containerd and driver == STARGZ)


# Docker Engine unpacks zstd layers in its graph-driver store since 23.0 (moby 23.0.0); the
# containerd store always has (containerd 1.5). 20.10 fails: "archive/tar: invalid tar header".
ZSTD_SINCE = 23
# The snapshotter a containerd-store engine names as its driver when it mounts eStargz layers lazily
# (dockerd's "storage-driver": "stargz", with stargz-snapshotter as containerd's proxy plugin).
STARGZ = "stargz"
STORAGE_DRIVER_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def _major(version: str) -> int:
    m = re.match(r"([0-9]{1,4})\.", version)
    return int(m.group(1)) if m else 0


def store_line(e: EngineFacts) -> str:
    """What the engine's image store is, and what follows for this host."""
    if e.store == identity.CONTAINERD:
        where = f"containerd image store (snapshotter {e.driver or '?'}): a multi-platform image is held locally under one name"
    elif e.store == identity.GRAPH_DRIVER:
        where = f"graph driver {e.driver or '?'}: one platform per local name (multi-arch cells build per platform)"
    else:
        where = "not said"
    zstd = "pulls zstd layers" if e.zstd_pulls else f"cannot pull zstd layers (Docker {ZSTD_SINCE}+ or the containerd store can): publish gzip for this node"
    return f"store:    {where}; {zstd}"


# -- launch flags --------------------------------------------------------------------------------

@dataclass
class LaunchFlags:
    """The `docker run` flags a training container needs on this node, each with why."""
    shm: list[str]
    gpus: list[str]
    cpus: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def line(self) -> str:
        return " ".join(["docker run", *self.shm, *self.gpus, "IMAGE", "python", "train.py"])


def host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError):
        return 0


def launch_flags(engine: EngineFacts, driver: Driver, memory: int | None = None) -> LaunchFlags:
    """Shared memory: DataLoader workers hand batches over through /dev/shm, and Docker gives a
    container 64 MB. GPUs: `--gpus all` through the NVIDIA runtime, or CDI device names. CPUs: a
    cpuset (what Slurm gives) or a quota; `threads: auto` images size their threads to either."""
    memory = host_memory_bytes() if memory is None else memory
    shm_gib = max(1, memory // 4 // 2**30)
    flags = LaunchFlags(shm=["--ipc=host"], gpus=[], cpus=[])
    flags.notes.append(f"shm: --ipc=host, or --shm-size={shm_gib}g (a quarter of this host's "
                       f"{memory / 2**30:.0f} GiB) where the host's IPC namespace must not be shared; "
                       "Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm")
    gpu = driver.version is not None and bool(driver.gpus)
    if gpu and engine.nvidia_runtime:
        flags.gpus = ["--gpus", "all"]
        flags.notes.append("GPUs: --gpus all (NVIDIA runtime); one GPU: --gpus device=0")
    elif gpu and engine.cdi:
        flags.gpus = ["--device", "nvidia.com/gpu=all"]
        flags.notes.append("GPUs: --device nvidia.com/gpu=all (CDI); one GPU: --device nvidia.com/gpu=0")
    elif gpu:
        flags.notes.append(f"GPUs: none can be given to containers yet: {CONTAINER_TOOLKIT_FIX}")
    else:
        flags.notes.append("GPUs: none (no NVIDIA GPU here): no GPU flag")
    if engine.cpus:
        n = engine.cpus
        half = max(1, n // 2)
        flags.cpus = [f"--cpuset-cpus=0-{half - 1}" if half > 1 else "--cpuset-cpus=0"]
        flags.notes.append(f"CPUs: {n} on this host; to share it, give each container a cpuset "
                           f"({flags.cpus[0]}, as Slurm does) or a quota (--cpus={half}): "
                           "threads: auto images size OpenMP/MKL/OpenBLAS to it; a fixed-threads image "
                           "needs -e OMP_NUM_THREADS=N to match")
    else:
        flags.notes.append("CPUs: the engine did not say how many: no CPU flag")
    return flags


# -- judging cells -------------------------------------------------------------------------------

@dataclass
class CellVerdict:
    cell: str
    cuda: str | None
    tag: str
    verdict: str  # runs | runs-with-limits | cannot-run
    reason: str
    fix: str = ""
    min_driver: str | None = None


def _driver_verdict(cell: Cell, driver: Driver, table: DriverTable) -> CellVerdict:
    tag = cell.tags[0] if cell.tags else ""
    v = CellVerdict(cell.id, cell.cuda, tag, RUNS, "CPU-only image")
    if cell.cuda is None:
        return v
    need, major = table.toolkits.get(cell.cuda), cell.cuda.split(".")[0]
    compat = table.compat.get(major)
    v.min_driver = need
    if driver.version is None:
        v.verdict, v.reason = CANNOT, "cannot run here: no GPU (no NVIDIA driver found)"
        return v
    have = version_tuple(driver.version) or ()
    if need is not None and have >= (version_tuple(need) or ()):
        v.reason = f"driver {driver.version} >= {need} needed by CUDA {cell.cuda}"
        return v
    if compat is not None and have >= (version_tuple(compat) or ()):
        v.verdict = LIMITS
        short = (f"driver {driver.version} < {need} needed by CUDA {cell.cuda}" if need else
                 f"CUDA {cell.cuda} is not in imagefactory's driver table")
        v.reason = (f"{short}; runs through CUDA {major}.x minor-version compatibility "
                    f"(driver >= {compat}): prebuilt kernels run, newer PTX does not JIT")
        v.fix = f"upgrade the driver to {need} or newer for full support" if need else \
            "add this toolkit's minimum driver to resources/cuda_drivers.json"
        return v
    v.verdict = CANNOT
    floor = need or compat
    v.reason = (f"driver {driver.version} < {floor} needed by CUDA {cell.cuda}" if floor else
                f"CUDA {cell.cuda} is not in imagefactory's driver table")
    return v


def _foreign(cell: Cell, cells: list[Cell], host: platforms.Platform | None, machine: str) -> CellVerdict | None:
    """The verdict on a cell of another platform than this host's: it would run only emulated."""
    if cell.platform == host:
        return None
    here = str(host) if host is not None else f"{machine} (not a platform imagefactory builds)"
    v = CellVerdict(cell.id, cell.cuda, cell.tags[0] if cell.tags else "", CANNOT,
                    f"{cell.platform} image on a {here} host: runs only emulated (QEMU), not for training here")
    twin = next((c for c in cells if c.platform == host and (c.python, c.cuda, c.blas, c.installer, c.variant)
                 == (cell.python, cell.cuda, cell.blas, cell.installer, cell.variant)), None)
    v.fix = f"run it on a {cell.platform} node" + (f", or use the {host} cell ({twin.id})" if twin else "")
    return v


def _alternative(cell: Cell, cells: list[Cell], verdicts: dict[str, CellVerdict]) -> Cell | None:
    """The newest-CUDA cell that runs here, preferring one with the same python, BLAS and installer."""
    ok = [c for c in cells if c.cuda is not None and verdicts[c.id].verdict == RUNS]
    if not ok:
        return None
    same = [c for c in ok if (c.python, c.blas, c.installer) == (cell.python, cell.blas, cell.installer)]
    return max(same or ok, key=lambda c: version_tuple(c.cuda or "") or ())


def judge(cells: list[Cell], driver: Driver, engine: EngineFacts, table: DriverTable,
          host: platforms.Platform | None = platforms.DEFAULT, machine: str = "") -> list[CellVerdict]:
    """Each cell's verdict on a host of platform `host` (`machine`: its `uname -m`, named when the
    platform table has none for it; diagnose passes this host's)."""
    verdicts = {c.id: _foreign(c, cells, host, machine) or _driver_verdict(c, driver, table) for c in cells}
    cells_here = [c for c in cells if c.platform == host]
    plumbing = engine.nvidia_runtime or engine.cdi
    for c in cells:
        v = verdicts[c.id]
        if c.cuda is None or v.verdict == CANNOT:
            continue
        if engine.reachable and not plumbing:
            v.verdict = CANNOT
            v.reason = f"{v.reason}; but the engine has no NVIDIA runtime or CDI spec, so containers get no GPU"
            v.fix = CONTAINER_TOOLKIT_FIX
    for c in cells:
        v = verdicts[c.id]
        if v.verdict != CANNOT or v.fix:
            continue
        alt = _alternative(c, cells, verdicts)
        if driver.version is None:
            v.fix = "run it on a node with an NVIDIA GPU" + (f" and driver >= {v.min_driver}" if v.min_driver else "")
            cpu = [x for x in cells_here if x.cuda is None]
            twin = [x for x in cpu if (x.python, x.blas, x.installer) == (c.python, c.blas, c.installer)]
            v.fix += f", or use a CPU cell ({(twin or cpu)[0].id})" if cpu else ""
        else:
            v.fix = f"upgrade the driver to {v.min_driver} or newer" if v.min_driver else \
                "add this toolkit's minimum driver to resources/cuda_drivers.json"
            v.fix += f", or use the {alt.accel} cell ({alt.id})" if alt else ""
    return [verdicts[c.id] for c in cells]


def recommend(cells: list[Cell], verdicts: list[CellVerdict]) -> str | None:
    """The release tag a node should pull: the newest CUDA that runs fully here, else the newest
    that runs with limits, else the first CPU cell (matrix order breaks ties)."""
    by_id = {c.id: c for c in cells}
    for wanted in (RUNS, LIMITS):
        gpu = [v for v in verdicts if v.cuda is not None and v.verdict == wanted]
        if gpu:
            best = max(gpu, key=lambda v: version_tuple(by_id[v.cell].cuda or "") or ())
            return best.tag or None
    cpu = [v for v in verdicts if v.cuda is None and v.verdict != CANNOT]  # not another platform's
    return cpu[0].tag if cpu else None


# -- the whole report ----------------------------------------------------------------------------

@dataclass
class Report:
    engine: EngineFacts
    driver: Driver
    matrix: str | None
    cells: list[CellVerdict]
    recommended: str | None
    launch: LaunchFlags | None = None
    verification: list[dict] = field(default_factory=list)  # `doctor --verify`: verify.Verdict.as_dict() per tag
    machine: str = ""  # this host's `uname -m` (MACHINE_RE, else "(unreadable)")
    platform: str | None = None  # its platform ("linux/amd64"); None: not one imagefactory builds
    docker_host: str = field(default_factory=lambda: os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"))
    zstd_registries: list[str] = field(default_factory=list)  # the matrix's registries that get zstd layers
    estargz_registries: list[str] = field(default_factory=list)  # ... and those that get eStargz layers

    @staticmethod
    def _compression(registries: list[str], kind: str, here: str) -> str | None:
        return f"compression: {', '.join(registries)} get {kind} layers{here}" if registries else None

    @property
    def compression(self) -> str | None:
        """What the matrix's zstd registries mean for this node (None: the matrix pushes no zstd)."""
        here = ("; this engine pulls them" if self.engine.zstd_pulls else
                f", which this engine CANNOT pull (Docker {ZSTD_SINCE}+ or the containerd store can): pull this "
                f"node's images from a registry the matrix pushes gzip to")
        return self._compression(self.zstd_registries, "zstd", here)

    @property
    def lazy(self) -> str | None:
        """What the matrix's eStargz registries mean for this node (None: it pushes no eStargz)."""
        here = (f"; this engine pulls them lazily (snapshotter {STARGZ})" if self.engine.lazy_pulls else
                f"; this engine pulls them whole, as gzip (lazily only with the {STARGZ} snapshotter: "
                f"docs/layers.md#lazy-pulling-estargz)")
        return self._compression(self.estargz_registries, "eStargz", here)

    @property
    def gpu(self) -> bool:
        return self.driver.version is not None and bool(self.driver.gpus)

    @property
    def exit_code(self) -> int:
        if not self.engine.reachable:
            return 3
        unverified = any(not v.get("ok") for v in self.verification)
        return 1 if unverified or any(v.verdict == CANNOT for v in self.cells) else 0

    def to_json(self) -> dict:
        return {"exit_code": self.exit_code, "host": {"machine": self.machine, "platform": self.platform},
                "engine": asdict(self.engine), "docker_host": self.docker_host,
                "driver": asdict(self.driver), "gpu": self.gpu, "matrix": self.matrix,
                "cells": [asdict(v) for v in self.cells], "recommended": self.recommended,
                "launch": None if self.launch is None else {**asdict(self.launch), "line": self.launch.line},
                "verification": self.verification, "zstd_registries": self.zstd_registries,
                "estargz_registries": self.estargz_registries}


def diagnose(matrix: Matrix | None, *, engine_factory: EngineFactory | None = None,
             driver_query: Callable[[], Driver] = query_driver, table: DriverTable | None = None,
             machine: str | None = None) -> Report:
    """The report on this host (`machine`: its `uname -m`, read here unless given)."""
    table = table or load_table()
    engine, driver = engine_facts(engine_factory), driver_query()
    raw = machine if machine is not None else _host.machine()
    machine = raw if MACHINE_RE.fullmatch(raw) else "(unreadable)"
    host = platforms.native(raw) if MACHINE_RE.fullmatch(raw) else None
    cells = list(matrix.cells) if matrix else []
    verdicts = judge(cells, driver, engine, table, host=host, machine=machine)
    return Report(engine=engine, driver=driver, matrix=str(matrix.path) if matrix else None,
                  cells=verdicts, recommended=recommend(cells, verdicts) if cells else None,
                  launch=launch_flags(engine, driver) if engine.reachable else None,
                  machine=machine, platform=host.oci if host else None, zstd_registries=_compressed(matrix, "zstd"),
                  estargz_registries=_compressed(matrix, "estargz"))


def _compressed(matrix: Matrix | None, how: str) -> list[str]:
    from imagefactory.config import registries

    return registries.compressed_with(matrix, how) if matrix else []


def text(report: Report) -> str:
    e, d = report.engine, report.driver
    lines = [f"host:     {report.platform or 'not a platform imagefactory builds'} (uname -m: {report.machine})"
             ] if report.machine else []
    if e.reachable:
        lines.append(f"engine:   Docker {e.version} (API {e.api_version}) at {report.docker_host}")
        lines.append(store_line(e))
        lines.append(f"runtime:  NVIDIA runtime {'yes' if e.nvidia_runtime else 'no'}, "
                     f"CDI spec {'yes' if e.cdi else 'no'}")
    else:
        lines.append(f"engine:   NOT REACHABLE: {e.error}")
    if report.gpu:
        lines.append(f"driver:   {d.version} (from {d.source})")
        lines.append(f"GPUs:     {len(d.gpus)}: " + ", ".join(d.gpus))
    else:
        lines.append(f"driver:   none ({d.error})")
        lines.append("GPUs:     none: this host has no usable NVIDIA GPU, so only CPU cells can run here")
    if d.ignored_lines:
        lines.append(f"note:     {d.ignored_lines} line(s) of nvidia-smi output did not parse and were ignored")
    if report.launch is not None:
        lines.append(f"launch:   {report.launch.line}")
        lines += [f"          {note}" for note in report.launch.notes]
    if report.matrix is None:
        lines.append("matrix:   none given and no matrix.yaml here: host facts only")
        return "\n".join(lines) + "\n"
    lines += [f"matrix:   {report.matrix} ({len(report.cells)} cell(s))"]
    lines += [line for line in (report.compression, report.lazy) if line]
    lines += [""]
    width = max([len(v.cell) for v in report.cells] + [4])
    for v in report.cells:
        lines.append(f"{v.cell:<{width}}  {VERDICT_TEXT[v.verdict]:<16}  {v.tag}")
        lines.append(f"{'':<{width}}    {v.reason}")
        if v.fix:
            lines.append(f"{'':<{width}}    fix: {v.fix}")
    lines += ["", f"pull:     {report.recommended}" if report.recommended else
              "pull:     nothing in this matrix runs here"]
    lines += [f"verify:   {v['line']}" for v in report.verification]
    return "\n".join(lines) + "\n"


def default_matrix(given: Path | None) -> Path | None:
    """--matrix if given; else ./matrix.yaml when it exists; else None (host facts only)."""
    if given is not None:
        return given
    here = Path("matrix.yaml")
    return here if here.is_file() else None
