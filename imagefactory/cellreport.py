"""What the report says of one cell: its state and everything the run learnt about it. The
report (report.py) writes these; the catalogue (catalog.py) reads them back, so both import this
module and neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from imagefactory.checks import Check, launches

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
    builder: str = ""  # what built the image: buildkit | classic ("" when none was built this run)
    sbom: str = ""  # build/sbom/<cell>.cdx.json, written once the cell passed (supply.py)
    provenance: str = ""  # build/provenance/<cell>.intoto.json
    signing: str = ""  # signed | sign-failed | not-signed | "" (no --sign asked)
    signatures: list[dict] = field(default_factory=list)  # per pushed digest: .sig/.att tags and digests
    # how the probe ran when not natively: "qemu-aarch64 (QEMU_CPU=neoverse-n1) on linux/amd64"
    # (platforms.Emulated); "" natively or untested
    emulated: str = ""

    @property
    def launches(self) -> dict[str, str]:
        """{launch mode: "pass" | "fail"} (smoke.MODES), from the checks; {} when untested."""
        return launches(self.checks)

    @property
    def ok(self) -> bool:
        return self.status == PASSED and self.publish in ("", PUBLISHED)
