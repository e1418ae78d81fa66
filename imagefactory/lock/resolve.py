"""Step 3 (lock/): cells -> lock files (locks/<cell-id>.txt next to the matrix), resolved on the host.

The resolver is the route's own installer, asked for a plan instead of an install:

* pip, where this host is the target (an amd64 cell, this machine amd64, this interpreter the
  cell's Python X.Y): `pip install --dry-run --report` for the cell's target (`--python-version`,
  `--platform`, `--only-binary :all:`), with no pip configuration but the matrix's indexes;
  every file gets its sha256 (from the index, or hashed here for wheelhouse files).
* pip, for any other target: pip evaluates environment markers against the running interpreter
  whatever `--platform`/`--python-version` say, so `uv pip compile --python-platform
  --python-version` resolves (markers judged for the target), and pip, given uv's pins and
  hashes with `--no-deps --require-hashes`, picks the one file of each that the image's pip
  installs (the same tags, the same indexes).
* conda: py-rattler's solver (condasolve.py, no conda on this machine) for the cell's conda
  subdir (platforms.py: linux-64, linux-aarch64) with the
  cell's channels and their netrc logins, BLAS pin, cuda-version and a `__cuda` virtual package
  for the cell's CUDA; every package gets its URL and sha256 from the channel's repodata.

`lock` writes missing and stale locks and leaves current ones alone; `--upgrade` resolves
again (every package, or only the named ones, the rest held at their locked versions);
`--check` resolves nothing and reports missing or stale locks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from imagefactory.files import fsutil
from imagefactory.files import bounded
from imagefactory import terminal
from imagefactory.files import yamlfile
from imagefactory.lock import lockfile
from imagefactory.config import platforms
from imagefactory.config import recipe
from imagefactory.errors import ConfigError, ImageFactoryError, LocksMissing
from imagefactory.lock.lockfile import Lock
from imagefactory.config.model import Cell, Matrix

# pip settings that only say how to reach the network; every other PIP_* (and every pip
# configuration file) is left out, so the host's pip setup cannot change what is locked.
_PIP_ENV_KEEP = ("PIP_CERT", "PIP_CLIENT_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES", "PIP_PROXY")
# uv settings that only say how to reach the network or where its cache is; every other UV_*
# (an index, a constraint, a torch backend) is left out, and so is every uv.toml (UV_NO_CONFIG).
_UV_ENV_KEEP = ("UV_CACHE_DIR", "UV_HTTP_TIMEOUT", "UV_HTTP_RETRIES", "UV_NATIVE_TLS", "UV_CONCURRENT_DOWNLOADS")
RESOLVE_TIMEOUT = 900.0  # seconds for one resolver run (uv, or pip picking files); a torch lock takes < 1 min
# A requirement written to the file uv reads: PEP 508 (matrix.py parsed it) and nothing a
# requirements file would read as an option (" -", a leading "-") or a comment ("#").
_REQUIREMENT_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._\[\],<>=!~*;:'\"()@/+-]| (?![-#]))*")
_TOOL_VERSION_RE = re.compile(r"[0-9]+(?:\.[0-9]+){1,3}(?:[a-z0-9.+-]{0,20})")
UNCHANGED, WRITTEN, UPGRADED = "unchanged", "written", "upgraded"
MISSING, STALE, CURRENT = "missing", "stale", "current"


class ResolveError(ImageFactoryError):
    """The resolver could not find a set of packages for a cell (exit 1)."""


@dataclass(frozen=True)
class Options:
    upgrade: bool = False
    packages: tuple[str, ...] = ()  # with upgrade: only these may move
    check: bool = False
    netrc: Path | None = None  # conda channels' logins (pip reads its own netrc)


@dataclass
class Outcome:
    cell: str
    path: Path
    status: str  # unchanged | written | upgraded (lock) ; missing | stale | current (--check)
    changes: list[str] = field(default_factory=list)  # "numpy 2.3.1 -> 2.3.2", "+ scipy 1.16.0"
    problems: list[str] = field(default_factory=list)  # --check: why stale


Resolver = Callable[[Matrix, Cell, dict[str, str]], tuple[str, str]]  # (matrix, cell, held) -> (body, resolver)


# --------------------------------------------------------------------------- pip

def _pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in _PIP_ENV_KEEP}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip reads no configuration file at all
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def pip_command(matrix: Matrix, cell: Cell, report: Path, target: Path, constraints: Path | None) -> list[str]:
    cmd = _pip_target(matrix, cell, report, target)
    if constraints is not None:
        cmd += ["--constraint", str(constraints)]
    return cmd + [recipe.torch_requirement(matrix, cell)[0], *recipe.pip_requirements(cell)]


def pick_command(matrix: Matrix, cell: Cell, report: Path, target: Path, pinned: Path) -> list[str]:
    """pip choosing, for each of uv's pins (no markers, every file's hash), the one file the image's
    pip installs: the same target tags and indexes, nothing resolved (`--no-deps`)."""
    return _pip_target(matrix, cell, report, target) + ["--no-deps", "--require-hashes", "-r", str(pinned)]


def _pip_target(matrix: Matrix, cell: Cell, report: Path, target: Path) -> list[str]:
    first, extra = lockfile.pip_sources(matrix, cell)
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
           # pip before 23.3 takes --platform only with --target; --dry-run installs nothing there.
           "--target", str(target), "--ignore-installed",
           "--python-version", cell.python, "--implementation", "cp",
           "--abi", "cp" + cell.python.replace(".", ""), "--only-binary", ":all:"]
    for platform in cell.platform.glibc_platforms:
        cmd += ["--platform", platform]
    cmd += ["--index-url", first or lockfile.PYPI]
    for url in extra:
        cmd += ["--extra-index-url", url]
    if matrix.pip.wheelhouse:
        cmd += ["--find-links", str(matrix.pip.wheelhouse)]
    return cmd


def _file_sha256(url: str, wheelhouse: Path | None) -> str:
    """sha256 of a wheelhouse file pip reported without a hash; only wheelhouse files qualify."""
    path = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path)).resolve()
    if wheelhouse is None or not path.is_relative_to(wheelhouse.resolve()) or not path.is_file():
        raise ResolveError(f"pip reported {url} without a sha256, and it is not a wheelhouse file")
    return fsutil.sha256_file(path)


def pins_from_report(report: dict, wheelhouse: Path | None, cell_id: str) -> list[tuple[str, str, str]]:
    """(canonical name, version, sha256) for every file in a pip installation report."""
    out = []
    for item in report.get("install", []):
        name, version = str(item["metadata"]["name"]), str(item["metadata"]["version"])
        if not lockfile.NAME_RE.fullmatch(name) or not lockfile.VERSION_RE.fullmatch(version):
            raise ResolveError(f"cell {cell_id}: pip reported an odd package {name!r} {version!r}")
        info = item.get("download_info", {})
        sha = ((info.get("archive_info") or {}).get("hashes") or {}).get("sha256")
        if not sha:
            sha = _file_sha256(info.get("url", ""), wheelhouse)
        if not lockfile.SHA256_RE.fullmatch(sha):
            raise ResolveError(f"cell {cell_id}: pip reported a malformed sha256 for {name}: {sha!r}")
        out.append((lockfile.canonical(name), version, sha))
    return sorted(out)


def host_is_target(cell: Cell, machine: str | None = None, python: str | None = None) -> bool:
    """Whether pip's own resolver judges this cell's environment markers right: pip evaluates them
    against the running interpreter (its machine, its Python X.Y), whatever `--platform` and
    `--python-version` say (an aarch64 torch 2.10 locked on x86_64 took 27 packages, CUDA 12
    among them, for the 9 it installs; a py3.12 torch locked by a 3.11 pip lacks setuptools)."""
    here = python or "{}.{}".format(*sys.version_info[:2])
    return platforms.native(machine) == cell.platform and cell.python == here


def resolve_pip(matrix: Matrix, cell: Cell, held: dict[str, str]) -> tuple[str, str]:
    """The body of a pip lock (requirements with hashes) and the resolver that made it: pip's
    own where this host is the target, uv's target-aware resolver otherwise."""
    if not host_is_target(cell):
        return resolve_uv(matrix, cell, held)
    with tempfile.TemporaryDirectory(prefix="imagefactory-lock-") as tmp:
        report, constraints = Path(tmp) / "report.json", _constraints(Path(tmp), held)
        cmd = pip_command(matrix, cell, report, Path(tmp) / "target", constraints)
        _run(cmd, _pip_env(), cell, "pip", held)
        data = json.loads(report.read_text())
    pins = pins_from_report(data, matrix.pip.wheelhouse, cell.id)
    return _body(pins), f"pip {_pip_version()} (install --dry-run --report)"


