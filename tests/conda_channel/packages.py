"""The test channel's packages: where each one's files come from, how they are fixed up, and
the metadata conda-forge gives its own build of the same package.

Sources, all on this machine or reachable from it: the pyenv CPython (relocated with patchelf),
PyPI wheels (`pip download`: torch's local CPU wheel, Intel's mkl and intel-openmp, the
pure-Python packages) and Debian bookworm packages (`apt-get download` + `dpkg-deb -x`:
OpenBLAS, gfortran's runtime, NumPy 1.24 and the libraries CPython needs beyond a minbase).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import subprocess
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import BinaryIO, Literal

PYTHON_HOME = Path(os.environ.get("IMAGEFACTORY_CONDA_PYTHON", "/root/.pyenv/versions/3.11.7"))
PY = "3.11"
PY_TAG = "py311"
SITE = f"lib/python{PY}/site-packages"
TORCH = "2.13.0"
BLAS = "3.9.0"
BLAS_BUILD = 31  # conda-forge's libblas build number for this generation of the switch
GLIBC = "__glibc >=2.28,<3.0.a0"  # manylinux_2_28 wheels
PY_DEP = f"python >={PY},<3.12.0a0"
PY_ABI = f"python_abi {PY}.* *_cp311"
NOARCH_BUILD = "pyhd8ed1ab_0"  # conda-forge's noarch python build string

WHEELS = (  # pinned: an unchanged builder builds the same channel
    f"torch=={TORCH}+cpu", "mkl==2026.2.1", "intel-openmp==2026.2.0", "typing_extensions==4.16.0",
    "filelock==4.3.1", "sympy==1.14.0", "mpmath==1.4.1", "networkx==3.6.1", "jinja2==3.1.6",
    "markupsafe==3.0.4", "fsspec==2026.9.0", "threadpoolctl==3.8.0", "setuptools==84.2.1",
)
DEBS = ("libopenblas0-pthread", "libgfortran5", "libquadmath0", "python3-numpy",
        "libssl3", "libsqlite3-0", "libreadline8", "libncursesw6")
# Extension modules left out of python: their libraries are not in a minbase image and are not
# packaged here (Tk), or the module is deprecated and needs NIS (nis).
DROPPED_MODULES = ("_tkinter", "nis", "_test", "_xxtestfuzz", "xxlimited", "_ctypes_test", "xxsubtype")
DROPPED_STDLIB = {"__pycache__", "test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo"}


@dataclass
class Package:
    """One conda package: staged by `stage(dst)` into an empty folder, then assembled."""
    name: str
    version: str
    build: str
    stage: Callable[[Path], None]
    depends: list[str] = field(default_factory=list)
    constrains: list[str] = field(default_factory=list)
    build_number: int = 0
    noarch: Literal["python", "generic"] | None = None  # None: linux-64
    channel: str = "channel"  # the folder (channel) it is written to
    level: int = 3  # compression level (rattler-build's 0-9)
    license: str | None = None
    summary: str | None = None

    @property
    def subdir(self) -> str:
        return "noarch" if self.noarch else "linux-64"


@dataclass
class Sources:
    wheels: Path  # pip download folder
    debs: dict[str, Path]  # Debian package name -> its unpacked tree
    versions: dict[str, str]  # Debian package name -> upstream version

    def wheel(self, name: str) -> Path:
        key = name.lower().replace("-", "_")
        for w in sorted(self.wheels.glob("*.whl")):
            if w.name.split("-", 1)[0].lower() == key:
                return w
        raise FileNotFoundError(f"no wheel for {name} in {self.wheels}")


# --------------------------------------------------------------------------- fetching

PYTHON_DEBS = ("libssl3", "libsqlite3-0", "libreadline8", "libncursesw6")  # what python needs (installer)


def fetch(work: Path, wheels_too: bool = True, debs_wanted: tuple[str, ...] = DEBS) -> Sources:
    ensure_patchelf()
    wheels, debs = work / "wheels", work / "debs"
    wheels.mkdir(parents=True)
    debs.mkdir()
    if wheels_too:
        subprocess.run(["pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", PY,
                        "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", str(wheels),
                        *WHEELS], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", *debs_wanted], cwd=debs,
                   check=True, stdout=subprocess.DEVNULL)
    trees, versions = {}, {}
    for deb in sorted(debs.glob("*.deb")):
        name = deb.name.split("_", 1)[0]
        trees[name] = debs / name
        subprocess.run(["dpkg-deb", "-x", str(deb), str(trees[name])], check=True)
        raw = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True, text=True)
        versions[name] = upstream(raw.stdout.strip())
    return Sources(wheels, trees, versions)


def upstream(debian_version: str) -> str:
    """'1:1.24.2-1+deb12u1' -> '1.24.2'; '0.3.21+ds-4' -> '0.3.21'."""
    version = debian_version.split(":", 1)[-1].rsplit("-", 1)[0]
    return re.split(r"[+~]", version, maxsplit=1)[0]


# --------------------------------------------------------------------------- helpers

def digest(*parts: object) -> str:
    """A conda-style build hash: 'h' and 7 hex digits of what the build depends on."""
    return "h" + hashlib.sha256(repr(parts).encode()).hexdigest()[:7]


def patchelf(*args: str) -> None:
    subprocess.run(["patchelf", *args], check=True)


def needed(path: Path) -> list[str]:
    out = subprocess.run(["patchelf", "--print-needed", str(path)], check=True, capture_output=True, text=True)
    return out.stdout.split()


def is_elf(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def ensure_patchelf() -> None:
    """Debian's patchelf, installed with apt-get when missing (the builder runs as root in CI)."""
    if shutil.which("patchelf"):
        return
    if os.geteuid() != 0:
        raise RuntimeError("the conda test channel needs patchelf: apt-get install patchelf")
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "patchelf"], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


