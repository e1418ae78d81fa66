"""Step 9 (publish/): merge the lists from other jobs' reports (`imagefactory merge`). A team with native
arm64 runners builds each cell in a CI job of its own, on a runner of its platform
(`build --only CELL --push --report build/report-CELL.json`); one merge job then reads those
report.json files and publishes each list of the matrix, as jupyter/docker-stacks' merge job does.

A list is merged (publish_lists.publish_lists: the one merge and read-back) only when the reports
show, for every platform it declares, exactly one report of that member cell that passed and
pushed the per-arch tag this matrix plans for it, with a digest, and the same digest under the
cell's content-hash tag (the tag the matrix derives from the content hash the report names).
Anything else refuses that list with one line naming the cell: a missing report (a job that
failed before writing one, an artifact not downloaded), a member that failed, a report of another
matrix or content. The registry must still serve each member's digest under its per-arch tag.

Reports are CI artifacts, so they are read as hostile: regular files within a size cap, every
value used checked against a whole-string pattern (cell ids against the matrix, refs with
refs.parse, digests with DIGEST), and a file that fails is a ConfigError (exit 2) naming the file
and key, its value shown escaped and cut, before anything reaches the registry.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from imagefactory.engine import logins
from imagefactory.files import bounded
from imagefactory import terminal
from imagefactory.publish import lists as publish_lists
from imagefactory.config import refs
from imagefactory.config import tags
from imagefactory.run.results import (BUILD_FAILED, BUILT, CACHED, CHECK_FAILED, INTERRUPTED, NOT_BUILT, NOT_PUBLISHED,
                                     PASSED, PUBLISH_FAILED, PUBLISHED, SKIPPED, CellReport, ListReport)
from imagefactory.run.context import Publishing, RunContext
from imagefactory.errors import ConfigError
from imagefactory.config.model import Matrix

MAX_REPORT_BYTES = 8 * 1024 * 1024  # one cell's report.json (checks, log tail): far less in practice
MAX_FILES = 1000  # report files read at most
MAX_PUSHED = 256  # pushed entries of one cell
DIGEST = re.compile(r"sha256:[0-9a-f]{64}", re.ASCII)
CONTENT_HASH = re.compile(r"[0-9a-f]{64}", re.ASCII)
STATES = frozenset({BUILT, CACHED, BUILD_FAILED, PASSED, CHECK_FAILED, NOT_BUILT, SKIPPED, INTERRUPTED})
PUBLISH_STATES = frozenset({"", PUBLISHED, PUBLISH_FAILED, NOT_PUBLISHED, INTERRUPTED})

Found = dict[str, list[CellReport]]  # cell id -> the reports naming it (one, unless two jobs wrote one)


def report_files(paths: list[Path]) -> list[Path]:
    """The report files: each file given, and every *.json under each folder given (links to
    folders not followed), sorted; ConfigError for a path that is neither, or too many files."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            for root, dirs, files in os.walk(path):
                dirs.sort()
                found += [Path(root) / f for f in sorted(files) if f.endswith(".json")]
        elif path.exists():
            found.append(path)
        else:
            raise ConfigError(f"--reports {bounded.short(path)}: not found")
        if len(found) > MAX_FILES:
            raise ConfigError(f"--reports: more than {MAX_FILES} report files")
    return found


def _text(raw: dict, key: str, where: str, pattern: re.Pattern[str] | frozenset[str] | None = None) -> str:
    value = raw.get(key, "")
    ok = isinstance(value, str) and (pattern is None or (value in pattern if isinstance(pattern, frozenset)
                                                         else pattern.fullmatch(value) is not None))
    if not ok:
        raise ConfigError(f"{where}.{key}: {terminal.show(value)} is not a valid {key}")
    return value


def _pushed(raw: Any, where: str) -> list[dict]:
    """The pushed entries, each {"ref": a tagged reference, "digest": sha256:<64 hex>}."""
    if not isinstance(raw, list) or len(raw) > MAX_PUSHED:
        raise ConfigError(f"{where}.pushed: expected a list of at most {MAX_PUSHED} entries")
    out = []
    for i, p in enumerate(raw):
        if not isinstance(p, dict):
            raise ConfigError(f"{where}.pushed[{i}]: expected a mapping")
        ref, digest = p.get("ref"), p.get("digest")
        parsed = refs.parse(ref) if isinstance(ref, str) else None
        if parsed is None or parsed.tag is None or parsed.digest is not None:
            raise ConfigError(f"{where}.pushed[{i}].ref: {terminal.show(ref)} is not a tagged image reference")
        if not isinstance(digest, str) or DIGEST.fullmatch(digest) is None:
            raise ConfigError(f"{where}.pushed[{i}].digest: {terminal.show(digest)} is not a sha256 digest")
        out.append({"ref": ref, "digest": digest})
    return out


