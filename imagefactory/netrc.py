"""Index and channel logins: a netrc file, mounted into BuildKit builds as a secret.

`build --netrc PATH` (default: $NETRC, then ~/.netrc when it exists) names the file. It is read
once, through the bounded reader (inputs.read_regular), and only to learn which hosts it has
logins for: a link, anything but a regular file, an unreadable or oversized file is exit 2.
Its contents never enter a message, a log or the report; only its path and host names do.

The file reaches a build only as `docker buildx build --secret id=netrc,src=PATH`, mounted by
`RUN --mount=type=secret,id=netrc,target=SECRET_PATH` around the install steps, with
NETRC=SECRET_PATH set for that RUN only (pip's and conda's HTTP client, requests, reads it).
A secret mount is no layer, no ENV, no ARG, no label and no history entry. The classic builder
has no secrets, so a cell that needs a login is refused under it, before anything is built.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping
from urllib.parse import urlsplit

from imagefactory import inputs
from imagefactory.errors import ConfigError
from imagefactory.model import Cell, Matrix

SECRET_ID = "netrc"
SECRET_PATH = "/run/secrets/imagefactory-netrc"  # inside the install RUN only
MAX_BYTES = 64 * 1024
# a netrc machine name: a host name or address (no port, no path)
HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")
ANY_HOST = "*"  # a `default` entry: a login for every host


@dataclass(frozen=True)
class Netrc:
    path: Path
    hosts: frozenset[str]  # lower-case machine names; ANY_HOST for a `default` entry

    def __str__(self) -> str:  # as the run's settings line shows it: the path, never more
        return str(self.path)


def default_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """$NETRC, else ~/.netrc when it exists, else None (nothing to mount)."""
    env = os.environ if environ is None else environ
    if env.get("NETRC"):
        return Path(env["NETRC"])
    home = Path(env.get("HOME") or Path.home())
    candidate = home / ".netrc"
    return candidate if os.path.lexists(candidate) else None


def load(path: Path, flag: str = "--netrc") -> Netrc:
    """The hosts a netrc file has logins for. ConfigError (exit 2) for a link, anything but a
    regular file, a file that cannot be read or is larger than MAX_BYTES."""
    where = f"{flag} {inputs.short(path)}"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{where}: file not found") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read: {e.strerror}") from None
    if stat.S_ISLNK(mode):
        raise ConfigError(f"{where}: is a symbolic link; name the file itself (a link could be swapped "
                          "between this check and the build)")
    try:
        data = inputs.read_regular(path, MAX_BYTES)
    except inputs.InputError as e:
        raise ConfigError(f"{where}: {e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    return Netrc(Path(os.path.abspath(path)), frozenset(hosts(text)))


def hosts(text: str) -> set[str]:
    """The machine names of a netrc text (ANY_HOST for `default`); macdef bodies are skipped.
    Never returns or reports a login, password or account."""
    found: set[str] = set()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        tokens = lines[i].split()
        i += 1
        j = 0
        while j < len(tokens):
            word = tokens[j]
            if word == "machine" and j + 1 < len(tokens):
                name = tokens[j + 1].lower()
                if HOST_RE.fullmatch(name):
                    found.add(name)
                j += 2
            elif word == "default":
                found.add(ANY_HOST)
                j += 1
            elif word == "macdef":  # a macro: its body runs to the next empty line
                while i < len(lines) and lines[i].strip():
                    i += 1
                break
            elif word in ("login", "password", "account"):
                j += 2  # the value is never looked at
            else:
                j += 1
    return found


def _host(url: str) -> str | None:
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return None
    return host.lower() if host else None


def cell_urls(matrix: Matrix, cell: Cell) -> list[str]:
    """The URLs a cell's install steps fetch packages from (indexes, channels)."""
    if cell.installer == "pip":
        pip = matrix.pip
        urls = [pip.index_url, *pip.extra_index_urls, pip.torch_index_url,
                pip.numpy_index_url if cell.blas == "mkl" else None]
        return [u for u in urls if u]
    return [c for c in matrix.conda.channels if "://" in c]


def cell_hosts(matrix: Matrix, cell: Cell) -> set[str]:
    return {h for h in (_host(u) for u in cell_urls(matrix, cell)) if h}


def needs(netrc: Netrc | None, matrix: Matrix, cell: Cell) -> bool:
    """Whether the netrc has a login for a host the cell installs from."""
    if netrc is None:
        return False
    used = cell_hosts(matrix, cell)
    return bool(used & netrc.hosts) or (ANY_HOST in netrc.hosts and bool(used))


def resolve(path: Path | None, explicit: bool, matrix: Matrix, cells: Iterable[Cell], *, buildkit: bool,
            warn: Callable[[str], None]) -> Netrc | None:
    """The netrc a build mounts, or None. A netrc that names no host the cells use: a warning,
    nothing mounted. Under the classic builder a cell that needs it is refused (exit 2)."""
    if path is None:
        return None
    netrc = load(path, "--netrc" if explicit else ("$NETRC" if os.environ.get("NETRC") else "~/.netrc"))
    cells = list(cells)
    needing = [c for c in cells if needs(netrc, matrix, c)]
    if not needing:
        used = sorted({h for c in cells for h in cell_hosts(matrix, c)})
        warn(f"warning: netrc {netrc.path}: names no host the selected cells install from "
             f"({', '.join(used) or 'no index or channel URL set'}); nothing is mounted")
        return None
    if not buildkit:
        raise ConfigError([
            f"cell {c.id}: installs from {', '.join(sorted(cell_hosts(matrix, c) & netrc.hosts) or 'its indexes')}, "
            f"whose login is in {netrc.path}; the classic builder has no build secrets, so the login could only "
            "reach the build through a layer: build with --builder buildkit (docker buildx; "
            "scripts/ci-setup.sh installs it)" for c in needing])
    return netrc


def refused_indexes(matrix: Matrix, cell: Cell, netrc_path: Path | None, timeout: float = 5.0) -> list[str]:
    """After a failed build: the cell's indexes and channels that refuse this host a login
    (401/403), asked from here with the netrc's login for their host (if any). pip reports a
    refused index only as "no matching distribution", so this names it. Never shows a login."""
    import netrc as stdlib_netrc

    import requests

    logins = None
    if netrc_path is not None:
        try:
            logins = stdlib_netrc.netrc(str(netrc_path))
        except (OSError, stdlib_netrc.NetrcParseError):
            logins = None
    found = []
    for url in cell_urls(matrix, cell):
        if "{" in url:
            continue
        host = _host(url)
        entry = logins.authenticators(host) if logins is not None and host else None
        auth = (entry[0], entry[2] or "") if entry else None
        try:
            response = requests.get(url, auth=auth, timeout=timeout, allow_redirects=True)
        except requests.RequestException:
            continue
        if response.status_code in (401, 403):
            how = "with the netrc's login" if auth else "without a login (none in a netrc for this host: --netrc PATH)"
            found.append(f"{url} answered {response.status_code} {response.reason} {how}")
    return found