_PLACEHOLDER = "libimagefactory-symbolic-placeholder.so"


def _dynamic(f: BinaryIO) -> tuple[int, list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(file offset of .dynamic, its (tag, value, offset) entries, PT_LOAD (vaddr, offset, size))."""
    head = f.read(64)
    if head[:6] != b"\x7fELF\x02\x01":
        raise ValueError("not a little-endian ELF64 file")
    (phoff,), (phentsize, phnum) = struct.unpack_from("<Q", head, 32), struct.unpack_from("<HH", head, 54)
    f.seek(phoff)
    table = f.read(phentsize * phnum)
    loads, dyn_off, dyn_size = [], 0, 0
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dyn_off, dyn_size = p_offset, p_filesz
    f.seek(dyn_off)
    raw = f.read(dyn_size)
    entries = [struct.unpack_from("<qQ", raw, j) + (j,) for j in range(0, len(raw), 16)]
    return dyn_off, entries, loads


def make_symbolic(path: Path) -> None:
    """Give a shared library DT_SYMBOLIC (what `ld -Bsymbolic` sets): its references to symbols it
    defines bind to its own definitions, never to another library's. patchelf 0.14 cannot add the
    tag, so it adds a DT_NEEDED entry for a placeholder name, which is then rewritten in place."""
    patchelf("--add-needed", _PLACEHOLDER, str(path))
    with open(path, "r+b") as f:
        dyn_off, entries, loads = _dynamic(f)
        strtab = next(v for t, v, _ in entries if t == 5)
        base = next(off + strtab - va for va, off, size in loads if va <= strtab < va + size)
        for tag, value, at in entries:
            f.seek(base + value)
            if tag == 1 and f.read(len(_PLACEHOLDER) + 1) == _PLACEHOLDER.encode() + b"\0":
                f.seek(dyn_off + at)
                f.write(struct.pack("<qQ", 16, 0))  # DT_SYMBOLIC
                return
    raise RuntimeError(f"{path}: patchelf's new DT_NEEDED entry was not found")


def set_runpath(path: Path, runpath: str) -> None:
    patchelf("--set-rpath", runpath, str(path))


def copy_libs(tree: Path, dst: Path, patterns: tuple[str, ...]) -> None:
    """Shared libraries (files and their soname links) matching `patterns` from a Debian tree into
    dst/lib, each with RUNPATH $ORIGIN so it finds its siblings in the environment."""
    lib = dst / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    for folder in ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"):
        for pattern in patterns:
            for src in sorted((tree / folder).glob(pattern)):
                target = lib / src.name
                if src.is_symlink():
                    os.symlink(os.readlink(src), target)
                else:
                    shutil.copy2(src, target)
                    target.chmod(0o755)
                    set_runpath(target, "$ORIGIN")


def symlinks(dst: Path, links: dict[str, str]) -> None:
    for rel, target in links.items():
        path = dst / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)


def write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def entry_script(module: str, func: str) -> str:
    """A console script that runs the environment's python whatever the prefix (conda-forge writes
    the prefix into the shebang; this assembler records no prefix placeholder)."""
    return ("#!/bin/sh\n"
            "'''exec' \"$(dirname -- \"$(readlink -f -- \"$0\")\")/python\" \"$0\" \"$@\"\n"
            "' '''\n"
            f"import sys\nfrom {module} import {func}\n"
            f"if __name__ == '__main__':\n    sys.argv[0] = sys.argv[0].removesuffix('.exe')\n"
            f"    sys.exit({func}())\n")


# --------------------------------------------------------------------------- python

def _stdlib_ignore(folder: str, names: list[str]) -> set[str]:
    drop = {n for n in names if n in DROPPED_STDLIB}
    if folder.endswith("lib-dynload"):
        drop |= {n for n in names if n.split(".", 1)[0].startswith(DROPPED_MODULES)}
    if os.path.basename(folder).startswith("config-"):
        drop |= {n for n in names if n.endswith(".a")}
    if folder.endswith(f"python{PY}"):
        drop.add("site-packages")
    return drop


def stage_python(dst: Path, home: Path = PYTHON_HOME) -> None:
    """The pyenv CPython (built --enable-shared), relocatable: RUNPATH $ORIGIN/../lib for the
    interpreter, $ORIGIN/../.. for extension modules that link the libraries packaged beside it."""
    (dst / "bin").mkdir(parents=True)
    shutil.copy2(home / f"bin/python{PY}", dst / f"bin/python{PY}")
    symlinks(dst, {"bin/python3": f"python{PY}", "bin/python": f"python{PY}"})
    (dst / "lib").mkdir()
    for so in (f"libpython{PY}.so.1.0", "libpython3.so"):
        shutil.copy2(home / "lib" / so, dst / "lib" / so)
    symlinks(dst, {f"lib/libpython{PY}.so": f"libpython{PY}.so.1.0"})
    shutil.copytree(home / "include", dst / "include", symlinks=True)
    shutil.copytree(home / f"lib/python{PY}", dst / f"lib/python{PY}", symlinks=True, ignore=_stdlib_ignore)
    write(dst / SITE / "README.txt", "This directory exists so that 3rd party packages can be installed here.\n")
    set_runpath(dst / f"bin/python{PY}", "$ORIGIN/../lib")
    set_runpath(dst / "lib/libpython3.so", "$ORIGIN")  # the stable-ABI shim needs libpython3.11.so.1.0
    bundled = {"libssl.so.3", "libcrypto.so.3", "libsqlite3.so.0", "libreadline.so.8", "libncursesw.so.6",
               "libpanelw.so.6"}
    for ext in sorted((dst / f"lib/python{PY}/lib-dynload").glob("*.so")):
        if bundled & set(needed(ext)):
            set_runpath(ext, "$ORIGIN/../..")


def python_packages(src: Sources) -> list[Package]:
    v = src.versions
    libs = [
        Package("openssl", v["libssl3"], digest("openssl", v["libssl3"]) + "_0",
                lambda d: copy_libs(src.debs["libssl3"], d, ("libssl.so.3", "libcrypto.so.3")),
                license="Apache-2.0", summary="OpenSSL (Debian bookworm's libssl3)"),
        Package("libsqlite", v["libsqlite3-0"], digest("libsqlite", v["libsqlite3-0"]) + "_0",
                lambda d: copy_libs(src.debs["libsqlite3-0"], d, ("libsqlite3.so.0*",)),
                license="Unlicense", summary="SQLite (Debian bookworm's libsqlite3-0)"),
        Package("ncurses", v["libncursesw6"], digest("ncurses", v["libncursesw6"]) + "_0",
                lambda d: copy_libs(src.debs["libncursesw6"], d, ("lib*w.so.6*",)),
                license="X11 AND BSD-3-Clause", summary="ncurses (Debian bookworm's libncursesw6)"),
        Package("readline", v["libreadline8"], digest("readline", v["libreadline8"]) + "_0",
                lambda d: copy_libs(src.debs["libreadline8"], d, ("libreadline.so.8*", "libhistory.so.8*")),
                depends=["ncurses >=6.4,<7.0a0"], license="GPL-3.0-only",
                summary="readline (Debian bookworm's libreadline8)"),
    ]
    deps = [f"{p.name} >={p.version},<{int(p.version.split('.')[0]) + 1}.0a0" for p in libs]
    python = Package("python", "3.11.7", digest("python", "3.11.7", deps) + "_0_cpython", stage_python,
                     depends=sorted(deps + ["__glibc >=2.17,<3.0.a0"]), constrains=[f"python_abi {PY}.* *_cp311"],
                     license="Python-2.0", summary="CPython 3.11.7 (this machine's pyenv build, relocated)")
    abi = Package("python_abi", PY, "8_cp311", lambda d: d.mkdir(parents=True, exist_ok=True), build_number=8,
                  constrains=["python 3.11.* *_cpython"], license="BSD-3-Clause",
                  summary="Metapackage to select python implementation")
    return [*libs, python, abi]


# --------------------------------------------------------------------------- BLAS and OpenMP

def _wheel_data(wheel: Path, dst: Path, keep: Callable[[str], bool]) -> None:
    """Files under the wheel's *.data/data/lib/ that `keep` accepts, into dst/lib."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) == 4 and parts[0].endswith(".data") and parts[1:3] == ["data", "lib"] and keep(parts[3]):
                target = dst / "lib" / parts[3]
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as f, open(target, "wb") as out:
                    shutil.copyfileobj(f, out, 1 << 20)
                target.chmod(0o755)


