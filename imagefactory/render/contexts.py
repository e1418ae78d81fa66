"""Step 5 (render/): cells -> build contexts (a Dockerfile and every file it copies).

recipe.py decides the values; the Jinja2 templates in dockerfiles/ hold every line of
Dockerfile text; this module writes them, with the files they copy, into one context per cell.
Same matrix in, same bytes out.
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
from typing import TYPE_CHECKING, Mapping

from imagefactory.config import recipe
from imagefactory.render import digests
from imagefactory.files import bounded
from imagefactory import terminal
from imagefactory.lock import lockfile
from imagefactory.render import rendered
from imagefactory.config import netrc as netrc_mod
from imagefactory.engine.api import Builder
from imagefactory.errors import ConfigError
from imagefactory.interrupt import Interrupt
from imagefactory.config.model import AUTO, Cell, Matrix
# The recipe (what a cell's image is made of) lives in recipe.py; its names stay reachable here.
from imagefactory.config.recipe import (CACHE_DIRS, CERT_BUNDLE, CERT_ENV, CGROUP_ROOT, ENV_PATH, ENV_PREFIX,  # noqa: F401
                                 HASH_LABEL, LABEL_PREFIX, LAUNCH_HOOK, LAUNCH_PTH, MINICONDA_URL,
                                 MINIFORGE_URL, MKL_THREADING_LAYER, _conda_values, conda_specs,
                                 image_env, labels, newer_python_modules, pip_requirements, runtime_env,
                                 site_packages, torch_requirement)

if TYPE_CHECKING:
    import jinja2


@functools.cache
def templates_dir() -> Path:
    """dockerfiles/ beside the package (a checkout), or inside it (an installed wheel)."""
    here = Path(__file__).resolve().parents[1]  # the package
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
    import jinja2  # only for a render not kept from an earlier run (template_text)

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


# What the templates run besides Jinja2: this module's filters, and the recipe's and the model's
# values and properties (a render kept from before is keyed by their source, rendered.py)
RENDER_CODE = ("imagefactory.render.contexts", "imagefactory.config.recipe", "imagefactory.config.model", "imagefactory.config.platforms")


def template_text(name: str, values: Mapping[str, object]) -> str:
    """What the template `name` of dockerfiles/ renders for `values`; the same render as an
    earlier run's is read back (rendered.py), without Jinja2."""
    return rendered.text(name, values, lambda: environment().get_template(name).render(values),
                         templates=templates_dir(), code=RENDER_CODE)


@dataclass(frozen=True)
class Context:
    cell: Cell
    path: Path
    content_hash: str  # sha256 hex of the whole context (Dockerfile without the hash label + files)

    @property
    def dockerfile(self) -> Path:
        return self.path / "Dockerfile"


def dockerfile_text(matrix: Matrix, cell: Cell, content_hash: str | None, certs: list[str], *,
                    locked: bool, builder: Builder = Builder.classic, netrc: bool = False) -> str:
    """`builder` buildkit: package caches are BuildKit cache mounts (the classic builder has none);
    `netrc`: the install steps mount the netrc secret (netrc.py; BuildKit only)."""
    buildkit = builder is Builder.buildkit
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
        "prefix": ENV_PREFIX[cell.installer],
        "site_packages": site_packages(cell),
        "compile_skip": newer_python_modules(cell.python),  # compileall -x (partials/bytecode.j2)
        "source_date_epoch": recipe.SOURCE_DATE_EPOCH,  # partials/settle.j2, venv_layers.j2
        "venv_layers": recipe.VENV_LAYERS,
        "env_layers": recipe.CONDA_LAYERS,
    }
    if cell.installer == "conda":
        values.update(_conda_values(matrix, cell, locked))
    else:
        values.update(_pip_values(matrix, cell, locked))
    return template_text(f"{cell.installer}.Dockerfile.j2", values)


def _launch_values(cell: Cell, certs: bool, cgroup_root: str) -> dict[str, object]:
    return {"cell_id": cell.id, "prefix": ENV_PREFIX[cell.installer], "path_entries": ENV_PATH[cell.installer],
            "env": image_env(cell, certs), "threads_auto": cell.threads == AUTO, "cgroup_root": cgroup_root}


