"""The documentation cannot drift from what it documents.

* Every relative link in README.md and docs/*.md resolves: the file exists, and a `#anchor`
  names a heading of that file, as GitHub makes anchors from headings.
* docs/matrix.md's key reference ("Every key") documents exactly the keys of
  imagefactory/resources/matrix.schema.json: none missing, none the schema does not have.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
SCHEMA = REPO / "imagefactory" / "resources" / "matrix.schema.json"
MATRIX_DOC = REPO / "docs" / "matrix.md"

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text without fenced blocks and code spans (a link inside code is not a link)."""
    return _CODE.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    return _LINK.findall(prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, punctuation dropped
    (letters, digits, `_`, `-` and spaces kept), each space a `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a Markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(doc: Path, root: Path = REPO) -> list[str]:
    broken = []
    for target in links(doc.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or root not in dest.parents:
            broken.append(f"{doc.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{doc.name}: {target}: no such heading in {dest.name}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_the_link_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    """The checker itself can fail: a missing file, a missing heading; code is not a link."""
    (tmp_path / "other.md").write_text("# Other\n\n## The factory (`bench/factory.py`)\n\n## Dup\n\n## Dup\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](other.md#the-factory-benchfactorypy) [ok](other.md#dup-1) [ok](#title)\n"
                   "# Title\n[gone](missing.md) [bad](other.md#nowhere) `[code](nowhere.md)`\n"
                   "```\n[fenced](nowhere.md)\n```\n[web](https://example.com/x)\n")
    assert broken_links(doc, root=tmp_path) == ["a.md: missing.md: no such file",
                                                "a.md: other.md#nowhere: no such heading in other.md"]


# --------------------------------------------------------------------------- matrix reference

def _resolve(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """A schema node with local `$ref`s followed and `allOf` branches merged in."""
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    for branch in node.get("allOf", []):
        branch = _resolve(branch, root)
        node = {**node, "properties": {**branch.get("properties", {}), **node.get("properties", {})}}
    return node


def schema_keys(node: dict[str, Any], root: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Every key path of the schema: `a`, `a.b`, and `a[].b` for the objects in a list."""
    node = _resolve(node, root)
    for name, sub in node.get("properties", {}).items():
        path = prefix + name
        yield path
        sub = _resolve(sub, root)
        yield from schema_keys(sub, root, path + ".")
        items = sub.get("items")
        if isinstance(items, dict):
            yield from schema_keys(items, root, path + "[].")


def documented_keys(text: str) -> list[str]:
    """The keys in the first column of the tables under docs/matrix.md's "Every key"."""
    section = text.split("\n## Every key\n", 1)[1].split("\n## ", 1)[0]
    keys = []
    for row in section.splitlines():
        first = row.split("|")[1].strip() if row.startswith("|") else ""
        if first and first != "key" and not set(first) <= set("-: "):
            assert re.fullmatch(r"`[^`]+`", first), f"one key per row, in backticks: {row}"
            keys.append(first.strip("`"))
    return keys


def test_the_matrix_reference_documents_exactly_the_schemas_keys() -> None:
    schema = json.loads(SCHEMA.read_text())
    in_schema = set(schema_keys(schema, schema))
    documented = documented_keys(MATRIX_DOC.read_text())
    assert len(documented) == len(set(documented)), "a key documented twice"
    assert sorted(in_schema - set(documented)) == [], "schema keys docs/matrix.md does not document"
    assert sorted(set(documented) - in_schema) == [], "keys docs/matrix.md documents that the schema lacks"


def test_the_schema_walk_sees_nested_and_referenced_keys() -> None:
    root = {"$defs": {"u": {"type": "object", "properties": {"uid": {"type": "integer"}}}},
            "properties": {"user": {"$ref": "#/$defs/u"},
                           "inc": {"type": "array", "items": {"properties": {"torch": {}}}}}}
    assert sorted(schema_keys(root, root)) == ["inc", "inc[].torch", "user", "user.uid"]
