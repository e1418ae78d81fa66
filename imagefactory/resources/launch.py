"""The image's launch settings, applied at the start of EVERY interpreter of its environment.

imagefactory installs this file as `imagefactory_launch.py` in the environment's site-packages,
beside `imagefactory-launch.pth`, whose one line (`import imagefactory_launch`) makes `site` run
it before any program, however the image was started: through its ENTRYPOINT or not (Kubernetes
`command:`, Slurm + pyxis, `apptainer exec`, Charliecloud `ch-run`), as any UID with or without
a passwd entry, on a read-only root, with HOME unset or unwritable. (A .pth line, not a
sitecustomize.py: Debian's standard library ships its own sitecustomize, which comes first on
sys.path and would shadow one in site-packages.)

In order, each only where the process has no value of its own (a value the user set wins):
  1. the ENV the image declares (PREFIX/etc/imagefactory/launch.conf, written by imagefactory),
     for runtimes that drop it (ch-run without --set-env); the environment's bin/ joins PATH;
  2. the variables the environment's conda activate.d scripts export, captured when the image
     was built (PREFIX/etc/imagefactory/activation.conf; `python -m imagefactory_launch capture`
     captures them again, for an image derived from this one that adds such a script);
  3. `threads: auto`: OMP/MKL/OPENBLAS_NUM_THREADS = the CPU budget (see cpu_budget), or the
     first valid count the user set among them (1 to 2**31-1: what a C int holds); a value that is
     not a count is left alone and never copied, said in one line on stderr when the others are set;
  4. cache places torch needs writable (and, for compiled code, mounted exec) when the default
     one is not: TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, TORCH_HOME, MPLCONFIGDIR.

It must never stop Python from starting: every failure leaves the environment as it was.
Standard library only, and nothing slow to import (no json, re or tempfile): it runs before
every program, each DataLoader worker and each DDP rank included (and no `from __future__`
import: that alone costs a third of the budget; annotations that Python 3.9 cannot evaluate are
strings). `python -m imagefactory_launch`
prints what this process got (`state`); `exec_place()` is where compiled code can go, or None.
"""

import os
import sys

CGROUP_ROOT = "/sys/fs/cgroup"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
MAX_DIGITS = 18  # a quota or period longer than this is garbage (and would overflow a shell's arithmetic)
MAX_THREADS = 2147483647  # a thread count the libraries take as a C int (omp_set_num_threads, OpenBLAS, MKL)
CONF_DIR = os.path.join("etc", "imagefactory")
LAUNCH_CONF = "launch.conf"
ACTIVATION_CONF = "activation.conf"
MAX_CONF_BYTES = 1 << 20  # a settings file is a few hundred bytes
DIRECTIVES = ("threads",)  # launch.conf keys that are settings of the hook, not variables

# What this process got from the hook: variable -> value, and where compiled code can go.
state: dict[str, object] = {"applied": {}, "budget": None, "exec_place": None, "error": None, "warning": None}


# -- the CPU budget: ONE rule, shared (and tested to agree) with the shell script's copy -------------
# min(affinity CPUs, floor(quota / period)), at least 1. The quota: cgroup v2's cpu.max when that
# file can be read (its first line, exactly two fields: "max 100000" is no quota), else the first
# cgroup v1 folder (cpu, cpu,cpuacct) whose cpu.cfs_quota_us and cpu.cfs_period_us can both be read.
# Quota and period are positive integers of at most 18 ASCII digits, without a leading zero;
# anything else (-1, max, garbage, a NUL byte anywhere in the line) is no quota. A line is read from
# the first 4096 bytes. Only regular files count (a FIFO, a folder: cannot be read).

def _count(text: bytes) -> "int | None":
    """A positive integer written the one way the rule accepts, or None."""
    if not text or len(text) > MAX_DIGITS or text[:1] == b"0" or not text.isdigit():
        return None  # bytes.isdigit() is ASCII-only
    return int(text)


_IFMT, _IFREG, _IFDIR = 0o170000, 0o100000, 0o040000  # stat's S_IFMT bits (stat is not imported)


