"""Step 2 (config/): matrix file -> validated, expanded cells.

Every problem is collected (not just the first) and reported as
``FILE:LINE: key.path: what is wrong (allowed: ...)``; nothing downstream runs
unless the whole file is valid.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import re
import unicodedata
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from imagefactory import __version__
from imagefactory.config import availability
from imagefactory.config import bases
from imagefactory.config import expand
from imagefactory.config.bases import DEFAULT_BASE_IMAGES
from imagefactory.config.bases import apply_base_registry as apply_base_registry  # matrix.apply_base_registry
from imagefactory.files import bounded
from imagefactory import credentials
from imagefactory import terminal
from imagefactory.files import yamlfile
from imagefactory.files.store import Store
from imagefactory.config import platforms
from imagefactory.config import refs
from imagefactory.config import registries
from imagefactory.config import tags
from imagefactory.errors import ConfigError
from imagefactory.files.yamlfile import Located as _Located
from imagefactory.files.yamlfile import Problem
from imagefactory.config.model import Cell, CondaSettings, InstallerPin, Matrix, PipSettings, TagList, parse_size

if TYPE_CHECKING:
    import jsonschema

CELL_KEYS = ("torch", "numpy", "threads", "compiler", "base_image", "packages", "env", "size_budget")
DEFAULT_THREADS = 4
# Variables the templates bake from the cell; the smoke tests judge them, so `env` cannot override them.
MANAGED_ENV = {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_THREADING_LAYER",
               "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "PATH", "VIRTUAL_ENV"}

# Variables that make every process load code the image did not choose (the dynamic loader reads
# LD_*, every bash reads BASH_ENV, sh reads ENV before the entrypoint script runs): refused in
# `env` unless listed under `env_allow`.
LOADER_ENV = {"LD_PRELOAD", "LD_AUDIT", "BASH_ENV", "ENV"}
# Thread controls that would fight the counts `threads` bakes (and the checks judge): refused.
THREAD_ENV = {"OMP_THREAD_LIMIT", "OMP_DYNAMIC", "OMP_MAX_ACTIVE_LEVELS", "MKL_DYNAMIC",
              "MKL_DOMAIN_NUM_THREADS", "GOTO_NUM_THREADS", "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"}
INVISIBLE_LETTERS = {"\u115f", "\u1160", "\u3164", "\uffa0"}  # Hangul fillers: letters (\w) that show as nothing
LOOPBACK_HOSTS = re.compile(r"localhost|127(?:\.[0-9]{1,3}){3}|\[?::1\]?")
DECIMAL_RE = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")  # what YAML 1.2 and a reader both read as the same integer

MAX_CELLS = 256
# The bounded YAML reader and the message helpers live in files/yamlfile.py, which every file read goes through.
MAX_BYTES, MAX_DEPTH, MAX_EVENTS, MAX_VALUES = (yamlfile.YAML_MAX_BYTES, yamlfile.MAX_DEPTH, yamlfile.MAX_EVENTS,
                                                yamlfile.MAX_VALUES)
MAX_LINE, MAX_PROBLEMS, CREDENTIALS_RE = terminal.MAX_LINE, yamlfile.MAX_PROBLEMS, credentials.CREDENTIALS_RE
_read, _parse, _structure, _config_error = yamlfile.read_yaml_text, yamlfile.parse_yaml, yamlfile.structure, yamlfile.config_error
_show, _printable = terminal.show, terminal.printable
RESERVED_LABEL_PREFIX = "io.imagefactory"
# Whole-string patterns for what reaches a Dockerfile, a condarc or a shell word.
CONDA_SPEC_RE = re.compile(
    r"[A-Za-z0-9_][A-Za-z0-9._-]*(?:(?:==|=|>=|<=|!=|~=|>|<)[A-Za-z0-9_][A-Za-z0-9.*+_]*"
    r"(?:,(?:==|=|>=|<=|!=|~=|>|<)[A-Za-z0-9_][A-Za-z0-9.*+_]*)*)?")

def is_reference(ref: str) -> bool:
    """True when `ref` is a valid Docker image reference (name, optional tag/digest)."""
    return refs.is_reference(ref)


def schema() -> dict[str, Any]:
    """The published JSON Schema of the matrix file."""
    return json.loads(_schema_text())




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
        name = _unknown_keys(error)[0]
        return path + (name,), _unknown_key(name, sorted(error.schema.get("properties", {}))), True
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
        why = f": {error.schema['description']}" if "description" in error.schema else ""
        return path, f"{_show(inst)} is out of range ({v} {error.validator_value}){why}", False
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


def _unknown_keys(error: jsonschema.ValidationError) -> list[str]:
    allowed = set(error.schema.get("properties", {}))
    inst = error.instance
    return sorted(str(k) for k in set(inst) - allowed) if isinstance(inst, dict) else ["?"]


def _unknown_key(name: str, allowed: list[str]) -> str:
    """'unknown key ...', naming the code points of a look-alike ('tоrch' with a Cyrillic о)."""
    guess = difflib.get_close_matches(name, allowed, n=1)
    odd = codepoints(name)
    holds = f"it holds {odd}; " if odd else ""
    hint = f"did you mean '{guess[0]}'? " if guess else ""
    return f"unknown key {_show(name)} ({holds}{hint}allowed: {', '.join(allowed)})"


def _fullmatch(validator, pattern: str, instance: Any, schema: dict[str, Any]):
    """`pattern`, matched against the whole string: `$` alone lets "3.11\\n" through."""
    import jsonschema

    if isinstance(instance, str) and not re.fullmatch(pattern, instance):
        yield jsonschema.ValidationError(f"{_show(instance)} does not match {pattern!r}")


@functools.cache
def validator_class() -> Any:
    """The schema's validator class, built on first use: jsonschema (with its format checkers) is
    the largest import of a command, and `--help`, or a `list` of a matrix validated before, never
    needs it."""
    import jsonschema

    # Integers are ints: JSON Schema counts 4.0 as an integer, and `threads: 4.0` would bake "4.0".
    types = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda checker, value: isinstance(value, int) and not isinstance(value, bool))
    return jsonschema.validators.extend(jsonschema.Draft202012Validator, validators={"pattern": _fullmatch},
                                        type_checker=types)


def __getattr__(name: str) -> Any:  # `matrix.Validator`, built on first use
    if name == "Validator":
        return validator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_RANK = {"type": 0, "additionalProperties": 1, "required": 1}  # per value, the most basic mistake wins

# -- the validation cache ---------------------------------------------------------------------------
# A matrix whose bytes loaded before (no problem at all), under the same schema and the same
# imagefactory (its validator's rules are code: _fullmatch, the integer type), loads from its kept
# data (below): `load` skips the YAML parser and the schema step (and the jsonschema import) for
# it. Only a matrix that passed every check is kept; every check of _build runs every time.


@functools.cache
def _schema_text() -> str:
    return resources.files("imagefactory").joinpath("resources/matrix.schema.json").read_text()


def validation_key(text: str) -> str:
    """The key of the matrix's kept data (DATA): what decides what it loads to, the schema's verdict
    included: the matrix's bytes, the schema's bytes and the code (imagefactory's version, and the
    YAML reader's source)."""
    return DATA.key(__version__, hashlib.sha256(_schema_text().encode()).hexdigest(), text.encode("utf-8"),
                    code=(yamlfile.__name__,))


def _schema_problems(data: Any, loc: _Located) -> list[Problem]:
    """Every schema problem of `data`, each reported once, the most basic first."""
    problems: list[Problem] = []
    best: dict[tuple[str, ...], tuple[int, Problem]] = {}
    for error in validator_class()(schema()).iter_errors(data):
        if error.validator == "additionalProperties":  # every unknown key, not only the first
            at = tuple(error.absolute_path)
            allowed = sorted(error.schema.get("properties", {}))
            problems.extend(Problem(loc.line(at + (k,)), _keypath(at + (k,)), _unknown_key(k, allowed))
                            for k in _unknown_keys(error))
            continue
        epath, msg, at_key = _schema_message(error, loc)
        rank = _RANK.get(str(error.validator), 2)
        where = tuple(map(str, error.absolute_path)) + ((str(error.validator),) if at_key else ())
        if where not in best or rank < best[where][0]:
            best[where] = (rank, Problem(loc.line(epath, key=at_key), _keypath(epath), msg))
    problems.extend(p for _, p in best.values())
    return problems


def load(path: str | Path) -> Matrix:
    """Read, validate and expand a matrix file. Raises ConfigError with every problem."""
    path = Path(path).absolute()
    shown = str(path if not path.is_relative_to(Path.cwd()) else path.relative_to(Path.cwd()))
    try:
        text = _read(path, shown)
    except ConfigError as e:
        raise ConfigError([_printable(line) for line in e.problems]) from None
    key = validation_key(text)
    data = kept_data(key)
    parsed = None  # the data's JSON text, to keep, when it came from the YAML
    if data is not None:  # these bytes loaded before: their YAML parses to this, valid, with no odd integer
        loc = _Located(None, compose=lambda: _parse(text, shown)[0])
        problems: list[Problem] = []
    else:
        try:
            root, data = _parse(text, shown)
        except ConfigError as e:
            raise ConfigError([_printable(line) for line in e.problems]) from None
        if not isinstance(data, dict):
            raise ConfigError(_printable(f"{shown}:1: (top level): expected a mapping with keys image, matrix, "
                                         f"torch"))
        loc = _Located(root)
        parsed = _as_json(data)  # before _build, which reads the data as it is
        problems = _schema_problems(data, loc)
        problems.extend(odd_integers(data, loc))

    matrix = None
    if not problems:
        matrix = _build(path, data, loc, problems)
    if problems:
        raise _config_error(shown, problems)
    if parsed is not None:
        keep_data(key, parsed)
    assert matrix is not None
    return matrix


# -- the parsed matrix -----------------------------------------------------------------------------
# The data of a matrix whose bytes loaded before (under the key above): a pure function of the
# bytes, so the next load reads it as JSON, imports no YAML parser and skips the schema (`list` and
# a no-op `build`: 0.14 s against 2.16 s on examples/matrix.yaml).
# The YAML is parsed again only if a problem needs its line (a file the matrix names went away).
DATA_KEPT = 64
DATA_MAX_BYTES = 16 << 20  # a YAML file is at most yamlfile.YAML_MAX_BYTES; its aliases can make more
DATA = Store("matrix-data", DATA_KEPT, DATA_MAX_BYTES, suffix=".json")


def _data_file(key: str) -> Path | None:
    """The kept data of the matrix `key` (validation_key) names, under files/yamlfile.py's YAML reader as
    it is now (its source is in the file's name)."""
    return DATA.file(key)


def kept_data(key: str) -> dict[str, Any] | None:
    """The data the matrix `key` names parsed to, kept by an earlier load; None when there is none
    or it is odd (then the YAML is parsed). Read bounded, never through a link."""
    text = DATA.get(key)
    try:
        data = json.loads(text) if text is not None else None
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _as_json(data: Any) -> str | None:
    """`data` as JSON text, if JSON holds it exactly (YAML can say more: dates, non-string keys)."""
    try:
        text = json.dumps(data)
    except (TypeError, ValueError, RecursionError):
        return None
    return text if json.loads(text) == data else None


def keep_data(key: str, text: str) -> None:
    """Keep what a matrix that loaded parsed to (its JSON text); never fatal."""
    DATA.put(key, text)


def _build(path: Path, data: dict[str, Any], loc: _Located, problems: list[Problem]) -> Matrix | None:
    """Semantic checks and expansion; the data already matches the schema. The problems come in
    this order: the axes and their include/exclude (expand.py), the file-wide settings, then each
    cell (its base image: bases.py; its packages, platform and installer), then the tags."""

    def problem(keypath: tuple[Any, ...], message: str) -> None:
        problems.append(Problem(loc.line(keypath), _keypath(keypath), message))

    combos = expand.expand(data["matrix"], problem)
    if not combos and not problems:
        problem(("matrix",), "no cell is left after exclude")
        return None
    pip, conda, certs = _settings(data, path.parent, problem)
    if len(combos) > MAX_CELLS:
        problem(("matrix",), f"{len(combos)} cells, more than {MAX_CELLS}; split the matrix file")
        return None
    cells, sources = _cells(combos, data, pip, conda, problem)
    tagged = _tags(data, cells, sources, problem)
    compression = _compression(data, problem)
    if problems:
        return None
    return Matrix(path=path, image=data["image"], pip=pip, conda=conda, ca_certificates=tuple(certs),
                  **tagged, **compression)


def _compression(data: dict[str, Any], problem) -> dict[str, Any]:
    """The Matrix fields of `compression` and `tags.compression`: each registry named there is
    image's or one under tags.registries (a setting for a registry nothing is pushed to is a typo)."""
    tags_cfg = data.get("tags", {})
    allowed = registries.allowed(data["image"], tuple(tags_cfg.get("registries", [])))
    per = {refs.normal_registry(r): how for r, how in tags_cfg.get("compression", {}).items()}
    for registry, given in zip(per, tags_cfg.get("compression", {})):
        if registry not in allowed:
            problem(("tags", "compression", given),
                    f"{given!r} is not a registry this matrix pushes to (allowed: {', '.join(allowed)})")
    return {"compression": data.get("compression", "gzip"), "registry_compression": tuple(sorted(per.items()))}


def _budget(combo: dict[str, Any], data: dict[str, Any], where: tuple[Any, ...], problem) -> int | None:
    """The cell's size budget in bytes (its include entry's, else the file's); None without one."""
    if "size_budget" in combo:
        value, keypath = combo["size_budget"], where + ("size_budget",)
    elif "size_budget" in data:
        value, keypath = data["size_budget"], ("size_budget",)
    else:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        problem(keypath, str(e))
        return None


def _settings(data: dict[str, Any], base_dir: Path, problem) -> tuple[PipSettings, CondaSettings, list[Path]]:
    """The file-wide settings, checked: pip, conda, the CA certificates, env, plain-HTTP indexes
    and labels."""
    pip = _pip_settings(data.get("pip", {}), base_dir, problem)
    conda = _conda_settings(data.get("conda", {}), problem)
    certs = _certificates(data.get("ca_certificates", []), base_dir, problem)
    _check_env(data, problem)
    _check_plain_http(data, problem)
    _check_labels(data.get("labels", {}), problem)
    return pip, conda, certs


def _check_labels(labels: dict[str, str], problem) -> None:
    for name, value in labels.items():
        if INVISIBLE_LETTERS & set(value):
            problem(("labels", name), f"the value holds {codepoints(''.join(INVISIBLE_LETTERS & set(value)))}, "
                                      f"a letter that shows as nothing; remove it")
        if name == RESERVED_LABEL_PREFIX or name.startswith(RESERVED_LABEL_PREFIX + "."):
            problem(("labels", name), f"labels under {RESERVED_LABEL_PREFIX}. are set by imagefactory "
                                      f"(the checks and the cache read them); choose another name")


def _cells(combos: list[dict[str, Any]], data: dict[str, Any], pip: PipSettings, conda: CondaSettings,
           problem) -> tuple[list[Cell], list[tuple[Any, ...]]]:
    """One Cell per combination, each checked by the per-cell rules (its id unique, its base
    image, its packages, its platform, then what its installer needs); with each cell's key path
    (_cell_source)."""
    axes_spec = data["matrix"]
    base_images = {**DEFAULT_BASE_IMAGES, **data.get("base_images", {})}
    cells: list[Cell] = []
    sources: list[tuple[Any, ...]] = []
    seen: set[str] = set()
    for combo in combos:
        where = _cell_source(combo, axes_spec)
        cell = replace(_cell(combo, data, bases.resolve(combo, base_images, data.get("base_registry"))),
                       size_budget=_budget(combo, data, where, problem))
        if cell.id in seen:
            problem(where, f"cell {cell.id} is defined twice")
            continue
        seen.add(cell.id)
        bases.check(cell, combo, base_images, where, problem)
        _check_packages(cell, combo, where, problem)
        if _check_platform(cell, conda, _platform_source(combo, axes_spec, where), problem):
            _check_cell(cell, pip, conda, where, problem)
        cells.append(cell)
        sources.append(where)
    return cells, sources


def _cell(combo: dict[str, Any], data: dict[str, Any], base: str) -> Cell:
    """The cell of one combination: its own keys first, then the file's, then the defaults."""
    env = {**data.get("env", {}), **combo.get("env", {})}
    user = data.get("user", {})
    return Cell(
        python=combo["python"], cuda=None if combo["cuda"] == "none" else combo["cuda"], blas=combo["blas"],
        installer=combo["installer"], variant=combo["variant"], platform=platforms.get(combo["platform"]),
        torch=combo.get("torch", data["torch"]), numpy=combo.get("numpy", data.get("numpy")),
        threads=combo.get("threads", data.get("threads", DEFAULT_THREADS)),
        compiler=combo.get("compiler", data.get("compiler", True)),
        base_image=base,
        packages=tuple(data.get("packages", [])) + tuple(combo.get("packages", [])),
        env=tuple(sorted(env.items())),
        labels=tuple(sorted(data.get("labels", {}).items())),
        user=user.get("name", "trainer"), uid=user.get("uid", 1000),
    )


def _tags(data: dict[str, Any], cells: list[Cell], sources: list[tuple[Any, ...]], problem) -> dict[str, Any]:
    """The Matrix fields of the tags: the cells with their tags, the templates, the registries and
    the lists, resolved and checked (tags.py)."""
    tags_cfg = data.get("tags", {})
    image = data["image"]
    tag_template = tags_cfg.get("template", Matrix.tag_template)
    hash_template = tags_cfg.get("hash_template", Matrix.hash_tag_template)
    allowed = registries.allowed(image, tuple(tags_cfg.get("registries", [])))
    for why in registries.credential_clashes(allowed):
        problem(("tags", "registries"), why)
    resolved, lists = _resolve_tags(cells, image, tag_template, hash_template, tags_cfg.get("extra", []), allowed,
                                    problem, sources=sources, set_keys=set(tags_cfg))
    return {"cells": tuple(resolved), "tag_template": tag_template, "hash_tag_template": hash_template,
            "extra_tags": tuple(tags_cfg.get("extra", [])), "registries": allowed[1:], "lists": lists}


def _resolve_tags(cells: list[Cell], image: str, template: str, hash_template: str, extra: list[str],
                  allowed: tuple[str, ...], problem, *, sources: list[tuple[Any, ...]] | None = None,
                  set_keys: set[str] | None = None) -> tuple[list[Cell], tuple[TagList, ...]]:
    """Each cell with its release tag (its per-arch tag when its release tag names a list of
    several platforms' images, tags.plan), and the lists; every tag a valid reference without a
    digest, on the registry of `image` or one under tags.registries (`allowed`), and no tag of a
    cell shared by another (one push would overwrite the other), reported naming both cells, at the
    template's line when the file sets it, else at the second cell's (`sources`: each cell's key
    path; `set_keys`: the keys under `tags` the file sets). Hash tags are checked with a distinct
    stand-in hash per cell."""
    given = {"template", "hash_template", "extra"} if set_keys is None else set_keys
    try:
        releases = [tags.release_tag(template, image, cell) for cell in cells]
        hashes = [tags.hash_tag(hash_template, image, cell, f"{n:012x}") for n, cell in enumerate(cells)]
    except tags.TagTemplateError as e:
        problem(("tags", e.key), str(e))
        return [], ()
    own, lists = tags.plan(list(zip(cells, releases)))
    resolved: list[Cell] = []
    owner: dict[str, tuple[str, str]] = {}
    for cell, listed, release, hashed in zip(cells, releases, own, hashes):
        named = [(release, "template"), (hashed, "hash_template")] + [
            (ref, "extra") for ref in tags.extra_tags(release, tuple(extra), git_sha="0" * 40)]
        bad = [(why, key) for ref, key in named + [(listed, "template")] if (why := tags.refusal(ref, allowed))]
        for why, key in dict.fromkeys(bad):
            problem(("tags", key), f"cell {cell.id}: {why}")
        if bad:
            return [], ()  # one cell shows the mistake; the others would repeat it
        for ref, key in dict.fromkeys(named):
            if ref in owner and owner[ref][0] != cell.id:
                at = ("tags", key) if key in given or sources is None else sources[len(resolved)]
                how = (f"add a field such as {{id}} to tags.{key}" if key in given else
                       f"the default tags.{key} cannot tell them apart: rename a variant, or set tags.{key} "
                       f"with a field such as {{id}}")
                problem(at, f"cells {owner[ref][0]} and {cell.id} would both be tagged {ref!r}, and one push "
                            f"would overwrite the other; {how}")
                return [], ()
            owner[ref] = (cell.id, key)
        resolved.append(replace(cell, tags=(release,)))
    return resolved, lists


def _env_blocks(data: dict[str, Any]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Every `env` mapping with its key path: the top level's and each include entry's."""
    blocks = [(("env",), data["env"])] if "env" in data else []
    return blocks + [(("matrix", "include", i, "env"), inc["env"]) for i, inc in
                     enumerate(data["matrix"].get("include", [])) if "env" in inc]


def _check_env(data: dict[str, Any], problem) -> None:
    """Names imagefactory sets, names that fight `threads`, and loader names not under env_allow."""
    allowed = set(data.get("env_allow", []))
    used = set()
    for keypath, block in _env_blocks(data):
        used |= set(block)
        for name in sorted(block):
            if name in MANAGED_ENV:
                problem(keypath + (name,), f"{name} is set by imagefactory "
                                           f"({'use threads' if 'THREADS' in name else 'from the cell'}), not by env")
            elif name in THREAD_ENV:
                problem(keypath + (name,), f"{name} would fight the thread counts `threads` bakes (and the "
                                           f"checks judge); set threads instead")
            elif name in LOADER_ENV and name not in allowed:
                problem(keypath + (name,), f"{name} makes every process in the image load code of its choosing; "
                                           f"if that is meant, list it under env_allow")
    for i, name in enumerate(data.get("env_allow", [])):
        if name not in LOADER_ENV:
            problem(("env_allow", i), f"{name!r} needs no allowing (allowed: {', '.join(sorted(LOADER_ENV))})")
        elif name not in used:
            problem(("env_allow", i), f"{name} is allowed but no env sets it; remove it")


def _check_plain_http(data: dict[str, Any], problem) -> None:
    """Plain-http indexes and channels only on loopback: pip ignores any other without
    --trusted-host, and a proxy on the way could change what it serves."""
    pip, conda = data.get("pip", {}), data.get("conda", {})
    urls: list[tuple[tuple[Any, ...], str]] = [(("pip", key), pip[key]) for key in ("index_url", "torch_index_url", "numpy_index_url")
            if isinstance(pip.get(key), str)]
    urls += [(("pip", "extra_index_urls", i), u) for i, u in enumerate(pip.get("extra_index_urls", []))]
    urls += [(("conda", "channels", i), u) for i, u in enumerate(conda.get("channels", []))]
    for keypath, url in urls:
        if url.lower().startswith("http://"):
            host = url[len("http://"):].split("/", 1)[0].rsplit("@", 1)[-1]
            host = host.split("]", 1)[0] + "]" if host.startswith("[") else host.split(":", 1)[0]  # no port
            if not LOOPBACK_HOSTS.fullmatch(host.lower()):
                problem(keypath, f"{url!r} is plain http off this machine: pip refuses it without "
                                 f"--trusted-host and anything on the way can change it; use https")


def odd_integers(data: Any, loc: _Located, path: tuple[Any, ...] = ()) -> list[Problem]:
    """Integers not written in plain decimal: YAML 1.1 reads 02000 as octal 1024, 0x10 as 16,
    1:20 as 80, 1_000 as 1000; a reader of the file would not."""
    found: list[Problem] = []
    if isinstance(data, dict):
        for key, value in data.items():
            found += odd_integers(value, loc, path + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += odd_integers(value, loc, path + (i,))
    elif isinstance(data, int) and not isinstance(data, bool):
        typed = loc.source(path)
        if typed is not None and not DECIMAL_RE.fullmatch(typed):
            found.append(Problem(loc.line(path), _keypath(path),
                                 f"{typed} is read by YAML 1.1 as {data}, not as written; write {data} "
                                 f"(plain decimal)"))
    return found


def codepoints(text: str) -> str:
    """The characters of `text` that are not plain ASCII, by code point and name (at most 3)."""
    odd = list(dict.fromkeys(c for c in text if not (" " < c < "\x7f")))
    named = [f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}" for c in odd[:3]]
    return ", ".join(named) + (f" and {len(odd) - 3} more" if len(odd) > 3 else "")


def _certificates(patterns: list[str], base_dir: Path, problem) -> list[Path]:
    """The CA certificate files, each a regular file holding certificates and no key."""
    certs: list[Path] = []
    if not patterns:
        return certs
    from imagefactory.config import cacerts  # only a matrix that names CA files reads them

    for i, rel in enumerate(patterns):
        try:
            certs += cacerts.ca_files(rel, base_dir)  # a glob lists one directory, at most 256 files
        except bounded.InputError as e:
            problem(("ca_certificates", i), str(e))
    return certs


def _cell_source(combo: dict[str, Any], spec: dict[str, Any]) -> tuple[Any, ...]:
    """The key path a cell's problems point at: its include entry if it has one, else matrix."""
    for i, inc in enumerate(spec.get("include", [])):
        if all(combo.get(k) == v for k, v in inc.items()):
            return ("matrix", "include", i)
    return ("matrix",)


def _platform_source(combo: dict[str, Any], spec: dict[str, Any], where: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key path that set a cell's platform: its include entry's key, the axis value, or `where`."""
    if where != ("matrix",):
        inc = spec["include"][where[2]]
        return where + ("platform",) if "platform" in inc else where
    values = spec.get("platform", [])
    return ("matrix", "platform", values.index(combo["platform"])) if combo["platform"] in values else where


def _check_platform(cell: Cell, conda: CondaSettings, where: tuple[Any, ...], problem) -> bool:
    """What the cell's platform cannot have: MKL off x86_64, a conda installer without a digest.
    False (one problem said) when the other checks of the cell would only repeat it."""
    p = cell.platform
    if cell.blas == "mkl" and not p.mkl:
        problem(where, f"cell {cell.id}: blas mkl does not exist for {p.oci} (Intel's MKL is x86_64 only: no "
                       f"mkl wheel for {p.arch} on PyPI, no {p.conda_subdir} mkl on conda-forge); use blas "
                       f"openblas, or exclude {{platform: {p.oci}, blas: mkl}}")
        return False
    if cell.installer == "conda" and conda.installer(p) is None:
        problem(where, f"cell {cell.id}: no {conda.distribution} installer digest is known for {p.oci}; set "
                       f"conda.installers.{p.oci}.sha256 (the {p.arch} installer's, from its .sha256 file)")
        return False
    return True


def _check_cell(cell: Cell, pip: PipSettings, conda: CondaSettings, where, problem) -> None:
    """Combinations that validate field by field but cannot work."""
    if cell.installer == "pip" and cell.blas == "mkl" and pip.numpy_index_url is None:
        problem(where, f"cell {cell.id}: PyPI's NumPy is linked to OpenBLAS only, so a pip cell cannot "
                       f"have blas: mkl without pip.numpy_index_url (an index serving MKL NumPy, "
                       f"e.g. Intel's); use installer conda or blas openblas")
    if (cell.installer == "pip" and cell.cuda is None and pip.torch_index_url is None and not _wheels(pip, cell, "+cpu")
            and not availability.pypi_serves_cpu(cell.torch, cell.python, cell.platform)):
        on = "" if cell.platform == platforms.DEFAULT else f" {cell.torch} for {cell.platform.oci}"
        problem(where, f"cell {cell.id}: PyPI serves no CPU-only torch{on} and pip.torch_index_url is null; "
                       f"put torch-{cell.torch}+cpu-*.whl in pip.wheelhouse or set pip.torch_index_url")
    elif cell.installer == "pip":
        route = "pypi" if pip.torch_index_url is None else "index"
        local = "+cpu" if cell.cuda is None else ("" if route == "pypi" else f"+cu{cell.cuda.replace('.', '')}")
        why = None if _wheels(pip, cell, local, python=True) else availability.pip_problem(
            cell.torch, cell.cuda, cell.python, route, platform=cell.platform)
        if why:
            hint = "set pip.torch_index_url, " if route == "pypi" and cell.cuda else ""
            problem(where, f"cell {cell.id}: {why} ({hint}or put the wheel in pip.wheelhouse; "
                           f"see {availability.PIP_DATA_FILE.removeprefix('imagefactory/')})")
    if cell.installer == "conda":
        why = availability.conda_problem(cell.torch, cell.cuda, cell.python, cell.blas, platform=cell.platform)
        if why:
            problem(where, f"cell {cell.id}: {why}")


def _wheels(pip: PipSettings, cell: Cell, local: str, *, python: bool = False) -> list[Path]:
    """The cell's torch wheels in the wheelhouse (`local`: "+cpu", "+cu130" or ""), for its Python
    when `python`."""
    if pip.wheelhouse is None:
        return []
    tag = f"cp{cell.python.replace('.', '')}-" if python else ""
    version = cell.torch if cell.torch.count(".") == 2 else f"{cell.torch}.*"
    arch = "" if cell.platform == platforms.DEFAULT else f"_{cell.platform.arch}.whl"  # another arch's wheels: not its
    return [w for w in pip.wheelhouse.glob(f"torch-{version}{local}-{tag}*.whl")
            if (local or "+" not in w.name) and w.name.endswith(arch)]


def _check_packages(cell: Cell, combo: dict[str, Any], where: tuple[Any, ...], problem) -> None:
    """Each extra package is a valid spec for the installer of the cell it goes into."""
    if not cell.packages:  # nothing to check, and no packaging import (a cell without packages)
        return
    from packaging.requirements import InvalidRequirement, Requirement

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
                return
        elif not CONDA_SPEC_RE.fullmatch(spec):
            problem(keypath, f"cell {cell.id}: {spec!r} is not a conda package spec "
                             f"(name, then =, ==, >=, <=, !=, ~=, > or < and a version), e.g. scipy>=1.11")
            return
    else:  # every spec parses: one package pinned twice cannot install
        why = _pins_conflict(list(dict.fromkeys(cell.packages)), cell.installer)
        if why:
            problem(where + ("packages",) if own else ("packages",), f"cell {cell.id}: {why}; keep one")


def _pins_conflict(specs: list[str], installer: str) -> str | None:
    """Why two specs of one package in a cell cannot both hold (scipy==1.11.0 and scipy==1.13.0,
    or scipy==1.11.0 and scipy>=1.13), or None. A pin is a version the install must be; it must meet
    every other spec of its package. Ranges alone are left to the installer."""
    from packaging.requirements import Requirement

    by_name: dict[str, list[str]] = {}
    for spec in specs:
        name = (Requirement(spec).name if installer == "pip" else re.split(r"[=<>!~]", spec, maxsplit=1)[0])
        by_name.setdefault(re.sub(r"[-_.]+", "-", name).lower(), []).append(spec)
    for name, given in by_name.items():
        if len(given) > 1 and not _pins_meet(given, installer):
            return f"{given[0]!r} and {given[1]!r} pin {name} to versions no install can satisfy at once"
    return None


def _pins_meet(specs: list[str], installer: str) -> bool:
    if installer == "pip":
        from packaging.requirements import Requirement

        sets = [Requirement(s).specifier for s in specs]
        pins = [sp.version for ss in sets for sp in ss if sp.operator in ("==", "===") and "*" not in sp.version]
        return all(ss.contains(pin, prereleases=True) for pin in pins for ss in sets)
    exact = {m for s in specs for m in re.findall(r"(?:^|,)[A-Za-z0-9._-]*==([^,]+)", s)}
    fuzzy = {m for s in specs for m in re.findall(r"(?:^|[,A-Za-z0-9_-])=([^=,][^,]*)", s)}
    if len(exact) > 1:
        return False
    return all(v == f or v.startswith(f + ".") for v in exact for f in fuzzy) and all(
        a.startswith(b + ".") or b.startswith(a + ".") or a == b for a in fuzzy for b in fuzzy)


def _pip_settings(cfg: dict[str, Any], base_dir: Path, problem) -> PipSettings:
    wheelhouse = None
    if "wheelhouse" in cfg:
        wheelhouse = base_dir / cfg["wheelhouse"]
        try:
            wheelhouse = bounded.resolved(wheelhouse)  # a link loop is an InputError, not a RuntimeError
            from imagefactory.files import wheelfiles  # only a matrix with a wheelhouse lists its files

            refused = wheelfiles.wheelhouse_files(wheelhouse)[1] if wheelhouse.is_dir() else None
        except bounded.InputError as e:
            problem(("pip", "wheelhouse"), str(e))
            return PipSettings()
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
        installers=tuple((oci, InstallerPin(pin["sha256"], pin.get("url")))
                         for oci, pin in sorted(cfg.get("installers", {}).items())),
    )

