"""Which torch builds exist (conda-forge's pytorch, PyTorch's and PyPI's wheels), and the exact
conda spec that selects one.

The facts live with their sources in resources/conda_pytorch_builds.json (torch version x
CUDA x Python x BLAS) and resources/pip_torch_wheels.json (torch version x CUDA x Python): each
file's top-level `releases` are linux/amd64's (linux-64, x86_64 wheels), its `by_platform` holds
the other platforms' (linux/arm64: linux-aarch64, aarch64 wheels), sourced the same way.
matrix.py asks `conda_problem` / `pip_problem` whether a cell is possible on its platform;
render/contexts.py asks `conda_build_spec` for the spec that pins the cell's CUDA build.

Vocabulary is the matrix file's: cuda None is a CPU build, blas is "mkl" or
"openblas" (conda-forge's "generic" variant).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from imagefactory.config import platforms
from imagefactory.config.platforms import Platform

DATA_FILE = "imagefactory/resources/conda_pytorch_builds.json"
PIP_DATA_FILE = "imagefactory/resources/pip_torch_wheels.json"
PIP_ROUTES = {"index": "PyTorch's wheel index", "pypi": "PyPI"}  # torch_index_url set / null
BLAS_VARIANTS = {"mkl": "mkl", "generic": "openblas"}  # conda-forge's name -> the matrix's

_TORCH_RE = re.compile(r"([0-9]+)\.([0-9]+)(?:\.([0-9]+))?")
_CUDA_RE = re.compile(r"([0-9]{2})\.([0-9])")
_PYTHON_RE = re.compile(r"3\.([0-9]{1,2})")
_BUILDS_RE = re.compile(r"[0-9]+(?:-[0-9]+)?")

Version = tuple[int, ...]


def _version(text: str, pattern: re.Pattern[str]) -> Version | None:
    match = pattern.fullmatch(text)
    if match is None:
        return None
    return tuple(int(x) for x in text.split("."))


@dataclass(frozen=True)
class Release:
    """A group of builds of one torch version that share their CUDA, Python and BLAS variants."""

    torch: str  # "2.7.1"
    builds: str  # build numbers, "0" or "1-4"
    cuda: tuple[str | None, ...]  # None: the CPU build
    python: tuple[str, ...]
    blas: tuple[str, ...]  # "mkl" | "openblas"
    source: str

    @property
    def version(self) -> Version:
        return tuple(int(x) for x in self.torch.split("."))


@dataclass(frozen=True)
class Note:
    """A known problem of some published builds (not a reason to refuse them)."""

    torch: str
    builds: str
    blas: tuple[str, ...]
    note: str
    source: str


@dataclass(frozen=True)
class Table:
    releases: tuple[Release, ...]
    notes: tuple[Note, ...] = ()
    publisher: str = "conda-forge"  # who publishes the builds, as messages name it
    package: str = "pytorch"
    data_file: str = DATA_FILE
    name: str = "imagefactory's conda-forge build table"

    @property
    def versions(self) -> list[Version]:
        return sorted({r.version for r in self.releases})

    @property
    def span(self) -> str:
        versions = self.versions
        return f"torch {_dotted(versions[0])} to {_dotted(versions[-1])}"


@dataclass(frozen=True)
class Combo:
    """One installable combination; torch as the table names it."""

    torch: Version
    cuda: str | None
    python: str
    blas: str


def _dotted(version: Iterable[int]) -> str:
    return ".".join(map(str, version))


def _strings(entry: dict[str, Any], key: str, pattern: re.Pattern[str], where: str,
             file: str = DATA_FILE) -> tuple[str, ...]:
    values = entry.get(key)
    if not isinstance(values, list) or not values:
        raise ValueError(f"{file}: {where}: {key} must be a non-empty list")
    for value in values:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise ValueError(f"{file}: {where}: {key}: {value!r} is malformed")
    if len(set(values)) != len(values):
        raise ValueError(f"{file}: {where}: {key} lists a value twice")
    return tuple(values)


def _text(entry: dict[str, Any], key: str, pattern: re.Pattern[str] | None, where: str,
          file: str = DATA_FILE) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value.strip() or (pattern and not pattern.fullmatch(value)):
        raise ValueError(f"{file}: {where}: {key}: {value!r} is missing or malformed")
    return value


def parse_table(doc: dict[str, Any]) -> Table:
    """Check and convert the data file's content. A mistake in it raises ValueError."""
    releases = []
    for i, entry in enumerate(doc.get("releases") or []):
        where = f"releases[{i}]"
        cuda = _strings(entry, "cuda", re.compile(rf"none|{_CUDA_RE.pattern}"), where)
        blas = _strings(entry, "blas", re.compile("|".join(BLAS_VARIANTS)), where)
        releases.append(Release(
            torch=_text(entry, "torch", re.compile(r"[0-9]+\.[0-9]+\.[0-9]+"), where),
            builds=_text(entry, "builds", _BUILDS_RE, where),
            cuda=tuple(None if c == "none" else c for c in cuda),
            python=_strings(entry, "python", _PYTHON_RE, where),
            blas=tuple(BLAS_VARIANTS[b] for b in blas),
            source=_text(entry, "source", None, where),
        ))
    if not releases:
        raise ValueError(f"{DATA_FILE}: releases must not be empty")
    notes = []
    for i, entry in enumerate(doc.get("notes") or []):
        where = f"notes[{i}]"
        blas = _strings(entry, "blas", re.compile("|".join(BLAS_VARIANTS)), where)
        notes.append(Note(
            torch=_text(entry, "torch", re.compile(r"[0-9]+\.[0-9]+\.[0-9]+"), where),
            builds=_text(entry, "builds", _BUILDS_RE, where),
            blas=tuple(BLAS_VARIANTS[b] for b in blas),
            note=_text(entry, "note", None, where),
            source=_text(entry, "source", None, where),
        ))
    return Table(tuple(releases), tuple(notes))


