"""The environment's layer plan, applied inside the image's venv stage (stdlib only).

`python layers.py split PREFIX OUT EPOCH` moves every file of the environment at PREFIX into one
folder per layer, OUT/<layer>/PREFIX/..., and the final stage copies each folder as a layer of
its own: the layer holds those files and their folders, every time fixed, so its bytes depend on
its files alone.

Layers go from what changes least to what changes most: the venv itself (its interpreter links,
pip; setuptools and wheel when nothing later needs them), the CUDA runtime libraries (`nvidia-*`, `cuda-*` wheels and what they need), torch (with
triton and every package torch needs that is not in a layer before it), the BLAS stack (NumPy,
MKL and its OpenMP/TBB runtimes, OpenBLAS wheels), then everything else: the matrix's
`packages:` and their dependencies. Which distribution goes where is decided from what was
installed (each distribution's METADATA `Requires-Dist` closure), and which files each one owns
from its RECORD: cells that install the same packages for a layer get the same files in it.
Bytecode (`__pycache__/NAME.TAG.pyc`) goes with its source; a file no RECORD lists goes to the
first layer. Every file lands in exactly one layer; a folder is repeated in each layer that has
files below it.

Reproducible bytes: every moved entry (and every folder made) gets mtime EPOCH; owners are the
build's (root), modes are kept. OUT/plan.json records which distributions each layer holds, and
each layer carries its own part of it as PREFIX/etc/imagefactory/layers/<layer>.txt (so that no
layer is empty).

A conda environment (PREFIX/conda-meta exists) is split the same way by its conda-meta records
(`depends`, `files`), into CONDA_LAYERS: python and what it needs, the CUDA libraries, the BLAS
stack (before torch: conda's pytorch depends on the BLAS it was built for, and the BLAS stays
with the BLAS), torch, the rest. Files no record lists (conda-meta/history and pinned, which
name the cell's specs) go to the last layer there.

A seed is claimed by its own layer only: no other layer's closure takes it.

`python layers.py early PREFIX OUT EPOCH` is the classic builder's first half: its torch step
(a step of its own, so that other packages changing does not fetch torch again) moves the files
of the layers up to torch's out at once, keeping their dist-info in place for the next step's
pip. Moving them later would copy them into that step's layer: the build would hold them twice.
The later `split` takes what is left, and drops what `early` moved for a distribution that pip
replaced in between.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys

# (layer folder, what seeds it); the order is the image's layer order.
BASE = "1-venv"
PACKAGES = "5-packages"
LAYERS = (BASE, "2-cuda", "3-torch", "4-blas", PACKAGES)
EARLY = ("2-cuda", "3-torch")  # what `early` moves: the layers torch's own install fills
EARLY_RECORD = "early.json"  # OUT/early.json: what `early` moved, for `split`
CONDA_LAYERS = ("1-python", "2-cuda", "3-blas", "4-torch", "5-packages")


class Route:
    """One route's plan: its layers (image order), each layer's seeds (claimed in that order), the
    layer whose seeds' requirements are not followed, where unclaimed names and unlisted files go."""

    def __init__(self, layers: "tuple[str, ...]", seeds: "dict[str, re.Pattern[str]]", closed: str,
                 extras: "re.Pattern[str]", unowned: str):
        self.layers, self.seeds, self.closed, self.extras, self.unowned = layers, seeds, closed, extras, unowned

    def reserved(self, name: str, layer: str) -> bool:
        """Whether `name` is another layer's seed (only that layer may claim it)."""
        return any(other != layer and pattern.fullmatch(name) for other, pattern in self.seeds.items())


PIP = Route(LAYERS, {
    BASE: re.compile(r"pip"),
    "2-cuda": re.compile(r"(nvidia|cuda)-[a-z0-9-]+"),
    "3-torch": re.compile(r"torch|triton|pytorch-triton(-[a-z0-9]+)?"),
    "4-blas": re.compile(r"numpy|mkl(-[a-z0-9-]+)?|intel-(openmp|cmplr-[a-z0-9-]+)|tbb|tcmlib|umf"
                         r"|scipy-openblas(32|64)|openblas"),
}, closed=BASE, extras=re.compile(r"setuptools|wheel"), unowned=BASE)  # extras: ensurepip's

