"""The only module that talks to Docker (through the Docker SDK for Python).

Everything else calls these methods and sees imagefactory's own errors, never
the SDK's. The SDK's traps handled here (see docs): builds and pushes report
failures inside the stream rather than raising; exec/run has no timeout.
"""

from __future__ import annotations

import os
import re
from collections import deque
from dataclasses import dataclass
from typing import Callable

import docker
import docker.errors
import requests.exceptions

from imagefactory.errors import BuildError, DockerUnavailable, EngineError, PushError

STEP_RE = re.compile(r"^Step (\d+)/(\d+) : (.*)$")
TAIL_LINES = 30

START_HINT = (
    "start one (`sudo systemctl start docker`, or as root: "
    "`setsid dockerd >/tmp/dockerd.log 2>&1 &`), or point DOCKER_HOST at a running engine"
)


@dataclass
class BuildProgress:
    step: int = 0
    steps: int = 0
    instruction: str = ""


@dataclass(frozen=True)
class RunResult:
    exit_code: int | None  # None: killed at the timeout
    stdout: str
    stderr: str


@dataclass(frozen=True)
class EngineInfo:
    version: str
    api_version: str
    runtimes: tuple[str, ...]
    cdi_spec_dirs: tuple[str, ...]  # empty before Docker 25 or when CDI is off
    cpus: int = 0  # CPUs the engine's host has (NCPU)


