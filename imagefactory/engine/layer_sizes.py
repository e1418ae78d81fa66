"""An image's layers as a push would send them, measured before the push (a size budget's input).

The one input both image stores give is `docker save`'s stream, read once, nothing kept on disk:
- the containerd image store (Docker 23+ with the snapshotter) saves an OCI layout whose layers are
  the compressed blobs a push sends: their sizes are **exact**;
- the classic graph-driver store (Docker 20.10's overlay2) saves each layer as an uncompressed
  `layer.tar`; a push gzips it then. Its size is **estimated** by gzip-compressing the stream at
  zlib's default level and counting the bytes (nothing written), and kept by diff id in the one
  store (files/store.py), so a later image holding the same layer is not measured again.
Which one a member is, is decided by its first bytes (gzip or zstd magic: a blob), not by the engine.
Each layer's Dockerfile step comes from the image config's history (its non-empty entries, in order);
an environment layer's packages from the list it carries (resources/layers.py writes
PREFIX/etc/imagefactory/layers/<layer>.txt), found in the first PEEK uncompressed bytes of the
layer as it streams past (a tar is in path order: etc/ before lib/). A zstd blob's is not read.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import zlib
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Iterator, Protocol

from imagefactory.files.store import Store

GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
SMALL = 4 << 20  # members read into memory: manifest.json, the config (JSON); layers are streamed
CHUNK = 1 << 20
PEEK = 64 << 20  # the uncompressed bytes at a layer's start searched for its package list
LIST_MAX = 1 << 16  # the largest package list read
STEP_CHARS = 1000  # of a layer's Dockerfile step (a settled apt step names its packages past 600)
SIZES = Store("layer-sizes", 4096, LIST_MAX + 2 * STEP_CHARS, suffix=".json")  # size, step, package list
# the list's path in the layer tar, and each of its lines: pip's name==version, conda's name=version=build
LIST_RE = re.compile(r"(?:\./)?(?:[A-Za-z0-9._+-]{1,255}/){1,16}etc/imagefactory/layers/(?P<layer>[0-9]-[a-z]{1,20})\.txt")
PACKAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}(?:==[A-Za-z0-9._+!-]{1,64}|=[A-Za-z0-9._+!-]{1,64}=[A-Za-z0-9._+-]{1,64})")


@dataclass(frozen=True)
class Layer:
    """One layer: its compressed bytes (as pushed, or estimated), the blob's digest where it exists
    locally ("" when estimated), its diff id (the uncompressed tar's sha256) and the Dockerfile step
    that made it ("" when the history does not say)."""

    size: int
    diff_id: str
    digest: str = ""
    step: str = ""
    estimated: bool = False  # gzipped here, not a blob's size
    packages: tuple[str, ...] = ()  # an environment layer's, from the list it carries; () when none was found


@dataclass(frozen=True)
class Measured:
    """An image's layers in order, base first."""

    layers: tuple[Layer, ...]

    @property
    def exact(self) -> bool:
        """Every size is a local blob's (the containerd store); else some are gzip estimates."""
        return not any(layer.estimated for layer in self.layers)

    @property
    def total(self) -> int:
        return sum(layer.size for layer in self.layers)


class _Chunks(io.RawIOBase):
    """A raw stream over an iterable of byte chunks (the SDK's `get_image` answer), to buffer."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it: Iterator[bytes] = iter(chunks)
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._left:
            chunk = next(self._it, None)
            if chunk is None:
                return 0
            self._left = memoryview(chunk)
        n = min(len(buffer), len(self._left))
        buffer[:n] = self._left[:n]
        self._left = self._left[n:]
        return n


class Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


def gzip_size(stream: Readable) -> tuple[int, str]:
    """(bytes of `stream` gzip-compressed at zlib's default level, the sha256 of `stream`): the
    estimate of a layer a push will gzip, and its diff id. Nothing is written."""
    squeeze, h, size = zlib.compressobj(6, zlib.DEFLATED, 31), hashlib.sha256(), 0
    while chunk := stream.read(CHUNK):
        h.update(chunk)
        size += len(squeeze.compress(chunk))
    return size + len(squeeze.flush()), "sha256:" + h.hexdigest()


def _member(tar: tarfile.TarFile, info: tarfile.TarInfo, small: dict[str, bytes],
            sizes: dict[str, tuple[int, str, bool, tuple[str, ...]]]) -> None:
    """Read one member of the save stream: JSON-sized ones kept, each layer measured and its
    package list looked for."""
    stream = tar.extractfile(info)
    if stream is None:
        return
    head = stream.read(4)
    if head.startswith(GZIP_MAGIC) or head == ZSTD_MAGIC:  # a compressed blob: exact, as pushed
        inflate = _Inflate(head) if head.startswith(GZIP_MAGIC) else None
        while chunk := stream.read(CHUNK):
            if inflate:
                inflate.feed(chunk)
        found = packages(bytes(inflate.out)) if inflate else ()
        sizes[info.name] = (info.size, "sha256:" + info.name.rsplit("/", 1)[-1], True, found)
    elif info.name.endswith("layer.tar") or info.size > SMALL:  # uncompressed: estimated
        kept = _Kept(_Prefixed(head, stream))
        size, diff_id = gzip_size(kept)
        sizes[info.name] = (size, diff_id, False, packages(bytes(kept.out)))
    else:
        small[info.name] = head + stream.read()


class _Inflate:
    """The first PEEK uncompressed bytes of a gzip blob, fed its compressed chunks in order."""

    def __init__(self, head: bytes) -> None:
        self._d, self.out, self._broken = zlib.decompressobj(31), bytearray(), False
        self.feed(head)

    def feed(self, chunk: bytes) -> None:
        if self._broken or len(self.out) >= PEEK or self._d.eof:
            return
        try:
            self.out += self._d.decompress(self._d.unconsumed_tail + chunk, PEEK - len(self.out))
        except zlib.error:  # not gzip after its magic: what was inflated is all there is
            self._broken = True


class _Kept:
    """`stream` read through, its first PEEK bytes kept."""

    def __init__(self, stream: Readable) -> None:
        self._stream, self.out = stream, bytearray()

    def read(self, n: int = -1, /) -> bytes:
        data = self._stream.read(n)
        if len(self.out) < PEEK:
            self.out += data[:PEEK - len(self.out)]
        return data


def packages(start: bytes) -> tuple[str, ...]:
    """The package list an environment layer carries, from its tar's first bytes (`start`, perhaps
    cut short): each line that is a package, in the list's order; () when there is none."""
    try:
        with tarfile.open(fileobj=io.BytesIO(start), mode="r|") as tar:
            for info in tar:
                if info.isfile() and info.size <= LIST_MAX and LIST_RE.fullmatch(info.name):
                    stream = tar.extractfile(info)
                    text = stream.read().decode("utf-8", "replace") if stream else ""
                    return tuple(line for line in text.splitlines() if PACKAGE_RE.fullmatch(line))
    except (tarfile.TarError, EOFError, OSError, zlib.error):
        pass  # cut short before the list, or not a tar: no list
    return ()


class _Prefixed:
    """`stream` with `head` (bytes already read from it) put back in front."""

    def __init__(self, head: bytes, stream: IO[bytes]) -> None:
        self._head, self._stream = head, stream

    def read(self, n: int = -1, /) -> bytes:
        head, self._head = self._head, b""
        return head + self._stream.read(n if n < 0 else max(0, n - len(head)))


_METADATA_RE = re.compile(r"(?:.* )?#\(nop\) +(?!COPY |ADD )[A-Z]+ .*", re.DOTALL)  # classic: no layer


def steps(config: dict, count: int) -> list[str]:
    """The Dockerfile step of each of the `count` layers, base first: the config history's entries
    that made a layer. Some builders (the classic one on the containerd store) mark none
    `empty_layer`; their metadata-only steps are `#(nop)` ones other than COPY/ADD. When even that
    does not give one step per layer, none is named ([]): a wrong step is worse than none."""
    history = config.get("history")
    if not isinstance(history, list):
        return []
    entries = [h for h in history if isinstance(h, dict)]
    made = [str(h.get("created_by", ""))[:STEP_CHARS] for h in entries if not h.get("empty_layer")]
    if len(made) != count:
        made = [step for step in made if not _METADATA_RE.fullmatch(step)]
    return made if len(made) == count else []


def measure(chunks: Iterable[bytes]) -> Measured:
    """The layers of the one image in a `docker save` stream, in manifest.json's order. ValueError
    when the stream is not a save of one image."""
    small: dict[str, bytes] = {}
    sizes: dict[str, tuple[int, str, bool, tuple[str, ...]]] = {}
    with tarfile.open(fileobj=io.BufferedReader(_Chunks(chunks), CHUNK), mode="r|") as tar:
        for info in tar:
            if info.isfile():
                _member(tar, info, small, sizes)
    manifest = json.loads(small.get("manifest.json", b"null"))
    if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict):
        raise ValueError("the save stream holds no manifest.json of one image")
    config = json.loads(small.get(str(manifest[0].get("Config")), b"{}"))
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    made = steps(config, len(manifest[0].get("Layers") or []))
    layers = []
    for i, path in enumerate(manifest[0].get("Layers") or []):
        if path not in sizes:
            raise ValueError(f"the save stream lacks layer {str(path)[:80]}")
        size, named, exact, found = sizes[path]
        diff_id = str(diff_ids[i]) if i < len(diff_ids) else (named if not exact else "")
        layers.append(Layer(size, diff_id, named if exact else "", made[i] if i < len(made) else "", not exact, found))
    return Measured(tuple(layers))


