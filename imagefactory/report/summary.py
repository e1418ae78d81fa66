"""Step 12 (report/): the report. One JSON document for tools, one Markdown summary for people
(ready for a GitHub step summary), and the image catalogue page (catalog.py)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from imagefactory.files import fsutil
from imagefactory.probe.checks import Check

from imagefactory.run.results import CACHED, PUBLISHED, CellReport, ListReport, size_facts


def write(reports: list[CellReport], path: Path, *, gpus: bool,
          lists: Sequence[ListReport] = ()) -> tuple[Path, Path]:
    """report.json, the Markdown summary beside it (.md, also appended to GITHUB_STEP_SUMMARY),
    and the image catalogue beside both (.html, catalog.py). `lists`: the lists publishing merged
    or refused (publish/lists.py), under the key "lists" (added beside "cells", nothing changed)."""
    from imagefactory.report import catalog

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "ok": all(r.ok for r in reports) and all(lr.ok for lr in lists),
        "gpus": gpus,
        "cells": [{**asdict(r), "launches": r.launches} for r in reports],
        "lists": [asdict(lr) for lr in lists],
    }
    fsutil.atomic_write(path, json.dumps(doc, indent=2) + "\n")
    md = path.with_suffix(".md")
    text = summary(reports, lists)
    md.write_text(text)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a") as f:
            f.write(text)
    catalog.write(reports, path)
    return path, md


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: no `|` ends the cell, no newline ends the row, and
    no `<` opens HTML (GitHub renders raw HTML in a step summary)."""
    return (str(text).replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;")
            .replace("\r", " ").replace("\n", " "))


def _code(text: str) -> str:
    """Text as one code span in a table cell (a backtick inside cannot close it early)."""
    body = str(text).replace("\r", " ").replace("\n", " ").replace("|", "\\|")
    fence = "``" if "`" in body else "`"
    return f"{fence} {body} {fence}" if fence == "``" else f"`{body}`"


_ICON = {"pass": "✅", "fail": "❌", "skip": "➖", "info": "ℹ️", "not-judged": "❔"}
_ORDER = {"fail": 0, "pass": 1, "skip": 1, "info": 2, "not-judged": 2}  # failing checks first, information last
_ALONE = "all"  # the column of checks judged alone, not per launch mode
_LEGEND = ("✅ pass · ❌ fail · ➖ skipped · ℹ️ information{}, per launch mode. A check's value is shown "
           "once; a mode shows its own value only where it saw another.")
_LEGEND_EMULATED = " · ❔ not judged (a speed measured under emulation, binfmt/QEMU)"  # only where a cell ran so


def _legend(reports: list[CellReport]) -> str:
    emulated = any(c.verdict == "not-judged" for r in reports for c in r.checks)
    return _LEGEND.format(_LEGEND_EMULATED if emulated else "")


def _modes(reports: list[CellReport]) -> list[str]:
    """Every launch mode the checks name, in the order first seen (the report's columns)."""
    seen: dict[str, None] = {}
    for r in reports:
        for c in r.checks:
            seen.setdefault(c.mode or _ALONE, None)
    return list(seen)


def _rows(checks: list[Check]) -> list[dict[str, Check]]:
    """The checks grouped by name ({mode: check} per name), failing first, information last."""
    groups: dict[str, dict[str, Check]] = {}
    for c in checks:
        groups.setdefault(c.name, {})[c.mode or _ALONE] = c
    worst = {name: min(_ORDER.get(c.verdict, 1) for c in g.values()) for name, g in groups.items()}
    return sorted(groups.values(), key=lambda g: worst[next(iter(g.values())).name])


def _failing(r: CellReport) -> str:
    """`torch.compile (hpc)`: each failing check once, with the modes it failed in."""
    failed: dict[str, list[str]] = {}
    for c in r.checks:
        if c.verdict == "fail":
            failed.setdefault(c.name, []).append(c.mode)
    return ", ".join(f"`{name}`" + (f" ({', '.join(m for m in modes if m)})" if any(modes) else "")
                     for name, modes in failed.items())


def _status(r: CellReport) -> str:
    return r.status + (" (emulated)" if r.emulated else "") + (" (cached)" if r.cached and not r.pulled else "") + (
        " (pulled, not built)" if r.pulled else "") + (
        f" (verdicts cached from {_cell(r.verdicts_at)})" if r.verdicts == CACHED else "")


