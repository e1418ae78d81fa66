"""A no-op `build` (nothing changed since the last run) on the real engine does only what a changed
input would need: it imports no schema validator or YAML parser (jsonschema, PyYAML: the matrix's bytes loaded
before, matrix.py) and no template engine (Jinja2: the same renders as before, rendered.py), and its
report is that of a real run. Like every build that pushes nothing, it makes no SBOM or provenance
and loads nothing of the attest step (cyclonedx among it): those are a publishing run's
(pipeline/build.py, attest/record.py). Its CA files are parsed again (cryptography's X.509 parser): that cache saved a
few tens of milliseconds and was dropped (issue 33; config/cacerts.py). No timing is asserted: bench/cli.py measures the no-op against a cached
`docker build` (docs/performance.md).

No build of its own: it takes cpu_build's image, so every run here is a cache hit with cached
verdicts. And no run keeps the engine's API version (engine/docker.py negotiates each time), on
the real SDK and engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import LEFTOVERS, Build, cli_env, report_of
from tests.unit.helpers import RUN_CLI as RUN  # the CLI in a fresh interpreter, then the modules it loaded

pytestmark = [pytest.mark.docker]

CELL = Build.GOOD
SKIPPED = ("jsonschema", "jinja2", "yaml")
NOT_ATTESTED = ("cyclonedx", "imagefactory.attest")  # in no run that pushes nothing, first or again


def _loaded(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == s or m.startswith(s + ".") for s in prefixes))


def noop_build(matrix: Path, root: Path) -> tuple[set[str], int, str]:
    """`imagefactory build` of cpu_build's cell in a fresh interpreter: the modules it loaded, its
    exit code and its stderr (without the module list)."""
    args = ["build", "--matrix", str(matrix), "--only", CELL, "--plain", "--gpus", "none", "--builder", "classic",
            "--report", str(root / "report.json"), "--work-dir", str(root / "work")]
    try:
        r = subprocess.run([sys.executable, "-c", RUN, json.dumps(args)], capture_output=True, text=True,
                           env=cli_env(None), timeout=600)
    finally:
        LEFTOVERS.from_work_dir(root / "work")
    err, sep, tail = r.stderr.rpartition("\nMODULES ")
    assert sep, r.stderr[-3000:]
    modules, code = tail.rsplit(" EXIT ", 1)
    return set(json.loads(modules)), int(code.strip() or 0), err


def test_a_no_op_build_imports_no_serializer_parser_validator_or_template_engine(cpu_build, tmp_path):
    first = cpu_build.first_report[CELL]  # later tests rewrite cpu_build's own report
    for run in ("first", "again"):  # the second in the same work dir: nothing at all changed
        modules, code, err = noop_build(cpu_build.matrix, tmp_path)
        assert code == 0, err[-3000:]
        cell = report_of(tmp_path / "report.json")[CELL]
        assert cell["status"] == "passed" and cell["cached"] is True and cell["verdicts"] == "cached", (run, cell)
        assert cell["content_hash"] == first["content_hash"] and cell["image_id"] == first["image_id"]
        assert (cell["sbom"], cell["provenance"]) == ("", ""), cell  # a build that pushes nothing attests nothing
        assert _loaded(modules, NOT_ATTESTED) == [], (run, _loaded(modules, NOT_ATTESTED))
        # The first run in a new work dir may have something new to make: its catalogue (its report
        # names that dir's logs). The second has nothing new at all.
        if run == "again":
            assert _loaded(modules, SKIPPED) == [], _loaded(modules, SKIPPED)
    assert not (tmp_path / "sbom").exists() and not (tmp_path / "provenance").exists()


def test_each_new_process_engine_negotiates_its_version_and_keeps_none(engine, tmp_path, monkeypatch):
    """On the real engine and SDK: no API version is kept between runs (that cache saved one
    GET /version); each run's first engine negotiates, writes nothing to the cache folder, and
    its `docker info` is the engine's."""
    from docker.api.client import APIClient

    from imagefactory.engine import docker as engine_mod

    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "cache"))
    negotiated = []
    real = APIClient._retrieve_server_version
    monkeypatch.setattr(APIClient, "_retrieve_server_version", lambda self: negotiated.append(1) or real(self))
    server = engine.client.version()["ApiVersion"]
    engine_mod.Engine()
    assert negotiated == [1]
    assert not (tmp_path / "cache").exists()
    again = engine_mod.Engine()  # another run: no factory shares the first one's version
    assert negotiated == [1, 1] and again.client.api.api_version == server
    assert again.native_platform() == engine.native_platform() is not None


def test_the_engine_takes_an_image_by_name_only_with_the_content_hash_label(cpu_build, engine, session_id):
    """find_built's one inspect (engine.labelled_image), on the real engine: cpu_build's image by
    its candidate name carries its content hash; the same image under another hash, the cell's
    base image (a name on an image without the label) and a missing name are not taken."""
    from imagefactory.config import matrix
    from imagefactory.render import contexts

    first = cpu_build.first_report[CELL]
    assert engine.labelled_image(first["candidate"], contexts.HASH_LABEL, first["content_hash"]) == first["image_id"]
    assert engine.labelled_image(first["candidate"], contexts.HASH_LABEL, "0" * 64) is None
    base = matrix.load(cpu_build.matrix).cell(CELL).base_image  # what this run's setup made and cpu_build used
    assert engine.image_id(base) is not None
    assert engine.labelled_image(base, contexts.HASH_LABEL, first["content_hash"]) is None
    assert engine.labelled_image(f"imagefactory-test/no-such-image:{session_id}", contexts.HASH_LABEL,
                                 first["content_hash"]) is None