def _cell(raw: Any, where: str, ids: frozenset[str]) -> CellReport:
    """One cell of a report: only the values the merge uses, each checked."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    cell = raw.get("cell")
    if not isinstance(cell, str) or cell not in ids:
        raise ConfigError(f"{where}.cell: {terminal.show(cell)} is not a cell of the matrix (a report of another "
                          f"matrix?)")
    return CellReport(cell, status=_text(raw, "status", where, STATES),
                      content_hash=_text(raw, "content_hash", where, CONTENT_HASH) if raw.get("content_hash") else "",
                      publish=_text(raw, "publish", where, PUBLISH_STATES),
                      pushed=_pushed(raw.get("pushed", []), where))


def read(path: Path, matrix: Matrix) -> list[CellReport]:
    """The cells of one report file; ConfigError (one line: the file, the key, why) for anything else."""
    shown = bounded.short(path)
    try:
        doc = json.loads(bounded.read_regular(path, MAX_REPORT_BYTES))
    except bounded.InputError as e:
        raise ConfigError(f"{shown}: {e}") from None
    except (ValueError, RecursionError):  # JSON, UTF-8, or nesting deeper than the parser goes
        raise ConfigError(f"{shown}: not a JSON report") from None
    cells = doc.get("cells") if isinstance(doc, dict) else None
    if not isinstance(cells, list):
        raise ConfigError(f"{shown}: not a report (no \"cells\" list)")
    ids = frozenset(c.id for c in matrix.cells)
    try:
        return [_cell(c, f"cells[{i}]", ids) for i, c in enumerate(cells)]
    except ConfigError as e:
        raise ConfigError(f"{shown}: {e.message}") from None


def load(matrix: Matrix, paths: list[Path]) -> Found:
    """Every report of every file, by cell: all read and checked before anything is merged."""
    found: Found = {}
    for path in report_files(paths):
        for r in read(path, matrix):
            found.setdefault(r.cell, []).append(r)
    return found


def refusal(matrix: Matrix, lr: ListReport, found: Found) -> str:
    """Why the reports do not let `lr` be merged ("" when they do), naming each member."""
    why = [w for w in (_member_refusal(matrix, m, found.get(m["cell"], [])) for m in lr.members) if w]
    return ("not published: every platform's report must show it passed and pushed as planned; "
            + "; ".join(why)) if why else ""


def _member_refusal(matrix: Matrix, m: dict, reports: list[CellReport]) -> str:
    name = f"{m['cell']} ({m['platform']})"
    if len(reports) > 1:
        return f"{name}: {len(reports)} reports name it, not one"
    r = reports[0] if reports else None
    if r is not None and r.status == PASSED and r.publish == PUBLISHED and not m["digest"]:
        return f"{name}: its report pushed no {m['tag']}, the per-arch tag this matrix plans (another matrix's?)"
    why = publish_lists.member_blocked(m, r, absent="has no report (its job wrote none, or it was not downloaded)")
    if why or r is None:
        return why
    if not r.content_hash:
        return f"{name}: its report names no content hash"
    hash_tag = tags.hash_tag(matrix.hash_tag_template, matrix.image, matrix.cell(m["cell"]), r.content_hash)
    hashed = next((p["digest"] for p in r.pushed if p["ref"] == hash_tag), "")
    if hashed != m["digest"]:
        return (f"{name}: its report pushed {m['digest']} as {m['tag']} but {hashed or 'nothing'} as its "
                f"content-hash tag {hash_tag} (another content?)")
    return ""


def members(found: Found) -> list[CellReport]:
    """The one report of each cell, as the merge saw it (a cell two reports name: the first)."""
    return [rs[0] for rs in found.values()]


def merge(matrix: Matrix, found: Found, run: RunContext) -> list[ListReport]:
    """Each list of the matrix, merged (publish_lists) when `found` lets it, refused otherwise."""
    creds = logins.registry_credentials(matrix)
    lists = publish_lists.start(matrix, members(found), run.settings(Publishing))
    publish_lists.publish_lists(lists, run, lambda ref: logins.auth_for(ref, creds),
                                lambda text: logins.redact(text, creds), lambda lr: refusal(matrix, lr, found))
    return lists