def _read(path: str, limit: int) -> bytes:
    """At most `limit` bytes of a REGULAR file, opened without blocking: a FIFO (or a device, a
    folder) where a cgroup or settings file should be is OSError, never waited on, so no file can
    stop an interpreter from starting."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_mode & _IFMT != _IFREG:
            raise OSError("not a regular file: %s" % path)
        chunks: "list[bytes]" = []
        size = 0
        while size < limit:
            chunk = os.read(fd, limit - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _first_line(path: str) -> bytes:
    """The first line of the first 4096 bytes, as it is: a NUL byte stays, a non-digit (the shell
    copy reads it so, though a shell's `read` alone would drop it)."""
    return _read(path, 4096).split(b"\n", 1)[0]


def _fields(line: bytes) -> list[bytes]:
    return [f for f in line.replace(b"\t", b" ").split(b" ") if f]  # a shell's default IFS


def cgroup_limit(root: str = CGROUP_ROOT) -> "tuple[int, int] | None":
    """(quota, period) of the CFS quota this process runs under, or None (no quota, unknown)."""
    try:
        fields = _fields(_first_line(root + "/cpu.max"))
    except OSError:
        pass
    else:
        if len(fields) != 2:
            return None
        quota, period = _count(fields[0]), _count(fields[1])
        return (quota, period) if quota and period else None
    for folder in ("cpu", "cpu,cpuacct"):
        try:
            quota_line = _first_line("%s/%s/cpu.cfs_quota_us" % (root, folder))
            period_line = _first_line("%s/%s/cpu.cfs_period_us" % (root, folder))
        except OSError:
            continue
        quota, period = _count(quota_line.strip(b" \t")), _count(period_line.strip(b" \t"))
        return (quota, period) if quota and period else None
    return None


def cpu_budget(root: str = CGROUP_ROOT) -> int:
    """The CPUs this process may really use: min(affinity, floor(quota/period)), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    limit = cgroup_limit(root)
    if limit is not None:
        n = min(n, limit[0] // limit[1])
    return max(1, n)


def _thread_count(value: str) -> bool:
    """Whether a thread variable's value is a count: 1 to MAX_THREADS, ASCII digits, no leading zero."""
    count = _count(value.encode("utf-8", "replace"))
    return count is not None and count <= MAX_THREADS


def thread_counts(environ: "dict[str, str] | os._Environ[str]", root: str = CGROUP_ROOT) -> dict[str, str]:
    """threads: auto. The thread variables to set: those the user left unset or empty, each to the
    first valid count the user gave (OMP, MKL, then OPENBLAS), else to the CPU budget."""
    given = [environ.get(name) or "" for name in THREAD_VARS]
    valid = [v for v in given if _thread_count(v)]
    count = valid[0] if valid else str(cpu_budget(root))
    return {name: count for name, value in zip(THREAD_VARS, given) if not value}


def thread_warning(environ: "dict[str, str] | os._Environ[str]", counts: dict[str, str]) -> "str | None":
    """The one line said on stderr when a thread variable the user set is not a count (abc, 0,
    99999999999: more than a C int holds) and others are set now: it is left as set, for its own
    library to read, and not copied; the variables set get the count named. The shell copy says
    the same line."""
    bad = [name for name in THREAD_VARS if environ.get(name) and not _thread_count(environ[name])]
    if not bad or not counts:
        return None
    return ("imagefactory: not a thread count (1 to %d), left as set and not copied: %s; set instead: %s"
            % (MAX_THREADS, " ".join(bad), " ".join("%s=%s" % kv for kv in counts.items())))


# -- settings files ------------------------------------------------------------------------------

def read_conf(path: str) -> list[tuple[str, str]]:
    """KEY=VALUE lines (# comments). A key is a variable name, or one of DIRECTIVES."""
    try:
        text = _read(path, MAX_CONF_BYTES).decode("utf-8", "replace")
    except OSError:
        return []
    out = []
    for line in text.split("\n"):
        key, sep, value = line.partition("=")
        if sep and key and not key.startswith("#") and (key[0].isalpha() or key[0] == "_") \
                and key.isascii() and key.replace("_", "").isalnum() and "\0" not in value:
            out.append((key, value))
    return out


def _prepend(environ, name: str, entries: str) -> None:
    have = environ.get(name) or ""
    parts = have.split(":") if have else []
    missing = [e for e in entries.split(":") if e and e not in parts]
    if missing:
        _set(environ, name, ":".join(missing + parts))


def _set(environ, name: str, value: str) -> None:
    environ[name] = value
    applied = state["applied"]
    assert isinstance(applied, dict)
    applied[name] = value


def apply_conf(environ, pairs: list[tuple[str, str]]) -> dict[str, str]:
    """Apply variables (a user's value wins; *PATH variables gain their missing entries) and
    return the directives."""
    directives = {}
    for key, value in pairs:
        if key in DIRECTIVES:
            directives[key] = value
        elif key.endswith("PATH"):
            _prepend(environ, key, value)
        elif not environ.get(key):
            _set(environ, key, value)
    return directives


# -- cache places --------------------------------------------------------------------------------

def _usable(path: str, need_exec: bool, exists: bool = False) -> bool:
    """Whether `path` (or, where it does not exist yet and `exists` is False, its nearest existing
    parent) is a folder this process can create files in and, with need_exec, map code from (no
    noexec mount)."""
    if not path or not os.path.isabs(path):
        return False
    while not exists and not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        return False
    if need_exec:
        try:
            return not os.statvfs(path).f_flag & os.ST_NOEXEC
        except OSError:
            return False
    return True


def _temp_dirs(environ) -> list[str]:
    """Where tempfile.gettempdir() looks, in its order (without importing tempfile)."""
    named = [environ.get(k) for k in ("TMPDIR", "TEMP", "TMP")]
    return [d for d in named if d] + ["/tmp", "/var/tmp", "/usr/tmp"]


def exec_place(environ=None) -> "str | None":
    """A folder this process can write and run compiled code from, or None (a noexec /tmp and
    nothing else writable: the fix is a tmpfs mounted exec, e.g. `--tmpfs /tmp:exec`, or a
    writable exec folder in TORCHINDUCTOR_CACHE_DIR)."""
    environ = os.environ if environ is None else environ
    home = environ.get("HOME") or ""
    for d in _temp_dirs(environ) + ["/dev/shm", home]:
        if _usable(d, need_exec=True, exists=True):
            return d
    return None


def _own_folder(path: str) -> bool:
    """Whether `path` is a folder of this UID that no one else can write: made now (0700) when
    missing. A sticky, shared TMPDIR (Apptainer binds the host's /tmp) may hold one another UID
    made first, or a link planted there: those are never used."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_mode & _IFMT == _IFDIR and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _fallback(environ, need_exec: bool, leaf: str) -> "str | None":
    """PLACE/leaf in the first usable place (exec_place's order for compiled code, else the temp
    dirs and /dev/shm) where that folder is this UID's own."""
    home = environ.get("HOME") or ""
    places = _temp_dirs(environ) + ["/dev/shm"] + ([home] if need_exec else [])
    for d in places:
        if _usable(d, need_exec=need_exec, exists=True) and _own_folder(os.path.join(d, leaf)):
            return os.path.join(d, leaf)
    return None


def cache_dirs(environ, have_matplotlib: bool) -> dict[str, str]:
    """Cache variables to set: each one the user left unset whose default place is not usable,
    pointed at a folder of this UID's own in a usable place (none where there is none: the probe's
    compile check says so)."""
    uid = os.getuid()
    home = environ.get("HOME") or ""
    temp = next((d for d in _temp_dirs(environ) if _usable(d, need_exec=False, exists=True)), "")
    xdg_cache = environ.get("XDG_CACHE_HOME") or (home and os.path.join(home, ".cache"))
    xdg_config = environ.get("XDG_CONFIG_HOME") or (home and os.path.join(home, ".config"))
    wanted = [  # variable, its default place, needs exec, folder name under the fallback
        ("TORCHINDUCTOR_CACHE_DIR", temp, True, "torchinductor_uid%d" % uid),
        ("TRITON_CACHE_DIR", home and os.path.join(home, ".triton", "cache"), True, "triton_uid%d" % uid),
        ("TORCH_HOME", xdg_cache and os.path.join(xdg_cache, "torch"), False, "torch_uid%d" % uid),
    ]
    if have_matplotlib:
        wanted.append(("MPLCONFIGDIR", xdg_config and os.path.join(xdg_config, "matplotlib"), False,
                       "matplotlib_uid%d" % uid))
    out = {}
    for name, default, need_exec, leaf in wanted:
        if environ.get(name) or _usable(default, need_exec):
            continue
        place = _fallback(environ, need_exec, leaf)
        if place:
            out[name] = place
    return out


# -- at every start ------------------------------------------------------------------------------

def apply(environ=None, prefix: "str | None" = None, root: str = CGROUP_ROOT) -> None:
    environ = os.environ if environ is None else environ
    prefix = prefix or sys.prefix
    conf = os.path.join(prefix, CONF_DIR)
    directives = apply_conf(environ, read_conf(os.path.join(conf, LAUNCH_CONF)))
    apply_conf(environ, read_conf(os.path.join(conf, ACTIVATION_CONF)))
    if directives.get("threads") == "auto":
        counts = thread_counts(environ, root)
        warning = thread_warning(environ, counts)
        state["budget"] = next(iter(counts.values()), None)
        for name, value in counts.items():
            _set(environ, name, value)
        if warning:
            state["warning"] = warning
            if sys.stderr is not None:
                sys.stderr.write(warning + "\n")
    site_dir = os.path.dirname(os.path.abspath(__file__))
    for name, value in cache_dirs(environ, os.path.isdir(os.path.join(site_dir, "matplotlib"))).items():
        _set(environ, name, value)
    state["exec_place"] = exec_place(environ)


def _start() -> None:
    try:
        apply()
    except Exception as exc:  # never stop an interpreter from starting
        state["error"] = "%s: %s" % (type(exc).__name__, exc)


# -- at build time -------------------------------------------------------------------------------

def capture(prefix: "str | None" = None) -> dict[str, str]:
    """What the environment's activate.d scripts export (as `conda activate` would run them),
    written to PREFIX/etc/imagefactory/activation.conf for the hook to apply at every start."""
    import glob
    import subprocess

    prefix = prefix or sys.prefix
    scripts = sorted(glob.glob(os.path.join(prefix, "etc", "conda", "activate.d", "*.sh")))
    start = {"PATH": "/usr/bin:/bin", "HOME": "/", "CONDA_PREFIX": prefix}
    exported: dict[str, str] = {}
    if scripts:
        code = 'for f in "$CONDA_PREFIX"/etc/conda/activate.d/*.sh; do . "$f" >&2; done; env -0'
        r = subprocess.run(["bash", "-c", code], env=start, stdout=subprocess.PIPE, check=True, timeout=300)
        after = dict(item.split("=", 1) for item in r.stdout.decode().split("\0") if "=" in item)
        exported["CONDA_PREFIX"] = prefix  # as the entrypoint and the shell script export it
        for key, value in sorted(after.items()):
            if key in ("_", "SHLVL", "PWD", "OLDPWD") or start.get(key) == value:
                continue
            if "\n" in value:
                raise ValueError("activation variable %s has a newline in its value" % key)
            if key.endswith("PATH"):  # only the entries activation adds
                value = ":".join(p for p in value.split(":") if p and p not in start.get(key, "").split(":"))
            exported[key] = value
    folder = os.path.join(prefix, CONF_DIR)
    os.makedirs(folder, exist_ok=True)
    lines = ["# Written by `python -m imagefactory_launch capture`: what %d activate.d script(s) export"
             % len(scripts)] + ["%s=%s" % kv for kv in exported.items()]
    with open(os.path.join(folder, ACTIVATION_CONF), "w") as f:
        f.write("\n".join(lines) + "\n")
    return exported


def main(argv: list[str]) -> int:
    if argv[:1] == ["capture"]:
        for key, value in capture().items():
            print("%s=%s" % (key, value))
        return 0
    import json

    hook = sys.modules.get("imagefactory_launch")  # the copy `site` ran at start
    print(json.dumps(getattr(hook, "state", None)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
elif __name__ == "imagefactory_launch":  # as installed; imported under another name (tests), it waits
    _start()
