"""`conda` in the test channel's stand-in installer (imagefactory tests only; not conda).

Runs on the installer's own python as `python -I -m _imagefactory_standin_conda ROOT ARGS...`
(bin/conda). It supports exactly what imagefactory's conda template runs:

    conda --version
    conda create -y -p PREFIX SPEC...      solve with py-rattler against ROOT/.condarc's channels
    conda create -y -p PREFIX --file LOCK  an @EXPLICIT lock of URL#SHA256 lines, no solve
    conda clean -afy

Packages are downloaded into $CONDA_PKGS_DIRS (else ROOT/pkgs) and checked against their
sha256 there; one already there with the right digest is not downloaded again. Logins come
from $NETRC (else ~/.netrc), as conda's requests session reads them. Anything else exits 2.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import netrc
import os
import re
import shutil
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

VERSION = "0.0.0"  # not a conda release: see --version
SUBDIRS: list[Any] = ["linux-64", "noarch"]
_EXPLICIT_RE = re.compile(r"(?P<url>https?://\S+?/(?P<subdir>[^/]+)/(?P<file>[^/#]+\.(?:conda|tar\.bz2)))"
                          r"#(?:sha256:)?(?P<sha256>[0-9a-f]{64})")


class Failure(Exception):
    """One line for stderr, and the exit status."""

    def __init__(self, line: str, status: int = 1) -> None:
        super().__init__(line)
        self.status = status


def unsupported(what: str) -> Failure:
    return Failure(f"conda (imagefactory test stand-in): {what} is not supported; this stand-in runs only "
                   f"`conda create -y -p PREFIX SPEC...|--file LOCK`, `conda clean -afy` and `conda --version`", 2)


# --------------------------------------------------------------------------- configuration

def channels(root: Path) -> list[str]:
    """The `channels:` list of ROOT/.condarc, as imagefactory's condarc.j2 writes it."""
    path = root / ".condarc"
    if not path.is_file():
        raise Failure(f"NoChannelsConfiguredError: {path} does not exist (this stand-in has no default channels)")
    out, inside = [], False
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].rstrip()
        if not line or line.lstrip().startswith("#"):
            continue
        if not line.startswith((" ", "-")):
            inside = line.strip() == "channels:"
            continue
        item = line.strip()
        if inside and item.startswith("- "):
            value = item[2:].strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = json.loads(value) if value[0] == '"' else value[1:-1].replace("''", "'")
            out.append(value.rstrip("/"))
    if not out:
        raise Failure(f"NoChannelsConfiguredError: {path} lists no channels")
    for url in out:
        if "://" not in url:
            raise Failure(f"UnavailableInvalidChannel: {url}: this stand-in reaches only channels given as URLs")
    return out


def pkgs_dirs(root: Path) -> list[Path]:
    env = os.environ.get("CONDA_PKGS_DIRS", "")
    dirs = [Path(d) for d in env.split(",") if d.strip()]
    return dirs or [root / "pkgs"]


# --------------------------------------------------------------------------- downloads

def _login(url: str) -> str | None:
    host = urllib.parse.urlsplit(url).hostname or ""
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    if not entry:
        return None
    user, _, password = entry
    return "Basic " + base64.b64encode(f"{user}:{password or ''}".encode()).decode()


