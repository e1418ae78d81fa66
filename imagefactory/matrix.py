"""Step 1: matrix file -> validated, expanded cells.

Every problem is collected (not just the first) and reported as
``FILE:LINE: key.path: what is wrong (allowed: ...)``; nothing downstream runs
unless the whole file is valid.
"""

from __future__ import annotations

import difflib
import glob
import itertools
import json
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from imagefactory import tags as tagging
from imagefactory.errors import ConfigError
from imagefactory.model import Cell, CondaSettings, Matrix, PipSettings

AXES = ("python", "cuda", "blas", "installer")
CELL_KEYS = ("torch", "numpy", "threads", "base_image", "packages", "env")
DEFAULT_BASE_IMAGES = {"conda": "debian:bookworm-slim", "pip": "python:{python}-slim-bookworm"}
DEFAULT_THREADS = 4
# Variables the templates bake from the cell; the smoke tests judge them, so `env` cannot override them.
MANAGED_ENV = {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_THREADING_LAYER",
               "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "PATH", "VIRTUAL_ENV"}

# The CUDA build `pip install torch==X` gets from PyPI, by torch minor release
# (pytorch/test-infra generate_binary_build_matrix.py history; see docs/domain.md).
PYPI_DEFAULT_CUDA = {
    "2.5": "12.4", "2.6": "12.4", "2.7": "12.6", "2.8": "12.8", "2.9": "12.8",
    "2.10": "12.8", "2.11": "13.0", "2.12": "13.0", "2.13": "13.0", "2.14": "13.0",
}

# Docker reference grammar (distribution/reference), enough to refuse anything
# that is not a plain reference before it reaches a Dockerfile or the engine.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
REFERENCE_RE = re.compile(
    rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG})?(?:@sha256:[0-9a-f]{{64}})?$"
)


def is_reference(ref: str) -> bool:
    """True when `ref` is a valid Docker image reference (name, optional tag/digest)."""
    if not REFERENCE_RE.match(ref):
        return False
    name = ref.split("@")[0]
    return len(name) <= 255


def schema() -> dict[str, Any]:
    """The published JSON Schema of the matrix file."""
    text = resources.files("imagefactory").joinpath("resources/matrix.schema.json").read_text()
    return json.loads(text)


@dataclass(frozen=True)
class Problem:
    line: int
    key: str
    message: str


class _Located:
    """Maps key paths of a YAML document to line numbers (1-based)."""

    def __init__(self, root: yaml.Node | None):
        self.root = root

    def line(self, path: tuple[Any, ...], *, key: bool = True) -> int:
        """The line of the value at `path`; for a mapping entry, the line of its key."""
        node = self.root
        if node is None:
            return 1
        best = node.start_mark.line + 1
        for i, part in enumerate(path):
            child = None
            if isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    if k.value == part:
                        last = i == len(path) - 1
                        child = k if (key and last) else v
                        break
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                child = node.value[part]
            if child is None:
                return best
            node = child
            best = node.start_mark.line + 1
        return best

    def duplicate_keys(self) -> list[tuple[int, str]]:
        found: list[tuple[int, str]] = []

        def walk(node: yaml.Node, path: str) -> None:
            if isinstance(node, yaml.MappingNode):
                seen: set[str] = set()
                for k, v in node.value:
                    name = str(k.value)
                    sub = f"{path}.{name}" if path else name
                    if name in seen:
                        found.append((k.start_mark.line + 1, sub))
                    seen.add(name)
                    walk(v, sub)
            elif isinstance(node, yaml.SequenceNode):
                for i, v in enumerate(node.value):
                    walk(v, f"{path}[{i}]")

        if self.root is not None:
            walk(self.root, "")
        return found


