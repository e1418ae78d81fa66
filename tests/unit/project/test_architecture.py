"""docs/architecture.md is the map: every module of the package is listed there once, under the
folder it lives in, and nothing listed is gone. Its numbered folder headings are the pipeline's
order, and imports follow it: a module imports from its own folder or an earlier one, never a later
one (a later step may use an earlier step's types; an earlier step never reaches forward)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.unit.helpers import PACKAGE_DIR, package_modules

MAP = PACKAGE_DIR.parent / "docs" / "architecture.md"
HEADING = re.compile(r"^## (\d+)\. `([a-z_]+)/`", re.M)
ENTRY = re.compile(r"^- `([a-z_/]+\.py)`", re.M)
TOP = ("errors", "interrupt", "terminal", "credentials", "__main__")  # the modules beside the folders


def folders(text: str) -> list[str]:
    """The step folders in the map's order (its numbered headings)."""
    found = [(int(n), name) for n, name in HEADING.findall(text)]
    assert [n for n, _ in found] == list(range(1, len(found) + 1)), "the map's headings are numbered 1, 2, 3, ..."
    return [name for _, name in found]


def listed(text: str) -> dict[str, str]:
    """Each module the map lists (folder/module.py) -> the folder heading it is listed under."""
    out: dict[str, str] = {}
    sections = re.split(r"^## ", text, flags=re.M)
    for section in sections:
        head = re.match(r"\d+\. `([a-z_]+)/`", section)
        for path in ENTRY.findall(section):
            assert path not in out, f"{path} is listed twice in docs/architecture.md"
            out[path] = head.group(1) if head else ""
    return out


def modules_on_disk() -> set[str]:
    return {str(p.relative_to(PACKAGE_DIR)) for name, p in package_modules().items() if p.name != "__init__.py"}


def test_every_module_is_on_the_map_and_every_entry_exists():
    entries = listed(MAP.read_text())
    on_disk = modules_on_disk()
    assert sorted(on_disk - set(entries)) == [], "modules missing from docs/architecture.md"
    assert sorted(set(entries) - on_disk) == [], "docs/architecture.md names modules that are gone"


def test_each_module_is_listed_under_its_own_folder():
    wrong = {path: under for path, under in listed(MAP.read_text()).items()
             if "/" in path and path.split("/")[0] != under}
    assert wrong == {}


def test_every_folder_of_the_package_is_a_step_on_the_map():
    on_disk = {p.parent.name for p in PACKAGE_DIR.glob("*/__init__.py")}
    assert sorted(on_disk) == sorted(folders(MAP.read_text()))


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each imagefactory module `path` imports: at the top, inside a function, or
    for annotations only."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("imagefactory"):
            if node.module == "imagefactory":
                out += [(node.lineno, f"imagefactory.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("imagefactory")]
    return out


def backward_imports(order: list[str], modules: dict[str, Path]) -> list[str]:
    """Each import that reaches a later folder than the importer's (a top module reaches none)."""
    rank = {name: i for i, name in enumerate(order)}
    bad = []
    for name, path in modules.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] == "__main__":
            continue
        own = rank.get(parts[1], -1)  # errors, interrupt: -1, before every folder
        for line, target in _imported(path):
            tparts = target.split(".")
            if len(tparts) > 1 and tparts[1] in rank and rank[tparts[1]] > own:
                bad.append(f"{name}:{line} imports {target}")
    return bad


def test_imports_run_from_later_steps_to_earlier_ones_never_back():
    assert backward_imports(folders(MAP.read_text()), package_modules()) == []


@pytest.mark.parametrize("importer, target", [("config/recipe.py", "imagefactory.lock.lockfile"),
                                              ("errors.py", "imagefactory.files.bounded")])
def test_a_backward_import_is_caught(tmp_path, importer, target):
    """The rule above can fail: a module of an earlier step (or a top module) importing a later one."""
    planted = tmp_path / "imagefactory" / importer
    planted.parent.mkdir(parents=True)
    planted.write_text(f"from {target.rsplit('.', 1)[0]} import {target.rsplit('.', 1)[1]}\n")
    name = "imagefactory." + importer[:-3].replace("/", ".")
    modules = {**package_modules(), name: planted}
    found = backward_imports(folders(MAP.read_text()), modules)
    assert any(line.startswith(f"{name}:1 imports ") for line in found), found


STEP = re.compile(r'^"""Step (\d+)[ :(]')


def test_one_numbering_the_maps_headings_are_the_docstrings_steps():
    """A module's docstring that names its step names its folder's number on the map: one numbering,
    the order data flows (which the import rule above holds against the import graph)."""
    number = {name: i for i, name in enumerate(folders(MAP.read_text()), 1)}
    wrong = {}
    for name, path in package_modules().items():
        parts = name.split(".")
        found = STEP.match(path.read_text(encoding="utf-8"))
        if len(parts) > 1 and parts[1] in number and found and int(found.group(1)) != number[parts[1]]:
            wrong[name] = (found.group(1), number[parts[1]])
    assert wrong == {}
    assert all(STEP.match((PACKAGE_DIR / folder / "__init__.py").read_text()) for folder in number)
