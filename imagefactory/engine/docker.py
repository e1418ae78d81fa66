"""The only module that talks to Docker (through the Docker SDK for Python).

Everything else calls these methods and sees imagefactory's own errors, never
the SDK's. The SDK's traps handled here (see docs): builds and pushes report
failures inside the stream rather than raising; exec/run has no timeout.

`ContainerEngine` (engine/api.py, which imports no SDK) is the interface every command
takes; `Engine` implements it with the Docker SDK, tests/fake_engine.py in memory. The
names re-exported from engine_api stay importable from here. Every SDK error becomes an
imagefactory error: EngineGone when the engine stopped answering, Cancelled when the run was
interrupted, else the operation's own error.
"""

from __future__ import annotations

import os
import re
import socket
import tarfile
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Protocol

import docker
import docker.errors
import requests.exceptions
import urllib3.exceptions

from imagefactory.engine import identity
from imagefactory.engine.registry import HttpRegistry
from imagefactory.config import platforms
from imagefactory.config import refs
from imagefactory.engine.api import (Builder, BuildProgress, BuildRequest, ContainerEngine, EngineFactory, EngineInfo,
                                     LocalImage, PushOutcome, RegistryClient, RunResult, is_transient, refuse_foreign)
from imagefactory.engine.api import DOCKER, PODMAN
from imagefactory.errors import (BuildError, Cancelled, DockerUnavailable, EngineError, EngineGone, ImageFactoryError,
                                 PushError)
from imagefactory.interrupt import Interrupt

if TYPE_CHECKING:
    from imagefactory.engine.layer_sizes import Measured

STEP_RE = re.compile(r"^Step (\d+)/(\d+) : (.*)$")
# The classic builder runs each RUN step in a container and names it in the stream.
RUNNING_IN_RE = re.compile(r"^ ---> Running in ([0-9a-f]{12,64})$")
# A push's last status line, "TAG: digest: sha256:... size: N": the graph-driver store also sends the
# digest as an aux event, the containerd image store only this line.
PUSHED_RE = re.compile(r"(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}): digest: (?P<digest>sha256:[0-9a-f]{64}) size: [0-9]{1,12}")
TAIL_LINES = 30

__all__ = ["BuildProgress", "BuildRequest", "ContainerEngine", "Engine", "EngineFactory", "EngineInfo", "PushOutcome", "RunResult",
           "is_transient", "split_tag"]

START_HINT = (
    "start one (`sudo systemctl start docker`, or as root: "
    "`setsid dockerd >/tmp/dockerd.log 2>&1 &`), or point DOCKER_HOST at a running engine"
)


_SDK_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException, urllib3.exceptions.HTTPError,
               OSError)

_LINK_ERRORS = (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError)


def _connect(timeout: int, shared: dict[str, Any]) -> docker.DockerClient:
    """A client of the engine that has answered: with the API version this run's engines agreed
    on (`shared`, then a ping), else with one negotiated now (GET /version; kept in `shared` for
    the run's other engines). SDK errors are the caller's."""
    if "api_version" in shared:
        client = docker.from_env(timeout=timeout, version=shared["api_version"])
        client.ping()
        return client
    client = docker.from_env(timeout=timeout)  # negotiated: the engine has answered
    shared["api_version"] = str(client.api.api_version)
    return client


def _ask_info(timeout: int, version: str) -> Future[dict[str, Any]]:
    """`docker info`, asked on a thread of its own with a client of its own (a client is one
    thread's): the engine answers it (~10 ms) while the run resolves its base images."""
    answer: Future[dict[str, Any]] = Future()

    def ask() -> None:
        try:
            client = docker.from_env(timeout=timeout, version=version)
            try:
                answer.set_result(client.info())
            finally:
                client.close()
        except BaseException as e:  # noqa: BLE001 - the future carries it to _info, which asks again
            answer.set_exception(e)

    threading.Thread(target=ask, name="docker-info", daemon=True).start()
    return answer


