"""config/bases.py: a cell's base image resolved, and the checks it must pass."""

from __future__ import annotations

from dataclasses import replace

from imagefactory.config import bases, platforms
from imagefactory.config.model import Cell

COMBO = {"python": "3.11", "cuda": "12.6", "blas": "openblas", "installer": "pip", "platform": "linux/amd64",
         "variant": ""}


def cell(base: str, installer: str = "pip") -> Cell:
    return Cell(python="3.11", cuda=None, blas="openblas", installer=installer, variant="",
                platform=platforms.get("linux/amd64"), torch="2.4.0", numpy=None, threads=4, compiler=True,
                base_image=base, packages=(), env=(), labels=(), user="trainer", uid=1000)


def test_the_placeholders_are_filled_and_the_mirror_applied():
    images = {**bases.DEFAULT_BASE_IMAGES, "pip": "nvidia/cuda:{cuda}-{accel}-py{python}"}
    assert bases.resolve(COMBO, images, None) == "nvidia/cuda:12.6-cu12.6-py3.11"
    assert bases.resolve(COMBO, images, "m:5000") == "m:5000/nvidia/cuda:12.6-cu12.6-py3.11"
    assert bases.resolve({**COMBO, "cuda": "none"}, images, None) == "nvidia/cuda:-cpu-py3.11"
    assert bases.resolve({**COMBO, "base_image": "debian:{python}"}, images, None) == "debian:3.11"
    assert bases.resolve(COMBO, bases.DEFAULT_BASE_IMAGES, None) == "python:3.11-slim-bookworm"


def check(c: Cell, combo: dict) -> list[tuple[tuple, str]]:
    problems: list[tuple[tuple, str]] = []
    bases.check(c, combo, bases.DEFAULT_BASE_IMAGES, ("matrix", "include", 0), lambda k, m: problems.append((k, m)))
    return problems


def test_a_good_base_passes():
    assert check(cell("python:3.11-slim-bookworm"), COMBO) == []


def test_scratch_a_bad_reference_and_a_stage_name_are_problems_at_the_key_that_names_them():
    (k, m), = check(cell("scratch"), {**COMBO, "base_image": "scratch"})
    assert k == ("matrix", "include", 0, "base_image") and "scratch is the empty image" in m
    (k, m), = check(cell("Not A Ref"), COMBO)
    assert k == ("base_images", "pip") and "is not a valid image reference" in m
    (k, m), = check(cell("venv"), COMBO)
    assert "has the name of a build stage" in m
    assert check(replace(cell("venv"), installer="conda"), {**COMBO, "installer": "conda"}) == []
