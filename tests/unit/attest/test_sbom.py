"""sbom.py's components: each one once, and none lost for sharing a name with another.

An image holds same-named things of different sources (numpy from PyPI and from conda; cuDNN
as a conda package and as the library loaded; two cuDNN builds at two places, from a wheel and
from conda; libgomp and libomp, both "openmp"): each is its own component. The purls, the
validator and the kept documents are in test_signing.py.
"""

from __future__ import annotations

from pathlib import Path

from imagefactory.attest import sbom
from imagefactory.lock.lockfile import Lock, Pin
from tests.unit.helpers import CUDA_MKL, good_probe

BASE = "127.0.0.1:5000/library/debian:bookworm-slim@sha256:" + "c" * 64
SUBJECT = sbom.Subject("127.0.0.1:5001/ml/train", CUDA_MKL.id, "a" * 64, "sha256:" + "b" * 64, BASE)
CUDNN_CONDA = "/opt/env/lib/libcudnn.so.9"
CUDNN_WHEEL = "/opt/env/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9"


def conda_record(name: str, version: str, build: str, sha: str) -> dict:
    return {"name": name, "version": version, "build": build, "channel": "https://conda.anaconda.org/conda-forge",
            "subdir": "linux-64", "sha256": sha}


def probe() -> dict:
    """A conda CUDA cell's image: conda's numpy also shows as a Python distribution, a pip-installed
    numpy of another version beside it, cuDNN from conda and from a wheel, both loaded."""
    p = good_probe(CUDA_MKL)
    p["packages"] = {"error": None, "python": {"numpy": "2.2.1", "torch": "2.13.0", "Jinja2": "3.1.6"}, "conda": None}
    p["sbom"] = {"error": None, "dpkg": [{"name": "libc6", "version": "2.36-9", "arch": "amd64", "source": None}] * 2,
                 "conda": [conda_record("numpy", "2.2.1", "py312_0", "1" * 64),
                           conda_record("cudnn", "9.10.1.4", "h0_0", "2" * 64),
                           conda_record("cudnn", "9.10.1.4", "h0_0", "2" * 64)],  # listed twice: one component
                 "libraries": {"cudnn": [CUDNN_CONDA, CUDNN_WHEEL, CUDNN_CONDA], "cudart": []},
                 "versions": {"cuda": "12.9", "cudnn": "91001"}}
    return p


def components(lock: Lock | None = None) -> list[dict]:
    doc = sbom.validate(sbom.document(SUBJECT, probe(), lock))  # the validator: bom-refs are unique
    return doc["components"]


def named(comps: list[dict], name: str) -> list[dict]:
    return [c for c in comps if c["name"] == name]


def path(component: dict) -> str | None:
    return next((p["value"] for p in component.get("properties", ()) if p["name"] == "imagefactory:path"), None)


def test_numpy_from_pypi_and_from_conda_are_two_components():
    purls = sorted(c.get("purl", "") for c in named(components(), "numpy"))
    assert purls == ["pkg:conda/numpy@2.2.1?build=py312_0&channel=https://conda.anaconda.org/conda-forge"
                     "&subdir=linux-64", "pkg:pypi/numpy@2.2.1"], purls


def test_cudnn_as_a_package_and_each_place_it_is_loaded_from_are_components():
    cudnn = named(components(), "cudnn")
    assert sorted((c.get("purl", "")[:10], path(c) or "") for c in cudnn) == [
        ("", CUDNN_CONDA), ("", CUDNN_WHEEL), ("pkg:conda/", "")], cudnn
    assert len({c["bom-ref"] for c in cudnn}) == 3


def test_the_openmp_runtimes_at_two_places_are_two_components():
    """A conda image loads LLVM's libomp under two names (good_probe): both are listed."""
    openmp = named(components(), "openmp")
    assert sorted(map(path, openmp)) == ["/opt/env/lib/libgomp.so.1", "/opt/env/lib/libomp.so"]


def test_a_component_listed_twice_is_one_component():
    comps = components()
    assert len(named(comps, "libc6")) == 1
    assert len([c for c in named(comps, "cudnn") if path(c) == CUDNN_CONDA]) == 1
    refs = [c["bom-ref"] for c in comps]
    assert len(refs) == len(set(refs))


def test_a_conda_locks_hashes_go_to_the_conda_components_only():
    lock = Lock(Path("locks/x.txt"), "conda", (), (Pin("numpy", "2.2.1", ("3" * 64,), 5, url="u", build="py312_0"),), "")
    numpy = {c.get("purl", "").split("/")[0]: c for c in named(components(lock), "numpy")}
    assert sorted(h["content"] for h in numpy["pkg:conda"]["hashes"]) == ["1" * 64, "3" * 64]
    assert "hashes" not in numpy["pkg:pypi"]  # conda's file is not the PyPI distribution's


def test_a_pip_locks_hashes_reach_a_distribution_named_otherwise_than_its_canonical_name():
    lock = Lock(Path("locks/x.txt"), "pip", (), (Pin("jinja2", "3.1.6", ("4" * 64,), 3),
                                                  Pin("numpy", "2.2.1", ("5" * 64,), 4)), "")
    comps = components(lock)
    assert named(comps, "Jinja2")[0]["hashes"] == [{"alg": "SHA-256", "content": "4" * 64}]
    conda_numpy = next(c for c in named(comps, "numpy") if c["purl"].startswith("pkg:conda/"))
    assert conda_numpy["hashes"] == [{"alg": "SHA-256", "content": "1" * 64}]  # its own, not the wheel's


def test_the_document_is_the_same_bytes_whatever_order_the_probe_lists_them_in():
    p = probe()
    p["sbom"]["libraries"]["cudnn"].reverse()
    p["sbom"]["conda"].reverse()
    assert sbom.document(SUBJECT, p, None) == sbom.document(SUBJECT, probe(), None)