class _Stream:
    """The HTTP response of a build or push stream, and the build container now running:
    what a cancellation must stop."""

    def __init__(self) -> None:
        self.response: Any = None
        self.container: str | None = None



def _size(value: object) -> int | None:
    """A byte count from an engine's answer; None for anything else."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class Engine:
    """A connected Docker engine (implements ContainerEngine); builds with the builder it is given
    (ClassicBuilder by default, buildkit.BuildxBuilder for BuildKit)."""

    def __init__(self, client: docker.DockerClient | None = None, *, timeout: int = 600,
                 interrupt: Interrupt | None = None, shared: dict[str, Any] | None = None,
                 registry: RegistryClient | None = None, builder: ImageBuilder | None = None):
        """`shared`: what the engines of one run (select.docker_factory, one per worker) learn
        once: the API version the first agreed with the engine (_connect), and `docker info`
        (its runtimes and architecture do not change within a run), asked in the background
        from the first engine on (_info). `registry`: the registry HTTP API client that goes with
        this engine (default: engine.registry.HttpRegistry with this engine's Docker config logins).
        `builder`: what `build` builds with (default ClassicBuilder); it may refuse this engine
        (ConfigError) once it has answered."""
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        self._shared = shared if shared is not None else {}
        try:
            if client is None:  # ours: its API version and `docker info` are the run's
                self.client = _connect(timeout, self._shared)
                if "info" not in self._shared:
                    self._shared["info"] = _ask_info(timeout, self._shared["api_version"])
            else:  # the caller's (the tests' fakes)
                self.client = client
                self.client.ping()
        except _SDK_ERRORS as e:
            raise DockerUnavailable(f"no Docker engine answered at {where} ({_short(e)}); {START_HINT}") from None
        self.api = self.client.api
        self.interrupt = interrupt or Interrupt()
        self.registry: RegistryClient = registry or HttpRegistry(self.interrupt, self.login)
        self._builder: ImageBuilder = builder or ClassicBuilder()
        self.builder: Builder = self._builder.kind
        self._stream: _Stream | None = None
        self._native: tuple[platforms.Platform | None] | None = None  # (the engine's platform,) once asked
        hooks = getattr(self.api, "hooks", None)
        if isinstance(hooks, dict):
            hooks.setdefault("response", []).append(self._on_response)
        self._builder.attach(self)

    def _on_response(self, response: Any, *args: Any, **kwargs: Any) -> None:
        if self._stream is not None:
            self._stream.response = response

    @contextmanager
    def _streaming(self) -> Iterator[_Stream]:
        """Capture the response of the streamed request made in the block, so that a
        cancellation (from another thread) can shut its socket and kill its build container."""
        stream = _Stream()

        def stop() -> None:
            _shutdown(stream.response)
            if stream.container:
                self._kill(stream.container)

        self._stream = stream
        try:
            with self.interrupt.on_cancel(stop):
                yield stream
        finally:
            self._stream = None
            if stream.response is not None:
                stream.response.close()
            if stream.container and self.interrupt.is_set():  # started after the stop action ran
                self._kill(stream.container)

    def _kill(self, container: str) -> None:
        try:
            self.api.remove_container(container, force=True)
        except _SDK_ERRORS:
            pass

    def _failed(self, what: str, e: BaseException) -> NoReturn:
        """Turn an SDK error into ours: Cancelled if the run was interrupted, EngineGone if the
        engine no longer answers, else EngineError."""
        if self.interrupt.is_set():
            raise Cancelled("interrupted") from None
        if isinstance(e, _LINK_ERRORS) and not self.alive():
            raise EngineGone(f"{what}: the Docker engine stopped answering ({_short(e)})") from None
        raise EngineError(f"{what}: {_short(e)}") from None

    def alive(self) -> bool:
        try:
            return bool(self.client.ping())
        except _SDK_ERRORS:
            return False

    # -- images -----------------------------------------------------------------------------
    def images_with_label(self, key: str, value: str) -> dict[str, list[str]]:
        """Local images carrying label key=value: {image id: its tags}."""
        try:
            images = self.client.images.list(filters={"label": f"{key}={value}"})
            return {image.id: list(image.tags) for image in images}
        except _SDK_ERRORS as e:
            self._failed("could not list the local images", e)

    def labelled_image(self, ref: str, key: str, value: str) -> str | None:
        try:
            image = self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            return None
        except _SDK_ERRORS as e:
            self._failed(f"could not inspect {ref}", e)
        labels = (image.attrs.get("Config") or {}).get("Labels") or {}
        return str(image.id) if labels.get(key) == value else None

    def image_id(self, ref: str) -> str | None:
        try:
            return self.client.images.get(ref).id
        except docker.errors.ImageNotFound:
            return None
        except _SDK_ERRORS as e:
            self._failed(f"could not inspect {ref}", e)

    def _inspected(self, ref: str) -> dict | None:
        """The local image's inspect answer; None when there is none."""
        try:
            return self.client.images.get(ref).attrs
        except docker.errors.ImageNotFound:
            return None
        except _SDK_ERRORS as e:
            self._failed(f"could not inspect {ref}", e)

    def image_platform(self, ref: str) -> str | None:
        """os/architecture of the local image's config ("linux/amd64"); None when there is none."""
        attrs = self._inspected(ref)
        if attrs is None:
            return None
        return f"{attrs.get('Os') or '?'}/{attrs.get('Architecture') or '?'}"

    def local_image(self, ref: str) -> LocalImage | None:
        """The local image's size as `docker images` lists it and its rootfs diff ids; None if there is none."""
        attrs = self._inspected(ref)
        if attrs is None:
            return None
        size = self._listed_size(str(attrs.get("Id", "")))
        if size is None:
            size = _size(attrs.get("Size"))
        diff_ids = tuple(str(d) for d in (attrs.get("RootFS") or {}).get("Layers") or [])
        return LocalImage(size or 0, diff_ids)

    def _listed_size(self, image_id: str) -> int | None:
        """The image's size in the image list (its layers as stored, what `docker images` shows).
        Inspect's Size is not that on the containerd store: there it is the compressed content's
        (368 MB for a 1.66 GB CPU torch image)."""
        try:
            listed = self.client.api.images(all=True)
        except _SDK_ERRORS:
            return None
        return next((_size(entry.get("Size")) for entry in listed if entry.get("Id") == image_id), None)

    def layer_sizes(self, ref: str) -> Measured:
        """The compressed layers a push of `ref` sends (engine/layer_sizes.py): exact on the containerd
        store (its blobs), gzip estimates on the graph-driver store (kept by diff id)."""
        from imagefactory.engine import layer_sizes  # only a push measures: a build loads no layer reader

        try:
            attrs = self.client.images.get(ref).attrs
            diff_ids = [str(d) for d in (attrs.get("RootFS") or {}).get("Layers") or []]
            estimates = identity.store(self._info()) != identity.CONTAINERD
            with self._streaming():
                return layer_sizes.measured(diff_ids, lambda: self.api.get_image(ref), estimates=estimates)
        except docker.errors.ImageNotFound:
            raise EngineError(f"cannot measure {ref}: no such image") from None
        except (ValueError, tarfile.TarError) as e:
            raise EngineError(f"cannot measure {ref}: its save stream is not one image ({str(e)[:120]})") from None
        except _SDK_ERRORS as e:
            self._failed(f"could not measure the layers of {ref}", e)

    def _info(self) -> dict[str, Any]:
        """`docker info`, asked once for all the engines that share it: the answer to the
        background question the first engine asked (_ask_info); if that failed, asked again
        here, so that its error is this call's."""
        asked = self._shared.get("info")
        if isinstance(asked, Future):
            try:
                self._shared["info"] = asked.result()
            except Exception:  # noqa: BLE001 - asked again below, where its error is handled
                self._shared.pop("info", None)
        if "info" not in self._shared:
            self._shared["info"] = self.client.info()
        return dict(self._shared["info"])

    def product(self) -> str:
        """PODMAN when the version answer names a "Podman Engine" component (podman system
        service), else DOCKER; asked once for all the engines of a run."""
        if "product" not in self._shared:
            try:
                components = self.client.version().get("Components") or []
            except _SDK_ERRORS as e:
                self._failed("could not ask the engine its version", e)
            names = {str(c.get("Name")) for c in components if isinstance(c, dict)}
            self._shared["product"] = PODMAN if "Podman Engine" in names else DOCKER
        return str(self._shared["product"])

    def native_platform(self) -> platforms.Platform | None:
        """The platform of the engine's own host (docker info Architecture); None if not in the table."""
        if self._native is None:
            try:
                self._native = (platforms.native(str(self._info().get("Architecture") or "?")),)
            except _SDK_ERRORS as e:
                self._failed("could not ask the engine its architecture", e)
        return self._native[0]

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
        except _SDK_ERRORS as e:
            self._failed(f"could not tag {image} as {ref}", e)
        if not ok:
            raise EngineError(f"could not tag {image} as {ref}")

    def untag(self, ref: str) -> None:
        """Remove the name `ref` (never the image another name still holds)."""
        try:
            self.api.remove_image(ref, noprune=True)
        except docker.errors.ImageNotFound:
            pass
        except _SDK_ERRORS as e:
            self._failed(f"could not remove the tag {ref}", e)

    def remove_image(self, ref: str) -> None:
        """Remove the image `ref` names (forced, layers pruned); nothing if there is none."""
        try:
            self.client.images.remove(ref, force=True)
        except docker.errors.ImageNotFound:
            pass
        except _SDK_ERRORS as e:
            self._failed(f"could not remove the image {ref}", e)

    # -- build ------------------------------------------------------------------------------
    def build(self, request: BuildRequest, *, log: Callable[[str], None] = lambda line: None,
              progress: Callable[[BuildProgress], None] = lambda p: None) -> str:
        """Build `request` with the builder this engine was given (ClassicBuilder: through the SDK;
        buildkit.BuildxBuilder: `docker buildx build`); the image id."""
        return self._builder.build(self, request, log=log, progress=progress)

    def describe(self) -> EngineInfo:
        """Version and GPU plumbing of the engine (for `imagefactory doctor`)."""
        try:
            version, info = self.client.version(), self.client.info()
        except (docker.errors.APIError, requests.exceptions.RequestException) as e:
            raise EngineError(f"the Docker engine did not describe itself: {_short(e)}") from None
        return EngineInfo(version=str(version.get("Version", "")), api_version=str(version.get("ApiVersion", "")),
                          runtimes=tuple(sorted(info.get("Runtimes") or {})),
                          cdi_spec_dirs=tuple(info.get("CDISpecDirs") or ()),
                          cpus=int(info.get("NCPU") or 0), architecture=str(info.get("Architecture") or ""),
                          store=identity.store(info), driver=str(info.get("Driver") or ""))

    # -- run --------------------------------------------------------------------------------
    def gpus_available(self) -> bool:
        """Whether this engine can give containers GPUs (the NVIDIA runtime is registered)."""
        try:
            info = self._info()
        except _SDK_ERRORS as e:
            self._failed("could not ask the engine about its runtimes", e)
        return "nvidia" in (info.get("Runtimes") or {}) or bool(info.get("CDISpecDirs") and
                                                              os.path.exists("/dev/nvidia0"))

    def run(self, image: str, command: list[str], *, timeout: float, gpus: bool = False,
            environment: dict[str, str] | None = None, cpus: float | None = None,
            options: dict[str, Any] | None = None, platform: platforms.Platform | None = None) -> RunResult:
        """Run `command` in a fresh container of `image` as the image's default user, with no
        network; kill it after `timeout` seconds (or when the run is interrupted). The
        container is always removed. `cpus` is `docker run --cpus` (a CFS quota); `options`
        are more container-create options (a launch mode's: entrypoint, user, read_only,
        tmpfs, cpuset_cpus, shm_size, ipc_mode; see smoke.LaunchMode). `platform`: the create
        request's platform (an emulated run's; none is sent without it)."""
        device_requests = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])] if gpus else None
        extra: dict[str, Any] = {"nano_cpus": int(cpus * 1e9)} if cpus else {}  # docker run --cpus
        if platform is not None:
            extra["platform"] = platform.oci
        self.interrupt.check()
        try:
            container = self.client.containers.create(
                image, command=command, network_mode="none", detach=True,
                device_requests=device_requests, environment=environment or {}, **extra, **(options or {}),
            )
        except _SDK_ERRORS as e:
            self._failed(f"could not create a container of {image}", e)
        try:
            with self.interrupt.on_cancel(lambda: self._kill(container.id)):
                container.start()
                try:
                    status = container.wait(timeout=timeout)
                    code: int | None = int(status.get("StatusCode", -1))
                except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                    self.interrupt.check()
                    container.kill()
                    code = None
                self.interrupt.check()
                out = container.logs(stdout=True, stderr=False).decode(errors="replace")
                err = container.logs(stdout=False, stderr=True).decode(errors="replace")
            return RunResult(code, out, err)
        except _SDK_ERRORS as e:
            self._failed(f"could not run a container of {image}", e)
        finally:
            self._kill(container.id)

    # -- push -------------------------------------------------------------------------------
    def push(self, ref: str, *, auth_config: dict[str, str] | None = None,
             progress: Callable[[dict], None] = lambda e: None, compression: str = "gzip") -> PushOutcome:
        """Push one tag. The SDK does not raise on failure: errors arrive as stream events.
        An interrupt closes the stream (the engine then abandons the upload). Another `compression`
        than gzip (zstd, estargz) goes through buildx (buildkit.push_recompressed): the containerd store only."""
        if compression != "gzip":
            return self._push_recompressed(ref, compression, auth_config)
        repo, tag = split_tag(ref)
        digest = None
        layers_pushed: set[str] = set()
        layers_existing: set[str] = set()
        self.interrupt.check()
        try:
            with self._streaming():
                for event in self.api.push(repo, tag=tag, stream=True, decode=True, auth_config=auth_config):
                    self.interrupt.check()
                    progress(event)
                    if "error" in event:
                        message = event["error"].strip()
                        raise PushError(f"push of {ref} failed: {message}", transient=is_transient(message))
                    status = event.get("status", "")
                    if status == "Pushed" and event.get("id"):
                        layers_pushed.add(event["id"])
                    elif status.startswith(("Layer already exists", "Mounted from")):
                        layers_existing.add(event.get("id", ""))
                    aux = event.get("aux") or {}
                    if "Digest" in aux:
                        digest = aux["Digest"]
                    elif digest is None:  # the containerd image store says it only in its last status line
                        said = PUSHED_RE.fullmatch(status.strip())
                        if said is not None and said["tag"] == tag:
                            digest = said["digest"]
        except Cancelled:
            raise
        except PushError:
            self.interrupt.check()
            raise
        except docker.errors.APIError as e:
            if self.interrupt.is_set():
                raise Cancelled("interrupted") from None
            raise PushError(f"push of {ref} failed: {_short(e)}", transient=is_transient(str(e))) from None
        except _SDK_ERRORS as e:
            if self.interrupt.is_set():
                raise Cancelled("interrupted") from None
            if not self.alive():
                raise EngineGone(f"push of {ref} failed: the Docker engine stopped answering ({_short(e)})") from None
            raise PushError(f"push of {ref} failed: lost the Docker engine: {_short(e)}", transient=True) from None
        self.interrupt.check()
        if digest is None:
            raise PushError(f"push of {ref} ended without a digest", transient=True)
        return PushOutcome(ref, digest, sorted(layers_pushed), sorted(layers_existing - {""}))

    def _push_recompressed(self, ref: str, compression: str, auth_config: dict[str, str] | None) -> PushOutcome:
        """Through the builder (BuildxBuilder.push_recompressed): the classic builder has no way to."""
        recompress = getattr(self._builder, "push_recompressed", None)
        if recompress is None:
            raise PushError(f"push of {ref}: {compression} layers are written by BuildKit; the classic builder "
                            f"cannot (use --builder buildkit)", transient=False)
        if identity.store(self._info()) != identity.CONTAINERD:
            raise PushError(f"push of {ref}: {compression} layers need an engine on the containerd image store "
                            f"(this one keeps uncompressed layers: Docker 20.10's graph driver)", transient=False)
        return PushOutcome(ref, recompress(self, ref, compression, auth_config), [], [])

    def pull(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str:
        """Pull `ref` (name:tag@sha256:...); the local image id. Like a push, a pull reports its
        failure inside the stream: EngineError then. An interrupt closes the stream."""
        name, _, digest = ref.partition("@")
        repo, tag = split_tag(name)  # by digest when there is one (the tag is then only a name)
        tag = digest or tag
        self.interrupt.check()
        try:
            with self._streaming():
                for event in self.api.pull(repo, tag=tag, stream=True, decode=True, auth_config=auth_config):
                    self.interrupt.check()
                    if "error" in event:
                        raise EngineError(f"pull of {ref} failed: {str(event['error']).strip()}")
        except (Cancelled, EngineError):
            self.interrupt.check()
            raise
        except _SDK_ERRORS as e:
            self._failed(f"pull of {ref} failed", e)
        self.interrupt.check()
        image_id = self.image_id(ref)
        if image_id is None:
            raise EngineError(f"pull of {ref} ended without an image")
        return image_id

    def registry_digest(self, ref: str, *, auth_config: dict[str, str] | None = None) -> str | None:
        """The manifest digest the registry serves for `ref`: asked through the engine (GET
        /distribution, which uses the engine's own logins and mirrors); on podman, whose Docker
        API has no /distribution (404), of the registry's HTTP API (`self.registry`). None
        when the registry serves nothing under `ref` or will not say."""
        try:
            data = self.api.inspect_distribution(ref, auth_config=auth_config)
        except _SDK_ERRORS:
            self.interrupt.check()
            if self.product() != PODMAN:
                return None
        else:
            digest = (data.get("Descriptor") or {}).get("digest")
            return digest if isinstance(digest, str) and identity.DIGEST_RE.fullmatch(digest) else None
        try:
            manifest = self.registry.manifest(ref, auth_config=auth_config)
        except Cancelled:
            raise
        except ImageFactoryError:
            return None
        return manifest.digest if manifest is not None else None

    def login(self, ref: str) -> dict[str, str] | None:
        """What a registry call of `ref` without auth_config is given (the registry client's `login`):
        the Docker config's login for its registry (`auths` or a credential helper); None without
        one (identity tokens are not used)."""
        try:
            found = self.api._auth_configs.resolve_authconfig(refs.registry(ref)) or {}
        except _SDK_ERRORS:
            return None
        user, password = found.get("username") or found.get("Username"), found.get("password") or found.get("Password")
        return {"username": str(user), "password": str(password)} if user and password else None


class ImageBuilder(Protocol):
    """What an Engine builds with (it is given one): the classic builder through the SDK
    (ClassicBuilder) or BuildKit through `docker buildx build` (buildkit.BuildxBuilder)."""

    kind: Builder  # Builder.classic or Builder.buildkit: the engine's `builder`

    def attach(self, engine: Engine) -> None:
        """Called once the engine answered: ConfigError when this builder cannot build through it."""
        ...

    def build(self, engine: Engine, request: BuildRequest, *, log: Callable[[str], None],
              progress: Callable[[BuildProgress], None]) -> str:
        ...


class ClassicBuilder:
    """The classic builder: POST /build through the Docker SDK (the engine's client)."""

    kind = Builder.classic

    def attach(self, engine: Engine) -> None:
        pass

    def build(self, engine: Engine, request: BuildRequest, *, log: Callable[[str], None] = lambda line: None,
              progress: Callable[[BuildProgress], None] = lambda p: None) -> str:
        """Build `request.context` and tag it; returns the image id. Raises BuildError with the
        failing step and the log tail when the stream reports an error. The classic builder has
        no build secrets: it refuses them rather than build without. It is given no platform: it
        builds for the engine's own (with a local base tag of another arch it ignores one)."""
        if request.secrets:
            raise BuildError("the classic builder has no build secrets; build with --builder buildkit")
        refuse_foreign(request, engine.native_platform())
        builder = _BuildStream(log, progress)
        tag = request.tag
        engine.interrupt.check()
        try:
            with engine._streaming() as stream:
                events = engine.api.build(path=request.context, tag=tag, rm=True, forcerm=True, decode=True,
                                          network_mode=request.network, pull=request.pull,
                                          cache_from=list(request.cache_from) or None, nocache=request.nocache)
                for event in events:
                    builder.feed(event, stream)  # first: it notes a new build container
                    engine.interrupt.check()
        except Cancelled:
            raise
        except BuildError:  # a RUN step killed by our own interrupt fails too: that is not the cell's fault
            engine.interrupt.check()
            raise
        except _SDK_ERRORS as e:
            if engine.interrupt.is_set():
                raise Cancelled("interrupted") from None
            gone = isinstance(e, _LINK_ERRORS) and not engine.alive()
            message = f"lost the Docker engine: {_short(e)}" if gone else _short(e)
            builder.emit(f"ERROR: {message}")
            if gone:
                raise EngineGone(f"build of {tag}: {message}") from None
            raise builder.error(message) from None
        engine.interrupt.check()
        image_id = builder.image_id or engine.image_id(tag)
        if image_id is None:
            raise builder.error("the build ended without producing an image")
        return image_id


class _BuildStream:
    """The state of one build stream: log tail, current step, image id, build container."""

    def __init__(self, log: Callable[[str], None], progress: Callable[[BuildProgress], None]):
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.state = BuildProgress()
        self.image_id: str | None = None
        self.log, self.progress = log, progress

    def emit(self, line: str) -> None:
        self.tail.append(line)
        self.log(line)

    def error(self, message: str) -> BuildError:
        return BuildError(message, step=_step_text(self.state), log_tail=list(self.tail))

    def feed(self, event: dict, stream: _Stream) -> None:
        if "stream" in event:
            for line in str(event["stream"]).splitlines():
                if not line.strip():
                    continue
                self.emit(line)
                m = STEP_RE.match(line)
                if m:
                    self.state = BuildProgress(int(m[1]), int(m[2]), m[3])
                    self.progress(self.state)
                    stream.container = None
                running = RUNNING_IN_RE.fullmatch(line)
                if running:
                    stream.container = running[1]
        if "status" in event:
            self.emit(" ".join(str(event[k]) for k in ("id", "status", "progress") if event.get(k)))
        if "aux" in event and "ID" in (event["aux"] or {}):
            self.image_id = event["aux"]["ID"]
        if "error" in event:
            message = str(event["error"]).strip()
            self.emit(f"ERROR: {message}")
            raise self.error(message)


def _shutdown(response: Any) -> None:
    """Shut the socket under a streamed HTTP response, from any thread: the reader blocked
    on it wakes up at once (closing it would not wake it)."""
    if response is None:
        return
    try:
        raw = response.raw._fp.fp.raw
        sock = getattr(raw, "_sock", raw)
        sock.shutdown(socket.SHUT_RDWR)
    except (AttributeError, OSError):
        try:
            response.close()
        except Exception:  # noqa: BLE001 - best effort from another thread
            pass


def split_tag(ref: str) -> tuple[str, str]:
    """'host:5000/a/b:tag' -> ('host:5000/a/b', 'tag'); no tag -> 'latest' (imagefactory.config.refs)."""
    return refs.split_tag(ref)


def _step_text(state: BuildProgress) -> str | None:
    return f"step {state.step}/{state.steps}: {state.instruction}" if state.step else None


def _short(e: BaseException) -> str:
    text = getattr(e, "explanation", None) or str(e)
    return " ".join(str(text).split())[:500]

