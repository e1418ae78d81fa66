"""The recipe of a cell: every value its image is made of, decided in Python before any text is
written: the runtime and image ENV, the labels, where the environment lives, the torch
requirement and the index options that pick its build, the conda specs.

render/contexts.py writes these values into build contexts through the templates; lock/resolve.py resolves the
same requirements and specs on the host, so a lock pins exactly what an image would install.
"""

from __future__ import annotations

from imagefactory import __version__
from imagefactory.config import availability
from imagefactory.config import platforms
from imagefactory.config import tags
from imagefactory.config.availability import conda_build_spec
from imagefactory.errors import ConfigError
from imagefactory.config.model import AUTO, Cell, Matrix

HASH_LABEL = "io.imagefactory.content-hash"
LABEL_PREFIX = "io.imagefactory"

# {arch}: the cell's platform's (platforms.Platform.arch: x86_64, aarch64)
MINIFORGE_URL = "https://github.com/conda-forge/miniforge/releases/download/{v}/Miniforge3-{v}-Linux-{arch}.sh"
MINICONDA_URL = "https://repo.anaconda.com/miniconda/Miniconda3-{v}-Linux-{arch}.sh"

ENV_PREFIX = {"conda": "/opt/env", "pip": "/opt/venv"}
# Where the package caches are mounted under BuildKit (root's pip cache; conda's CONDA_PKGS_DIRS).
CACHE_DIRS = {"conda": "/var/cache/imagefactory/conda-pkgs", "pip": "/root/.cache/pip"}
# What the image's ENV puts before the base image's PATH.
ENV_PATH = {"conda": "/opt/env/bin:/opt/conda/bin", "pip": "/opt/venv/bin"}
CERT_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT")  # partials/certs.j2
CERT_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CGROUP_ROOT = "/sys/fs/cgroup"
LAUNCH_HOOK = "imagefactory_launch.py"  # resources/launch.py, installed in the environment's site-packages
LAUNCH_PTH = "imagefactory-launch.pth"  # ... and the line that makes `site` import it in every interpreter
LAYER_SPLITTER = "imagefactory_layers.py"  # resources/layers.py, run in the environment's build stage
# The pip environment's layers, in image order (resources/layers.py LAYERS, which makes them).
VENV_LAYERS = ("1-venv", "2-cuda", "3-torch", "4-blas", "5-packages")
# The conda environment's (resources/layers.py CONDA_LAYERS): the BLAS before torch, which needs it.
CONDA_LAYERS = ("1-python", "2-cuda", "3-blas", "4-torch", "5-packages")
# Every time a reproducible layer holds (partials/settle.j2, resources/layers.py) and BuildKit's
# image times: 1980-01-01, a constant (the same bytes on any day) that zip and tar both represent.
SOURCE_DATE_EPOCH = 315532800

# MKL's threading layer must match the OpenMP runtime the process loads (pytorch/pytorch#37377,
# numpy/numpy#24683; Intel's optimization-zone numpy README):
# PyPI torch loads GNU's libgomp; conda-forge's pytorch and mkl load LLVM's libomp (libgomp.so.1
# and libiomp5.so are aliases of it there), for which Intel's layer, MKL's default, is right.
MKL_THREADING_LAYER = {"conda": "INTEL", "pip": "GNU"}


