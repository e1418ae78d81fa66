"""Lock files: one per cell, next to the matrix (locks/<cell-id>.txt), in the format the
cell's own installer consumes.

* pip: a requirements file, `name==version --hash=sha256:...` for every package,
  installed with `pip install --require-hashes --no-deps -r`;
* conda: an `@EXPLICIT` file, one `URL#sha256` line per package, created with
  `conda create --file` (no solve).

A header of `# input KEY: VALUE` lines records what the lock was resolved for (Python,
torch, BLAS, CUDA, installer, packages, indexes or channels). A lock whose inputs no longer
match its cell is stale: rendering refuses it (exit 2) and names the cell and what changed.
This module reads and judges locks; lock/resolve.py resolves and writes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from imagefactory.config import availability
from imagefactory.config import platforms
from imagefactory.files import bounded
from imagefactory import terminal
from imagefactory.files import yamlfile
from imagefactory.errors import ConfigError
from imagefactory.config.model import Cell, Matrix

LOCK_DIR = "locks"
CONTEXT_NAME = "lock.txt"  # the lock's name inside a build context
PYPI = "https://pypi.org/simple"

_INPUT_RE = re.compile(r"# input (?P<key>[a-z-]+): (?P<value>[ -~]*)")
NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_VERSION = r"[0-9][A-Za-z0-9.!+_-]*"
_SHA256 = r"[0-9a-f]{64}"
_SUBDIRS = "|".join(re.escape(p.conda_subdir) for p in platforms.PLATFORMS.values())
_CONDA_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # conda names may start with "_"
VERSION_RE = re.compile(_VERSION)
_MD5_TAIL_RE = re.compile(r"#[0-9a-fA-F]{32}$")
SHA256_RE = re.compile(_SHA256)
_PIP_LINE_RE = re.compile(rf"(?P<name>{NAME_RE.pattern})==(?P<version>{_VERSION})"
                          rf"(?P<hashes>(?: +--hash=sha256:{_SHA256})+)")
_CONDA_LINE_RE = re.compile(rf"(?P<url>https?://[A-Za-z0-9._~:/%+-]+/(?P<subdir>{_SUBDIRS}|noarch)/"
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
    # `# resolved:` records: (name, version, conda build or None, line): what the resolver returned
    resolved: tuple[tuple[str, str, str | None, int], ...] = ()

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
                ("platform", f"cp{cell.python.replace('.', '')} {cell.platform.pip_platform}")]
    else:
        out += [("channels", ", ".join(matrix.conda.channels)), ("platform", cell.platform.conda_subdir)]
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

LOCK_MAX_BYTES = 4 << 20  # a lock of a few hundred packages is tens of KB
FIRST_LINE = "# imagefactory lock for cell "
_RESOLVED_RE = re.compile(rf"# resolved: (?P<name>[A-Za-z0-9_][A-Za-z0-9._-]*)==(?P<version>{_VERSION})"
                          r"(?:=(?P<build>[A-Za-z0-9_.+!-]+))?")


def read(path: Path) -> str | None:
    """The text of a lock file; None when there is none (not even a broken link or a FIFO).
    Read like the matrix file: a regular file inside locks/, within LOCK_MAX_BYTES, UTF-8, and
    written by `imagefactory lock`; nothing of a file that is not one is ever shown."""
    where = shown(path)
    try:
        raw = bounded.read_within(path, path.parent, LOCK_MAX_BYTES)
    except bounded.InputError as e:
        raise ConfigError(terminal.printable(f"{where}:1: (lock): {e}; a lock is a regular file inside "
                                           f"{LOCK_DIR}/ (run `imagefactory lock` to write it)")) from None
    if raw is None:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(terminal.printable(f"{where}:{line}: (lock): byte "
                                           f"0x{raw[e.start]:02x} is not UTF-8: not a lock file")) from None
    if not text.startswith(FIRST_LINE):
        raise ConfigError(terminal.printable(f"{where}:1: (lock): not a lock written by `imagefactory lock` "
                                           f"(its first line is not {FIRST_LINE.strip()!r}); nothing of it "
                                           f"is shown; run `imagefactory lock`"))
    return text


def parse(path: Path, installer: str, text: str | None = None) -> Lock:
    """Read a lock file; a malformed one is a ConfigError with every bad line located (capped)."""
    where = shown(path)
    if text is None:
        text = read(path)
        if text is None:
            raise ConfigError(terminal.printable(f"{where}:1: (lock): no such lock file"))
    problems: list[str] = []
    found: list[tuple[str, str, int]] = []
    pins: list[Pin] = []
    records: list[tuple[str, str, str | None, int]] = []
    explicit = False
    for number, line in _logical_lines(text):
        if not line:
            continue
        if line.startswith("#"):
            m = _INPUT_RE.fullmatch(line)
            if m:
                found.append((m["key"], m["value"], number))
            r = _RESOLVED_RE.fullmatch(line)
            if r:
                records.append((canonical(r["name"]) if installer == "pip" else r["name"], r["version"],
                                r["build"], number))
            continue
        if installer == "conda" and line == "@EXPLICIT":
            explicit = True
            continue
        pin = _pip_pin(line, number) if installer == "pip" else (conda_pin(line, number) if explicit else None)
        if pin is None:
            want = ("name==version --hash=sha256:<64 hex>" if installer == "pip"
                    else "@EXPLICIT, then URL#<sha256, 64 hex> per line")
            md5 = ("; #<32 hex> is an md5, conda's own explicit format: a lock pins each file by its sha256"
                   if installer == "conda" and _MD5_TAIL_RE.search(line) else "")
            problems.append(f"{where}:{number}: (lock): malformed line {terminal.show(line)} (expected {want}){md5}")
        else:
            pins.append(pin)
    if installer == "conda" and not explicit:
        problems.append(f"{where}:1: (lock): no @EXPLICIT line: not an explicit conda environment")
    problems += _pin_problems(pins, where)
    if not pins and not problems:
        problems.append(f"{where}:1: (lock): locks no package")
    if problems:
        raise ConfigError(yamlfile.capped(problems))
    return Lock(path=path, installer=installer, inputs=tuple(found), pins=tuple(pins), text=text,
                resolved=tuple(records))


def _pin_problems(pins: list[Pin], where: str) -> list[str]:
    """Each package locked once, to exactly one file, and no file's sha256 given to another."""
    problems = []
    seen: dict[str, int] = {}
    digests: dict[str, Pin] = {}
    for pin in pins:
        if pin.name in seen:
            problems.append(f"{where}:{pin.line}: {pin.name}: locked twice (first on line {seen[pin.name]})")
        seen.setdefault(pin.name, pin.line)
        if len(pin.hashes) != 1:
            problems.append(f"{where}:{pin.line}: {pin.name}: {len(pin.hashes)} hashes; a lock names exactly "
                            f"one file per package, with one sha256")
        for digest in pin.hashes:
            other = digests.setdefault(digest, pin)
            if other is not pin and other.name != pin.name:
                problems.append(f"{where}:{pin.line}: {pin.name}: sha256 {digest[:12]}... is also the hash of "
                                f"{other.name} (line {other.line}); two files cannot share one sha256")
    return problems


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