MKL_SKIP = ("blacs", "scalapack", "cdft", "tbb", "sycl")


def _wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def openmp_packages(src: Sources) -> list[Package]:
    iomp = src.wheel("intel_openmp")
    mkl = src.wheel("mkl")
    iomp_v, mkl_v = _wheel_version(iomp), _wheel_version(mkl)
    major = iomp_v.split(".")[0]
    return [
        Package("intel-openmp", iomp_v, digest("intel-openmp", iomp_v) + "_0",
                lambda d: _wheel_data(iomp, d, lambda n: n == "libiomp5.so"), depends=[GLIBC],
                license="LicenseRef-IntelEULA", summary="Intel OpenMP runtime (libiomp5.so from PyPI's wheel)"),
        Package("_openmp_mutex", "4.5", "3_kmp_iomp",
                lambda d: symlinks(d, {"lib/libgomp.so.1": "libiomp5.so"}), build_number=3,
                depends=[f"intel-openmp >={iomp_v}"], license="BSD-3-Clause",
                summary="OpenMP mutex: libgomp.so.1 is the environment's Intel OpenMP runtime"),
        Package("mkl", mkl_v, digest("mkl", mkl_v) + "_0",
                lambda d: _wheel_data(mkl, d, lambda n: n.startswith("libmkl_") and not any(s in n for s in MKL_SKIP)),
                depends=[GLIBC, "_openmp_mutex >=4.5", f"intel-openmp {major}.*"],
                license="LicenseRef-IntelSimplifiedSoftwareOct2022",
                summary="Intel MKL (libmkl_rt and its layers from PyPI's wheel)"),
    ]


