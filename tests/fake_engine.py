"""The in-memory ContainerEngine for every unit test that needs an engine (build.py, smoke.py,
publish.py, bench.py, doctor.py, the CLI).

One `World` is what a Docker engine plus a registry would hold: images with labels and tags,
what each cell's build and probe do, what each push does, what the registry serves. `World.engine`
is the engine factory the pipeline takes; every engine it makes shares the world and the run's
Interrupt, like the real per-thread engines share one daemon.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from imagefactory.run.context import UI, BuildOptions, RunContext, Settings, Silent
from imagefactory.config import platforms
from imagefactory.engine.api import (Builder, BuildProgress, BuildRequest, ContainerEngine, EngineInfo, LocalImage,
                                     Manifest, PushOutcome, RegistryClient, RunResult, is_transient, refuse_foreign)
from imagefactory.errors import BuildError, Cancelled, EngineError, EngineGone, PushError, RegistryError
from imagefactory.interrupt import Interrupt
from imagefactory.pipeline.schedule import instructions

if TYPE_CHECKING:  # like the real engine's: only a push measures layers
    from imagefactory.engine.layer_sizes import Measured

LABEL_RE = re.compile(r'(\S+)="([^"]*)"')
ENGINE_INFO = EngineInfo("27.3.1", "1.47", ("runc",), (), cpus=16, architecture="x86_64")

# What a cell's build does: "ok", "error" (the stream reports an error event), "hang" (until
# interrupted), "gone" (the engine stops answering).
# What its probe does: a dict (printed as the probe's JSON), ("timeout", dict) (printed the dict,
# then was killed at the timeout), "hang" (until interrupted), "crash" (the default).
# What a push of a ref does, try by try: "ok", "unauthorized", "transient", "hang".
# A build reports one progress step per Dockerfile instruction; `hold[cell]` makes it wait
# before its step 2 until the event is set. `run_outputs`, when not empty, answers the next
# runs in order (a RunResult, or an exception to raise) whatever the image: the bench's
# workload containers. Calls are recorded: ("build", cell), ("step", (cell, n)),
# ("probe", cell) and ("run", image) for each container, ("build_args", {...}) with the
# build's pull/cache_from/nocache.


@dataclass
class Image:
    id: str
    labels: dict[str, str]
    tags: set[str] = field(default_factory=set)
    cell: str = ""
    platform: str = "linux/amd64"  # its config's os/architecture


@dataclass
class World:
    interrupt: Interrupt = field(default_factory=Interrupt)
    builds: dict[str, str] = field(default_factory=dict)  # cell id -> behaviour (default "ok")
    probes: dict[str, Any] = field(default_factory=dict)  # cell id -> behaviour
    pushes: dict[str, list[str]] = field(default_factory=dict)  # ref -> behaviour per try (default "ok")
    wrong_digest: set[str] = field(default_factory=set)  # refs the registry serves another digest for
    wrong_arch: set[str] = field(default_factory=set)  # cells whose builds come out linux/amd64 whatever was asked
    # the registry's HTTP API (lists): what was PUT, by ref and by repo@digest; what each PUT of a ref does,
    # try by try ("ok", "transient", "refused", "hang"); refs whose index the registry serves altered
    manifests: dict[str, Manifest] = field(default_factory=dict)
    puts: dict[str, list[str]] = field(default_factory=dict)
    altered: set[str] = field(default_factory=set)
    label_lookup_fails: bool = False
    images: dict[str, Image] = field(default_factory=dict)
    # image id -> its layers as a push sends them (layer_sizes; the registry's manifests of it)
    layers: dict[str, Measured] = field(default_factory=dict)
    # local_image: image id (or cell id) -> its size in the store (1000 when unset); base ref -> its diff ids
    sizes: dict[str, int] = field(default_factory=dict)
    base_layers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    registry: dict[str, str] = field(default_factory=dict)  # ref -> digest served (base images too)
    blobs: dict[str, Image] = field(default_factory=dict)  # digest -> the image a pull of it gives (pushes add)
    pull_fails: bool = False  # every pull fails (the registry refuses)
    local: dict[str, list[str]] | None = None  # ref -> local RepoDigests (None: one per ref, see below)
    hold: dict[str, threading.Event] = field(default_factory=dict)  # cell id -> set before its step 2
    run_outputs: list[Any] = field(default_factory=list)  # RunResult | Exception, answered in order
    run_calls: list[dict] = field(default_factory=list)  # each run's arguments
    info: EngineInfo = ENGINE_INFO
    builder: Builder | str = Builder.classic  # what its engines build with (classic or buildkit)
    product: str = "docker"  # what serves the API: docker | podman (podman names an arbitrary UID after it)
    gpus: bool = False
    calls: list[tuple] = field(default_factory=list)  # (operation, argument), in order
    running: set[str] = field(default_factory=set)  # containers now running
    on_call: Callable[[str, Any], None] = lambda op, arg: None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def engine(self) -> ContainerEngine:
        return FakeEngine(self)

    def served_digest(self, ref: str, auth_config: dict[str, str] | None) -> str | None:
        """What the registry serves under `ref` (`registry`, or a wrong digest for `wrong_digest`),
        asked of the engine or of the registry: recorded as ("registry_digest", ref) either way."""
        self.record("registry_digest", ref)
        self.record("digest_auth", (ref, auth_config))
        served = self.registry.get(ref)
        if served and ref in self.wrong_digest:
            return "sha256:" + "0" * 64
        return served

    def context(self, options: Settings | None = None, ui: UI | None = None) -> RunContext:
        """A run on this world: its engines share the world's interrupt."""
        return RunContext(options or BuildOptions(), ui or Silent(), self.interrupt, self.engine)

    def record(self, op: str, arg: Any) -> None:
        with self.lock:
            self.calls.append((op, arg))
        self.on_call(op, arg)

    def ops(self, op: str) -> list[Any]:
        return [arg for o, arg in self.calls if o == op]

    def count(self, op: str) -> list[Any]:
        return sorted(self.ops(op))

    def image_by_ref(self, ref: str) -> Image | None:
        return self.images.get(ref) or next((i for i in self.images.values() if ref in i.tags), None)


