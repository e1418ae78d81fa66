"""What identifies an image on an engine, in either image store: the one rule every step asks.

An engine names each local image by an id, and what that id is depends on its image store:
- the graph-driver store (overlay2; Docker up to 28 by default, Debian 12's 20.10): the
  image's **config digest**;
- the containerd image store (Docker 29's fresh installs, Docker Desktop since 4.34, any engine
  with the `containerd-snapshotter` feature): the image's **manifest digest**, or its index
  digest when the name holds a multi-platform image.

Nothing in the pipeline derives an id of its own: verdicts, content-hash lookups, reports,
tags and pushes all use the id the engine gives (`ContainerEngine.image_id`). A build's id is
the id the engine gives the name just built, checked against what the builder says it made
(`built`): buildx's metadata names the config digest and the manifest digest, and the
engine's id must be one of them. So a verdict kept under a graph-driver id is never found for
the same image in the containerd store: it is probed again, never trusted for another image.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")

GRAPH_DRIVER = "graph-driver"
CONTAINERD = "containerd"
# docker info's DriverStatus says it of an engine on the containerd image store.
_SNAPSHOTTER = "io.containerd.snapshotter.v1"


def store(info: Mapping[str, Any]) -> str:
    """The image store of an engine, from its `docker info`: CONTAINERD when DriverStatus names
    containerd's snapshotter (driver-type io.containerd.snapshotter.v1), else GRAPH_DRIVER."""
    status = info.get("DriverStatus")
    if isinstance(status, list):
        for pair in status:
            if isinstance(pair, (list, tuple)) and len(pair) == 2 and pair[1] == _SNAPSHOTTER:
                return CONTAINERD
    return GRAPH_DRIVER


def builder_digests(metadata: Mapping[str, Any]) -> frozenset[str]:
    """The digests buildx's --metadata-file says the build made: the image's config digest and
    its manifest digest (each only when it is a well-formed sha256 digest)."""
    found = set()
    for key in ("containerimage.config.digest", "containerimage.digest"):
        value = metadata.get(key)
        if isinstance(value, str) and DIGEST_RE.fullmatch(value):
            found.add(value)
    return frozenset(found)


def built(engine_id: str | None, made: Iterable[str]) -> str | None:
    """The id of the image a build just made: the engine's id for the name it built, when the
    builder's own digests (`made`, empty when it said none) include it; None when the engine
    holds no such name or the name holds another image than the build made."""
    if engine_id is None or not DIGEST_RE.fullmatch(engine_id):
        return None
    made = frozenset(made)
    return engine_id if not made or engine_id in made else None
