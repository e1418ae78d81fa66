"""Lock files: one per cell, next to the matrix (locks/<cell-id>.txt), in the format the
cell's own installer consumes.

* pip: a requirements file, `name==version --hash=sha256:...` for every package,
  installed with `pip install --require-hashes --no-deps -r`;
* conda: an `@EXPLICIT` file, one `URL#sha256` line per package, created with
  `conda create --file` (no solve).

A header of `# input KEY: VALUE` lines records what the lock was resolved for (Python,
torch, BLAS, CUDA, installer, packages, indexes or channels). A lock whose inputs no longer
match its cell is stale: rendering refuses it (exit 2) and names the cell and what changed.
This module reads and judges locks; lock.py resolves and writes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from imagefactory.errors import ConfigError
from imagefactory.model import Cell, Matrix

LOCK_DIR = "locks"
CONTEXT_NAME = "lock.txt"  # the lock's name inside a build context
PIP_PLATFORM = "manylinux_2_28_x86_64"  # the oldest glibc the locked wheels may need (Debian 10+)
CONDA_PLATFORM = "linux-64"
PYPI = "https://pypi.org/simple"

_INPUT_RE = re.compile(r"# input (?P<key>[a-z-]+): (?P<value>[ -~]*)")
NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_VERSION = r"[0-9][A-Za-z0-9.!+_-]*"
_SHA256 = r"[0-9a-f]{64}"
_CONDA_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # conda names may start with "_"
VERSION_RE = re.compile(_VERSION)
SHA256_RE = re.compile(_SHA256)
_PIP_LINE_RE = re.compile(rf"(?P<name>{NAME_RE.pattern})==(?P<version>{_VERSION})"
                          rf"(?P<hashes>(?: +--hash=sha256:{_SHA256})+)")
_CONDA_LINE_RE = re.compile(rf"(?P<url>https?://[A-Za-z0-9._~:/%+-]+/(?P<subdir>linux-64|noarch)/"
                            rf"(?P<file>[A-Za-z0-9_][A-Za-z0-9._+!-]*(?:\.conda|\.tar\.bz2)))#(?P<sha256>{_SHA256})")


def canonical(name: str) -> str:
    """PEP 503 normalised name: 'Jinja2' and 'typing_extensions' -> 'jinja2', 'typing-extensions'."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str
    hashes: tuple[str, ...]  # sha256 hex
    line: int  # 1-based, for located messages
    url: str | None = None  # conda: the package URL
    build: str | None = None  # conda: the build string


@dataclass(frozen=True)
class Lock:
    path: Path
    installer: str  # pip | conda
    inputs: tuple[tuple[str, str, int], ...]  # (key, value, line)
    pins: tuple[Pin, ...]
    text: str

    def input(self, key: str) -> tuple[str, int] | None:
        for k, v, line in self.inputs:
            if k == key:
                return v, line
        return None

    def versions(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((p.name, p.version) for p in self.pins))


def path_for(matrix: Matrix, cell: Cell) -> Path:
    return matrix.directory / LOCK_DIR / f"{cell.id}.txt"


def shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def pip_sources(matrix: Matrix, cell: Cell) -> tuple[str | None, list[str]]:
    """(first index or None for PyPI, extra indexes) every locked file of a pip cell may come from."""
    pip = matrix.pip
    extra = list(pip.extra_index_urls)
    if pip.torch_index_url:
        variant = "cpu" if cell.cuda is None else "cu" + cell.cuda.replace(".", "")
        extra.append(pip.torch_index_url.replace("{variant}", variant))
    if cell.blas == "mkl" and pip.numpy_index_url:
        extra.append(pip.numpy_index_url)
    return pip.index_url, extra


def channel_url(channel: str) -> str:
    return channel.rstrip("/") if "://" in channel else f"https://conda.anaconda.org/{channel}"


