"""The default builder is auto: BuildKit where `docker buildx` answers, else the classic builder,
said once; and test finds an image whichever builder built it (a cell's content hash covers its
Dockerfile, which differs by builder).

No build of its own: each run takes the session's shared images, cpu_build's (classic) and
bk_build's (BuildKit, with a netrc), so every run here is a cache hit with cached verdicts. Every
other module names its builder (helpers.pinned_builder); these runs leave --builder out.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.integration.helpers import Build, buildx_or_skip, report_of, run_cli

pytestmark = [pytest.mark.docker]

CELL = Build.GOOD


def default_run(command: str, matrix: Path, root: Path, *args: str, env: dict | None = None):
    """`imagefactory COMMAND` of `matrix` with no --builder, its report and work dir under `root`."""
    result = run_cli(command, "--matrix", str(matrix), "--only", CELL, "--plain", "--gpus", "none", "--report",
                     str(root / "report.json"), "--work-dir", str(root / "work"), *args, env=env,
                     default_builder=True)
    assert (root / "report.json").exists(), result.stdout[-2000:] + result.stderr[-3000:]
    return result, report_of(root / "report.json")[CELL]


def settings_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("imagefactory "))


def test_build_with_no_builder_flag_builds_with_buildkit_where_buildx_answers(bk_build, tmp_path):
    buildx_or_skip()
    result, cell = default_run("build", bk_build.matrix, tmp_path, "--netrc", str(bk_build.netrc))
    assert result.returncode == 0, result.stderr[-3000:]
    assert cell["builder"] == "buildkit" and cell["status"] == "passed", cell
    assert cell["content_hash"] == bk_build.report()[CELL]["content_hash"]  # BuildKit's render: a cache hit
    assert "builder=buildkit" in settings_line(result.stderr) and "builder: classic" not in result.stderr


def no_buildx_path(root: Path) -> str:
    """A PATH whose `docker` is the real CLI without the buildx plugin (it answers `buildx` the way
    a Docker CLI without the plugin does)."""
    real = shutil.which("docker")
    assert real is not None
    shim = root / "bin" / "docker"
    shim.parent.mkdir()
    shim.write_text('#!/bin/sh\nif [ "$1" = buildx ]; then\n'
                    "  echo \"docker: 'buildx' is not a docker command.\" >&2; exit 1\nfi\n"
                    f'exec {real} "$@"\n')
    shim.chmod(0o755)
    return f"{shim.parent}{os.pathsep}{os.environ.get('PATH', '')}"


def test_build_with_no_builder_flag_and_no_buildx_builds_classic_and_says_so_once(cpu_build, tmp_path):
    result, cell = default_run("build", cpu_build.matrix, tmp_path, env={"PATH": no_buildx_path(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert cell["builder"] == "classic" and cell["status"] == "passed", cell
    assert cell["content_hash"] == cpu_build.first_report[CELL]["content_hash"]  # the classic render: a cache hit
    assert result.stderr.count("builder: classic (") == 1, result.stderr
    assert "not installed" in result.stderr and "builder=classic" in settings_line(result.stderr)


def test_test_under_buildkit_finds_the_classic_builders_image(cpu_build, tmp_path):
    buildx_or_skip()
    result, cell = default_run("test", cpu_build.matrix, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "builder=buildkit" in settings_line(result.stderr)
    first = cpu_build.first_report[CELL]
    assert (cell["status"], cell["builder"], cell["content_hash"]) == ("passed", "classic", first["content_hash"])
    assert cell["image_id"] == first["image_id"]
    assert "found the image the classic builder built" in Path(cell["log"]).read_text()


def test_test_under_the_classic_builder_finds_buildkits_image_built_with_a_netrc(bk_build, tmp_path):
    """No --netrc here (test has none): BuildKit's render with the netrc mounted is one of the hashes looked for."""
    result, cell = default_run("test", bk_build.matrix, tmp_path, "--builder", "classic")
    assert result.returncode == 0, result.stderr[-3000:]
    first = bk_build.report()[CELL]
    assert (cell["status"], cell["builder"], cell["content_hash"]) == ("passed", "buildkit", first["content_hash"])
    assert cell["image_id"] == first["image_id"]
