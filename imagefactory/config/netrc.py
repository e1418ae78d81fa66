"""Index and channel logins: a netrc file, mounted into BuildKit builds as a secret.

`build --netrc PATH` (default: $NETRC, then ~/.netrc when it exists) names the file. It is read
once, through the bounded reader (bounded.read_real), and only to learn which hosts it has
logins for, with netrc(5)'s grammar (tokens across lines, quoted words; a password is never a
keyword). Links are followed (a Kubernetes secret volume, a dotfile manager's ~/.netrc); what they
lead to must be a regular file outside /proc, /sys and /dev, readable, within MAX_BYTES, UTF-8
without NUL bytes, or it is exit 2. The file itself (not the link) is what is mounted. Its
contents never enter a message, a log or the report; only its path and host names do.

The file reaches a build only as `docker buildx build --secret id=netrc,src=PATH`, mounted by
`RUN --mount=type=secret,id=netrc,target=SECRET_PATH` around the install steps, with
NETRC=SECRET_PATH set for that RUN only (pip's and conda's HTTP client, requests, reads it).
A secret mount is no layer, no ENV, no ARG, no label and no history entry. The classic builder
has no secrets, so a cell that needs a login is refused under it, before anything is built.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping
from urllib.parse import urlsplit
from imagefactory.files import bounded
from imagefactory import terminal
from imagefactory.files import fsutil
from imagefactory.errors import ConfigError
from imagefactory.config.model import Cell, Matrix

SECRET_ID = "netrc"
SECRET_PATH = "/run/secrets/imagefactory-netrc"  # inside the install RUN only
MAX_BYTES = 64 * 1024
# a netrc machine name: a host name or IPv4 address (no port, no path), or an IPv6 address, bare or
# in a URL's brackets (no zone: `%eth0` names no host a URL can)
HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
IPV6_RE = re.compile(r"\[?(?P<address>[0-9A-Fa-f:.]{2,45})\]?")
ANY_HOST = "*"  # a `default` entry: a login for every host


@dataclass(frozen=True)
class Netrc:
    path: Path
    hosts: frozenset[str]  # lower-case machine names; ANY_HOST for a `default` entry

    def __str__(self) -> str:  # as the run's settings line shows it: the path, never more
        return str(self.path)


def default_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """$NETRC, else ~/.netrc when it exists, else None (nothing to mount, also without a home)."""
    env = os.environ if environ is None else environ
    if env.get("NETRC"):
        return Path(env["NETRC"])
    home = fsutil.home(env)
    candidate = home / ".netrc" if home is not None else None
    return candidate if candidate is not None and os.path.lexists(candidate) else None


def locate(flag: Path | None) -> Netrc | None:
    """The netrc a command reads logins from: --netrc when given, else $NETRC, else ~/.netrc;
    loaded and checked (load), named in errors by where it came from. None: there is none."""
    path = flag if flag is not None else default_path()
    if path is None:
        return None
    return load(path, "--netrc" if flag is not None else ("$NETRC" if os.environ.get("NETRC") else "~/.netrc"))


def load(path: Path, flag: str = "--netrc") -> Netrc:
    """The hosts a netrc file has logins for. Links are followed (a Kubernetes secret volume, a
    dotfile manager's ~/.netrc), and what they lead to must be a regular UTF-8 file of at most
    MAX_BYTES outside /proc, /sys and /dev (bounded.read_real); ConfigError (exit 2) otherwise.
    The path kept (and mounted) is the file itself, not the link."""
    where = f"{flag} {bounded.short(path)}"
    try:
        real, data = bounded.read_real(path, MAX_BYTES)
    except bounded.InputError as e:
        raise ConfigError(f"{where}: {e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    if "\0" in text:
        raise ConfigError(f"{where}: holds NUL bytes, so it is not a netrc file")
    try:
        found = hosts(text)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    return Netrc(real, frozenset(found))


MAX_TOKENS = 20_000  # a netrc of MAX_BYTES holds far fewer
_VALUE_KEYWORDS = ("login", "user", "password", "account")  # each takes the next token as its value


class _Lexer:
    """netrc's tokens, as netrc(5) and Python's netrc read them: words separated by white space,
    newlines included; a "quoted word" (a backslash escapes the next character); at most MAX_TOKENS."""

    def __init__(self, text: str):
        self.text, self.i, self.count = text, 0, 0

    def word(self) -> str | None:
        text, n = self.text, len(self.text)
        while self.i < n and text[self.i].isspace():
            self.i += 1
        if self.i >= n:
            return None
        self.count += 1
        if self.count > MAX_TOKENS:
            raise ValueError(f"more than {MAX_TOKENS} words")
        quoted = text[self.i] == '"'
        self.i += quoted
        out: list[str] = []
        while self.i < n and (text[self.i] != '"' if quoted else not text[self.i].isspace()):
            if text[self.i] == "\\" and self.i + 1 < n:
                self.i += 1
            out.append(text[self.i])
            self.i += 1
        self.i += quoted  # the closing quote
        return "".join(out)

    def skip_past(self, mark: str) -> None:
        """To just after the next `mark` (the end of a comment line, a macro's empty line)."""
        end = self.text.find(mark, self.i)
        self.i = len(self.text) if end < 0 else end + len(mark)


def hosts(text: str) -> set[str]:
    """The machine names of a netrc text (ANY_HOST for `default`). The value after login, password
    and account is never a keyword, whatever it says; a `#` word where a keyword goes starts a
    comment; macdef bodies are skipped. Never returns or reports a login, password or account."""
    found: set[str] = set()
    lexer = _Lexer(text)
    while (word := lexer.word()) is not None:
        if word == "machine":
            name = machine_host(lexer.word() or "")
            if name is not None:
                found.add(name)
        elif word == "default":
            found.add(ANY_HOST)
        elif word in _VALUE_KEYWORDS:
            lexer.word()  # the value is never looked at
        elif word == "macdef":
            lexer.word()  # the macro's name; its body runs to the next empty line
            lexer.skip_past("\n\n")
        elif word.startswith("#"):
            lexer.skip_past("\n")
    return found


def machine_host(name: str) -> str | None:
    """The host a netrc machine name stands for, as a URL's host is compared (urlsplit's hostname):
    lower-case, an IPv6 address without brackets (`[::1]` and `::1` alike); None: it names none."""
    if HOST_RE.fullmatch(name):
        return name.lower()
    m = IPV6_RE.fullmatch(name)
    if m is None or (name[0] == "[") != (name[-1] == "]") or ":" not in m["address"]:
        return None
    try:
        ipaddress.IPv6Address(m["address"])
    except ValueError:
        return None
    return m["address"].lower()


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


def _login_hosts(netrc: Netrc, matrix: Matrix, cell: Cell) -> list[str]:
    """The hosts a cell installs from that the netrc has a login for (all of them for `default`)."""
    used = cell_hosts(matrix, cell)
    return sorted(used if ANY_HOST in netrc.hosts else used & netrc.hosts)


def needs(netrc: Netrc | None, matrix: Matrix, cell: Cell) -> bool:
    """Whether the netrc has a login for a host the cell installs from."""
    if netrc is None:
        return False
    used = cell_hosts(matrix, cell)
    return bool(used & netrc.hosts) or (ANY_HOST in netrc.hosts and bool(used))


def resolve(flag: Path | None, matrix: Matrix, cells: Iterable[Cell], *, buildkit: bool,
            warn: Callable[[str], None]) -> Netrc | None:
    """The netrc a build mounts (locate: --netrc, $NETRC or ~/.netrc), or None. A netrc that names
    no host the cells use: a warning, nothing mounted. Under the classic builder a cell that needs
    it is refused (exit 2)."""
    netrc = locate(flag)
    if netrc is None:
        return None
    cells = list(cells)
    needing = [c for c in cells if needs(netrc, matrix, c)]
    if not needing:
        used = sorted({h for c in cells for h in cell_hosts(matrix, c)})
        warn(f"warning: netrc {netrc.path}: names no host the selected cells install from "
             f"({terminal.listing(used, empty='no index or channel URL set')}); nothing is mounted")
        return None
    if not buildkit:
        raise ConfigError([
            f"cell {c.id}: installs from {terminal.listing(_login_hosts(netrc, matrix, c))}, "
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

