"""What a platform means, in one table: every module that needs an architecture asks here.

A cell is built for one platform (model.Cell.platform). The OCI name is what the matrix's
`platform` axis, `docker buildx build --platform` and the image config speak; the rest is what
each tool calls the same machine:

* `arch`: `uname -m`, the conda installer's file name (`Miniforge3-...-Linux-aarch64.sh`) and
  the tail of pip's platform tags;
* `pip_platform` / `glibc_platforms`: the wheel tags a lock resolves for (the oldest glibc the
  locked wheels may need, Debian 10+), newest first;
* `conda_subdir`: the conda-forge subdirectory of its packages;
* `mkl`: whether MKL exists there at all (x86_64 only: PyPI's `mkl` has no aarch64 wheel,
  conda-forge's MKL is linux-64/osx-64/win-64 only);
* `emulation`: what another host needs to run it (binfmt + QEMU; `qemu_cpu` a CPU model that
  keeps probes tractable: QEMU's default aarch64 CPU advertises SVE/SME and OpenBLAS then picks
  kernels about 15x slower, and `import torch` takes 21-28 s there against 16 s with neoverse-n1;
  `slowdown` the factor a probe's timeouts are scaled by when it runs emulated).

`emulated(target, host)` says whether a cell's containers run under emulation on an engine's host
(an `Emulated`: the platform to create them with, the QEMU_CPU to set, what the report says).

Facts: /work/shared/docs/domain.md ("aarch64 GPU nodes") and the issue's measurements.
"""

from __future__ import annotations

import platform as _host
from dataclasses import dataclass


@dataclass(frozen=True)
class Emulation:
    """How a host of another architecture runs this platform's binaries."""

    binfmt: str  # the binfmt_misc handler (`update-binfmts --enable qemu-aarch64`)
    qemu_cpu: str | None  # the QEMU_CPU model probes run under; None: QEMU's default (not measured)
    # emulated runs against native ones: `import torch` 16 s against about 1.6 s, a torch wheel's pip
    # install 220 s against 29 s (2 cores, QEMU_CPU=neoverse-n1); probe timeouts are scaled by it
    slowdown: float = 10.0


@dataclass(frozen=True)
class Platform:
    """One target platform. Compare platforms by value; the table below is the only source."""

    oci: str  # "linux/arm64": the matrix value, buildx's --platform, os/architecture of the image
    architecture: str  # "arm64": the image config's Architecture (engine inspect), the cell id's suffix
    arch: str  # "aarch64": uname -m, installer file names, pip platform tags
    conda_subdir: str  # "linux-aarch64"
    glibc_platforms: tuple[str, ...]  # pip wheel tags a lock accepts, newest first
    mkl: bool  # whether MKL (and so blas: mkl) exists for it
    emulation: Emulation

    @property
    def os(self) -> str:
        return self.oci.split("/", 1)[0]

    @property
    def pip_platform(self) -> str:
        """The tag a pip lock is resolved for (its header names it)."""
        return self.glibc_platforms[0]

    @property
    def uv_platform(self) -> str:
        """`uv pip compile --python-platform`: a resolver that evaluates markers for the target."""
        return f"{self.arch}-manylinux_2_28"

    def __str__(self) -> str:
        return self.oci


def _glibc(arch: str) -> tuple[str, ...]:
    """manylinux_2_28 down to 2_17 (= manylinux2014), then the bare linux tag."""
    return tuple(f"manylinux_2_{minor}_{arch}" for minor in range(28, 16, -1)) + (
        f"manylinux2014_{arch}", f"linux_{arch}")


AMD64 = Platform(oci="linux/amd64", architecture="amd64", arch="x86_64", conda_subdir="linux-64",
                 glibc_platforms=_glibc("x86_64"), mkl=True,
                 emulation=Emulation(binfmt="qemu-x86_64", qemu_cpu=None))
ARM64 = Platform(oci="linux/arm64", architecture="arm64", arch="aarch64", conda_subdir="linux-aarch64",
                 glibc_platforms=_glibc("aarch64"), mkl=False,
                 emulation=Emulation(binfmt="qemu-aarch64", qemu_cpu="neoverse-n1"))

@dataclass(frozen=True)
class Emulated:
    """`target` binaries run on a `host` of another platform, through binfmt_misc and QEMU."""

    target: Platform
    host: Platform

    @property
    def environment(self) -> dict[str, str]:
        """What a container of `target` is given: QEMU_CPU, the CPU model qemu-user emulates."""
        cpu = self.target.emulation.qemu_cpu
        return {"QEMU_CPU": cpu} if cpu else {}

    @property
    def slowdown(self) -> float:
        return self.target.emulation.slowdown

    def __str__(self) -> str:
        """`qemu-aarch64 (QEMU_CPU=neoverse-n1) on linux/amd64`: the report's words."""
        cpu = self.target.emulation.qemu_cpu
        return f"{self.target.emulation.binfmt} ({f'QEMU_CPU={cpu}' if cpu else 'QEMU default CPU'}) on {self.host.oci}"


def emulated(target: Platform, host: Platform | None) -> Emulated | None:
    """How `target` runs on an engine whose own platform is `host`: None natively. A host the
    table lacks counts as the default platform, as the classic builder's refusal counts it."""
    own = host or DEFAULT
    return None if target == own else Emulated(target, own)


PLATFORMS: dict[str, Platform] = {p.oci: p for p in (AMD64, ARM64)}
DEFAULT = AMD64  # a matrix without a platform axis builds this one only (today's ids, tags and hashes)
# `uname -m` answers that name a platform of the table (arm64 is what macOS and some kernels say)
_MACHINES = {"x86_64": AMD64, "amd64": AMD64, "aarch64": ARM64, "arm64": ARM64}


def get(oci: str) -> Platform:
    """The platform an OCI name ("linux/arm64") names; KeyError for one the table lacks."""
    return PLATFORMS[oci]


def names() -> list[str]:
    """The OCI names the table knows: the matrix's allowed `platform` values."""
    return list(PLATFORMS)


def by_architecture(architecture: str, os: str = "linux") -> Platform | None:
    """The platform an image config's Os/Architecture ("linux", "arm64") is; None if unknown."""
    return next((p for p in PLATFORMS.values() if p.architecture == architecture and p.os == os), None)


def native(machine: str | None = None) -> Platform | None:
    """The platform of this host (`uname -m`), or None when the table has none for it."""
    return _MACHINES.get((machine or _host.machine()).lower())
