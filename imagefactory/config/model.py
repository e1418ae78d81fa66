"""The validated, expanded matrix: plain data that every later step reads.

matrix.py builds these from a file; nothing else constructs them except tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Literal, Union

from imagefactory.config import platforms
from imagefactory.config.platforms import Platform
AUTO = "auto"
Threads = Union[int, Literal["auto"]]  # a baked count, or computed by the entrypoint at start

@dataclass(frozen=True)
class Cell:
    """One image of the matrix, with every value the templates and checks need."""

    python: str  # "3.11" (major.minor)
    cuda: str | None  # "12.9", or None for a CPU-only cell
    blas: str  # "mkl" | "openblas"
    installer: str  # "conda" | "pip"
    torch: str  # "2.7.1"
    threads: Threads  # baked into OMP/MKL/OPENBLAS_NUM_THREADS, or "auto" (the container's CPU budget)
    base_image: str  # fully resolved base image reference (base_registry applied)
    numpy: str | None = None  # optional version pin
    packages: tuple[str, ...] = ()  # extra packages, installed with the cell's installer
    env: tuple[tuple[str, str], ...] = ()  # extra ENV, sorted by name
    labels: tuple[tuple[str, str], ...] = ()  # extra labels, sorted by name
    user: str = "trainer"
    uid: int = 1000
    compiler: bool = True  # ship g++ and the Python headers (torch.compile / Triton)
    tags: tuple[str, ...] = ()  # release tags (full references), applied only after checks pass
    # (name, version) of every package in the cell's lock (render fills it in); () when unlocked
    locked: tuple[tuple[str, str], ...] = ()
    # the optional fifth axis (matrix.variant): cells alike in the four axes that differ in
    # packages, threads, env...; "" for none. It ends the id: py3.11-cpu-openblas-pip-vision
    variant: str = ""
    # what the image is built for (platforms.py); a cell of any other than the default has its
    # architecture in its id, before the variant: py3.11-cpu-openblas-pip-arm64
    platform: Platform = platforms.DEFAULT
    # the most compressed bytes its image may have (size_budget, parse_size); None: no budget,
    # and nothing measured before a push
    size_budget: int | None = None

    @property
    def id(self) -> str:
        accel = "cpu" if self.cuda is None else f"cu{self.cuda}"
        arch = "" if self.platform == platforms.DEFAULT else f"-{self.platform.architecture}"
        return f"py{self.python}-{accel}-{self.blas}-{self.installer}{arch}" + (f"-{self.variant}" if self.variant else "")

    @property
    def accel(self) -> str:
        return "cpu" if self.cuda is None else f"cu{self.cuda}"


@dataclass(frozen=True)
class PipSettings:
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    wheelhouse: Path | None = None  # absolute path on the host
    # Index that serves torch builds; "{variant}" becomes cpu / cu126 / ...
    # None: torch comes from index_url (PyPI) and the wheelhouse only.
    torch_index_url: str | None = "https://download.pytorch.org/whl/{variant}"
    numpy_index_url: str | None = None  # an index serving MKL-linked NumPy (pip + mkl cells)


@dataclass(frozen=True)
class InstallerPin:
    """The conda installer of one platform: its digest, and where to get it (None: the
    distribution's URL for the platform's architecture)."""

    sha256: str
    url: str | None = None


@dataclass(frozen=True)
class CondaSettings:
    distribution: str = "miniforge"  # miniforge | miniconda
    version: str = "25.3.1-0"
    sha256: str = "376b160ed8130820db0ab0f3826ac1fc85923647f75c1b8231166e3d559ab768"  # linux/amd64's (x86_64)
    channels: tuple[str, ...] = ("conda-forge",)
    installer_url: str | None = None  # None: the distribution's official download URL
    # the installers of the other platforms (OCI name, pin): no aarch64 digest is built in
    installers: tuple[tuple[str, InstallerPin], ...] = ()

    def installer(self, platform: Platform) -> InstallerPin | None:
        """The installer a cell of `platform` downloads and checks; None when no digest is known."""
        if platform == platforms.DEFAULT:
            return InstallerPin(self.sha256, self.installer_url)
        return dict(self.installers).get(platform.oci)


@dataclass(frozen=True)
class TagList:
    """One release tag naming a list of per-platform images (an OCI image index), as
    docker-stacks publishes: `ref` is the list, each member a cell and its per-arch tag."""

    ref: str  # registry/ns/name:2.13.0-py3.11-cpu-openblas-pip
    members: tuple[tuple[str, str, str], ...]  # (cell id, platform OCI name, per-arch tag)

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(p for _, p, _ in self.members)


@dataclass(frozen=True)
class Matrix:
    path: Path  # the matrix file, absolute
    image: str  # [registry/]namespace/name
    cells: tuple[Cell, ...]
    pip: PipSettings = field(default_factory=PipSettings)
    conda: CondaSettings = field(default_factory=CondaSettings)
    ca_certificates: tuple[Path, ...] = ()  # absolute paths on the host
    tag_template: str = "{image}:{torch}-py{python}-{accel}-{blas}{installer_suffix}{variant_suffix}"
    hash_tag_template: str = "{image}:sha-{hash}"
    extra_tags: tuple[str, ...] = ()  # "date", "git-sha"
    registries: tuple[str, ...] = ()  # registries besides image's that tags may name (tags.registries)
    # release tags that name several platforms' images (tags.plan): the cells push their per-arch
    # tags (cell.tags), then publish/lists.py merges each list whose every platform passed
    lists: tuple[TagList, ...] = ()
    compression: str = "gzip"  # how pushed layers are compressed: gzip | zstd | estargz (OCI media types)
    # (registry, gzip | zstd | estargz) where tags.compression sets one of its own
    registry_compression: tuple[tuple[str, str], ...] = ()

    def compression_for(self, registry: str) -> str:
        """How layers pushed to `registry` are compressed: its own setting, else the matrix's."""
        return dict(self.registry_compression).get(registry, self.compression)

    def cell(self, cell_id: str) -> Cell:
        for c in self.cells:
            if c.id == cell_id:
                return c
        raise KeyError(cell_id)

    @property
    def directory(self) -> Path:
        return self.path.parent


