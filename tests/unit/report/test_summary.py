"""The Markdown summary reads at a glance, from tests/fixtures/report/report.json: two cells of a
real report, the second failing `torch.compile` in the `hpc` launch mode only."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from imagefactory.report import summary
from imagefactory.run import results

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "report"
GOOD, BAD = "py3.11-cpu-openblas-pip", "py3.12-cpu-openblas-pip"


def load(path: Path) -> list[results.CellReport]:
    """The cells of a report.json, as the pipeline had them before writing it."""
    known = {f.name for f in dataclasses.fields(results.CellReport)}
    return [results.CellReport(**{k: v for k, v in c.items() if k in known and k != "checks"},
                              checks=[summary.Check(**ch) for ch in c["checks"]])
            for c in json.loads(path.read_text())["cells"]]


@pytest.fixture
def reports() -> list[results.CellReport]:
    return load(FIXTURE / "report.json")


def section(md: str, cell: str) -> str:
    return md.split(f"\n## `{cell}`: ", 1)[1].split("\n## ", 1)[0]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first table in `text`, split into cells (`\\|` stays inside a cell)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in lines[2:]]


def test_one_row_per_check_failing_first_with_the_fix(reports):
    md = summary.summary(reports)
    rows = table_rows(section(md, BAD))
    names = [r[0] for r in rows]
    judged = {c.name for c in reports[1].checks}
    assert len(names) == len(set(names)) == len(judged)  # one row per check, not one per check and mode
    assert names[0] == "torch.compile"  # the one failing check comes first
    head = ["check", "docker", "bare", "hpc", "value", "fix"]
    assert [c.strip() for c in section(md, BAD).split("\n| ", 1)[1].split("|")[:6]] == ["check", *head[1:]]
    compile_row = dict(zip(head, rows[0]))
    assert compile_row["docker"].startswith("✅") and compile_row["hpc"].startswith("❌")
    assert "--tmpfs /tmp:exec" in compile_row["fix"] and "expected compiles and matches eager" in compile_row["fix"]
    # no other row names a fix, and the passing cell's table names none at all
    assert all(r[5] == "" for r in rows[1:])
    assert all(r[5] == "" for r in table_rows(section(md, GOOD)))


def test_information_rows_show_the_value_once_and_modes_only_where_they_differ(reports):
    rows = {r[0]: r for r in table_rows(section(summary.summary(reports), GOOD))}
    python = rows["python.version"]
    assert python[1:4] == ["✅", "✅", "✅"] and python[4] == "3.11"
    threads = rows["threads.numpy_blas"]  # 2 threads in docker and bare, 1 CPU in hpc
    assert threads[1:5] == ["✅", "✅", "✅ 1", "2"]
    info = rows["launch.conditions"]  # the same in docker and bare: shown once
    assert info[1] == info[2] == "ℹ️" and "info" not in " ".join(info[1:4])
    assert info[4].count("uid: 1000") == 1 and "uid: 4242" in info[3]


def test_the_overview_has_a_column_per_mode_and_names_failing_checks(reports):
    md = summary.summary(reports)
    assert "| cell | status | docker | bare | hpc | publish | failing checks |" in md
    assert f"| `{BAD}` | check-failed | ✅ | ✅ | ❌ | not-published | `torch.compile` (hpc) |" in md
    assert f"| `{GOOD}` | passed | ✅ | ✅ | ✅ | published | — |" in md
    assert "registry had every layer" in section(md, GOOD)


def test_the_summary_is_well_formed_markdown(reports):
    """Every table row has as many cells as its header, a blank line before every table and
    heading, and a hostile value cannot end a cell, a row or open HTML."""
    reports[1].checks[0] = summary.Check("probe.numpy", "imported", "a | b\nc <script>x</script>", "fail",
                                        "fix | it\r\n", mode="docker")
    md = summary.summary(reports)
    lines = md.splitlines()
    width = None
    for i, line in enumerate(lines):
        if line.startswith("|"):
            cells = len(re.split(r"(?<!\\)\|", line)) - 2
            if not lines[i - 1].startswith("|"):
                assert lines[i - 1] == "" and lines[i + 1].startswith("|---"), (i, line)
                width = cells
            assert cells == width, line
        elif line.startswith("#"):
            assert i == 0 or lines[i - 1] == "", line
    assert "<script>" not in md and "&lt;script>" in md


def test_write_gives_json_and_markdown_and_keeps_the_json_as_it_was(reports, tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    path, md = summary.write(reports, tmp_path / "report.json", gpus=False)
    doc = json.loads(path.read_text())
    assert [c["cell"] for c in doc["cells"]] == [GOOD, BAD] and doc["cells"][1]["launches"]["hpc"] == "fail"
    assert md == tmp_path / "report.md" and md.read_text() == summary.summary(reports)
    # report.json is what it was: the fixture's cells come back field for field. The fields
    # signing added (sbom, provenance, signing, signatures) are new keys, empty when unsigned, and
    # so is emulated (empty for a native probe): a reader of the old document finds every key it
    # knew, with the same value.
    fixture = json.loads((FIXTURE / "report.json").read_text())
    added = {"sbom": "", "provenance": "", "signing": "", "signatures": [], "emulated": "", "sizes": {}}
    assert [{k: v for k, v in c.items() if k not in added} for c in doc["cells"]] == fixture["cells"]
    assert all({k: c[k] for k in added} == added for c in doc["cells"])


def test_a_failed_build_shows_its_step_error_and_log_tail_in_a_fence_it_cannot_close():
    r = results.CellReport("py3.11-cpu-mkl-pip", status=results.BUILD_FAILED, failed_step="step 9/31: RUN pip install",
                          error="exit | 1", log_tail=["ERROR: no such package", "```", "# not a heading"])
    md = summary.summary([r])
    # no cell was probed: no mode columns, and the row has as many cells as the header
    assert "| cell | status | publish | failing checks |" in md and "| `py3.11-cpu-mkl-pip` | build-failed | — |  |" in md
    body = section(md, "py3.11-cpu-mkl-pip")
    assert "**step 9/31: RUN pip install**: exit \\| 1" in body
    assert "````\nERROR: no such package\n```\n# not a heading\n````" in body