def _download(url: str, target: Path) -> str:
    """url into target (via a temporary file); returns the sha256 of what arrived."""
    request = urllib.request.Request(url, headers={"User-Agent": "conda/imagefactory-standin"})
    login = _login(url)
    if login:
        request.add_header("Authorization", login)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(request, timeout=120) as response:
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
                h.update(block)
        os.replace(tmp, target)
    except urllib.error.HTTPError as e:
        raise Failure(f"CondaHTTPError: HTTP {e.code} {e.reason} for url <{url}>") from None
    except (urllib.error.URLError, OSError) as e:
        raise Failure(f"CondaHTTPError: could not fetch <{url}>: {getattr(e, 'reason', e)}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(url: str, sha256: str, cache: Path) -> Path:
    """The package at `url`, in the cache and matching `sha256`: downloaded only when not there."""
    target = cache / url.rsplit("/", 1)[-1]
    if target.is_file() and file_sha256(target) == sha256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    actual = _download(url, target)
    if actual != sha256:
        target.unlink()
        raise Failure(f"ChecksumMismatchError: Conda detected a mismatch between the expected content and "
                      f"downloaded content for url '{url}': expected sha256: {sha256}, actual sha256: {actual}")
    return target


# --------------------------------------------------------------------------- records

def local_record(record: Any, path: Path) -> Any:
    """The record, pointing at its verified file in the package cache."""
    import rattler
    return rattler.RepoDataRecord(record, path.name, path.as_uri(), str(record.channel))


async def _index_json(path: Path) -> bytes:
    from rattler.package_streaming import PackageArchive
    archive = await PackageArchive.from_path(path)
    data = await archive.read_file("info/index.json")
    if data is None:
        raise Failure(f"CondaVerificationError: {path.name} has no info/index.json")
    return data


def explicit_records(lock: Path, cache: Path) -> list[tuple[Any, str, str]]:
    """(record, url, channel) for every line of an @EXPLICIT lock, each file checked by sha256."""
    import rattler
    lines = [line.strip() for line in lock.read_text().splitlines()]
    body = [line for line in lines if line and not line.startswith("#")]
    if not body or body[0] != "@EXPLICIT":
        raise Failure(f"CondaValueError: {lock}: not an @EXPLICIT environment")
    out = []
    for line in body[1:]:
        m = _EXPLICIT_RE.fullmatch(line)
        if not m:
            raise Failure(f"CondaValueError: {lock}: not URL#SHA256 (this stand-in checks every file): {line}")
        path = fetch(m["url"], m["sha256"], cache)
        with tempfile.TemporaryDirectory() as tmp:
            index = Path(tmp) / "index.json"
            index.write_bytes(asyncio.run(_index_json(path)))
            md5 = hashlib.md5(path.read_bytes()).hexdigest()
            record = rattler.PackageRecord.from_index_json(index, size=path.stat().st_size, sha256=m["sha256"],
                                                           md5=md5)
        channel = m["url"].rsplit("/", 2)[0]
        out.append((rattler.RepoDataRecord(record, path.name, path.as_uri(), channel), m["url"], channel))
    return out


def client() -> Any:
    """rattler's HTTP client, with logins from netrc/keyring/auth file; it needs the system's CA
    roots even for http:// (reqwest's builder fails without /etc/ssl/certs)."""
    from rattler.networking import Client
    try:
        return Client.authenticated_client()
    except ValueError as e:
        raise Failure(f"CondaSSLError: cannot set up HTTP ({e}): are CA certificates installed "
                      f"(/etc/ssl/certs, Debian's ca-certificates)?") from None


def solved_records(root: Path, specs: list[str], cache: Path) -> list[tuple[Any, str, str]]:
    import rattler
    from rattler.virtual_package import VirtualPackageOverrides
    urls = channels(root)
    gateway = rattler.Gateway(cache_dir=cache / "cache", client=client())
    virtual = rattler.VirtualPackage.detect(VirtualPackageOverrides.from_env())
    try:
        match = [rattler.MatchSpec(s, strict=False) for s in specs]
        records = asyncio.run(rattler.solve([rattler.Channel(u) for u in urls], match, gateway=gateway,
                                            platforms=SUBDIRS, virtual_packages=virtual))
    except Exception as e:  # rattler's errors: solver conflicts, fetch errors, bad specs
        text = " ".join(str(e).split())
        raise Failure(f"{type(e).__name__}: {text}") from None
    out = []
    for r in records:
        url = str(r.url)
        path = fetch(url, r.sha256.hex() if isinstance(r.sha256, bytes) else str(r.sha256), cache)
        out.append((local_record(r, path), url, str(r.channel)))
    return out


# --------------------------------------------------------------------------- commands

def _fix_meta(prefix: Path, origins: dict[str, tuple[str, str]]) -> None:
    """conda-meta as conda leaves it: readable by every user (rattler writes 0600), each record's
    url and channel the remote ones (not the cache file rattler was given)."""
    meta = prefix / "conda-meta"
    for path in sorted(meta.glob("*.json")):
        record = json.loads(path.read_text())
        origin = origins.get(record.get("fn", ""))
        if origin:
            record["url"], record["channel"] = origin
            path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        path.chmod(0o644)
    with open(meta / "history", "a") as f:
        f.write(f"==> imagefactory stand-in conda create <==\n# cmd: {' '.join(sys.argv)}\n")
    (meta / "history").chmod(0o644)


def create(root: Path, args: list[str]) -> int:
    prefix, lock, specs = None, None, []
    it = iter(args)
    for a in it:
        if a in ("-y", "--yes", "-q", "--quiet"):
            continue
        if a in ("-p", "--prefix"):
            prefix = Path(next(it, ""))
        elif a.startswith("--prefix="):
            prefix = Path(a.split("=", 1)[1])
        elif a == "--file":
            lock = Path(next(it, ""))
        elif a.startswith("-"):
            raise unsupported(f"`conda create {a}`")
        else:
            specs.append(a)
    if prefix is None or not str(prefix) or (lock is None) == (not specs) or (lock is not None and specs):
        raise unsupported("`conda create` without exactly `-p PREFIX` and either SPEC... or `--file LOCK`")
    if prefix.exists() and any(prefix.iterdir()):
        raise Failure(f"CondaValueError: prefix already exists: {prefix}")
    cache = pkgs_dirs(root)[0]
    cache.mkdir(parents=True, exist_ok=True)
    entries = explicit_records(lock, cache) if lock else solved_records(root, specs, cache)
    import rattler
    records = [e[0] for e in entries]
    asyncio.run(rattler.install(records, prefix, cache_dir=cache, show_progress=False, client=client()))
    _fix_meta(prefix, {Path(url).name: (url, channel) for _, url, channel in entries})
    print(f"Preparing transaction: done\nExecuting transaction: done ({len(records)} packages in {prefix})")
    return 0


def clean(root: Path, args: list[str]) -> int:
    flags = set()
    for a in args:
        if re.fullmatch(r"-[afy]+", a):
            flags |= set(a[1:])
        elif a in ("--all", "--force-pkgs-dirs", "--yes"):
            flags.add({"--all": "a", "--force-pkgs-dirs": "f", "--yes": "y"}[a])
        else:
            raise unsupported(f"`conda clean {a}`")
    if "a" not in flags:
        raise unsupported("`conda clean` without -a")
    for folder in pkgs_dirs(root):
        if folder.is_dir():
            for child in folder.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    return 0


def run(argv: list[str]) -> int:
    root, args = Path(argv[0]), argv[1:]
    if args in (["--version"], ["-V"]):
        import rattler  # noqa: F401
        from importlib.metadata import version
        print(f"conda {VERSION} (imagefactory test stand-in on py-rattler {version('py-rattler')})")
        return 0
    if args[:1] == ["create"]:
        return create(root, args[1:])
    if args[:1] == ["clean"]:
        return clean(root, args[1:])
    raise unsupported(f"`conda {' '.join(args)}`" if args else "`conda` without a command")


def main() -> None:
    try:
        status = run(sys.argv[1:])
    except Failure as e:
        print(str(e), file=sys.stderr)
        status = e.status
    except Exception as e:  # one line, not a traceback: the build log shows it
        print(f"conda (imagefactory test stand-in): {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # normal interpreter shutdown after rattler segfaulted 1 run in 5


if __name__ == "__main__":
    main()
