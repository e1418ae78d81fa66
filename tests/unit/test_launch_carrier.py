"""The launch carriers that do not depend on the ENTRYPOINT (resources/launch.py, installed as the
imagefactory_launch hook; dockerfiles/partials/launch_env.sh.j2, the shell copy) and the ONE CPU-budget
rule: every copy of it (the shell script under dash and bash, the entrypoint, the hook, the probe
read by checks.py, the bench workload) run on the same fake cgroup trees, and they must agree."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import venv
from dataclasses import replace
from pathlib import Path

import pytest

from imagefactory import checks, render
from imagefactory.model import AUTO, Cell
from tests.unit.helpers import CPU_OPENBLAS

RESOURCES = Path(render.__file__).resolve().parent / "resources"
CPUS = sorted(os.sched_getaffinity(0))
AFFINITIES = sorted({1, len(CPUS)})  # 1 and 2 on the 2-core CI machine: both sides of every quota below


def _load(name: str, module: str):
    spec = importlib.util.spec_from_file_location(module, RESOURCES / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


launch = _load("launch.py", "launch_under_test")  # not "imagefactory_launch": nothing applies at import
probe = _load("probe.py", "probe_under_test")
workload = _load("workload.py", "workload_under_test")

AUTO_CELL: Cell = replace(CPU_OPENBLAS, threads=AUTO)

# (case id, files under the cgroup root (a bytes value is a file, None a folder), the quota limit
# quota//period the rule must find, or None for "no quota")
CASES = [
    ("v2-1.5cpus", {"cpu.max": b"150000 100000\n"}, 1),
    ("v2-max", {"cpu.max": b"max 100000\n"}, None),
    ("v2-4cpus", {"cpu.max": b"400000 100000\n"}, 4),
    ("v2-half-cpu", {"cpu.max": b"50000 100000\n"}, 0),
    ("v2-tabs", {"cpu.max": b"\t150000\t100000  \n"}, 1),
    ("v2-garbage", {"cpu.max": b"abc def\n"}, None),
    ("v2-empty", {"cpu.max": b""}, None),
    ("v2-one-field", {"cpu.max": b"150000\n"}, None),
    ("v2-three-fields", {"cpu.max": b"150000 100000 7\n"}, None),
    ("v2-zero-quota", {"cpu.max": b"0 100000\n"}, None),
    ("v2-negative", {"cpu.max": b"-1 100000\n"}, None),
    ("v2-zero-period", {"cpu.max": b"150000 0\n"}, None),
    ("v2-leading-zero", {"cpu.max": b"0150000 100000\n"}, None),
    ("v2-19-digits", {"cpu.max": b"1000000000000000000 1\n"}, None),
    ("v2-18-digits", {"cpu.max": b"100000000000000000 100000\n"}, 10 ** 12),
    ("v2-carriage-return", {"cpu.max": b"150000 100000\r\n"}, None),
    ("v2-binary", {"cpu.max": b"\xff\xfe\x01 \x80\n"}, None),
    ("v2-first-line-only", {"cpu.max": b"\n150000 100000\n"}, None),
    ("v2-decimal", {"cpu.max": b"1.5 1\n"}, None),
    ("v2-decides-over-v1", {"cpu.max": b"garbage\n", "cpu/cpu.cfs_quota_us": b"100000\n",
                            "cpu/cpu.cfs_period_us": b"100000\n"}, None),
    ("v2-folder-falls-to-v1", {"cpu.max": None, "cpu/cpu.cfs_quota_us": b"100000\n",
                               "cpu/cpu.cfs_period_us": b"100000\n"}, 1),
    ("v1-1cpu", {"cpu/cpu.cfs_quota_us": b"100000\n", "cpu/cpu.cfs_period_us": b"100000\n"}, 1),
    ("v1-unlimited", {"cpu/cpu.cfs_quota_us": b"-1\n", "cpu/cpu.cfs_period_us": b"100000\n"}, None),
    ("v1-padded", {"cpu/cpu.cfs_quota_us": b"  100000  \n", "cpu/cpu.cfs_period_us": b"100000"}, 1),
    ("v1-two-words", {"cpu/cpu.cfs_quota_us": b"100000 5\n", "cpu/cpu.cfs_period_us": b"100000\n"}, None),
    ("v1-cpuacct", {"cpu,cpuacct/cpu.cfs_quota_us": b"300000\n", "cpu,cpuacct/cpu.cfs_period_us": b"100000\n"}, 3),
    ("v1-first-complete-folder", {"cpu/cpu.cfs_quota_us": b"100000\n",
                                  "cpu,cpuacct/cpu.cfs_quota_us": b"100000\n",
                                  "cpu,cpuacct/cpu.cfs_period_us": b"100000\n"}, 1),
    ("v1-garbage-decides", {"cpu/cpu.cfs_quota_us": b"lots\n", "cpu/cpu.cfs_period_us": b"100000\n",
                            "cpu,cpuacct/cpu.cfs_quota_us": b"100000\n",
                            "cpu,cpuacct/cpu.cfs_period_us": b"100000\n"}, None),
    # issue 25, item 20: NUL bytes are dropped by every copy, as a shell's `read` drops them
    ("v2-nul-inside", {"cpu.max": b"15\x000000 100000\n"}, 1),
    ("v2-nul-only-field", {"cpu.max": b"\x00 100000\n"}, None),
    ("v1-nul", {"cpu/cpu.cfs_quota_us": b"100\x00000\n", "cpu/cpu.cfs_period_us": b"100000\x00\n"}, 1),
    ("no-cgroup-files", {}, None),
    ("no-sys-at-all", "missing", None),
]


def _tree(tmp_path: Path, files) -> str:
    root = tmp_path / "sys" / "fs" / "cgroup"
    if files == "missing":
        return str(root)  # not even /sys
    root.mkdir(parents=True)
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            path.mkdir()
        else:
            path.write_bytes(data)
    return str(root)


def _pinned(n: int):
    cpus = set(CPUS[:n])
    return lambda: os.sched_setaffinity(0, cpus)


def _shell(argv: list[str], n: int, env: dict[str, str] | None = None) -> str:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    r = subprocess.run(argv, env={**base, **(env or {})}, capture_output=True, text=True, timeout=30,
                       preexec_fn=_pinned(n))
    assert r.returncode == 0 and r.stderr == "", (argv, r.stderr)
    return r.stdout


def shell_copies(tmp_path: Path, root: str) -> dict[str, list[str]]:
    """Each shell copy as a command printing OMP_NUM_THREADS with nothing set by the user."""
    script = tmp_path / "launch-env.sh"
    script.write_text(render.launch_env_text(AUTO_CELL, cgroup_root=root))
    entry = tmp_path / "entrypoint.sh"
    entry.write_text(render.entrypoint_text(AUTO_CELL, cgroup_root=root))
    show = '. "$0"; printf %s "$OMP_NUM_THREADS"'
    return {"profile.d under dash": ["dash", "-c", show, str(script)],
            "profile.d under bash": ["bash", "-c", show, str(script)],
            "entrypoint": ["bash", str(entry), "printenv", "OMP_NUM_THREADS"]}


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

USER_VALUES = [
    ({"OMP_NUM_THREADS": "3"}, {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3"}),
    ({"MKL_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"}),
    ({"OMP_NUM_THREADS": "abc"}, {"OMP_NUM_THREADS": "abc", "MKL_NUM_THREADS": "B", "OPENBLAS_NUM_THREADS": "B"}),
    ({"OMP_NUM_THREADS": "0", "OPENBLAS_NUM_THREADS": "5"},
     {"OMP_NUM_THREADS": "0", "MKL_NUM_THREADS": "5", "OPENBLAS_NUM_THREADS": "5"}),
    ({"OMP_NUM_THREADS": ""}, {"OMP_NUM_THREADS": "B", "MKL_NUM_THREADS": "B", "OPENBLAS_NUM_THREADS": "B"}),
    ({"OMP_NUM_THREADS": "4,2"}, {"OMP_NUM_THREADS": "4,2", "MKL_NUM_THREADS": "B", "OPENBLAS_NUM_THREADS": "B"}),
]


@pytest.mark.parametrize("given, want", USER_VALUES)
def test_a_value_the_user_sets_wins_and_a_bad_one_is_left_alone(tmp_path, monkeypatch, given, want):
    root = _tree(tmp_path, {"cpu.max": b"100000 100000\n"})  # budget 1: "B" above
    want = {k: v.replace("B", "1") for k, v in want.items()}
    show = '. "$0"; printf "%s %s %s" "$OMP_NUM_THREADS" "$MKL_NUM_THREADS" "$OPENBLAS_NUM_THREADS"'
    script = tmp_path / "launch-env.sh"
    script.write_text(render.launch_env_text(AUTO_CELL, cgroup_root=root))
    line = " ".join(want[k] for k in launch.THREAD_VARS)
    for shell in ("dash", "bash"):
        assert _shell([shell, "-c", show, str(script)], len(CPUS), given) == line, shell
    environ = dict(given)
    environ.update(launch.thread_counts(environ, root))
    assert {k: environ[k] for k in launch.THREAD_VARS} == want


def test_the_shell_script_survives_set_eu_and_leaves_no_helpers_behind(tmp_path):
    script = tmp_path / "launch-env.sh"
    script.write_text(render.launch_env_text(AUTO_CELL, cgroup_root=str(tmp_path / "none")))
    for shell in ("dash", "bash"):
        out = _shell([shell, "-euc", '. "$0"; set | grep -c "^_imagefactory" || true; command -v '
                      '_imagefactory_cpu_budget || echo gone', str(script)], 1)
        assert out.split() == ["0", "gone"], (shell, out)


def test_fixed_threads_are_the_image_env_and_activation_is_sourced(tmp_path):
    prefix = tmp_path / "env"
    (prefix / "etc" / "conda" / "activate.d").mkdir(parents=True)
    (prefix / "etc" / "conda" / "activate.d" / "x.sh").write_text("export MKL_INTERFACE_LAYER=LP64,GNU\necho noise\n")
    cell = replace(CPU_OPENBLAS, threads=4, env=(("HF_HOME", "/data/hf"),))
    text = render.launch_env_text(cell).replace("_imagefactory_prefix=/opt/venv",
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
    """A real venv with the hook installed as an image installs it (.pth + module + launch.conf)."""
    root = tmp_path_factory.mktemp("hooked") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    site = Path(subprocess.run([root / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / render.LAUNCH_HOOK).write_text(render.launch_hook_source())
    (site / render.LAUNCH_PTH).write_text("import imagefactory_launch\n")
    conf = root / "etc" / "imagefactory"
    conf.mkdir(parents=True)
    text = render.launch_conf_text(replace(AUTO_CELL, env=(("HF_HOME", "/data/hf"),)))
    (conf / "launch.conf").write_text(text.replace("PATH=/opt/venv/bin", f"PATH={root}/bin"))
    return root


# Never imports the hook itself: only `site` (the .pth line) may have run it.
SHOW = ("import os, json, sys; h = sys.modules.get('imagefactory_launch'); print(json.dumps({'env': "
        "{k: os.environ.get(k) for k in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'HF_HOME', "
        "'VIRTUAL_ENV', 'PATH', 'MKL_INTERFACE_LAYER', 'TORCH_HOME')}, 'state': getattr(h, 'state', None)}))")


def _run_hooked(venv_root: Path, env: dict[str, str], n: int = 1, code: str = SHOW):
    import json

    r = subprocess.run([venv_root / "bin" / "python", "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, preexec_fn=_pinned(n))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return json.loads(r.stdout)


def test_hook_sizes_threads_and_applies_the_image_env_without_any_entrypoint(hooked_venv, tmp_path):
    out = _run_hooked(hooked_venv, {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, n=1)
    assert out["env"]["OMP_NUM_THREADS"] == out["env"]["MKL_NUM_THREADS"] == "1"
    assert out["env"]["HF_HOME"] == "/data/hf" and out["env"]["VIRTUAL_ENV"] == "/opt/venv"
    assert out["env"]["PATH"] == f"{hooked_venv}/bin:/usr/bin:/bin"
    assert out["state"]["error"] is None and out["state"]["budget"] == "1"
    if len(CPUS) > 1:
        assert _run_hooked(hooked_venv, {"PATH": "/usr/bin"}, n=len(CPUS))["env"]["OMP_NUM_THREADS"] == str(len(CPUS))


def test_hook_leaves_user_values_and_never_stops_python(hooked_venv, tmp_path):
    out = _run_hooked(hooked_venv, {"OMP_NUM_THREADS": "abc", "HF_HOME": "/mine", "PATH": f"{hooked_venv}/bin"})
    assert out["env"]["OMP_NUM_THREADS"] == "abc" and out["env"]["MKL_NUM_THREADS"] == "1"
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
    text = render.environment().get_template("python-launcher.sh.j2").render(python=f"{hooked_venv}/bin/python")
    launcher = tmp_path / "python"
    launcher.write_text(text)
    launcher.chmod(0o755)
    code = "import sys; print(sys.prefix)"
    r = subprocess.run([launcher, "-c", code], capture_output=True, text=True, env={"PATH": "/usr/bin"}, timeout=30)
    assert r.stdout.strip() == str(hooked_venv)
    link = tmp_path / "link"
    link.symlink_to(hooked_venv / "bin" / "python")
    r = subprocess.run([link, "-c", code], capture_output=True, text=True, env={"PATH": "/usr/bin"}, timeout=30)
    assert r.stdout.strip() != str(hooked_venv)  # why a launcher: the symlink loses the venv


def test_the_hook_file_is_standalone():
    text = (RESOURCES / "launch.py").read_text()
    for slow in ("import json\n", "import re\n", "import tempfile", "from imagefactory", "import imagefactory"):
        assert not text.startswith(slow) and f"\n{slow}" not in text.split("def main")[0], slow