def mkl_rt(src: Sources) -> str:
    """libmkl_rt's soname in the mkl wheel (libmkl_rt.so.2 up to MKL 2025, .so.3 after)."""
    with zipfile.ZipFile(src.wheel("mkl")) as z:
        names = [n.rsplit("/", 1)[-1] for n in z.namelist() if "/libmkl_rt.so." in n]
    return sorted(names)[-1]


def _stage_openblas(src: Sources, dst: Path) -> None:
    folder = src.debs["libopenblas0-pthread"] / "usr/lib/x86_64-linux-gnu/openblas-pthread"
    real = next(folder.glob("libopenblasp-r*.so"))
    (dst / "lib").mkdir(parents=True)
    shutil.copy2(real, dst / "lib" / real.name)
    set_runpath(dst / "lib" / real.name, "$ORIGIN")
    symlinks(dst, {"lib/libopenblas.so.0": real.name, "lib/libopenblas.so": real.name})


def _stage_gfortran(src: Sources, dst: Path) -> None:
    copy_libs(src.debs["libgfortran5"], dst, ("libgfortran.so.5*",))
    copy_libs(src.debs["libquadmath0"], dst, ("libquadmath.so.0*",))


def openblas_packages(src: Sources) -> list[Package]:
    ob_v, gf_v = src.versions["libopenblas0-pthread"], src.versions["libgfortran5"]
    gf_dep = f"libgfortran5 >={gf_v}"
    return [
        Package("libgfortran5", gf_v, digest("libgfortran5", gf_v) + "_0",
                partial(_stage_gfortran, src),
                license="GPL-3.0-only WITH GCC-exception-3.1",
                summary="gfortran and quadmath runtimes (Debian bookworm's libgfortran5, libquadmath0)"),
        Package("libopenblas", ob_v, "pthreads_" + digest("libopenblas", ob_v) + "_0",
                lambda d: _stage_openblas(src, d), depends=[gf_dep], constrains=["openblas 0.3.21.*"],
                license="BSD-3-Clause", summary="OpenBLAS, pthreads (Debian bookworm's libopenblas0-pthread)"),
    ]


