"""doctor: the driver table, nvidia-smi parsing (hostile output too), and the per-cell verdicts
for several driver versions. The real run on this host is in tests/integration/test_doctor_bench.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from imagefactory.tools import doctor
from imagefactory.config import platforms
from imagefactory.tools.doctor import CANNOT, LIMITS, RUNS, Driver, EngineFacts
from imagefactory.engine.api import EngineInfo
from imagefactory.errors import DockerUnavailable
from imagefactory.config.model import Cell
from tests.fake_engine import World
from dataclasses import replace
from pathlib import Path
from tests.unit.helpers import run_cli
from tests.unit.helpers import hardening_project

TABLE = doctor.load_table()
ENGINE_OK = EngineFacts(reachable=True, version="27.3.1", api_version="1.47", nvidia_runtime=True)


def cell(cuda: str | None, python: str = "3.11", blas: str = "mkl", installer: str = "conda") -> Cell:
    accel = "cpu" if cuda is None else f"cu{cuda}"
    return Cell(python=python, cuda=cuda, blas=blas, installer=installer, torch="2.7.1", threads=4,
                base_image="debian:bookworm-slim", tags=(f"reg.example/ml/train:2.7.1-py{python}-{accel}-{blas}",))


CELLS = [cell(None), cell("11.8"), cell("12.6"), cell("12.9"), cell("13.0")]


def verdicts(driver: Driver, engine: EngineFacts = ENGINE_OK, cells=None) -> dict[str, doctor.CellVerdict]:
    return {v.cell: v for v in doctor.judge(cells or CELLS, driver, engine, TABLE)}


# -- the table ---------------------------------------------------------------------------------------

def test_shipped_table_has_the_release_note_minimums_and_sources():
    assert TABLE.toolkits == {"11.8": "520.61.05", "12.1": "530.30.02", "12.4": "550.54.14",
                              "12.6": "560.28.03", "12.8": "570.26", "12.9": "575.51.03", "13.0": "580.65.06"}
    assert TABLE.compat == {"11": "450.80.02", "12": "525.60.13", "13": "580"}
    assert TABLE.source("release-notes").startswith("https://docs.nvidia.com/cuda/")
    assert TABLE.source("compatibility").startswith("https://docs.nvidia.com/deploy/cuda-compatibility")


@pytest.mark.parametrize("mutate", [
    lambda d: d["toolkits"].update({"12.9": {"min_driver": "575.51.03 ", "source": "release-notes"}}),
    lambda d: d["toolkits"].update({"12.9": {"min_driver": "575.51.03", "source": "a blog"}}),
    lambda d: d["toolkits"].update({"12.x": {"min_driver": "575.51.03", "source": "release-notes"}}),
])
def test_malformed_table_is_refused(mutate):
    from importlib import resources
    data = json.loads(resources.files("imagefactory").joinpath("resources/cuda_drivers.json").read_text())
    mutate(data)
    with pytest.raises(ValueError, match="cuda_drivers.json"):
        doctor.load_table(json.dumps(data))


@pytest.mark.parametrize("text,expected", [
    ("575.51.03", (575, 51, 3)), ("570.26", (570, 26)), ("580", (580,)), (" 560.35.03\n", (560, 35, 3)),
    ("575.51.03x", None), ("575.51.03\n999", None), ("v575", None), ("575..1", None), ("", None),
    ("1.2.3.4", None), ("N/A", None),
])
def test_version_parsing_is_whole_string(text, expected):
    assert doctor.version_tuple(text) == expected


# -- nvidia-smi output -------------------------------------------------------------------------------

def test_parse_one_gpu():
    d = doctor.parse_nvidia_smi("560.35.03, NVIDIA GeForce RTX 4090\n")
    assert (d.version, d.gpus, d.ignored_lines, d.error) == ("560.35.03", ["NVIDIA GeForce RTX 4090"], 0, "")


def test_parse_eight_gpus_with_a_two_part_version():
    d = doctor.parse_nvidia_smi("".join("570.26, NVIDIA H100 80GB HBM3\n" for _ in range(8)))
    assert d.version == "570.26" and len(d.gpus) == 8


def test_hostile_output_is_ignored_line_by_line():
    out = ("WARNING: infoROM is corrupted at gpu 0000:01:00.0\n"
           "\n"
           "575.51.03, NVIDIA H200\n"
           "575.51.03; rm -rf /, NVIDIA H200\n"
           "999.99.99, Impostor GPU\n"  # a second, different driver version: not plausible
           "575.51.03, \x1b[31mred\x1b[0m\n"
           "\x00\xff garbage without a comma\n")
    d = doctor.parse_nvidia_smi(out)
    assert d.version == "575.51.03"
    assert d.gpus == ["NVIDIA H200", "(unreadable GPU name)"]
    assert d.ignored_lines == 4


@pytest.mark.parametrize("out", ["", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
                                 "N/A, N/A\n", "[Not Supported], Tesla T4\n"])
def test_output_without_a_version_is_no_driver(out):
    d = doctor.parse_nvidia_smi(out)
    assert d.version is None and "no driver version" in d.error


def test_nvidia_smi_failures_become_errors(monkeypatch):
    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def failing(*a, **k):
        return subprocess.CompletedProcess(a, 9, "NVIDIA-SMI has failed because it couldn't communicate\nmore\n", "")
    d = doctor.query_nvidia_smi(failing)
    assert d.version is None and d.error == "nvidia-smi exited 9: NVIDIA-SMI has failed because it couldn't communicate"

    def hanging(*a, **k):
        raise subprocess.TimeoutExpired("nvidia-smi", 20)
    assert "TimeoutExpired" in doctor.query_nvidia_smi(hanging).error

    ok = doctor.query_nvidia_smi(lambda *a, **k: subprocess.CompletedProcess(a, 0, "580.65.06, NVIDIA H200\n", ""))
    assert ok.version == "580.65.06"


def test_no_nvidia_smi_and_no_nvml(monkeypatch):
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    assert doctor.query_nvidia_smi().error == "nvidia-smi: not found"
    assert doctor.query_nvml("libnvidia-ml-not-here.so.1").error.startswith("NVML: ")


# -- verdicts for several drivers --------------------------------------------------------------------

def test_new_driver_runs_every_cell():
    v = verdicts(Driver("580.65.06", ["NVIDIA H200"]))
    assert {k: x.verdict for k, x in v.items()} == dict.fromkeys(v, RUNS)
    assert doctor.recommend(CELLS, list(v.values())) == CELLS[-1].tags[0]  # newest CUDA


def test_driver_560_runs_12_6_and_12_9_with_limits_and_not_13_0():
    v = verdicts(Driver("560.35.03", ["NVIDIA A100"]))
    assert v["py3.11-cu12.6-mkl-conda"].verdict == RUNS
    limited = v["py3.11-cu12.9-mkl-conda"]
    assert limited.verdict == LIMITS
    assert "driver 560.35.03 < 575.51.03 needed by CUDA 12.9" in limited.reason
    assert "minor-version compatibility" in limited.reason and "575.51.03" in limited.fix
    no = v["py3.11-cu13.0-mkl-conda"]
    assert no.verdict == CANNOT
    assert no.reason == "driver 560.35.03 < 580.65.06 needed by CUDA 13.0"
    assert no.fix == "upgrade the driver to 580.65.06 or newer, or use the cu12.6 cell (py3.11-cu12.6-mkl-conda)"
    assert doctor.recommend(CELLS, list(v.values())) == "reg.example/ml/train:2.7.1-py3.11-cu12.6-mkl"


def test_driver_575_is_below_13_0_minor_compatibility():
    v = verdicts(Driver("575.51.03", ["NVIDIA L4"]))
    assert v["py3.11-cu12.9-mkl-conda"].verdict == RUNS
    assert v["py3.11-cu13.0-mkl-conda"].verdict == CANNOT
    assert "cu12.9 cell" in v["py3.11-cu13.0-mkl-conda"].fix


def test_driver_520_runs_only_11_8():
    v = verdicts(Driver("520.61.05", ["Tesla V100"]))
    assert v["py3.11-cu11.8-mkl-conda"].verdict == RUNS
    for cid in ("py3.11-cu12.6-mkl-conda", "py3.11-cu12.9-mkl-conda"):
        assert v[cid].verdict == CANNOT and "cu11.8 cell" in v[cid].fix


def test_driver_470_runs_11_8_with_limits_only():
    v = verdicts(Driver("470.82.01", ["Tesla T4"]))
    assert v["py3.11-cu11.8-mkl-conda"].verdict == LIMITS
    assert all(v[c.id].verdict == CANNOT for c in CELLS if c.cuda and c.cuda != "11.8")
    assert "use the" not in v["py3.11-cu12.6-mkl-conda"].fix  # nothing runs fully: no alternative to offer
    assert doctor.recommend(CELLS, list(v.values())) == CELLS[1].tags[0]


def test_toolkit_missing_from_the_table_falls_back_to_minor_compatibility():
    cells = [cell("12.2")]
    assert verdicts(Driver("560.35.03"), cells=cells)["py3.11-cu12.2-mkl-conda"].verdict == LIMITS
    odd = verdicts(Driver("560.35.03"), cells=[cell("14.0")])["py3.11-cu14.0-mkl-conda"]
    assert odd.verdict == CANNOT and "not in imagefactory's driver table" in odd.reason


def test_no_gpu_cpu_cells_run_gpu_cells_cannot():
    v = verdicts(Driver(error="nvidia-smi: not found"), EngineFacts(reachable=True, version="20.10.24"))
    assert v["py3.11-cpu-mkl-conda"].verdict == RUNS
    gpu = v["py3.11-cu12.9-mkl-conda"]
    assert gpu.verdict == CANNOT and "no GPU" in gpu.reason
    assert gpu.fix == "run it on a node with an NVIDIA GPU and driver >= 575.51.03, or use a CPU cell (py3.11-cpu-mkl-conda)"
    assert doctor.recommend(CELLS, list(v.values())) == CELLS[0].tags[0]


def test_driver_without_container_runtime_or_cdi_cannot_give_containers_a_gpu():
    engine = EngineFacts(reachable=True, version="27.3.1", nvidia_runtime=False, cdi=False)
    v = verdicts(Driver("580.65.06", ["NVIDIA H200"]), engine)
    gpu = v["py3.11-cu12.9-mkl-conda"]
    assert gpu.verdict == CANNOT and "no NVIDIA runtime or CDI" in gpu.reason and "nvidia-ctk" in gpu.fix
    with_cdi = verdicts(Driver("580.65.06", ["NVIDIA H200"]),
                        EngineFacts(reachable=True, version="27.3.1", cdi=True))
    assert with_cdi["py3.11-cu12.9-mkl-conda"].verdict == RUNS


def test_cdi_spec_is_found_in_the_engines_spec_dirs(tmp_path):
    assert doctor._cdi_specs((str(tmp_path),)) is False
    (tmp_path / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    assert doctor._cdi_specs((str(tmp_path / "missing"), str(tmp_path))) is True


# -- engine facts, exit codes and text --------------------------------------------------------------

def test_engine_facts_read_version_and_runtime_and_refuse_odd_strings():
    facts = doctor.engine_facts(World(info=EngineInfo("27.3.1", "1.47", ("nvidia", "runc"), ())).engine)
    assert (facts.reachable, facts.version, facts.api_version, facts.nvidia_runtime) == (True, "27.3.1", "1.47", True)
    odd = doctor.engine_facts(World(info=EngineInfo("27.3.1\n\x1b[2J", "1.47; x", ("runc",), ())).engine)
    assert (odd.version, odd.api_version, odd.nvidia_runtime) == ("(unreadable)", "(unreadable)", False)


def test_engine_facts_name_the_store_and_what_follows():
    new = doctor.engine_facts(World(info=EngineInfo("26.1.5+dfsg1", "1.45", ("runc",), (), store="containerd",
                                                    driver="overlayfs")).engine)
    assert (new.store, new.driver, new.multi_platform, new.zstd_pulls) == ("containerd", "overlayfs", True, True)
    line = doctor.store_line(new)
    assert "containerd image store" in line and "multi-platform" in line and "pulls zstd" in line
    old = doctor.engine_facts(World(info=EngineInfo("20.10.24+dfsg1", "1.41", ("runc",), (), store="graph-driver",
                                                    driver="overlay2")).engine)
    assert (old.store, old.multi_platform, old.zstd_pulls) == ("graph-driver", False, False)
    assert "graph driver overlay2" in doctor.store_line(old) and "cannot pull zstd" in doctor.store_line(old)
    # Docker 23 and later unpack zstd in the graph-driver store too
    mid = doctor.engine_facts(World(info=EngineInfo("28.2.2", "1.50", ("runc",), (), store="graph-driver",
                                                    driver="overlay2")).engine)
    assert (mid.multi_platform, mid.zstd_pulls) == (False, True)
    odd = doctor.engine_facts(World(info=EngineInfo("27.3.1", "1.47", ("runc",), (), store="zfs\x1b[2J",
                                                    driver="overlay2\n\x1b[2J")).engine)
    assert (odd.store, odd.driver, odd.multi_platform) == ("", "(unreadable)", False)
    assert "\x1b" not in doctor.store_line(odd)


def test_exit_codes():
    def unreachable():
        raise DockerUnavailable("no Docker engine answered at unix:///x")
    gone = doctor.diagnose(None, engine_factory=unreachable, driver_query=lambda: Driver(error="nvidia-smi: not found"))
    assert gone.exit_code == 3 and gone.to_json()["engine"]["error"].startswith("no Docker engine answered")

    from imagefactory.config.model import Matrix
    m = Matrix(path=Path("/x/matrix.yaml"), image="reg.example/ml/train", cells=tuple(CELLS))
    here = World(info=EngineInfo("27.3.1", "1.47", ("nvidia",), ())).engine
    assert doctor.diagnose(m, engine_factory=here, driver_query=lambda: Driver("580.65.06", ["H200"]),
                           machine="x86_64").exit_code == 0
    assert doctor.diagnose(m, engine_factory=here, driver_query=lambda: Driver("560.35.03", ["A100"]),
                           machine="x86_64").exit_code == 1
    assert doctor.diagnose(None, engine_factory=here, driver_query=lambda: Driver(error="none")).exit_code == 0


def test_text_says_plainly_there_is_no_gpu():
    report = doctor.Report(engine=ENGINE_OK, driver=Driver(error="nvidia-smi: not found"), matrix=None,
                           cells=[], recommended=None)
    out = doctor.text(report)
    assert "only CPU cells can run here" in out and "host facts only" in out


# -- the host's platform -----------------------------------------------------------------------------

def pip_cell(platform: platforms.Platform, cuda: str | None = None) -> Cell:
    accel = "cpu" if cuda is None else f"cu{cuda}"
    return Cell(python="3.11", cuda=cuda, blas="openblas", installer="pip", torch="2.10.0", threads=4,
                base_image="python:3.11-slim-bookworm", platform=platform,
                tags=(f"reg.example/ml/train:{platform.arch}-2.10.0-py3.11-{accel}-openblas-pip",))


BOTH = [pip_cell(platforms.AMD64), pip_cell(platforms.ARM64), pip_cell(platforms.AMD64, "12.9"),
        pip_cell(platforms.ARM64, "12.9")]


def _diagnose(cells: list[Cell], machine: str, driver: Driver = Driver("580.65.06", ["H200"])) -> doctor.Report:

    from imagefactory.config.model import Matrix
    m = Matrix(path=Path("/x/matrix.yaml"), image="reg.example/ml/train", cells=tuple(cells))
    here = World(info=EngineInfo("27.3.1", "1.47", ("nvidia",), ())).engine
    return doctor.diagnose(m, engine_factory=here, driver_query=lambda: driver, machine=machine)


def test_a_cell_of_another_platform_cannot_run_here_and_says_why():
    report = _diagnose(BOTH, "x86_64")
    v = {x.cell: x for x in report.cells}
    arm = v["py3.11-cpu-openblas-pip-arm64"]
    assert arm.verdict == CANNOT
    assert arm.reason == "linux/arm64 image on a linux/amd64 host: runs only emulated (QEMU), not for training here"
    assert arm.fix == "run it on a linux/arm64 node, or use the linux/amd64 cell (py3.11-cpu-openblas-pip)"
    assert v["py3.11-cu12.9-openblas-pip-arm64"].verdict == CANNOT
    assert v["py3.11-cpu-openblas-pip"].verdict == RUNS and v["py3.11-cu12.9-openblas-pip"].verdict == RUNS
    assert report.exit_code == 1  # a refusal, as for a driver too old
    assert report.recommended == BOTH[2].tags[0]


def test_on_an_arm64_host_the_amd64_cells_are_refused_and_an_arm64_tag_is_recommended():
    report = _diagnose(BOTH, "aarch64", Driver(error="nvidia-smi: not found"))
    v = {x.cell: x for x in report.cells}
    assert v["py3.11-cpu-openblas-pip"].verdict == CANNOT
    assert "linux/amd64 image on a linux/arm64 host: runs only emulated (QEMU)" in v["py3.11-cpu-openblas-pip"].reason
    assert v["py3.11-cpu-openblas-pip-arm64"].verdict == RUNS
    assert "use a CPU cell (py3.11-cpu-openblas-pip-arm64)" in v["py3.11-cu12.9-openblas-pip-arm64"].fix
    assert report.recommended == BOTH[1].tags[0]  # never the amd64 CPU tag, though it comes first


def test_the_host_architecture_is_in_text_and_json():
    report = _diagnose(BOTH, "aarch64")
    assert report.to_json()["host"] == {"machine": "aarch64", "platform": "linux/arm64"}
    out = doctor.text(report)
    assert out.startswith("host:     linux/arm64 (uname -m: aarch64)\n")
    assert "py3.11-cpu-openblas-pip  " in out and "linux/amd64 image on a linux/arm64 host" in out


@pytest.mark.parametrize("machine,shown", [("riscv64", "riscv64"), ("x86_64\x1b[2J", "(unreadable)"), ("", "(unreadable)")])
def test_a_host_of_no_known_platform_runs_no_cell_and_its_machine_is_shown_checked(machine, shown):
    report = _diagnose(BOTH[:1], machine)
    assert report.to_json()["host"] == {"machine": shown, "platform": None}
    (v,) = report.cells
    assert v.verdict == CANNOT and f"linux/amd64 image on a {shown} (not a platform imagefactory builds) host" in v.reason
    assert report.exit_code == 1 and "\x1b" not in doctor.text(report)


# -- launch flags --------------------------------------------------------------------------------------

GiB = 2**30


def diagnosed(info: EngineInfo, driver: Driver) -> doctor.Report:
    return doctor.diagnose(None, engine_factory=World(info=info).engine, driver_query=lambda: driver)


def test_launch_flags_for_a_gpu_node_with_the_nvidia_runtime():
    report = diagnosed(EngineInfo("27.3.1", "1.47", ("nvidia", "runc"), (), cpus=64), Driver("580.65.06", ["H200"] * 8))
    flags = report.launch
    assert flags is not None and flags.shm == ["--ipc=host"] and flags.gpus == ["--gpus", "all"]
    assert flags.cpus == ["--cpuset-cpus=0-31"]
    assert flags.line == "docker run --ipc=host --gpus all IMAGE python train.py"
    data = report.to_json()["launch"]
    assert data["line"] == flags.line and data["gpus"] == ["--gpus", "all"]
    out = doctor.text(report)
    assert "launch:   docker run --ipc=host --gpus all IMAGE" in out
    assert "--shm-size=" in out and "emptyDir with medium: Memory mounted at /dev/shm" in out
    assert "64 on this host" in out and "--cpus=32" in out


def test_launch_flags_through_cdi_and_without_any_gpu_plumbing(tmp_path):
    (tmp_path / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    cdi = diagnosed(EngineInfo("27.3.1", "1.47", ("runc",), (str(tmp_path),), cpus=8), Driver("580.65.06", ["L4"]))
    assert cdi.launch is not None and cdi.launch.gpus == ["--device", "nvidia.com/gpu=all"]
    bare = diagnosed(EngineInfo("27.3.1", "1.47", ("runc",), (), cpus=8), Driver("580.65.06", ["L4"]))
    assert bare.launch is not None and bare.launch.gpus == []
    assert any("nvidia-ctk" in n for n in bare.launch.notes)  # the fix, not a flag that cannot work


def test_launch_flags_on_a_cpu_node():
    report = diagnosed(EngineInfo("20.10.24", "1.41", ("runc",), (), cpus=2), Driver(error="nvidia-smi: not found"))
    assert report.launch is not None and report.launch.gpus == [] and report.launch.cpus == ["--cpuset-cpus=0"]
    assert "GPUs: none (no NVIDIA GPU here)" in doctor.text(report)
    odd = diagnosed(EngineInfo("20.10.24", "1.41", ("runc",), (), cpus=-3), Driver(error="none"))
    assert odd.engine.cpus == 0 and odd.launch is not None and odd.launch.cpus == []


def test_shm_size_is_a_quarter_of_memory_and_at_least_1g():
    facts = doctor.EngineFacts(reachable=True, cpus=4)
    assert "--shm-size=16g" in doctor.launch_flags(facts, Driver(error="x"), memory=64 * GiB).notes[0]
    assert "--shm-size=1g" in doctor.launch_flags(facts, Driver(error="x"), memory=2 * GiB).notes[0]


def test_no_launch_flags_without_an_engine():
    def unreachable():
        raise DockerUnavailable("no Docker engine answered at unix:///x")
    gone = doctor.diagnose(None, engine_factory=unreachable, driver_query=lambda: Driver(error="none"))
    assert gone.launch is None and gone.to_json()["launch"] is None and "launch:" not in doctor.text(gone)


# -- moved from test_caught_mutants.py ----------------------------------------


def gpu_cell(cuda: str | None) -> Cell:
    accel = "cpu" if cuda is None else f"cu{cuda}"
    return Cell(python="3.11", cuda=cuda, blas="mkl", installer="conda", torch="2.7.1", threads=4,
                base_image="debian:bookworm-slim", tags=(f"reg.example/ml/train:py3.11-{accel}",))


def test_a_driver_field_with_more_digits_is_newer():
    """Mutant: versions compared as strings: '580.105.08' < '580.65.06', so a driver newer than
    CUDA 13.0's minimum was judged too old (limits only) and another tag recommended."""
    cells = [gpu_cell(None), gpu_cell("12.9"), gpu_cell("13.0")]
    assert TABLE.toolkits["13.0"] == "580.65.06"
    v = {x.cuda: x for x in doctor.judge(cells, Driver("580.105.08", ["NVIDIA H200"]), ENGINE_OK, TABLE)}
    assert v["13.0"].verdict == RUNS and v["13.0"].reason == "driver 580.105.08 >= 580.65.06 needed by CUDA 13.0"
    assert doctor.recommend(cells, list(v.values())) == "reg.example/ml/train:py3.11-cu13.0"
    older = {x.cuda: x for x in doctor.judge(cells, Driver("580.9.1", ["NVIDIA H200"]), ENGINE_OK, TABLE)}
    assert older["13.0"].verdict == LIMITS  # 580.9 < 580.65 as numbers, '580.9' > '580.65' as text