def _body(pins: list[tuple[str, str, str]]) -> str:
    return "".join(f"{n}=={v} \\\n    --hash=sha256:{h}\n" for n, v, h in pins)


def _constraints(folder: Path, held: dict[str, str]) -> Path | None:
    """`lock --upgrade PKG`: every other package held at its locked version."""
    if not held:
        return None
    path = folder / "constraints.txt"
    path.write_text("".join(f"{n}=={v}\n" for n, v in sorted(held.items())))
    return path


def _run(cmd: list[str], env: dict[str, str], cell: Cell, tool: str, held: dict[str, str]) -> None:
    """Run one resolver, bounded in time; its failure is one escaped, bounded line naming the cell."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, timeout=RESOLVE_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ResolveError(f"cell {cell.id}: {tool} did not finish within {RESOLVE_TIMEOUT:.0f} s; "
                           f"nothing was locked") from None
    except OSError as e:
        raise ResolveError(terminal.printable(f"cell {cell.id}: {tool} could not start: {e}")) from None
    if r.returncode != 0:
        tail = " | ".join(line.strip() for line in r.stderr.strip().splitlines()[-6:] if line.strip())
        held_note = (f" (holding {len(held)} package(s) at their locked versions; "
                     f"`lock --upgrade` with no package moves them all)") if held else ""
        raise ResolveError(terminal.printable(f"cell {cell.id}: {tool} could not resolve{held_note}: {tail}"))


def _tool_version(cmd: list[str], env: dict[str, str]) -> str:
    """`pip --version` / `uv --version`: the second word, if it is a version at all."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    words = out.split()
    return words[1] if len(words) > 1 and _TOOL_VERSION_RE.fullmatch(words[1]) else "?"