def requirement_pins(text: str) -> tuple[list[Pin], list[tuple[int, str]]]:
    """The `name==version --hash=sha256:...` lines of a requirements text (a resolver's output;
    comments skipped, several hashes allowed), and every other line, located: what lock/resolve.py checks
    of a resolver's answer before any of it is used."""
    pins, other = [], []
    for number, line in _logical_lines(text):
        if not line or line.startswith("#"):
            continue
        pin = _pip_pin(line, number)
        if pin is None:
            other.append((number, line))
        else:
            pins.append(pin)
    return pins, other


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
    """Why `lock` no longer fits `cell`, one located line each; [] when it fits. The header must
    record exactly the cell's inputs; the body must be the recorded resolution, complete, of the
    cell's build variant, from the matrix's channels."""
    where = shown(lock.path)
    fix = f"run `imagefactory lock --only {cell.id}`"
    problems = []
    wanted = dict(inputs(matrix, cell))
    seen: dict[str, int] = {}
    for key, _value, line in lock.inputs:
        if key in seen:
            problems.append(f"{where}:{line}: input.{key}: given twice (first on line {seen[key]}); {fix}")
        elif key not in wanted:
            problems.append(f"{where}:{line}: input.{key}: not an input of a {cell.installer} cell; {fix}")
        seen.setdefault(key, line)
    for key, want in wanted.items():
        got = lock.input(key)
        if got is None:
            problems.append(f"{where}:1: input.{key}: cell {cell.id}: the lock does not record {key} "
                            f"(the cell has {want!r}); {fix}")
        elif got[0] != want:
            problems.append(f"{where}:{got[1]}: input.{key}: cell {cell.id} changed: the lock was made for "
                            f"{key} {got[0]!r}, the cell now has {want!r}; {fix}")
    problems += _body_problems(lock, matrix, cell, where, fix)
    problems += _resolution_problems(lock, cell, where, fix)
    problems += (_pip_variant if cell.installer == "pip" else _conda_variant)(lock, matrix, cell, where, fix)
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