def test_the_newest_cuda_is_the_numerically_newest():
    """Mutant: CUDA versions compared as strings ('12.9' > '12.10') names an older cell's tag."""
    table = replace(TABLE, toolkits={**TABLE.toolkits, "12.10": "580.65.06"})
    cells = [gpu_cell("12.9"), gpu_cell("12.10"), gpu_cell("13.0")]
    v = doctor.judge(cells, Driver("580.65.06", ["NVIDIA H200"]), ENGINE_OK, table)
    assert {x.verdict for x in v} == {RUNS}
    assert doctor.recommend(cells[:2], v[:2]) == "reg.example/ml/train:py3.11-cu12.10"
    too_old = {x.cuda: x for x in doctor.judge(cells, Driver("450.80.02", ["T4"]), ENGINE_OK, table)}
    assert too_old["12.10"].verdict == CANNOT


# -- moved from test_hardening_iii.py ----------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


def test_doctor_prints_docker_host_escaped(project, monkeypatch, capsys):
    from imagefactory.tools import doctor

    report = doctor.Report(engine=doctor.EngineFacts(reachable=True, version="20.10.24", api_version="1.41"),
                           driver=doctor.Driver(error="none"), matrix=None, cells=[], recommended=None,
                           docker_host="tcp://h\x1b[2J:2375")
    monkeypatch.setattr(doctor, "diagnose", lambda m: report)
    code, out, err = run_cli(["doctor"], monkeypatch, capsys)
    assert "\x1b" not in out and "tcp://h\\x1b[2J:2375" in out