def _keypath(path: tuple[Any, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _schema_message(error: jsonschema.ValidationError) -> tuple[tuple[Any, ...], str, bool]:
    """Turn a jsonschema error into (path, one-line message, points-at-key)."""
    path = tuple(error.absolute_path)
    v = error.validator
    inst = error.instance
    if v == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(inst) - set(allowed)) if isinstance(inst, dict) else []
        name = str(extra[0]) if extra else "?"
        guess = difflib.get_close_matches(name, allowed, n=1)
        hint = f"did you mean '{guess[0]}'? " if guess else ""
        return path + (name,), f"unknown key '{name}' ({hint}allowed: {', '.join(allowed)})", True
    if v == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return path, f"missing required key '{missing}'", False
    if v == "type":
        want = error.validator_value
        want = " or ".join(want) if isinstance(want, list) else want
        got = type(inst).__name__
        if isinstance(inst, float) and want == "string":
            return path, (f"{inst!r} was read as a number; quote it "
                          f"(YAML reads 3.10 as 3.1): write \"{inst}\""), False
        return path, f"expected {want}, got {got} {inst!r}", False
    if v == "enum":
        return path, f"{inst!r} is not allowed (allowed: {', '.join(map(str, error.validator_value))})", False
    if v == "pattern":
        desc = error.schema.get("description", f"must match {error.validator_value}")
        return path, f"{inst!r} is malformed ({desc})", False
    if v in ("minItems", "minProperties"):
        return path, "must not be empty", False
    if v in ("minimum", "maximum"):
        return path, f"{inst!r} is out of range ({v} {error.validator_value})", False
    if v == "propertyNames":
        return path, f"{error.message}", True
    if v == "oneOf":
        return path, f"{inst!r} is not a valid value (a URL or null)", False
    return path, error.message, False


def load(path: str | Path) -> Matrix:
    """Read, validate and expand a matrix file. Raises ConfigError with every problem."""
    path = Path(path).absolute()
    shown = str(path if not path.is_relative_to(Path.cwd()) else path.relative_to(Path.cwd()))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{shown}: no such matrix file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{shown}: cannot read: {e}") from None

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        raise ConfigError(f"{shown}:{line}: (yaml): {e.problem or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{shown}:1: (yaml): {e}") from None

    loc = _Located(root)
    problems: list[Problem] = []
    for line, key in loc.duplicate_keys():
        problems.append(Problem(line, key, "key given twice (the later one would silently win)"))

    if not isinstance(data, dict):
        raise ConfigError(f"{shown}:1: (top level): expected a mapping with keys image, matrix, torch")

    validator = jsonschema.Draft202012Validator(schema())
    for error in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        epath, msg, at_key = _schema_message(error)
        problems.append(Problem(loc.line(epath, key=at_key), _keypath(epath), msg))

    matrix = None
    if not problems:
        matrix = _build(path, data, loc, problems)
    if problems:
        problems.sort(key=lambda p: (p.line, p.key))
        raise ConfigError([f"{shown}:{p.line}: {p.key}: {p.message}" for p in problems])
    assert matrix is not None
    return matrix


def _build(path: Path, data: dict[str, Any], loc: _Located, problems: list[Problem]) -> Matrix | None:
    """Semantic checks and expansion; the data already matches the schema."""

    def problem(keypath: tuple[Any, ...], message: str) -> None:
        problems.append(Problem(loc.line(keypath), _keypath(keypath), message))

    base_dir = path.parent
    axes_spec = data["matrix"]
    axes = {a: list(axes_spec.get(a, ["conda"] if a == "installer" else [])) for a in AXES}

    for axis, values in axes.items():
        for i, v in enumerate(values):
            if values.index(v) != i:
                problem(("matrix", axis, i), f"{v!r} is listed twice (duplicate cells)")

    # exclude: partial match removes every combination (GitHub Actions semantics).
    for i, ex in enumerate(axes_spec.get("exclude", [])):
        for axis, value in ex.items():
            if value not in axes[axis]:
                problem(("matrix", "exclude", i, axis),
                        f"{value!r} is not in matrix.{axis}, so this exclude removes nothing "
                        f"(allowed: {', '.join(axes[axis])})")

    combos: list[dict[str, Any]] = []
    for combo_values in itertools.product(*(dict.fromkeys(axes[a]) for a in AXES)):
        combo = dict(zip(AXES, combo_values))
        if any(all(combo[k] == v for k, v in ex.items()) for ex in axes_spec.get("exclude", [])):
            continue
        combos.append(combo)
    original = [dict(c) for c in combos]

    # include: extend matching combinations without overwriting an original axis value;
    # an entry that extends none adds a new cell.
    for i, inc in enumerate(axes_spec.get("include", [])):
        inc_axes = {k: v for k, v in inc.items() if k in AXES}
        matched = False
        for combo, orig in zip(combos, original):
            if all(orig[k] == v for k, v in inc_axes.items()):
                combo.update(inc)
                matched = True
        if not matched:
            missing = [a for a in ("python", "cuda", "blas") if a not in inc_axes]
            if missing:
                problem(("matrix", "include", i),
                        f"matches no cell, and a new cell needs {', '.join(missing)}")
                continue
            new = {"installer": "conda", **inc}
            combos.append(new)
            original.append({k: new[k] for k in AXES})

    if not combos and not problems:
        problem(("matrix",), "no cell is left after exclude")
        return None

    pip_cfg = data.get("pip", {})
    conda_cfg = data.get("conda", {})
    pip = _pip_settings(pip_cfg, base_dir, problem)
    conda = _conda_settings(conda_cfg, problem)

    certs: list[Path] = []
    for i, rel in enumerate(data.get("ca_certificates", [])):
        pattern = base_dir / rel
        found = sorted(Path(p) for p in glob.glob(str(pattern))) if "*" in rel else [pattern]
        if not found:
            problem(("ca_certificates", i), f"no file matches {pattern}")
        for p in found:
            p = p.resolve()
            if not p.is_file():
                problem(("ca_certificates", i), f"file not found: {p}")
            elif "BEGIN CERTIFICATE" not in p.read_text(errors="replace"):
                problem(("ca_certificates", i), f"not a PEM certificate: {p}")
            else:
                certs.append(p)

    env_sources = [("env",)] * ("env" in data) + [("matrix", "include", i, "env") for i, inc in
                                 enumerate(axes_spec.get("include", [])) if "env" in inc]
    for keypath in env_sources:
        node: Any = data
        for part in keypath:
            node = node[part]
        for name in sorted(set(node) & MANAGED_ENV):
            problem(keypath + (name,), f"{name} is set by imagefactory "
                                       f"({'use threads' if 'THREADS' in name else 'from the cell'}), not by env")

    base_images = {**DEFAULT_BASE_IMAGES, **data.get("base_images", {})}
    base_registry = data.get("base_registry")
    user = data.get("user", {})
    tags_cfg = data.get("tags", {})
    image = data["image"]

    cells: list[Cell] = []
    seen: set[str] = set()
    for combo in combos:
        cuda = None if combo["cuda"] == "none" else combo["cuda"]
        torch = combo.get("torch", data["torch"])
        accel = "cpu" if cuda is None else f"cu{cuda}"
        base = combo.get("base_image", base_images[combo["installer"]])
        base = base.replace("{python}", combo["python"]).replace("{cuda}", cuda or "").replace("{accel}", accel)
        base = apply_base_registry(base, base_registry)
        env = {**data.get("env", {}), **combo.get("env", {})}
        cell = Cell(
            python=combo["python"], cuda=cuda, blas=combo["blas"], installer=combo["installer"],
            torch=torch, numpy=combo.get("numpy", data.get("numpy")),
            threads=combo.get("threads", data.get("threads", DEFAULT_THREADS)),
            base_image=base,
            packages=tuple(data.get("packages", [])) + tuple(combo.get("packages", [])),
            env=tuple(sorted(env.items())),
            labels=tuple(sorted(data.get("labels", {}).items())),
            user=user.get("name", "trainer"), uid=user.get("uid", 1000),
        )
        where = _cell_source(combo, axes_spec)
        if cell.id in seen:
            problem(where, f"cell {cell.id} is defined twice")
            continue
        seen.add(cell.id)
        if not is_reference(base):
            problem(where + ("base_image",) if "base_image" in combo else ("base_images", combo["installer"]),
                    f"cell {cell.id}: base image {base!r} is not a valid image reference")
        _check_cell(cell, pip, conda, where, problem)
        cells.append(cell)

    tag_template = tags_cfg.get("template", Matrix.tag_template)
    hash_template = tags_cfg.get("hash_template", Matrix.hash_tag_template)

    resolved: list[Cell] = []
    for cell in cells:
        try:
            release = tagging.release_tag(tag_template, image, cell)
            hashed = tagging.hash_tag(hash_template, image, cell, "0" * 12)
        except tagging.TagTemplateError as e:
            problem(("tags", e.key), str(e))
            break
        extras = [(ref, "extra") for ref in tagging.extra_tags(release, tuple(tags_cfg.get("extra", [])),
                                                               git_sha="0" * 40)]
        bad = [(ref, key) for ref, key in [(release, "template"), (hashed, "hash_template"), *extras]
               if not is_reference(ref)]
        for ref, key in bad:
            problem(("tags", key), f"cell {cell.id}: {ref!r} is not a valid Docker reference")
        if bad:
            break  # one cell shows the mistake; the others would repeat it
        resolved.append(replace(cell, tags=(release,)))
    if problems:
        return None
    return Matrix(
        path=path, image=image, cells=tuple(resolved), pip=pip, conda=conda,
        ca_certificates=tuple(certs), tag_template=tag_template, hash_tag_template=hash_template,
        extra_tags=tuple(tags_cfg.get("extra", [])),
    )


def _cell_source(combo: dict[str, Any], spec: dict[str, Any]) -> tuple[Any, ...]:
    """The key path a cell's problems point at: its include entry if it has one, else matrix."""
    for i, inc in enumerate(spec.get("include", [])):
        if all(combo.get(k) == v for k, v in inc.items()):
            return ("matrix", "include", i)
    return ("matrix",)


def _check_cell(cell: Cell, pip: PipSettings, conda: CondaSettings, where, problem) -> None:
    """Combinations that validate field by field but cannot work."""
    if cell.installer == "pip" and cell.blas == "mkl" and pip.numpy_index_url is None:
        problem(where, f"cell {cell.id}: PyPI's NumPy is linked to OpenBLAS only, so a pip cell cannot "
                       f"have blas: mkl without pip.numpy_index_url (an index serving MKL NumPy, "
                       f"e.g. Intel's); use installer conda or blas openblas")
    if cell.installer == "pip" and cell.cuda is not None and pip.torch_index_url is None:
        minor = ".".join(cell.torch.split(".")[:2])
        default = PYPI_DEFAULT_CUDA.get(minor)
        if default is None:
            problem(where, f"cell {cell.id}: unknown which CUDA build PyPI serves for torch {cell.torch}; "
                           f"set pip.torch_index_url to an index with a cu{cell.cuda.replace('.', '')} build")
        elif default != cell.cuda:
            problem(where, f"cell {cell.id}: PyPI's torch {cell.torch} is built for CUDA {default}, not "
                           f"{cell.cuda}, and pip.torch_index_url is null (allowed: cuda {default}, "
                           f"or set pip.torch_index_url)")
    if cell.installer == "pip" and cell.cuda is None and pip.torch_index_url is None:
        wheels = list(pip.wheelhouse.glob(f"torch-{cell.torch}+cpu-*.whl")) if pip.wheelhouse else []
        if not wheels:
            problem(where, f"cell {cell.id}: PyPI serves no CPU-only torch and pip.torch_index_url is null; "
                           f"put torch-{cell.torch}+cpu-*.whl in pip.wheelhouse or set pip.torch_index_url")
    if cell.installer == "conda" and cell.cuda is not None and _vtuple(cell.cuda) < (11, 8):
        problem(where, f"cell {cell.id}: conda-forge pytorch has no CUDA {cell.cuda} build (11.8 or newer)")


def _vtuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def _pip_settings(cfg: dict[str, Any], base_dir: Path, problem) -> PipSettings:
    wheelhouse = None
    if "wheelhouse" in cfg:
        wheelhouse = (base_dir / cfg["wheelhouse"]).resolve()
        if not wheelhouse.is_dir():
            problem(("pip", "wheelhouse"), f"directory not found: {wheelhouse}")
            wheelhouse = None
    urls = [("index_url", cfg.get("index_url"))] + [
        (("extra_index_urls", i), u) for i, u in enumerate(cfg.get("extra_index_urls", []))
    ] + [("torch_index_url", cfg.get("torch_index_url")), ("numpy_index_url", cfg.get("numpy_index_url"))]
    for key, url in urls:
        if url and re.match(r"^https?://[^/]*@", url):
            keypath = ("pip",) + (key if isinstance(key, tuple) else (key,))
            problem(keypath, "credentials in a URL would be baked into an image layer; "
                             "serve the index without them (or through a local proxy)")
    return PipSettings(
        index_url=cfg.get("index_url"),
        extra_index_urls=tuple(cfg.get("extra_index_urls", [])),
        wheelhouse=wheelhouse,
        torch_index_url=cfg.get("torch_index_url", PipSettings.torch_index_url),
        numpy_index_url=cfg.get("numpy_index_url"),
    )


def _conda_settings(cfg: dict[str, Any], problem) -> CondaSettings:
    dist = cfg.get("distribution", "miniforge")
    default = CondaSettings()
    version, sha = cfg.get("version"), cfg.get("sha256")
    if dist == "miniconda" and (version is None or sha is None):
        problem(("conda",), "distribution miniconda needs conda.version and conda.sha256 "
                            "(no Miniconda digest is known to imagefactory)")
    elif dist == "miniforge" and version not in (None, default.version) and sha is None:
        problem(("conda", "version"), f"Miniforge {version} needs conda.sha256 (the built-in digest "
                                      f"is for {default.version})")
    return CondaSettings(
        distribution=dist,
        version=version or default.version,
        sha256=sha or default.sha256,
        channels=tuple(cfg.get("channels", default.channels)),
        installer_url=cfg.get("installer_url"),
    )


def apply_base_registry(ref: str, base_registry: str | None) -> str:
    """Prefix a Docker Hub reference with a mirror; references naming a registry are kept."""
    if not base_registry:
        return ref
    first = ref.split("/")[0]
    if "/" in ref and ("." in first or ":" in first or first == "localhost"):
        return ref  # already names its registry
    if "/" not in ref:
        ref = f"library/{ref}"
    return f"{base_registry.rstrip('/')}/{ref}"