def inputs(matrix: Matrix, cell: Cell) -> list[tuple[str, str]]:
    """What a cell's lock is resolved for; a lock is stale when any of these differ."""
    out = [("cell", cell.id), ("python", cell.python), ("cuda", cell.cuda or "none"), ("blas", cell.blas),
           ("installer", cell.installer), ("torch", cell.torch), ("numpy", cell.numpy or "any"),
           ("packages", ", ".join(cell.packages) or "none")]
    if cell.installer == "pip":
        first, extra = pip_sources(matrix, cell)
        out += [("indexes", ", ".join([first or PYPI, *extra])),
                ("wheelhouse", "yes" if matrix.pip.wheelhouse else "no"),
                ("platform", f"cp{cell.python.replace('.', '')} {PIP_PLATFORM}")]
    else:
        out += [("channels", ", ".join(matrix.conda.channels)), ("platform", CONDA_PLATFORM)]
    return out


def header(matrix: Matrix, cell: Cell, resolver: str) -> str:
    how = ("pip install --require-hashes --no-deps -r THIS-FILE" if cell.installer == "pip"
           else "conda create -p PREFIX --file THIS-FILE")
    lines = [f"# imagefactory lock for cell {cell.id}. Install with: {how}",
             "# Written by `imagefactory lock`; move it forward with `imagefactory lock --upgrade`. Do not edit.",
             f"# resolver: {resolver}"]
    lines += [f"# input {k}: {v}" for k, v in inputs(matrix, cell)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- reading

def parse(path: Path, installer: str) -> Lock:
    """Read a lock file; a malformed one is a ConfigError with every bad line located."""
    where = shown(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}:1: (lock): cannot read: {e}") from None
    problems: list[str] = []
    found: list[tuple[str, str, int]] = []
    pins: list[Pin] = []
    explicit = False
    for number, line in _logical_lines(text):
        if not line:
            continue
        if line.startswith("#"):
            m = _INPUT_RE.fullmatch(line)
            if m:
                found.append((m["key"], m["value"], number))
            continue
        if installer == "conda" and line == "@EXPLICIT":
            explicit = True
            continue
        pin = _pip_pin(line, number) if installer == "pip" else (conda_pin(line, number) if explicit else None)
        if pin is None:
            want = ("name==version --hash=sha256:<64 hex> ..." if installer == "pip"
                    else "@EXPLICIT, then URL#<sha256, 64 hex> per line")
            problems.append(f"{where}:{number}: (lock): malformed line {line[:80]!r} (expected {want})")
        else:
            pins.append(pin)
    if installer == "conda" and not explicit:
        problems.append(f"{where}:1: (lock): no @EXPLICIT line: not an explicit conda environment")
    seen: dict[str, int] = {}
    for pin in pins:
        if pin.name in seen:
            problems.append(f"{where}:{pin.line}: {pin.name}: locked twice (first on line {seen[pin.name]})")
        seen.setdefault(pin.name, pin.line)
    if not pins and not problems:
        problems.append(f"{where}:1: (lock): locks no package")
    if problems:
        raise ConfigError(problems)
    return Lock(path=path, installer=installer, inputs=tuple(found), pins=tuple(pins), text=text)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, line) with backslash continuations joined."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for i, raw in enumerate(text.splitlines(), 1):
        if not buf:
            start = i
        stripped = raw.strip()
        if stripped.endswith("\\") and not stripped.startswith("#"):
            buf += stripped[:-1].rstrip() + " "
            continue
        out.append((start, (buf + stripped).strip()))
        buf = ""
    if buf:
        out.append((start, buf.strip()))
    return out


def _pip_pin(line: str, number: int) -> Pin | None:
    m = _PIP_LINE_RE.fullmatch(" ".join(line.split()))
    if not m:
        return None
    hashes = tuple(h.split(":", 1)[1] for h in m["hashes"].split())
    return Pin(canonical(m["name"]), m["version"], hashes, number)


def conda_pin(line: str, number: int) -> Pin | None:
    m = _CONDA_LINE_RE.fullmatch(line)
    if not m:
        return None
    stem = re.sub(r"(\.conda|\.tar\.bz2)$", "", m["file"])
    parts = stem.rsplit("-", 2)
    if len(parts) != 3 or not _CONDA_NAME_RE.fullmatch(parts[0]):
        return None
    name, version, build = parts
    return Pin(name, version, (m["sha256"],), number, url=m["url"], build=build)