def _overview(reports: list[CellReport], modes: list[str]) -> list[str]:
    """One row per cell: its status, a verdict per launch mode, publish, the failing checks."""
    lines = ["| cell | status | " + " | ".join(modes + ["publish", "failing checks"]) + " |",
             "|---" * (len(modes) + 4) + "|"]
    for r in reports:
        launched = r.launches
        verdicts = [_ICON.get(launched.get(m, ""), "—") for m in modes]
        row = [_code(r.cell), _status(r), *verdicts, _cell(r.publish or "—"), _cell(_failing(r)) or ("—" if r.checks else "")]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _check_row(group: dict[str, Check], modes: list[str]) -> str:
    """One check: an icon per mode, the row's value once (the value most modes saw), a mode's own
    value only where it differs, and for a failure what was expected and the fix it names."""
    values = [group[m].actual for m in modes if m in group]
    common = max(values, key=values.count) if values else ""
    cells = []
    for m in modes:
        c = group.get(m)
        cells.append("—" if c is None else _ICON.get(c.verdict, _cell(c.verdict)) +
                     ("" if c.actual == common or not c.actual else " " + _cell(c.actual)))
    failed = [c for c in group.values() if c.verdict == "fail"]
    fixes = list(dict.fromkeys(c.detail for c in failed if c.detail))
    fix = (f"expected {_cell(failed[0].expected)}" + "".join(f"; {_cell(d)}" for d in fixes)) if failed else ""
    name = next(iter(group.values())).name
    return f"| {_cell(name)} | " + " | ".join(cells) + f" | {_cell(common)} | {fix} |"


def _checks_table(r: CellReport) -> list[str]:
    modes = _modes([r])
    lines = ["| check | " + " | ".join(modes) + " | value | fix |", "|---" * (len(modes) + 3) + "|"]
    return lines + [_check_row(g, modes) for g in _rows(r.checks)]


def _section(r: CellReport) -> list[str]:
    """A cell's details: builder, error and log tail, one row per check, what was pushed."""
    lines = [f"## {_code(r.cell)}: {r.status}", ""]
    if r.builder:
        lines += [f"builder: {_cell(r.builder)}", ""]
    if r.emulated:
        lines += [f"probed emulated: {_cell(r.emulated)}; its speed is not judged", ""]
    if r.error:
        lines += [f"**{_cell(r.failed_step or 'error')}**: {_cell(r.error)}", ""]
        if r.log_tail:
            fence = "````" if any("```" in line for line in r.log_tail) else "```"
            lines += [fence, *(line.replace("\r", " ") for line in r.log_tail), fence, ""]
    if r.checks:
        lines += [*_checks_table(r), ""]
    for p in r.pushed:
        lines.append(f"- pushed {_code(p['ref'])} → {_code(p['digest'])}"
                     + ("" if p.get("layers_pushed") else " (registry had every layer)"))
    facts = size_facts(r.sizes)
    return lines + ([""] if facts and lines[-1] else []) + [f"- {_cell(label)}: {_cell(text)}" for label, text in facts]


def _lists(lists: Sequence[ListReport]) -> list[str]:
    """One row per list: its tag, each member (cell, platform, digest), published or why not."""
    if not lists:
        return []
    lines = ["## Lists", "", "| list | members | publish | why not |", "|---|---|---|---|"]
    for lr in lists:
        members = " · ".join(f"{_code(m['cell'])} {_cell(m['platform'])} {_code(m['digest'][:19] or '—')}"
                              for m in lr.members)
        state = _cell(lr.publish) + (f" {_code(lr.digest[:19])}" if lr.publish == PUBLISHED else "")
        lines.append(f"| {_code(lr.ref)} | {members} | {state} | {_cell(lr.reason) or '—'} |")
    return lines + [""]


def summary(reports: list[CellReport], lists: Sequence[ListReport] = ()) -> str:
    """The Markdown summary (GitHub-flavoured, for a step summary): one overview row per cell,
    the lists, then per cell one row per check with a column per launch mode."""
    lines = ["# imagefactory report", "", _legend(reports), "", *_overview(reports, _modes(reports))]
    lines += ([""] + _lists(lists)) if lists else []
    for r in reports:
        lines += ([""] if lines[-1] else []) + _section(r)
    return "\n".join(lines).rstrip("\n") + "\n"