def resolution(pins: tuple[Pin, ...] | list[Pin]) -> str:
    """The `# resolved:` records of what the resolver returned, written into the lock's header:
    the lock is complete when its lines are exactly these."""
    return "".join(f"# resolved: {p.name}=={p.version}" + (f"={p.build}" if p.build else "") + "\n"
                   for p in sorted(pins, key=lambda p: p.name))


def roots(cell: Cell) -> list[str]:
    """Packages every lock of `cell` must pin: what the cell asks for (conda: the environment's
    python, numpy and cuda-version; pytorch is judged by version and build when present)."""
    if cell.installer == "pip":
        names = ["torch", "numpy", "threadpoolctl"]
        names += [canonical(m.group()) for spec in cell.packages if (m := NAME_RE.match(spec))]
    else:
        names = ["python", "numpy"] + (["cuda-version"] if cell.cuda else [])
        names += [m.group() for spec in cell.packages if (m := _CONDA_NAME_RE.match(spec))]
    return list(dict.fromkeys(names))


def _resolution_problems(lock: Lock, cell: Cell, where: str, fix: str) -> list[str]:
    """Completeness: the lines pin exactly the recorded resolution, and what the cell asks for.
    A lock is installed with --no-deps (pip) or without a solve (conda): a package missing
    from it is missing from the image."""
    if not lock.resolved:
        return [f"{where}:1: (lock): cell {cell.id}: records no resolution (`# resolved:` lines), so "
                f"nothing shows it is complete; {fix}"]
    out = []
    records: dict[str, tuple[str, str | None, int]] = {}
    for name, version, build, line in lock.resolved:
        if name in records:
            out.append(f"{where}:{line}: {name}: recorded twice in the resolution; {fix}")
        records.setdefault(name, (version, build, line))
    pinned = {p.name: p for p in lock.pins}
    for pin in lock.pins:
        rec = records.get(pin.name)
        if rec is None:
            out.append(f"{where}:{pin.line}: {pin.name}: not in the lock's recorded resolution (a package "
                       f"added by hand); {fix}")
        elif (rec[0], rec[1]) != (pin.version, pin.build):
            out.append(f"{where}:{pin.line}: {pin.name}: pins {pin.version}{'=' + pin.build if pin.build else ''}"
                       f", the recorded resolution has {rec[0]}{'=' + rec[1] if rec[1] else ''}; {fix}")
    for name, (version, _, line) in records.items():
        if name not in pinned:
            out.append(f"{where}:{line}: {name}: the recorded resolution needs {name} {version}, and no line "
                       f"pins it (the image would lack it); {fix}")
    for name in roots(cell):
        if name not in pinned and name not in records:
            out.append(f"{where}:1: {name}: cell {cell.id} asks for {name}, and the lock pins none; {fix}")
    return out


_LOCAL_VARIANT = re.compile(r"cpu|cu[0-9]+|rocm[0-9.]+")


def _pip_variant(lock: Lock, matrix: Matrix, cell: Cell, where: str, fix: str) -> list[str]:
    """The build variant: a local version such as +cu129 must be the cell's; a CPU cell pins no
    NVIDIA package; torch is the build the cell's index serves (+cpu, +cuXY, or PyPI's plain one)."""
    variant = "cpu" if cell.cuda is None else "cu" + cell.cuda.replace(".", "")
    plain_cpu = cell.cuda is None and availability.pypi_serves_cpu(cell.torch, cell.python, cell.platform)
    torch_local = variant if matrix.pip.torch_index_url or (cell.cuda is None and not plain_cpu) else None
    out = []
    for pin in lock.pins:
        local = pin.version.split("+", 1)[1] if "+" in pin.version else None
        if pin.name == "torch" and local != torch_local:
            want = f"+{torch_local}" if torch_local else ("no local version (PyPI's CPU build for "
                                                          f"{cell.platform})" if plain_cpu else
                                                          "no local version (PyPI's default CUDA build)")
            out.append(f"{where}:{pin.line}: torch: cell {cell.id} wants the {want} build, the lock pins "
                       f"{pin.version}; {fix}")
        elif local is not None and _LOCAL_VARIANT.fullmatch(local) and local != variant:
            out.append(f"{where}:{pin.line}: {pin.name}: {pin.version} is a +{local} build, cell {cell.id} "
                       f"is +{variant}; {fix}")
        elif cell.cuda is None and pin.name.startswith("nvidia-"):
            out.append(f"{where}:{pin.line}: {pin.name}: a CUDA library in the lock of CPU cell {cell.id}; {fix}")
    return out


