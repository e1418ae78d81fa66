"""The launch carriers that do not depend on the ENTRYPOINT (resources/launch.py, installed as the
imagefactory_launch hook; dockerfiles/partials/launch_env.sh.j2, the shell copy) and the ONE CPU-budget
rule: every copy of it (the shell script under dash and bash, the entrypoint, the hook, the probe
read by checks.py, the bench workload) run on the same fake cgroup trees, and they must agree. The
table and the means to run each copy: tests/unit/thread_rule.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from imagefactory.probe import checks
from imagefactory.render import contexts
from tests.unit.helpers import CPU_OPENBLAS
from tests.unit.thread_rule import (
    AFFINITIES, AUTO_CELL, CASES, CPUS, REFUSED, RESOURCES, USER_VALUES, _run_hooked, _shell, _tree, launch,
    make_hooked_venv, probe, shell_copies, workload,
)
import stat
from imagefactory.files import bounded

@pytest.mark.parametrize("affinity", AFFINITIES)
@pytest.mark.parametrize("case, files, limit", CASES, ids=[c[0] for c in CASES])
def test_every_copy_of_the_cpu_budget_rule_agrees(tmp_path, monkeypatch, case, files, limit, affinity):
    root = _tree(tmp_path, files)
    want = max(1, affinity if limit is None else min(affinity, limit))
    got = {name: _shell(argv, affinity).strip() for name, argv in shell_copies(tmp_path, root).items()}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(CPUS[:affinity]))
    got["hook"] = str(launch.cpu_budget(root))
    got["hook threads"] = launch.thread_counts({}, root)["OMP_NUM_THREADS"]
    probe_cpus = {"affinity": affinity, "cgroup_quota": probe.cgroup_quota(root)}
    got["probe + checks"] = str(checks._thread_budget({"cpus": probe_cpus}))
    got["workload"] = str(workload.cpu_budget(root)["auto"])
    assert got == dict.fromkeys(got, str(want)), case


# -- user values: the shell copies and the hook treat them alike --------------------------------------

def _with_stderr(argv: list[str], env: dict[str, str]) -> tuple[str, str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    r = subprocess.run(argv, env={**base, **env}, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, (argv, r.stderr)
    return r.stdout, r.stderr


@pytest.mark.parametrize("given, want, said", USER_VALUES,
                         ids=[" ".join(f"{k}={v!r}" for k, v in g.items()) for g, _, _ in USER_VALUES])
def test_a_value_the_user_sets_wins_and_a_bad_one_is_left_alone(tmp_path, given, want, said):
    """Every copy (the shell script under dash and bash, the entrypoint, the hook): the same values
    and the same line on stderr."""
    root = _tree(tmp_path, {"cpu.max": b"100000 100000\n"})  # budget 1: "B" above
    want, said = want.replace("B", "1"), said.replace("=B", "=1") + ("\n" if said else "")
    show = 'printf "%s %s %s" "$OMP_NUM_THREADS" "$MKL_NUM_THREADS" "$OPENBLAS_NUM_THREADS"'
    script = tmp_path / "launch-env.sh"
    script.write_text(contexts.launch_env_text(AUTO_CELL, cgroup_root=root))
    entry = tmp_path / "entrypoint.sh"
    entry.write_text(contexts.entrypoint_text(AUTO_CELL, cgroup_root=root))
    got = {shell: _with_stderr([shell, "-c", '. "$0"; ' + show, str(script)], given) for shell in ("dash", "bash")}
    got["entrypoint"] = _with_stderr(["bash", str(entry), "sh", "-c", show], given)
    environ = dict(given)
    counts = launch.thread_counts(environ, root)
    line = launch.thread_warning(environ, counts)
    environ.update(counts)
    got["hook"] = (" ".join(environ[k] for k in launch.THREAD_VARS), line + "\n" if line else "")
    assert got == dict.fromkeys(got, (want, said))


def test_the_shell_script_survives_set_eu_and_leaves_no_helpers_behind(tmp_path):
    script = tmp_path / "launch-env.sh"
    script.write_text(contexts.launch_env_text(AUTO_CELL, cgroup_root=str(tmp_path / "none")))
    for shell in ("dash", "bash"):
        out = _shell([shell, "-euc", '. "$0"; set | grep -c "^_imagefactory" || true; command -v '
                      '_imagefactory_cpu_budget || echo gone', str(script)], 1)
        assert out.split() == ["0", "gone"], (shell, out)


def test_fixed_threads_are_the_image_env_and_activation_is_sourced(tmp_path):
    prefix = tmp_path / "env"
    (prefix / "etc" / "conda" / "activate.d").mkdir(parents=True)
    (prefix / "etc" / "conda" / "activate.d" / "x.sh").write_text("export MKL_INTERFACE_LAYER=LP64,GNU\necho noise\n")
    cell = replace(CPU_OPENBLAS, threads=4, env=(("HF_HOME", "/data/hf"),))
    text = contexts.launch_env_text(cell).replace("_imagefactory_prefix=/opt/venv",
                                                f"_imagefactory_prefix={prefix}")
    script = tmp_path / "launch-env.sh"
    script.write_text(text)
    show = '. "$0"; printf "%s|%s|%s|%s|%s" "$OMP_NUM_THREADS" "$HF_HOME" "$MKL_INTERFACE_LAYER" "$CONDA_PREFIX" "$PATH"'
    r = subprocess.run(["dash", "-c", show, str(script)], env={"PATH": "/usr/bin:/bin", "HF_HOME": "/mine"},
                       capture_output=True, text=True, timeout=30)
    assert r.stdout == f"4|/mine|LP64,GNU|{prefix}|/opt/venv/bin:/usr/bin:/bin", r
    assert r.stderr == "noise\n"  # activation chatter never reaches the command's stdout


# -- the hook in a real interpreter ------------------------------------------------------------------

@pytest.fixture(scope="module")
def hooked_venv(tmp_path_factory) -> Path:
    return make_hooked_venv(tmp_path_factory.mktemp("hooked") / "venv")


def test_hook_sizes_threads_and_applies_the_image_env_without_any_entrypoint(hooked_venv, tmp_path):
    out = _run_hooked(hooked_venv, {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, n=1)
    assert out["env"]["OMP_NUM_THREADS"] == out["env"]["MKL_NUM_THREADS"] == "1"
    assert out["env"]["HF_HOME"] == "/data/hf" and out["env"]["VIRTUAL_ENV"] == "/opt/venv"
    assert out["env"]["PATH"] == f"{hooked_venv}/bin:/usr/bin:/bin"
    assert out["state"]["error"] is None and out["state"]["budget"] == "1"
    if len(CPUS) > 1:
        assert _run_hooked(hooked_venv, {"PATH": "/usr/bin"}, n=len(CPUS))["env"]["OMP_NUM_THREADS"] == str(len(CPUS))


def test_hook_leaves_user_values_and_never_stops_python(hooked_venv, tmp_path):
    said = REFUSED + "OMP_NUM_THREADS; set instead: MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1\n"
    out = _run_hooked(hooked_venv, {"OMP_NUM_THREADS": "abc", "HF_HOME": "/mine", "PATH": f"{hooked_venv}/bin"},
                      stderr=said)
    assert out["env"]["OMP_NUM_THREADS"] == "abc" and out["env"]["MKL_NUM_THREADS"] == "1"
    assert out["state"]["warning"] == said.strip()
    assert out["env"]["HF_HOME"] == "/mine" and out["env"]["PATH"] == f"{hooked_venv}/bin"
    # No HOME at all, an unreadable settings folder replaced by a file: still starts, still sized.
    conf = hooked_venv / "etc" / "imagefactory" / "activation.conf"
    conf.mkdir()
    try:
        out = _run_hooked(hooked_venv, {})
        assert out["state"]["error"] is None and out["env"]["OMP_NUM_THREADS"] == "1"
    finally:
        conf.rmdir()


def test_hook_applies_captured_activation(hooked_venv, tmp_path):
    activate = hooked_venv / "etc" / "conda" / "activate.d"
    activate.mkdir(parents=True)
    (activate / "blas.sh").write_text("export MKL_INTERFACE_LAYER=LP64,GNU\nexport PATH=/opt/extra/bin:$PATH\necho hi\n")
    try:
        r = subprocess.run([hooked_venv / "bin" / "python", "-m", "imagefactory_launch", "capture"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out = _run_hooked(hooked_venv, {"PATH": "/usr/bin"})
        assert out["env"]["MKL_INTERFACE_LAYER"] == "LP64,GNU"
        assert out["env"]["PATH"].split(":")[:2] == ["/opt/extra/bin", f"{hooked_venv}/bin"]  # as activate.d does
        assert _run_hooked(hooked_venv, {"MKL_INTERFACE_LAYER": "ILP64"})["env"]["MKL_INTERFACE_LAYER"] == "ILP64"
    finally:
        shutil.rmtree(activate.parent.parent.parent / "etc" / "conda")
        (hooked_venv / "etc" / "imagefactory" / "activation.conf").unlink()


def test_hook_failure_is_recorded_not_raised(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(launch, "apply", boom)
    launch._start()
    assert launch.state["error"] == "RuntimeError: disk on fire"


def test_read_conf_refuses_malformed_lines(tmp_path):
    path = tmp_path / "launch.conf"
    path.write_bytes(b"# comment\nthreads=auto\nOK_1=a=b\n=x\n1BAD=x\nBAD-NAME=x\nno equals\n\xff\xfe=1\nNUL=a\0b\n")
    assert launch.read_conf(str(path)) == [("threads", "auto"), ("OK_1", "a=b")]
    assert launch.read_conf(str(tmp_path / "missing")) == []


# -- cache places -------------------------------------------------------------------------------------

def _noexec(monkeypatch, *paths: str) -> None:
    real = os.statvfs

    class Flags:
        def __init__(self, st):
            self.f_flag = st.f_flag | os.ST_NOEXEC

    monkeypatch.setattr(os, "statvfs", lambda p: Flags(real(p)) if str(p) in paths else real(p))


def test_caches_move_only_where_the_default_is_unusable(tmp_path, monkeypatch):
    tmp, home = tmp_path / "tmp", tmp_path / "home"
    tmp.mkdir()
    home.mkdir()
    uid = os.getuid()
    usable = {"TMPDIR": str(tmp), "HOME": str(home)}
    assert launch.cache_dirs(usable, have_matplotlib=True) == {}  # defaults usable: nothing changes
    # HOME unwritable (a file stands for it): Triton, torch hub and matplotlib go to the temp dir.
    ro_home = tmp_path / "file"
    ro_home.write_text("")
    got = launch.cache_dirs({"TMPDIR": str(tmp), "HOME": str(ro_home)}, have_matplotlib=True)
    assert got == {"TRITON_CACHE_DIR": f"{tmp}/triton_uid{uid}", "TORCH_HOME": f"{tmp}/torch_uid{uid}",
                   "MPLCONFIGDIR": f"{tmp}/matplotlib_uid{uid}"}
    assert "MPLCONFIGDIR" not in launch.cache_dirs({"TMPDIR": str(tmp)}, have_matplotlib=False)
    # A noexec temp dir: compiled code goes to the next place that is writable AND exec (HOME here).
    _noexec(monkeypatch, str(tmp), "/tmp", "/var/tmp", "/usr/tmp", "/dev/shm")
    got = launch.cache_dirs(usable, have_matplotlib=False)
    assert got == {"TORCHINDUCTOR_CACHE_DIR": f"{home}/torchinductor_uid{uid}"}
    assert launch.cache_dirs({**usable, "TORCHINDUCTOR_CACHE_DIR": "/mine"}, have_matplotlib=False) == {}


def test_no_writable_exec_place_is_reported_not_invented(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    _noexec(monkeypatch, str(tmp), "/tmp", "/var/tmp", "/usr/tmp", "/dev/shm")
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) == str(tmp))  # only the noexec tmp is writable
    environ = {"TMPDIR": str(tmp), "HOME": "/"}
    assert launch.exec_place(environ) is None
    got = launch.cache_dirs(environ, have_matplotlib=False)
    assert "TORCHINDUCTOR_CACHE_DIR" not in got and got["TORCH_HOME"].startswith(str(tmp))


def test_python_launcher_runs_the_environments_interpreter(hooked_venv, tmp_path):
    """/usr/local/bin/python: a script, because a symlink is not a venv interpreter."""
    text = contexts.environment().get_template("python-launcher.sh.j2").render(python=f"{hooked_venv}/bin/python")
    launcher = tmp_path / "python"
    launcher.write_text(text)
    launcher.chmod(0o755)
    code = "import sys; print(sys.prefix)"
    env = {"PATH": "/usr/bin", "TMPDIR": str(tmp_path)}  # the hook's cache folders here, not in /tmp
    r = subprocess.run([launcher, "-c", code], capture_output=True, text=True, env=env, timeout=30)
    assert r.stdout.strip() == str(hooked_venv)
    link = tmp_path / "link"
    link.symlink_to(hooked_venv / "bin" / "python")
    r = subprocess.run([link, "-c", code], capture_output=True, text=True, env=env, timeout=30)
    assert r.stdout.strip() != str(hooked_venv)  # why a launcher: the symlink loses the venv


def test_the_hook_file_is_standalone():
    text = (RESOURCES / "launch.py").read_text()
    for slow in ("import json\n", "import re\n", "import tempfile", "from imagefactory", "import imagefactory"):
        assert not text.startswith(slow) and f"\n{slow}" not in text.split("def main")[0], slow


# -- moved from test_hardening_iii.py ----------------------------------------


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
