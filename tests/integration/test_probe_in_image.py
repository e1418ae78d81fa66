"""The probe's torch branch, run where torch is: inside the shared built CPU image.

tests/unit/resources/test_probe.py runs the probe on the host, whose test extra has no torch, so there
only the "torch is missing" branch runs. Here the same assertions about the torch section
(tests/unit/helpers.assert_torch_section) run against the probe's report from the image the
session already built (the `cpu_build` fixture): no build of its own, one probe run.
"""

from __future__ import annotations

import pytest

from imagefactory.config import matrix
from imagefactory.probe import smoke
from tests.integration.helpers import Build
from tests.unit.helpers import assert_torch_section

pytestmark = pytest.mark.docker


def test_the_probes_torch_section_in_the_built_image(engine, cpu_build):
    image = cpu_build.first_report[Build.GOOD]["candidate"]
    assert image, cpu_build.first_report
    cell = matrix.load(cpu_build.matrix).cell(Build.GOOD)
    assert isinstance(cell.threads, int)
    result = smoke.run_probe(engine, image, timeout=300, compile_check=False)  # the compile child: not read here
    assert result.exit_code == 0, result.stderr[-2000:]
    report = smoke.parse_probe_output(result.stdout)
    assert report is not None, result.stdout[-2000:]
    assert_torch_section(report, threads=cell.threads)
    assert report["torch"]["version"] == f"{cell.torch}+cpu" and report["torch"]["cuda"] is None
    assert report["env"]["OMP_NUM_THREADS"] == str(cell.threads)
    assert report["compute"]["torch_matmul"]["ok"] is True, report["compute"]