def platform_doc(doc: dict[str, Any], platform: Platform, file: str) -> dict[str, Any]:
    """The part of a data file that describes `platform`: the top level for the default platform,
    else its `by_platform` entry. ValueError when the file has none."""
    if platform == platforms.DEFAULT:
        return doc
    part = (doc.get("by_platform") or {}).get(platform.oci)
    if not isinstance(part, dict):
        raise ValueError(f"{file}: by_platform has no {platform.oci} entry")
    return part


def _named(t: Table, platform: Platform) -> Table:
    if platform == platforms.DEFAULT:
        return t  # the messages of today's cells stay as they were
    return replace(t, name=f"{t.name} for {platform.oci}", publisher=f"{t.publisher} ({platform.oci})")


@functools.cache
def table(platform: Platform = platforms.DEFAULT) -> Table:
    """The shipped table of `platform`."""
    text = resources.files("imagefactory").joinpath("resources/conda_pytorch_builds.json").read_text()
    return _named(parse_table(platform_doc(json.loads(text), platform, DATA_FILE)), platform)


def parse_pip_table(doc: dict[str, Any]) -> dict[str, Table]:
    """The pip wheel file's content as one table per route ("index": PyTorch's wheel index, with
    its CPU build; "pypi": PyPI's default CUDA build). A mistake in it raises ValueError."""
    index: list[Release] = []
    pypi: list[Release] = []
    seen: set[str] = set()
    for i, entry in enumerate(doc.get("releases") or []):
        where, file = f"releases[{i}]", PIP_DATA_FILE
        torch = _text(entry, "torch", re.compile(r"[0-9]+\.[0-9]+\.[0-9]+"), where, file)
        if torch in seen:
            raise ValueError(f"{file}: {where}: torch {torch} is listed twice")
        seen.add(torch)
        python = _strings(entry, "python", _PYTHON_RE, where, file)
        read_python = _text(entry, "python_source", None, where, file)
        pypi_cuda = _text(entry, "pypi_cuda", re.compile(rf"none|{_CUDA_RE.pattern}"), where, file)
        index_cuda = _strings(entry, "index_cuda", _CUDA_RE, where, file)
        both = tuple(BLAS_VARIANTS.values())  # pip torch has no BLAS variants (numpy's is checked apart)
        index.append(Release(torch, "0", (None,) + index_cuda, python, both,
                             f"{_text(entry, 'index_cuda_source', None, where, file)}; {read_python}"))
        pypi.append(Release(torch, "0", (None if pypi_cuda == "none" else pypi_cuda,), python, both,
                            f"{_text(entry, 'pypi_cuda_source', None, where, file)}; {read_python}"))
    if not index:
        raise ValueError(f"{PIP_DATA_FILE}: releases must not be empty")
    return {route: Table(tuple(releases), publisher=PIP_ROUTES[route], package="torch", data_file=PIP_DATA_FILE,
                  name="imagefactory's torch wheel table")
            for route, releases in (("index", index), ("pypi", pypi))}