_CONDA_URL_BAD = re.compile(r"(?:^|/)\.{1,2}(?:/|$)|//|%|\\")


def _conda_variant(lock: Lock, matrix: Matrix, cell: Cell, where: str, fix: str) -> list[str]:
    """The build variant (pytorch's cpu_/cudaXY_ and mkl/generic build, the BLAS libraries' builds,
    cuda-version) and every URL exactly CHANNEL/SUBDIR/FILE of one of the matrix's channels."""
    out = []
    cuda_tag = "cpu" if cell.cuda is None else "cuda" + cell.cuda.replace(".", "")
    blas_tag = "mkl" if cell.blas == "mkl" else "generic"
    bases = {channel_url(c) for c in matrix.conda.channels}
    for pin in lock.pins:
        build = pin.build or ""
        if pin.name == "pytorch" and not (build.startswith(cuda_tag + "_") and f"_{blas_tag}_" in build):
            out.append(f"{where}:{pin.line}: pytorch: cell {cell.id} wants a {cuda_tag}_{blas_tag} build, the "
                       f"lock pins build {build}; {fix}")
        elif pin.name in ("libblas", "libcblas", "liblapack", "liblapacke") and not build.endswith(f"_{cell.blas}"):
            out.append(f"{where}:{pin.line}: {pin.name}: cell {cell.id} wants {cell.blas}, the lock pins "
                       f"{pin.name} build {build}; {fix}")
        elif pin.name == "cuda-version" and pin.version != (cell.cuda or ""):
            out.append(f"{where}:{pin.line}: cuda-version: cell {cell.id} is "
                       f"{'CUDA ' + cell.cuda if cell.cuda else 'a CPU cell'}, the lock pins cuda-version "
                       f"{pin.version}; {fix}")
        elif cell.cuda is None and "cuda" in build:
            out.append(f"{where}:{pin.line}: {pin.name}: build {build} is a CUDA build, cell {cell.id} is a CPU "
                       f"cell; {fix}")
        url = pin.url or ""
        prefix = url.rsplit("/", 2)[0]
        if _CONDA_URL_BAD.search(url.split("://", 1)[-1]) or prefix not in bases:
            out.append(f"{where}:{pin.line}: {pin.name}: {terminal.show(url, 160)} is not CHANNEL/SUBDIR/FILE of "
                       f"one of the matrix's channels ({', '.join(matrix.conda.channels)}); {fix}")
    return out


def _body_problems(lock: Lock, matrix: Matrix, cell: Cell, where: str, fix: str) -> list[str]:
    """The pins' versions must agree with the cell, whatever the header says."""
    by_name = {p.name: p for p in lock.pins}
    out = []
    torch = by_name.get("torch" if cell.installer == "pip" else "pytorch")
    if torch is not None and _release(torch.version) != _release(cell.torch):
        out.append(f"{where}:{torch.line}: {torch.name}: cell {cell.id} wants torch {cell.torch}, "
                   f"the lock pins {torch.version}; {fix}")
    python = by_name.get("python")
    if cell.installer == "conda" and python is not None and ".".join(python.version.split(".")[:2]) != cell.python:
        out.append(f"{where}:{python.line}: python: cell {cell.id} wants Python {cell.python}, "
                   f"the lock pins {python.version}; {fix}")
    return out


def load(matrix: Matrix, cell: Cell) -> Lock | None:
    """The cell's lock, checked against the cell; None when the cell has none (no file at all:
    a FIFO, a link or anything else there is an error). A malformed or stale lock is a
    ConfigError (exit 2) naming the cell, the line and what is wrong."""
    path = path_for(matrix, cell)
    text = read(path)
    if text is None:
        return None
    lock = parse(path, cell.installer, text)
    problems = stale(lock, matrix, cell)
    if problems:
        raise ConfigError(yamlfile.capped(problems))
    return lock


def load_all(matrix: Matrix, cells: list[Cell]) -> dict[str, Lock | None]:
    """Every cell's lock, read once, or one ConfigError listing the problems of all of them (capped)."""
    out: dict[str, Lock | None] = {}
    problems: list[str] = []
    for cell in cells:
        try:
            out[cell.id] = load(matrix, cell)
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(yamlfile.capped(problems))
    return out
