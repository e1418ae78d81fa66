"""The linters, once, where CI runs them, and the test code's own rules.

CI runs the README's test command (.ci/run: `python3 -m pytest -q`), so ruff and mypy run
here, in the unit suite, and nowhere else: ci.yml's lint job runs `pytest tests/unit` rather
than repeating them as steps of its own. Each checker is also shown to fail on a crafted
defect, so a broken configuration (no files checked, a rule set that selects nothing) is seen.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_is_clean():
    r = _run("ruff", "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_is_clean():
    r = _run("mypy")  # files and settings from pyproject.toml
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"no issues found in [1-9]\d* source files", r.stdout), r.stdout


def test_ruff_reports_a_crafted_defect(tmp_path):
    """With the project's settings (--config pyproject.toml): an undefined name is reported."""
    (tmp_path / "bad.py").write_text("def f():\n    return undefined_name\n")
    r = _run("ruff", "check", "--config", str(REPO / "pyproject.toml"), str(tmp_path / "bad.py"))
    assert r.returncode == 1 and "F821" in r.stdout, r.stdout + r.stderr


def test_mypy_reports_a_crafted_defect(tmp_path):
    (tmp_path / "bad.py").write_text("def f(x: int) -> str:\n    return x\n")
    r = _run("mypy", "--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
             str(tmp_path / "bad.py"), cwd=tmp_path)
    assert r.returncode == 1 and "Incompatible return value type" in r.stdout, r.stdout + r.stderr


# -- test modules import shared helpers from helpers modules, never from one another ---------------

_TEST_MODULE = re.compile(r"tests(\.\w+)*\.test_\w+")


def cross_imports(source: str) -> list[str]:
    """Imports of a test module (tests....test_x) in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and _TEST_MODULE.fullmatch(node.module):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if _TEST_MODULE.fullmatch(a.name)]
    return found


@pytest.mark.parametrize("path", sorted((REPO / "tests").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_no_test_module_imports_another(path):
    assert cross_imports(path.read_text()) == []


@pytest.mark.parametrize("source", ["from tests.unit.test_checks import good_probe\n",
                                    "import tests.integration.test_build\n",
                                    "def f():\n    from tests.unit.test_probe import run_probe\n"])
def test_a_cross_import_is_reported(source):
    assert cross_imports(source)


def test_helpers_modules_are_not_test_modules():
    assert cross_imports("from tests.unit.helpers import good_probe\nfrom tests.conftest import REPO\n"
                         "from tests.integration.conftest import Build\n") == []