@functools.cache
def pip_tables(platform: Platform = platforms.DEFAULT) -> dict[str, Table]:
    """The shipped pip wheel tables of `platform`, by route."""
    text = resources.files("imagefactory").joinpath("resources/pip_torch_wheels.json").read_text()
    tables = parse_pip_table(platform_doc(json.loads(text), platform, PIP_DATA_FILE))
    return {route: _named(t, platform) for route, t in tables.items()}


def pypi_serves_cpu(torch: str, python: str, platform: Platform = platforms.DEFAULT,
                    tables: dict[str, Table] | None = None) -> bool:
    """Whether PyPI's plain `torch==X` is a CPU build for this platform (aarch64 2.9 and 2.10;
    never on x86_64, where PyPI's torch is a CUDA build)."""
    tables = tables or (pip_tables() if platform == platforms.DEFAULT else pip_tables(platform))
    return conda_problem(torch, None, python, "openblas", tables["pypi"]) is None


def pip_problem(torch: str, cuda: str | None, python: str, route: str,
                tables: dict[str, Table] | None = None, platform: Platform = platforms.DEFAULT) -> str | None:
    """None when a torch wheel for this combination exists on `route` ("index": the PyTorch wheel
    index of torch_index_url; "pypi": PyPI) for `platform`; otherwise why not, and the nearest
    that exists. Where PyPI has no CPU build, a CPU cell without an index takes the PyTorch
    index's CPU wheel from the wheelhouse, so it is looked up there."""
    tables = tables or (pip_tables() if platform == platforms.DEFAULT else pip_tables(platform))
    if cuda is None and route == "pypi" and pypi_serves_cpu(torch, python, platform, tables):
        return None
    data = tables["index" if cuda is None else route]
    return conda_problem(torch, cuda, python, "openblas", data)


def conda_build_spec(torch: str, cuda: str | None) -> str:
    """The conda spec that selects torch's build for this CUDA version (or its CPU build).

    The build string starts with `cuda{XY}` (`cuda129`) or `cpu`: a cuda126 build
    also accepts cuda-version 12.7-12.9, so pinning cuda-version alone can land on
    it. `pytorch=2.7.1=cuda126*` can only be 2.7.1's build 0, its one CUDA 12.6 build.
    """
    if _version(torch, _TORCH_RE) is None:
        raise ValueError(f"not a torch version: {torch!r}")
    if cuda is None:
        return f"pytorch={torch}=cpu*"
    if _version(cuda, _CUDA_RE) is None:
        raise ValueError(f"not a CUDA version: {cuda!r}")
    return f"pytorch={torch}=cuda{cuda.replace('.', '')}*"


def _covers(request: Version, version: Version) -> bool:
    """`2.8` covers every 2.8.z; `2.8.0` covers only itself."""
    return version[:len(request)] == request


