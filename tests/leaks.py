"""Nothing left behind, checked (issue 45, item 5): what the engines, the registries and /tmp held
before the integration session's first test, compared with what they hold once every fixture is
torn down. Anything the run made and left (an image, tagged or not, a container, a volume, a
network, a BuildKit record, a tag in a registry, a file or folder under /tmp) fails the run
(tests/conftest.py's pytest_sessionfinish), named.

Left out, each for a reason:
- /tmp/pytest-of-<user>: pytest's own base temporary folder, which keeps the last three runs by
  design (`tmp_path_retention_count`);
- the test services' images (label SERVICE_LABEL): built once per machine and kept, like the base
  images, so that a warm run pays nothing for them (tests/services/);
- the compose project's volumes and network exist only while its services run (`down -v`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SERVICE_LABEL = "io.imagefactory-test.service"
TMP = Path(os.environ.get("IMAGEFACTORY_TEST_LEAK_TMP", "/tmp"))
KEPT_TMP = (f"pytest-of-{os.environ.get('USER', 'root')}",)


@dataclass
class Snapshot:
    """What one place holds, by kind: {"images": {...ids}, ...}. A place that does not answer is
    left out of both snapshots (a module that needs it fails on its own)."""

    held: dict[str, set[str]] = field(default_factory=dict)

    def new_since(self, before: "Snapshot") -> dict[str, list[str]]:
        return {kind: sorted(ids - before.held.get(kind, set()))
                for kind, ids in self.held.items() if kind in before.held and ids - before.held[kind]}


def _engine(host: str | None) -> dict[str, set[str]]:
    import docker

    client = docker.DockerClient(base_url=host, timeout=120) if host else docker.from_env(timeout=120)
    try:
        client.ping()
        images = {i.id for i in client.images.list(all=True)
                  if SERVICE_LABEL not in ((i.attrs.get("Config") or {}).get("Labels") or {})}
        held = {
            "images": images,
            "containers": {f"{c.id[:12]} {c.name}" for c in client.containers.list(all=True)},
            "volumes": {v.name for v in client.volumes.list()},
            "networks": {f"{n.id[:12]} {n.name}" for n in client.networks.list()},
        }
        try:
            held["build records"] = {r["ID"] for r in client.df().get("BuildCache") or []}
        except docker.errors.APIError:  # podman's API has no build cache
            pass
        return held
    finally:
        client.close()


def _registry(address: str, auth: tuple[str, str] | None) -> dict[str, set[str]]:
    import requests

    tags: set[str] = set()
    url: str | None = f"http://{address}/v2/_catalog?n=1000"
    while url:
        r = requests.get(url, auth=auth, timeout=30)
        r.raise_for_status()
        for repo in r.json().get("repositories") or []:
            listed = requests.get(f"http://{address}/v2/{repo}/tags/list", auth=auth, timeout=30)
            if listed.status_code == 200:
                tags |= {f"{repo}:{t}" for t in listed.json().get("tags") or []}
        following = r.links.get("next", {}).get("url")
        url = f"http://{address}{following}" if following else None
    return {"tags": tags}


def _tmp() -> dict[str, set[str]]:
    return {"entries": {p.name for p in TMP.iterdir() if p.name not in KEPT_TMP}}


def places(engines: dict[str, str | None], registries: dict[str, tuple[str, tuple[str, str] | None]]
           ) -> dict[str, Callable[[], dict[str, set[str]]]]:
    """Each place by its name in the message, and how to read it."""
    out: dict[str, Callable[[], dict[str, set[str]]]] = {}
    for name, host in engines.items():
        out[name] = lambda host=host: _engine(host)
    for name, (address, auth) in registries.items():
        out[name] = lambda address=address, auth=auth: _registry(address, auth)
    out[str(TMP)] = _tmp
    return out


def snapshot(readers: dict[str, Callable[[], dict[str, set[str]]]]) -> dict[str, Snapshot]:
    taken = {}
    for name, read in readers.items():
        try:
            taken[name] = Snapshot(read())
        except Exception:  # not running here: nothing to compare  # noqa: BLE001
            continue
    return taken


def leaks(before: dict[str, Snapshot], after: dict[str, Snapshot]) -> list[str]:
    """One line per place and kind that holds something it did not hold before."""
    lines = []
    for name, then in before.items():
        now = after.get(name)
        if now is None:
            continue
        for kind, new in now.new_since(then).items():
            shown = ", ".join(new[:8]) + (f", ... ({len(new)} in all)" if len(new) > 8 else "")
            lines.append(f"{name}: {len(new)} new {kind} left behind: {shown}")
    return lines


class Check:
    """The session's two snapshots: /tmp from the start, the engines and registries from the
    collection of a session that holds integration tests (the unit tier reaches no engine)."""

    readers: dict[str, Callable[[], dict[str, set[str]]]] = {}
    before: dict[str, Snapshot] = {}

    @classmethod
    def start(cls, engines: bool) -> None:
        cls.readers = {str(TMP): _tmp}
        if engines:
            from tests.integration import helpers  # (not before: its import makes a Docker config in /tmp)

            cls.readers = places({"the default engine": None, "the legacy engine": helpers.LEGACY_HOST,
                                  "podman": helpers.PODMAN_HOST},
                                 {f"registry {helpers.BASE_REGISTRY}": (helpers.BASE_REGISTRY, None),
                                  f"registry {helpers.TEST_REGISTRY}": (helpers.TEST_REGISTRY,
                                                                        (helpers.TEST_USER, helpers.TEST_PASSWORD))})
        cls.before = snapshot(cls.readers)

    @classmethod
    def finish(cls) -> list[str]:
        if not cls.before:
            return []
        return leaks(cls.before, snapshot(cls.readers))