def as_launched(probe: dict, options: dict[str, Any], environment: dict[str, str], product: str = "docker") -> dict:
    """The probe a well-behaved engine's container would report under these create options:
    the user (podman adds a passwd entry named after an arbitrary UID), read-only root, /tmp,
    HOME and cpuset the launch asked for."""
    probe = json.loads(json.dumps(probe))
    launch = probe.setdefault("launch", {})
    if not isinstance(launch, dict):
        return probe
    if "user" in options and isinstance(probe.get("user"), dict):
        uid, gid = (int(x) for x in str(options["user"]).split(":"))
        probe["user"].update(uid=uid, gid=gid, name=None if product == "docker" else str(uid))
    if options.get("read_only"):
        launch.update(root_read_only=True, tmp_writable=True,
                      tmp_noexec="exec" not in str((options.get("tmpfs") or {}).get("/tmp", "")).split(","))
    if "HOME" in environment:
        launch.update(home=environment["HOME"], home_writable=False)
    if "cpuset_cpus" in options and isinstance(probe.get("cpus"), dict):
        probe["cpus"]["affinity"] = len(str(options["cpuset_cpus"]).split(","))
    return probe


class FakeEngine:
    """Implements imagefactory.engine.api.ContainerEngine in memory."""

    def __init__(self, world: World):
        self.world = world
        self.interrupt = world.interrupt
        self.builder = Builder(world.builder)
        self.registry: RegistryClient = FakeRegistry(world)

    def _hang(self) -> None:
        while not self.interrupt.is_set():
            self.interrupt._event.wait(0.05)
        raise Cancelled("interrupted")

    def describe(self) -> EngineInfo:
        return self.world.info

    def product(self) -> str:
        return self.world.product

    # -- images --------------------------------------------------------------------------
    def images_with_label(self, key: str, value: str) -> dict[str, list[str]]:
        self.world.record("images_with_label", value)
        if self.world.label_lookup_fails:
            raise EngineError("could not list the local images: 500 Server Error")
        return {i.id: sorted(i.tags) for i in list(self.world.images.values()) if i.labels.get(key) == value}

    def labelled_image(self, ref: str, key: str, value: str) -> str | None:
        self.world.record("labelled_image", ref)
        image = self.world.image_by_ref(ref)
        return image.id if image is not None and image.labels.get(key) == value else None

    def image_id(self, ref: str) -> str | None:
        image = self.world.image_by_ref(ref)
        return image.id if image else None

    def image_platform(self, ref: str) -> str | None:
        image = self.world.image_by_ref(ref)
        return image.platform if image else None

    def local_image(self, ref: str) -> LocalImage | None:
        """A built image: `world.sizes` (by image id, else by cell) and the diff ids of `world.layers`
        (those of layer_sizes' default when unset); a base: `world.base_layers`, else none."""
        self.world.record("local_image", ref)
        if ref in self.world.base_layers:
            return LocalImage(5000, self.world.base_layers[ref])
        image = self.world.image_by_ref(ref)
        if image is None:
            return None
        measured = self.world.layers.get(image.id)
        diff_ids = tuple(x.diff_id for x in measured.layers) if measured else ("sha256:" + "d" * 64,)
        return LocalImage(self.world.sizes.get(image.id, self.world.sizes.get(image.cell, 1000)), diff_ids)

    def layer_sizes(self, ref: str) -> Measured:
        """`world.layers` of the image `ref` names (one 1000-byte layer when unset)."""
        self.world.record("layer_sizes", ref)
        self.interrupt.check()
        image = self.world.image_by_ref(ref)
        if image is None:
            raise EngineError(f"cannot measure {ref}: no such image")
        from imagefactory.engine.layer_sizes import Layer, Measured

        return self.world.layers.get(image.id, Measured((Layer(1000, "sha256:" + "d" * 64, "sha256:" + "d" * 64),)))

    def tag(self, image: str, ref: str) -> None:
        self.world.record("tag", (image, ref))
        target = self.world.image_by_ref(image)
        if target is None:
            raise EngineError(f"could not tag {image} as {ref}: no such image")
        for other in self.world.images.values():
            other.tags.discard(ref)
        target.tags.add(ref)

    def untag(self, ref: str) -> None:
        self.world.record("untag", ref)
        for image in self.world.images.values():
            image.tags.discard(ref)

    def remove_image(self, ref: str) -> None:
        self.world.record("remove_image", ref)
        image = self.world.image_by_ref(ref)
        if image is not None:
            del self.world.images[image.id]

    # -- build ---------------------------------------------------------------------------
    def build(self, request: BuildRequest, *, log: Callable[[str], None] = lambda line: None,
              progress: Callable[[BuildProgress], None] = lambda p: None) -> str:
        self.interrupt.check()
        cell, tag = Path(request.context).name, request.tag
        self.world.record("build", cell)
        self.world.record("build_args", {"cell": cell, "pull": request.pull, "cache_from": list(request.cache_from),
                                         "nocache": request.nocache, "secrets": dict(request.secrets),
                                         "platform": request.platform.oci, "request": request})
        if request.secrets and self.builder is Builder.classic:
            raise BuildError("the classic builder has no build secrets; build with --builder buildkit")
        if self.builder is Builder.classic:
            refuse_foreign(request, platforms.native(self.world.info.architecture))
        dockerfile = (Path(request.context) / "Dockerfile").read_text()
        behaviour = self.world.builds.get(cell, "ok")
        steps = instructions(dockerfile) or ["FROM base"]
        progress(BuildProgress(1, len(steps), steps[0]))
        self.world.record("step", (cell, 1))
        log(f"Step 1/{len(steps)} : {steps[0]}")
        if behaviour == "error":
            raise BuildError("The command '/bin/sh -c pip install x' returned a non-zero code: 1",
                             step="step 2/2: RUN pip install x", log_tail=["ERROR: no such package"])
        if behaviour == "gone":
            raise EngineGone(f"build of {tag}: lost the Docker engine: connection refused")
        if behaviour == "hang":
            self.world.running.add(f"build-{cell}")
            try:
                self._hang()
            finally:
                self.world.running.discard(f"build-{cell}")
        for n, line in enumerate(steps[1:], 2):
            if n == 2 and cell in self.world.hold:
                assert self.world.hold[cell].wait(10)
            self.interrupt.check()
            self.world.record("step", (cell, n))
            progress(BuildProgress(n, len(steps), line))
        image = Image("sha256:" + hashlib.sha256(f"{cell}{len(self.world.images)}".encode()).hexdigest(),
                      dict(LABEL_RE.findall(dockerfile)), {tag}, cell,
                      "linux/amd64" if cell in self.world.wrong_arch else request.platform.oci)
        with self.world.lock:
            for other in self.world.images.values():
                other.tags.discard(tag)
            self.world.images[image.id] = image
        return image.id

    # -- run -----------------------------------------------------------------------------
    def native_platform(self) -> platforms.Platform | None:
        return platforms.native(self.world.info.architecture)

    def gpus_available(self) -> bool:
        return self.world.gpus

    def run(self, image: str, command: list[str], *, timeout: float, gpus: bool = False,
            environment: dict[str, str] | None = None, cpus: float | None = None,
            options: dict[str, Any] | None = None, platform: platforms.Platform | None = None) -> RunResult:
        self.interrupt.check()
        self.world.record("run", image)
        self.world.record("run_options", (image, dict(options or {}), dict(environment or {})))
        self.world.run_calls.append({"image": image, "command": command, "timeout": timeout, "gpus": gpus,
                                     "cpus": cpus, "environment": environment, "options": options,
                                     "platform": platform})
        if self.world.run_outputs:
            out = self.world.run_outputs.pop(0)
            if isinstance(out, Exception):
                raise out
            return out
        target = self.world.image_by_ref(image)
        cell = target.cell if target else "?"
        if not {"entrypoint", "user"} & set(options or {}):  # one ("probe", cell) per image: its docker mode
            self.world.record("probe", cell)
        behaviour = self.world.probes.get(cell, "crash")
        if callable(behaviour):  # per launch: behaviour(options, environment)
            behaviour = behaviour(dict(options or {}), dict(environment or {}))
        if behaviour == "hang":
            self.world.running.add(f"probe-{cell}")
            try:
                self._hang()
            finally:
                self.world.running.discard(f"probe-{cell}")
        if isinstance(behaviour, dict):
            behaviour = as_launched(behaviour, dict(options or {}), dict(environment or {}), self.world.product)
        if behaviour == "crash":
            return RunResult(1, "", "Traceback: boom")
        if isinstance(behaviour, tuple) and behaviour[0] == "timeout":
            # it printed a complete report, then hung, and was killed at the timeout
            return RunResult(None, json.dumps(behaviour[1]) + "\n", "")
        return RunResult(0, json.dumps(behaviour) + "\n", "")

    # -- push ----------------------------------------------------------------------------
    def push(self, ref: str, *, auth_config: dict[str, str] | None = None,
             progress: Callable[[dict], None] = lambda e: None, compression: str = "gzip") -> PushOutcome:
        self.interrupt.check()
        self.world.record("push", ref)
        if compression != "gzip":
            self.world.record("push_compression", (ref, compression))
        tries = self.world.pushes.get(ref, [])
        behaviour = tries.pop(0) if tries else "ok"
        if behaviour == "hang":
            self._hang()
        if behaviour in ("unauthorized", "transient"):
            message = ("unauthorized: authentication required" if behaviour == "unauthorized"
                       else "received unexpected HTTP status: 502 Bad Gateway")
            secret = (auth_config or {}).get("password", "")
            raise PushError(f"push of {ref} failed: {message} (sent {secret})", transient=is_transient(message))
        image = self.world.image_by_ref(ref)
        if image is None:
            raise PushError(f"push of {ref} failed: no such image", transient=False)
        digest = "sha256:" + hashlib.sha256(image.id.encode()).hexdigest()
        progress({"status": "Pushed", "id": "layer1"})
        self.world.registry[ref] = digest
        self.world.blobs[digest] = Image(image.id, dict(image.labels), set(), image.cell, image.platform)
        return PushOutcome(ref, digest, ["layer1"], [])

    def pull(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str:
        """A pull of name:tag@digest gives what was pushed under that digest (`world.blobs`)."""
        self.interrupt.check()
        self.world.record("pull", ref)
        self.world.record("pull_auth", auth_config)
        blob = self.world.blobs.get(ref.partition("@")[2])
        if self.world.pull_fails or blob is None:
            raise EngineError(f"pull of {ref} failed: manifest unknown")
        with self.world.lock:
            image = self.world.images.setdefault(blob.id, Image(blob.id, dict(blob.labels), set(), blob.cell,
                                                                blob.platform))
        return image.id

    def registry_digest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str | None:
        return self.world.served_digest(ref, auth_config)

    def local_repo_digests(self, ref: str) -> list[str]:
        """`world.local`, else: every base image is here, pulled from its registry, one repo digest
        per reference."""
        self.world.record("local_repo_digests", ref)
        if self.world.local is not None:
            return self.world.local.get(ref, [])
        name = ref.split("@", 1)[0]
        if ":" in name.rsplit("/", 1)[-1]:
            name = name.rsplit(":", 1)[0]
        return [f"{name}@sha256:{hashlib.sha256(ref.encode()).hexdigest()}"]


class FakeRegistry:
    """Implements imagefactory.engine.api.RegistryClient on the same World: the registry the fake
    engines push to and pull from. Calls are recorded as ("registry_manifest", ref) and
    ("put_manifest", ref), with their auth_config as ("manifest_auth", ...) and ("put_auth", ...)."""

    def __init__(self, world: World):
        self.world = world
        self.interrupt = world.interrupt

    def _hang(self) -> None:
        while not self.interrupt.is_set():
            self.interrupt._event.wait(0.05)
        raise Cancelled("interrupted")

    def manifest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> Manifest | None:
        """A pushed tag serves a Docker schema 2 manifest of its digest; a PUT ref what was put
        (`altered`: the same index with its first member's digest changed, a digest of its own)."""
        self.interrupt.check()
        self.world.record("registry_manifest", ref)
        self.world.record("manifest_auth", (ref, auth_config))
        put = self.world.manifests.get(ref)
        if put is not None and ref in self.world.altered:
            doc = json.loads(put.body)
            doc["manifests"][0]["digest"] = "sha256:" + "e" * 64
            body = json.dumps(doc).encode()
            return Manifest(put.media_type, "sha256:" + hashlib.sha256(body).hexdigest(), body)
        if put is not None:
            return put
        digest = ref.partition("@")[2] or self.world.served_digest(ref, auth_config)
        if not digest or (ref.partition("@")[2] and digest not in self.world.blobs):
            return None
        blob = self.world.blobs.get(digest)
        measured = self.world.layers.get(blob.id) if blob is not None else None
        layers = [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "digest": layer.digest,
                   "size": layer.size} for layer in (measured.layers if measured else ())]
        return Manifest("application/vnd.docker.distribution.manifest.v2+json", digest,
                        json.dumps({"schemaVersion": 2, "for": digest, "layers": layers}).encode())

    def put_manifest(self, ref: str, manifest: Manifest, *, auth_config: dict[str, str] | None = None) -> str:
        self.interrupt.check()
        self.world.record("put_manifest", ref)
        self.world.record("put_auth", (ref, auth_config))
        tries = self.world.puts.get(ref, [])
        behaviour = tries.pop(0) if tries else "ok"
        if behaviour == "hang":
            self._hang()
        if behaviour == "transient":
            raise RegistryError(f"putting {ref}: the registry answered HTTP 503", transient=True)
        if behaviour == "refused":
            raise RegistryError(f"putting {ref}: the registry answered HTTP 400 MANIFEST_INVALID", transient=False)
        self.world.manifests[ref] = manifest
        self.world.registry[ref] = manifest.digest
        return manifest.digest

    def digest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str | None:
        """The digest served under `ref` (a digest in it is its own), as World.served_digest records it."""
        self.interrupt.check()
        return ref.partition("@")[2] or self.world.served_digest(ref, auth_config)

    def content(self, pinned: str, kind: str, digest: str, *, auth_config: dict[str, str] | None = None,
                accept: str = "") -> bytes | None:
        """The bytes of a manifest put under `digest` in `pinned`'s repository; no blobs are kept."""
        self.interrupt.check()
        put = self.world.manifests.get(f"{pinned.split('@', 1)[0]}@{digest}")
        return put.body if put is not None and kind == "manifests" else None