def test_doctor_says_whether_this_node_can_pull_the_zstd_the_matrix_pushes(write_matrix):
    from imagefactory.config import matrix

    m = matrix.load(write_matrix('image: registry.example.com/ml/train\nmatrix: {python: ["3.11"], cuda: ["none"], '
                                 'blas: [openblas], installer: [pip]}\ntorch: "2.13.0"\ncompression: zstd\n'))
    old = World(info=EngineInfo("20.10.24", "1.41", ("runc",), (), store="graph-driver")).engine
    report = doctor.diagnose(m, engine_factory=old, driver_query=lambda: Driver(error="none"))
    assert report.zstd_registries == ["registry.example.com"] and report.to_json()["zstd_registries"]
    assert "zstd layers, which this engine CANNOT pull" in doctor.text(report)
    new = World(info=EngineInfo("26.1.5", "1.45", ("runc",), (), store="containerd")).engine
    assert "this engine pulls them" in doctor.text(doctor.diagnose(m, engine_factory=new,
                                                                  driver_query=lambda: Driver(error="none")))
    gzip_only = doctor.diagnose(matrix.load(write_matrix(m.path.read_text().replace("compression: zstd\n", ""))),
                                engine_factory=old, driver_query=lambda: Driver(error="none"))
    assert gzip_only.compression is None and "zstd" not in doctor.text(gzip_only).split("matrix:")[1]
    assert gzip_only.lazy is None and "eStargz" not in doctor.text(gzip_only)


