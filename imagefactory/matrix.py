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
from urllib.parse import parse_qsl, urlsplit

import jsonschema
import yaml
from packaging.requirements import InvalidRequirement, Requirement

from imagefactory import availability, inputs
from imagefactory import tags as tagging
from imagefactory.errors import ConfigError
from imagefactory.model import Cell, CondaSettings, Matrix, PipSettings

AXES = ("python", "cuda", "blas", "installer")
CELL_KEYS = ("torch", "numpy", "threads", "compiler", "base_image", "packages", "env")
DEFAULT_BASE_IMAGES = {"conda": "debian:bookworm-slim", "pip": "python:{python}-slim-bookworm"}
DEFAULT_THREADS = 4
# Variables the templates bake from the cell; the smoke tests judge them, so `env` cannot override them.
MANAGED_ENV = {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_THREADING_LAYER",
               "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "PATH", "VIRTUAL_ENV"}

# Bounds on what a matrix file may cost to read (a real one is a few KB, tens of cells).
MAX_BYTES = 256 * 1024  # pure-Python YAML parses about 20 KB a second on a busy machine
MAX_DEPTH = 32  # nesting of mappings and sequences
MAX_EVENTS = 20_000  # YAML parser events (scalars, starts, ends)
MAX_VALUES = 20_000  # values after aliases are expanded
MAX_CELLS = 256
MAX_LINE = 400  # characters of one error line
MAX_PROBLEMS = 20  # error lines shown
RESERVED_LABEL_PREFIX = "io.imagefactory"
STAGE_NAMES = {"venv"}  # build-stage names in dockerfiles/; a base image with one of them would be the stage
# Whole-string patterns for what reaches a Dockerfile, a condarc or a shell word.
CONDA_SPEC_RE = re.compile(
    r"[A-Za-z0-9_][A-Za-z0-9._-]*(?:(?:==|=|>=|<=|!=|~=|>|<)[A-Za-z0-9_][A-Za-z0-9.*+_]*"
    r"(?:,(?:==|=|>=|<=|!=|~=|>|<)[A-Za-z0-9_][A-Za-z0-9.*+_]*)*)?")
# scheme://user[:password]@ anywhere in a string (a URL inside an env or label value too). No
# scheme before "://": a pattern that starts with [A-Za-z]+ is quadratic on a long run of letters.
CREDENTIALS_RE = re.compile(r"://[^/?#\s@]*@")
# A query or fragment parameter whose name says it carries a credential: token=, key=, api_key=,
# password=, secret=, sig=, X-Amz-Signature=, X-Amz-Credential=, auth=... (checked per URL).
CREDENTIAL_PARAM_RE = re.compile(r"(?:[a-z0-9]+[_.-])*(?:token|key|apikey|accesstoken|authtoken|password|passwd|pwd|"
                                 r"secret|sig|signature|credentials?|auth|authorization|session)", re.IGNORECASE)
URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,30}://\S{1,4000}")
CREDENTIALS_MESSAGE = ("credentials in a URL (user:password@, or a ?token=/key=/password=/sig= parameter) would be "
                       "baked into an image layer and its history; put the login in a netrc file and build with "
                       "--builder buildkit --netrc PATH (a build secret, never in a layer)")


def has_credentials(text: str) -> bool:
    """Whether `text` holds a URL with userinfo or with a credential-named query parameter."""
    if "://" not in text:
        return False
    if CREDENTIALS_RE.search(text):
        return True
    for url in URL_RE.findall(text[:100_000]):
        try:
            parts = urlsplit(url)
        except ValueError:  # not a URL after all (an unbalanced "[" in its host)
            continue
        for section in (parts.query, parts.fragment):
            for name, _ in parse_qsl(section, keep_blank_values=True):
                if CREDENTIAL_PARAM_RE.fullmatch(name.strip()[:100]):
                    return True
    return False
# Characters the YAML reader refuses; reported by us with their line, not a byte offset.
_UNREADABLE = re.compile("[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010FFFF]")

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
    rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG})?(?:@sha256:[0-9a-f]{{64}})?"
)


