"""The images' compileall step (partials/bytecode.j2, conda.Dockerfile.j2): a module named for a
newer Python than the cell's (torch's torch/testing/_internal/py312_intrinsics.py on a 3.11 cell)
is skipped without a word, and any other file that does not compile is still reported.

The rendered command's own options are run with this host's Python on a small tree: the test
runs what the image runs, for a cell of the host's Python (3.11 in CI)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from imagefactory.config import matrix
from imagefactory.config import recipe
from imagefactory.render import contexts as render

HOST = f"3.{sys.version_info.minor}"
NEWER = f"py3{sys.version_info.minor + 1}_intrinsics.py"  # py312_intrinsics.py on 3.11
# syntax of the next Python that this one cannot parse (3.12's type statement on 3.11)
NEWER_SYNTAX = "type X = int\n" if sys.version_info < (3, 12) else "def f[T](:\n"

MATRIX = f"""\
image: registry.example.com/ml/train
matrix:
  python: ["{HOST}"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip, conda]
torch: "2.10.0"
"""


@pytest.fixture(scope="module")
def dockerfiles(tmp_path_factory) -> dict[str, str]:
    """installer -> the Dockerfile of a CPU cell of the host's Python."""
    path = tmp_path_factory.mktemp("bytecode") / "matrix.yaml"
    path.write_text(MATRIX)
    m = matrix.load(path)
    return {c.installer: render.dockerfile_text(m, c, None, [], locked=False) for c in m.cells}


def compileall_options(dockerfile: str) -> list[str]:
    """The options of the Dockerfile's compileall over the whole environment, as the shell
    hands them to compileall (the words between `-m compileall` and the first folder)."""
    (line,) = [x for x in dockerfile.splitlines() if re.search(r"python -m compileall .* -j 0 ", x)]
    words = shlex.split(line.split("-m compileall", 1)[1].split(" /opt/", 1)[0])
    assert words[:3] == ["-q", "-j", "0"], line
    return words


def run(options: list[str], tree: Path) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "compileall", *options, str(tree)],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def tree(root: Path, *, broken: bool) -> Path:
    pkg = root / "site-packages" / "torch" / "testing" / "_internal"
    pkg.mkdir(parents=True)
    (pkg / NEWER).write_text(NEWER_SYNTAX)
    (pkg / f"py3{sys.version_info.minor}_helpers.py").write_text("X = 1\n")  # this Python's own: compiled
    (pkg / "py310_helpers.py").write_text("X = 1\n")  # an older Python's: compiled
    (pkg / "common.py").write_text("import os\n")
    if broken:
        (root / "site-packages" / "broken.py").write_text("def broken(:\n    pass\n")
    return root


def compiled(path: Path) -> bool:
    return any((path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"))


@pytest.mark.parametrize("installer", ["pip", "conda"])
def test_the_rendered_compileall_skips_a_newer_pythons_module_silently(dockerfiles, installer, tmp_path):
    options = compileall_options(dockerfiles[installer])
    assert options == ["-q", "-j", "0", "-x", recipe.newer_python_modules(HOST)]
    root = tree(tmp_path, broken=False)
    rc, out = run(options, root)
    assert (rc, out) == (0, "")  # no SyntaxError, no traceback: nothing at all
    pkg = root / "site-packages" / "torch" / "testing" / "_internal"
    assert not compiled(pkg / NEWER)
    assert all(compiled(p) for p in pkg.glob("*.py") if p.name != NEWER)
    # the file is skipped for its name, not because it compiles: without -x it is reported
    rc, out = run(options[:3], root)
    assert rc == 1 and NEWER in out and "SyntaxError" in out


@pytest.mark.parametrize("installer", ["pip", "conda"])
def test_the_rendered_compileall_still_reports_a_real_syntax_error(dockerfiles, installer, tmp_path):
    root = tree(tmp_path, broken=True)
    rc, out = run(compileall_options(dockerfiles[installer]), root)
    assert rc == 1
    assert "broken.py" in out and "SyntaxError" in out
    assert NEWER not in out


@pytest.mark.parametrize("python", ["3.8", "3.9", "3.10", "3.11", "3.12", "3.13", "3.14"])
def test_the_skip_pattern_names_exactly_the_newer_pythons_modules(python):
    pattern = re.compile(recipe.newer_python_modules(python))
    minor = int(python.split(".")[1])
    for nn in range(100):
        path = f"/opt/venv/lib/python{python}/site-packages/torch/testing/_internal/py3{nn}_intrinsics.py"
        assert bool(pattern.search(path)) == (nn > minor), path
    newer = f"py3{minor + 1}"
    for path in [f"/x/{newer}_intrinsics.pyi", f"/x/{newer}_intrinsics.py.orig", f"/x/not_{newer}_intrinsics.py",
                 f"/x/{newer}intrinsics.py", f"/x/{newer}_/module.py", f"/x/{newer}_dir/module.py",
                 f"/x/{newer}_a-b.py", f"/x/{newer}_.py", f"/x/{newer}_a.py/inner.py"]:
        assert not pattern.search(path), path
    assert pattern.search(f"/x/{newer}_a_B9.py")


def test_the_golden_cells_skip_torchs_py312_module():
    """The golden Dockerfiles (all Python 3.11) carry the pattern, and it names torch's file."""
    golden = Path(__file__).resolve().parents[2] / "golden"
    for dockerfile in sorted(golden.glob("*.Dockerfile")):
        (options,) = [compileall_options(dockerfile.read_text())]
        assert options[3:] == ["-x", recipe.newer_python_modules("3.11")], dockerfile.name
    assert re.search(recipe.newer_python_modules("3.11"),
                     "/opt/venv/lib/python3.11/site-packages/torch/testing/_internal/py312_intrinsics.py")
