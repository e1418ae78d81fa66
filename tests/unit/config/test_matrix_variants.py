"""The optional fifth axis, `matrix.variant`: cells alike in python, cuda, blas and installer
that differ in what the include entries matching their variant set."""

from __future__ import annotations

import pytest

from imagefactory.config import matrix
from imagefactory.render import contexts as render
from imagefactory.errors import ConfigError

VARIANTS = """
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
  variant: [base, t2, vision]
  include:
    - {variant: t2, threads: 2}
    - {variant: vision, packages: [pillow]}
torch: "2.13.0"
threads: 4
"""
PLAIN = VARIANTS.replace("  variant: [base, t2, vision]\n", "").split("  include:")[0] + 'torch: "2.13.0"\nthreads: 4\n'


def test_each_variant_is_a_cell_with_what_its_include_entries_set(write_matrix):
    m = matrix.load(write_matrix(VARIANTS))
    assert [c.id for c in m.cells] == ["py3.11-cpu-openblas-pip-base", "py3.11-cpu-openblas-pip-t2",
                                       "py3.11-cpu-openblas-pip-vision"]
    base, t2, vision = m.cells
    assert (base.threads, base.packages) == (4, ())
    assert (t2.threads, t2.packages) == (2, ())
    assert (vision.threads, vision.packages) == (4, ("pillow",))
    # the default tag ends with the variant, so the cells never share a tag
    assert t2.tags == ("registry.example.com/ml/train:2.13.0-py3.11-cpu-openblas-pip-t2",)


def test_a_variant_is_labelled_and_a_cell_without_one_keeps_its_labels(write_matrix):
    m = matrix.load(write_matrix(VARIANTS))
    labels = dict(render.labels(m, m.cells[1], None))
    assert labels["io.imagefactory.variant"] == "t2" and labels["io.imagefactory.cell"].endswith("-pip-t2")
    plain = matrix.load(write_matrix(PLAIN, "plain.yaml"))
    [cell] = plain.cells
    assert cell.id == "py3.11-cpu-openblas-pip" and cell.variant == ""
    assert "io.imagefactory.variant" not in dict(render.labels(plain, cell, None))
    assert cell.tags == ("registry.example.com/ml/train:2.13.0-py3.11-cpu-openblas-pip",)


def test_exclude_and_a_template_can_name_the_variant(write_matrix):
    text = VARIANTS.replace("  include:", "  exclude: [{variant: base}]\n  include:") + \
        'tags: {template: "{image}:{variant}-{python}"}\n'
    m = matrix.load(write_matrix(text))
    assert [c.tags[0].rsplit(":", 1)[1] for c in m.cells] == ["t2-3.11", "vision-3.11"]


@pytest.mark.parametrize("name", ["Vision", "-x", "x-", "a b", "../x", "a_b", "x" * 33, "", "a\nb"])
def test_a_variant_name_outside_the_pattern_is_one_located_error(write_matrix, name):
    text = VARIANTS.replace("variant: [base, t2, vision]", f"variant: [base, {name!r}]")
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(text))
    assert e.value.exit_code == 2
    assert any(":7: matrix.variant[1]" in p for p in e.value.problems), e.value.problems


def test_a_variant_listed_twice_and_an_exclude_of_no_variant_are_errors(write_matrix):
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(VARIANTS.replace("[base, t2, vision]", "[base, t2, base]")))
    assert any("listed twice" in p for p in e.value.problems)
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(PLAIN.replace("  installer: [pip]\n", "  installer: [pip]\n  exclude: [{variant: x}]\n")))
    assert any("none, matrix.variant is not set" in p for p in e.value.problems), e.value.problems


def test_two_variants_that_would_share_a_tag_are_refused(write_matrix):
    text = VARIANTS + 'tags: {template: "{image}:{python}-{accel}"}\n'
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(text))
    assert any("would both be tagged" in p for p in e.value.problems)