def is_reference(ref: str) -> bool:
    """True when `ref` is a valid Docker image reference (name, optional tag/digest)."""
    if not REFERENCE_RE.fullmatch(ref):
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

    def node(self, path: tuple[Any, ...], *, key: bool = True) -> yaml.Node | None:
        """The node at `path` (for a mapping entry, its key node), or the deepest one found."""
        node = self.root
        for i, part in enumerate(path):
            child = None
            if isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    if k.value == part:
                        child = k if (key and i == len(path) - 1) else v
                        break
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                child = node.value[part]
            if child is None:
                return node
            node = child
        return node

    def line(self, path: tuple[Any, ...], *, key: bool = True) -> int:
        """The line of the value at `path`; for a mapping entry, the line of its key."""
        node = self.node(path, key=key)
        return 1 if node is None else node.start_mark.line + 1

    def source(self, path: tuple[Any, ...]) -> str | None:
        """The text the user typed for the scalar at `path` (3.10, not the float 3.1)."""
        node = self.node(path, key=False)
        return node.value if isinstance(node, yaml.ScalarNode) else None


_STR = "tag:yaml.org,2002:str"
_KEY_KINDS = {"int": "a number", "float": "a number", "bool": "true/false", "null": "null (empty)",
              "timestamp": "a date", "binary": "binary data"}


def _structure(root: yaml.Node) -> tuple[list[Problem], int]:
    """Problems of the document's shape, found without expanding aliases: keys that are not
    text, keys given twice, control characters, credentials in URLs. Also the number of
    values the document has once its aliases are expanded."""
    problems: list[Problem] = []
    visited: set[int] = set()
    sizes: dict[int, int] = {}

    def scalar(node: yaml.ScalarNode, path: str) -> None:
        text = node.value
        bad = next((c for c in text if not c.isprintable()), None)
        if node.tag == _STR and bad is not None:
            problems.append(Problem(node.start_mark.line + 1, path or "(top level)",
                                    f"{_show(text)} holds the control character {_show(bad)[1:-1]}"))
        elif node.tag == _STR and has_credentials(text):
            problems.append(Problem(node.start_mark.line + 1, path or "(top level)", CREDENTIALS_MESSAGE))

    def walk(node: yaml.Node, path: str) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        size = 1
        if id(node) not in visited:
            visited.add(id(node))
            if isinstance(node, yaml.ScalarNode):
                scalar(node, path)
            elif isinstance(node, yaml.SequenceNode):
                for i, v in enumerate(node.value):
                    size += walk(v, f"{path}[{i}]")
            elif isinstance(node, yaml.MappingNode):
                size += _mapping(node, path, walk, problems)
        sizes[id(node)] = size
        return size

    total = walk(root, "")
    return problems, total


def _mapping(node: yaml.MappingNode, path: str, walk, problems: list[Problem]) -> int:
    seen: set[str] = set()
    size = 0
    for k, v in node.value:
        line = k.start_mark.line + 1
        if not isinstance(k, yaml.ScalarNode):
            problems.append(Problem(line, path or "(top level)", "a key must be text, not a list or mapping"))
            size += 1 + walk(v, path)
            continue
        name = k.value
        sub = f"{path}.{name}" if path else name
        if k.tag not in (_STR, "tag:yaml.org,2002:merge"):
            kind = _KEY_KINDS.get(k.tag.rsplit(":", 1)[-1], k.tag)
            problems.append(Problem(line, sub, f"key {_show(name)} is read as {kind}, not text; "
                                               f"quote it (\"{name}\") or rename it"))
        elif name in seen:
            problems.append(Problem(line, sub, "key given twice (the later one would silently win)"))
        else:
            walk(k, sub)  # control characters in a key
        seen.add(name)
        size += 1 + walk(v, sub)
    return size


