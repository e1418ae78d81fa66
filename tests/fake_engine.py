"""An in-memory ContainerEngine for the orchestration unit tests (build.py, smoke.py, publish.py).

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
from typing import Any, Callable

from imagefactory.engine import BuildProgress, ContainerEngine, PushOutcome, RunResult, is_transient
from imagefactory.errors import BuildError, Cancelled, EngineError, EngineGone, PushError
from imagefactory.interrupt import Interrupt

HASH_RE = re.compile(r'io\.imagefactory\.content-hash="([0-9a-f]{64})"')

# What a cell's build does: "ok", "error" (the stream reports an error event), "hang" (until
# interrupted), "gone" (the engine stops answering).
# What its probe does: a dict (printed as the probe's JSON), ("timeout", dict) (printed the dict,
# then was killed at the timeout), "hang" (until interrupted), "crash" (the default).
# What a push of a ref does, try by try: "ok", "unauthorized", "transient", "hang".


@dataclass
class Image:
    id: str
    labels: dict[str, str]
    tags: set[str] = field(default_factory=set)
    cell: str = ""


@dataclass
class World:
    interrupt: Interrupt = field(default_factory=Interrupt)
    builds: dict[str, str] = field(default_factory=dict)  # cell id -> behaviour (default "ok")
    probes: dict[str, Any] = field(default_factory=dict)  # cell id -> behaviour
    pushes: dict[str, list[str]] = field(default_factory=dict)  # ref -> behaviour per try (default "ok")
    wrong_digest: set[str] = field(default_factory=set)  # refs the registry serves another digest for
    label_lookup_fails: bool = False
    images: dict[str, Image] = field(default_factory=dict)
    registry: dict[str, str] = field(default_factory=dict)  # ref -> digest served
    calls: list[tuple] = field(default_factory=list)  # (operation, argument), in order
    running: set[str] = field(default_factory=set)  # containers now running
    on_call: Callable[[str, Any], None] = lambda op, arg: None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def engine(self) -> ContainerEngine:
        return FakeEngine(self)

    def record(self, op: str, arg: Any) -> None:
        with self.lock:
            self.calls.append((op, arg))
        self.on_call(op, arg)

    def ops(self, op: str) -> list[Any]:
        return [arg for o, arg in self.calls if o == op]

    def image_by_ref(self, ref: str) -> Image | None:
        return self.images.get(ref) or next((i for i in self.images.values() if ref in i.tags), None)


def as_launched(probe: dict, options: dict[str, Any], environment: dict[str, str]) -> dict:
    """The probe a well-behaved engine's container would report under these create options:
    the user, read-only root, /tmp, HOME and cpuset the launch asked for."""
    probe = json.loads(json.dumps(probe))
    launch = probe.setdefault("launch", {})
    if not isinstance(launch, dict):
        return probe
    if "user" in options and isinstance(probe.get("user"), dict):
        uid, gid = (int(x) for x in str(options["user"]).split(":"))
        probe["user"].update(uid=uid, gid=gid, name=None)
    if options.get("read_only"):
        launch.update(root_read_only=True, tmp_writable=True,
                      tmp_noexec="exec" not in str((options.get("tmpfs") or {}).get("/tmp", "")).split(","))
    if "HOME" in environment:
        launch.update(home=environment["HOME"], home_writable=False)
    if "cpuset_cpus" in options and isinstance(probe.get("cpus"), dict):
        probe["cpus"]["affinity"] = len(str(options["cpuset_cpus"]).split(","))
    return probe


class FakeEngine:
    """Implements imagefactory.engine.ContainerEngine in memory."""

    def __init__(self, world: World):
        self.world = world
        self.interrupt = world.interrupt

    def _hang(self) -> None:
        while not self.interrupt.is_set():
            self.interrupt._event.wait(0.05)
        raise Cancelled("interrupted")

    # -- images --------------------------------------------------------------------------
    def images_with_label(self, key: str, value: str) -> dict[str, list[str]]:
        self.world.record("images_with_label", value)
        if self.world.label_lookup_fails:
            raise EngineError("could not list the local images: 500 Server Error")
        return {i.id: sorted(i.tags) for i in list(self.world.images.values()) if i.labels.get(key) == value}

    def image_id(self, ref: str) -> str | None:
        image = self.world.image_by_ref(ref)
        return image.id if image else None

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

    # -- build ---------------------------------------------------------------------------
    def build(self, context: str, tag: str, *, network_mode: str | None = "host",
              log: Callable[[str], None] = lambda line: None,
              progress: Callable[[BuildProgress], None] = lambda p: None,
              pull: bool = False, cache_from: list[str] | None = None) -> str:
        self.interrupt.check()
        cell = Path(context).name
        self.world.record("build", cell)
        dockerfile = (Path(context) / "Dockerfile").read_text()
        behaviour = self.world.builds.get(cell, "ok")
        progress(BuildProgress(1, 2, "FROM base"))
        log("Step 1/2 : FROM base")
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
        m = HASH_RE.search(dockerfile)
        image = Image("sha256:" + hashlib.sha256(f"{cell}{len(self.world.images)}".encode()).hexdigest(),
                      {"io.imagefactory.content-hash": m[1] if m else ""}, {tag}, cell)
        with self.world.lock:
            for other in self.world.images.values():
                other.tags.discard(tag)
            self.world.images[image.id] = image
        return image.id

    # -- run -----------------------------------------------------------------------------
    def gpus_available(self) -> bool:
        return False

    def run(self, image: str, command: list[str], *, timeout: float, gpus: bool = False,
            environment: dict[str, str] | None = None, options: dict[str, Any] | None = None) -> RunResult:
        self.interrupt.check()
        self.world.record("run", image)
        self.world.record("run_options", (image, dict(options or {}), dict(environment or {})))
        target = self.world.image_by_ref(image)
        cell = target.cell if target else "?"
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
            behaviour = as_launched(behaviour, dict(options or {}), dict(environment or {}))
        if behaviour == "crash":
            return RunResult(1, "", "Traceback: boom")
        if isinstance(behaviour, tuple) and behaviour[0] == "timeout":
            # it printed a complete report, then hung, and was killed at the timeout
            return RunResult(None, json.dumps(behaviour[1]) + "\n", "")
        return RunResult(0, json.dumps(behaviour) + "\n", "")

    # -- push ----------------------------------------------------------------------------
    def push(self, ref: str, *, auth_config: dict[str, str] | None = None,
             progress: Callable[[dict], None] = lambda e: None) -> PushOutcome:
        self.interrupt.check()
        self.world.record("push", ref)
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
        return PushOutcome(ref, digest, ["layer1"], [])

    def registry_digest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str | None:
        self.world.record("registry_digest", ref)
        served = self.world.registry.get(ref)
        if served and ref in self.world.wrong_digest:
            return "sha256:" + "0" * 64
        return served

    def local_repo_digests(self, ref: str) -> list[str]:
        """Every base image is here, pulled from its registry: one repo digest per reference."""
        self.world.record("local_repo_digests", ref)
        name = ref.split("@", 1)[0]
        if ":" in name.rsplit("/", 1)[-1]:
            name = name.rsplit(":", 1)[0]
        return [f"{name}@sha256:{hashlib.sha256(ref.encode()).hexdigest()}"]
