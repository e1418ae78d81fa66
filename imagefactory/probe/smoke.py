"""Step 6 (probe/): prove an image in-container, the ways GPU nodes launch it.

The probe (resources/probe.py, standard library plus what it inspects) runs inside
the image with no network and a timeout; the host parses its JSON and judges it against
the cell (checks.py). It runs once per launch mode, the modes' containers side by side:

- `docker`: `docker run IMAGE python ...`, through the image's ENTRYPOINT, as its user;
- `bare`: the ENTRYPOINT bypassed (`--entrypoint python`), as Kubernetes `command:`,
  Slurm's pyxis and `apptainer exec` start a container;
- `hpc`: bare, and as an arbitrary UID without a passwd entry (4242:4242), a read-only
  root, `/tmp` a tmpfs that allows exec, `HOME` unwritable, a cpuset of 1 CPU.

Every mode is judged by the same checks (thread expectations follow the mode's own CPU
budget) plus `launch.conditions`, which proves the container really ran as the mode asked.
Each check names its mode; a cell passes only if every mode passes.

The probe containers get a proper /dev/shm (`--shm-size 1g` by default; `host` is
`--ipc=host`, `default` is Docker's 64 MB, which the DataLoader check does not fit in).

A cell of another platform than the engine's own (platforms.emulated) is probed emulated, in
every mode: its containers are created with the cell's platform and QEMU_CPU (the platform
table's CPU model), the container's timeout and the probe's own are scaled by the table's
slowdown, and the checks that judge speed say "emulated: not judged" (checks.NOT_JUDGED).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from imagefactory.probe import checks
from imagefactory.config import platforms
from imagefactory.probe.limits import DEFAULT_PROBE_SHM, DEFAULT_PROBE_TIMEOUT
from imagefactory.engine.api import DOCKER, PODMAN, ContainerEngine, RunResult
from imagefactory.errors import ConfigError, EngineError, EngineGone
from imagefactory.config.model import Cell

DEFAULT_TIMEOUT = DEFAULT_PROBE_TIMEOUT  # defined once, in limits.py
DEFAULT_SHM = DEFAULT_PROBE_SHM
# a size as Docker's --shm-size takes it (1g, 1G, 1gb, 512m): normalised to "1g", "512m"
SHM_RE = re.compile(r"host|default|(?P<n>[1-9][0-9]{0,5})(?P<unit>[kmgKMG])[bB]?")
HPC_UID = 4242


@dataclass(frozen=True)
class LaunchMode:
    """How a probe container is started. `expect` is what the probe must see inside it
    (launch.conditions): keys of the probe's "launch"/"user"/"cpus" facts."""

    name: str
    entrypoint: bool = True  # run through the image's ENTRYPOINT
    user: str | None = None  # None: the image's USER
    read_only: bool = False
    tmp_exec: bool = False  # /tmp a tmpfs with exec (only with read_only)
    home: str | None = None  # HOME in the container's environment
    cpuset: str | None = None

    def options(self, shm: str) -> dict[str, Any]:
        """Container-create options (Docker SDK names) for this mode under `shm`."""
        opts: dict[str, Any] = {}
        if not self.entrypoint:
            opts["entrypoint"] = ["python"]
        if self.user:
            opts["user"] = self.user
        if self.read_only:
            opts["read_only"] = True
            opts["tmpfs"] = {"/tmp": "rw,exec,nosuid,nodev,mode=1777" if self.tmp_exec else "rw,nosuid,nodev,mode=1777"}
        if self.cpuset:
            opts["cpuset_cpus"] = self.cpuset
        opts.update(shm_options(shm))
        return opts

    def environment(self) -> dict[str, str]:
        return {"HOME": self.home} if self.home else {}

    def expect(self, product: str = DOCKER) -> dict[str, Any]:
        """What the probe must see, on an engine that is `product` (ContainerEngine.product()):
        Docker gives an arbitrary UID no passwd entry (no user name); podman adds one, named
        after the UID, as it does for every such container."""
        out: dict[str, Any] = {}
        if self.user:
            out["uid"] = int(self.user.split(":")[0])
            out["user name"] = str(out["uid"]) if product == PODMAN else None
        if self.read_only:
            out["root read-only"] = True
            out["/tmp writable"] = True
            out["/tmp noexec"] = not self.tmp_exec
        if self.home:
            out["HOME writable"] = False
        if self.cpuset:
            out["CPUs (affinity)"] = len(self.cpuset.split(","))
        return out