def conda_problem(torch: str, cuda: str | None, python: str, blas: str, data: Table | None = None,
                  platform: Platform = platforms.DEFAULT) -> str | None:
    """None when `data` (conda-forge's table of `platform` unless given) has this combination;
    otherwise why not, and the nearest that exists.

    `torch` may be X.Y (any published X.Y.z will do) or X.Y.Z.
    """
    data = data or (table() if platform == platforms.DEFAULT else table(platform))
    request = _version(torch, _TORCH_RE)
    if request is None:
        return f"{torch!r} is not a torch version (X.Y or X.Y.Z)"
    if _version(python, _PYTHON_RE) is None or (cuda is not None and _version(cuda, _CUDA_RE) is None):
        return f"python {python!r} or cuda {cuda!r} is malformed"
    covered = [r for r in data.releases if _covers(request, r.version)]
    reason = _reason(torch, request, covered, cuda, python, blas, data)
    return _with_nearest(reason, request, cuda, python, blas, data)


def _with_nearest(reason: str | None, request: Version, cuda: str | None, python: str, blas: str,
                  data: Table) -> str | None:
    if reason is None:
        return None
    suggestions = nearest(request, cuda, python, blas, data)
    if not suggestions:
        return f"{reason}; no published {_accel(cuda)} build is near"
    return f"{reason}; nearest: " + ", or ".join(suggestions)


def _reason(torch: str, request: Version, covered: list[Release], cuda: str | None, python: str,
            blas: str, data: Table) -> str | None:
    """Why no covered release has the combination, or None when one has."""
    if not covered:
        return _unpublished(torch, request, data)
    with_cuda = [r for r in covered if cuda in r.cuda]
    if not with_cuda:
        return (f"{data.publisher} has no {data.package} {torch} build for {_accel(cuda)} "
                f"({torch} is built for {_cuda_list(covered)} only)")
    with_python = [r for r in with_cuda if python in r.python]
    if not with_python:
        pythons = sorted({p for r in with_cuda for p in r.python}, key=_pykey)
        return (f"{data.publisher} has no {data.package} {torch} build for Python {python}"
                f"{'' if cuda is None else ' with CUDA ' + cuda} "
                f"({torch} is built for Python {_span(pythons)} only)")
    if not any(blas in r.blas for r in with_python):
        others = sorted({b for r in with_python for b in r.blas})
        return (f"{data.publisher} has no {_blas_name(blas)} {data.package} {torch} build for {_accel(cuda)} "
                f"and Python {python} (only {', '.join(map(_blas_name, others))})")
    return None


def _unpublished(torch: str, request: Version, data: Table) -> str:
    versions = data.versions
    extend = f"add its builds to {data.data_file} (the file says where to read them)"
    if request > versions[-1][:len(request)]:
        return (f"torch {torch} is newer than {data.name} ({data.span}); "
                f"if {data.publisher} publishes it now, {extend}")
    if request < versions[0][:len(request)]:
        return (f"torch {torch} is older than {data.name} ({data.span}); "
                f"to use it, {extend}")
    same_minor = [_dotted(v) for v in versions if v[:2] == request[:2]]
    known = f" (its {_dotted(request[:2])} releases: {', '.join(same_minor)})" if same_minor else ""
    return f"{data.publisher} publishes no {data.package} {torch}{known}"


def _accel(cuda: str | None) -> str:
    return "CPU" if cuda is None else f"CUDA {cuda}"


def _blas_name(blas: str) -> str:
    return "MKL" if blas == "mkl" else "OpenBLAS (generic)"


def _pykey(python: str) -> Version:
    return tuple(int(x) for x in python.split("."))


def _cudakey(cuda: str) -> Version:
    return tuple(int(x) for x in cuda.split("."))


def _span(pythons: list[str]) -> str:
    """'3.10-3.13' for consecutive minors, else a comma list."""
    minors = [_pykey(p)[1] for p in pythons]
    if len(pythons) > 1 and minors == list(range(minors[0], minors[-1] + 1)):
        return f"{pythons[0]}-{pythons[-1]}"
    return ", ".join(pythons)


def _cuda_list(releases: list[Release]) -> str:
    cudas = sorted({c for r in releases for c in r.cuda if c is not None}, key=_cudakey)
    if not cudas:
        return "CPU"
    if len(cudas) == 1:
        return f"CUDA {cudas[0]}"
    return f"CUDA {', '.join(cudas[:-1])} and {cudas[-1]}"