CONDA = Route(CONDA_LAYERS, {
    "1-python": re.compile(r"python"),
    "2-cuda": re.compile(r"cuda-[a-z0-9-]+|libcu[a-z0-9-]+|libnv[a-z0-9-]+|cudnn|nccl|(lib)?cusparselt"
                         r"|(lib)?cutensor|(lib)?magma"),
    "3-blas": re.compile(r"numpy|blas(-devel)?|lib(c?blas|lapacke?)|mkl(-[a-z0-9-]+)?|intel-openmp|llvm-openmp"
                         r"|_openmp_mutex|libgomp|tbb|libhwloc|libopenblas|openblas"),
    "4-torch": re.compile(r"pytorch(-[a-z0-9-]+)?|libtorch|triton|torchtriton"),
}, closed="", extras=re.compile(r"(?!)"), unowned="5-packages")
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_PYC = re.compile(r"(?P<stem>[^/.]+)\.[^/]+\.pyc")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class Dist:
    """One installed distribution: its name, version, what it needs, the files it owns."""

    def __init__(self, name: str, version: str, requires: "list[str]", files: "list[str]", label: str = ""):
        self.name, self.version, self.requires, self.files = name, version, requires, files
        self.label = label or "%s==%s" % (name, version)


def _metadata(text: str) -> "tuple[str, str, list[str]]":
    name = version = ""
    requires: list[str] = []
    for line in text.split("\n"):
        if not line.strip():
            break  # the headers end at the first blank line; the description follows
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "Name":
            name = value
        elif key == "Version":
            version = value
        elif key == "Requires-Dist" and "extra" not in value.partition(";")[2]:
            m = _REQUIREMENT.match(value)
            if m:
                requires.append(canonical(m.group(1)))
    return name, version, requires


def read_dists(site: str) -> "list[Dist]":
    """Every *.dist-info in `site`, with the absolute paths its RECORD lists."""
    dists = []
    for entry in sorted(os.listdir(site)):
        info = os.path.join(site, entry)
        if not entry.endswith(".dist-info") or not os.path.isdir(info):
            continue
        with open(os.path.join(info, "METADATA"), encoding="utf-8", errors="replace") as f:
            name, version, requires = _metadata(f.read())
        files = []
        record = os.path.join(info, "RECORD")
        if os.path.isfile(record):
            with open(record, encoding="utf-8", errors="replace", newline="") as f:
                for row in csv.reader(f):
                    if row and row[0]:
                        files.append(os.path.normpath(os.path.join(site, row[0])))
        files.append(os.path.normpath(info))  # the dist-info itself (RECORD may omit some of it)
        dists.append(Dist(canonical(name or entry.split("-")[0]), version, requires, files))
    return dists


def read_conda(prefix: str) -> "list[Dist]":
    """Every package record in PREFIX/conda-meta, with the absolute paths of its `files`."""
    meta = os.path.join(prefix, "conda-meta")
    dists = []
    for entry in sorted(os.listdir(meta)):
        path = os.path.join(meta, entry)
        if not entry.endswith(".json") or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        name, version, build = (str(record.get(k) or "") for k in ("name", "version", "build"))
        requires = [str(d).split()[0] for d in record.get("depends") or [] if str(d).split()]
        files = [os.path.normpath(os.path.join(prefix, str(f))) for f in record.get("files") or []]
        files.append(os.path.normpath(path))  # its own record goes with it
        dists.append(Dist(name or entry.rsplit("-", 2)[0], version, requires, files,
                          label="%s=%s=%s" % (name, version, build)))
    return dists


def plan(dists: "list[Dist]", route: Route = PIP) -> "dict[str, str]":
    """Distribution name -> layer. A layer gets its seeds and everything they need (transitively)
    that no layer before it holds and no other layer seeds; what is left goes to the last layer."""
    by_name = {d.name: d for d in dists}
    where: dict[str, str] = {}
    for layer, seeds in route.seeds.items():
        todo = sorted(n for n in by_name if n not in where and seeds.fullmatch(n))
        while todo:
            name = todo.pop()
            if name in where:
                continue
            where[name] = layer
            if layer != route.closed:  # pip and setuptools come with the venv; what they need is theirs
                todo.extend(r for r in by_name[name].requires
                            if r in by_name and r not in where and not route.reserved(r, layer))
    for name in by_name:  # what the venv brought and no layer claimed stays with the venv
        where.setdefault(name, route.layers[0] if route.extras.fullmatch(name) else route.layers[-1])
    return where