MODES: dict[str, LaunchMode] = {
    "docker": LaunchMode("docker"),
    "bare": LaunchMode("bare", entrypoint=False),
    "hpc": LaunchMode("hpc", entrypoint=False, user=f"{HPC_UID}:{HPC_UID}", read_only=True, tmp_exec=True,
                      home="/nonexistent", cpuset="0"),
}
DEFAULT_MODES = tuple(MODES)


def check_shm(value: str, *, where: str = "--probe-shm") -> str:
    m = SHM_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f"{where}: {value!r} is not host, default or a size such as 1g, 512m")
    return f"{m['n']}{m['unit'].lower()}" if m["n"] else value


def shm_options(shm: str) -> dict[str, Any]:
    """`host`: --ipc=host; `default`: Docker's own 64 MB; a size: --shm-size."""
    check_shm(shm)
    if shm == "host":
        return {"ipc_mode": "host"}
    if shm == "default":
        return {}
    return {"shm_size": shm}


def probe_source() -> str:
    return resources.files("imagefactory").joinpath("resources/probe.py").read_text()


@dataclass(frozen=True)
class SmokeResult:
    checks: list[checks.Check]
    probe: dict | None  # {mode: the probe's JSON}, None unless every mode reported one
    stdout: str
    stderr: str
    emulation: platforms.Emulated | None = None  # how the probe ran when not natively

    @property
    def passed(self) -> bool:
        return checks.passed(self.checks)