def _key(diff_id: str) -> str:
    return SIZES.key(diff_id, code=(__name__,))


def kept(diff_ids: list[str]) -> Measured | None:
    """The layers estimated before for these diff ids; None unless every one is kept."""
    found = []
    for diff_id in diff_ids:
        text = SIZES.get(_key(diff_id))
        try:
            entry = json.loads(text) if text else None
        except ValueError:
            entry = None
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or isinstance(entry["size"], bool):
            return None
        listed = entry.get("packages")
        names = tuple(str(p) for p in listed if PACKAGE_RE.fullmatch(str(p))) if isinstance(listed, list) else ()
        found.append(Layer(entry["size"], diff_id, "", str(entry.get("step", ""))[:STEP_CHARS], True, names))
    return Measured(tuple(found)) if found else None


def keep(result: Measured) -> None:
    """Keep each estimated layer's size by diff id (never fatal). A blob's size is not kept: the
    save stream says it without compressing, and another blob may hold the same diff id."""
    for layer in result.layers:
        if layer.estimated and layer.diff_id:
            SIZES.put(_key(layer.diff_id), json.dumps({"size": layer.size, "step": layer.step,
                                                      "packages": list(layer.packages)}))


def measured(diff_ids: list[str], save: Callable[[], Iterable[bytes]], *, estimates: bool) -> Measured:
    """The image's layers (`diff_ids`: its rootfs's, from an inspect): on a store that holds no blobs
    (`estimates`), kept by diff id when every one was measured before; else its save stream (`save`)
    read once, and its estimates kept."""
    found = kept(diff_ids) if estimates else None
    if found is not None:
        return found
    result = measure(save())
    keep(result)
    return result
