"""The image catalogue (report.html): the grid, the failed cell, the digests, and a hostile report
escaped; from tests/fixtures/report/ (two cells of a real report, the second failing
`torch.compile` in the `hpc` launch mode only, and bench figures for the first). The page in a
real browser: tests/integration/test_catalog.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import markupsafe
import pytest
from typer.testing import CliRunner

from imagefactory.report import catalog
from imagefactory.report import summary
from imagefactory.run import results
from imagefactory.cli.app import app
from imagefactory.errors import ConfigError

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "report"
GOOD, BAD = "py3.11-cpu-openblas-pip", "py3.12-cpu-openblas-pip"


@pytest.fixture
def reports() -> list[results.CellReport]:
    return catalog.read_report(FIXTURE / "report.json")


def test_the_catalogue_shows_the_grid_the_failure_and_the_digests(reports):
    page = catalog.render(reports, catalog.read_bench(FIXTURE / "bench.json"))
    rows, columns, cells = catalog.grid(reports)
    assert rows == ["3.11", "3.12"] and columns == ["CPU"]
    assert [t.verdict for t in cells[("3.12", "CPU")]] == ["fail"]
    assert 'data-cell="py3.12-cpu-openblas-pip" data-verdict="fail"' in page
    assert "hpc: torch.compile" in page
    digest = reports[0].pushed[0]["digest"]
    assert f"docker pull 127.0.0.1:5001/imagefactory/example@{digest}" in page
    assert "srun --container-image=127.0.0.1:5001#imagefactory/example:2.13.0-py3.11-cpu-openblas-pip" in page
    assert "dataloader" in page and "×5.31" in page  # bench figures, as bars
    assert not re.search(r"<script|https?://|src=", page, re.I)  # self-contained, no script


HOSTILE = '"><script>alert(1)</script><img src=x onerror=alert(2)>'


def test_every_value_from_the_report_is_escaped(reports):
    r = reports[1]
    r.cell = "py3.12-cpu-openblas-pip" + HOSTILE
    r.status = r.builder = r.base_image = HOSTILE
    r.checks = [summary.Check(HOSTILE, HOSTILE, HOSTILE, "fail", HOSTILE, mode=HOSTILE)]
    r.pushed = [{"ref": "reg.example/a:b" + HOSTILE, "digest": HOSTILE}, {"ref": "reg.example/a:b", "digest": HOSTILE}]
    page = catalog.render(reports, {r.cell: [{"name": HOSTILE, "status": "ok", "speedup": 2.0, "unit": HOSTILE,
                                               "container": HOSTILE, "baseline": {"label": HOSTILE, "value": 1},
                                               "candidate": {"label": HOSTILE, "value": 2}}]})
    assert "<script" not in page and "<img" not in page and "onerror=alert" not in page.replace("onerror=alert(2)&gt;", "")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # a digest that is not sha256:<64 hex> makes no pull line by digest
    assert "docker pull reg.example/a:b" in page and "docker pull reg.example/a@" not in page
    assert str(markupsafe.escape(HOSTILE)) in page


def test_a_report_that_is_not_one_is_a_located_config_error(tmp_path):
    bad = tmp_path / "report.json"
    for text, says in (("[]", "report: expected dict"), ('{"cells": [{"cell": 1}]}', "cells[0].cell: expected str"),
                       ('{"cells": [{"cell": "x", "checks": [{"name": []}]}]}', "cells[0].checks[0].name"),
                       ('{"cells": [{"cell": "x", "tags": [1]}]}', "cells[0].tags[0]"), ("{", "not a JSON report")):
        bad.write_text(text)
        with pytest.raises(ConfigError) as e:
            catalog.read_report(bad)
        assert says in e.value.message and str(bad) in e.value.message, e.value.message
    with pytest.raises(ConfigError, match="file not found"):
        catalog.read_report(tmp_path / "missing.json")


def test_a_newer_reports_unknown_keys_are_ignored(tmp_path):
    doc = json.loads((FIXTURE / "report.json").read_text())
    doc["cells"][0]["signatures"] = [{"ref": "x", "verified": True}]
    (tmp_path / "report.json").write_text(json.dumps(doc))
    assert [r.cell for r in catalog.read_report(tmp_path / "report.json")] == [GOOD, BAD]


def test_the_report_command_writes_the_catalogue_and_prints_the_summary(tmp_path):
    shutil.copy(FIXTURE / "report.json", tmp_path / "report.json")
    runner = CliRunner()
    result = runner.invoke(app, ["report", "--html", "--report", str(tmp_path / "report.json")])
    assert result.exit_code == 0, result.output
    assert 'data-verdict="fail"' in (tmp_path / "report.html").read_text()
    result = runner.invoke(app, ["report", "--report", str(tmp_path / "report.json")])
    assert result.exit_code == 0 and f"| `{BAD}` | check-failed |" in result.stdout


def test_every_run_writes_the_catalogue_beside_the_report(reports, tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    shutil.copy(FIXTURE / "bench.json", tmp_path / "bench.json")
    summary.write(reports, tmp_path / "report.json", gpus=False)
    page = (tmp_path / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and 'data-verdict="fail"' in page and "×5.31" in page


def test_a_field_a_newer_cell_report_declares_is_read_by_its_declared_kind(tmp_path, monkeypatch):
    """A field another change adds to CellReport (a list of dicts, an optional value) is read
    without being forced to a string; a known field of the wrong kind is still refused."""
    import dataclasses

    @dataclasses.dataclass
    class Newer(results.CellReport):
        signatures: list[dict] = dataclasses.field(default_factory=list)
        note: "str | None" = None

    monkeypatch.setattr(catalog, "CellReport", Newer)
    doc = json.loads((FIXTURE / "report.json").read_text())
    doc["cells"][0].update(signatures=[{"ref": "x", "verified": True}], note=None)
    (tmp_path / "report.json").write_text(json.dumps(doc))
    (first, _) = catalog.read_report(tmp_path / "report.json")
    assert first.signatures == [{"ref": "x", "verified": True}] and first.note is None
    doc["cells"][0]["signatures"] = "not a list"
    (tmp_path / "report.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"cells\[0\]\.signatures: expected list"):
        catalog.read_report(tmp_path / "report.json")


def test_an_emulated_cell_says_so_and_every_cell_its_architecture(reports):
    """What the probe saw: the machine inside (platform.machine), and for a cell probed under
    QEMU the report's emulated words; a native cell says nothing of emulation."""
    from dataclasses import replace as with_

    from imagefactory.probe.checks import PASS, Check

    arm = with_(reports[0], cell="py3.11-cpu-openblas-pip-arm64", emulated="qemu-aarch64 (QEMU_CPU=neoverse-n1) on linux/amd64",
                checks=[*reports[0].checks, Check("platform.machine", "aarch64", "aarch64", PASS, mode="docker")])
    page = catalog.render([arm, reports[1]], {})
    assert "<td>architecture</td><td>aarch64</td>" in page
    assert "<td>probed</td><td>emulated: qemu-aarch64 (QEMU_CPU=neoverse-n1) on linux/amd64</td>" in page
    assert page.count("<td>probed</td>") == 1