def combos(data: Table) -> list[Combo]:
    """Every published combination, once."""
    found = {Combo(r.version, c, p, b) for r in data.releases for c in r.cuda for p in r.python for b in r.blas}
    return sorted(found, key=lambda c: (c.torch, _cudakey(c.cuda) if c.cuda else (), _pykey(c.python), c.blas))


class _Ranks:
    """Distance between values of one axis: how many published values lie between them.

    The requested value joins the published ones (minus those it already matches), so
    its neighbours on both sides are at distance 1. Ties are broken towards the newer.
    """

    def __init__(self, published: Iterable[Version], request: Version):
        self.order = sorted(set(published) | {request})
        self.request = self.order.index(request)

    def distance(self, value: Version) -> int:
        return abs(self.order.index(value) - self.request)

    def newness(self, value: Version) -> int:
        return self.order.index(value)


def nearest(request: Version, cuda: str | None, python: str, blas: str, data: Table) -> list[str]:
    """The published combinations nearest to the request, best first, as matrix values.

    Nearest means fewest changed axes (torch, cuda, python, blas). When one changed
    axis is enough, the closest value of each axis that works is given, in the order
    cuda, python, blas, torch; otherwise the single closest combination. Closest: the
    fewest published values in between, then the newer. A CUDA request never gets a
    CPU suggestion, nor the reverse.
    """
    candidates = [c for c in combos(data) if (c.cuda is None) == (cuda is None)]
    if not candidates:
        return []
    torch_ranks = _Ranks([c.torch for c in candidates if not _covers(request, c.torch)], request)
    cuda_ranks = _Ranks([_cudakey(c.cuda) for c in candidates if c.cuda], _cudakey(cuda) if cuda else ())
    python_ranks = _Ranks([_pykey(c.python) for c in candidates], _pykey(python))

    def changed(c: Combo) -> tuple[bool, bool, bool, bool]:
        return (c.cuda != cuda, c.python != python, c.blas != blas, not _covers(request, c.torch))

    def key(c: Combo) -> tuple[int, ...]:
        torch_at = request if _covers(request, c.torch) else c.torch
        cuda_at = _cudakey(c.cuda) if c.cuda else ()
        return (sum(changed(c)), torch_ranks.distance(torch_at), cuda_ranks.distance(cuda_at),
                python_ranks.distance(_pykey(c.python)), int(c.blas != blas),
                -torch_ranks.newness(torch_at), -cuda_ranks.newness(cuda_at),
                -python_ranks.newness(_pykey(c.python)))

    ranked = sorted(candidates, key=key)
    fewest = sum(changed(ranked[0]))
    if fewest != 1:
        picks = ranked[:1]
    else:
        picks = []
        for axis in range(4):  # cuda, python, blas, torch
            best = next((c for c in ranked if changed(c) == tuple(i == axis for i in range(4))), None)
            if best is not None:
                picks.append(best)
    return [_describe(c, request, cuda, python, blas) for c in picks]


def _describe(c: Combo, request: Version, cuda: str | None, python: str, blas: str) -> str:
    """'torch 2.8 with cuda 12.9': torch, then each axis that changed; when only torch
    changed, the axes it keeps are named so the suggestion reads on its own."""
    torch = _dotted(request) if _covers(request, c.torch) else _dotted(c.torch)
    axes = [("cuda", c.cuda or "none", cuda or "none"), ("python", c.python, python), ("blas", c.blas, blas)]
    parts = [f"{name} {got}" for name, got, want in axes if got != want]
    if not parts and torch != _dotted(request):
        parts = [f"cuda {c.cuda}"] if c.cuda else []
        parts += [f"python {c.python}"]
    return f"torch {torch}" + (f" with {', '.join(parts)}" if parts else "")


def known_issues(torch: str, blas: str, data: Table | None = None) -> list[Note]:
    """Notes about published builds of this torch version (X.Y or X.Y.Z) and BLAS."""
    data = data or table()
    request = _version(torch, _TORCH_RE)
    if request is None:
        return []
    return [n for n in data.notes
            if _covers(request, tuple(int(x) for x in n.torch.split("."))) and blas in n.blas]
