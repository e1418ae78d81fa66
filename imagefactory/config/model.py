"""The validated, expanded matrix: plain data that every later step reads.

matrix.py builds these from a file; nothing else constructs them except tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    # the most compressed bytes its image may have (size_budget, config/sizes.py); None: no budget,
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