def _pip_version() -> str:
    return _tool_version([sys.executable, "-m", "pip", "--version"], _pip_env())


# --------------------------------------------------------------------------- uv (another target)

def _uv_env() -> dict[str, str]:
    env = {k: v for k, v in _pip_env().items() if not k.startswith("UV_") or k in _UV_ENV_KEEP}
    env["UV_NO_CONFIG"] = "1"  # no uv.toml, no pyproject.toml [tool.uv] (and --no-config below)
    env["UV_PYTHON_DOWNLOADS"] = "never"
    if "PIP_CERT" in env and "SSL_CERT_FILE" not in env:  # the CA bundle pip is told to trust
        env["SSL_CERT_FILE"] = env["PIP_CERT"]
    return env


def _uv_binary(cell: Cell) -> str:
    try:
        import uv  # the PyPI package ships the binary; a dependency of imagefactory

        return str(uv.find_uv_bin())
    except (ImportError, FileNotFoundError) as e:
        raise ResolveError(terminal.printable(f"cell {cell.id}: locking for {cell.platform} Python {cell.python} "
                                            f"needs uv (`pip install uv`): {e}")) from None


def uv_command(uv: str, matrix: Matrix, cell: Cell, requirements: Path, out: Path,
               constraints: Path | None) -> list[str]:
    """uv's resolver, for the cell's platform and Python (markers judged for them), over the
    matrix's indexes only, each index as pip reads it (the best version of all of them)."""
    first, extra = lockfile.pip_sources(matrix, cell)
    cmd = [uv, "pip", "compile", "--no-config", "--no-python-downloads", "--quiet", "--no-header",
           "--no-annotate", "--generate-hashes", "--python-platform", cell.platform.uv_platform,
           "--python-version", cell.python, "--only-binary", ":all:",
           "--index-strategy", "unsafe-best-match", "--index-url", first or lockfile.PYPI]
    for url in extra:
        cmd += ["--extra-index-url", url]
    if matrix.pip.wheelhouse:
        cmd += ["--find-links", str(matrix.pip.wheelhouse)]
    if constraints is not None:
        cmd += ["--constraint", str(constraints)]
    return cmd + ["--output-file", str(out), str(requirements)]


def _requirements(matrix: Matrix, cell: Cell) -> str:
    """The file uv reads: each requirement checked whole, so none can be a requirements-file option."""
    wanted = [recipe.torch_requirement(matrix, cell)[0], *recipe.pip_requirements(cell)]
    for requirement in wanted:
        if not _REQUIREMENT_RE.fullmatch(requirement):
            raise ConfigError(terminal.printable(f"cell {cell.id}: requirement {terminal.show(requirement)} cannot be "
                                               f"locked: only a PEP 508 requirement on one line, no option"))
    return "".join(r + "\n" for r in wanted)


def uv_pins(text: str, cell: Cell) -> list[lockfile.Pin]:
    """uv's answer, every line of it a `name==version --hash=sha256:...` pin (all files' hashes)."""
    pins, other = lockfile.requirement_pins(text)
    if other:
        number, line = other[0]
        raise ResolveError(terminal.printable(f"cell {cell.id}: uv printed {len(other)} line(s) that are not "
                                            f"`name==version --hash=sha256:...`, first line {number}: "
                                            f"{terminal.show(line, 120)}"))
    if not pins:
        raise ResolveError(f"cell {cell.id}: uv resolved no package")
    return pins


