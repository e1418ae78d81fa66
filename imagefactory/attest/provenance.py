"""Provenance of an image that passed: an in-toto statement with a SLSA provenance v1 predicate.

It names who built the image and from what: imagefactory's version and the builder (classic or
BuildKit), the matrix file's sha256 and the cell id, the content hash, the base image's digest,
the lock's sha256 when the cell is locked, the git commit of the matrix's repository when it is
in one (and whether the matrix file differs from that commit), and the SBOM's sha256. Like the
SBOM it carries no time and no path of this machine: the same build gives the same bytes.

`cosign attest --type slsaprovenance1` is given the predicate alone (it makes the statement
itself, with the pushed digest as subject); the statement written beside the report names the
image by its config digest, the one name it has before a push.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

from imagefactory import __version__
from imagefactory.files import fsutil
from imagefactory.config import refs
from imagefactory.errors import ImageFactoryError

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:imagefactory:buildtype:matrix-cell:v1"
BUILDER_ID = "urn:imagefactory:builder:{builder}"
COMMIT_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")


class ProvenanceError(ImageFactoryError):
    """The provenance of an image cannot be stated (a value it needs is missing or malformed)."""


def git_commit(directory: Path, file: Path) -> dict[str, object] | None:
    """{"commit", "dirty"} of the repository holding `file`, or None when it is in none."""
    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None

    head = git("rev-parse", "HEAD")
    commit = head.stdout.strip() if head is not None and head.returncode == 0 else ""
    if not COMMIT_RE.fullmatch(commit):
        return None
    status = git("status", "--porcelain", "--", file.name)
    dirty = status is None or status.returncode != 0 or bool(status.stdout.strip())
    return {"commit": commit, "dirty": dirty}


def predicate(*, matrix_path: Path, cell: str, content_hash: str, builder: str, base_image: str,
              lock_path: Path | None, sbom_sha256: str | None, git: dict[str, object] | None) -> dict:
    """The SLSA provenance v1 predicate."""
    if not SHA256_RE.fullmatch(content_hash):
        raise ProvenanceError(f"cell {cell}: no content hash")
    parsed = refs.parse(base_image)
    if parsed is None or parsed.digest is None:
        raise ProvenanceError(f"cell {cell}: base image {base_image[:200]!r} is not pinned by digest")
    deps: list[dict] = [{"uri": f"oci://{parsed.registry}/{parsed.path}" + (f":{parsed.tag}" if parsed.tag else ""),
                         "name": "base-image", "digest": {"sha256": parsed.digest.split(":", 1)[1]}}]
    if lock_path is not None:
        deps.append({"uri": f"file:locks/{lock_path.name}", "name": "lock",
                     "digest": {"sha256": fsutil.sha256_file(lock_path)}})
    if git is not None:
        deps.append({"uri": f"git:{matrix_path.name}", "name": "matrix-repository",
                     "digest": {"gitCommit": str(git["commit"])},
                     "annotations": {"matrixDiffersFromCommit": bool(git["dirty"])}})
    by_products = [{"name": "sbom", "mediaType": "application/vnd.cyclonedx+json",
                    "digest": {"sha256": sbom_sha256}}] if sbom_sha256 else []
    return {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {"matrix": {"file": matrix_path.name, "sha256": fsutil.sha256_file(matrix_path)},
                                   "cell": cell},
            "internalParameters": {"contentHash": content_hash, "builder": builder},
            "resolvedDependencies": deps,
        },
        "runDetails": {
            "builder": {"id": BUILDER_ID.format(builder=builder),
                        "version": {"imagefactory": __version__, "builder": builder}},
            "metadata": {"invocationId": f"{cell}@{content_hash}"},
            "byproducts": by_products,
        },
    }


def statement(image: str, image_id: str, pred: dict) -> dict:
    """The in-toto statement: `pred` about the image with config digest `image_id`."""
    return {"_type": STATEMENT_TYPE, "subject": [{"name": image, "digest": {"sha256": image_id.split(":", 1)[1]}}],
            "predicateType": PREDICATE_TYPE, "predicate": pred}


def text(doc: dict) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def content_hash_of(pred: object) -> str | None:
    """The content hash a provenance predicate names (verify.py compares it with the image's)."""
    try:
        value = pred["buildDefinition"]["internalParameters"]["contentHash"]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    return value if isinstance(value, str) and SHA256_RE.fullmatch(value) else None


def path_for(report_path: Path, cell: str) -> Path:
    """build/provenance/<cell>.intoto.json, beside the report."""
    return Path(report_path).parent / "provenance" / f"{cell}.intoto.json"


def sha256_text(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()
