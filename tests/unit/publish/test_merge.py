"""Issue 23 item 7: one CI job per cell (on a runner of its platform) writes its report, and
`imagefactory merge` publishes each list from those reports, only when every declared platform's
report shows it passed and pushed the per-arch tag the matrix plans (merge.py). The cell jobs are
real runs of build + publish on the in-memory engine and registry (tests/fake_engine.py), each
with `--only` its cell, writing its report as the CLI does; the merge runs through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from imagefactory.pipeline import build
from imagefactory.engine import select
from imagefactory.files import bounded
from imagefactory.config import matrix
from imagefactory.publish import merge
from imagefactory.publish import push
from imagefactory.report import summary
from imagefactory.config import tags
from imagefactory.run.context import BuildOptions, PushOptions
from tests.fake_engine import World
from tests.unit.helpers import AMD, AMD_TAG, ARM, ARM_TAG, BASE, LIST, PIP_BOTH, good_probe, pip_both_project, run_cli



@pytest.fixture
def project(tmp_path: Path) -> Path:
    (pip_both_project(tmp_path) / "reports").mkdir()
    return tmp_path


@pytest.fixture
def world(project: Path) -> World:
    m = matrix.load(project / "matrix.yaml")
    return World(probes={c.id: good_probe(c) for c in m.cells}, builder="buildkit")


def cell_job(project: Path, world: World, cell: str, *, failing: bool = False) -> Path:
    """One cell job: `build --only CELL --push --report reports/report-CELL.json`, on the shared registry."""
    m = matrix.load(project / "matrix.yaml")
    if failing:
        world.probes[cell] = {"crash": True}
    opts = BuildOptions(work_dir=project / f"work-{cell}", gpus="none", verdicts_dir=project / "verdicts")
    reports = build.build(m, [m.cell(cell)], world.context(opts)).reports
    lists = push.publish(m, reports, world.context(PushOptions(backoff=0)))
    path, _ = summary.write(reports, project / "reports" / f"report-{cell}" / f"report-{cell}.json", gpus=False,
                           lists=lists)
    return path


def edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc["cells"][0])
    path.write_text(json.dumps(doc))


def merge_cli(project: Path, world: World, monkeypatch, capsys, *extra: str) -> tuple[int, str, str]:
    monkeypatch.setattr(select, "docker_engine", lambda interrupt, **kwargs: world.engine())
    world.calls.clear()
    return run_cli(["merge", "--matrix", str(project / "matrix.yaml"), "--reports", str(project / "reports"),
                    "--report", str(project / "out" / "report.json"), "--plain", "--retry-delay", "0", *extra],
                   monkeypatch, capsys)


def merged_report(project: Path) -> dict:
    return json.loads((project / "out" / "report.json").read_text())


def pushed(path: Path, ref: str) -> str:
    return next(p["digest"] for p in json.loads(path.read_text())["cells"][0]["pushed"] if p["ref"] == ref)


def test_two_good_reports_the_list_is_merged_put_and_read_back(project, world, monkeypatch, capsys):
    amd, arm = cell_job(project, world, AMD), cell_job(project, world, ARM)
    assert LIST not in world.manifests  # neither cell job merged it: the other platform was not in its run
    code, out, err = merge_cli(project, world, monkeypatch, capsys)
    assert code == 0, err
    index = json.loads(world.manifests[LIST].body)
    resolved = {f"{d['platform']['os']}/{d['platform']['architecture']}": d["digest"] for d in index["manifests"]}
    assert resolved == {"linux/amd64": pushed(amd, AMD_TAG), "linux/arm64": pushed(arm, ARM_TAG)}
    assert world.ops("put_manifest")[-1] == LIST and world.ops("registry_manifest")[-1] == LIST  # read back
    (lr,) = merged_report(project)["lists"]
    assert lr["publish"] == "published" and lr["digest"] in out and merged_report(project)["ok"] is True
    assert "## Lists" in (project / "out" / "report.md").read_text()


def test_the_arm64_report_missing_refuses_the_list_naming_it(project, world, monkeypatch, capsys):
    cell_job(project, world, AMD)
    code, out, err = merge_cli(project, world, monkeypatch, capsys)
    assert code == 1 and not world.ops("put_manifest")
    (lr,) = merged_report(project)["lists"]
    assert lr["publish"] == "not-published" and "\n" not in lr["reason"]
    assert f"{ARM} (linux/arm64) has no report" in lr["reason"] and f"{AMD} (" not in lr["reason"]
    assert f"{LIST}\tnot-published\t" in out and "1 of 1 list(s) not published" in err


def test_a_failed_member_refuses_the_list(project, world, monkeypatch, capsys):
    cell_job(project, world, AMD)
    cell_job(project, world, ARM, failing=True)
    code, _, _ = merge_cli(project, world, monkeypatch, capsys)
    (lr,) = merged_report(project)["lists"]
    assert code == 1 and not world.ops("put_manifest")
    assert f"{ARM} (linux/arm64) did not pass (check-failed)" in lr["reason"]


def test_two_reports_of_one_cell_refuse_the_list(project, world, monkeypatch, capsys):
    amd = cell_job(project, world, AMD)
    cell_job(project, world, ARM)
    (project / "reports" / "again.json").write_text(amd.read_text())
    code, _, _ = merge_cli(project, world, monkeypatch, capsys)
    assert code == 1 and not world.ops("put_manifest")
    assert f"{AMD} (linux/amd64): 2 reports name it" in merged_report(project)["lists"][0]["reason"]


def _other_repo(cell: dict) -> None:  # the report of a matrix that pushes elsewhere
    for p in cell["pushed"]:
        p["ref"] = p["ref"].replace("ml/train:", "ml/other:")


def _other_digest(cell: dict) -> None:  # the per-arch tag names a digest its content-hash tag does not
    next(p for p in cell["pushed"] if p["ref"] == ARM_TAG)["digest"] = "sha256:" + "d" * 64


def _other_content(cell: dict) -> None:  # another content hash: its hash tag is not among the pushes
    cell["content_hash"] = "f" * 64


@pytest.mark.parametrize("change, words", [
    (_other_repo, f"its report pushed no {ARM_TAG}, the per-arch tag this matrix plans"),
    (_other_digest, f"its report pushed sha256:{'d' * 64} as {ARM_TAG} but sha256:"),
    (_other_content, f"but nothing as its content-hash tag {BASE}sha-ffffffffffff"),
])
def test_a_report_whose_per_arch_ref_or_digest_is_not_the_plan_refuses_the_list(project, world, monkeypatch,
                                                                                 capsys, change, words):
    cell_job(project, world, AMD)
    edit(cell_job(project, world, ARM), change)
    code, _, _ = merge_cli(project, world, monkeypatch, capsys)
    (lr,) = merged_report(project)["lists"]
    assert code == 1 and not world.ops("put_manifest") and lr["publish"] == "not-published"
    assert f"{ARM} (linux/arm64): " in lr["reason"] and words in lr["reason"], lr["reason"]


def test_the_registry_serving_another_digest_than_the_report_is_a_failed_merge(project, world, monkeypatch, capsys):
    cell_job(project, world, AMD)
    cell_job(project, world, ARM)
    world.registry[ARM_TAG] = "sha256:" + "c" * 64  # the tag moved since the cell job pushed it
    code, _, _ = merge_cli(project, world, monkeypatch, capsys)
    (lr,) = merged_report(project)["lists"]
    assert code == 1 and lr["publish"] == "publish-failed" and not world.ops("put_manifest")
    assert f"the registry serves sha256:{'c' * 64} for {ARM_TAG}" in lr["reason"]


ESC = "\x1b[31m"


@pytest.mark.parametrize("change, key", [
    (lambda c: c["pushed"][0].update(digest="sha256:" + "A" * 64), "cells[0].pushed[0].digest"),
    (lambda c: c["pushed"][0].update(digest="sha256:" + "a" * 64 + "\n"), "cells[0].pushed[0].digest"),
    (lambda c: c["pushed"][1].update(ref=ARM_TAG + ESC), "cells[0].pushed[1].ref"),
    (lambda c: c["pushed"][1].update(ref=ARM_TAG + "\nX"), "cells[0].pushed[1].ref"),
    (lambda c: c["pushed"][1].update(ref=ARM_TAG + "@sha256:" + "a" * 64), "cells[0].pushed[1].ref"),
    (lambda c: c.update(pushed=[{"ref": ARM_TAG, "digest": "sha256:" + "a" * 64}] * 300), "cells[0].pushed"),
    (lambda c: c.update(cell=ARM + ESC), "cells[0].cell"),
    (lambda c: c.update(status="passed" + ESC), "cells[0].status"),
    (lambda c: c.update(publish=["published"]), "cells[0].publish"),
    (lambda c: c.update(content_hash="a" * 63 + ESC), "cells[0].content_hash"),
])
def test_a_hostile_value_is_one_line_exit_2_and_nothing_is_put(project, world, monkeypatch, capsys, change, key):
    cell_job(project, world, AMD)
    arm = cell_job(project, world, ARM)
    edit(arm, change)
    code, out, err = merge_cli(project, world, monkeypatch, capsys)
    assert code == 2 and out == "" and not world.calls and not world.ops("put_manifest")
    (line,) = err.splitlines()
    assert line.startswith(f"error: {bounded.short(arm)}: {key}: ") and ESC not in line and len(line) < 400, line
    assert not (project / "out" / "report.json").exists()


@pytest.mark.parametrize("content", ["huge", "not json", "deep", "no cells"])
def test_an_unreadable_report_is_one_line_exit_2(project, world, monkeypatch, capsys, content):
    cell_job(project, world, AMD)
    bad = project / "reports" / "report-x.json"
    if content == "huge":
        with bad.open("wb") as f:
            f.truncate(merge.MAX_REPORT_BYTES + 1)  # sparse: the reader stops one byte past the cap
    else:
        bad.write_text({"not json": "{\"cells\": [" + ESC, "deep": "[" * 100_000 + "]" * 100_000,
                        "no cells": "{\"cell\": 1}"}[content])
    code, out, err = merge_cli(project, world, monkeypatch, capsys)
    assert code == 2 and not world.calls
    (line,) = err.splitlines()
    assert line.startswith(f"error: {bounded.short(bad)}: ") and ESC not in line, line
    assert ("larger than" in line) if content == "huge" else ("not a" in line)


def test_a_missing_reports_path_is_exit_2(project, world, monkeypatch, capsys):
    monkeypatch.setattr(select, "docker_engine", lambda interrupt, **kwargs: world.engine())
    code, _, err = run_cli(["merge", "--matrix", str(project / "matrix.yaml"), "--reports",
                            str(project / "nowhere"), "--report", str(project / "out.json")], monkeypatch, capsys)
    assert code == 2 and "--reports" in err and "not found" in err


def test_reports_of_cells_in_no_list_are_read_and_ignored(project, world, monkeypatch, capsys):
    text = PIP_BOTH.replace("platform: [linux/amd64, linux/arm64]", "platform: [linux/amd64]")
    (project / "matrix.yaml").write_text(text)
    cell_job(project, world, AMD)
    code, _, err = merge_cli(project, world, monkeypatch, capsys)
    assert code == 0 and "no lists" in err and not world.ops("put_manifest")


def test_the_refusal_reuses_the_member_check_of_the_in_run_merge(project):
    m = matrix.load(project / "matrix.yaml")
    (lr,) = merge.publish_lists.start(m, [], PushOptions())
    assert merge.refusal(m, lr, {}).count("has no report") == 2
    assert tags.list_of(m, m.cell(ARM)) is m.lists[0]


def test_list_github_rows_carry_the_platform(project, monkeypatch, capsys):
    code, out, _ = run_cli(["list", "--matrix", str(project / "matrix.yaml"), "--format", "github"],
                           monkeypatch, capsys)
    rows = json.loads(out)["include"]
    assert code == 0 and {(r["cell"], r["platform"]) for r in rows} == {(AMD, "linux/amd64"), (ARM, "linux/arm64")}
