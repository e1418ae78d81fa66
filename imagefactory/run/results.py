"""What the report says of one cell: its state and everything the run learnt about it. The
report (report/summary.py) writes these; the catalogue (catalog.py) reads them back, so both import this
module and neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from imagefactory.config.model import human
from imagefactory.probe.checks import Check, launches

# Cell states, in pipeline order.
BUILT, CACHED, BUILD_FAILED, PASSED, CHECK_FAILED, NOT_BUILT, SKIPPED = (
    "built", "cached", "build-failed", "passed", "check-failed", "not-built", "skipped")
INTERRUPTED = "interrupted"  # a SIGINT/SIGTERM stopped this cell's work (or its publish)
PUBLISHED, PUBLISH_FAILED, NOT_PUBLISHED = "published", "publish-failed", "not-published"


@dataclass
class CellReport:
    cell: str
    status: str = SKIPPED
    content_hash: str = ""
    image_id: str = ""
    candidate: str = ""
    cached: bool = False
    build_seconds: float = 0.0
    log: str = ""
    error: str = ""
    failed_step: str = ""
    log_tail: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    publish: str = ""  # published | publish-failed | not-published | "" (no push asked)
    pushed: list[dict] = field(default_factory=list)  # {"ref", "digest", "layers_pushed", "layers_existing"}
    base_image: str = ""  # the base as built: name:tag@sha256:... once resolved (freshness.py)
    base_digest: str = ""
    verdicts: str = ""  # probed | cached (an earlier pass of this very image, verdicts.py) | "" (not tested)
    verdicts_at: str = ""  # when the verdicts were made (UTC)
    pulled: str = ""  # name:tag@sha256:... when the image was pulled from the registry instead of built (regcache.py)
    builder: str = ""  # what built the image: buildkit | classic (test and push: the one that built the image found)
    sbom: str = ""  # build/sbom/<cell>.cdx.json, written once the cell passed (supply.py)
    provenance: str = ""  # build/provenance/<cell>.intoto.json
    signing: str = ""  # signed | sign-failed | not-signed | "" (no --sign asked)
    signatures: list[dict] = field(default_factory=list)  # per pushed digest: .sig/.att tags and digests
    # how the probe ran when not natively: "qemu-aarch64 (QEMU_CPU=neoverse-n1) on linux/amd64"
    # (platforms.Emulated); "" natively or untested
    emulated: str = ""
    # what the image costs a pull (publish/sizes.py, publish/budget.py): "compressed", "layers",
    # "largest_layer" (bytes, from the registry's manifest), "fetch_after" {sibling cell: bytes},
    # "previous" {"digest", "fetch"}, "budget" {"limit", "measured", "how", "over", "largest"} (when pushed);
    # "local" {"size"; "compressed", "how" where measured} for every image the run built or found
    sizes: dict = field(default_factory=dict)

    @property
    def launches(self) -> dict[str, str]:
        """{launch mode: "pass" | "fail"} (smoke.MODES), from the checks; {} when untested."""
        return launches(self.checks)

    @property
    def ok(self) -> bool:
        return self.status == PASSED and self.publish in ("", PUBLISHED)


@dataclass
class ListReport:
    """What the report says of one list (model.TagList, publish/lists.py): its tag and the tags derived
    from it, its members as pushed, and whether it was published; `reason` says why not, in one line."""

    ref: str  # the list tag: registry/ns/name:2.10.0-py3.11-cpu-openblas-pip
    tags: list[str] = field(default_factory=list)  # ref, then its date / git-sha variants (each a list)
    members: list[dict] = field(default_factory=list)  # {"cell", "platform", "tag", "digest"} (per-arch, as pushed)
    publish: str = NOT_PUBLISHED  # published | publish-failed | not-published | interrupted
    reason: str = ""
    media_type: str = ""  # of the index put: OCI image index or Docker manifest list
    digest: str = ""  # the index's, once put
    pushed: list[dict] = field(default_factory=list)  # {"ref", "digest"} for each tag put and read back

    @property
    def ok(self) -> bool:
        """Not a failure of its own: a list its members kept from publishing fails through them."""
        return self.publish not in (PUBLISH_FAILED, INTERRUPTED)


def _bytes(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _share(n: int, total: int | None) -> str:
    return human(n) + (f" ({100 * n / total:.1f}%)" if total else "")


def _local_facts(local: object) -> list[tuple[str, str]]:
    """The local image's size (and its compressed size where it was measured), when recorded."""
    if not isinstance(local, dict) or _bytes(local.get("size")) is None:
        return []
    text = f"{human(local['size'])} in the engine's store"
    packed = _bytes(local.get("compressed"))
    if packed is not None:
        text += f", {human(packed)} compressed ({'exact' if local.get('how') == 'exact' else 'estimated'})"
    return [("image size", text)]


def size_facts(sizes: dict) -> list[tuple[str, str]]:
    """(label, text) of what an image costs a pull, from CellReport.sizes (report.md and the
    catalogue); anything of the wrong type (an odd report.json) is left out, never shown raw."""
    facts = _local_facts(sizes.get("local"))
    total, count, top = (_bytes(sizes.get(k)) for k in ("compressed", "layers", "largest_layer"))
    if total is not None and count is not None and top is not None:
        how = str(sizes.get("compression", ""))[:20]
        facts.append(("pull size", f"{human(total)} compressed{f' ({how})' if how else ''} in {count} layers, "
                                   f"largest {human(top)}"))
    after = sizes.get("fetch_after")
    for other, n in (after.items() if isinstance(after, dict) else ()):
        if _bytes(n) is not None:
            facts.append((f"a node holding {str(other)[:100]} fetches", _share(n, total)))
    previous = sizes.get("previous")
    if isinstance(previous, dict) and _bytes(previous.get("fetch")) is not None:
        facts.append(("a node holding the release it replaced fetches", _share(previous["fetch"], total)))
    budget = sizes.get("budget")
    if isinstance(budget, dict) and _bytes(budget.get("limit")) is not None and _bytes(budget.get("measured")) is not None:
        state = "over" if budget.get("over") is True else "within"
        facts.append(("size budget", f"{human(budget['limit'])}: {human(budget['measured'])} before the push "
                                     f"({'exact' if budget.get('how') == 'exact' else 'estimated'}), {state}"))
    return facts
