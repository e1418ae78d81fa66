"""Issue 25 (Hardening III): logins, paths, flags and the environment, the launch hook, two
regressions, and the planted bugs the suite missed. Each test names the item it holds to."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import pytest

from imagefactory.engine import logins
from imagefactory.config import cacerts
from imagefactory.cli import app as cli
from imagefactory.cli import options, preflight
from imagefactory.files import fsutil
from imagefactory.files import bounded
from imagefactory.engine import environment
from imagefactory.files import terminal
from imagefactory.files import yamlfile
from imagefactory.config import matrix
from imagefactory.config import netrc
from imagefactory.probe import smoke
from imagefactory.errors import ConfigError
from tests.unit.helpers import run_cli

PIP = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
torch: "2.13.0"
pip:
  index_url: https://pkgs.example.com/simple
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    for name in ("NETRC", "DOCKER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")  # never the real engine
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("IMAGEFACTORY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "matrix.yaml").write_text(PIP)
    return tmp_path


def one_error(args: list[str], monkeypatch, capsys, code: int = 2) -> str:
    """The command exits `code` with one printable error line."""
    got, out, err = run_cli(args, monkeypatch, capsys)
    assert got == code, err
    (line,) = err.splitlines()
    assert line.startswith("error: ") and line.isprintable(), line
    return line


def nothing_written(root: Path) -> None:
    assert sorted(p.name for p in root.iterdir()) == ["matrix.yaml"] or not (root / "build").exists()


# --------------------------------------------------------------------------- 1. what may be a netrc

def test_proc_self_environ_is_not_a_netrc_directly_or_through_a_linked_folder(tmp_path):
    os.symlink("/proc/self", tmp_path / "me")
    for path in (Path("/proc/self/environ"), tmp_path / "me" / "environ"):
        with pytest.raises(ConfigError, match="pseudo file system"):
            netrc.load(path)


def test_an_environment_value_saying_default_never_makes_a_default_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEFACTORY_PROBE", "x default y")
    os.symlink("/proc", tmp_path / "p")
    with pytest.raises(ConfigError, match="pseudo file system"):
        netrc.load(tmp_path / "p" / str(os.getpid()) / "environ")


@pytest.mark.parametrize("where", ["/dev/null", "/sys/kernel/notes"])
def test_devices_and_sysfs_are_not_a_netrc(where):
    if not os.path.exists(where):
        pytest.skip(f"{where} is not here")
    with pytest.raises(ConfigError, match="pseudo file system"):
        netrc.load(Path(where))


def test_a_kubernetes_secret_volume_and_a_dotfile_link_are_accepted(tmp_path):
    """A secret volume: netrc -> ..data/netrc, ..data -> ..2026_12_01/; a dotfile manager: a link."""
    stamp = tmp_path / "..2026_12_01"
    stamp.mkdir()
    (stamp / "netrc").write_text("machine pkgs.example.com login a password b\n")
    os.symlink(stamp.name, tmp_path / "..data")
    os.symlink("..data/netrc", tmp_path / "netrc")
    got = netrc.load(tmp_path / "netrc")
    assert got.hosts == {"pkgs.example.com"}
    assert got.path == stamp.resolve() / "netrc"  # what is mounted is the file, not the link
    dot = tmp_path / "dotfiles"
    dot.mkdir()
    (dot / "netrc").write_text("machine x.example.com login a password b\n")
    os.symlink(dot / "netrc", tmp_path / ".netrc")
    assert netrc.load(tmp_path / ".netrc").hosts == {"x.example.com"}


# --------------------------------------------------------------------------- 2. netrc's grammar

@pytest.mark.parametrize("text, hosts", [
    ("machine\npkgs.example.com login a password b\n", {"pkgs.example.com"}),
    ('machine "pkgs.example.com" login a password b\n', {"pkgs.example.com"}),
    ("machine a.example.com login u password machine\n", {"a.example.com"}),
    ("machine a.example.com login u password default\n", {"a.example.com"}),
    ('machine a.example.com login u password "x machine b.example.com"\n', {"a.example.com"}),
    ("machine a.example.com\n  login u\n  password\n    default\nmachine b.example.com password p\n",
     {"a.example.com", "b.example.com"}),
    ("# machine c.example.com\nmachine a.example.com password p\n", {"a.example.com"}),
    ("macdef init\nmachine m.example.com\n\nmachine a.example.com password p\n", {"a.example.com"}),
    ("machine a.example.com password p\ndefault login x password y\n", {"a.example.com", netrc.ANY_HOST}),
])
def test_hosts_are_read_with_netrcs_grammar(text, hosts):
    assert netrc.hosts(text) == hosts


def test_the_scan_agrees_with_pythons_netrc(tmp_path):
    import netrc as stdlib

    text = ('machine\n"a.example.com" login u password machine\nmachine b.example.com login "v w" password '
            'default\ndefault login d password "machine c.example.com"\n')
    (tmp_path / "n").write_text(text)
    (tmp_path / "n").chmod(0o600)
    parsed = stdlib.netrc(str(tmp_path / "n"))
    want = set(parsed.hosts) | ({netrc.ANY_HOST} if "default" in parsed.hosts else set())
    assert netrc.hosts(text) == {h for h in want if h != "default"} | {netrc.ANY_HOST}


def test_a_netrc_with_nul_bytes_is_refused(tmp_path):
    (tmp_path / "n").write_bytes(b"machine a.example.com\0 password p\n")
    with pytest.raises(ConfigError, match="NUL"):
        netrc.load(tmp_path / "n")


def test_the_token_scan_is_bounded():
    with pytest.raises(ValueError, match="more than"):
        netrc.hosts("x " * (netrc.MAX_TOKENS + 1))


@pytest.mark.parametrize("source", ["NETRC", "HOME"])
def test_a_login_in_netrc_or_home_refuses_a_classic_build_as_the_flag_does(project, monkeypatch, capsys, source):
    text = "machine pkgs.example.com login a password b\n"
    if source == "NETRC":
        (project / "logins").write_text(text)
        monkeypatch.setenv("NETRC", str(project / "logins"))
    else:
        (project / "home").mkdir()
        (project / "home" / ".netrc").write_text(text)
    line = one_error(["build", "--builder", "classic"], monkeypatch, capsys)
    assert "installs from pkgs.example.com" in line and "classic builder has no build secrets" in line
    assert not (project / "build").exists()


# --------------------------------------------------------------------------- 3, 12. listings

def test_a_default_entry_refusal_names_hosts_not_characters(project, monkeypatch, capsys):
    (project / "logins").write_text("default login a password b\n")
    line = one_error(["build", "--builder", "classic", "--netrc", "logins"], monkeypatch, capsys)
    assert "installs from download.pytorch.org, pkgs.example.com, whose login" in line and "i, t, s" not in line


def test_listing_takes_names_never_one_string():
    assert terminal.listing(["a", "b"]) == "a, b"
    assert terminal.listing([], empty="nothing") == "nothing"
    assert terminal.listing([str(i) for i in range(20)], limit=3) == "0, 1, 2 and 17 more"
    with pytest.raises(TypeError):
        terminal.listing("its indexes")  # type: ignore[arg-type]


def test_ten_thousand_unknown_only_ids_are_twenty_lines_and_a_count(project, monkeypatch, capsys):
    args = ["list"] + [a for i in range(10_000) for a in ("--only", f"nope{i}")]
    code, out, err = run_cli(args, monkeypatch, capsys)
    lines = err.splitlines()
    assert code == 2 and len(lines) == yamlfile.MAX_PROBLEMS + 1
    assert lines[-1] == f"error: {10_000 - yamlfile.MAX_PROBLEMS} more problems not shown"


def test_a_typo_against_240_cells_is_one_bounded_line(project, monkeypatch, capsys):
    variants = ", ".join(f"v{i}" for i in range(12))
    (project / "matrix.yaml").write_text(
        PIP.replace('python: ["3.11"]', 'python: ["3.10", "3.11", "3.12", "3.13", "3.14"]')
        .replace("blas: [openblas]", "blas: [openblas, mkl]")
        .replace("installer: [pip]", f"installer: [pip, conda]\n  variant: [{variants}]")
        + "  numpy_index_url: https://pkgs.example.com/mkl/simple\n")
    n = len(matrix.load(project / "matrix.yaml").cells)
    assert n == 240
    line = one_error(["list", "--only", "py3.11-cpu-openblas-pipp"], monkeypatch, capsys)
    assert len(line) < terminal.MAX_LINE and f"and {n - terminal.MAX_LISTED} more" in line


# --------------------------------------------------------------------------- 4, 7. nothing printed raw

def test_the_warning_itself_reaches_the_terminal_escaped(project, monkeypatch, capsys):
    bad = project / "n\x1b[31m\x07"
    bad.write_text("machine other.example.com login a password b\n")
    monkeypatch.setattr(cli, "_run", _no_engine)
    code, out, err = run_cli(["build", "--builder", "classic", "--netrc", str(bad)], monkeypatch, capsys)
    assert "warning: netrc" in err and "names no host" in err
    assert "\x1b" not in err + out and "\x07" not in err + out and "\\x1b[31m\\x07" in err


def _no_engine(*args, **kwargs):
    from imagefactory.errors import ImageFactoryError

    raise ImageFactoryError("stopped before the engine (test)")


def test_render_prints_its_out_path_escaped(project, monkeypatch, capsys):
    out_dir = project / "o\x1b]0;owned\x07x"
    code, out, err = run_cli(["render", "--out", str(out_dir)], monkeypatch, capsys)
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;owned\\x07x" in out and "\t" in out


def test_doctor_prints_docker_host_escaped(project, monkeypatch, capsys):
    from imagefactory.tools import doctor

    report = doctor.Report(engine=doctor.EngineFacts(reachable=True, version="20.10.24", api_version="1.41"),
                           driver=doctor.Driver(error="none"), matrix=None, cells=[], recommended=None,
                           docker_host="tcp://h\x1b[2J:2375")
    monkeypatch.setattr(doctor, "diagnose", lambda m: report)
    code, out, err = run_cli(["doctor"], monkeypatch, capsys)
    assert "\x1b" not in out and "tcp://h\\x1b[2J:2375" in out


def test_the_escaping_stream_keeps_newlines_and_tabs_and_escapes_the_rest():
    assert terminal.printable_text("a\tb\nc") == "a\tb\nc"
    assert terminal.printable_text("\x1b[31mx\u202e\r") == "\\x1b[31mx\\u202e\\r"


# --------------------------------------------------------------------------- 5. lock files

@pytest.mark.parametrize("which", ["build/.imagefactory.lock", "build/.report.json.lock"])
def test_a_planted_lock_link_never_truncates_its_target(project, monkeypatch, capsys, which):
    victim = project / "precious.txt"
    victim.write_text("do not empty me\n")
    (project / "build").mkdir()
    os.symlink(victim, project / which)
    monkeypatch.setattr(cli, "_engine_environment", lambda: None)
    line = one_error(["build", "--builder", "classic"], monkeypatch, capsys)
    assert "symbolic link" in line and victim.read_text() == "do not empty me\n"


def test_a_lock_file_that_holds_something_else_is_not_truncated(tmp_path):
    other = tmp_path / "lock"
    other.write_text("someone's notes\n")
    with pytest.raises(ConfigError, match="not one imagefactory made"):
        fsutil.open_lock(other, "--work-dir x")
    assert other.read_text() == "someone's notes\n"
    os.link(other, tmp_path / "second-name")
    other.write_text("")
    with pytest.raises(ConfigError, match="hard link"):
        fsutil.open_lock(other, "--work-dir x")


def test_a_lock_file_a_run_left_is_reused(tmp_path):
    path = tmp_path / "lock"
    os.close(fsutil.open_lock(path, "x"))
    path.write_text("4242\n")
    os.close(fsutil.open_lock(path, "x"))
    assert stat.S_ISREG(os.lstat(path).st_mode)


# --------------------------------------------------------------------------- 6. unusable outputs

@pytest.mark.parametrize("args, flag", [
    (["--work-dir", "/proc/imagefactory"], "--work-dir"),
    (["--report", "/proc/self/report.json"], "--report"),
    (["--work-dir", "matrix.yaml"], "--work-dir"),
    (["--work-dir", "matrix.yaml/sub"], "--work-dir"),
    (["--report", "matrix.yaml"], "--report"),
    (["--report", "matrix.json"], "--report"),  # with the matrix in matrix.md: the summary would overwrite it
])
def test_an_unusable_work_dir_or_report_is_exit_2_naming_the_flag(project, monkeypatch, capsys, args, flag):
    if args[1] == "matrix.json":  # the Markdown summary beside it would overwrite a matrix.md
        (project / "matrix.yaml").rename(project / "matrix.md")
        args = ["--matrix", "matrix.md", *args]
    before = (project / ("matrix.md" if "matrix.md" in args else "matrix.yaml")).read_bytes()
    line = one_error(["build", "--builder", "classic", *args], monkeypatch, capsys)
    assert line.startswith(f"error: {flag} "), line
    assert (project / ("matrix.md" if "matrix.md" in args else "matrix.yaml")).read_bytes() == before
    assert not (project / "build").exists()


def test_a_report_that_is_the_matrix_file_through_a_link_is_refused(project, monkeypatch, capsys):
    os.symlink("matrix.yaml", project / "report.json")
    line = one_error(["test", "--report", "report.json"], monkeypatch, capsys)
    assert "is the matrix file" in line


# --------------------------------------------------------------------------- 8-11. flags

@pytest.mark.parametrize("value", ["", "a\nb", "--push", "type=registry,ref=x", "a b", "x" * 300])
def test_cache_from_is_an_image_reference(project, monkeypatch, capsys, value):
    line = one_error(["build", "--builder", "classic", "--cache-from", value], monkeypatch, capsys)
    assert line.startswith("error: --cache-from ") and "not an image reference" in line


def test_cache_from_takes_a_reference():
    assert preflight._cache_from(["registry.example.com/ml/train:2.13.0", "debian"]) == (
        "registry.example.com/ml/train:2.13.0", "debian")


@pytest.mark.parametrize("args", [["build", "--probe-timeout", "nan"], ["build", "--retry-delay", "nan"],
                                  ["build", "--probe-timeout", "inf"], ["bench", "--budget", "nan"],
                                  ["test", "--probe-timeout", "NaN"]])
def test_nan_and_inf_fail_the_float_flags(project, monkeypatch, capsys, args):
    line = one_error(args, monkeypatch, capsys)
    assert line.startswith(f"error: {args[1]} ") and "finite" in line


def test_every_float_flag_is_checked_for_nan():
    floats = [name for name, (kind, _) in options.FLAGS.items() if kind is float]
    assert floats and all(options.FLAGS[name][1].callback is options._finite for name in floats)
    assert not math.isfinite(float("nan"))


@pytest.mark.parametrize("given, kept", [("1G", "1g"), ("1g", "1g"), ("512M", "512m"), ("2gb", "2g"),
                                         ("1Gb", "1g"), ("host", "host"), ("default", "default")])
def test_probe_shm_takes_what_docker_takes(given, kept):
    assert smoke.check_shm(given) == kept


@pytest.mark.parametrize("bad", ["1", "0g", "1t", "1 g", "-1g", "1g\n", "HOST", "1gib"])
def test_probe_shm_still_refuses_what_is_not_a_size(bad):
    with pytest.raises(ConfigError):
        smoke.check_shm(bad)


def test_buildx_builder_under_the_classic_builder_is_refused(project, monkeypatch, capsys):
    line = one_error(["build", "--builder", "classic", "--buildx-builder", "remote"], monkeypatch, capsys)
    assert "--buildx-builder remote" in line and "--builder buildkit" in line


# --------------------------------------------------------------------------- 13-16. the environment

@pytest.mark.parametrize("value", ["tcp://[::1", "tcp://127.0.0.1:65536", "tcp://host:0", "unix://", "tcp://a b:1",
                                   "http://x:99999999", "ssh://", "tcp://h:1\n", "\x1b[31m"])
def test_a_malformed_docker_host_is_exit_2_naming_it(project, monkeypatch, capsys, value):
    monkeypatch.setenv("DOCKER_HOST", value)
    for args in (["build", "--builder", "classic"], ["doctor"]):
        line = one_error(args, monkeypatch, capsys)
        assert line.startswith("error: $DOCKER_HOST ") and "not an engine address" in line
    assert not (project / "build").exists()


@pytest.mark.parametrize("value", ["unix:///var/run/docker.sock", "tcp://127.0.0.1:2375", "tcp://[::1]:2375",
                                   "ssh://me@build-host", "ssh://build-host:2222", "tcp://docker:2376/"])
def test_a_well_formed_docker_host_passes(value):
    assert environment.docker_host({"DOCKER_HOST": value}) == value
    assert environment.docker_host({}) is None


def test_home_unset_for_a_uid_without_passwd_entry_is_exit_2_not_a_traceback(project, monkeypatch, capsys):
    import pwd

    monkeypatch.delenv("HOME")
    monkeypatch.delenv("IMAGEFACTORY_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    assert fsutil.home() is None and netrc.default_path() is None
    line = one_error(["build", "--builder", "classic"], monkeypatch, capsys)
    assert "$HOME is not set" in line and "IMAGEFACTORY_CACHE_DIR" in line
    code, out, err = run_cli(["list"], monkeypatch, capsys)  # a command that needs no cache still runs
    assert code == 0, err


@pytest.mark.parametrize("make", [lambda p: os.mkfifo(p), lambda p: p.write_bytes(b" " * (2 << 20)),
                                  lambda p: os.symlink("/dev/zero", p)])
def test_a_fifo_or_huge_docker_config_is_exit_2_not_a_hang(project, monkeypatch, capsys, make):
    folder = project / "dockercfg"
    folder.mkdir()
    make(folder / "config.json")
    monkeypatch.setenv("DOCKER_CONFIG", str(folder))
    line = one_error(["build", "--builder", "classic"], monkeypatch, capsys)
    assert line.startswith("error: $DOCKER_CONFIG/config.json ")
    assert not (project / "build").exists()


def test_no_buildx_answer_is_read_from_the_cache_folder(project, monkeypatch):
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


# --------------------------------------------------------------------------- 17-19, 23, 24. the matrix

def write(project: Path, text: str) -> Path:
    (project / "matrix.yaml").write_text(text)
    return project / "matrix.yaml"


def refused(project: Path, text: str, monkeypatch, capsys) -> str:
    write(project, text)
    line = one_error(["list"], monkeypatch, capsys)
    assert line.startswith("error: matrix.yaml:"), line
    return line


def test_registries_that_map_to_one_credential_variable_are_refused(project, monkeypatch, capsys):
    line = refused(project, PIP + "tags:\n  registries: [reg-a.example.com, reg.a.example.com]\n", monkeypatch, capsys)
    assert "tags.registries" in line and "IMAGEFACTORY_REGISTRY_USER_REG_A_EXAMPLE_COM" in line


def test_the_credential_mapping_is_one_to_one_for_a_loaded_matrix(project):
    from imagefactory.config import tags

    m = matrix.load(write(project, PIP + "tags:\n  registries: [a.example.com, b.example.com:5000, Other.Example.NET]\n"))
    suffixes = [tags.env_suffix(r) for r in tags.allowed_registries(m)[1:]]
    assert len(set(suffixes)) == len(suffixes) and logins.env_suffix is tags.env_suffix


def test_the_schemas_tag_defaults_are_the_codes():
    from imagefactory.config.model import Matrix

    props = matrix.schema()["properties"]["tags"]["properties"]
    assert props["template"]["default"] == Matrix.tag_template
    assert props["hash_template"]["default"] == Matrix.hash_tag_template


VARIANTS = PIP.replace("  installer: [pip]", "  installer: [pip]\n  variant: [base, vision]\n  include:\n"
                       "    - {python: \"3.12\", cuda: none, blas: openblas, installer: pip, variant: visoin}")


def test_a_typod_variant_in_an_include_that_adds_a_cell_is_refused(project, monkeypatch, capsys):
    line = refused(project, VARIANTS, monkeypatch, capsys)
    assert "matrix.include[0].variant" in line and "'visoin' is not in matrix.variant" in line
    assert "did you mean 'vision'?" in line


def test_an_include_that_adds_a_cell_of_a_listed_variant_is_kept(project):
    m = matrix.load(write(project, VARIANTS.replace("variant: visoin", "variant: vision")))
    assert "py3.12-cpu-openblas-pip-vision" in [c.id for c in m.cells]


@pytest.mark.parametrize("doc", ["labels: &l {a: *l}\n", "labels: &l [*l]\n", "env: &e {A: {B: *e}}\n"])
@pytest.mark.parametrize("command", ["list", "render"])
def test_a_recursive_alias_is_refused_cleanly(project, monkeypatch, capsys, doc, command):
    write(project, PIP + doc)
    line = one_error([command], monkeypatch, capsys)
    assert "recursive alias" in line and line.startswith("error: matrix.yaml:")
    assert not (project / "build").exists()


@pytest.mark.parametrize("packages, bad", [
    ('["scipy==1.11.0", "scipy==1.13.0"]', True),
    ('["scipy==1.11.0", "SciPy>=1.13"]', True),
    ('["scipy==1.11.0", "scipy>=1.10"]', False),
    ('["scipy>=1.11", "scipy<2"]', False),
])
def test_two_pins_of_one_package_are_refused(project, monkeypatch, capsys, packages, bad):
    text = PIP + f"packages: {packages}\n"
    if bad:
        assert "no install can satisfy at once" in refused(project, text, monkeypatch, capsys)
    else:
        matrix.load(write(project, text))


def test_two_conda_pins_of_one_package_are_refused(project, monkeypatch, capsys):
    conda = PIP.replace("installer: [pip]", "installer: [conda]").split("pip:")[0]
    line = refused(project, conda + 'packages: ["scipy=1.11", "scipy=1.13"]\n', monkeypatch, capsys)
    assert "pin scipy" in line
    matrix.load(write(project, conda + 'packages: ["scipy=1.11", "scipy==1.11.2"]\n'))


# --------------------------------------------------------------------------- 20-22. the launch hook

def _hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_iii", Path(bounded.__file__).parents[1] / "resources" / "launch.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _finishes(fn, seconds: float = 10.0) -> bool:
    import threading

    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def test_a_fifo_for_cpu_max_or_the_settings_file_never_blocks_a_start(tmp_path):
    launch = _hook()
    root, prefix = tmp_path / "cgroup", tmp_path / "env"
    root.mkdir()
    os.mkfifo(root / "cpu.max")
    conf = prefix / "etc" / "imagefactory"
    conf.mkdir(parents=True)
    os.mkfifo(conf / "launch.conf")
    os.mkfifo(conf / "activation.conf")
    environ: dict[str, str] = {"HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    try:
        assert _finishes(lambda: launch.apply(environ, prefix=str(prefix), root=str(root)))
        assert _finishes(lambda: launch.cpu_budget(str(root)))
    finally:  # a copy that did block is released, so the test run itself ends
        for fifo in (root / "cpu.max", conf / "launch.conf", conf / "activation.conf"):
            fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
            os.close(fd)
    assert launch.read_conf(str(conf / "launch.conf")) == []


def test_the_settings_file_is_still_read_when_it_is_a_regular_file(tmp_path):
    launch = _hook()
    (tmp_path / "launch.conf").write_bytes(b"threads=auto\nHF_HOME=/data/hf\n")
    assert launch.read_conf(str(tmp_path / "launch.conf")) == [("threads", "auto"), ("HF_HOME", "/data/hf")]


# Item 20 (NUL bytes dropped, as a shell's `read` drops them) was reversed by issue 35: a NUL is a
# non-digit. Those rows are in the one table of the rule, tests/unit/thread_rule.py's CASES.


def _shared_tmp(tmp_path: Path) -> Path:
    """A sticky, world-writable temp dir (a host's /tmp bound in by Apptainer)."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    (tmp_path / "home-file").write_text("")  # HOME stands for an unwritable one: TORCH_HOME must move
    return shared


def _env(tmp_path: Path, shared: Path, launch) -> dict[str, str]:
    """The environment of a start whose only usable places are under tmp_path (no real /tmp)."""
    usable = launch._usable
    launch._usable = lambda path, *a, **k: str(path).startswith(str(tmp_path)) and usable(path, *a, **k)
    (tmp_path / "second").mkdir(exist_ok=True)
    return {"TMPDIR": str(shared), "TEMP": str(tmp_path / "second"), "HOME": str(tmp_path / "home-file")}


def test_a_cache_place_another_uid_made_first_is_never_used(tmp_path):
    launch = _hook()
    shared = _shared_tmp(tmp_path)
    uid = os.getuid()
    planted = shared / f"torch_uid{uid}"
    planted.mkdir()
    os.chown(planted, 4242, 4242)  # these tests run as root: stand in for another user
    got = launch.cache_dirs(_env(tmp_path, shared, launch), have_matplotlib=False)
    assert got["TORCH_HOME"] == str(tmp_path / "second" / f"torch_uid{uid}")  # the next place, its own


@pytest.mark.parametrize("plant", ["link", "world-writable"])
def test_a_linked_or_world_writable_cache_place_is_never_used(tmp_path, plant):
    launch = _hook()
    shared = _shared_tmp(tmp_path)
    leaf = shared / f"torch_uid{os.getuid()}"
    if plant == "link":
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", leaf)
    else:
        leaf.mkdir()
        leaf.chmod(0o777)
    got = launch.cache_dirs(_env(tmp_path, shared, launch), have_matplotlib=False)
    assert got["TORCH_HOME"] == str(tmp_path / "second" / leaf.name)


def test_a_cache_place_this_uid_makes_is_its_own_and_closed_to_others(tmp_path):
    launch = _hook()
    shared = _shared_tmp(tmp_path)
    got = launch.cache_dirs(_env(tmp_path, shared, launch), have_matplotlib=False)
    place = Path(got["TORCH_HOME"])
    st = os.lstat(place)
    assert place.parent == shared and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
    assert not st.st_mode & 0o022


# --------------------------------------------------------------------------- planted bugs the suite missed

def test_an_extra_tag_of_one_cell_equal_to_another_cells_release_tag_is_refused(project, monkeypatch, capsys):
    """Cell `a` gets a-g0000000 as its git-sha tag (the check's stand-in sha); cell `a-g0000000`
    has that as its release tag: one push would overwrite the other."""
    text = PIP.replace("  installer: [pip]", "  installer: [pip]\n  variant: [a, a-g0000000]") + (
        'tags:\n  template: "{image}:{variant}"\n  extra: [git-sha]\n')
    line = refused(project, text, monkeypatch, capsys)
    assert "would both be tagged 'registry.example.com/ml/train:a-g0000000'" in line


def test_a_ca_file_with_a_private_key_whose_begin_line_is_cut_off_is_refused(tmp_path):
    from tests.conftest import REPO

    cert = (REPO / "tests" / "golden" / "certs" / "corp-ca.pem").read_text()
    body = "MC4CAQAwBQYDK2VwBCIEIBm5nGyGzDNZm0Ql0sm6yAZdLS0rYH/3wNudt2Wv4nsC"
    (tmp_path / "ca.pem").write_text(cert + body + "\n-----END PRIVATE KEY-----\n")
    with pytest.raises(bounded.InputError, match="private key"):
        cacerts.certificates(tmp_path / "ca.pem")
    (tmp_path / "ca.pem").write_text(cert)
    assert cacerts.certificates(tmp_path / "ca.pem").startswith(b"-----BEGIN CERTIFICATE-----")


class _CacheEngine:
    """A registry that serves the content tag, and a local image (another one) with the label."""

    def __init__(self, pulled: str, labelled: list[str]):
        self.pulled, self.labelled, self.tagged = pulled, labelled, []

    def registry_digest(self, ref, *, auth_config=None):
        return "sha256:" + "a" * 64

    def pull(self, ref, *, auth_config=None):
        return self.pulled

    def images_with_label(self, key, value):
        return {i: [] for i in self.labelled}

    def tag(self, image, ref):
        self.tagged.append((image, ref))


def test_the_registry_cache_refuses_a_pulled_image_without_the_label_even_if_another_has_it(project):
    from imagefactory.pipeline import regcache

    m = matrix.load(project / "matrix.yaml")
    cell, lines = m.cells[0], []
    creds = {r: None for r in ("registry.example.com",)}
    other = _CacheEngine(pulled="sha256:pulled", labelled=["sha256:some-other-local-image"])
    assert regcache.pull_content(other, m, cell, "f" * 64, creds, lines.append) is None
    assert other.tagged == [] and "does not carry content hash" in lines[-1]
    same = _CacheEngine(pulled="sha256:pulled", labelled=["sha256:pulled"])
    assert regcache.pull_content(same, m, cell, "f" * 64, creds, lines.append) is not None


def test_an_hpc_probe_that_reports_no_launch_facts_fails_launch_conditions():
    from imagefactory.probe import checks

    expect = smoke.MODES["hpc"].expect()
    assert expect.get("root read-only") is True
    probe = {"user": {"uid": expect["uid"], "name": None}, "cpus": {"affinity": expect.get("CPUs (affinity)", 1)}}
    got = checks.launch_conditions(expect, probe)
    assert got.verdict == "fail" and "root read-only is None" in (got.detail or "")
    assert checks.launch_conditions(expect, {**probe, "launch": "garbage"}).verdict == "fail"


def test_tags_registries_names_are_normalised(project):
    from imagefactory.config import tags

    assert tags.registries("registry.example.com/ml/train", ("Other.Example.NET", "index.docker.io")) == (
        "registry.example.com", "other.example.net", "docker.io")
    text = PIP + ('tags:\n  registries: [Other.Example.NET, index.docker.io]\n'
                  '  template: "other.example.net/ml/train:{torch}-py{python}"\n')
    m = matrix.load(write(project, text))
    assert m.cells[0].tags == ("other.example.net/ml/train:2.13.0-py3.11",)
    assert tags.refusal("docker.io/ml/train:x", tags.allowed_registries(m)) is None
    assert tags.refusal("OTHER.example.net/ml/train:x", tags.allowed_registries(m)) is None


def test_a_stop_action_registered_after_an_interrupt_runs_at_once():
    from imagefactory.interrupt import Interrupt

    interrupt, ran = Interrupt(), []
    interrupt.cancel()
    with interrupt.on_cancel(lambda: ran.append("stopped")):
        assert ran == ["stopped"]
    assert ran == ["stopped"]  # once, not again on the way out


def test_a_signal_caught_just_before_the_scope_ends_is_not_lost(monkeypatch):
    """The stopper thread never gets to run here (as when the signal lands on the block's last
    line): the scope's exit itself must act on the pending signal."""
    import signal

    from imagefactory import interrupt as interrupt_mod

    class Idle:
        def __init__(self, *a, **k):
            pass

        def start(self):
            pass

        def join(self, timeout=None):
            pass

    monkeypatch.setattr(interrupt_mod.threading, "Thread", Idle)
    interrupt, ran = interrupt_mod.Interrupt(), []
    with interrupt.on_cancel(lambda: ran.append("stopped")):
        with interrupt.signals():
            signal.raise_signal(signal.SIGTERM)
        assert interrupt.is_set() and interrupt.signum == signal.SIGTERM and ran == ["stopped"]


@pytest.mark.parametrize("files, limit", [
    ({"cpu.max": "fifo", "cpu/cpu.cfs_quota_us": b"100000\n", "cpu/cpu.cfs_period_us": b"100000\n"}, (100000, 100000)),
    ({"cpu/cpu.cfs_quota_us": "fifo", "cpu/cpu.cfs_period_us": b"100000\n"}, None),
])
def test_every_copy_reads_a_fifo_as_it_reads_a_folder_without_waiting(tmp_path, files, limit):
    """A FIFO is not a regular file: each Python copy (hook, probe, workload) treats it as a file that
    cannot be read, as the shell's `[ -f ]` does, and never waits on it (a thread with a timeout, so
    a copy that blocks fails here instead of hanging the suite)."""
    import importlib.util

    root = tmp_path / "cgroup"
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(root / rel) if data == "fifo" else (root / rel).write_bytes(data)
    resources = Path(bounded.__file__).parents[1] / "resources"
    for name in ("launch.py", "probe.py", "workload.py"):
        spec = importlib.util.spec_from_file_location(f"iii_{name[:-3]}", resources / name)
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        got: list = []
        try:
            assert _finishes(lambda got=got, mod=mod: got.append(mod.cgroup_limit(str(root)))), name
        finally:
            for rel, data in files.items():
                if data == "fifo":
                    os.close(os.open(root / rel, os.O_RDWR | os.O_NONBLOCK))
        assert got == [limit], name