def _show(value: object, limit: int = 80) -> str:
    """A value as it appears in a message: repr (control characters escaped), cut to `limit`."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _printable(line: str) -> str:
    """One message line safe for a terminal: no control or escape characters, bounded length."""
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    return line if len(line) <= MAX_LINE else f"{line[:MAX_LINE]}... ({len(line) - MAX_LINE} more characters)"


def _keypath(path: tuple[Any, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _schema_message(error: jsonschema.ValidationError, loc: _Located) -> tuple[tuple[Any, ...], str, bool]:
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
        return path + (name,), f"unknown key {_show(name)} ({hint}allowed: {', '.join(allowed)})", True
    if v == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return path, f"missing required key '{missing}'", False
    if v == "type":
        want = error.validator_value
        want = " or ".join(want) if isinstance(want, list) else want
        got = type(inst).__name__
        typed = loc.source(path)
        if isinstance(inst, (float, int)) and not isinstance(inst, bool) and want == "string" and typed:
            why = f"YAML reads {typed} as {inst!r}" if str(inst) != typed else "a version is text"
            return path, f"{typed} was read as a number; quote it ({why}): write \"{typed}\"", False
        return path, f"expected {want}, got {got} {_show(inst)}", False
    if v == "enum":
        return path, f"{_show(inst)} is not allowed (allowed: {', '.join(map(str, error.validator_value))})", False
    if v == "pattern":
        desc = error.schema.get("description", f"must match {error.validator_value}")
        return path, f"{_show(inst)} is malformed ({desc})", False
    if v in ("minItems", "minProperties"):
        return path, "must not be empty", False
    if v in ("maxItems", "maxProperties", "maxLength"):
        return path, f"too long (at most {error.validator_value})", False
    if v in ("minimum", "maximum"):
        return path, f"{_show(inst)} is out of range ({v} {error.validator_value})", False
    if v == "propertyNames":
        return path, f"{error.message}", True
    if v == "oneOf":
        # The branch whose type the value has says best what is wrong with it (threads: 0);
        # a value of no branch's type gets the description (threads: four -> "a count, or auto").
        branches: dict[Any, list[jsonschema.ValidationError]] = {}
        for e in error.context or []:
            branches.setdefault(e.relative_schema_path[0], []).append(e)
        of_its_type = [errs for errs in branches.values() if all(e.validator != "type" for e in errs)]
        if of_its_type:
            return _schema_message(of_its_type[0][0], loc)
        desc = error.schema.get("description", "see the README")
        return path, f"expected {desc}, got {type(inst).__name__} {_show(inst)}", False
    return path, _show(error.message, MAX_LINE), False


def _fullmatch(validator, pattern: str, instance: Any, schema: dict[str, Any]):
    """`pattern`, matched against the whole string: `$` alone lets "3.11\\n" through."""
    if isinstance(instance, str) and not re.fullmatch(pattern, instance):
        yield jsonschema.ValidationError(f"{_show(instance)} does not match {pattern!r}")


# Integers are ints: JSON Schema counts 4.0 as an integer, and `threads: 4.0` would bake "4.0".
_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda checker, value: isinstance(value, int) and not isinstance(value, bool))
Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, validators={"pattern": _fullmatch},
                                         type_checker=_TYPES)
_RANK = {"type": 0, "additionalProperties": 1, "required": 1}  # per value, the most basic mistake wins


def _read(path: Path, shown: str) -> str:
    """The text of a regular, bounded, UTF-8 file; a located error for anything else."""
    try:
        raw = inputs.read_regular(path, MAX_BYTES)
    except inputs.InputError as e:
        raise ConfigError(f"{shown}: {'no such matrix file' if str(e) == 'file not found' else e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{shown}:{line}: (yaml): byte 0x{raw[e.start]:02x} is not UTF-8 "
                          f"(save the file as UTF-8)") from None


def _parse(text: str, shown: str) -> tuple[yaml.Node | None, Any]:
    """Compose and construct the document within MAX_DEPTH, MAX_EVENTS and MAX_VALUES."""
    def fail(line: int, message: str) -> ConfigError:
        return ConfigError(f"{shown}:{line}: (yaml): {message}")

    bad = _UNREADABLE.search(text)
    if bad:
        raise fail(text.count("\n", 0, bad.start()) + 1,
                   f"control character {_show(bad.group())[1:-1]} is not allowed in a YAML file")
    depth = 0
    for number, line in enumerate(text.splitlines(), 1):  # the scanner slows down with each flow level
        depth = max(0, depth + line.count("[") + line.count("{") - line.count("]") - line.count("}"))
        if depth > MAX_DEPTH:
            raise fail(number, f"nested deeper than {MAX_DEPTH} levels")
    try:
        depth, events = 0, 0
        alias_line: int | None = None
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            events += 1
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            at = event.start_mark.line + 1 if event.start_mark else 1
            if isinstance(event, yaml.AliasEvent) and alias_line is None:
                alias_line = at
            if depth > MAX_DEPTH:
                raise fail(at, f"nested deeper than {MAX_DEPTH} levels")
            if events > MAX_EVENTS:
                raise fail(at, f"more than {MAX_EVENTS} values")
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                return None, None
            problems, size = _structure(root)
            if size > MAX_VALUES:
                raise fail(alias_line or 1, f"aliases expand the document to more than {MAX_VALUES} values")
            if problems:
                raise _config_error(shown, problems)
            return root, loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise fail(mark.line + 1 if mark else 1, str(e.problem or e)) from None
    except yaml.YAMLError as e:
        raise fail(1, str(e)) from None


def _config_error(shown: str, problems: list[Problem]) -> ConfigError:
    """Every problem once, in file order, each line printable and bounded."""
    unique = sorted(set(problems), key=lambda p: (p.line, p.key, p.message))
    lines = [_printable(f"{shown}:{p.line}: {p.key}: {p.message}") for p in unique[:MAX_PROBLEMS]]
    if len(unique) > MAX_PROBLEMS:
        lines.append(f"{_printable(shown)}: {len(unique) - MAX_PROBLEMS} more problems not shown")
    return ConfigError(lines)


def load(path: str | Path) -> Matrix:
    """Read, validate and expand a matrix file. Raises ConfigError with every problem."""
    path = Path(path).absolute()
    shown = str(path if not path.is_relative_to(Path.cwd()) else path.relative_to(Path.cwd()))
    try:
        root, data = _parse(_read(path, shown), shown)
    except ConfigError as e:
        raise ConfigError([_printable(line) for line in e.problems]) from None
    if not isinstance(data, dict):
        raise ConfigError(_printable(f"{shown}:1: (top level): expected a mapping with keys image, matrix, torch"))

    loc = _Located(root)
    problems: list[Problem] = []
    best: dict[tuple[str, ...], tuple[int, Problem]] = {}
    for error in Validator(schema()).iter_errors(data):
        epath, msg, at_key = _schema_message(error, loc)
        rank = _RANK.get(str(error.validator), 2)
        where = tuple(map(str, error.absolute_path)) + ((str(error.validator),) if at_key else ())
        if where not in best or rank < best[where][0]:
            best[where] = (rank, Problem(loc.line(epath, key=at_key), _keypath(epath), msg))
    problems.extend(p for _, p in best.values())

    matrix = None
    if not problems:
        matrix = _build(path, data, loc, problems)
    if problems:
        raise _config_error(shown, problems)
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
    for picked in itertools.product(*(dict.fromkeys(axes[a]) for a in AXES)):
        combo = dict(zip(AXES, picked))
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

    certs = _certificates(data.get("ca_certificates", []), base_dir, problem)

    env_sources = [("env",)] * ("env" in data) + [("matrix", "include", i, "env") for i, inc in
                                 enumerate(axes_spec.get("include", [])) if "env" in inc]
    for keypath in env_sources:
        node: Any = data
        for part in keypath:
            node = node[part]
        for name in sorted(set(node) & MANAGED_ENV):
            problem(keypath + (name,), f"{name} is set by imagefactory "
                                       f"({'use threads' if 'THREADS' in name else 'from the cell'}), not by env")

    for name in data.get("labels", {}):
        if name == RESERVED_LABEL_PREFIX or name.startswith(RESERVED_LABEL_PREFIX + "."):
            problem(("labels", name), f"labels under {RESERVED_LABEL_PREFIX}. are set by imagefactory "
                                      f"(the checks and the cache read them); choose another name")
    if len(combos) > MAX_CELLS:
        problem(("matrix",), f"{len(combos)} cells, more than {MAX_CELLS}; split the matrix file")
        return None

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
            compiler=combo.get("compiler", data.get("compiler", True)),
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
        elif cell.installer == "pip" and _repository(base) in STAGE_NAMES:
            problem(where + ("base_image",) if "base_image" in combo else ("base_images", combo["installer"]),
                    f"cell {cell.id}: base image {base!r} has the name of a build stage of the pip "
                    f"template ({', '.join(sorted(STAGE_NAMES))}); name its registry or namespace")
        _check_packages(cell, combo, where, problem)
        _check_cell(cell, pip, conda, where, problem)
        cells.append(cell)

    tag_template = tags_cfg.get("template", Matrix.tag_template)
    hash_template = tags_cfg.get("hash_template", Matrix.hash_tag_template)

    resolved = _resolve_tags(cells, image, tag_template, hash_template, tags_cfg.get("extra", []), problem)
    if problems:
        return None
    return Matrix(
        path=path, image=image, cells=tuple(resolved), pip=pip, conda=conda,
        ca_certificates=tuple(certs), tag_template=tag_template, hash_tag_template=hash_template,
        extra_tags=tuple(tags_cfg.get("extra", [])),
    )


def _resolve_tags(cells: list[Cell], image: str, template: str, hash_template: str, extra: list[str],
                  problem) -> list[Cell]:
    """Each cell with its release tag; every tag a valid reference, and no tag shared by two cells
    (one push would overwrite the other). Hash tags are checked with a distinct stand-in hash per
    cell: cells always differ in content, so only a template without {hash} can make them clash."""
    resolved: list[Cell] = []
    owner: dict[str, tuple[str, str]] = {}
    for n, cell in enumerate(cells):
        try:
            release = tagging.release_tag(template, image, cell)
            hashed = tagging.hash_tag(hash_template, image, cell, f"{n:012x}")
        except tagging.TagTemplateError as e:
            problem(("tags", e.key), str(e))
            return []
        refs = [(release, "template"), (hashed, "hash_template")] + [
            (ref, "extra") for ref in tagging.extra_tags(release, tuple(extra), git_sha="0" * 40)]
        bad = [(ref, key) for ref, key in refs if not is_reference(ref)]
        for ref, key in bad:
            problem(("tags", key), f"cell {cell.id}: {ref!r} is not a valid Docker reference")
        if bad:
            return []  # one cell shows the mistake; the others would repeat it
        for ref, key in dict.fromkeys(refs):
            if ref in owner and owner[ref][0] != cell.id:
                problem(("tags", key), f"cells {owner[ref][0]} and {cell.id} would both be tagged {ref!r}, "
                                       f"and one push would overwrite the other; add a field such as {{id}}")
                return []
            owner[ref] = (cell.id, key)
        resolved.append(replace(cell, tags=(release,)))
    return resolved


def _certificates(patterns: list[str], base_dir: Path, problem) -> list[Path]:
    """The CA certificate files, each a regular file holding certificates and no key."""
    certs: list[Path] = []
    for i, rel in enumerate(patterns):
        pattern = base_dir / rel
        found = sorted(Path(p) for p in glob.glob(str(pattern))) if "*" in rel else [pattern]
        if not found:
            problem(("ca_certificates", i), f"no file matches {pattern}")
        for p in found:
            try:
                inputs.certificates(p)
            except inputs.InputError as e:
                problem(("ca_certificates", i), str(e))
            else:
                certs.append(p.resolve())
    return certs


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
    if cell.installer == "conda":
        why = availability.conda_problem(cell.torch, cell.cuda, cell.python, cell.blas)
        if why:
            problem(where, f"cell {cell.id}: {why}")


def _repository(ref: str) -> str:
    """The repository part of a reference: no registry-less tag, no digest."""
    name = ref.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def _check_packages(cell: Cell, combo: dict[str, Any], where: tuple[Any, ...], problem) -> None:
    """Each extra package is a valid spec for the installer of the cell it goes into."""
    own = list(combo.get("packages", []))
    for spec in dict.fromkeys(cell.packages):
        keypath = where + ("packages", own.index(spec)) if spec in own else ("packages", list(
            cell.packages).index(spec))
        if cell.installer == "pip":
            try:
                Requirement(spec)
            except InvalidRequirement:
                problem(keypath, f"cell {cell.id}: {spec!r} is not a pip requirement (PEP 508: a name, then "
                                 f"==, !=, >=, <=, >, <, ~= or === and a version), e.g. scipy>=1.11")
        elif not CONDA_SPEC_RE.fullmatch(spec):
            problem(keypath, f"cell {cell.id}: {spec!r} is not a conda package spec "
                             f"(name, then =, ==, >=, <=, !=, ~=, > or < and a version), e.g. scipy>=1.11")


def _pip_settings(cfg: dict[str, Any], base_dir: Path, problem) -> PipSettings:
    wheelhouse = None
    if "wheelhouse" in cfg:
        wheelhouse = base_dir / cfg["wheelhouse"]
        try:
            wheelhouse = wheelhouse.resolve()
            refused = inputs.wheelhouse_files(wheelhouse)[1] if wheelhouse.is_dir() else None
        except OSError as e:
            problem(("pip", "wheelhouse"), f"cannot be read: {e.strerror}")
            return PipSettings()
        if refused is None:
            problem(("pip", "wheelhouse"), f"directory not found: {wheelhouse}")
            wheelhouse = None
        for reason in refused or []:
            problem(("pip", "wheelhouse"), f"{reason}; only regular files inside it enter an image")
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
    name = ref.split("@", 1)[0]  # a digest's "sha256:" is not a registry port
    first = name.split("/")[0]
    if "/" in name and ("." in first or ":" in first or first == "localhost"):
        return ref  # already names its registry
    if "/" not in name:
        ref = f"library/{ref}"
    return f"{base_registry.rstrip('/')}/{ref}"
