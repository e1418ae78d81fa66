"""config/expand.py: the axes' combinations, less exclude, with include applied."""

from __future__ import annotations

from imagefactory.config import expand


def run(spec):
    problems: list[tuple[tuple, str]] = []
    combos = expand.expand(spec, lambda keypath, message: problems.append((keypath, message)))
    return combos, problems


def ids(combos):
    return [(c["python"], c["cuda"], c["blas"]) for c in combos]


def test_every_combination_in_the_files_order_with_the_default_axes():
    combos, problems = run({"python": ["3.11", "3.12"], "cuda": ["none", "12.6"], "blas": ["openblas"]})
    assert problems == []
    assert ids(combos) == [("3.11", "none", "openblas"), ("3.11", "12.6", "openblas"),
                           ("3.12", "none", "openblas"), ("3.12", "12.6", "openblas")]
    assert {(c["installer"], c["platform"], c["variant"]) for c in combos} == {
        ("conda", expand.DEFAULT_AXES["platform"][0], "")}


def test_a_partial_exclude_removes_every_match_and_a_stray_one_is_a_problem():
    combos, problems = run({"python": ["3.11", "3.12"], "cuda": ["none", "12.6"], "blas": ["openblas"],
                            "exclude": [{"cuda": "12.6"}, {"python": "3.10"}]})
    assert ids(combos) == [("3.11", "none", "openblas"), ("3.12", "none", "openblas")]
    assert [k for k, _ in problems] == [("matrix", "exclude", 1, "python")]


def test_include_extends_without_overwriting_and_adds_a_new_cell():
    combos, problems = run({"python": ["3.11"], "cuda": ["none"], "blas": ["openblas", "mkl"],
                            "include": [{"blas": "mkl", "torch": "2.4.0"},
                                        {"python": "3.12", "cuda": "none", "blas": "mkl"},
                                        {"python": "3.13"}]})
    assert [c.get("torch") for c in combos] == [None, "2.4.0", None]
    assert ids(combos)[-1] == ("3.12", "none", "mkl") and combos[-1]["installer"] == "conda"
    assert problems == [(("matrix", "include", 2), "matches no cell, and a new cell needs cuda, blas")]


def test_an_included_cell_may_not_bring_its_own_variant():
    combos, problems = run({"python": ["3.11"], "cuda": ["none"], "blas": ["openblas"], "variant": ["slim", "full"],
                            "include": [{"python": "3.12", "cuda": "none", "blas": "mkl", "variant": "slm"}]})
    assert len(combos) == 2
    ((keypath, message),) = problems
    assert keypath == ("matrix", "include", 0, "variant") and "did you mean 'slim'?" in message


def test_a_value_listed_twice_is_a_problem():
    _, problems = run({"python": ["3.11", "3.11"], "cuda": ["none"], "blas": ["openblas"]})
    assert problems == [(("matrix", "python", 1), "'3.11' is listed twice (duplicate cells)")]
