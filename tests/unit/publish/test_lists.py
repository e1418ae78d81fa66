"""Issue 23 part 5: a list is published only when every platform of it passed (publish_lists.py),
with the in-memory engine and registry (tests/fake_engine.py); the registry HTTP client's
hostile-input rules against a real HTTP server on loopback (engine/registry.py)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from imagefactory.pipeline import build
from imagefactory.config import matrix
from imagefactory.publish import push
from imagefactory.engine import registry
from imagefactory.report import summary
from imagefactory.errors import RegistryError
from imagefactory.run.context import BuildOptions, PushOptions
from tests.fake_engine import World
from tests.unit.helpers import AMD, AMD_TAG, ARM, ARM_TAG, LIST, PIP_BOTH, good_probe, pip_both_project



@pytest.fixture
def project(tmp_path: Path) -> Path:
    return pip_both_project(tmp_path)


def _run(project: Path, text: str = PIP_BOTH, only: tuple[str, ...] = (), failing: tuple[str, ...] = (), **opts):
    """Build, probe and publish the matrix on a fresh world (buildkit: both platforms build); `failing`
    cells' probes crash. Returns the world, the cell reports by id, and the lists' reports."""
    (project / "matrix.yaml").write_text(text)
    m = matrix.load(project / "matrix.yaml")
    cells = [c for c in m.cells if not only or c.id in only]
    w = World(probes={c.id: good_probe(c) for c in m.cells if c.id not in failing}, builder="buildkit")
    w.puts.update(opts.pop("puts", {}))
    w.altered.update(opts.pop("altered", set()))
    if "on_call" in opts:
        w.on_call = opts.pop("on_call")(w)
    bopts = BuildOptions(work_dir=project / "work", gpus="none", verdicts_dir=project / "verdicts")
    reports = build.build(m, cells, w.context(bopts)).reports
    lists = push.publish(m, reports, w.context(PushOptions(backoff=0, **opts)))
    return w, {r.cell: r for r in reports}, lists


def _pushed(r, ref: str) -> str:
    return next(p["digest"] for p in r.pushed if p["ref"] == ref)


def test_both_platforms_passed_the_list_is_merged_put_and_read_back(project):
    w, cells, (lr,) = _run(project)
    assert lr.publish == "published" and lr.reason == "" and lr.ref == LIST
    index = json.loads(w.manifests[LIST].body)
    assert index["mediaType"] == "application/vnd.docker.distribution.manifest.list.v2+json"
    resolved = {f"{d['platform']['os']}/{d['platform']['architecture']}": d["digest"] for d in index["manifests"]}
    assert resolved == {"linux/amd64": _pushed(cells[AMD], AMD_TAG), "linux/arm64": _pushed(cells[ARM], ARM_TAG)}
    assert all(d["size"] > 0 for d in index["manifests"])
    assert [m["digest"] for m in lr.members] == [_pushed(cells[AMD], AMD_TAG), _pushed(cells[ARM], ARM_TAG)]
    assert lr.digest == "sha256:" + hashlib.sha256(w.manifests[LIST].body).hexdigest()
    assert lr.pushed == [{"ref": LIST, "digest": lr.digest}]
    # the index went in by its own digest first (no tag claimed), then under the list tag, then read back
    puts = w.ops("put_manifest")
    assert puts == [f"{LIST.rsplit(':', 1)[0]}@{lr.digest}", LIST]
    assert w.ops("registry_manifest")[-1] == LIST
    assert cells[AMD].publish == cells[ARM].publish == "published"


def test_arm64_failed_no_list_the_amd64_per_arch_tag_is_still_pushed(project):
    w, cells, (lr,) = _run(project, failing=(ARM,))
    assert cells[ARM].status == "check-failed" and cells[AMD].publish == "published"
    assert AMD_TAG in w.ops("push") and not [p for p in w.ops("push") if "aarch64-" in p]
    assert lr.publish == "not-published" and ARM in lr.reason and "linux/arm64" in lr.reason
    assert "\n" not in lr.reason and "every platform must pass" in lr.reason
    assert not w.ops("put_manifest") and LIST not in w.registry


def test_atomic_publishes_nothing_when_a_platform_failed(project):
    w, cells, (lr,) = _run(project, failing=(ARM,), atomic=True)
    assert not w.ops("push") and not w.ops("put_manifest")
    assert cells[AMD].publish == "not-published" and "--atomic" in cells[AMD].error
    assert lr.publish == "not-published" and "--atomic" in lr.reason and ARM in lr.reason


def test_a_member_not_in_the_run_keeps_the_list_unpublished_without_failing_it(project):
    w, cells, (lr,) = _run(project, only=(AMD,))
    assert cells[AMD].publish == "published" and not w.ops("put_manifest")
    assert lr.publish == "not-published" and f"{ARM} (linux/arm64) was not part of this run" in lr.reason
    assert lr.ok  # only a merge that failed fails the run; a member that failed fails it through itself


def test_a_registry_serving_another_index_is_a_publish_failure_of_the_list(project):
    w, cells, (lr,) = _run(project, altered={LIST})
    assert lr.publish == "publish-failed" and not lr.ok and lr.pushed == []
    assert f"for {LIST}, not the index {lr.digest} put" in lr.reason and "\n" not in lr.reason
    assert cells[AMD].publish == cells[ARM].publish == "published"  # the per-arch tags stay


def test_a_per_arch_tag_overwritten_before_the_merge_is_refused(project):
    def on_call(w):
        def hook(op, arg):
            if op == "registry_manifest" and arg == ARM_TAG:
                w.registry[ARM_TAG] = "sha256:" + "d" * 64  # someone else pushed the tag since
        return hook

    w, cells, (lr,) = _run(project, on_call=on_call)
    assert lr.publish == "publish-failed" and not w.ops("put_manifest")
    assert f"the registry serves sha256:{'d' * 64} for {ARM_TAG}" in lr.reason and ARM in lr.reason


def test_date_tags_of_the_list_are_lists_too(project):
    text = PIP_BOTH + "tags: {extra: [date]}\n"
    w, cells, (lr,) = _run(project, text, today=dt.date(2026, 11, 30))
    assert lr.tags == [LIST, LIST + "-20261130"] and lr.publish == "published"
    assert [p["ref"] for p in lr.pushed] == lr.tags and w.manifests[LIST + "-20261130"] == w.manifests[LIST]
    assert AMD_TAG + "-20261130" in cells[AMD].tags  # the per-arch variants stay each cell's own


def test_a_transient_put_is_retried_a_refused_one_is_not(project):
    w, _, (lr,) = _run(project, puts={LIST: ["transient"]})
    assert lr.publish == "published" and w.ops("put_manifest").count(LIST) == 2
    w, _, (lr,) = _run(project, puts={LIST: ["refused", "ok"]})
    assert lr.publish == "publish-failed" and "MANIFEST_INVALID" in lr.reason
    assert w.ops("put_manifest").count(LIST) == 1


def test_an_interrupt_while_the_list_is_put_leaves_it_interrupted_not_published(project):
    def on_call(w):
        def hook(op, arg):
            if op == "put_manifest" and arg == LIST:
                w.interrupt.cancel()
        return hook

    w, _, (lr,) = _run(project, puts={LIST: ["hang"]}, on_call=on_call)
    assert lr.publish == "interrupted" and lr.pushed == [] and "not claimed published" in lr.reason
    assert not lr.ok


def test_the_report_says_per_list_its_members_and_why(project, tmp_path):
    w, cells, lists = _run(project, failing=(ARM,))
    json_path, md_path = summary.write(list(cells.values()), tmp_path / "out" / "report.json", gpus=False,
                                      lists=lists)
    doc = json.loads(json_path.read_text())
    assert set(doc) >= {"ok", "gpus", "cells", "lists"}  # "cells" as before, "lists" beside it
    (entry,) = doc["lists"]
    assert entry["ref"] == LIST and entry["publish"] == "not-published" and ARM in entry["reason"]
    assert [(m["cell"], m["platform"]) for m in entry["members"]] == [(AMD, "linux/amd64"), (ARM, "linux/arm64")]
    assert entry["members"][0]["digest"] == _pushed(cells[AMD], AMD_TAG) and entry["members"][1]["digest"] == ""
    md = md_path.read_text()
    assert "## Lists" in md and f"`{LIST}`" in md and "not-published" in md


def test_a_list_that_failed_to_merge_makes_the_report_not_ok(project, tmp_path):
    w, cells, lists = _run(project, altered={LIST})
    json_path, _ = summary.write(list(cells.values()), tmp_path / "report.json", gpus=False, lists=lists)
    assert json.loads(json_path.read_text())["ok"] is False
    assert all(r.ok for r in cells.values())


# -- the registry HTTP client: hostile answers, against a real server on loopback ----------------

class _Registry(BaseHTTPRequestHandler):
    answers: dict[str, tuple[int, dict[str, str], bytes]] = {}
    seen: list[tuple[str, str, dict[str, str]]] = []

    def _answer(self) -> None:
        self.seen.append((self.command, self.path, dict(self.headers)))
        status, headers, body = self.answers.get(self.path.split("?", 1)[0], (404, {}, b""))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    _Registry.answers, _Registry.seen = {}, []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


DOCKER = "application/vnd.docker.distribution.manifest.v2+json"


def test_a_manifest_is_read_with_its_digest_checked_against_its_bytes(server):
    body = b'{"schemaVersion": 2}'
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    _Registry.answers["/v2/ml/train/manifests/1"] = (200, {"Content-Type": DOCKER, "Docker-Content-Digest": digest},
                                                    body)
    got = registry.get_manifest(f"{server}/ml/train:1", None)
    assert got is not None and (got.digest, got.size, got.media_type) == (digest, len(body), DOCKER)
    assert registry.get_manifest(f"{server}/ml/train:2", None) is None  # 404
    _Registry.answers["/v2/ml/train/manifests/1"] = (200, {"Content-Type": DOCKER,
                                                           "Docker-Content-Digest": "sha256:" + "0" * 64}, body)
    with pytest.raises(RegistryError, match="names digest 'sha256:0000"):
        registry.get_manifest(f"{server}/ml/train:1", None)


def test_an_oversized_or_unknown_answer_is_refused_and_never_echoed(server):
    big = b"{" + b" " * (registry.MAX_BYTES + 10) + b"}"
    _Registry.answers["/v2/ml/train/manifests/big"] = (200, {"Content-Type": DOCKER}, big)
    with pytest.raises(RegistryError, match="larger than 4 MiB"):
        registry.get_manifest(f"{server}/ml/train:big", None)
    _Registry.answers["/v2/ml/train/manifests/odd"] = (200, {"Content-Type": "text/html<script>"}, b"<b>hi</b>")
    with pytest.raises(RegistryError) as e:
        registry.get_manifest(f"{server}/ml/train:odd", None)
    assert "<b>" not in e.value.message and "'text/html<script>'" in e.value.message
    body = json.dumps({"errors": [{"code": "DENIED\nINJECTED", "message": "<img src=x>"}]}).encode()
    _Registry.answers["/v2/ml/train/manifests/err"] = (403, {}, body)
    with pytest.raises(RegistryError) as e:
        registry.get_manifest(f"{server}/ml/train:err", None)
    assert e.value.message.endswith("answered HTTP 403") and not e.value.transient


@pytest.mark.parametrize("realm", ["http://evil.example/token", "https://evil.example/to ken",
                                   "javascript:alert(1)", "https://user@evil.example/token"])
def test_a_token_realm_that_is_no_plain_https_url_is_not_followed(server, realm):
    _Registry.answers["/v2/ml/train/manifests/1"] = (401, {"WWW-Authenticate": f'Bearer realm="{realm}"'}, b"")
    with pytest.raises(RegistryError, match="HTTP 401"):
        registry.get_manifest(f"{server}/ml/train:1", {"username": "u", "password": "secret"})
    assert len(_Registry.seen) == 1  # the challenge was not followed anywhere


def test_a_token_that_could_break_a_header_is_not_sent(server):
    realm = f"http://{server}/token"
    _Registry.answers["/v2/ml/train/manifests/1"] = (401, {"WWW-Authenticate": f'Bearer realm="{realm}",'
                                                                                f'scope="repository:ml/train:pull"'}, b"")
    _Registry.answers["/token"] = (200, {}, json.dumps({"token": "abc\r\nX-Evil: 1"}).encode())
    with pytest.raises(RegistryError, match="HTTP 401"):
        registry.get_manifest(f"{server}/ml/train:1", None)
    _Registry.answers["/token"] = (200, {}, json.dumps({"token": "good.token-1"}).encode())
    with pytest.raises(RegistryError, match="HTTP 401"):  # the server keeps answering 401
        registry.get_manifest(f"{server}/ml/train:1", None)
    assert _Registry.seen[-1][2].get("Authorization") == "Bearer good.token-1"
    assert "scope=repository%3Aml%2Ftrain%3Apull" in _Registry.seen[-2][1]


def test_a_reference_that_is_no_reference_never_reaches_a_url():
    with pytest.raises(RegistryError, match="is not an image reference"):
        registry.get_manifest("127.0.0.1:5000/ml/train:1/../../x", None)
