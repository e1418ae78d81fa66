"""The Docker client's environment, checked before an engine is asked: DOCKER_HOST (whole-string
pattern) and the Docker config folder and file (read bounded).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from imagefactory.errors import ConfigError
from imagefactory.files.bounded import InputError, read_real, short
from imagefactory.files.fsutil import home
from imagefactory.terminal import printable, show


DOCKER_CONFIG_MAX_BYTES = 1 << 20  # a config.json with dozens of logins is a few KB


_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])"


DOCKER_HOST_RE = re.compile(
    rf"unix://(?P<path>/[^\s\x00]{{1,4000}})|(?:tcp|http|https)://{_HOST}(?::(?P<port>[0-9]{{1,5}}))?/?"
    rf"|ssh://(?:[A-Za-z0-9._-]{{1,64}}@)?{_HOST}(?::(?P<sshport>[0-9]{{1,5}}))?/?|fd://[0-9]{{0,9}}", re.ASCII)


def docker_host(environ: Any = None) -> str | None:
    """$DOCKER_HOST when it is set and well formed (unix:///PATH, tcp://HOST[:PORT], ssh://[USER@]HOST[:PORT]),
    None when unset; ConfigError naming it otherwise (the SDK would raise a traceback)."""
    env = os.environ if environ is None else environ
    value = env.get("DOCKER_HOST")
    if not value:
        return None
    m = DOCKER_HOST_RE.fullmatch(value)
    port = m and (m["port"] or m["sshport"])
    if m is None or (port and not 0 < int(port) <= 65535):
        raise ConfigError(printable(f"$DOCKER_HOST {show(value)}: not an engine address (unix:///var/run/docker.sock, "
                                    f"tcp://HOST:PORT with a port from 1 to 65535, ssh://USER@HOST)"))
    return value


def docker_config_dir(environ: Any = None) -> Path | None:
    """$DOCKER_CONFIG, else ~/.docker; None without a home."""
    env = os.environ if environ is None else environ
    if env.get("DOCKER_CONFIG"):
        return Path(env["DOCKER_CONFIG"])
    where = home(env)
    return where / ".docker" if where is not None else None


def check_docker_config(environ: Any = None) -> bytes | None:
    """The bytes of the Docker CLI's config.json (what the SDK reads for logins), read bounded;
    None when there is none. ConfigError for a FIFO, a device, a huge file: the SDK would hang on
    it or run out of memory."""
    env = os.environ if environ is None else environ
    folder = docker_config_dir(env)
    if folder is None:
        return None
    path = folder / "config.json"
    if not os.path.lexists(path):
        return None
    try:
        return read_real(path, DOCKER_CONFIG_MAX_BYTES)[1]
    except InputError as e:
        raise ConfigError(printable(f"{'$DOCKER_CONFIG' if env.get('DOCKER_CONFIG') else '~/.docker'}"
                                    f"/config.json {short(path)}: {e}")) from None