ACTIVATE = """#!/bin/bash
export CONDA_MKL_INTERFACE_LAYER_BACKUP=${MKL_INTERFACE_LAYER:-}
export MKL_INTERFACE_LAYER="LP64,GNU"
"""
DEACTIVATE = """#!/bin/bash
export MKL_INTERFACE_LAYER=${CONDA_MKL_INTERFACE_LAYER_BACKUP}
unset CONDA_MKL_INTERFACE_LAYER_BACKUP
if [[ -z "${MKL_INTERFACE_LAYER}" ]]; then
    unset MKL_INTERFACE_LAYER
fi
"""


def _stage_switch(dst: Path, lib: str, target: str, activate: bool) -> None:
    symlinks(dst, {f"lib/{lib}.so.3": target, f"lib/{lib}.so": f"{lib}.so.3"})
    if activate:
        write(dst / "etc/conda/activate.d/libblas_mkl_activate.sh", ACTIVATE, 0o755)
        write(dst / "etc/conda/deactivate.d/libblas_mkl_deactivate.sh", DEACTIVATE, 0o755)


def switch_packages(src: Sources, flavour: str, number: int = BLAS_BUILD, blas_target: str | None = None,
                    channel: str = "channel") -> list[Package]:
    """libblas, libcblas and liblapack of one flavour (mkl | openblas): symlinks to the real
    library, as conda-forge's BLAS switch. `blas_target` overrides libblas.so.3's target (the
    broken variant)."""
    real = mkl_rt(src) if flavour == "mkl" else "libopenblas.so.0"
    mkl_v = _wheel_version(src.wheel("mkl"))
    provider = ([f"mkl >={mkl_v},<{int(mkl_v.split('.')[0]) + 1}.0a0"] if flavour == "mkl"
                else [f"libopenblas >={src.versions['libopenblas0-pthread']},<1.0a0"])
    if blas_target:
        provider.append("libopenblas >=0.3.21,<1.0a0")
    build = f"{number}_linux64_{flavour}"
    pin = f"libblas {BLAS} {build}"
    out = []
    for lib in ("libblas", "libcblas", "liblapack"):
        target = blas_target if (blas_target and lib == "libblas") else real
        deps = provider if lib == "libblas" else [pin]
        constrains = [f"{o} {BLAS} {build}" for o in ("libcblas", "liblapack", "liblapacke") if o != lib]
        if lib == "libblas":
            constrains.append(f"blas * {flavour}")
        out.append(Package(lib, BLAS, build,
                           partial(_stage_switch, lib=lib, target=target,
                                   activate=lib == "libblas" and flavour == "mkl"),
                           depends=deps, constrains=constrains, build_number=number, channel=channel,
                           license="BSD-3-Clause", summary=f"{lib}.so.3 -> {target} ({flavour} build of the switch)"))
    return out