def entrypoint_text(cell: Cell, certs: bool = False, cgroup_root: str = CGROUP_ROOT) -> str:
    """The ENTRYPOINT script. cgroup_root: where it reads the CPU quota (tests point it elsewhere)."""
    return template_text("entrypoint.sh.j2", _launch_values(cell, certs, cgroup_root))


def launch_env_text(cell: Cell, certs: bool = False, cgroup_root: str = CGROUP_ROOT) -> str:
    """The same settings in POSIX sh, for /etc/profile.d/ and /.singularity.d/env/."""
    return template_text("launch-env.sh.j2", _launch_values(cell, certs, cgroup_root))


def launch_conf_text(cell: Cell, certs: bool = False) -> str:
    """The settings the Python launch hook applies (resources/launch.py reads them)."""
    return template_text("launch.conf.j2", _launch_values(cell, certs, CGROUP_ROOT))


def launch_hook_source() -> str:
    return (Path(__file__).resolve().parents[1] / "resources" / "launch.py").read_text(encoding="utf-8")


def layer_splitter_source() -> str:
    """resources/layers.py: the environment's build stage runs it to split the environment into layers."""
    return (Path(__file__).resolve().parents[1] / "resources" / "layers.py").read_text(encoding="utf-8")


def _write_launch_files(cell: Cell, root: Path, certs: bool) -> None:
    files = {
        "entrypoint.sh": (entrypoint_text(cell, certs), 0o755),  # the classic builder has no COPY --chmod
        "launch-env.sh": (launch_env_text(cell, certs), 0o644),
        "launch.conf": (launch_conf_text(cell, certs), 0o644),
        LAUNCH_HOOK: (launch_hook_source(), 0o644),
        LAUNCH_PTH: ("import imagefactory_launch\n", 0o644),
        "python-launcher": (template_text("python-launcher.sh.j2", {"python": f"{ENV_PREFIX[cell.installer]}/bin/python"}),
                            0o755),
    }
    for name, (text, mode) in files.items():
        (root / name).write_text(text, encoding="utf-8")
        (root / name).chmod(mode)  # COPY keeps the mode


def _cert_names(matrix: Matrix) -> list[str]:
    # Generated names: a file's own name (a newline, a quote) never reaches the context or the
    # Dockerfile; update-ca-certificates only reads *.crt.
    return [f"ca-{i:02d}.crt" for i in range(len(matrix.ca_certificates))]


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _write_files(matrix: Matrix, cell: Cell, root: Path, lock: lockfile.Lock | None) -> None:
    """Every file of the context except the Dockerfile. Only regular files are read; a context
    gets its own copy (or hard link) of each, never a symbolic link, wherever `root` is."""
    names = _cert_names(matrix)
    _write_launch_files(cell, root, bool(names))
    if names:
        from imagefactory.config import cacerts  # only a matrix that names CA files reads them

        (root / "certs").mkdir()
        for name, src in zip(names, matrix.ca_certificates):
            try:
                (root / "certs" / name).write_bytes(cacerts.certificates(src))
            except bounded.InputError as e:
                raise ConfigError(terminal.printable(f"ca_certificates: {e}")) from None
    if lock is not None:
        (root / lockfile.CONTEXT_NAME).write_text(lock.text, encoding="utf-8")  # so it is part of the content hash
    (root / recipe.LAYER_SPLITTER).write_text(layer_splitter_source(), encoding="utf-8")
    if cell.installer == "conda":
        text = template_text("condarc.j2", {"channels": matrix.conda.channels, "certs": names})
        (root / "condarc").write_text(text, encoding="utf-8")
        return
    if matrix.pip.wheelhouse is not None:
        from imagefactory.files import wheelfiles  # only a matrix with a wheelhouse lists its files

        (root / "wheelhouse").mkdir()
        try:
            files, refused = wheelfiles.wheelhouse_files(matrix.pip.wheelhouse)
        except bounded.InputError as e:
            refused = [str(e)]
        if refused:
            raise ConfigError(terminal.printable(f"pip.wheelhouse: {refused[0]}; only regular files inside it "
                                               f"enter an image"))
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