# -- sizes in bytes as a matrix writes them (`size_budget: 6GB`, `900MiB`, or an integer) and as a
# -- report shows them. The schema's pattern (resources/matrix.schema.json, $defs.size_budget) admits
# -- the text; `parse_size` is the one reader of it, SIZE_RE the same pattern matched whole.

SIZE_UNITS = {"B": 1, "kB": 1000, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "TB": 1000 ** 4,
         "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "TiB": 1024 ** 4}
SIZE_RE = re.compile(r"(?P<number>(?:0|[1-9][0-9]{0,12})(?:\.[0-9]{1,3})?) ?(?P<unit>" + "|".join(SIZE_UNITS) + ")")
MAX_SIZE = 1 << 40  # 1 TiB: no image is larger; a budget above it is a typo


def parse_size(value: int | str) -> int:
    """Bytes of `value` (an integer, or a number and a unit, whole); ValueError saying why not."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected bytes or a size such as 6GB, got {type(value).__name__}")
    if isinstance(value, int):
        n = value
    else:
        m = SIZE_RE.fullmatch(value)
        if m is None:
            raise ValueError(f"{value[:40]!r} is not a size (a number and a unit: {', '.join(SIZE_UNITS)}; e.g. 6GB)")
        n = int(Decimal(m["number"]) * SIZE_UNITS[m["unit"]])
    if not 1 <= n <= MAX_SIZE:
        raise ValueError(f"{value!r} is {n} bytes: a size budget is between 1 byte and 1 TiB")
    return n


def human(n: int) -> str:
    """`n` bytes for people: 1.43 GB, 220 MB, 512 B (decimal units, as registries show them)."""
    for unit, size in (("TB", 1000 ** 4), ("GB", 1000 ** 3), ("MB", 1000 ** 2), ("kB", 1000)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"