def owners(dists: "list[Dist]", where: "dict[str, str]") -> "dict[str, str]":
    """Absolute path -> layer, for every path some RECORD lists (a dist-info folder: its whole tree)."""
    out: dict[str, str] = {}
    for d in dists:
        for path in d.files:
            out[path] = where[d.name]
    return out


def layer_of(path: str, owned: "dict[str, str]", unowned: str = BASE) -> str:
    """The layer of one file: its RECORD's, its source's for bytecode, its dist-info's, else the first."""
    if path in owned:
        return owned[path]
    folder, name = os.path.split(path)
    m = _PYC.fullmatch(name)
    if m and os.path.basename(folder) == "__pycache__":
        source = os.path.join(os.path.dirname(folder), m.group("stem") + ".py")
        if source in owned:
            return owned[source]
    parent = folder
    while parent not in ("/", ""):
        if parent.endswith(".dist-info") and parent in owned:
            return owned[parent]
        parent = os.path.dirname(parent)
    return unowned


def assign(prefix: str, owned: "dict[str, str]", unowned: str = BASE) -> "tuple[dict[str, str], list[str]]":
    """Every file and link below `prefix` -> its layer; and the folders that hold nothing."""
    files: dict[str, str] = {}
    empty = []
    for root, dirs, names in os.walk(prefix):
        for name in dirs:
            path = os.path.join(root, name)
            if os.path.islink(path):  # a link to a folder (lib64 -> lib) is an entry, not a tree
                files[path] = layer_of(path, owned, unowned)
        for name in names:
            path = os.path.join(root, name)
            files[path] = layer_of(path, owned, unowned)
        if not dirs and not names:
            empty.append(root)
    return files, empty


def _make_parents(src_dir: str, dst_dir: str, made: "set[str]") -> None:
    if dst_dir in made:
        return
    parent_src, parent_dst = os.path.dirname(src_dir), os.path.dirname(dst_dir)
    if parent_src != src_dir and not os.path.isdir(parent_dst):
        _make_parents(parent_src, parent_dst, made)
    if not os.path.isdir(dst_dir):
        os.mkdir(dst_dir)
        os.chmod(dst_dir, os.stat(src_dir).st_mode & 0o7777)
    made.add(dst_dir)


def _site(prefix: str) -> str:
    lib = os.path.join(prefix, "lib")
    return next(os.path.join(lib, v, "site-packages") for v in sorted(os.listdir(lib))
                if os.path.isdir(os.path.join(lib, v, "site-packages")))


def _move(files: "dict[str, str]", out: str, made: "set[str]") -> None:
    for path, layer in sorted(files.items()):
        dst = os.path.join(out, layer) + path
        _make_parents(os.path.dirname(path), os.path.dirname(dst), made)
        os.rename(path, dst)


def _prune(paths: "list[str]", stop: str) -> None:
    """Remove the folders these paths left empty, up to (not including) `stop`."""
    for folder in sorted({os.path.dirname(p) for p in paths}, key=len, reverse=True):
        while folder.startswith(stop + "/") and os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)
            folder = os.path.dirname(folder)


def early(prefix: str, out: str, epoch: int) -> "dict[str, list]":
    """Move the files of the EARLY layers (not their dist-info) out; returns what was moved,
    by distribution: name -> [layer, version, moved paths]."""
    prefix = os.path.normpath(prefix)
    dists = read_dists(_site(prefix))
    where = plan(dists)
    owned = owners(dists, where)
    by_dist = {path: d.name for d in dists for path in d.files}
    files, _ = assign(prefix, owned)
    moving = {path: layer for path, layer in files.items()
              if layer in EARLY and ".dist-info/" not in path[len(prefix):] + "/"}
    made: set[str] = set()
    for layer in LAYERS:
        os.makedirs(os.path.join(out, layer), exist_ok=True)
    _move(moving, out, made)
    _prune(list(moving), prefix)
    _settle(out, epoch)
    record: dict[str, list] = {d.name: [where[d.name], d.version, []] for d in dists if where[d.name] in EARLY}
    for path in sorted(moving):
        record[layer_of(path, by_dist)][2].append(os.path.join(out, moving[path]) + path)
    return record


