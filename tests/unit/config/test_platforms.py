"""The platform seam: one table says what a platform is; the engine interface is one frozen build
request and constructs no engine; the builder is one typed value."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from imagefactory.engine import buildkit
from imagefactory.engine import select
from imagefactory.config import platforms
from imagefactory.engine.api import Builder, BuildRequest
from imagefactory.config.model import Cell
from tests.conftest import REPO
from tests.unit.helpers import package_modules
import json
import shutil
import subprocess
import sys
from imagefactory.config import availability
from imagefactory.config import matrix
from imagefactory.render import contexts
from imagefactory.config import tags
from imagefactory.run.context import BuildOptions, PushOptions

PACKAGE = REPO / "imagefactory"


def test_the_table_names_each_platform_the_way_each_tool_does():
    amd64, arm64 = platforms.get("linux/amd64"), platforms.get("linux/arm64")
    assert (amd64.arch, amd64.architecture, amd64.conda_subdir) == ("x86_64", "amd64", "linux-64")
    assert (arm64.arch, arm64.architecture, arm64.conda_subdir) == ("aarch64", "arm64", "linux-aarch64")
    assert amd64.pip_platform == "manylinux_2_28_x86_64" and arm64.pip_platform == "manylinux_2_28_aarch64"
    assert arm64.glibc_platforms[-2:] == ("manylinux2014_aarch64", "linux_aarch64")
    assert arm64.uv_platform == "aarch64-manylinux_2_28"
    assert amd64.mkl and not arm64.mkl  # no MKL for aarch64 anywhere
    assert arm64.emulation.binfmt == "qemu-aarch64" and arm64.emulation.qemu_cpu == "neoverse-n1"
    assert platforms.DEFAULT == amd64 and platforms.names() == ["linux/amd64", "linux/arm64"]
    assert platforms.by_architecture("arm64") == arm64 and platforms.by_architecture("s390x") is None
    assert platforms.native("aarch64") == arm64 and platforms.native("x86_64") == amd64
    with pytest.raises(dataclasses.FrozenInstanceError):
        arm64.mkl = True  # type: ignore[misc]


def test_a_cell_of_the_default_platform_keeps_its_id_and_another_names_its_arch():
    cell = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.10.0", threads=2,
                base_image="python:3.11-slim-bookworm")
    assert cell.id == "py3.11-cpu-openblas-pip"
    assert dataclasses.replace(cell, platform=platforms.ARM64).id == "py3.11-cpu-openblas-pip-arm64"
    assert dataclasses.replace(cell, platform=platforms.ARM64, variant="vision").id == \
        "py3.11-cpu-openblas-pip-arm64-vision"


def test_a_build_request_is_one_frozen_value_and_buildx_builds_its_platform(tmp_path):
    request = BuildRequest("/ctx", "t:1", platform=platforms.ARM64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.tag = "u:2"  # type: ignore[misc]
    args = buildkit.command("docker", request, tmp_path / "m.json", builder=None)
    assert args[args.index("--platform") + 1] == "linux/arm64"
    default = buildkit.command("docker", BuildRequest("/ctx", "t:1"), tmp_path / "m.json", builder=None)
    assert default[default.index("--platform") + 1] == "linux/amd64"


def _imports(path: Path) -> set[str]:
    """The imagefactory modules `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("imagefactory"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("imagefactory"))
    return found & set(package_modules())


def test_the_engine_interface_constructs_no_engine():
    """engine_api.py describes engines; engines.py makes them. An interface module that imports its
    implementations closes the engine_api -> engine/buildkit -> context -> engine_api circle."""
    assert not _imports(PACKAGE / "engine" / "api.py") & {"imagefactory.engine.docker", "imagefactory.engine.buildkit",
                                                       "imagefactory.engine.select", "imagefactory.run.context"}


def test_the_package_has_no_import_cycle():
    graph = {name: _imports(path) for name, path in package_modules().items()}

    def cycle_from(start: str, node: str, seen: tuple[str, ...]) -> tuple[str, ...] | None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return seen + (nxt,)
            if nxt not in seen:
                found = cycle_from(start, nxt, seen + (nxt,))
                if found:
                    return found
        return None

    for module in sorted(graph):
        assert cycle_from(module, module, (module,)) is None, " -> ".join(cycle_from(module, module, (module,)) or ())


def test_auto_is_a_choice_no_engine_is_made_of(monkeypatch):
    with pytest.raises(ValueError, match="resolve it"):
        select.docker_engine(builder=Builder.auto)


def test_an_arm64_pip_cell_on_this_host_is_resolved_by_uv_not_by_pip(tmp_path, monkeypatch):
    """pip's --platform reads markers on this host (an aarch64 torch would lock x86 CUDA wheels): a
    cell of another platform goes to uv (tests/unit/lock/test_resolve_platforms.py locks one for real)."""
    from imagefactory.lock import resolve
    from imagefactory.config.model import Matrix

    cell = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.10.0", threads=2,
                base_image="python:3.11-slim-bookworm", platform=platforms.ARM64)
    m = Matrix(path=tmp_path / "matrix.yaml", image="r.example.com/ml/train", cells=(cell,))
    monkeypatch.setattr(platforms, "native", lambda machine=None: platforms.AMD64)
    monkeypatch.setattr(resolve, "resolve_uv", lambda m, c, held: ("uv-body", "uv"))
    assert resolve.resolve(m, cell, {}) == ("uv-body", "uv")


# -- moved from test_platforms_axis.py ----------------------------------------
# The matrix's platform axis: linux/amd64 by default (today's ids, tags and content hashes), other
# platforms' cells with their arch in their id, per-arch tags beside one list tag, the availability
# tables per platform, MKL refused off x86_64, a per-arch conda installer.


GOLDEN = REPO / "tests" / "golden"


PIP_BOTH = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
{platform}torch: "2.10.0"
threads: 2
pip: {{torch_index_url: null, wheelhouse: wheels}}
"""


BOTH = "  platform: [linux/amd64, linux/arm64]\n"


SHA = "a" * 64


@pytest.fixture
def pip_project(tmp_path: Path) -> Path:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.10.0+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"x")
    return tmp_path


def _load(project: Path, text: str) -> matrix.Matrix:
    (project / "matrix.yaml").write_text(text)
    return matrix.load(project / "matrix.yaml")


def _rendered(m: matrix.Matrix, out: Path) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """cell id -> (content hash, Dockerfile, tags)."""
    return {c.cell.id: (c.content_hash, c.dockerfile.read_text(), c.cell.tags) for c in contexts.render(m, out)}


def test_a_matrix_without_the_axis_is_the_same_matrix_as_one_naming_linux_amd64(tmp_path):
    """The golden matrix, and the same file with `platform: [linux/amd64]`: the same ids, tags,
    Dockerfiles and content hashes (the golden Dockerfiles prove those are today's)."""
    shutil.copytree(GOLDEN, tmp_path / "g")
    plain = matrix.load(tmp_path / "g" / "matrix.yaml")
    text = (tmp_path / "g" / "matrix.yaml").read_text()
    explicit_path = tmp_path / "g" / "explicit.yaml"
    explicit_path.write_text(text.replace("  installer: [conda]\n", "  installer: [conda]\n  platform: [linux/amd64]\n"))
    explicit = matrix.load(explicit_path)
    assert all(c.platform == platforms.DEFAULT for c in explicit.cells) and explicit.lists == ()
    assert _rendered(plain, tmp_path / "a") == _rendered(explicit, tmp_path / "b")
    assert [c.id for c in plain.cells] == ["py3.11-cpu-mkl-conda", "py3.11-cpu-openblas-conda",
                                           "py3.11-cu12.9-openblas-conda", "py3.11-cpu-openblas-pip",
                                           "py3.11-cu13.0-openblas-pip"]
    assert plain.cells[0].tags == ("registry.example.com/ml/train:2.13.0-py3.11-cpu-mkl",)


def test_adding_arm64_changes_no_amd64_content_hash(pip_project):
    """The amd64 cell of a two-platform matrix gets its per-arch tag, but the same labels (its
    version label is the list's) and so the same image as before."""
    alone = _rendered(_load(pip_project, PIP_BOTH.format(platform="")), pip_project / "a")
    both = _rendered(_load(pip_project, PIP_BOTH.format(platform=BOTH)), pip_project / "b")
    cell = "py3.11-cpu-openblas-pip"
    assert both[cell][0] == alone[cell][0] and both[cell][1] == alone[cell][1]
    assert both[cell][2] != alone[cell][2]  # its own tag is the per-arch one now


def test_an_arm64_cell_names_its_arch_gets_its_own_image_and_a_per_arch_tag_beside_the_list(pip_project):
    m = _load(pip_project, PIP_BOTH.format(platform=BOTH))
    assert [c.id for c in m.cells] == ["py3.11-cpu-openblas-pip", "py3.11-cpu-openblas-pip-arm64"]
    amd, arm = m.cells
    assert arm.platform == platforms.ARM64
    base = "registry.example.com/ml/train:"
    assert amd.tags == (base + "x86_64-2.10.0-py3.11-cpu-openblas-pip",)
    assert arm.tags == (base + "aarch64-2.10.0-py3.11-cpu-openblas-pip",)
    (listed,) = m.lists
    assert listed.ref == base + "2.10.0-py3.11-cpu-openblas-pip"
    assert listed.members == ((amd.id, "linux/amd64", amd.tags[0]), (arm.id, "linux/arm64", arm.tags[0]))
    done = _rendered(m, pip_project / "out")
    assert done[amd.id][0] != done[arm.id][0]
    text = done[arm.id][1]
    assert 'io.imagefactory.platform="linux/arm64"' in text
    assert 'org.opencontainers.image.version="2.10.0-py3.11-cpu-openblas-pip"' in text
    assert "torch==2.10.0 " in text or "torch==2.10.0\n" in text or "'torch==2.10.0'" in text, text
    assert "torch==2.10.0+cpu" not in text  # aarch64 2.10 on PyPI is the CPU build
    assert "io.imagefactory.platform" not in done[amd.id][1]


def test_tag_names_of_a_list_and_its_members():
    cell = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.13.0", threads=2,
                base_image="python:3.11-slim-bookworm")
    arm = Cell(**{**cell.__dict__, "platform": platforms.ARM64})
    assert tags.arch_tag("reg.example.com:5000/ml/train:2.13.0-py3.11", platforms.ARM64) == \
        "reg.example.com:5000/ml/train:aarch64-2.13.0-py3.11"
    own, lists = tags.plan([(cell, "x/y:1"), (arm, "x/y:1"), (cell, "x/y:2")])
    assert own == ["x/y:x86_64-1", "x/y:aarch64-1", "x/y:2"]
    assert [t.ref for t in lists] == ["x/y:1"] and lists[0].platforms == ("linux/amd64", "linux/arm64")


def _problem(project: Path, text: str) -> list[str]:
    (project / "matrix.yaml").write_text(text)
    r = subprocess.run([sys.executable, "-m", "imagefactory", "list", "--matrix", str(project / "matrix.yaml")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    return [line for line in r.stderr.splitlines() if line.strip()]


def test_mkl_on_arm64_is_one_located_line_naming_the_platform(tmp_path):
    lines = _problem(tmp_path, "image: registry.example.com/ml/train\nmatrix:\n  python: [\"3.11\"]\n"
                               "  cuda: [\"none\"]\n  blas: [mkl, openblas]\n  installer: [conda]\n"
                               "  platform: [linux/amd64, linux/arm64]\ntorch: \"2.13.0\"\n"
                               f"conda: {{installers: {{linux/arm64: {{sha256: {SHA}}}}}}}\n")
    assert len(lines) == 1, lines
    assert f"{tmp_path / 'matrix.yaml'}:7: matrix.platform[1]: cell py3.11-cpu-mkl-conda-arm64: blas mkl does " \
           "not exist for linux/arm64" in lines[0]


def test_a_conda_arm64_cell_needs_its_installer_digest(tmp_path):
    head = ("image: registry.example.com/ml/train\nmatrix:\n  python: [\"3.11\"]\n  cuda: [\"none\"]\n"
            "  blas: [openblas]\n  installer: [conda]\n  platform: [linux/arm64]\ntorch: \"2.13.0\"\n")
    (line,) = _problem(tmp_path, head)
    assert "cell py3.11-cpu-openblas-conda-arm64: no miniforge installer digest is known for linux/arm64" in line
    assert "conda.installers.linux/arm64.sha256" in line
    (line,) = _problem(tmp_path, head + f"conda: {{installers: {{linux/arm64: {{sha256: {SHA}0}}}}}}\n")
    assert "conda.installers.linux/arm64.sha256" in line and "malformed" in line  # the whole string must match
    m = _load(tmp_path, head + f"conda: {{installers: {{linux/arm64: {{sha256: {SHA}}}}}}}\n")
    text = _rendered(m, tmp_path / "out")["py3.11-cpu-openblas-conda-arm64"][1]
    assert "/25.3.1-0/Miniforge3-25.3.1-0-Linux-aarch64.sh" in text and SHA in text


def test_availability_per_platform():
    arm = platforms.ARM64
    assert availability.conda_problem("2.13.0", "12.9", "3.11", "openblas", platform=arm) is None
    assert availability.conda_problem("2.13.0", "13.0", "3.14", "openblas", platform=arm) is None
    assert "no MKL pytorch" in (availability.conda_problem("2.13.0", None, "3.11", "mkl", platform=arm) or "")
    assert availability.conda_problem("2.13.0", None, "3.11", "mkl") is None  # linux-64 has it
    assert availability.pip_problem("2.10.0", None, "3.11", "pypi", platform=arm) is None
    assert "CPU only" in (availability.pip_problem("2.10.0", "13.0", "3.11", "pypi", platform=arm) or "")
    assert availability.pip_problem("2.13.0", "13.0", "3.11", "pypi", platform=arm) is None
    assert availability.pypi_serves_cpu("2.10.0", "3.11", arm)
    assert not availability.pypi_serves_cpu("2.11.0", "3.11", arm)  # CUDA 13 builds from 2.11 on
    assert not availability.pypi_serves_cpu("2.10.0", "3.11")  # x86_64: PyPI's torch is a CUDA build


def test_a_cpu_arm64_pip_cell_from_2_11_without_an_index_is_refused(pip_project):
    text = PIP_BOTH.format(platform="  platform: [linux/arm64]\n").replace('"2.10.0"', '"2.11.0"')
    (line,) = _problem(pip_project, text)
    assert "PyPI serves no CPU-only torch 2.11.0 for linux/arm64" in line


def test_the_schema_allows_exactly_the_platforms_of_the_table():
    schema = json.loads((REPO / "imagefactory" / "resources" / "matrix.schema.json").read_text())
    assert schema["$defs"]["platform"]["enum"] == platforms.names()
    assert sorted(schema["properties"]["conda"]["properties"]["installers"]["properties"]) == \
        [p for p in platforms.names() if p != platforms.DEFAULT.oci]


def _build(pip_project: Path, world_builder: str, **world):
    from imagefactory.pipeline import build
    from imagefactory.publish import push
    from tests.fake_engine import World
    from tests.unit.helpers import good_probe

    m = _load(pip_project, PIP_BOTH.format(platform=BOTH))
    w = World(probes={c.id: good_probe(c) for c in m.cells}, builder=world_builder, **world)
    opts = BuildOptions(work_dir=pip_project / "work", gpus="none", verdicts_dir=pip_project / "verdicts")
    reports = build.build(m, list(m.cells), w.context(opts)).reports
    push.publish(m, reports, w.context(PushOptions(backoff=0)))
    return w, {r.cell: r for r in reports}


ARM = "py3.11-cpu-openblas-pip-arm64"


AMD = "py3.11-cpu-openblas-pip"


def test_buildkit_builds_each_cell_for_its_platform(pip_project):
    w, reports = _build(pip_project, "buildkit")
    assert {a["cell"]: a["platform"] for a in w.ops("build_args")} == {AMD: "linux/amd64", ARM: "linux/arm64"}
    assert reports[ARM].status == "passed" and reports[AMD].status == "passed"


def test_an_image_of_the_wrong_arch_is_refused_before_its_probe_and_never_tagged(pip_project):
    w, reports = _build(pip_project, "buildkit", wrong_arch={ARM})
    arm = reports[ARM]
    assert arm.status == "check-failed" and "is linux/amd64, not linux/arm64" in arm.error
    assert [c.name for c in arm.checks] == ["image.platform"] and arm.checks[0].verdict == "fail"
    assert ARM not in w.ops("probe") and AMD in w.ops("probe")
    pushed = " ".join(w.ops("push"))
    assert "aarch64-" not in pushed and "x86_64-2.10.0" in pushed  # the amd64 cell still publishes


def test_the_classic_builder_refuses_a_foreign_platform(pip_project):
    w, reports = _build(pip_project, "classic")
    assert reports[ARM].status == "build-failed"
    assert "the classic builder builds only for the engine's own platform (linux/amd64), not linux/arm64" in \
        reports[ARM].error and "--builder buildkit" in reports[ARM].error
    assert ARM not in w.ops("probe") and reports[AMD].status == "passed"


def test_refuse_foreign_follows_the_engines_own_platform():
    from imagefactory.engine.api import refuse_foreign
    from imagefactory.errors import BuildError, ForeignPlatform

    arm = BuildRequest("/ctx", "t:1", platform=platforms.ARM64)
    refuse_foreign(arm, platforms.ARM64)  # an arm64 engine builds arm64 with the classic builder
    with pytest.raises(ForeignPlatform) as e:
        refuse_foreign(BuildRequest("/ctx", "t:1"), platforms.ARM64)
    assert isinstance(e.value, BuildError) and "(linux/arm64), not linux/amd64" in e.value.message
