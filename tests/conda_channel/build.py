"""Build the test conda channel, its broken twin and the stand-in installer (cached).

    python3 -m tests.conda_channel.build --out DIR [--force]

`build(out)` returns a ChannelInfo. The result is cached under
${IMAGEFACTORY_CI_CACHE:-~/.cache/imagefactory-ci}/conda-channel/<key>, where <key> hashes
this builder's own source: a changed builder builds again, an unchanged one returns at once.
A build is made in a temporary folder and renamed into place, so an interrupted build leaves
no half channel; `out` gets hard links to the cached files (no copy).

Layout (served as the root of a ChannelServer):
    channel/{linux-64,noarch}/   the channel (repodata.json, .conda files)
    broken/{linux-64,noarch}/    a libblas *_mkl switch whose libblas.so.3 is OpenBLAS
    installer.sh                 the stand-in Miniforge installer
    channel.json                 what tests need (ChannelInfo)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.conda_channel import installer, packages
from tests.conda_channel.packages import Package

HERE = Path(__file__).resolve().parent
# What each cached part's key hashes: the packages, and the installer (rebuilt alone, in seconds,
# when only the stand-in conda or the installer changes).
PACKAGE_SOURCES = ("build.py", "packages.py")
INSTALLER_SOURCES = ("packages.py", "installer.py", "standin_conda.py")
CHANNEL, BROKEN, INSTALLER, INFO = "channel", "broken", "installer.sh", "channel.json"
TIMESTAMP = datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)


@dataclass(frozen=True)
class PackageFile:
    channel: str  # CHANNEL or BROKEN
    subdir: str
    file: str
    name: str
    version: str
    build: str
    sha256: str
    depends: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ChannelInfo:
    root: Path  # serve this folder
    key: str  # the builder's hash
    channel: str  # the channel's folder under root
    broken: str  # the broken channel's folder under root
    installer: str  # the installer's file name under root
    installer_sha256: str
    python: str
    torch: str
    packages: tuple[PackageFile, ...]

    def channel_url(self, base: str, broken: bool = False) -> str:
        """The channel's URL under a server's base URL (http://127.0.0.1:PORT)."""
        return f"{base.rstrip('/')}/{self.broken if broken else self.channel}"

    def installer_url(self, base: str) -> str:
        return f"{base.rstrip('/')}/{self.installer}"

    def find(self, name: str, build_contains: str = "", channel: str | None = None) -> PackageFile:
        for p in self.packages:
            if p.name == name and build_contains in p.build and p.channel == (channel or self.channel):
                return p
        raise KeyError(f"{name} *{build_contains}* not in the channel")

    @classmethod
    def load(cls, root: Path) -> ChannelInfo:
        data = json.loads((root / INFO).read_text())
        data["packages"] = tuple(PackageFile(**p) for p in data["packages"])
        return cls(root=root, **data)


def cache_root() -> Path:
    base = os.environ.get("IMAGEFACTORY_CI_CACHE") or str(Path.home() / ".cache/imagefactory-ci")
    return Path(base) / "conda-channel"


def _hash(names: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    return h.hexdigest()[:8]


def key() -> str:
    """The cache key: 8 hex digits for the packages' builder, 8 for the installer's."""
    return _hash(PACKAGE_SOURCES) + _hash(INSTALLER_SOURCES)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def log(msg: str) -> None:
    print(f"[conda-channel] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- assembling

def assemble(pkg: Package, stage: Path, out: Path) -> PackageFile:
    from rattler_build import assemble_package
    subdir = out / pkg.channel / pkg.subdir
    subdir.mkdir(parents=True, exist_ok=True)
    made = assemble_package(pkg.name, pkg.version, pkg.subdir, pkg.build, subdir, files_dir=stage,
                            depends=pkg.depends, constrains=pkg.constrains, build_number=pkg.build_number,
                            noarch=pkg.noarch, license=pkg.license, summary=pkg.summary, timestamp=TIMESTAMP,
                            compression_level=pkg.level, detect_prefix=False)
    path = Path(made.path)
    return PackageFile(pkg.channel, pkg.subdir, path.name, pkg.name, pkg.version, pkg.build, _sha256(path),
                       list(pkg.depends))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def zstd_stored(data: bytes) -> bytes:
    """A zstd frame of raw (stored) blocks: valid zstd that any reader decodes, for the few KB of
    an info/ tar (Python 3.11 has no zstd compressor)."""
    out = bytearray(b"\x28\xb5\x2f\xfd\x00\x38")  # magic; no content size; window 2^17
    step = 1 << 17
    chunks = [data[i:i + step] for i in range(0, len(data), step)] or [b""]
    for i, chunk in enumerate(chunks):
        out += ((len(chunk) << 3) | (i == len(chunks) - 1)).to_bytes(3, "little") + chunk
    return bytes(out)


async def _info_files(path: Path) -> dict[str, bytes]:
    from rattler.package_streaming import PackageArchive
    archive = await PackageArchive.from_path(path)
    names = await archive.list_files("info")
    found = await archive.read_files(names)
    return {n: data for n, data in found.items() if data is not None}


def variant(base: PackageFile, pkg: Package, out: Path) -> PackageFile:
    """Another build of an assembled package without compressing its files again: the payload
    (pkg-*.tar.zst) byte for byte, a new info/ whose index.json has this build's string, number
    and depends. Used for pytorch's two builds (one staged tree)."""
    src = out / base.channel / base.subdir / base.file
    stem = f"{pkg.name}-{pkg.version}-{pkg.build}"
    info = asyncio.run(_info_files(src))
    index = json.loads(info["info/index.json"])
    index.update(build=pkg.build, build_number=pkg.build_number, depends=sorted(pkg.depends),
                 constrains=sorted(pkg.constrains))
    info["info/index.json"] = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(info.items()):
            entry = tarfile.TarInfo(name)
            entry.size, entry.mode, entry.mtime = len(data), 0o644, int(TIMESTAMP.timestamp())
            tar.addfile(entry, io.BytesIO(data))
    target = out / pkg.channel / pkg.subdir / f"{stem}.conda"
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        new.writestr("metadata.json", old.read("metadata.json"))
        with old.open(f"pkg-{src.name[:-6]}.tar.zst") as payload, new.open(f"pkg-{stem}.tar.zst", "w",
                                                                            force_zip64=True) as dst:
            shutil.copyfileobj(payload, dst, 1 << 20)
        new.writestr(f"info-{stem}.tar.zst", zstd_stored(buf.getvalue()))
    return PackageFile(pkg.channel, pkg.subdir, target.name, pkg.name, pkg.version, pkg.build, _sha256(target),
                       list(pkg.depends))


def _stage_all(pkgs: list[Package], work: Path, out: Path) -> list[PackageFile]:
    made: list[PackageFile] = []
    staged: dict[int, PackageFile] = {}
    for pkg in pkgs:
        started = time.monotonic()
        first = staged.get(id(pkg.stage))  # builds that share one staged tree (pytorch)
        if first is not None:
            made.append(variant(first, pkg, out))
        else:
            folder = work / "stage" / f"{pkg.name}-{pkg.build}"
            pkg.stage(folder)
            folder.mkdir(parents=True, exist_ok=True)
            made.append(assemble(pkg, folder, out))
            staged[id(pkg.stage)] = made[-1]
        log(f"{pkg.channel}/{pkg.subdir}/{made[-1].file} ({time.monotonic() - started:.1f} s)")
    return made


def index(out: Path) -> None:
    from rattler.index import index_fs
    for channel in (CHANNEL, BROKEN):
        for subdir in ("linux-64", "noarch"):
            (out / channel / subdir).mkdir(parents=True, exist_ok=True)
        asyncio.run(index_fs(out / channel, write_zst=False, write_shards=False, force=True))


def self_test(out: Path) -> None:
    """Both cells' specs solve against the finished channel, to the right builds."""
    import rattler
    channel = rattler.Channel((out / CHANNEL).as_uri())
    base = ["python=3.11", f"pytorch={packages.TORCH}=cpu*", "numpy", "threadpoolctl"]
    for blas, extra, torch_build in (("mkl", [], "_mkl_"), ("openblas", ["nomkl"], "_generic_")):
        specs = [rattler.MatchSpec(s, strict=False) for s in [*base, f"libblas=*=*{blas}", *extra]]
        records = asyncio.run(rattler.solve([channel], specs, platforms=["linux-64", "noarch"],
                                            virtual_packages=rattler.VirtualPackage.detect()))
        got = {r.name.normalized: str(r.build) for r in records}
        assert torch_build in got["pytorch"], (blas, got["pytorch"])
        for lib in ("libblas", "libcblas", "liblapack"):
            assert got[lib].endswith("_" + blas), (blas, lib, got[lib])
        assert ("mkl" in got) == (blas == "mkl") and ("nomkl" in got) == (blas == "openblas"), sorted(got)
    broken = rattler.Channel((out / BROKEN).as_uri())
    specs = [rattler.MatchSpec(s, strict=False) for s in [*base, "libblas=*=*mkl"]]
    records = asyncio.run(rattler.solve([broken, channel], specs, platforms=["linux-64", "noarch"],
                                        virtual_packages=rattler.VirtualPackage.detect()))
    got = {r.name.normalized: str(r.build) for r in records}
    assert got["libblas"] == f"{packages.BLAS_BUILD + 1}_linux64_mkl", got["libblas"]  # broken/ wins


@contextlib.contextmanager
def _building(final: Path) -> Iterator[tuple[Path, Path]]:
    """(work, out): build into out; on success out becomes `final` (rename), work is removed."""
    work = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    out = work / "out"
    out.mkdir(parents=True)
    started = time.monotonic()
    try:
        yield work, out
        shutil.rmtree(final, ignore_errors=True)
        out.rename(final)
        log(f"built {final} in {time.monotonic() - started:.1f} s")
    except BaseException:
        if os.environ.get("IMAGEFACTORY_CONDA_CHANNEL_KEEP"):  # debugging the builder: look at it
            log(f"build failed; kept {work}")
            work = Path("/nonexistent")
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_packages(final: Path) -> None:
    """channel/ and broken/, indexed and self-tested, and packages.json."""
    with _building(final) as (work, out):
        started = time.monotonic()
        src = packages.fetch(work / "src")
        log(f"sources fetched ({time.monotonic() - started:.1f} s)")
        torch_wheel = src.wheel("torch")
        pkgs = packages.all_packages(src, lambda d: packages.stage_torch(torch_wheel, d))
        made = _stage_all(pkgs, work, out)
        index(out)
        self_test(out)
        python = next(p for p in pkgs if p.name == "python")
        doc = {"python": python.version, "torch": packages.TORCH, "packages": [asdict(m) for m in made]}
        (out / "packages.json").write_text(json.dumps(doc, indent=1) + "\n")


def build_installer(final: Path) -> None:
    """installer.sh (the channel's python, staged again the same way) and installer.json."""
    with _building(final) as (work, out):
        src = packages.fetch(work / "src", wheels_too=False, debs_wanted=packages.PYTHON_DEBS)
        stages = []
        for pkg in packages.python_packages(src):
            if pkg.name != "python_abi":
                stages.append(work / "stage" / pkg.name)
                pkg.stage(stages[-1])
        sha = installer.make(stages[-1], stages[:-1], out / INSTALLER)
        (out / "installer.json").write_text(json.dumps({"installer_sha256": sha}) + "\n")


def _combine(pkgs: Path, inst: Path, final: Path) -> None:
    """The served tree: hard links to both parts, and channel.json."""
    with _building(final) as (_, out):
        for part in (pkgs / CHANNEL, pkgs / BROKEN, inst / INSTALLER):
            _link_tree(part, out / part.name)
        doc = json.loads((pkgs / "packages.json").read_text())
        info = {"key": final.name, "channel": CHANNEL, "broken": BROKEN, "installer": INSTALLER,
                "installer_sha256": json.loads((inst / "installer.json").read_text())["installer_sha256"],
                "python": doc["python"], "torch": doc["torch"], "packages": doc["packages"]}
        (out / INFO).write_text(json.dumps(info, indent=1) + "\n")


def _link(s: str | Path, d: str | Path) -> None:
    try:
        os.link(s, d)
    except OSError:
        shutil.copy2(s, d)


def _link_tree(src: Path, dst: Path) -> None:
    """dst: a fresh copy of src (a folder or a file) made of hard links (copies where links cannot be
    made), swapped in."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if src.is_dir():
        shutil.copytree(src, tmp, copy_function=_link)
    else:
        _link(src, tmp)
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    elif old.exists():
        old.unlink()


def _prune(root: Path, keep: set[str]) -> None:
    """Other builds (and temporary folders crashed builds left: we hold the lock) go."""
    for entry in root.iterdir():
        if entry.is_dir() and entry.name not in keep:
            shutil.rmtree(entry, ignore_errors=True)


def build(out: Path | None = None, force: bool = False) -> ChannelInfo:
    """The channel (built, or taken from the cache); with `out`, hard-linked into that folder."""
    root = cache_root()
    final = root / key()
    with _locked(root):
        if force or not (final / INFO).is_file():
            pkgs, inst = root / f"packages-{final.name[:8]}", root / f"installer-{final.name[8:]}"
            if force or not (pkgs / "packages.json").is_file():
                build_packages(pkgs)
            if force or not (inst / "installer.json").is_file():
                build_installer(inst)
            _combine(pkgs, inst, final)
            _prune(root, {final.name, pkgs.name, inst.name})
    if out is None:
        return ChannelInfo.load(final)
    out = Path(out).resolve()
    if not (out / INFO).is_file() or json.loads((out / INFO).read_text()).get("key") != final.name:
        _link_tree(final, out)
    return ChannelInfo.load(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder to hard-link the channel into")
    parser.add_argument("--force", action="store_true", help="build again even if cached")
    args = parser.parse_args(argv)
    started = time.monotonic()
    info = build(args.out, args.force)
    log(f"{info.root}: {len(info.packages)} packages, installer sha256 {info.installer_sha256} "
        f"({time.monotonic() - started:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