def metapackages() -> list[Package]:
    def empty(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
    return [Package("nomkl", "1.0", "h5ca1d4c_0", empty, noarch="generic", license="BSD-3-Clause",
                    summary="Select non-MKL builds (conda-forge's empty metapackage)")]


# --------------------------------------------------------------------------- NumPy

def _stage_numpy(src: Sources, dst: Path) -> None:
    """Debian's python3-numpy 1.24 for CPython 3.11, which links libblas.so.3 and liblapack.so.3:
    its extension modules get RUNPATH $ORIGIN/../../../.. (the environment's lib/), so the
    libblas switch decides its BLAS."""
    dist = src.debs["python3-numpy"] / "usr/lib/python3/dist-packages"
    site = dst / SITE
    shutil.copytree(dist / "numpy", site / "numpy", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    egg = next(dist.glob("numpy-*.egg-info"))
    shutil.copytree(egg, site / egg.name)
    for ext in sorted((site / "numpy").rglob("*.so")):
        if {"libblas.so.3", "liblapack.so.3"} & set(needed(ext)):
            depth = len(ext.relative_to(dst / f"lib/python{PY}").parts) - 1
            set_runpath(ext, "$ORIGIN/" + "/".join([".."] * (depth + 1)))


def numpy_package(src: Sources) -> Package:
    version = src.versions["python3-numpy"]
    deps = [f"{lib} >={BLAS},<4.0a0" for lib in ("libblas", "libcblas", "liblapack")] + [PY_DEP, PY_ABI]
    return Package("numpy", version, f"{PY_TAG}{digest('numpy', version, deps)}_0", lambda d: _stage_numpy(src, d),
                   depends=deps, constrains=["numpy-base <0a0"], license="BSD-3-Clause",
                   summary="NumPy 1.24 (Debian bookworm's python3-numpy, linking libblas.so.3)")


# --------------------------------------------------------------------------- wheels

def extract_wheel(wheel: Path, site: Path, skip: Callable[[str], bool] = lambda n: False) -> Path:
    """A wheel's purelib/platlib files into `site`; returns its dist-info folder (INSTALLER conda,
    no RECORD: conda owns the files)."""
    site.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                name = "/".join(parts[2:])
            if name.endswith("/") or skip(name) or name.endswith(".dist-info/RECORD"):
                continue
            target = site / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as f, open(target, "wb") as out:
                shutil.copyfileobj(f, out, 1 << 20)
            if (info.external_attr >> 16) & 0o111:
                target.chmod(0o755)
    info_dir = next(site.glob("*.dist-info"))
    (info_dir / "INSTALLER").write_text("conda\n")
    return info_dir


PURE = {  # conda-forge name -> (wheel name, depends)
    "typing_extensions": ("typing_extensions", ["python >=3.9"]),
    "filelock": ("filelock", ["python >=3.9"]),
    "mpmath": ("mpmath", ["python >=3.9"]),
    "sympy": ("sympy", ["mpmath >=1.1.0,<1.5", "python >=3.9"]),
    "networkx": ("networkx", ["python >=3.11"]),
    "jinja2": ("jinja2", ["markupsafe >=2.0", "python >=3.9"]),
    "fsspec": ("fsspec", ["python >=3.9"]),
    "threadpoolctl": ("threadpoolctl", ["python >=3.9"]),
    "setuptools": ("setuptools", ["python >=3.9"]),
}


def _stage_wheel(wheel: Path, site: str, dst: Path) -> None:
    extract_wheel(wheel, dst / site)


def wheel_packages(src: Sources) -> list[Package]:
    out = []
    for name, (wheel_name, deps) in PURE.items():
        wheel = src.wheel(wheel_name)
        out.append(Package(name, _wheel_version(wheel), NOARCH_BUILD,
                           partial(_stage_wheel, wheel, "site-packages"),
                           depends=deps, noarch="python", summary=f"{name} (repacked from PyPI's wheel)"))
    ms = src.wheel("markupsafe")
    ms_v = _wheel_version(ms)
    out.append(Package("markupsafe", ms_v, f"{PY_TAG}{digest('markupsafe', ms_v)}_0",
                       partial(_stage_wheel, ms, SITE), depends=[PY_DEP, PY_ABI],
                       license="BSD-3-Clause", summary="markupsafe (repacked from PyPI's cp311 wheel)"))
    return out


# --------------------------------------------------------------------------- torch

_GOMP_RE = re.compile(r"libgomp(-[0-9a-f]+)?\.so\.1")


def _torch_skip(name: str) -> bool:
    """torch's bundled GNU libgomp (torch/lib/libgomp.so.1, or auditwheel's torch.libs/libgomp-*.so.1)
    and its test binaries stay out."""
    base = name.rsplit("/", 1)[-1]
    return (name.startswith(("torch/lib/", "torch.libs/")) and bool(_GOMP_RE.fullmatch(base))) \
        or name.startswith("torch/bin/test_")


def stage_torch(wheel: Path, dst: Path) -> None:
    """PyPI's CPU torch, as conda-forge's links it: no bundled GNU libgomp; libtorch's OpenMP
    dependency is `libgomp.so.1` (a hashed auditwheel name is replaced) and resolves through
    RUNPATH to the environment's lib/ (_openmp_mutex: Intel's runtime, which exports GOMP_*).

    PyPI's libtorch_cpu links MKL statically and exports every MKL symbol. In a process where
    numpy loaded the environment's MKL first, MKL's layers (loaded RTLD_GLOBAL) interposed them:
    with MKL_INTERFACE_LAYER=LP64,GNU (conda-forge's activation) torch.dot on complex128 gave 0j.
    conda-forge's torch has no MKL of its own; DT_SYMBOLIC makes this one keep to its own copy."""
    site = dst / SITE
    info = extract_wheel(wheel, site, _torch_skip)
    lib = site / "torch/lib"
    for so in sorted(lib.glob("*.so*")):
        deps = needed(so)
        for dep in deps:
            if _GOMP_RE.fullmatch(dep) and dep != "libgomp.so.1":
                patchelf("--replace-needed", dep, "libgomp.so.1", str(so))
        if any(_GOMP_RE.fullmatch(dep) for dep in deps):
            set_runpath(so, "$ORIGIN:$ORIGIN/../../../..")
    make_symbolic(lib / "libtorch_cpu.so")
    plain = info.with_name(f"torch-{TORCH}.dist-info")  # conda-forge's reports 2.13.0, not 2.13.0+cpu
    info.rename(plain)
    meta = plain / "METADATA"
    meta.write_text(re.sub(r"(?m)^Version: .*$", f"Version: {TORCH}", meta.read_text(), count=1))
    version = site / "torch/version.py"
    version.write_text(re.sub(r"__version__ = '[^']*'", f"__version__ = '{TORCH}'", version.read_text()))
    for script, target in (("torchrun", "torch.distributed.run"),
                           ("torchfrtrace", "torch.distributed.flight_recorder.fr_trace")):
        write(dst / "bin" / script, entry_script(target, "main"), 0o755)


def torch_packages(src: Sources, staged: Callable[[Path], None]) -> list[Package]:
    """Two builds from one staged tree: cpu_mkl (MKL cells) and cpu_generic (nomkl cells)."""
    mkl_v = _wheel_version(src.wheel("mkl"))
    common = ["_openmp_mutex >=4.5", GLIBC, PY_DEP, PY_ABI, "filelock", "fsspec", "jinja2", "networkx",
              "sympy >=1.13.3", "typing_extensions >=4.10.0", "setuptools", f"libcblas >={BLAS},<4.0a0",
              f"liblapack >={BLAS},<4.0a0"]
    mkl = common + ["libblas * *mkl", f"mkl >={mkl_v},<{int(mkl_v.split('.')[0]) + 1}.0a0"]
    generic = common + ["nomkl", f"libblas >={BLAS},<4.0a0"]
    return [
        Package("pytorch", TORCH, f"cpu_mkl_{PY_TAG}_{digest('pytorch', 'mkl', mkl)}_100", staged, depends=mkl,
                build_number=100, license="BSD-3-Clause", summary="PyTorch (PyPI's CPU wheel, repacked)"),
        Package("pytorch", TORCH, f"cpu_generic_{PY_TAG}_{digest('pytorch', 'generic', generic)}_0", staged,
                depends=generic, license="BSD-3-Clause", summary="PyTorch (PyPI's CPU wheel, repacked)"),
    ]


def all_packages(src: Sources, torch_stage: Callable[[Path], None]) -> list[Package]:
    broken = switch_packages(src, "mkl", BLAS_BUILD + 1, blas_target="libopenblas.so.0", channel="broken")
    return [*python_packages(src), *openmp_packages(src), *openblas_packages(src),
            *switch_packages(src, "mkl"), *switch_packages(src, "openblas"), *metapackages(),
            numpy_package(src), *wheel_packages(src), *torch_packages(src, torch_stage), *broken]