# --------------------------------------------------------------------------- judging

def stale(lock: Lock, matrix: Matrix, cell: Cell) -> list[str]:
    """Why `lock` no longer fits `cell`, one located line each; [] when it fits."""
    where = shown(lock.path)
    fix = f"run `imagefactory lock --only {cell.id}`"
    problems = []
    for key, want in inputs(matrix, cell):
        got = lock.input(key)
        if got is None:
            problems.append(f"{where}:1: input.{key}: cell {cell.id}: the lock does not record {key} "
                            f"(the cell has {want!r}); {fix}")
        elif got[0] != want:
            problems.append(f"{where}:{got[1]}: input.{key}: cell {cell.id} changed: the lock was made for "
                            f"{key} {got[0]!r}, the cell now has {want!r}; {fix}")
    problems += _body_problems(lock, matrix, cell, where, fix)
    return problems


def _release(version: str) -> tuple[int, ...] | str:
    """'2.13.0+cpu' -> (2, 13); trailing zeros dropped so '2.13' == '2.13.0'."""
    base = version.split("+", 1)[0]
    if not re.fullmatch(r"[0-9]+(?:\.[0-9]+)*", base):
        return base
    nums = [int(p) for p in base.split(".")]
    while len(nums) > 1 and nums[-1] == 0:
        nums.pop()
    return tuple(nums)


def _body_problems(lock: Lock, matrix: Matrix, cell: Cell, where: str, fix: str) -> list[str]:
    """The pins themselves must agree with the cell, whatever the header says."""
    by_name = {p.name: p for p in lock.pins}
    out = []
    torch = by_name.get("torch" if cell.installer == "pip" else "pytorch")
    if torch is not None and _release(torch.version) != _release(cell.torch):
        out.append(f"{where}:{torch.line}: {torch.name}: cell {cell.id} wants torch {cell.torch}, "
                   f"the lock pins {torch.version}; {fix}")
    if cell.installer == "pip":
        if torch is None:
            out.append(f"{where}:1: torch: cell {cell.id}: the lock pins no torch; {fix}")
        return out
    python = by_name.get("python")
    if python is not None and ".".join(python.version.split(".")[:2]) != cell.python:
        out.append(f"{where}:{python.line}: python: cell {cell.id} wants Python {cell.python}, "
                   f"the lock pins {python.version}; {fix}")
    libblas = by_name.get("libblas")
    if libblas is not None and not (libblas.build or "").endswith(f"_{cell.blas}"):
        out.append(f"{where}:{libblas.line}: libblas: cell {cell.id} wants {cell.blas}, the lock pins "
                   f"libblas build {libblas.build}; {fix}")
    bases = [channel_url(c) + "/" for c in matrix.conda.channels]
    for pin in lock.pins:
        if pin.url and not any(pin.url.startswith(b) for b in bases):
            out.append(f"{where}:{pin.line}: {pin.name}: {pin.url} is from none of the matrix's channels "
                       f"({', '.join(matrix.conda.channels)}); {fix}")
    return out


def load(matrix: Matrix, cell: Cell) -> Lock | None:
    """The cell's lock, checked against the cell; None when the cell has none.
    A malformed or stale lock is a ConfigError (exit 2) naming the cell and what changed."""
    path = path_for(matrix, cell)
    if not path.is_file():
        return None
    lock = parse(path, cell.installer)
    problems = stale(lock, matrix, cell)
    if problems:
        raise ConfigError(problems)
    return lock


def load_all(matrix: Matrix, cells: list[Cell]) -> dict[str, Lock | None]:
    """Every cell's lock, or one ConfigError listing the problems of all of them."""
    out: dict[str, Lock | None] = {}
    problems: list[str] = []
    for cell in cells:
        try:
            out[cell.id] = load(matrix, cell)
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems)
    return out
