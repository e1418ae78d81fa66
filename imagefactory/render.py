"""Step 2: cells -> build contexts (a Dockerfile and every file it copies).

Python decides values; the Jinja2 templates in dockerfiles/ hold every line of
Dockerfile text. Same matrix in, same bytes out.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import jinja2

from imagefactory import __version__, digests, inputs, lockfile
from imagefactory import netrc as netrc_mod
from imagefactory.availability import conda_build_spec
from imagefactory.errors import ConfigError
from imagefactory.interrupt import Interrupt
from imagefactory.model import AUTO, Cell, Matrix

HASH_LABEL = "io.imagefactory.content-hash"
LABEL_PREFIX = "io.imagefactory"

MINIFORGE_URL = "https://github.com/conda-forge/miniforge/releases/download/{v}/Miniforge3-{v}-Linux-x86_64.sh"
MINICONDA_URL = "https://repo.anaconda.com/miniconda/Miniconda3-{v}-Linux-x86_64.sh"


def templates_dir() -> Path:
    """dockerfiles/ beside the package (a checkout), or inside it (an installed wheel)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "dockerfiles", here.parent / "dockerfiles"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("imagefactory's dockerfiles/ templates are missing from this installation")


def _dq(value: object) -> str:
    """A double-quoted Dockerfile word (ENV/LABEL value). Values are pattern-checked already;
    escaping here is the second line of defence."""
    text = str(value)
    if any(c in text for c in "\n\r"):
        raise ValueError(f"newline in a Dockerfile value: {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    env.filters["dq"] = _dq
    env.filters["kv"] = lambda pair: f"{pair[0]}={_dq(pair[1])}"
    env.filters["yaml_str"] = lambda v: json.dumps(str(v))  # a JSON string is a YAML string: null stays "null"
    return env


@dataclass(frozen=True)
class Context:
    cell: Cell
    path: Path
    content_hash: str  # sha256 hex of the whole context (Dockerfile without the hash label + files)

    @property
    def dockerfile(self) -> Path:
        return self.path / "Dockerfile"


ENV_PREFIX = {"conda": "/opt/env", "pip": "/opt/venv"}
# Where the package caches are mounted under BuildKit (root's pip cache; conda's CONDA_PKGS_DIRS).
CACHE_DIRS = {"conda": "/var/cache/imagefactory/conda-pkgs", "pip": "/root/.cache/pip"}

# MKL's threading layer must match the OpenMP runtime the process loads (docs/domain.md):
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


def labels(matrix: Matrix, cell: Cell, content_hash: str | None) -> list[tuple[str, str]]:
    out = {
        "org.opencontainers.image.title": f"{matrix.image.rsplit('/', 1)[-1]} {cell.id}",
        "org.opencontainers.image.description": (
            f"torch {cell.torch}, Python {cell.python}, "
            f"{'CPU only' if cell.cuda is None else 'CUDA ' + cell.cuda}, {cell.blas}, {cell.installer}"),
        "org.opencontainers.image.version": cell.tags[0].rsplit(":", 1)[-1] if cell.tags else cell.id,
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
    out.update(dict(cell.labels))
    if content_hash:
        out[HASH_LABEL] = content_hash
    return sorted(out.items())


def _conda_values(matrix: Matrix, cell: Cell) -> dict[str, object]:
    conda = matrix.conda
    template = MINIFORGE_URL if conda.distribution == "miniforge" else MINICONDA_URL
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
        "lock": lockfile.path_for(matrix, cell).is_file(),
        "distribution_title": "Miniforge" if conda.distribution == "miniforge" else "Miniconda",
        "installer_version": conda.version,
        "installer_url": conda.installer_url or template.format(v=conda.version),
        "installer_sha256": conda.sha256,
        "accept_tos": conda.distribution == "miniconda",
        "override_cuda": cell.cuda,
        "specs": specs,
        "pinned": pinned,
    }


def _index_opts(matrix: Matrix, first: str | None, extra: list[str]) -> list[str]:
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
        opts = _index_opts(matrix, pip.torch_index_url.replace("{variant}", variant),
                           extra + list(pip.extra_index_urls))
        return f"torch=={cell.torch}+{variant}", opts
    # PyPI's plain torch is its default CUDA build (validated); CPU builds carry +cpu.
    requirement = f"torch=={cell.torch}" if cell.cuda is not None else f"torch=={cell.torch}+cpu"
    return requirement, _index_opts(matrix, pip.index_url, list(pip.extra_index_urls))


def conda_specs(matrix: Matrix, cell: Cell) -> list[str]:
    """The specs a conda cell's environment is solved from (in the image, or by `imagefactory lock`)."""
    specs = _conda_values(matrix, cell)["specs"]
    assert isinstance(specs, list)
    return list(specs)


def pip_requirements(cell: Cell) -> list[str]:
    """What a pip cell installs besides torch."""
    numpy = f"numpy=={cell.numpy}" if cell.numpy else "numpy"
    return [numpy, "threadpoolctl>=3.1", *cell.packages]


def _pip_values(matrix: Matrix, cell: Cell) -> dict[str, object]:
    pip = matrix.pip
    requirement, torch_opts = torch_requirement(matrix, cell)
    numpy_index = [pip.numpy_index_url] if cell.blas == "mkl" and pip.numpy_index_url else []
    opts = _index_opts(matrix, pip.index_url, list(pip.extra_index_urls) + numpy_index)
    return {
        "wheelhouse": pip.wheelhouse is not None,
        "torch_requirement": requirement,
        "torch_opts": torch_opts,
        "pip_opts": opts,
        "requirements": pip_requirements(cell),
        # A lock installs every file from every index the lock was resolved against.
        "lock": lockfile.path_for(matrix, cell).is_file(),
        "lock_opts": _index_opts(matrix, *lockfile.pip_sources(matrix, cell)),
    }


def dockerfile_text(matrix: Matrix, cell: Cell, content_hash: str | None, certs: list[str], *,
                    buildkit: bool = False, netrc: bool = False) -> str:
    """`buildkit`: package caches are BuildKit cache mounts (the classic builder has none);
    `netrc`: the install steps mount the netrc secret (netrc.py; BuildKit only)."""
    if netrc and not buildkit:
        raise ConfigError(f"cell {cell.id}: a netrc login needs the BuildKit builder (build secrets)")
    values: dict[str, object] = {
        "buildkit": buildkit,
        "netrc_secret": netrc_mod.SECRET_PATH if netrc else None,
        "netrc_id": netrc_mod.SECRET_ID,
        "cache_dir": CACHE_DIRS[cell.installer],
        "pip_cache": "" if buildkit else " --no-cache-dir",
        "cell": cell,
        "base_image": cell.base_image,
        "certs": certs,
        "user": cell.user,
        "uid": cell.uid,
        "env": runtime_env(cell),
        "compiler": cell.compiler,
        "labels": labels(matrix, cell, content_hash),
    }
    if cell.installer == "conda":
        values.update(_conda_values(matrix, cell))
    else:
        values.update(_pip_values(matrix, cell))
    return environment().get_template(f"{cell.installer}.Dockerfile.j2").render(values)


def entrypoint_text(cell: Cell) -> str:
    return environment().get_template("entrypoint.sh.j2").render(
        prefix=ENV_PREFIX[cell.installer], threads_auto=cell.threads == AUTO)


def _cert_names(matrix: Matrix) -> list[str]:
    # update-ca-certificates only reads *.crt; numbered so two files with one name can't clash.
    return [f"{i:02d}-{p.stem}.crt" for i, p in enumerate(matrix.ca_certificates)]


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _write_files(matrix: Matrix, cell: Cell, root: Path) -> None:
    """Every file of the context except the Dockerfile. Only regular files are read; a context
    gets its own copy (or hard link) of each, never a symbolic link, wherever `root` is."""
    entrypoint = root / "entrypoint.sh"
    entrypoint.write_text(entrypoint_text(cell))
    entrypoint.chmod(0o755)  # the classic builder has no COPY --chmod; COPY keeps the mode
    names = _cert_names(matrix)
    if names:
        (root / "certs").mkdir()
        for name, src in zip(names, matrix.ca_certificates):
            try:
                (root / "certs" / name).write_bytes(inputs.certificates(src))
            except inputs.InputError as e:
                raise ConfigError(f"ca_certificates: {e}") from None
    lock = lockfile.load(matrix, cell)  # checked against the cell: a stale lock is exit 2
    if lock is not None:
        (root / lockfile.CONTEXT_NAME).write_text(lock.text)  # so it is part of the content hash
    if cell.installer == "conda":
        text = environment().get_template("condarc.j2").render(
            channels=matrix.conda.channels, certs=names)
        (root / "condarc").write_text(text)
    elif matrix.pip.wheelhouse is not None:
        (root / "wheelhouse").mkdir()
        files, refused = inputs.wheelhouse_files(matrix.pip.wheelhouse)
        if refused:
            raise ConfigError(f"pip.wheelhouse: {refused[0]}; only regular files inside it enter an image")
        for name, src in files:
            _link_or_copy(src, root / "wheelhouse" / name)


def _file_digest(path: Path) -> str:
    return digests.file_digest(path)  # big files' digests are remembered between runs


def context_hash(root: Path, dockerfile_without_hash: str) -> str:
    h = hashlib.sha256()
    h.update(b"Dockerfile\0" + dockerfile_without_hash.encode() + b"\0")
    files = (p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.name != "Dockerfile")
    for path in sorted(files):
        rel = path.relative_to(root).as_posix()
        h.update(rel.encode() + b"\0" + _file_digest(path).encode() + b"\0")
    return h.hexdigest()


def render_cell(matrix: Matrix, cell: Cell, dest: Path, *, buildkit: bool = False, netrc: bool = False) -> Context:
    """Write one cell's context to `dest` (created; must not exist)."""
    dest.mkdir(parents=True)
    _write_files(matrix, cell, dest)
    certs = _cert_names(matrix)
    flags = {"buildkit": buildkit, "netrc": netrc}
    digest = context_hash(dest, dockerfile_text(matrix, cell, None, certs, **flags))
    (dest / "Dockerfile").write_text(dockerfile_text(matrix, cell, digest, certs, **flags))
    lock = dest / lockfile.CONTEXT_NAME
    if lock.is_file():  # the checks compare the image's packages with the lock's
        cell = replace(cell, locked=lockfile.parse(lock, cell.installer).versions())
    return Context(cell=cell, path=dest, content_hash=digest)


def _check_out(out: Path, cells: list[Cell]) -> None:
    """Refuse an --out that render could not fill completely, before anything is replaced."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    for cell in cells:
        final = out / cell.id
        if final.is_symlink():
            raise ConfigError(f"--out {out}: {cell.id} is a symbolic link; remove it (render replaces "
                              f"each cell's folder and follows no link)")
        if final.exists() and not final.is_dir():
            raise ConfigError(f"--out {out}: {cell.id} exists and is not a directory; remove it")


def render(matrix: Matrix, out: Path, cells: list[Cell] | None = None,
           bases: Mapping[str, str] | None = None, interrupt: Interrupt | None = None, *,
           buildkit: bool = False, netrc_cells: frozenset[str] = frozenset()) -> list[Context]:
    """Render every cell into out/<cell-id>/, all or nothing: contexts are written to a
    temporary folder and moved into place only when every cell rendered.

    Render owns no signal: the caller does (the CLI turns SIGINT/SIGTERM into `interrupt`).
    Once `interrupt` is set, render stops before the next cell with Cancelled and leaves
    nothing behind.

    `bases` maps a cell's base image to its pinned form (name:tag@sha256:..., see
    freshness.py); the pinned FROM is then part of the content hash. Without it the
    tags are kept (`imagefactory render` needs no engine).

    `buildkit`: render for BuildKit (cache mounts); `netrc_cells`: the ids of the cells whose
    install steps mount the netrc secret."""
    out = Path(out)
    cells = list(matrix.cells if cells is None else cells)
    if bases:
        cells = [replace(c, base_image=bases.get(c.base_image, c.base_image)) for c in cells]
    _check_out(out, cells)
    lockfile.load_all(matrix, cells)  # every stale lock reported at once, before anything is written
    out.mkdir(parents=True, exist_ok=True)
    check = interrupt.check if interrupt is not None else (lambda: None)
    staging: Path | None = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=".render-", dir=out))
        staged = []
        for cell in cells:
            check()
            staged.append(render_cell(matrix, cell, staging / cell.id, buildkit=buildkit,
                                      netrc=cell.id in netrc_cells))
        check()
        _check_out(out, cells)
        contexts = []
        for ctx in staged:
            final = out / ctx.cell.id
            if final.exists():
                shutil.rmtree(final)
            ctx.path.rename(final)
            contexts.append(Context(ctx.cell, final, ctx.content_hash))
        return contexts
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
