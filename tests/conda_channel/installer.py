"""The stand-in Miniforge installer: a bash header and a gzip tarball of a base prefix (the
channel's relocated python and the libraries it links, py-rattler, and a `conda` command:
standin_conda.py). `bash installer.sh -b -p PREFIX` unpacks it as Miniforge's does."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = "3.11"
MODULE = "_imagefactory_standin_conda"

HEADER = r"""#!/bin/bash
# imagefactory TEST STAND-IN for a Miniforge installer: a relocated CPython, py-rattler and a
# `conda` that supports only what imagefactory's conda template runs. Not conda.
set -eu
BATCH=0
PREFIX="${HOME:-/root}/miniforge3"
usage() { echo "usage: $0 [-b] [-f] [-u] [-p PREFIX]  (imagefactory test stand-in installer)"; }
while getopts "bfhp:u" opt; do
    case "$opt" in
        b) BATCH=1 ;;
        f|u) ;;
        p) PREFIX="$OPTARG" ;;
        h) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
    esac
done
[ "$BATCH" = 1 ] || { echo "this stand-in installs in batch mode only (-b)" >&2; exit 2; }
if [ -e "$PREFIX" ] && [ -n "$(ls -A "$PREFIX" 2>/dev/null)" ]; then
    echo "ERROR: File or directory already exists: '$PREFIX'" >&2
    exit 1
fi
echo "PREFIX=$PREFIX"
mkdir -p "$PREFIX"
echo "Unpacking payload ..."
tail -n +@@SKIP@@ "$0" | tar -xzf - -C "$PREFIX" --no-same-owner
"$PREFIX/bin/conda" --version >/dev/null
echo "installation finished."
exit 0
"""

CONDA = f"""#!/bin/sh
# imagefactory test stand-in for conda (see {MODULE}.py)
root=$(CDPATH= cd -- "$(dirname -- "$(readlink -f -- "$0")")/.." && pwd)
exec "$root/bin/python{PY}" -I -m {MODULE} "$root" "$@"
"""


def _rattler_files() -> list[tuple[Path, str]]:
    """(source, name in the tarball) for py-rattler's installed files, bytecode left out."""
    dist = metadata.distribution("py-rattler")
    base = Path(str(dist.locate_file("")))
    out = []
    for f in dist.files or []:
        if "__pycache__" in f.parts or f.name in ("RECORD", "INSTALLER", "REQUESTED"):
            continue
        out.append((base / f, f"lib/python{PY}/site-packages/{f.as_posix()}"))
    return out


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 1764547200
    tar.addfile(info, io.BytesIO(data))


def _add_tree(tar: tarfile.TarFile, folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if not path.is_dir() or path.is_symlink():
            tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)


def make(python_stage: Path, lib_stages: list[Path], out: Path) -> str:
    """Write the installer to `out`; returns its sha256."""
    payload = out.with_suffix(".tar.gz")
    with tarfile.open(payload, "w:gz", compresslevel=6) as tar:
        for folder in [python_stage, *lib_stages]:
            _add_tree(tar, folder)
        for src, name in _rattler_files():
            tar.add(src, arcname=name, recursive=False)
        _add_bytes(tar, f"lib/python{PY}/site-packages/{MODULE}.py", (HERE / "standin_conda.py").read_bytes(), 0o644)
        _add_bytes(tar, "bin/conda", CONDA.encode(), 0o755)
        _add_bytes(tar, "conda-meta/history", b"", 0o644)
        _add_bytes(tar, "pkgs/.keep", b"", 0o644)
    skip = HEADER.count("\n") + 1
    head = HEADER.replace("@@SKIP@@", str(skip)).encode()
    assert head.count(b"\n") == skip - 1
    h = hashlib.sha256(head)
    with open(out, "wb") as f, open(payload, "rb") as p:
        f.write(head)
        for block in iter(lambda: p.read(1 << 20), b""):
            f.write(block)
            h.update(block)
    payload.unlink()
    os.chmod(out, 0o644)
    return h.hexdigest()
