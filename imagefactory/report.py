"""Step 6: the report. One JSON document for tools, one Markdown summary for people
(ready for a GitHub step summary)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from imagefactory import fsutil
from imagefactory.checks import Check, launches

# Cell states, in pipeline order.
BUILT, CACHED, BUILD_FAILED, PASSED, CHECK_FAILED, NOT_BUILT, SKIPPED = (
    "built", "cached", "build-failed", "passed", "check-failed", "not-built", "skipped")
INTERRUPTED = "interrupted"  # a SIGINT/SIGTERM stopped this cell's work (or its publish)
PUBLISHED, PUBLISH_FAILED, NOT_PUBLISHED = "published", "publish-failed", "not-published"


@dataclass
class CellReport:
    cell: str
    status: str = SKIPPED
    content_hash: str = ""
    image_id: str = ""
    candidate: str = ""
    cached: bool = False
    build_seconds: float = 0.0
    log: str = ""
    error: str = ""
    failed_step: str = ""
    log_tail: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    publish: str = ""  # published | publish-failed | not-published | "" (no push asked)
    pushed: list[dict] = field(default_factory=list)  # {"ref", "digest", "layers_pushed", "layers_existing"}
    base_image: str = ""  # the base as built: name:tag@sha256:... once resolved (freshness.py)
    base_digest: str = ""
    verdicts: str = ""  # probed | cached (an earlier pass of this very image, verdicts.py) | "" (not tested)
    verdicts_at: str = ""  # when the verdicts were made (UTC)
    pulled: str = ""  # name:tag@sha256:... when the image was pulled from the registry instead of built (regcache.py)
    builder: str = ""  # what built the image: buildkit | classic ("" when none was built this run)
    sbom: str = ""  # build/sbom/<cell>.cdx.json, written once the cell passed (supply.py)
    provenance: str = ""  # build/provenance/<cell>.intoto.json
    signing: str = ""  # signed | sign-failed | not-signed | "" (no --sign asked)
    signatures: list[dict] = field(default_factory=list)  # per pushed digest: .sig/.att tags and digests

    @property
    def launches(self) -> dict[str, str]:
        """{launch mode: "pass" | "fail"} (smoke.MODES), from the checks; {} when untested."""
        return launches(self.checks)

    @property
    def ok(self) -> bool:
        return self.status == PASSED and self.publish in ("", PUBLISHED)


def write(reports: list[CellReport], path: Path, *, gpus: bool) -> tuple[Path, Path]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "ok": all(r.ok for r in reports),
        "gpus": gpus,
        "cells": [{**asdict(r), "launches": r.launches} for r in reports],
    }
    fsutil.atomic_write(path, json.dumps(doc, indent=2) + "\n")
    md = path.with_suffix(".md")
    text = summary(reports)
    md.write_text(text)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a") as f:
            f.write(text)
    return path, md


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


_ICON = {"pass": "✅", "fail": "❌", "skip": "➖"}


def _named(c: Check) -> str:
    """A check as the summary names it: with its launch mode (`hpc: torch.compile`)."""
    return f"{c.mode}: {c.name}" if c.mode else c.name


def summary(reports: list[CellReport]) -> str:
    lines = ["# imagefactory report", "", "| cell | status | launches | publish | failed checks |",
             "|---|---|---|---|---|"]
    for r in reports:
        failed = ", ".join(_named(c) for c in r.checks if c.verdict == "fail") or ("—" if r.checks else "")
        status = r.status + (" (cached)" if r.cached and not r.pulled else "") + (
            " (pulled, not built)" if r.pulled else "") + (
            f" (verdicts cached from {r.verdicts_at})" if r.verdicts == CACHED else "")
        modes = " ".join(f"{m} {_ICON.get(v, v)}" for m, v in r.launches.items()) or "—"
        lines.append(f"| `{r.cell}` | {status} | {modes} | {r.publish or '—'} | {failed} |")
    for r in reports:
        lines += ["", f"## `{r.cell}`: {r.status}", ""]
        if r.builder:
            lines += [f"builder: {r.builder}", ""]
        if r.error:
            lines += [f"**{r.failed_step or 'error'}**: {r.error}", ""]
            if r.log_tail:
                lines += ["```", *r.log_tail, "```", ""]
        if r.launches:
            lines += ["Launch modes: " + ", ".join(f"{m} {_ICON.get(v, v)} {v}" for m, v in r.launches.items()), ""]
        if r.checks:
            lines += ["| mode | check | expected | actual | verdict |", "|---|---|---|---|---|"]
            for c in r.checks:
                actual = c.actual + (f" — {c.detail}" if c.detail else "")
                lines.append(f"| {c.mode or '—'} | {c.name} | {_cell(c.expected)} | {_cell(actual)} | "
                             f"{_ICON.get(c.verdict, c.verdict)} {c.verdict} |")
        for p in r.pushed:
            lines.append(f"- pushed `{p['ref']}` → `{p['digest']}`"
                         + ("" if p.get("layers_pushed") else " (registry had every layer)"))
    return "\n".join(lines) + "\n"
