"""The rules that make a layer's bytes the same on any day, by what they do, not by their text.

A settled RUN (partials/stamp.j2 ... partials/settle.j2) is run here as rendered, on a folder made
by the test standing for the image's root (every absolute path of the snippet moved under it: no
engine, nothing outside the folder touched); the final stages' COPY of the environment's layers is
read against the plan's order (resources/layers.py).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from imagefactory.config import matrix, recipe
from imagefactory.engine.api import Builder
from imagefactory.render import contexts
from imagefactory.resources import layers
from tests.conftest import REPO

EPOCH = recipe.SOURCE_DATE_EPOCH
LOWER = 1_000_000_000  # a lower layer's file: older than any build, never touched by a settle
SETTLED_RUN = '{% include "partials/stamp.j2" %}BODY \\\n{% include "partials/settle.j2" %}'


def rooted(script: str, root: Path) -> str:
    """`script` with every absolute path under `root` (the image's / there)."""
    moved = re.sub(r"(?<=\s)/", f"{root}/", script)
    assert not re.search(rf"(?<=\s)/(?!{re.escape(str(root)[1:])}/)", moved), moved  # nothing left outside root
    return moved


def settled(body: str, root: Path) -> str:
    """The shell of a settled RUN around `body`, as the Dockerfiles render it, under `root`."""
    return rooted(contexts.environment().from_string(SETTLED_RUN).render(source_date_epoch=EPOCH)
                  .replace("BODY", body), root)


def image_root(path: Path) -> Path:
    for folder in ("tmp", "etc", "opt/lower"):
        (path / folder).mkdir(parents=True)
    target = path / "opt" / "lower" / "target.txt"
    target.write_text("a lower layer's file\n")
    os.utime(target, (LOWER, LOWER))
    return path


def run_settled(body: str, root: Path) -> None:
    done = subprocess.run(["bash", "-o", "pipefail", "-c", settled(body, root)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def mtime(path: Path) -> int:
    return int(os.lstat(path).st_mtime)


def test_a_symlink_gets_the_fixed_time_and_its_target_keeps_its_own(tmp_path):
    """settle.j2's touch acts on a link itself (-h): followed, a link made by the RUN would keep the
    build's time, and its target, perhaps a lower layer's file, would be copied up into this layer."""
    root = image_root(tmp_path / "root")
    run_settled("mkdir /opt/new && ln -s /opt/lower/target.txt /opt/new/link && echo x > /opt/new/file", root)
    link = root / "opt" / "new" / "link"
    assert link.is_symlink() and os.readlink(link) == f"{root}/opt/lower/target.txt"
    assert mtime(link) == EPOCH
    assert mtime(root / "opt" / "lower" / "target.txt") == LOWER
    assert mtime(root / "opt" / "new" / "file") == mtime(root / "opt" / "new") == EPOCH
    assert mtime(root / "tmp") == mtime(root / "etc") == EPOCH
    assert not (root / "tmp" / "imagefactory-stamp").exists()


def test_a_file_written_in_the_stamps_own_tick_is_settled_too(tmp_path):
    """A file made straight after the stamp (by the shell itself: no process started in between) would
    fall in the stamp's clock tick without stamp.j2's pause: the same time as the stamp, not newer,
    and it would keep the build's time. Eight tries: without the pause most fall in the stamp's tick."""
    for n in range(8):
        root = image_root(tmp_path / f"root{n}")
        run_settled(": > /opt/written", root)
        assert mtime(root / "opt" / "written") == EPOCH, f"try {n}"


@pytest.fixture(scope="module")
def golden_matrix():
    return matrix.load(REPO / "tests" / "golden" / "matrix.yaml")


def copied_layers(dockerfile: str, stage: str) -> list[str]:
    """The layers the final stage copies from `stage`, in the Dockerfile's order."""
    final = dockerfile.rsplit("\nFROM ", 1)[1]
    return re.findall(rf"^COPY --from={stage} /imagefactory-layers/([^/\s]+)/ /$", final, re.MULTILINE)


@pytest.mark.parametrize("builder", [Builder.classic, Builder.buildkit])
@pytest.mark.parametrize("installer", ["pip", "conda"])
def test_the_environment_layers_are_copied_in_the_plans_order(golden_matrix, builder, installer):
    """What changes least comes first: a change to one package then leaves the torch and CUDA
    layers below it as they were, and a node that holds them fetches only the packages' layer."""
    plan, stage = (layers.LAYERS, "venv") if installer == "pip" else (layers.CONDA_LAYERS, "env")
    cells = [c for c in golden_matrix.cells if c.installer == installer]
    assert cells
    for cell in cells:
        text = contexts.dockerfile_text(golden_matrix, cell, None, [], locked=False, builder=builder)
        assert copied_layers(text, stage) == list(plan), cell.id


HISTORY = """\
==> 2025-03-04 05:06:07 <==
# cmd: constructor /opt/conda
+conda-forge/linux-64::python-3.12.9-h9e4cc4f_1_cpython
==> 2025-03-04 05:06:59 <==
# not a date line: ==> 2025-03-04 05:06:59 <== stays
"""
NORMALISED = HISTORY.replace("==> 2025-03-04 05:06:07 <==\n", "==> 1980-01-01 00:00:00 <==\n", 1) \
    .replace("\n==> 2025-03-04 05:06:59 <==\n", "\n==> 1980-01-01 00:00:00 <==\n", 1)


def installer_step(golden_matrix) -> str:
    """The installer's RUN of a conda cell's Dockerfile from its stamp on: the installer, conda's
    clean, the history's dates, the settle (the download and its checksum before it need a network)."""
    cell = next(c for c in golden_matrix.cells if c.installer == "conda")
    lines = contexts.dockerfile_text(golden_matrix, cell, None, [], locked=False).splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("RUN curl ") and "conda-installer.sh" in line)
    end = next(i for i in range(start, len(lines)) if not lines[i].rstrip("\n").endswith("\\"))
    run = "".join(lines[start:end + 1])
    return run[run.index("touch /tmp/imagefactory-stamp"):]


def fake_installer(root: Path, history: str | None) -> None:
    """An installer made here: `-b -p PREFIX` gives a conda that does nothing, and `history` (or none)."""
    write = "" if history is None else f"cat > \"$3/conda-meta/history\" <<'END'\n{history}END\n"
    (root / "tmp" / "conda-installer.sh").write_text(
        "set -e\nmkdir -p \"$3/bin\" \"$3/conda-meta\"\nprintf '#!/bin/sh\\nexit 0\\n' > \"$3/bin/conda\"\n"
        f"chmod +x \"$3/bin/conda\"\n{write}")


@pytest.mark.parametrize("history", [None, HISTORY], ids=["no-history", "history"])
def test_the_installer_step_takes_an_installer_with_or_without_a_history(golden_matrix, history, tmp_path):
    """A site's own installer (micromamba-based, a Miniforge fork) may write no conda-meta/history:
    the step goes on without one; one that does gets its install dates made 1980-01-01's."""
    root = image_root(tmp_path / "root")
    fake_installer(root, history)
    done = subprocess.run(["bash", "-o", "pipefail", "-c", rooted(installer_step(golden_matrix), root)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (root / "opt" / "conda" / "bin" / "conda").is_file()
    assert not (root / "tmp" / "conda-installer.sh").exists()
    written = root / "opt" / "conda" / "conda-meta" / "history"
    if history is None:
        assert not written.exists()
    else:
        assert written.read_text() == NORMALISED and mtime(written) == EPOCH
