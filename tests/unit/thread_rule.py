"""The ONE table of the CPU-budget and thread-count rules (issues 25 and 35), and how each copy of
the rules is run: the hook (resources/launch.py), the probe read by checks.py, the bench workload,
and the shell script rendered from dockerfiles/partials/launch_env.sh.j2 (as /etc/profile.d and
Apptainer's script under dash and bash, and as the ENTRYPOINT). tests/unit/resources/test_launch.py
runs every copy on every row; tests/unit/project/test_thread_rule.py holds that no copy is left out.
A helper module, not a test module: test modules import it, never one another."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import venv
from dataclasses import replace
from pathlib import Path

from imagefactory.render import contexts
from imagefactory.config.model import AUTO, Cell
from tests.unit.helpers import CPU_OPENBLAS

RESOURCES = Path(contexts.__file__).resolve().parents[1] / "resources"
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

# THE table of the CPU-budget rule: every copy runs every row. (case id, files under the cgroup root
# (a bytes value is a file, None a folder), the quota limit quota//period the rule must find, or
# None for "no quota": then the next limit, the affinity, decides)
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
    # issue 35, item 1 (it reverses issue 25's item 20, which dropped NULs as a shell's `read` does):
    # quota and period are whole strings of ASCII digits, so a NUL byte anywhere in the first line
    # makes it garbage; only spaces and tabs separate fields; 18 digits is the most; the first line
    # is read from the first 4096 bytes, with or without its newline.
    ("v2-nul-inside", {"cpu.max": b"15\x000000 100000\n"}, None),
    ("v2-nul-only-field", {"cpu.max": b"\x00 100000\n"}, None),
    ("v2-nul-after-period", {"cpu.max": b"150000 100000\x00\n"}, None),
    ("v2-nul-after-period-no-newline", {"cpu.max": b"150000 100000\x00"}, None),
    ("v2-nul-between-fields", {"cpu.max": b"150000\x00100000\n"}, None),
    ("v2-nul-before-quota", {"cpu.max": b"\x00150000 100000\n"}, None),
    ("v2-nul-on-the-second-line", {"cpu.max": b"150000 100000\n\x00\n"}, 1),
    ("v2-vertical-tab", {"cpu.max": b"150000\x0b100000\n"}, None),
    ("v2-form-feed", {"cpu.max": b"150000\x0c100000\n"}, None),
    ("v2-no-break-space", {"cpu.max": "150000\u00a0100000\n".encode()}, None),
    ("v2-no-break-space-latin-1", {"cpu.max": b"150000\xa0100000\n"}, None),
    ("v2-arabic-indic-digits", {"cpu.max": "\u0661\u0665\u0660\u0660\u0660\u0660 100000\n".encode()}, None),
    ("v2-fullwidth-digits", {"cpu.max": "\uff11\uff15\uff10\uff10\uff10\uff10 100000\n".encode()}, None),
    ("v2-no-final-newline", {"cpu.max": b"150000 100000"}, 1),
    ("v2-18-digits-both", {"cpu.max": b"999999999999999999 999999999999999999\n"}, 1),
    ("v2-18-digits-float-rounds-up", {"cpu.max": b"199999999999999999 100000000000000000\n"}, 1),
    ("v2-19-digit-period", {"cpu.max": b"150000 1000000000000000000\n"}, None),
    ("v2-line-past-4096-bytes", {"cpu.max": b" " * 4096 + b"150000 100000\n"}, None),
    ("v2-line-within-4096-bytes", {"cpu.max": b" " * 4000 + b"150000 100000\n"}, 1),
    ("v1-nul", {"cpu/cpu.cfs_quota_us": b"100\x00000\n", "cpu/cpu.cfs_period_us": b"100000\x00\n"}, None),
    ("v1-nul-in-quota", {"cpu/cpu.cfs_quota_us": b"100\x00000\n", "cpu/cpu.cfs_period_us": b"100000\n"}, None),
    ("v1-nul-after-period", {"cpu/cpu.cfs_quota_us": b"100000\n", "cpu/cpu.cfs_period_us": b"100000\x00"}, None),
    ("v1-vertical-tab", {"cpu/cpu.cfs_quota_us": b"100000\x0b\n", "cpu/cpu.cfs_period_us": b"100000\n"}, None),
    ("v1-no-break-space", {"cpu/cpu.cfs_quota_us": "100000\u00a0\n".encode(),
                           "cpu/cpu.cfs_period_us": b"100000\n"}, None),
    ("v1-no-final-newline", {"cpu/cpu.cfs_quota_us": b"200000", "cpu/cpu.cfs_period_us": b"100000"}, 2),
    ("v1-18-digits", {"cpu/cpu.cfs_quota_us": b"199999999999999999\n",
                      "cpu/cpu.cfs_period_us": b"100000000000000000\n"}, 1),
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
    script.write_text(contexts.launch_env_text(AUTO_CELL, cgroup_root=root))
    entry = tmp_path / "entrypoint.sh"
    entry.write_text(contexts.entrypoint_text(AUTO_CELL, cgroup_root=root))
    show = '. "$0"; printf %s "$OMP_NUM_THREADS"'
    return {"profile.d under dash": ["dash", "-c", show, str(script)],
            "profile.d under bash": ["bash", "-c", show, str(script)],
            "entrypoint": ["bash", str(entry), "printenv", "OMP_NUM_THREADS"]}


# (what the user set, the three variables after the start ("B": the budget, 1 here), and the one line
# on stderr: a value that is not a count (1 to 2**31-1, issue 35 item 2) is left as set and never
# copied, said where the others are set)
REFUSED = "imagefactory: not a thread count (1 to 2147483647), left as set and not copied: "
USER_VALUES = [
    ({"OMP_NUM_THREADS": "3"}, "3 3 3", ""),
    ({"MKL_NUM_THREADS": "2"}, "2 2 2", ""),
    ({"OMP_NUM_THREADS": "abc"}, "abc B B",
     REFUSED + "OMP_NUM_THREADS; set instead: MKL_NUM_THREADS=B OPENBLAS_NUM_THREADS=B"),
    ({"OMP_NUM_THREADS": "0", "OPENBLAS_NUM_THREADS": "5"}, "0 5 5",
     REFUSED + "OMP_NUM_THREADS; set instead: MKL_NUM_THREADS=5"),
    ({"OMP_NUM_THREADS": ""}, "B B B", ""),
    ({"OMP_NUM_THREADS": "4,2"}, "4,2 B B",
     REFUSED + "OMP_NUM_THREADS; set instead: MKL_NUM_THREADS=B OPENBLAS_NUM_THREADS=B"),
    ({"OMP_NUM_THREADS": "99999999999"}, "99999999999 B B",
     REFUSED + "OMP_NUM_THREADS; set instead: MKL_NUM_THREADS=B OPENBLAS_NUM_THREADS=B"),
    ({"OMP_NUM_THREADS": "2147483648"}, "2147483648 B B",
     REFUSED + "OMP_NUM_THREADS; set instead: MKL_NUM_THREADS=B OPENBLAS_NUM_THREADS=B"),
    ({"OMP_NUM_THREADS": "2147483647"}, "2147483647 2147483647 2147483647", ""),
    ({"MKL_NUM_THREADS": "999999999999999999"}, "B 999999999999999999 B",
     REFUSED + "MKL_NUM_THREADS; set instead: OMP_NUM_THREADS=B OPENBLAS_NUM_THREADS=B"),
    ({"OMP_NUM_THREADS": "99999999999999999999"}, "99999999999999999999 B B",
     REFUSED + "OMP_NUM_THREADS; set instead: MKL_NUM_THREADS=B OPENBLAS_NUM_THREADS=B"),
    ({"OMP_NUM_THREADS": "99999999999", "MKL_NUM_THREADS": "3"}, "99999999999 3 3",
     REFUSED + "OMP_NUM_THREADS; set instead: OPENBLAS_NUM_THREADS=3"),
    ({"OMP_NUM_THREADS": "-4", "MKL_NUM_THREADS": "x"}, "-4 x B",
     REFUSED + "OMP_NUM_THREADS MKL_NUM_THREADS; set instead: OPENBLAS_NUM_THREADS=B"),
    ({"OMP_NUM_THREADS": "99999999999", "MKL_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"},
     "99999999999 2 2", ""),  # nothing set: nothing said
    ({"OPENBLAS_NUM_THREADS": "3\n"}, "B B 3\n",
     REFUSED + "OPENBLAS_NUM_THREADS; set instead: OMP_NUM_THREADS=B MKL_NUM_THREADS=B"),
    ({"OMP_NUM_THREADS": "\u0663"}, "\u0663 B B",  # an Arabic-Indic three
     REFUSED + "OMP_NUM_THREADS; set instead: MKL_NUM_THREADS=B OPENBLAS_NUM_THREADS=B"),
]


# -- the hook in a real interpreter ------------------------------------------------------------------

def make_hooked_venv(root: Path) -> Path:
    """A real venv at `root` with the hook installed as an image installs it (.pth + module +
    launch.conf)."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    site = Path(subprocess.run([root / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / contexts.LAUNCH_HOOK).write_text(contexts.launch_hook_source())
    (site / contexts.LAUNCH_PTH).write_text("import imagefactory_launch\n")
    conf = root / "etc" / "imagefactory"
    conf.mkdir(parents=True)
    text = contexts.launch_conf_text(replace(AUTO_CELL, env=(("HF_HOME", "/data/hf"),)))
    (conf / "launch.conf").write_text(text.replace("PATH=/opt/venv/bin", f"PATH={root}/bin"))
    return root


# Never imports the hook itself: only `site` (the .pth line) may have run it.
SHOW = ("import os, json, sys; h = sys.modules.get('imagefactory_launch'); print(json.dumps({'env': "
        "{k: os.environ.get(k) for k in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'HF_HOME', "
        "'VIRTUAL_ENV', 'PATH', 'MKL_INTERFACE_LAYER', 'TORCH_HOME')}, 'state': getattr(h, 'state', None)}))")


def _run_hooked(venv_root: Path, env: dict[str, str], n: int = 1, code: str = SHOW, stderr: str = ""):
    import json

    # a temp dir of the test's own: with no HOME the hook makes its cache folders there, not in /tmp
    tmp = venv_root.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {"TMPDIR": str(tmp), **env}
    r = subprocess.run([venv_root / "bin" / "python", "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, preexec_fn=_pinned(n))
    assert r.returncode == 0 and r.stderr == stderr, r.stderr
    return json.loads(r.stdout)


