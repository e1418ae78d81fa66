"""Solving a conda cell on the host without conda: py-rattler (the library under pixi).

The only module that imports rattler. It is a host dependency of `imagefactory lock`; nothing
of it reaches an image. `solve` asks the cell's channels (mirror URLs as the matrix gives them,
logins from a netrc) for the cell's specs on one conda subdir, with the virtual packages a build
machine of that platform would have (`__cuda` from the cell, not from this host's GPU), and
returns every package of the environment by URL and sha256, sorted: the `@EXPLICIT` lock body.

Every failure is one line naming the cell: an unreachable channel, a channel that refuses a
login (or asks for one), a repodata that is not JSON, specs that cannot be satisfied (with the
solver's conflict, its tree flattened), a package the channel gives no sha256 (conda's repodata
may hold only an md5; rattler then answers with none).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, cast

from imagefactory.errors import ConfigError, ImageFactoryError

# What a build machine of the platform offers the solver (pixi's defaults for linux: glibc 2.28,
# the conda-forge baseline; an image's own glibc is newer on Debian bookworm, never older).
GLIBC = "2.28"
LINUX = "4.18"
SOLVE_TIMEOUT_S = 300
_LINE_MAX = 600
_SHA256_RE = re.compile(r"[0-9a-f]{64}")  # a lock pins every package by it (lockfile.SHA256_RE)


@dataclass(frozen=True)
class Record:
    url: str
    sha256: str
    name: str
    version: str
    build: str


class SolveError(ConfigError):
    """A conda cell cannot be solved on its channels (exit 2): one located line."""


def _one_line(text: str) -> str:
    """The solver's tree (└─, │) as one line, printable, bounded."""
    flat = " ".join(re.sub(r"[\u2500-\u257f]+", " ", text).split())
    flat = "".join(ch if ch.isprintable() else "?" for ch in flat)
    return flat if len(flat) <= _LINE_MAX else flat[:_LINE_MAX] + " ..."


def explain(cell_id: str, error: Exception, channels: list[str] | None = None) -> str:
    """One line for a rattler error: what failed, for which cell (and where, when rattler says)."""
    kind = type(error).__name__
    text = str(error)
    if kind == "SolverError":
        return f"cell {cell_id}: the conda specs cannot be satisfied on its channels: {_one_line(text)}"
    if kind == "InvalidMatchSpecError":
        return f"cell {cell_id}: a conda spec is not valid: {_one_line(text)}"
    url = re.search(r"for url \(([^)\s]+)\)", text)
    where = f" ({url.group(1)})" if url else (f" (channels: {', '.join(channels)})" if channels else "")
    if re.search(r"\b40[13]\b", text):
        return (f"cell {cell_id}: a channel refused access{where}: it needs a login (give one with --netrc "
                f"or $NETRC) or refused the one given")
    if "Connect" in text or "dns error" in text or "error sending request" in text:
        return f"cell {cell_id}: a channel could not be reached{where}: {_one_line(text)}"
    if "404" in text or "could not find subdir" in text:
        return f"cell {cell_id}: a channel has no repodata for the platform{where}: {_one_line(text)}"
    if "parse" in text.lower() or "json" in text.lower() or "expected" in text.lower():
        return f"cell {cell_id}: a channel's repodata is not valid{where}: {_one_line(text)}"
    return f"cell {cell_id}: the conda solve failed ({kind}): {_one_line(text)}"


@contextlib.contextmanager
def _netrc_env(netrc: Path | None) -> Iterator[None]:
    """rattler reads logins from $NETRC (or ~/.netrc); point it at the run's netrc, and at
    nothing else: without one, no login of this host's is sent."""
    before = os.environ.get("NETRC")
    os.environ["NETRC"] = str(netrc) if netrc is not None else os.devnull
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("NETRC", None)
        else:
            os.environ["NETRC"] = before


def virtual_packages(cuda: str | None, arch: str = "x86_64") -> list[Any]:
    from rattler import BuildString, GenericVirtualPackage, PackageName, Version

    def vp(name: str, version: str, build: str = "0") -> Any:
        return GenericVirtualPackage(PackageName(name), Version(version), BuildString(build))

    out = [vp("__unix", "0"), vp("__linux", LINUX), vp("__glibc", GLIBC), vp("__archspec", "1", arch)]
    if cuda is not None:
        out.append(vp("__cuda", cuda))
    return out


def _record(r: Any) -> Record:  # a rattler RepoDataRecord
    sha = r.sha256
    sha_hex = sha.hex() if isinstance(sha, (bytes, bytearray)) else str(sha or "")
    return Record(url=str(r.url), sha256=sha_hex, name=r.name.normalized, version=str(r.version), build=str(r.build))


async def _solve(channels: list[str], specs: list[str], subdir: str, cuda: str | None, arch: str,
                 cache: Path) -> list[object]:
    import rattler
    from rattler import Gateway, MatchSpec, SourceConfig

    # No sharded repodata: plain repodata.json, which every channel and mirror serves.
    from rattler import Client

    gateway = Gateway(cache_dir=cache, default_config=SourceConfig(sharded_enabled=False),
                      client=Client.authenticated_client())
    return list(await rattler.solve(
        channels, [MatchSpec(s, strict=False) for s in specs], gateway=gateway, platforms=[cast(Any, subdir), "noarch"],
        virtual_packages=virtual_packages(cuda, arch), timeout=datetime.timedelta(seconds=SOLVE_TIMEOUT_S)))


def solve(cell_id: str, channels: list[str], specs: list[str], *, subdir: str = "linux-64", arch: str = "x86_64",
          cuda: str | None = None, netrc: Path | None = None) -> list[Record]:
    """The environment's packages, sorted by URL. SolveError (exit 2) for every failure."""
    try:
        import rattler  # noqa: F401
    except ImportError:
        raise SolveError(f"cell {cell_id}: locking a conda cell needs py-rattler on this machine "
                         f"(pip install py-rattler)") from None
    with tempfile.TemporaryDirectory(prefix="imagefactory-solve-") as tmp, _netrc_env(netrc):
        try:
            found = asyncio.run(_solve(channels, specs, subdir, cuda, arch, Path(tmp)))
        except ImageFactoryError:  # Cancelled: the run's interrupt, raised inside the solve
            raise
        except Exception as e:  # rattler raises its own exception types, one per failure kind
            raise SolveError(explain(cell_id, e, channels)) from None
    records = sorted((_record(r) for r in found), key=lambda r: r.url)
    if not records:
        raise SolveError(f"cell {cell_id}: the conda solve returned no package")
    for r in records:
        if not _SHA256_RE.fullmatch(r.sha256):
            what = f"a malformed sha256 {r.sha256[:80]!r}" if r.sha256 else "no sha256 (its repodata may hold only an md5)"
            raise SolveError(_one_line(f"cell {cell_id}: the channel gives {r.name} {r.version} {r.build} ({r.url}) "
                                       f"{what}; a conda lock pins every package by its sha256"))
    return records
