"""Step 9 (publish/): merge the per-arch tags of each list (model.TagList) into one image index, as
jupyter/docker-stacks' merge_tags does, after every per-arch push of the run.

The rule: a list is published only when every platform of it passed. Each member cell must have
passed, and its per-arch tag must have been pushed and verified in this run; otherwise the list
is not published (one line naming the member and why) and the other members keep their per-arch
tags (`--atomic` publishes nothing when any cell failed).

Merging: each member's manifest is read from the registry by its per-arch tag and must be the
digest that was pushed (and probed) for that cell; the index references it by that digest and
the size the registry serves, with the cell's platform (os/architecture). All members Docker
schema 2 manifests: a Docker manifest list; otherwise an OCI image index. The index is PUT by
its own digest first (the registry then holds it under no tag), then under the list tag and the
tags derived from it (date, git-sha: lists too, with the same members), each read back: the
registry must serve exactly the index put, its manifests exactly the members, each platform
resolving to its cell's digest. A list is claimed published only once every tag of it was read
back; an interrupt or a failure leaves it interrupted or publish-failed, `pushed` saying which
of its tags the registry took.

Two callers share this one merge: publish/push.py, after the per-arch pushes of its own run, and
merge.py, after the per-arch pushes of other jobs (one CI job per cell, on a runner of its
platform), from the reports they wrote. Each hands `publish_lists` its own refusal.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

from imagefactory.config import refs
from imagefactory.engine.registry import shown
from imagefactory.config import tags
from imagefactory.run.results import (INTERRUPTED, NOT_PUBLISHED, PASSED, PUBLISH_FAILED, PUBLISHED, CellReport,
                                     ListReport)
from imagefactory.run.context import Publishing, RunContext
from imagefactory.engine.api import DOCKER_LIST, DOCKER_MANIFEST, MANIFEST_TYPES, OCI_INDEX, ContainerEngine, Manifest, RegistryClient
from imagefactory.errors import Cancelled, EngineError, PushError, RegistryError
from imagefactory.interrupt import Interrupt
from imagefactory.config.model import Matrix, TagList

AuthFor = Callable[[str], "dict[str, str] | None"]


def list_tags(matrix: Matrix, taglist: TagList, options: Publishing) -> list[str]:
    """The list tag, then its date / git-sha variants (lists too, as each cell's own are per-arch tags)."""
    extras = tags.extra_tags(taglist.ref, matrix.extra_tags, today=options.today, git_sha=options.git_sha)
    return list(dict.fromkeys([taglist.ref, *extras]))


def _pushed_digest(r: CellReport | None, tag: str) -> str:
    return next((p["digest"] for p in (r.pushed if r else []) if p.get("ref") == tag), "")


def start(matrix: Matrix, reports: list[CellReport], options: Publishing) -> list[ListReport]:
    """One report per list of the matrix, its members as this run pushed them (nothing decided yet)."""
    by_cell = {r.cell: r for r in reports}
    return [ListReport(t.ref, list_tags(matrix, t, options),
                       [{"cell": cell, "platform": platform, "tag": tag,
                         "digest": _pushed_digest(by_cell.get(cell), tag)} for cell, platform, tag in t.members])
            for t in matrix.lists]


def member_blocked(m: dict, r: CellReport | None, absent: str = "was not part of this run") -> str:
    """Why one member keeps its list back ("" when it does not): its cell did not pass, or its
    per-arch tag was not pushed; `absent` says what a missing report means to the caller."""
    name = f"{m['cell']} ({m['platform']})"
    if r is None:
        return f"{name} {absent}"
    if r.status != PASSED:
        return f"{name} did not pass ({r.status})"
    if r.publish != PUBLISHED or not m["digest"]:
        return f"{name}: its per-arch tag {m['tag']} was not published ({r.publish or 'not pushed'})"
    return ""


def blocked(lr: ListReport, by_cell: dict[str, CellReport]) -> str:
    """Why the list may not be published ("" when it may): each member that did not pass, was not
    pushed, or was not part of this run."""
    why = [w for w in (member_blocked(m, by_cell.get(m["cell"])) for m in lr.members) if w]
    return ("not published: every platform must pass; " + "; ".join(why)) if why else ""


def refuse_all(lists: list[ListReport], reason: str) -> None:
    for lr in lists:
        lr.publish, lr.reason = NOT_PUBLISHED, reason


def publish_lists(lists: list[ListReport], run: RunContext, auth_for: AuthFor, redact: Callable[[str], str],
                  refusal: Callable[[ListReport], str]) -> None:
    """Merge, put and verify every list that `refusal` lets through ("" for it: its members all passed
    and were pushed); update each in place. The one merge of both paths: after this run's per-arch
    pushes (publish/push.py: refusal is `blocked`) and after other jobs' (merge.py: from their reports)."""
    engine: ContainerEngine | None = None
    for lr in lists:
        why = "not published: the run was interrupted" if run.interrupt.is_set() else refusal(lr)
        if why:
            lr.publish, lr.reason = NOT_PUBLISHED, why
            run.ui.status(lr.ref, why)
            continue
        try:
            engine = engine or run.engines()()
            _merge(engine.registry, lr, auth_for, run.settings(Publishing), run.interrupt)
        except Cancelled:
            lr.publish = INTERRUPTED
            lr.reason = (f"interrupted after {len(lr.pushed)} of {len(lr.tags)} tag(s) of the list: not claimed "
                         f"published" + (f" (the registry took {', '.join(p['ref'] for p in lr.pushed)})"
                                         if lr.pushed else ""))
            continue
        except (PushError, EngineError) as e:
            lr.publish, lr.reason = PUBLISH_FAILED, redact(e.message)
            run.ui.status(lr.ref, f"list not published: {lr.reason}")
            continue
        lr.publish = PUBLISHED
        run.ui.status(lr.ref, f"published list {lr.digest} ({', '.join(m['platform'] for m in lr.members)})")


def _member(registry: RegistryClient, m: dict, auth: dict[str, str] | None) -> dict:
    """The index's descriptor of one member: the manifest its per-arch tag serves, which must be the
    digest pushed (and probed) for its cell, and a single image's manifest."""
    served = registry.manifest(m["tag"], auth_config=auth)
    if served is None or served.digest != m["digest"]:
        raise RegistryError(f"the registry serves {served.digest if served else 'nothing'} for {m['tag']}, not "
                            f"the {m['digest']} pushed for {m['cell']}", transient=False)
    if served.media_type not in MANIFEST_TYPES:
        raise RegistryError(f"{m['tag']} is a {served.media_type}, not one image's manifest", transient=False)
    os_, architecture = m["platform"].split("/", 1)
    return {"mediaType": served.media_type, "digest": served.digest, "size": served.size,
            "platform": {"architecture": architecture, "os": os_}}


def index(descriptors: list[dict]) -> Manifest:
    """The list of `descriptors`: a Docker manifest list when every member is a Docker schema 2
    manifest (what dockerd pushes), else an OCI image index."""
    docker = all(d["mediaType"] == DOCKER_MANIFEST for d in descriptors)
    media_type = DOCKER_LIST if docker else OCI_INDEX
    body = json.dumps({"schemaVersion": 2, "mediaType": media_type, "manifests": descriptors},
                      indent=2).encode() + b"\n"
    return Manifest(media_type, "sha256:" + hashlib.sha256(body).hexdigest(), body)


def mismatch(tag: str, put: Manifest, served: Manifest | None, members: list[dict]) -> str:
    """Why what the registry serves under `tag` is not the list put ("" when it is): the same index,
    its manifests exactly the members, each platform resolving to its cell's pushed digest."""
    if served is None:
        return f"the registry serves nothing for {tag}"
    if served.media_type != put.media_type or served.digest != put.digest:
        return f"the registry serves {served.digest} ({served.media_type}) for {tag}, not the index {put.digest} put"
    try:
        entries = json.loads(served.body).get("manifests") or []
        resolved = {f"{e['platform']['os']}/{e['platform']['architecture']}": e["digest"] for e in entries}
    except (ValueError, AttributeError, KeyError, TypeError):
        return f"the registry's index for {tag} cannot be read"
    wanted = {m["platform"]: m["digest"] for m in members}
    if len(entries) != len(members) or resolved != wanted:
        return (f"the registry's index for {tag} resolves {shown(resolved, 300)}, not the members "
                f"{wanted}")
    return ""


def _merge(registry: RegistryClient, lr: ListReport, auth_for: AuthFor, options: Publishing, interrupt: Interrupt) -> None:
    auth = auth_for(lr.ref)  # the members' per-arch tags live beside the list, on its registry
    descriptors = []
    for m in lr.members:
        interrupt.check()
        descriptors.append(_member(registry, m, auth))
    put = index(descriptors)
    lr.media_type, lr.digest = put.media_type, put.digest
    repository, _ = refs.split_tag(lr.ref)
    _put(registry, f"{repository}@{put.digest}", put, auth, options, interrupt)  # held under no tag yet
    for tag in lr.tags:
        interrupt.check()
        tag_auth = auth_for(tag)
        _put(registry, tag, put, tag_auth, options, interrupt)
        why = mismatch(tag, put, registry.manifest(tag, auth_config=tag_auth), lr.members)
        if why:
            raise RegistryError(why, transient=False)
        lr.pushed.append({"ref": tag, "digest": put.digest})


def _put(registry: RegistryClient, ref: str, put: Manifest, auth: dict[str, str] | None, options: Publishing,
         interrupt: Interrupt) -> None:
    import tenacity  # a list push's only

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(options.attempts),
        wait=tenacity.wait_exponential(multiplier=options.backoff, max=60),
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, PushError) and e.transient),
        sleep=interrupt.wait, reraise=True)
    retrying(registry.put_manifest, ref, put, auth_config=auth)