def runtime_env(cell: Cell) -> list[tuple[str, str]]:
    env: dict[str, str] = {}
    if cell.threads != AUTO:  # auto: the entrypoint computes the count when the container starts
        t = str(cell.threads)
        env.update({"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t})
    if cell.blas == "mkl":
        env["MKL_THREADING_LAYER"] = MKL_THREADING_LAYER[cell.installer]
    if cell.cuda is not None:
        env["NVIDIA_VISIBLE_DEVICES"] = "all"
        env["NVIDIA_DRIVER_CAPABILITIES"] = "compute,utility"
    env.update(dict(cell.env))
    return sorted(env.items())


def image_env(cell: Cell, certs: bool) -> list[tuple[str, str]]:
    """Every variable the final image's ENV declares besides PATH: what the launch hook and the
    shell script apply where a runtime drops the image's ENV (ch-run without --set-env)."""
    env = dict(runtime_env(cell))
    if cell.installer == "pip":
        env["VIRTUAL_ENV"] = ENV_PREFIX["pip"]
    if certs:
        env.update({name: CERT_BUNDLE for name in CERT_ENV})
    for key, value in env.items():
        if "\n" in value or "\r" in value or "\0" in value:
            raise ConfigError(f"env: {key}: a newline or NUL in the value cannot be carried")
    return sorted(env.items())


def site_packages(cell: Cell) -> str:
    return f"{ENV_PREFIX[cell.installer]}/lib/python{cell.python}/site-packages"


def newer_python_modules(python: str) -> str:
    """compileall's `-x` pattern for a cell of Python `python` ("3.11"): a module named for a
    newer Python than the cell's, `py3NN_NAME.py` with NN above the cell's minor (torch ships
    torch/testing/_internal/py312_intrinsics.py, 3.12 syntax, imported only on 3.12+). This
    Python can never import such a file, and compiling it prints a SyntaxError traceback in every
    build log. compileall searches the pattern in each file's full path, so it is anchored at
    both ends: the whole file name, after a `/`, up to the end. Any other file that does not
    compile is still reported (partials/bytecode.j2)."""
    def digits(low: int) -> str:  # one digit from `low` to 9
        return "9" if low == 9 else f"[{low}-9]"

    minor = int(python.split(".")[1])
    higher = []  # the numbers from minor + 1 to 99, as alternatives
    if minor < 9:
        higher.append(digits(minor + 1))
    tens, ones = divmod(max(minor + 1, 10), 10)
    if tens <= 9:
        higher.append(f"{tens}{digits(ones)}" if ones else f"{digits(tens)}[0-9]")
        if ones and tens < 9:
            higher.append(f"{digits(tens + 1)}[0-9]")
    return f"/py3(?:{'|'.join(higher) or '(?!)'})_[A-Za-z0-9_]+[.]py$"  # (?!): nothing is newer than 3.99


def labels(matrix: Matrix, cell: Cell, content_hash: str | None) -> list[tuple[str, str]]:
    """The image's labels. Its version is its release tag's, the list's when the cell is one
    platform of one (so adding a platform to a matrix changes no other cell's content hash)."""
    listed = tags.list_of(matrix, cell)
    release = listed.ref if listed else (cell.tags[0] if cell.tags else None)
    out = {
        "org.opencontainers.image.title": f"{matrix.image.rsplit('/', 1)[-1]} {cell.id}",
        "org.opencontainers.image.description": (
            f"torch {cell.torch}, Python {cell.python}, "
            f"{'CPU only' if cell.cuda is None else 'CUDA ' + cell.cuda}, {cell.blas}, {cell.installer}"),
        "org.opencontainers.image.version": release.rsplit(":", 1)[-1] if release else cell.id,
        "org.opencontainers.image.base.name": cell.base_image,
        **({"org.opencontainers.image.base.digest": cell.base_image.partition("@")[2]}
           if "@" in cell.base_image else {}),
        "org.opencontainers.image.vendor": "imagefactory",
        f"{LABEL_PREFIX}.cell": cell.id,
        f"{LABEL_PREFIX}.python": cell.python,
        f"{LABEL_PREFIX}.cuda": cell.cuda or "none",
        f"{LABEL_PREFIX}.blas": cell.blas,
        f"{LABEL_PREFIX}.installer": cell.installer,
        f"{LABEL_PREFIX}.torch": cell.torch,
        f"{LABEL_PREFIX}.threads": str(cell.threads),
        f"{LABEL_PREFIX}.compiler": "true" if cell.compiler else "false",
        f"{LABEL_PREFIX}.version": __version__,
    }
    if cell.variant:  # only then: a cell without a variant keeps the labels (and content hash) it had
        out[f"{LABEL_PREFIX}.variant"] = cell.variant
    if cell.platform != platforms.DEFAULT:  # the same: a linux/amd64 cell's labels are today's
        out[f"{LABEL_PREFIX}.platform"] = cell.platform.oci
    out.update(dict(cell.labels))
    if content_hash:
        out[HASH_LABEL] = content_hash
    return sorted(out.items())


def _conda_values(matrix: Matrix, cell: Cell, locked: bool = False) -> dict[str, object]:
    conda = matrix.conda
    template = MINIFORGE_URL if conda.distribution == "miniforge" else MINICONDA_URL
    pin = conda.installer(cell.platform)
    if pin is None:  # matrix.py refuses such a cell; a Matrix made in code may still hold one
        raise ConfigError(f"cell {cell.id}: no conda installer digest for {cell.platform.oci} (conda.installers)")
    blas_pin = f"libblas=*=*{cell.blas}"
    specs = [f"python={cell.python}", conda_build_spec(cell.torch, cell.cuda)]
    if cell.cuda is not None:
        specs.append(f"cuda-version={cell.cuda}")
    specs.append(blas_pin)
    pinned = [blas_pin]
    if cell.blas == "openblas":
        # The generic (non-MKL) pytorch build wants nomkl; without it the solver prefers mkl builds.
        specs.append("nomkl")
        pinned.append("nomkl")
    specs.append(f"numpy={cell.numpy}" if cell.numpy else "numpy")
    specs.append("threadpoolctl")
    specs.extend(cell.packages)
    return {
        "lock": locked,
        "distribution_title": "Miniforge" if conda.distribution == "miniforge" else "Miniconda",
        "installer_version": conda.version,
        "installer_url": pin.url or template.format(v=conda.version, arch=cell.platform.arch),
        "installer_sha256": pin.sha256,
        "accept_tos": conda.distribution == "miniconda",
        "override_cuda": cell.cuda,
        "specs": specs,
        "pinned": pinned,
    }


def index_opts(matrix: Matrix, first: str | None, extra: list[str]) -> list[str]:
    """pip options: the first index (None: pip's default), extra indexes, then the wheelhouse."""
    opts = ["--index-url", first] if first else []
    for url in extra:
        opts += ["--extra-index-url", url]
    if matrix.pip.wheelhouse:
        opts += ["--find-links", "/tmp/wheelhouse"]
    return opts


def torch_requirement(matrix: Matrix, cell: Cell) -> tuple[str, list[str]]:
    """The pip requirement for torch and the options that pick the right build."""
    pip = matrix.pip
    variant = "cpu" if cell.cuda is None else "cu" + cell.cuda.replace(".", "")
    if pip.torch_index_url:
        extra = [pip.index_url] if pip.index_url else []
        opts = index_opts(matrix, pip.torch_index_url.replace("{variant}", variant),
                           extra + list(pip.extra_index_urls))
        return f"torch=={cell.torch}+{variant}", opts
    # PyPI's plain torch is its default CUDA build (validated), or a CPU build where PyPI has one
    # (aarch64 2.9, 2.10); the index's CPU builds (a wheelhouse's) carry +cpu.
    plain = cell.cuda is not None or availability.pypi_serves_cpu(cell.torch, cell.python, cell.platform)
    requirement = f"torch=={cell.torch}" if plain else f"torch=={cell.torch}+cpu"
    return requirement, index_opts(matrix, pip.index_url, list(pip.extra_index_urls))


def conda_specs(matrix: Matrix, cell: Cell) -> list[str]:
    """The specs a conda cell's environment is solved from (in the image, or by `imagefactory lock`)."""
    specs = _conda_values(matrix, cell)["specs"]
    assert isinstance(specs, list)
    return list(specs)


def pip_requirements(cell: Cell) -> list[str]:
    """What a pip cell installs besides torch."""
    numpy = f"numpy=={cell.numpy}" if cell.numpy else "numpy"
    return [numpy, "threadpoolctl>=3.1", *cell.packages]
