"""Error messages and footguns of the matrix file (issue 18, part 6): every problem at once,
look-alike keys named by code point, loader and thread variables, plain http, system uids,
YAML 1.1 integers, scratch, Unicode labels."""

from __future__ import annotations

import pytest

from imagefactory.config import matrix
from imagefactory.errors import ConfigError

BASE = """
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
torch: "2.13.0"
"""
CELL = "py3.11-cpu-openblas-pip"


def problems(write_matrix, text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(text))
    assert e.value.exit_code == 2
    return e.value.problems


def loads(write_matrix, text: str):
    return matrix.load(write_matrix(text))


# -- every problem at once -------------------------------------------------------------------------
def test_two_misspelled_keys_are_two_problems(write_matrix):
    ps = problems(write_matrix, BASE + "threds: 4\ncompilr: false\npip: {indx_url: x, whelhouse: y}\n")
    assert len(ps) == 4
    assert any("threds" in p and "did you mean 'threads'" in p for p in ps)
    assert any("compilr" in p and "did you mean 'compiler'" in p for p in ps)
    assert any("pip.indx_url" in p for p in ps) and any("pip.whelhouse" in p for p in ps)


# -- look-alike keys -------------------------------------------------------------------------------
@pytest.mark.parametrize("key,named", [("t\u043erch", "U+043E CYRILLIC SMALL LETTER O"),
                                       ("torch\u3164", "U+3164 HANGUL FILLER")])
def test_a_look_alike_key_names_its_code_point(write_matrix, key, named):
    [p] = problems(write_matrix, BASE.replace('torch: "2.13.0"', f'torch: "2.13.0"\n{key}: "2.7.1"'))
    assert f"it holds {named}" in p and "did you mean 'torch'" in p


def test_a_plain_key_gets_no_code_point_note(write_matrix):
    [p] = problems(write_matrix, BASE + "threds: 4\n")
    assert "U+" not in p


# -- env -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_AUDIT", "BASH_ENV", "ENV"])
def test_loader_variables_need_env_allow(write_matrix, name):
    [p] = problems(write_matrix, BASE + f"env: {{{name}: /opt/x.so}}\n")
    assert f"env.{name}" in p and "env_allow" in p
    m = loads(write_matrix, BASE + f"env: {{{name}: /opt/x.so}}\nenv_allow: [{name}]\n")
    assert (name, "/opt/x.so") in m.cell(CELL).env


def test_a_loader_variable_in_an_include_entry_is_refused_too(write_matrix):
    text = BASE.replace("  installer: [pip]", '  installer: [pip]\n  include:\n    - {python: "3.11", env: {LD_PRELOAD: /x.so}}')
    [p] = problems(write_matrix, text)
    assert "matrix.include[0].env.LD_PRELOAD" in p


def test_env_allow_must_allow_something_used(write_matrix):
    ps = problems(write_matrix, BASE + "env_allow: [LD_PRELOAD, FOO]\n")
    assert any("env_allow[0]" in p and "no env sets it" in p for p in ps)
    assert any("env_allow[1]" in p and "needs no allowing" in p for p in ps)


@pytest.mark.parametrize("name", ["OMP_THREAD_LIMIT", "OMP_DYNAMIC", "MKL_DYNAMIC", "GOTO_NUM_THREADS"])
def test_thread_controls_that_fight_threads_are_refused(write_matrix, name):
    [p] = problems(write_matrix, BASE + f"env: {{{name}: '2'}}\nenv_allow: []\n")
    assert f"env.{name}" in p and "set threads instead" in p


@pytest.mark.parametrize("name", sorted(matrix.MANAGED_ENV))
def test_managed_names_are_refused(write_matrix, name):
    [p] = problems(write_matrix, BASE + f"env: {{{name}: x}}\n")
    assert f"{name} is set by imagefactory" in p


def test_mkl_threading_layer_is_managed():
    assert "MKL_THREADING_LAYER" in matrix.MANAGED_ENV  # render.py bakes it; the checks judge it


# -- plain http ------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,key", [
    ("pip: {index_url: 'http://pypi.example.com/simple'}", "pip.index_url"),
    ("pip: {extra_index_urls: ['https://a.example.com', 'http://b.example.com/simple']}", "pip.extra_index_urls[1]"),
    ("pip: {torch_index_url: 'http://127.0.0.1.evil.example/whl/{variant}'}", "pip.torch_index_url"),
    ("pip: {numpy_index_url: 'http://mkl.example.com'}", "pip.numpy_index_url"),
    ("conda: {channels: ['http://conda.example.com/forge']}", "conda.channels[0]"),
])
def test_plain_http_off_loopback_is_refused(write_matrix, setting, key):
    ps = problems(write_matrix, BASE + setting + "\n")
    assert any(key in p and "plain http" in p for p in ps), ps


@pytest.mark.parametrize("url", ["http://127.0.0.1:3141/simple", "http://localhost/simple",
                                 "http://127.1.2.3:8080/simple", "https://pypi.example.com/simple"])
def test_plain_http_on_loopback_and_https_are_fine(write_matrix, url):
    assert loads(write_matrix, BASE + f"pip: {{index_url: '{url}'}}\n").pip.index_url == url


# -- uid, YAML 1.1 integers ------------------------------------------------------------------------
def test_a_system_uid_is_refused(write_matrix):
    [p] = problems(write_matrix, BASE + "user: {uid: 999}\n")
    assert "user.uid" in p and "minimum 1000" in p and "system accounts" in p
    assert loads(write_matrix, BASE + "user: {uid: 1000}\n").cell(CELL).uid == 1000


@pytest.mark.parametrize("typed,read", [("02000", 1024), ("0x7d0", 2000), ("1_500", 1500), ("1:20", 80)])
def test_yaml_1_1_integers_are_refused(write_matrix, typed, read):
    [p] = problems(write_matrix, BASE + f"user: {{uid: {typed}}}\n" if read >= 1000 else BASE + f"threads: {typed}\n")
    assert f"{typed} is read by YAML 1.1 as {read}" in p


# -- scratch ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["base_images: {pip: scratch}", "base_images: {pip: 'docker.io/library/scratch:latest'}"])
def test_scratch_is_refused(write_matrix, setting):
    [p] = problems(write_matrix, BASE + setting + "\nbase_registry: mirror.example.com\n")
    assert "scratch is the empty image" in p


# -- labels ----------------------------------------------------------------------------------------
def test_labels_may_hold_letters_of_any_script(write_matrix):
    nfd = "Zoe\u0308"  # e + combining diaeresis
    m = loads(write_matrix, BASE + f"labels: {{maintainer: 'José Müller', team: 'Ελένη 李', x: '{nfd}'}}\n")
    assert dict(m.cell(CELL).labels) == {"maintainer": "José Müller", "team": "Ελένη 李", "x": nfd}


@pytest.mark.parametrize("value", ["a\u202eb", "a\u2066b", "a\u200fb", "a\\u0007b", "a\u3164b"])
def test_labels_refuse_control_bidi_and_invisible_characters(write_matrix, value):
    [p] = problems(write_matrix, BASE + f'labels: {{maintainer: "{value}"}}\n')
    assert "labels.maintainer" in p
    if value == "a\u3164b":  # a letter by its category, but shows as nothing
        assert "U+3164 HANGUL FILLER" in p