def _uv_output(out: Path, folder: Path, cell: Cell) -> str:
    try:
        raw = bounded.read_within(out, folder, lockfile.LOCK_MAX_BYTES)
    except bounded.InputError as e:
        raise ResolveError(f"cell {cell.id}: uv's answer {e}") from None
    return (raw or b"").decode("utf-8", "replace")


def _agree(pins: list[tuple[str, str, str]], resolved: list[lockfile.Pin], cell: Cell) -> None:
    """pip picked one file of each of uv's pins, and nothing else."""
    from packaging.version import Version

    want = {p.name: p for p in resolved}
    for name, version, sha in pins:
        pin = want.pop(name, None)
        if pin is None or Version(pin.version) != Version(version) or sha not in pin.hashes:
            raise ResolveError(f"cell {cell.id}: pip picked {name} {version} (sha256 {sha[:12]}...), which uv's "
                               f"resolution does not have")
    if want:
        raise ResolveError(f"cell {cell.id}: pip found no file for {', '.join(sorted(want))} of uv's resolution")


def resolve_uv(matrix: Matrix, cell: Cell, held: dict[str, str]) -> tuple[str, str]:
    """uv resolves for the target; pip picks the file of each pin the image's pip will install."""
    uv = _uv_binary(cell)
    with tempfile.TemporaryDirectory(prefix="imagefactory-lock-") as tmp:
        folder = Path(tmp)
        (folder / "requirements.in").write_text(_requirements(matrix, cell))
        out, report = folder / "resolved.txt", folder / "report.json"
        _run(uv_command(uv, matrix, cell, folder / "requirements.in", out, _constraints(folder, held)),
             _uv_env(), cell, "uv", held)
        resolved = uv_pins(_uv_output(out, folder, cell), cell)
        (folder / "pinned.txt").write_text("".join(
            f"{p.name}=={p.version} " + " ".join(f"--hash=sha256:{h}" for h in p.hashes) + "\n" for p in resolved))
        _run(pick_command(matrix, cell, report, folder / "target", folder / "pinned.txt"), _pip_env(), cell, "pip", {})
        data = json.loads(report.read_text())
    pins = pins_from_report(data, matrix.pip.wheelhouse, cell.id)
    _agree(pins, resolved, cell)
    how = (f"uv {_tool_version([uv, '--version'], _uv_env())} (pip compile --python-platform "
           f"{cell.platform.uv_platform} --python-version {cell.python}), files picked by pip {_pip_version()} "
           f"(install --dry-run --report --no-deps)")
    return _body(pins), how


# --------------------------------------------------------------------------- conda

def resolve_conda(matrix: Matrix, cell: Cell, held: dict[str, str], netrc: Path | None = None) -> tuple[str, str]:
    """The body of a conda lock (`@EXPLICIT`, URL#sha256 lines), solved here with py-rattler: no
    conda on this machine. The cell's channels and BLAS pin, its platform's subdir, `__cuda` for its CUDA."""
    if held:
        raise ResolveError(f"cell {cell.id}: `--upgrade PKG` is for pip cells; conda cells move with "
                           f"`lock --upgrade` (a whole new solve)")
    from imagefactory.lock import condasolve

    channels = [lockfile.channel_url(c) for c in matrix.conda.channels]
    records = condasolve.solve(cell.id, channels, recipe.conda_specs(matrix, cell),
                               subdir=cell.platform.conda_subdir, arch=cell.platform.arch, cuda=cell.cuda, netrc=netrc)
    lines = []
    for r in records:
        line = f"{r.url}#{r.sha256}"
        if lockfile.conda_pin(line, 0) is None:
            raise ResolveError(f"cell {cell.id}: the channel lists {r.name} without a usable URL and sha256: "
                               f"{terminal.show(line, 120)}")
        lines.append(line + "\n")
    return "@EXPLICIT\n" + "".join(lines), f"py-rattler {_rattler_version()} (solve, {cell.platform.conda_subdir})"


def _rattler_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("py-rattler")
    except PackageNotFoundError:
        return "?"


def resolve(matrix: Matrix, cell: Cell, held: dict[str, str], netrc: Path | None = None) -> tuple[str, str]:
    if cell.installer == "pip":
        return resolve_pip(matrix, cell, held)
    return resolve_conda(matrix, cell, held, netrc)


# --------------------------------------------------------------------------- the step