def test_doctor_says_whether_this_node_pulls_the_matrixs_estargz_lazily(write_matrix):
    from imagefactory.config import matrix

    m = matrix.load(write_matrix('image: registry.example.com/ml/train\nmatrix: {python: ["3.11"], cuda: ["none"], '
                                 'blas: [openblas], installer: [pip]}\ntorch: "2.13.0"\ncompression: estargz\n'))

    def report(info: EngineInfo) -> doctor.Report:
        return doctor.diagnose(m, engine_factory=World(info=info).engine, driver_query=lambda: Driver(error="none"))

    lazy = report(EngineInfo("26.1.5", "1.45", ("runc",), (), store="containerd", driver="stargz"))
    assert lazy.estargz_registries == ["registry.example.com"] and lazy.to_json()["estargz_registries"]
    assert lazy.engine.lazy_pulls and "get eStargz layers; this engine pulls them lazily" in doctor.text(lazy)
    assert lazy.compression is None  # no zstd line: eStargz is gzip to every launcher
    whole = report(EngineInfo("26.1.5", "1.45", ("runc",), (), store="containerd", driver="overlayfs"))
    old = report(EngineInfo("20.10.24", "1.41", ("runc",), (), store="graph-driver", driver="stargz"))
    for r in (whole, old):  # a graph driver named stargz is not the snapshotter
        assert not r.engine.lazy_pulls and "pulls them whole, as gzip" in doctor.text(r)