def parse_probe_output(stdout: str) -> dict | None:
    """The probe's JSON is the last non-empty line of stdout."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        data = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def run_probe(engine: ContainerEngine, image: str, *, timeout: float = DEFAULT_TIMEOUT,
              gpus: bool = False, compile_check: bool = True, mode: str = "docker",
              shm: str = DEFAULT_SHM, emulation: platforms.Emulated | None = None) -> RunResult:
    """Run the probe in `image`, launched as `mode` says. Without `compile_check` the probe
    leaves out its torch.compile child (a cell built without a compiler: the check is skipped).
    With `emulation` the container is created as its target platform with its QEMU_CPU, and the
    probe scales its own timeouts by its slowdown (`timeout`, the container's, is the caller's)."""
    launch = MODES[mode]
    args = ([] if compile_check else ["--no-compile"]) + (
        ["--slowdown", f"{emulation.slowdown:g}"] if emulation else [])
    command = ["-c", probe_source(), *args] if not launch.entrypoint else ["python", "-c", probe_source(), *args]
    environment = {**launch.environment(), **(emulation.environment if emulation else {})}
    return engine.run(image, command, timeout=timeout, gpus=gpus, environment=environment,
                      options=launch.options(shm), platform=emulation.target if emulation else None)


def judge(cell: Cell, probes: dict[str, Any], *, gpu_required: bool,
          emulation: platforms.Emulated | None = None, product: str = DOCKER) -> list[checks.Check]:
    """Every mode's probe judged against `cell`, each check tagged with its mode, the launch
    conditions as `product`'s containers have them (LaunchMode.expect). A mode without a probe
    (or with anything but a dict) fails as not run. An emulated probe's speed is not judged
    (checks.judge)."""
    out: list[checks.Check] = []
    for name in probes:
        mode = MODES.get(name)
        probe = probes[name]
        if mode is None or not isinstance(probe, dict):
            out.append(checks.Check("probe.ran", "probe JSON on stdout", "no probe", checks.FAIL,
                                    f"no probe report for launch mode {name}", mode=name))
            continue
        judged = checks.judge(cell, probe, gpu_required=gpu_required, emulation=emulation) + [
            checks.launch_conditions(mode.expect(product), probe)]
        out += [replace(c, mode=name) for c in judged]
    return out


def _one(engine: ContainerEngine, cell: Cell, image: str, mode: str, *, gpus: bool, timeout: float,
         shm: str, emulation: platforms.Emulated | None) -> tuple[list[checks.Check], dict | None, str, str]:
    """One mode: (checks, probe or None, stdout, stderr). A probe that could not run
    (timeout, crash, no JSON) is itself a failing check, never an exception."""
    try:
        result = run_probe(engine, image, timeout=timeout, gpus=gpus, compile_check=cell.compiler, mode=mode, shm=shm,
                           emulation=emulation)
    except EngineGone:  # not the image's fault: the run reports a lost engine (pipeline/build.py, exit 3)
        raise
    except EngineError as e:  # e.g. no `python` in the image, or GPUs asked of a host without any
        failed = checks.Check("probe.ran", "probe JSON on stdout", e.message, checks.FAIL, e.message, mode=mode)
        return [failed], None, "", e.message
    probe = parse_probe_output(result.stdout)
    why = None
    if result.exit_code is None:  # killed at the timeout: whatever it printed is not a verdict
        why = f"killed after {timeout:.0f} s"
    elif probe is None:
        tail = " | ".join(result.stderr.strip().splitlines()[-3:]) or "no output"
        why = f"exit code {result.exit_code}, no probe JSON: {tail}"
    if why is not None or probe is None:
        failed = checks.Check("probe.ran", "probe JSON on stdout", str(why), checks.FAIL, str(why), mode=mode)
        return [failed], None, result.stdout, result.stderr
    return (judge(cell, {mode: probe}, gpu_required=gpus, emulation=emulation, product=engine.product()), probe,
            result.stdout, result.stderr)


def emulation_of(engine: ContainerEngine, cell: Cell) -> platforms.Emulated | None:
    """How `cell`'s containers run on `engine`: None natively (platforms.emulated)."""
    return platforms.emulated(cell.platform, engine.native_platform())


def test_image(engine: ContainerEngine, cell: Cell, image: str, *, gpus: bool, timeout: float = DEFAULT_TIMEOUT,
               modes: tuple[str, ...] = DEFAULT_MODES, shm: str = DEFAULT_SHM,
               emulation: platforms.Emulated | None = None) -> SmokeResult:
    """Run the probe in `image` once per launch mode, the modes' containers concurrently
    (each under `timeout`, times the slowdown under `emulation`: see emulation_of()), and judge
    each against `cell`."""
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ConfigError(f"launch modes {', '.join(unknown) or '(none)'}: allowed: {', '.join(MODES)}")
    check_shm(shm)
    timeout *= emulation.slowdown if emulation else 1.0
    with ThreadPoolExecutor(max_workers=len(modes), thread_name_prefix="probe") as pool:
        futures = {m: pool.submit(_one, engine, cell, image, m, gpus=gpus, timeout=timeout, shm=shm,
                                  emulation=emulation) for m in modes}
        done = {m: f.result() for m, f in futures.items()}  # a Cancelled in any mode propagates
    found: list[checks.Check] = []
    probes: dict[str, dict] = {}
    stdout, stderr = [], []
    for m, (judged, probe, out, err) in done.items():
        found += judged
        if probe is not None:
            probes[m] = probe
        stdout.append(f"--- launch mode {m} ---\n{out.rstrip()}")
        stderr.append(f"--- launch mode {m} ---\n{err.rstrip()}")
    return SmokeResult(found, probes if len(probes) == len(modes) else None, "\n".join(stdout), "\n".join(stderr),
                       emulation)