def diff(old: dict[str, str], new: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            out.append(f"- {name} {old[name]}")
        elif name not in old:
            out.append(f"+ {name} {new[name]}")
        elif old[name] != new[name]:
            out.append(f"  {name} {old[name]} -> {new[name]}")
    return out


def _existing(matrix: Matrix, cell: Cell) -> tuple[Lock | None, list[str]]:
    """(the lock as written, why it no longer fits the cell); (None, []) when there is none."""
    path = lockfile.path_for(matrix, cell)
    text = lockfile.read(path)  # a FIFO or a link out of locks/ is an error here too, not "no lock"
    if text is None:
        return None, []
    lock = lockfile.parse(path, cell.installer, text)
    return lock, lockfile.stale(lock, matrix, cell)


def check(matrix: Matrix, cells: list[Cell]) -> list[Outcome]:
    """Resolve nothing: report each cell's lock as current, missing or stale."""
    outcomes = []
    for cell in cells:
        path = lockfile.path_for(matrix, cell)
        try:
            lock, problems = _existing(matrix, cell)
        except ConfigError as e:  # malformed: as bad as stale
            lock, problems = None, e.problems
        status = STALE if problems else (CURRENT if lock is not None else MISSING)
        outcomes.append(Outcome(cell.id, path, status, problems=yamlfile.capped(problems)))
    return outcomes


def check_exit(outcomes: list[Outcome]) -> None:
    """Raise what `lock --check` exits with: 2 for stale or malformed locks, 1 for missing ones."""
    stale = [p for o in outcomes for p in o.problems]
    missing = [o for o in outcomes if o.status == MISSING]
    if stale:
        raise ConfigError(yamlfile.capped(stale + [f"{lockfile.shown(o.path)}: cell {o.cell} has no lock"
                                                 for o in missing]))
    if missing:
        raise LocksMissing(f"{len(missing)} cell(s) have no lock: " + ", ".join(o.cell for o in missing)
                           + "; run `imagefactory lock`")


def _validate_packages(packages: tuple[str, ...], locks: dict[str, Lock | None]) -> None:
    problems = []
    known = {p.name for lock in locks.values() if lock is not None for p in lock.pins}
    for name in packages:
        if not lockfile.NAME_RE.fullmatch(name):
            problems.append(f"--upgrade {name!r}: not a package name")
        elif lockfile.canonical(name) not in known:
            problems.append(f"--upgrade {name}: no selected cell locks {lockfile.canonical(name)}")
    if problems:
        raise ConfigError(problems)


def lock(matrix: Matrix, cells: list[Cell], options: Options, resolver: Resolver | None = None,
         say: Callable[[str], None] = print) -> list[Outcome]:
    """Write the locks `options` ask for; every lock is written only once all cells resolved."""
    if resolver is None:
        def resolver(m: Matrix, c: Cell, held: dict[str, str]) -> tuple[str, str]:
            return resolve(m, c, held, options.netrc)
    if options.packages and not options.upgrade:
        raise ConfigError("package names are given with --upgrade (e.g. `lock --upgrade numpy`)")
    existing = {cell.id: _existing(matrix, cell) for cell in cells}
    _validate_packages(options.packages, {k: v[0] for k, v in existing.items()})
    wanted = {lockfile.canonical(p) for p in options.packages}
    planned: list[tuple[Cell, Outcome, str]] = []
    for cell in cells:
        old, problems = existing[cell.id]
        path = lockfile.path_for(matrix, cell)
        if old is not None and not problems and not options.upgrade:
            planned.append((cell, Outcome(cell.id, path, UNCHANGED), ""))
            continue
        before = {p.name: p.version for p in old.pins} if old is not None else {}
        held = {n: v for n, v in before.items() if n not in wanted} if wanted and not problems else {}
        say(f"{cell.id}: resolving ({'upgrade' if options.upgrade else 'stale' if problems else 'new'})")
        body, how = resolver(matrix, cell, held)
        head = lockfile.header(matrix, cell, how)
        pins = lockfile.parse(path, cell.installer, head + body).pins
        text = head + lockfile.resolution(pins) + body  # what completeness is judged against
        new = {p.name: p.version for p in pins}
        status = UPGRADED if old is not None else WRITTEN
        planned.append((cell, Outcome(cell.id, path, status, diff(before, new)), text))
    for cell, outcome, text in planned:
        if text:
            outcome.path.parent.mkdir(parents=True, exist_ok=True)
            fsutil.atomic_write(outcome.path, text)
            lockfile.load(matrix, cell)  # what was written must read back as a current lock
    return [o for _, o, _ in planned]