def render_cell(matrix: Matrix, cell: Cell, dest: Path, lock: lockfile.Lock | None, *,
                builder: Builder = Builder.classic, netrc: bool = False) -> Context:
    """Write one cell's context to `dest` (created; must not exist). `lock` is the cell's lock as
    lockfile.load_all read and checked it (read once per run), or None. `builder` and `netrc`
    as for dockerfile_text."""
    dest.mkdir(parents=True)
    _write_files(matrix, cell, dest, lock)
    certs = _cert_names(matrix)
    locked = lock is not None
    digest = context_hash(dest, dockerfile_text(matrix, cell, None, certs, locked=locked, builder=builder,
                                                netrc=netrc))
    (dest / "Dockerfile").write_text(dockerfile_text(matrix, cell, digest, certs, locked=locked, builder=builder,
                                                     netrc=netrc), encoding="utf-8")
    if lock is not None:  # the checks compare the image's packages with the lock's
        cell = replace(cell, locked=lock.versions())
    return Context(cell=cell, path=dest, content_hash=digest)


@dataclass(frozen=True)
class Variant:
    """One way a context can have been built: its Dockerfile differs by builder (BuildKit's has
    cache mounts) and by whether the install steps mount the netrc secret (BuildKit only)."""

    builder: Builder
    netrc: bool
    content_hash: str


def variants(matrix: Matrix, ctx: Context) -> list[Variant]:
    """Every content hash `ctx`'s files can have been built under: the classic builder's, BuildKit's,
    and BuildKit's with the netrc mounted when the cell installs from a host a netrc can name. The
    files are the same for each (only the Dockerfile differs), so nothing is written; `ctx`'s own
    hash comes first. How test and push find an image whichever builder made it."""
    certs, locked = _cert_names(matrix), (ctx.path / lockfile.CONTEXT_NAME).is_file()
    ways = [(Builder.classic, False), (Builder.buildkit, False)]
    if netrc_mod.cell_hosts(matrix, ctx.cell):
        ways.append((Builder.buildkit, True))
    found = [Variant(b, n, context_hash(ctx.path, dockerfile_text(matrix, ctx.cell, None, certs, locked=locked,
                                                                  builder=b, netrc=n)))
             for b, n in ways]
    return sorted(found, key=lambda v: v.content_hash != ctx.content_hash)


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
           builder: Builder = Builder.classic, netrc_cells: frozenset[str] = frozenset()) -> list[Context]:
    """Render every cell into out/<cell-id>/, all or nothing: contexts are written to a
    temporary folder and moved into place only when every cell rendered.

    Render owns no signal: the caller does (the CLI turns SIGINT/SIGTERM into `interrupt`).
    Once `interrupt` is set, render stops before the next cell with Cancelled and leaves
    nothing behind.

    `bases` maps a cell's base image to its pinned form (name:tag@sha256:..., see
    freshness.py); the pinned FROM is then part of the content hash. Without it the
    tags are kept (`imagefactory render` needs no engine).

    `builder`: the builder the contexts are for (BuildKit: cache mounts); `netrc_cells`: the ids of
    the cells whose install steps mount the netrc secret."""
    out = Path(out)
    cells = list(matrix.cells if cells is None else cells)
    if bases:
        cells = [replace(c, base_image=bases.get(c.base_image, c.base_image)) for c in cells]
    _check_out(out, cells)
    locks = lockfile.load_all(matrix, cells)  # every stale lock reported at once, before anything is written
    out.mkdir(parents=True, exist_ok=True)
    check = interrupt.check if interrupt is not None else (lambda: None)
    staging: Path | None = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=".render-", dir=out))
        staged = []
        for cell in cells:
            check()
            staged.append(render_cell(matrix, cell, staging / cell.id, locks[cell.id], builder=builder,
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


def _pip_values(matrix: Matrix, cell: Cell, locked: bool) -> dict[str, object]:
    pip = matrix.pip
    requirement, torch_opts = recipe.torch_requirement(matrix, cell)
    numpy_index = [pip.numpy_index_url] if cell.blas == "mkl" and pip.numpy_index_url else []
    opts = recipe.index_opts(matrix, pip.index_url, list(pip.extra_index_urls) + numpy_index)
    return {
        "wheelhouse": pip.wheelhouse is not None,
        "torch_requirement": requirement,
        "torch_opts": torch_opts,
        "pip_opts": opts,
        "requirements": recipe.pip_requirements(cell),
        # A lock installs every file from every index the lock was resolved against.
        "lock": locked,
        "lock_opts": recipe.index_opts(matrix, *lockfile.pip_sources(matrix, cell)),
    }
