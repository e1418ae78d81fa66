"""issue 18 part 4: credentials go only to the registry they belong to, against the real
authenticated registry. `localhost:5001` is the very server `127.0.0.1:5001` is, under another
registry name: the credentials of `image`'s registry must not follow a tag there."""

from __future__ import annotations

import pytest

from tests.integration.helpers import RUN_ID, TEST_PASSWORD, TEST_REGISTRY, TEST_USER, Build, registry_digest

pytestmark = [pytest.mark.docker, pytest.mark.registry]

CREDS = {"IMAGEFACTORY_REGISTRY_USER": TEST_USER, "IMAGEFACTORY_REGISTRY_PASSWORD": TEST_PASSWORD}
OTHER = "localhost:" + TEST_REGISTRY.rsplit(":", 1)[1]
OTHER_CREDS = {"IMAGEFACTORY_REGISTRY_USER_LOCALHOST_" + OTHER.rsplit(":", 1)[1]: TEST_USER,
               "IMAGEFACTORY_REGISTRY_PASSWORD_LOCALHOST_" + OTHER.rsplit(":", 1)[1]: TEST_PASSWORD}


def test_a_tag_on_another_registry_gets_only_that_registrys_credentials(cpu_build, test_registry,
                                                                       created_images):
    repo = f"regs-{RUN_ID}/train"  # the run id: the run deletes its pushes as it ends
    matrix = cpu_build.with_image(f"{TEST_REGISTRY}/{repo}")
    # the default template's tag part: it is the image's version label, so the content stays the same
    template = f"{OTHER}/{repo}:{{torch}}-py{{python}}-{{accel}}-{{blas}}{{installer_suffix}}"
    matrix.write_text(matrix.read_text() + f'tags: {{template: "{template}", registries: ["{OTHER}"]}}\n')
    tag = "2.13.0-py3.11-cpu-openblas-pip"
    release = f"{OTHER}/{repo}:{tag}"

    first = cpu_build.run("push", "--only", Build.GOOD, matrix=matrix, env=CREDS)
    good = cpu_build.report()[Build.GOOD]
    created_images.extend(good["tags"])
    assert first.returncode == 1, first.stdout + first.stderr
    # the hash tag on image's registry went out with its credentials; the release tag on the
    # other registry name got none of them, so the registry refused it
    assert [p["ref"] for p in good["pushed"]] == [f"{TEST_REGISTRY}/{repo}:sha-{good['content_hash'][:12]}"], good
    assert good["publish"] == "publish-failed" and release in good["error"]
    assert "no basic auth credentials" in good["error"] or "unauthorized" in good["error"].lower()
    assert TEST_PASSWORD not in first.stdout + first.stderr

    second = cpu_build.run("push", "--only", Build.GOOD, matrix=matrix, env={**CREDS, **OTHER_CREDS})
    good = cpu_build.report()[Build.GOOD]
    assert second.returncode == 0 and good["publish"] == "published", second.stdout + second.stderr
    pushed = {p["ref"]: p["digest"] for p in good["pushed"]}
    assert registry_digest(TEST_REGISTRY, repo, tag) == pushed[release]
