"""Issue 35, items 1 and 2: the CPU-budget rule and the thread-count rule, whole-string in every copy.

The rules' one table is tests/unit/thread_rule.py: CASES (cgroup files) and USER_VALUES (what a
user sets); test_launch_carrier runs every copy on every row. Here: no copy of the rule in the project is
left out of that run, the shell copies read the table alike under a UTF-8 locale, and the hook,
as installed, says a refused thread count once, not in every interpreter it starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from imagefactory.render import contexts
from tests.unit.thread_rule import (
    AUTO_CELL, CASES, CPUS, REFUSED, _run_hooked, _tree, launch, make_hooked_venv, probe, shell_copies, workload,
)
from imagefactory.files import bounded

REPO = Path(contexts.__file__).resolve().parents[2]

# Every file that reads the CPU quota, and how test_every_copy_of_the_cpu_budget_rule_agrees runs it.
# A new copy (a file naming cpu.max or cfs_quota_us) fails the test below until it is run there too.
COPIES = {
    "imagefactory/resources/launch.py": "hook, hook threads",
    "imagefactory/resources/probe.py": "probe + checks (checks._thread_budget)",
    "imagefactory/resources/workload.py": "workload",
    "dockerfiles/partials/launch_env.sh.j2": "profile.d under dash and bash, entrypoint",
}
SHELL_CARRIERS = {"launch-env.sh.j2", "entrypoint.sh.j2"}  # render.launch_env_text, render.entrypoint_text


def _project_files():
    for folder in ("imagefactory", "dockerfiles", "bench", "scripts"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                yield path


def test_every_copy_of_the_cpu_budget_rule_runs_the_table(tmp_path):
    readers = {str(p.relative_to(REPO)) for p in _project_files()
               if re.search(rb"cpu\.max|cfs_quota_us", p.read_bytes())}
    assert readers == set(COPIES), "a copy of the CPU-budget rule that the table test does not run"
    including = {p.name for p in (REPO / "dockerfiles").rglob("*.j2")
                 if 'include "partials/launch_env.sh.j2"' in p.read_text()}
    assert including == SHELL_CARRIERS
    assert {"profile.d under dash", "profile.d under bash", "entrypoint"} <= set(shell_copies(tmp_path, "/x"))
    for mod in (launch, probe, workload):
        assert callable(mod.cgroup_limit)


def _utf8_locale() -> str | None:
    out = subprocess.run(["locale", "-a"], capture_output=True, text=True).stdout.split()
    return next((name for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8", "en_US.utf8") if name in out), None)


NON_ASCII = [c for c in CASES if isinstance(c[1], dict) and any(v and re.search(rb"[\x80-\xff]", v)
                                                                 for v in c[1].values())]


@pytest.mark.parametrize("case, files, limit", NON_ASCII, ids=[c[0] for c in NON_ASCII])
def test_the_shell_copies_read_the_table_alike_under_a_utf8_locale(tmp_path, case, files, limit):
    """Images run with LANG=C.UTF-8 as often as without: a no-break space or a non-ASCII digit is
    still no separator and no digit to dash and bash."""
    locale = _utf8_locale()
    if locale is None:
        pytest.skip("no UTF-8 locale here")
    root = _tree(tmp_path, files)
    n = len(CPUS)
    want = str(max(1, n if limit is None else min(n, limit)))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": locale, "LANG": locale}
    for name, argv in shell_copies(tmp_path, root).items():
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        assert (r.stdout.strip(), r.stderr) == (want, ""), (case, name)


@pytest.fixture(scope="module")
def hooked_venv(tmp_path_factory) -> Path:
    return make_hooked_venv(tmp_path_factory.mktemp("hooked") / "venv")


CHILD = ("import json, os, subprocess, sys; r = subprocess.run([sys.executable, '-c', 'pass'], capture_output=True, "
         "text=True); print(json.dumps({'env': {k: os.environ.get(k) for k in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', "
         "'OPENBLAS_NUM_THREADS')}, 'state': sys.modules['imagefactory_launch'].state, 'child_stderr': r.stderr}))")


def test_the_installed_hook_refuses_a_count_a_c_int_cannot_hold_and_says_it_once(hooked_venv, tmp_path):
    """OMP_NUM_THREADS=99999999999: left as set for libgomp to judge, never copied into MKL's and
    OpenBLAS's variables (they take a C int); one line on stderr, and none from a child interpreter,
    which finds the other two set."""
    said = REFUSED + "OMP_NUM_THREADS; set instead: MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1\n"
    out = _run_hooked(hooked_venv, {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "99999999999"},
                      n=1, code=CHILD, stderr=said)
    assert out["env"] == {"OMP_NUM_THREADS": "99999999999", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    assert out["state"]["warning"] == said.strip() and out["state"]["error"] is None
    assert out["child_stderr"] == ""
    # The cap itself is a count: copied, nothing said.
    out = _run_hooked(hooked_venv, {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "2147483647"},
                      n=1, code=CHILD)
    assert set(out["env"].values()) == {"2147483647"} and out["state"]["warning"] is None


def test_the_hook_says_nothing_when_stderr_is_closed(hooked_venv, tmp_path):
    """A process started with fd 2 closed (sys.stderr is None) still starts and is still sized."""
    code = "import os, sys; print(os.environ['MKL_NUM_THREADS'], sys.modules['imagefactory_launch'].state['error'])"
    env = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "abc", "TMPDIR": str(tmp_path)}  # its cache folders: not /tmp
    r = subprocess.run([hooked_venv / "bin" / "python", "-c", code], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=60,
                       preexec_fn=lambda: (os.close(2), os.sched_setaffinity(0, {CPUS[0]})))
    assert (r.returncode, r.stdout) == (0, "1 None\n"), r


def test_the_hook_cap_is_what_a_c_int_holds():
    assert launch.MAX_THREADS == 2**31 - 1
    assert f"[ \"$1\" -le {2**31 - 1} ]" in contexts.launch_env_text(AUTO_CELL)
    assert sys.maxsize > launch.MAX_THREADS  # (the Python side compares ints; the shell, intmax_t)


# -- moved from test_hardening_iii.py ----------------------------------------


def _finishes(fn, seconds: float = 10.0) -> bool:
    import threading

    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


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
