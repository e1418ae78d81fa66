"""issue: tag, push and publish: only images that passed reach the registry.

Against real registries: 127.0.0.1:5001 (htpasswd auth, started by .ci/run) and
throwaway ones a test starts and stops itself."""

from __future__ import annotations

import json

import pytest

from tests.integration.helpers import (RUN_ID, TEST_PASSWORD, TEST_REGISTRY, TEST_USER, Build, Registry,
                                      registry_digest, registry_tags, report_of)

pytestmark = [pytest.mark.docker, pytest.mark.registry]

CREDS = {"IMAGEFACTORY_REGISTRY_USER": TEST_USER, "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD}


def repo_of(image: str) -> str:
    return image.split("/", 1)[1]


@pytest.fixture(scope="module")
def pushed(cpu_build, test_registry, created_images):
    """`imagefactory push` of the shared build, with credentials: one cell passed, one never built.
    No --builder: the default (BuildKit here) finds the image the classic builder built."""
    result = cpu_build.run("push", env=CREDS, default_builder=True)
    report = cpu_build.report()
    for cell in report.values():
        created_images.extend(cell["tags"])
    return result, report


def test_push_with_credentials_publishes_the_passing_cell_with_matching_digests(cpu_build, pushed):
    result, report = pushed
    good = report[Build.GOOD]
    assert good["publish"] == "published", result.stdout + result.stderr
    # pushed under its own builder's content hash, whatever this run's builder is
    assert (good["builder"], good["content_hash"]) == ("classic", cpu_build.first_report[Build.GOOD]["content_hash"])
    refs = [p["ref"] for p in good["pushed"]]
    assert refs[0] == f"{cpu_build.image}:sha-{good['content_hash'][:12]}"  # immutable first, release after
    assert refs[1] == f"{cpu_build.image}:2.13.0-py3.11-cpu-openblas-pip"
    repo = repo_of(cpu_build.image)
    for p in good["pushed"]:
        tag = p["ref"].rsplit(":", 1)[1]
        assert registry_digest(TEST_REGISTRY, repo, tag) == p["digest"]  # read back from the registry API
    first = good["pushed"][0]
    # every layer was either uploaded or already there (blobs can be shared with other repositories)
    assert first["layers_pushed"] or first["layers_existing"]


def test_a_cell_that_failed_is_never_pushed(cpu_build, pushed):
    result, report = pushed
    assert result.returncode == 1
    assert report[Build.BAD]["publish"] == "not-published" and report[Build.BAD]["pushed"] == []
    tags = registry_tags(TEST_REGISTRY, repo_of(cpu_build.image))
    assert tags and not [t for t in tags if "mkl" in t]


def test_no_secret_in_output_report_logs_or_image(cpu_build, pushed, engine):
    result, report = pushed
    texts = [result.stdout, result.stderr, cpu_build.report_path.read_text(),
             cpu_build.report_path.with_suffix(".md").read_text()]
    texts += [p.read_text() for p in (cpu_build.work_dir / "logs").glob("*.log")]
    attrs = engine.client.images.get(report[Build.GOOD]["pushed"][0]["ref"]).attrs
    texts.append(json.dumps(attrs))
    texts += [json.dumps(engine.client.api.history(report[Build.GOOD]["image_id"]))]
    assert not [t for t in texts if TEST_PASSWORD in t]


def test_pushing_what_the_registry_has_uploads_no_layer(cpu_build, pushed):
    result = cpu_build.run("push", "--only", Build.GOOD, env=CREDS)
    assert result.returncode == 0, result.stdout + result.stderr
    good = cpu_build.report()[Build.GOOD]
    assert good["publish"] == "published"
    assert all(p["layers_pushed"] == [] for p in good["pushed"])
    assert "registry had every layer" in cpu_build.report_path.with_suffix(".md").read_text()


def test_push_without_credentials_fails_clearly_and_is_not_retried(cpu_build, test_registry, created_images):
    image = f"{TEST_REGISTRY}/noauth-{id(cpu_build)}/train"
    result = cpu_build.run("push", "--only", Build.GOOD, matrix=cpu_build.with_image(image))
    assert result.returncode == 1
    good = cpu_build.report()[Build.GOOD]
    created_images.extend(good["tags"])
    assert good["publish"] == "publish-failed" and good["pushed"] == []
    assert "no basic auth credentials" in good["error"] or "unauthorized" in good["error"].lower()
    assert "retrying" not in result.stdout + result.stderr
    assert registry_tags(TEST_REGISTRY, repo_of(image)) == []


def test_atomic_with_one_failing_cell_pushes_nothing(cpu_build, test_registry):
    image = f"{TEST_REGISTRY}/atomic-{id(cpu_build)}/train"
    result = cpu_build.run("push", "--atomic", matrix=cpu_build.with_image(image), env=CREDS)
    assert result.returncode == 1
    report = cpu_build.report()
    assert {r["publish"] for r in report.values()} == {"not-published"}
    assert "--atomic" in report[Build.GOOD]["error"]
    assert registry_tags(TEST_REGISTRY, repo_of(image)) == []


def test_registry_stopped_gives_retries_then_a_clean_failure(cpu_build, tmp_path, created_images):
    registry = Registry(tmp_path)
    image = f"{registry.address}/stopped/train"
    matrix = cpu_build.with_image(image)
    registry.stop()
    result = cpu_build.run("push", "--only", Build.GOOD, "--push-tries", "3", "--retry-delay", "0.2", matrix=matrix)
    out = result.stdout + result.stderr
    assert result.returncode == 1
    assert "(try 1/3)" in out and "(try 2/3)" in out and "retrying" in out
    good = cpu_build.report()[Build.GOOD]
    assert good["publish"] == "publish-failed" and good["pushed"] == []
    assert "published" not in {r["publish"] for r in cpu_build.report().values()}
    created_images.extend(good["tags"])


def test_build_with_push_publishes_in_one_command(cpu_build, pushed, created_images):
    """To a repository of its own on the shared registry: its blobs are there already (from `pushed`),
    so the push mounts them instead of compressing a gigabyte again."""
    image = f"{TEST_REGISTRY}/onecommand-{RUN_ID}/train"
    result = cpu_build.run("build", "--only", Build.GOOD, "--push", matrix=cpu_build.with_image(image), env=CREDS)
    good = cpu_build.report()[Build.GOOD]
    created_images.extend(good["tags"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert good["cached"] and good["publish"] == "published"
    tags = registry_tags(TEST_REGISTRY, repo_of(image))
    assert f"sha-{good['content_hash'][:12]}" in tags and "2.13.0-py3.11-cpu-openblas-pip" in tags


def test_registry_dying_during_a_push_is_retried_and_nothing_is_reported_published(dying_push, created_images):
    """The push started by conftest (helpers.DyingPush): its registry was stopped mid-upload."""
    assert dying_push.reached, "the push never reached the registry"
    done = dying_push.push.wait(timeout=600)
    out = done.stdout + done.stderr
    good = report_of(dying_push.push.report_path)[Build.GOOD]
    created_images.extend(good["tags"])
    assert done.returncode == 1, out
    assert "(try 1/3)" in out and good["publish"] == "publish-failed" and good["pushed"] == []
    dying_push.registry.start()  # same storage: whatever arrived before the crash is still there
    try:
        assert registry_tags(dying_push.registry.address, dying_push.repo, auth=None) == []
    finally:
        dying_push.registry.stop()