class Engine:
    """A connected Docker engine."""

    def __init__(self, client: docker.DockerClient | None = None, *, timeout: int = 600):
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        try:
            self.client = client or docker.from_env(timeout=timeout)
            self.client.ping()
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
            raise DockerUnavailable(f"no Docker engine answered at {where} ({_short(e)}); {START_HINT}") from None
        self.api = self.client.api

    # -- images -----------------------------------------------------------------------------
    def images_with_label(self, key: str, value: str) -> dict[str, list[str]]:
        """Local images carrying label key=value: {image id: its tags}."""
        images = self.client.images.list(filters={"label": f"{key}={value}"})
        return {image.id: list(image.tags) for image in images}

    def image_id(self, ref: str) -> str | None:
        try:
            return self.client.images.get(ref).id
        except docker.errors.ImageNotFound:
            return None

    def local_repo_digests(self, ref: str) -> list[str]:
        """The local image's RepoDigests ('name@sha256:...'); [] when there is no local copy."""
        try:
            return [str(d) for d in self.client.images.get(ref).attrs.get("RepoDigests") or []]
        except (docker.errors.ImageNotFound, docker.errors.APIError):
            return []

    def tag(self, image: str, ref: str) -> None:
        repo, tag = split_tag(ref)
        try:
            ok = self.api.tag(image, repo, tag, force=True)
        except docker.errors.APIError as e:
            raise EngineError(f"could not tag {image} as {ref}: {_short(e)}") from None
        if not ok:
            raise EngineError(f"could not tag {image} as {ref}")

    # -- build ------------------------------------------------------------------------------
    def build(
        self,
        context: str,
        tag: str,
        *,
        network_mode: str = "host",
        log: Callable[[str], None] = lambda line: None,
        progress: Callable[[BuildProgress], None] = lambda p: None,
        pull: bool = False,
        cache_from: list[str] | None = None,
    ) -> str:
        """Build `context` and tag it; returns the image id. Raises BuildError with the
        failing step and the log tail when the stream reports an error."""
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        state = BuildProgress()
        image_id = None

        def emit(line: str) -> None:
            tail.append(line)
            log(line)

        try:
            stream = self.api.build(path=context, tag=tag, rm=True, forcerm=True, decode=True,
                                    network_mode=network_mode, pull=pull, cache_from=cache_from or None)
            for event in stream:
                if "stream" in event:
                    for line in event["stream"].splitlines():
                        if not line.strip():
                            continue
                        emit(line)
                        m = STEP_RE.match(line)
                        if m:
                            state = BuildProgress(int(m[1]), int(m[2]), m[3])
                            progress(state)
                if "status" in event:
                    emit(" ".join(str(event[k]) for k in ("id", "status", "progress") if event.get(k)))
                if "aux" in event and "ID" in event["aux"]:
                    image_id = event["aux"]["ID"]
                if "error" in event:
                    emit(f"ERROR: {event['error'].strip()}")
                    raise BuildError(event["error"].strip(), step=_step_text(state), log_tail=list(tail))
        except docker.errors.APIError as e:
            emit(f"ERROR: {_short(e)}")
            raise BuildError(_short(e), step=_step_text(state), log_tail=list(tail)) from None
        except requests.exceptions.RequestException as e:
            emit(f"ERROR: lost the Docker engine: {_short(e)}")
            raise BuildError(f"lost the Docker engine: {_short(e)}", step=_step_text(state),
                             log_tail=list(tail)) from None
        image_id = image_id or self.image_id(tag)
        if image_id is None:
            raise BuildError("the build ended without producing an image", step=_step_text(state),
                             log_tail=list(tail))
        return image_id

    def describe(self) -> EngineInfo:
        """Version and GPU plumbing of the engine (for `imagefactory doctor`)."""
        try:
            version, info = self.client.version(), self.client.info()
        except (docker.errors.APIError, requests.exceptions.RequestException) as e:
            raise EngineError(f"the Docker engine did not describe itself: {_short(e)}") from None
        return EngineInfo(version=str(version.get("Version", "")), api_version=str(version.get("ApiVersion", "")),
                          runtimes=tuple(sorted(info.get("Runtimes") or {})),
                          cdi_spec_dirs=tuple(info.get("CDISpecDirs") or ()),
                          cpus=int(info.get("NCPU") or 0))

    # -- run --------------------------------------------------------------------------------
    def gpus_available(self) -> bool:
        """Whether this engine can give containers GPUs (the NVIDIA runtime is registered)."""
        info = self.client.info()
        return "nvidia" in (info.get("Runtimes") or {}) or bool(info.get("CDISpecDirs") and
                                                              os.path.exists("/dev/nvidia0"))

    def run(self, image: str, command: list[str], *, timeout: float, gpus: bool = False,
            environment: dict[str, str] | None = None, cpus: float | None = None) -> RunResult:
        """Run `command` in a fresh container of `image` as the image's default user, with no
        network; kill it after `timeout` seconds. The container is always removed.
        `cpus` is `docker run --cpus` (a CFS quota)."""
        device_requests = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])] if gpus else None
        limits = {"nano_cpus": int(cpus * 1e9)} if cpus else {}
        try:
            container = self.client.containers.create(
                image, command=command, network_mode="none", detach=True,
                device_requests=device_requests, environment=environment or {}, **limits,
            )
        except docker.errors.APIError as e:
            raise EngineError(f"could not create a container of {image}: {_short(e)}") from None
        try:
            container.start()
            try:
                status = container.wait(timeout=timeout)
                code: int | None = int(status.get("StatusCode", -1))
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                container.kill()
                code = None
            out = container.logs(stdout=True, stderr=False).decode(errors="replace")
            err = container.logs(stdout=False, stderr=True).decode(errors="replace")
            return RunResult(code, out, err)
        except docker.errors.APIError as e:
            raise EngineError(f"could not run a container of {image}: {_short(e)}") from None
        finally:
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                pass

    # -- push -------------------------------------------------------------------------------
    def push(self, ref: str, *, auth_config: dict[str, str] | None = None,
             progress: Callable[[dict], None] = lambda e: None) -> "PushOutcome":
        """Push one tag. The SDK does not raise on failure: errors arrive as stream events."""
        repo, tag = split_tag(ref)
        digest = None
        layers_pushed: set[str] = set()
        layers_existing: set[str] = set()
        try:
            for event in self.api.push(repo, tag=tag, stream=True, decode=True, auth_config=auth_config):
                progress(event)
                if "error" in event:
                    message = event["error"].strip()
                    raise PushError(f"push of {ref} failed: {message}", transient=is_transient(message))
                status = event.get("status", "")
                if status == "Pushed" and event.get("id"):
                    layers_pushed.add(event["id"])
                elif status in ("Layer already exists", "Mounted from") or status.startswith("Mounted from"):
                    layers_existing.add(event.get("id", ""))
                aux = event.get("aux") or {}
                if "Digest" in aux:
                    digest = aux["Digest"]
        except docker.errors.APIError as e:
            raise PushError(f"push of {ref} failed: {_short(e)}", transient=is_transient(str(e))) from None
        except requests.exceptions.RequestException as e:
            raise PushError(f"push of {ref} failed: lost the Docker engine: {_short(e)}", transient=True) from None
        if digest is None:
            raise PushError(f"push of {ref} ended without a digest", transient=True)
        return PushOutcome(ref, digest, sorted(layers_pushed), sorted(layers_existing - {""}))

    def registry_digest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str | None:
        """The manifest digest the registry serves for `ref` (asked of the registry itself)."""
        try:
            data = self.api.inspect_distribution(ref, auth_config=auth_config)
        except (docker.errors.APIError, requests.exceptions.RequestException):
            return None
        return (data.get("Descriptor") or {}).get("digest")


@dataclass(frozen=True)
class PushOutcome:
    ref: str
    digest: str
    layers_pushed: list[str]
    layers_existing: list[str]


_AUTH_WORDS = ("unauthorized", "authentication required", "no basic auth credentials",
               "denied", "forbidden", "incorrect username or password")


def is_transient(message: str) -> bool:
    """Authentication and permission failures never get better by retrying; most else may."""
    low = message.lower()
    return not any(w in low for w in _AUTH_WORDS)


def split_tag(ref: str) -> tuple[str, str]:
    """'host:5000/a/b:tag' -> ('host:5000/a/b', 'tag'); no tag -> 'latest'."""
    name, _, digest = ref.partition("@")
    if digest:
        return name, digest
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon + 1:]
    return name, "latest"


def _step_text(state: BuildProgress) -> str | None:
    return f"step {state.step}/{state.steps}: {state.instruction}" if state.step else None


def _short(e: BaseException) -> str:
    text = getattr(e, "explanation", None) or str(e)
    return " ".join(str(text).split())[:500]

