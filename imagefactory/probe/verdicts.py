"""Verdict cache: an image that already passed the probe is not probed again.

A record says: image <id>, probed by probe <version> (and exact probe text), with GPUs
given or not, at <threads> threads, in launch modes <modes> with /dev/shm <shm>, natively or
emulated as <emulated> (platforms.Emulated; the key has no "emulated" for a native probe),
passed at <time>; it keeps each mode's raw probe JSON. A record from before the launch modes (no
"modes" in its key) never matches: that image is probed again in every mode.

Where the records live, and why: one JSON file per image id under
`$IMAGEFACTORY_CACHE_DIR/verdicts/` (default `$XDG_CACHE_HOME/imagefactory/verdicts/`, i.e.
`~/.cache/imagefactory/verdicts/`). Not the work dir: `build/` lives in the checkout and
is gone on a fresh clone, while the images are still on the engine, and a fresh
checkout on the same engine is exactly when re-probing is wasted. Not a label on a
derived image: writing a label means committing a new image (a build) per verdict and
finding it back by a second lookup, which costs more than the probe's margin; a small
file costs one read. An image id is the digest of the image's config, so a record can
only ever describe the content it was made for, whichever engine holds it.

The folder is a store (store.py's `Store`, here `VERDICTS`; --verdicts-dir gives a run another
folder: read bounded, never through a link, written atomically and durably, the newest KEPT
images' files staying) whose key is the image id's hex, itself a sha256 of the image's config. A record is checked whole when read:
anything that is not a well-formed record for exactly this key is ignored, and the
cell is probed again. On a hit, the stored probe JSON is judged again by today's
checks (cheap), so a stricter checks.py never lets an old pass through.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from imagefactory.probe import checks
from imagefactory.files.store import Store
from imagefactory.config import platforms
from imagefactory.probe import smoke
from imagefactory.config.model import Cell, Threads
from imagefactory.engine.api import DOCKER
from imagefactory.probe.smoke import DEFAULT_MODES, DEFAULT_SHM

IMAGE_ID_RE = re.compile(r"sha256:([0-9a-f]{64})")
_VERSION_RE = re.compile(r"^PROBE_VERSION = (\d+)$", re.MULTILINE)
_AT_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?\+00:00")
FORMAT = 1
MAX_BYTES = 4 << 20  # a record is a few KiB; anything huge is not ours
KEPT = 4096  # images whose verdicts stay; the oldest go first


def probe_version() -> str:
    """PROBE_VERSION read from the probe's text (the probe is never imported or run here),
    plus a digest of that text: an edited probe without a version bump still re-probes."""
    text = smoke.probe_source()
    m = _VERSION_RE.search(text)
    number = m[1] if m else "unknown"
    return f"{number}+{hashlib.sha256(text.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class Key:
    image_id: str
    probe_version: str
    gpus: bool
    threads: Threads  # a count, or "auto" (the entrypoint's budget)
    modes: tuple[str, ...] = DEFAULT_MODES  # launch modes (smoke.MODES), each proven
    shm: str = DEFAULT_SHM  # the probe containers' /dev/shm setting
    emulation: platforms.Emulated | None = None  # how the probe ran when not natively
    product: str = DOCKER  # what ran the probe's containers (ContainerEngine.product(): docker | podman)

    def as_dict(self) -> dict:
        out = {"image_id": self.image_id, "probe_version": self.probe_version,
               "gpus": self.gpus, "threads": self.threads, "modes": list(self.modes), "shm": self.shm}
        if self.product != DOCKER:  # (Docker's keys stay as they were before podman was known)
            out["engine"] = self.product
        return {**out, "emulated": str(self.emulation)} if self.emulation else out


def key(image_id: str, cell: Cell, *, gpus: bool, modes: tuple[str, ...] = DEFAULT_MODES,
        shm: str = DEFAULT_SHM, emulation: platforms.Emulated | None = None, product: str = DOCKER) -> Key:
    return Key(image_id, probe_version(), gpus, cell.threads, tuple(modes), shm, emulation, product)


@dataclass(frozen=True)
class Hit:
    checks: list[checks.Check]
    at: str  # when the earlier verdicts were made (UTC, ISO 8601)
    probe: dict | None = None  # {mode: the stored probe JSON}: what the SBOM is made from (supply.py)


VERDICTS = Store("verdicts", KEPT, MAX_BYTES, suffix=".json", durable=True)  # the cache folder's verdicts/


def _store(directory: Path | None) -> Store:
    """The verdicts' store: the cache folder's (VERDICTS), or `directory` (--verdicts-dir)."""
    return VERDICTS if directory is None else Store(VERDICTS.name, KEPT, MAX_BYTES, suffix=".json", durable=True,
                                                    at=directory)


def _entry(image_id: str) -> str | None:
    m = IMAGE_ID_RE.fullmatch(image_id)
    return m[1] if m else None


def _records(doc: object) -> list[dict]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("records"), list):
        return []
    return [r for r in doc["records"] if isinstance(r, dict)]


def _read(store: Store, entry: str) -> list[dict]:
    text = store.get(entry)  # bounded, no link nor FIFO
    try:
        return _records(json.loads(text)) if text is not None else []
    except (ValueError, RecursionError):
        return []


def lookup(directory: Path | None, k: Key, cell: Cell) -> Hit | None:
    """The earlier passing verdicts for exactly this key, judged again now; None: probe."""
    entry = _entry(k.image_id)
    if entry is None:
        return None
    for record in _read(_store(directory), entry):
        at, probe = record.get("at"), record.get("probe")
        if record.get("key") != k.as_dict() or not isinstance(at, str) or not _AT_RE.fullmatch(at):
            continue
        if not isinstance(probe, dict) or sorted(probe) != sorted(k.modes):  # {mode: probe JSON}
            continue
        judged = smoke.judge(cell, {m: probe[m] for m in k.modes}, gpu_required=k.gpus, emulation=k.emulation,
                             product=k.product)
        if checks.passed(judged):
            return Hit(judged, at, probe)
    return None


def store(directory: Path | None, k: Key, probe: dict, *, now: dt.datetime | None = None) -> str | None:
    """Record a pass (`probe`: {launch mode: its probe JSON}, every mode of the key); returns
    its time, or None when the cache cannot be written (never fatal: the next run simply
    probes again)."""
    at = (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc).isoformat(timespec="seconds")
    return at if _write(directory, k, {"key": k.as_dict(), "at": at, "probe": probe}) else None


def forget(directory: Path | None, k: Key) -> None:
    """Drop the record for this key: the image has just failed a probe (e.g. under --retest)."""
    _write(directory, k, None)


def _write(directory: Path | None, k: Key, record: dict | None) -> bool:
    entry = _entry(k.image_id)
    if entry is None:
        return False
    store = _store(directory)
    kept = [r for r in _read(store, entry) if r.get("key") != k.as_dict()][-7:]  # other modes of this image
    file = store.file(entry)
    if record is None and (file is None or not file.exists()):
        return True
    doc = {"format": FORMAT, "records": kept + ([record] if record else [])}
    return store.put(entry, json.dumps(doc, sort_keys=True))
