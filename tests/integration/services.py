"""The test services of tests/services/compose.yaml (the authenticated registry, the protected
package index): their images, built here once per machine, and the files they read, written
for each session. conftest.py hands them to pytest-docker, which runs `docker compose up -d`
before the session's first test and `down -v` after its last.

An image's tag is the content hash of what makes it (its Dockerfile, the pinned packages it
installs, its base): a warm run finds it and pays nothing; a change to any of them builds a new
one. The images carry SERVICE_LABEL, the one kind of image a run may leave (tests/leaks.py)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.integration.helpers import (BASE_REGISTRY, INDEX_USER, REPO, TEST_PASSWORD, TEST_REGISTRY, TEST_USER,
                                       free_port, make_wheel)
from tests.leaks import SERVICE_LABEL

SERVICES = REPO / "tests" / "services"
COMPOSE_FILE = SERVICES / "compose.yaml"
# what each service's image installs, pinned: part of its content hash
INDEX_PACKAGES = ("pypiserver==2.4.2", "passlib==1.7.4")
BASES = {"registry": f"{BASE_REGISTRY}/library/debian:bookworm-slim",
         "index": f"{BASE_REGISTRY}/library/python:3.11-slim-bookworm"}


@dataclass
class Files:
    """The session's service files, and what the tests need to know of them."""

    root: Path
    index_url: str
    index_password: str

    def env(self, images: dict[str, str]) -> dict[str, str]:
        """The variables compose.yaml reads."""
        return {"IMAGEFACTORY_TEST_REGISTRY_IMAGE": images["registry"], "IMAGEFACTORY_TEST_INDEX_IMAGE": images["index"],
                "IMAGEFACTORY_TEST_SERVICES_DIR": str(self.root),
                "IMAGEFACTORY_TEST_INDEX_PORT": self.index_url.split(":")[2].split("/")[0]}


def tag(name: str) -> str:
    """imagefactory-test/<name>:<content hash of its Dockerfile, its packages and its base>."""
    digest = hashlib.sha256()
    for part in ((SERVICES / name / "Dockerfile").read_bytes(), "\n".join(INDEX_PACKAGES if name == "index" else ()).encode(),
                 BASES[name].encode()):
        digest.update(hashlib.sha256(part).digest())
    return f"imagefactory-test/{name}:{digest.hexdigest()[:16]}"


def image(client, name: str) -> str:
    """The service's image, built unless this machine has it."""
    import docker

    ref = tag(name)
    try:
        client.images.get(ref)
        return ref
    except docker.errors.ImageNotFound:
        pass
    with tempfile.TemporaryDirectory(prefix=f"imagefactory-test-{name}-") as context:
        shutil.copy(SERVICES / name / "Dockerfile", context)
        if name == "index":  # downloaded on the host, which trusts the proxy's CA: the build reaches no index
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d",
                            f"{context}/wheels", *INDEX_PACKAGES], check=True, timeout=600)
        client.images.build(path=context, tag=ref, rm=True, forcerm=True, network_mode="host", pull=False,
                            buildargs={"BASE": BASES[name]}, labels={SERVICE_LABEL: name})
    return ref


def write_files(root: Path) -> Files:
    """The registry's config and htpasswd, the index's packages and htpasswd (a password of this
    session's own), under `root`."""
    from passlib.apache import HtpasswdFile

    (root / "registry").mkdir(parents=True)
    htpasswd = subprocess.run(["htpasswd", "-Bbn", TEST_USER, TEST_PASSWORD], capture_output=True, text=True,
                              check=True).stdout  # distribution reads bcrypt only
    (root / "registry" / "htpasswd").write_text(htpasswd)
    (root / "registry" / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: /var/lib/docker-registry\n"
        f"  delete:\n    enabled: true\nhttp:\n  addr: {TEST_REGISTRY}\nauth:\n  htpasswd:\n"
        "    realm: imagefactory-ci\n    path: /etc/imagefactory-test/htpasswd\n")
    (root / "index" / "packages").mkdir(parents=True)
    make_wheel(root / "index" / "packages")
    password = f"nEtrc-{uuid.uuid4().hex}"
    passwords = HtpasswdFile(str(root / "index" / "htpasswd"), new=True)
    passwords.set_password(INDEX_USER, password)
    passwords.save()
    for path in root.rglob("*"):  # read by the services' own users
        path.chmod(0o755 if path.is_dir() else 0o644)
    return Files(root, f"http://127.0.0.1:{free_port()}/simple/", password)