def _take_early(out: str, dists: "list[Dist]") -> "dict[str, str]":
    """What `early` moved that is still installed (name -> layer); the files of a distribution
    pip replaced since are removed."""
    path = os.path.join(out, EARLY_RECORD)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    os.remove(path)
    installed = {d.name: d.version for d in dists}
    kept = {}
    for name, (layer, version, moved) in sorted(record.items()):
        if installed.get(name) == version:
            kept[name] = layer
            continue
        for stale in moved:
            if os.path.lexists(stale):
                os.remove(stale)
        _prune(moved, os.path.join(out, layer))
    return kept


def split(prefix: str, out: str, epoch: int) -> "dict[str, list[str]]":
    """Move the environment at `prefix` into OUT/<layer>/... and fix every time; returns the plan."""
    prefix = os.path.normpath(prefix)
    conda = os.path.isdir(os.path.join(prefix, "conda-meta"))
    route = CONDA if conda else PIP
    dists = read_conda(prefix) if conda else read_dists(_site(prefix))
    where = plan(dists, route)
    where.update(_take_early(out, dists))
    files, empty = assign(prefix, owners(dists, where), route.unowned)
    made: set[str] = set()
    for layer in route.layers:
        os.makedirs(os.path.join(out, layer), exist_ok=True)
    _move(files, out, made)
    for path in empty:
        _make_parents(path, os.path.join(out, route.layers[0]) + path, made)
    layout = {layer: sorted(d.label for d in dists if where[d.name] == layer) for layer in route.layers}
    for layer, labels in layout.items():
        _write_manifest(prefix, os.path.join(out, layer), layer, labels, made)
    _settle(out, epoch)
    return layout


def _write_manifest(prefix: str, root: str, layer: str, labels: "list[str]", made: "set[str]") -> None:
    """PREFIX/etc/imagefactory/layers/<layer>.txt in the layer: the packages it holds, one a line.
    No layer is ever empty then: the 20.10 engine's classic builder fails the COPY that follows
    a COPY which changed nothing ("failed to get layer ...: layer does not exist")."""
    _make_parents(prefix, root + prefix, made)
    folder = root + prefix
    for part in ("etc", "imagefactory", "layers"):
        folder = os.path.join(folder, part)
        if not os.path.isdir(folder):
            os.mkdir(folder)
            os.chmod(folder, 0o755)
    with open(os.path.join(folder, layer + ".txt"), "w", encoding="utf-8") as f:
        f.write("".join(label + "\n" for label in labels) or "(no package)\n")
    os.chmod(os.path.join(folder, layer + ".txt"), 0o644)


def _fix_time(path: str, epoch: int) -> None:
    """mtime and atime `epoch`; an entry that has them already is left alone (setting a time on a
    file an earlier step made would copy the whole file into this step's layer)."""
    st = os.lstat(path)
    if st.st_mtime != epoch or st.st_atime != epoch:
        os.utime(path, (epoch, epoch), follow_symlinks=False)


def _settle(out: str, epoch: int) -> None:
    """Every entry below `out` gets mtime (and atime) `epoch`; folders last, deepest first."""
    for root, dirs, names in os.walk(out, topdown=False):
        for name in names + dirs:
            _fix_time(os.path.join(root, name), epoch)
    _fix_time(out, epoch)


def main(argv: "list[str]") -> int:
    if len(argv) != 4 or argv[0] not in ("split", "early") or not re.fullmatch(r"[0-9]{1,12}", argv[3]):
        print("usage: layers.py split|early PREFIX OUT EPOCH", file=sys.stderr)
        return 2
    command, prefix, out, epoch = argv[0], argv[1], argv[2], int(argv[3])
    if command == "early":
        record = early(prefix, out, epoch)
        _write_json(os.path.join(out, EARLY_RECORD), record, epoch)
        for name, (layer, version, _) in sorted(record.items()):
            print("layer %s: %s==%s (early)" % (layer, name, version), file=sys.stderr)
        return 0
    layout = split(prefix, out, epoch)
    _write_json(os.path.join(out, "plan.json"), layout, epoch)
    for layer in layout:
        print("layer %s: %s" % (layer, " ".join(layout[layer]) or "(no package)"), file=sys.stderr)
    return 0


def _write_json(path: str, value: object, epoch: int) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.write("\n")
    os.utime(path, (epoch, epoch))
    os.utime(os.path.dirname(path), (epoch, epoch))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
