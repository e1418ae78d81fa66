"""rendered.py: a template render whose key is unchanged is read back, without Jinja2; anything a
template could tell apart, and any change to the templates or the code, is another key."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest

from imagefactory.files import store
from imagefactory.render import contexts
from imagefactory.render import rendered
from tests.unit.helpers import CPU_OPENBLAS


class Color(enum.Enum):
    red = "red"


@pytest.fixture()
def templates(tmp_path: Path) -> Path:
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "t.j2").write_text("{{ x }}\n")
    rendered._folder.cache_clear()
    yield folder
    rendered._folder.cache_clear()


def counted(out: str = "made") -> tuple[list[int], object]:
    calls: list[int] = []
    return calls, lambda: calls.append(1) or out


def test_a_render_made_before_is_read_back_without_jinja(monkeypatch):
    """The no-op build's contexts: the same cell renders the same Dockerfile and launch files,
    read back; with Jinja2's environment gone, they still come out byte for byte."""
    cell = CPU_OPENBLAS
    texts = [contexts.entrypoint_text(cell), contexts.launch_env_text(cell), contexts.launch_conf_text(cell)]

    def no_jinja():
        raise AssertionError("Jinja2 was asked to render")

    monkeypatch.setattr(contexts, "environment", no_jinja)
    assert [contexts.entrypoint_text(cell), contexts.launch_env_text(cell), contexts.launch_conf_text(cell)] == texts
    with pytest.raises(AssertionError, match="Jinja2 was asked"):
        contexts.entrypoint_text(cell, certs=True)  # another value: rendered


def test_another_template_folder_or_code_is_another_key(templates, monkeypatch):
    calls, make = counted()
    assert rendered.text("t.j2", {"x": 1}, make, templates=templates, code=()) == "made"
    assert rendered.text("t.j2", {"x": 1}, make, templates=templates, code=()) == "made" and len(calls) == 1
    (templates / "t.j2").write_text("{{ x }}!\n")  # the same size would do: the bytes are hashed
    rendered._folder.cache_clear()
    rendered.text("t.j2", {"x": 1}, make, templates=templates, code=())
    assert len(calls) == 2
    (templates / "partial.j2").write_text("new")  # any file of the folder (an include)
    rendered._folder.cache_clear()
    rendered.text("t.j2", {"x": 1}, make, templates=templates, code=())
    assert len(calls) == 3
    real = store.code_digest
    monkeypatch.setattr(store, "code_digest", lambda *names: real(*names) + "-edited")
    rendered.text("t.j2", {"x": 1}, make, templates=templates, code=())
    assert len(calls) == 4


@pytest.mark.parametrize("a, b", [
    ({"x": (1, 2)}, {"x": [1, 2]}),
    ({"x": {"a": 1, "b": 2}}, {"x": {"b": 2, "a": 1}}),  # a template iterates a dict in its order
    ({"x": Color.red}, {"x": "red"}),
    ({"x": Path("a")}, {"x": "a"}),
    ({"x": 1}, {"x": 1.0}),
    ({"x": True}, {"x": 1}),
    ({"x": {1: "a"}}, {"x": {"1": "a"}}),
], ids=["tuple-list", "dict-order", "enum-str", "path-str", "int-float", "bool-int", "int-key"])
def test_values_a_template_tells_apart_are_other_keys(templates, a, b):
    assert rendered._key("t.j2", a, templates, ()) != rendered._key("t.j2", b, templates, ())
    assert rendered._key("t.j2", a, templates, ()) == rendered._key("t.j2", dict(a), templates, ())


def test_a_value_without_an_exact_form_is_rendered_every_time(templates):
    calls, make = counted()
    for _ in range(2):
        rendered.text("t.j2", {"x": {1, 2}}, make, templates=templates, code=())  # a set: no stable order
        rendered.text("t.j2", {"x": object()}, make, templates=templates, code=())
    assert len(calls) == 4


def test_a_kept_text_behind_a_link_or_unreadable_is_made_again(templates, tmp_path):
    calls, make = counted()
    rendered.text("t.j2", {"x": 1}, make, templates=templates, code=())
    kept = rendered._file(rendered._key("t.j2", {"x": 1}, templates, ()) or "")
    assert kept is not None and kept.read_text() == "made"
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("planted")
    kept.unlink()
    kept.symlink_to(elsewhere)
    assert rendered.text("t.j2", {"x": 1}, make, templates=templates, code=()) == "made" and len(calls) == 2
    assert elsewhere.read_text() == "planted"  # the link was replaced, not written through
    kept.unlink()
    kept.write_bytes(b"\xff\xfe not UTF-8")
    assert rendered.text("t.j2", {"x": 1}, make, templates=templates, code=()) == "made" and len(calls) == 3
    assert kept.read_text() == "made"  # kept anew
