"""`imagefactory --help` and `imagefactory COMMAND --help` answered from a cache of what typer
itself printed, without importing typer (docs/performance.md#the-cli-itself-benchclipy).

The help is a pure function of the code that printed it and of what that code reads from the
process: the modules loaded (their files), the command line, the environment, the working
folder, the terminal and the output streams. A page is replayed only when every one of those is
what it was when typer printed it:

- the key: the arguments, argv[0] and how __main__ was run (the "Usage:" line), the interpreter,
  its flags and sys.path, the whole environment (COLUMNS, locale, TYPER_*, ...), the working
  folder, the terminal's size and which streams are terminals, and their encodings;
- the witness: (mtime_ns, size, inode) of every module file loaded when the page was printed
  (imagefactory's, typer's, the standard library's: what Python itself checks before it trusts
  a .pyc), and of each sys.path folder and each folder that holds one of those files (a module
  added where an import would find it first).

Anything else (another argument, a changed file, a page typer printed with an error or on
stderr, an unreadable or odd cache file) runs typer as always, which prints the help and
records it again. A page is recorded only for `--help` or `COMMAND --help` that exited 0 and
wrote nothing on stderr. A page file holds the key's sha256, never the key (the environment may
hold secrets), and a page that holds a character the CLI's output escaping would have written
out is never replayed. This module imports json and nothing else beyond the interpreter's own
start-up.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterator

FORMAT = 1
FOLDER = "help"  # under the cache folder (fsutil.cache_root)
MAX_BYTES = 1 << 20
MAX_PAGES = 64  # pages kept; the oldest go first


def cacheable(args: list[str]) -> bool:
    """Only the two shapes whose whole output is a help page."""
    return args == ["--help"] or (len(args) == 2 and args[1] == "--help" and not args[0].startswith("-"))


def _stream(s: Any) -> list[Any]:
    return [getattr(s, "encoding", None), getattr(s, "errors", None)]


def _terminal() -> list[int] | None:
    """What shutil.get_terminal_size reads besides $COLUMNS and $LINES (those are in the env)."""
    stream = sys.__stdout__
    try:
        return None if stream is None else list(os.get_terminal_size(stream.fileno()))
    except (AttributeError, ValueError, OSError):
        return None


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def key(args: list[str]) -> dict[str, Any]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return {"format": FORMAT, "args": args, "argv0": sys.argv[0], "main": [getattr(main, "__package__", None),
            getattr(spec, "name", None)], "python": [sys.executable, sys.version, repr(sys.flags)],
            "path": sys.path, "env": dict(os.environ), "cwd": os.getcwd(), "terminal": _terminal(),
            "tty": [_isatty(fd) for fd in (0, 1, 2)], "streams": [_stream(sys.stdout), _stream(sys.stderr)]}


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return [st.st_mtime_ns, st.st_size, st.st_ino]


def _loaded_files() -> Iterator[str]:
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):  # a relative one is the working folder's (in the key)
            yield os.path.abspath(path)


def witness() -> list[list[Any]]:
    """The files and folders whose change could change the page, with their stat now."""
    files = sorted(set(_loaded_files()))
    folders = {os.path.dirname(f) for f in files} | {os.path.abspath(p or ".") for p in sys.path}
    return [[p, _stat(p)] for p in [sys.executable, *files, *sorted(folders - set(files))]]


def root() -> str | None:
    """fsutil.cache_root's folder, where the environment names it (else no cache)."""
    env = os.environ
    if env.get("IMAGEFACTORY_CACHE_DIR"):
        return env["IMAGEFACTORY_CACHE_DIR"]
    if env.get("XDG_CACHE_HOME"):
        return os.path.join(env["XDG_CACHE_HOME"], "imagefactory")
    return os.path.join(env["HOME"], ".cache", "imagefactory") if env.get("HOME") else None


def _sha256(data: bytes) -> str:
    """hashlib's sha256, from the interpreter's builtin module where it has one (_sha2 from 3.12,
    _sha256 before): hashlib loads OpenSSL first, a few milliseconds of the replay."""
    import importlib

    for name in ("_sha2", "_sha256", "hashlib"):
        try:
            module: Any = importlib.import_module(name)
        except ImportError:
            continue
        return str(module.sha256(data).hexdigest())
    raise ImportError("no sha256 implementation")


def digest(k: dict[str, Any]) -> str:
    """What a page file holds of its key: a digest (the environment may hold secrets; the file never does)."""
    return _sha256(json.dumps(k, sort_keys=True).encode())


def page_path(d: str) -> str | None:
    base = root()
    return None if base is None else os.path.join(base, FOLDER, f"{d[:32]}.json")


def printable(text: str) -> bool:
    """Whether inputs.printable_text leaves `text` as it is: a page holds only what the CLI's
    escaping streams let through, so a planted one cannot drive the terminal."""
    return (text.isascii() and text.replace("\n", "").replace("\t", "").isprintable()) or all(
        c.isprintable() or c in "\n\t" for c in text)


def _read(path: str) -> Any:
    """The page file's JSON: a regular file, not a link, at most MAX_BYTES; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            import stat

            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return json.loads(f.read(MAX_BYTES + 1)[:MAX_BYTES].decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def lookup(args: list[str]) -> str | None:
    """The recorded page for `args`, if every input it was printed from is unchanged."""
    if not cacheable(args):
        return None
    try:
        d = digest(key(args))
    except OSError:  # no working folder (it was removed)
        return None
    path = page_path(d)
    doc = _read(path) if path is not None else None
    if not isinstance(doc, dict) or doc.get("key") != d or not isinstance(doc.get("out"), str) \
            or not printable(doc["out"]):
        return None
    seen = doc.get("witness")
    if not isinstance(seen, list) or not all(isinstance(w, list) and len(w) == 2 and isinstance(w[0], str)
                                             for w in seen):
        return None
    return doc["out"] if all(_stat(p) == st for p, st in seen) else None


def replay(args: list[str]) -> bool:
    """Print the recorded page for `args` and say True, or say False (then typer runs)."""
    out = lookup(args)
    if out is None:
        return False
    sys.stdout.write(out)
    sys.stdout.flush()
    return True


def record(args: list[str], k: dict[str, Any], out: str) -> None:
    """Keep the page typer printed for `args`; `k`: the key as it was before typer ran. Never fatal."""
    d = digest(k)
    path = page_path(d)
    if path is None:
        return
    from pathlib import Path

    from imagefactory.files import fsutil

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fsutil.atomic_write(Path(path), json.dumps({"key": d, "out": out, "witness": witness()}))
        _prune(os.path.dirname(path))
    except (OSError, ValueError):
        pass


def _prune(folder: str) -> None:
    pages = sorted((e.stat().st_mtime_ns, e.path) for e in os.scandir(folder) if e.name.endswith(".json"))
    for _, path in pages[:-MAX_PAGES]:
        os.unlink(path)


class Tee:
    """A stream that passes writes on and keeps a copy (what the page replays)."""

    def __init__(self, raw: Any):
        self.raw = raw
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.raw.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)
