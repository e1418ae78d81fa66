"""resources/layers.py: the pip environment's layer plan (which distribution, which files, which
layer), run here on a made-up venv; tests/integration/test_layers.py runs it in real builds."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from imagefactory.config import recipe

RESOURCES = Path(recipe.__file__).resolve().parents[1] / "resources"
_spec = importlib.util.spec_from_file_location("layers_under_test", RESOURCES / "layers.py")
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)

EPOCH = recipe.SOURCE_DATE_EPOCH
SITE = "lib/python3.11/site-packages"

# name -> (version, Requires-Dist lines, files below site-packages besides the dist-info)
DISTS = {
    "pip": ("24.0", [], ["pip/__init__.py", "../../../bin/pip"]),
    "nvidia-cublas-cu12": ("12.8.4", [], ["nvidia/cublas/lib/libcublas.so.12"]),
    "nvidia-cudnn-cu12": ("9.10", ["nvidia-cublas-cu12"], ["nvidia/cudnn/lib/libcudnn.so.9"]),
    "torch": ("2.13.0", ["filelock", "sympy>=1.13", "nvidia-cudnn-cu12==9.10; platform_system == 'Linux'",
                         "opt-einsum>=3.3; extra == \"opt-einsum\""],
              ["torch/__init__.py", "torch/lib/libtorch.so", "../../../bin/torchrun"]),
    "filelock": ("3.16", [], ["filelock/__init__.py"]),
    "sympy": ("1.14", ["mpmath"], ["sympy/__init__.py"]),
    "mpmath": ("1.3", [], ["mpmath/__init__.py"]),
    "numpy": ("2.3", [], ["numpy/__init__.py", "numpy.libs/libscipy_openblas64_.so"]),
    "opt-einsum": ("3.4", [], ["opt_einsum/__init__.py"]),
    "six": ("1.17", [], ["six.py"]),
}
WHERE = {"pip": "1-venv", "nvidia-cublas-cu12": "2-cuda", "nvidia-cudnn-cu12": "2-cuda", "torch": "3-torch",
         "filelock": "3-torch", "sympy": "3-torch", "mpmath": "3-torch", "numpy": "4-blas",
         "opt-einsum": "5-packages", "six": "5-packages"}


def make_venv(root: Path, dists: dict = DISTS) -> Path:
    """A venv-shaped tree: links, pyvenv.cfg, an empty folder, and each distribution's files,
    METADATA and RECORD (and a __pycache__ entry for each .py)."""
    venv = root / "opt" / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "include").mkdir()
    site = venv / SITE
    site.mkdir(parents=True)
    (venv / "lib64").symlink_to("lib")
    (venv / "bin" / "python").symlink_to("/usr/local/bin/python3.11")
    (venv / "pyvenv.cfg").write_text("home = /usr/local/bin\n")
    add_dists(venv, dists)
    (site / "stray.py").write_text("# no RECORD lists me\n")
    (venv / "bin" / "imagefactory-tool").write_text("#!/bin/sh\n")
    (venv / "bin" / "imagefactory-tool").chmod(0o750)
    return venv


def add_dists(venv: Path, dists: dict) -> None:
    """Install made-up distributions into the venv: files, METADATA, RECORD, bytecode."""
    site = venv / SITE
    for name, (version, requires, files) in dists.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        meta += [f"Requires-Dist: {r}" for r in requires]
        (info / "METADATA").write_text("\n".join(meta) + "\n\nRequires-Dist: not-a-header\n")
        record = []
        for rel in files:
            path = Path(os.path.normpath(site / rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{name} {rel}\n")
            if path.suffix == ".py":
                (path.parent / "__pycache__").mkdir(exist_ok=True)
                (path.parent / "__pycache__" / f"{path.stem}.cpython-311.pyc").write_bytes(b"pyc")
            record.append(f"{rel},sha256=x,1")
        (info / "INSTALLER").write_text("pip\n")  # listed in no RECORD below: its dist-info's
        (info / "RECORD").write_text("\n".join(record + [f"{info.name}/RECORD,,"]) + "\n")


def split(tmp_path: Path, dists: dict = DISTS) -> tuple[Path, Path, dict]:
    venv = make_venv(tmp_path / "root", dists)
    out = tmp_path / "layers"
    assert layers.main(["split", str(venv), str(out), str(EPOCH)]) == 0
    return venv, out, json.loads((out / "plan.json").read_text())


def listing(out: Path) -> dict[str, set[str]]:
    """layer -> every file and link in it, as a path in the image."""
    return listing_of(out, layers.LAYERS)


def listing_of(out: Path, names: tuple[str, ...]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for layer in names:
        base = out / layer
        found[layer] = {"/" + p.relative_to(base).as_posix() for p in base.rglob("*")
                        if p.is_symlink() or not p.is_dir()}
    return found


def test_layer_names_are_the_ones_the_template_copies():
    assert layers.LAYERS == recipe.VENV_LAYERS


def test_plan_from_the_installed_distributions(tmp_path):
    _, _, plan = split(tmp_path)
    assert {name.split("==")[0]: layer for layer, names in plan.items() for name in names} == WHERE
    assert plan["3-torch"] == ["filelock==3.16", "mpmath==1.3", "sympy==1.14", "torch==2.13.0"]


def test_every_file_lands_in_exactly_one_layer_and_the_venv_is_emptied(tmp_path):
    venv, out, _ = split(tmp_path)
    before = make_venv(tmp_path / "again")
    expected = {"/opt/venv/" + p.relative_to(before).as_posix() for p in before.rglob("*")
                if p.is_symlink() or not p.is_dir()}
    found = listing(out)
    everything = [path for paths in found.values() for path in paths]
    assert len(everything) == len(set(everything))  # no file twice
    manifests = {f"/opt/venv/etc/imagefactory/layers/{layer}.txt" for layer in layers.LAYERS}
    assert {p.replace(str(tmp_path / "root"), "") for p in everything} == expected | manifests
    assert not [p for p in venv.rglob("*") if p.is_symlink() or not p.is_dir()]  # nothing left behind


def test_each_layer_lists_its_packages_in_a_file_of_its_own(tmp_path):
    venv, out, plan = split(tmp_path)
    for layer in layers.LAYERS:
        manifest = out / layer / str(venv).lstrip("/") / "etc" / "imagefactory" / "layers" / f"{layer}.txt"
        assert manifest.read_text().splitlines() == plan[layer]


def test_files_follow_their_distribution_bytecode_its_source(tmp_path):
    _, out, _ = split(tmp_path)
    found = {p.replace(str(tmp_path / "root"), ""): layer for layer, paths in listing(out).items() for p in paths}
    site = "/opt/venv/" + SITE
    assert found[f"{site}/torch/lib/libtorch.so"] == "3-torch"
    assert found[f"{site}/torch/__pycache__/__init__.cpython-311.pyc"] == "3-torch"
    assert found["/opt/venv/bin/torchrun"] == "3-torch"  # a RECORD path outside site-packages
    assert found[f"{site}/nvidia/cudnn/lib/libcudnn.so.9"] == "2-cuda"
    assert found[f"{site}/numpy.libs/libscipy_openblas64_.so"] == "4-blas"
    assert found[f"{site}/six-1.17.dist-info/INSTALLER"] == "5-packages"  # not in RECORD: its dist-info's
    assert found[f"{site}/__pycache__/six.cpython-311.pyc"] == "5-packages"
    for unowned in (f"{site}/stray.py", "/opt/venv/pyvenv.cfg", "/opt/venv/lib64", "/opt/venv/bin/python"):
        assert found[unowned] == "1-venv"


def test_times_modes_and_links_are_settled(tmp_path):
    _, out, _ = split(tmp_path)
    entries = [out, *out.rglob("*")]
    assert {os.lstat(p).st_mtime for p in entries} == {EPOCH}
    venv = out / "1-venv" / str(tmp_path / "root").lstrip("/") / "opt" / "venv"
    assert os.readlink(venv / "lib64") == "lib" and os.readlink(venv / "bin" / "python").endswith("python3.11")
    assert stat.S_IMODE(os.stat(venv / "bin" / "imagefactory-tool").st_mode) == 0o750
    assert (venv / "include").is_dir()  # an empty folder of the venv keeps its place
    # a folder is repeated in each layer with files below it, with the source folder's mode
    for layer in ("3-torch", "5-packages"):
        assert (out / layer / str(tmp_path / "root").lstrip("/") / "opt" / "venv" / SITE).is_dir()


def test_same_packages_same_layer_and_a_moved_package_changes_only_its_layers(tmp_path):
    _, out_a, _ = split(tmp_path / "a")
    _, out_b, _ = split(tmp_path / "b")

    a, b = relative(out_a, tmp_path / "a" / "root"), relative(out_b, tmp_path / "b" / "root")
    assert a == b  # stable: the same install, the same plan and files
    moved = dict(DISTS, torch=(DISTS["torch"][0], DISTS["torch"][1] + ["six"], DISTS["torch"][2]))
    _, out_c, _ = split(tmp_path / "c", moved)  # six becomes a dependency of torch
    c = relative(out_c, tmp_path / "c" / "root")
    changed = {layer for layer in layers.LAYERS if a[layer] != c[layer]}
    assert changed == {"3-torch", "5-packages"}


def test_a_layer_without_packages_still_holds_its_list(tmp_path):
    """Never an empty layer: the 20.10 engine's classic builder fails the COPY after an empty one."""
    venv, out, plan = split(tmp_path, {k: v for k, v in DISTS.items() if not k.startswith("nvidia")
                                       and k != "torch"})
    files = [p for p in (out / "2-cuda").rglob("*") if not p.is_dir()]
    assert [p.relative_to(out / "2-cuda" / str(venv).lstrip("/")).as_posix() for p in files] == \
        ["etc/imagefactory/layers/2-cuda.txt"]
    assert files[0].read_text() == "(no package)\n" and plan["2-cuda"] == []


TORCH_STEP = ("pip", "nvidia-cublas-cu12", "nvidia-cudnn-cu12", "torch", "filelock", "sympy", "mpmath")


def two_steps(root: Path, later: dict) -> tuple[Path, Path, dict]:
    """The classic route: torch's step (torch and what it needs), `early`; then the rest, `split`."""
    venv = make_venv(root / "root", {k: v for k, v in DISTS.items() if k in TORCH_STEP})
    out = root / "layers"
    assert layers.main(["early", str(venv), str(out), str(EPOCH)]) == 0
    add_dists(venv, later)
    assert layers.main(["split", str(venv), str(out), str(EPOCH)]) == 0
    return venv, out, json.loads((out / "plan.json").read_text())


def relative(out: Path, root: Path) -> dict[str, set[str]]:
    return {k: {p.replace(str(root), "") for p in v} for k, v in listing(out).items()}


def test_early_moves_the_cuda_and_torch_files_and_keeps_their_dist_info(tmp_path):
    venv = make_venv(tmp_path / "root", {k: v for k, v in DISTS.items() if k in TORCH_STEP})
    out = tmp_path / "layers"
    assert layers.main(["early", str(venv), str(out), str(EPOCH)]) == 0
    site = venv / SITE
    assert not (site / "torch").exists() and not (site / "nvidia").exists()  # emptied folders go too
    assert (site / "torch-2.13.0.dist-info" / "RECORD").is_file()  # for the next step's pip
    assert (site / "pip" / "__init__.py").is_file() and (venv / "include").is_dir()  # not early's
    found = relative(out, tmp_path / "root")
    assert f"/opt/venv/{SITE}/torch/lib/libtorch.so" in found["3-torch"]
    assert f"/opt/venv/{SITE}/nvidia/cudnn/lib/libcudnn.so.9" in found["2-cuda"]
    assert not found["1-venv"] and not found["4-blas"] and not found["5-packages"]
    record = json.loads((out / layers.EARLY_RECORD).read_text())
    assert {name: entry[:2] for name, entry in record.items()} == {
        "nvidia-cublas-cu12": ["2-cuda", "12.8.4"], "nvidia-cudnn-cu12": ["2-cuda", "9.10"],
        "torch": ["3-torch", "2.13.0"], "filelock": ["3-torch", "3.16"], "sympy": ["3-torch", "1.14"],
        "mpmath": ["3-torch", "1.3"]}


def test_two_steps_give_the_layers_of_one(tmp_path):
    _, out_one, plan_one = split(tmp_path / "one")
    _, out_two, plan_two = two_steps(tmp_path / "two", {k: v for k, v in DISTS.items() if k not in TORCH_STEP})
    assert relative(out_two, tmp_path / "two" / "root") == relative(out_one, tmp_path / "one" / "root")
    assert plan_two == plan_one and not (out_two / layers.EARLY_RECORD).exists()
    assert {os.lstat(p).st_mtime for p in [out_two, *out_two.rglob("*")]} == {EPOCH}


def test_split_leaves_the_times_early_fixed_alone(tmp_path, monkeypatch):
    """Setting a time on a file the torch step made would copy it into the next step's layer
    (a folder is copied without its files: walking it may have moved its atime, it is set again)."""
    venv = make_venv(tmp_path / "root", {k: v for k, v in DISTS.items() if k in TORCH_STEP})
    out = tmp_path / "layers"
    assert layers.main(["early", str(venv), str(out), str(EPOCH)]) == 0
    touched: list[str] = []
    real = os.utime
    monkeypatch.setattr(layers.os, "utime", lambda path, *a, **k: (touched.append(str(path)), real(path, *a, **k)))
    assert layers.main(["split", str(venv), str(out), str(EPOCH)]) == 0
    files = [p for p in touched if os.path.islink(p) or not os.path.isdir(p)]
    assert files and not [p for p in files if "/torch/" in p or "/nvidia/" in p]


def test_a_distribution_pip_replaced_after_early_leaves_no_file_behind(tmp_path):
    venv = make_venv(tmp_path / "root", {k: v for k, v in DISTS.items() if k in TORCH_STEP})
    out = tmp_path / "layers"
    assert layers.main(["early", str(venv), str(out), str(EPOCH)]) == 0
    site = venv / SITE
    shutil.rmtree(site / "sympy-1.14.dist-info")  # pip uninstalls sympy 1.14 (its files are gone already)
    add_dists(venv, {"sympy": ("1.12", ["mpmath"], ["sympy/core.py"])})
    assert layers.main(["split", str(venv), str(out), str(EPOCH)]) == 0
    found = relative(out, tmp_path / "root")
    torch_layer = {p.rsplit(SITE + "/", 1)[-1] for p in found["3-torch"]}
    assert "sympy/core.py" in torch_layer and "sympy-1.12.dist-info/METADATA" in torch_layer
    assert "sympy/__init__.py" not in torch_layer and "sympy/__pycache__/__init__.cpython-311.pyc" not in torch_layer
    assert "torch/lib/libtorch.so" in torch_layer  # what is still installed stays


@pytest.mark.parametrize("argv", [[], ["split", "a", "b"], ["split", "a", "b", "1; rm"], ["join", "a", "b", "1"],
                                  ["early", "a", "b", "x"]])
def test_bad_arguments_are_refused(argv, capsys):
    assert layers.main(argv) == 2
    assert "usage" in capsys.readouterr().err


# The conda route: conda-meta records. name -> (version, depends, files below the prefix)
CONDA = {
    "python": ("3.11.7", ["libgcc >=13", "openssl >=3.0", "__glibc >=2.17"],
               ["bin/python3.11", "lib/python3.11/os.py", "lib/libpython3.11.so.1.0"]),
    "libgcc": ("15.1.0", ["_openmp_mutex >=4.5"], ["lib/libgcc_s.so.1"]),
    "openssl": ("3.5.0", ["ca-certificates"], ["lib/libssl.so.3"]),
    "ca-certificates": ("2026.1.1", [], ["ssl/cacert.pem"]),
    "_openmp_mutex": ("4.5", ["llvm-openmp >=9"], ["lib/libgomp.so.1"]),
    "llvm-openmp": ("20.1.0", [], ["lib/libomp.so"]),
    "mkl": ("2024.2.2", ["llvm-openmp", "tbb 2021.*"], ["lib/libmkl_rt.so.2"]),
    "tbb": ("2021.13.0", ["libgcc"], ["lib/libtbb.so.12"]),
    "libblas": ("3.9.0", ["mkl >=2024"], ["lib/libblas.so.3"]),
    "libcblas": ("3.9.0", ["libblas 3.9.0"], ["lib/libcblas.so.3"]),
    "liblapack": ("3.9.0", ["libblas 3.9.0"], ["lib/liblapack.so.3"]),
    "numpy": ("2.3.1", ["python >=3.11", "libblas >=3.9", "libcblas", "liblapack"],
              ["lib/python3.11/site-packages/numpy/__init__.py"]),
    "cuda-version": ("12.9", [], []),
    "cuda-cudart": ("12.9.79", ["cuda-version 12.9.*", "libgcc"], ["lib/libcudart.so.12"]),
    "libcublas": ("12.9.1", ["cuda-version 12.9.*", "cuda-nvrtc"], ["lib/libcublas.so.12"]),
    "cuda-nvrtc": ("12.9.86", ["cuda-version 12.9.*"], ["lib/libnvrtc.so.12"]),
    "libtorch": ("2.13.0", ["libblas", "mkl", "libgcc", "libcublas", "sleef"], ["lib/libtorch_cpu.so"]),
    "sleef": ("3.8", [], ["lib/libsleef.so.3"]),
    "pytorch": ("2.13.0", ["python", "libtorch 2.13.0", "sympy", "filelock", "numpy"],
                ["lib/python3.11/site-packages/torch/__init__.py"]),
    "sympy": ("1.14", ["mpmath", "python"], ["lib/python3.11/site-packages/sympy/__init__.py"]),
    "mpmath": ("1.3", [], ["lib/python3.11/site-packages/mpmath/__init__.py"]),
    "filelock": ("3.16", [], ["lib/python3.11/site-packages/filelock/__init__.py"]),
    "six": ("1.17", ["python"], ["lib/python3.11/site-packages/six.py"]),
}
CONDA_WHERE = {
    "1-python": {"python", "libgcc", "openssl", "ca-certificates"},
    "2-cuda": {"cuda-version", "cuda-cudart", "libcublas", "cuda-nvrtc"},
    "3-blas": {"_openmp_mutex", "llvm-openmp", "mkl", "tbb", "libblas", "libcblas", "liblapack", "numpy"},
    "4-torch": {"libtorch", "sleef", "pytorch", "sympy", "mpmath", "filelock"},
    "5-packages": {"six"},
}


def make_conda_env(root: Path, packages: dict = CONDA, history: str = "# cmd: conda create\n") -> Path:
    """A conda prefix: each package's files and its conda-meta record, plus history and pinned."""
    prefix = root / "opt" / "env"
    meta = prefix / "conda-meta"
    meta.mkdir(parents=True)
    for name, (version, depends, files) in packages.items():
        for rel in files:
            (prefix / rel).parent.mkdir(parents=True, exist_ok=True)
            (prefix / rel).write_text(f"{name} {rel}\n")
            if rel.endswith(".py"):
                cache = (prefix / rel).parent / "__pycache__"
                cache.mkdir(exist_ok=True)
                (cache / f"{Path(rel).stem}.cpython-311.pyc").write_bytes(b"pyc")
        record = {"name": name, "version": version, "build": "h0_0", "depends": depends, "files": files}
        (meta / f"{name}-{version}-h0_0.json").write_text(json.dumps(record))
    (meta / "history").write_text(history)
    (meta / "pinned").write_text("libblas=*=*mkl\n")
    return prefix


def conda_split(root: Path, packages: dict = CONDA, history: str = "# cmd: conda create\n") -> tuple[Path, dict]:
    prefix = make_conda_env(root / "root", packages, history)
    out = root / "layers"
    assert layers.main(["split", str(prefix), str(out), str(EPOCH)]) == 0
    return out, json.loads((out / "plan.json").read_text())


def test_conda_layer_names_are_the_ones_the_template_copies():
    assert layers.CONDA_LAYERS == recipe.CONDA_LAYERS


def test_conda_plan_from_the_records_blas_before_torch_and_seeds_kept_for_their_layer(tmp_path):
    """libgcc needs _openmp_mutex and conda's torch needs the BLAS: neither closure takes them."""
    _, plan = conda_split(tmp_path)
    assert {layer: {label.split("=")[0] for label in labels} for layer, labels in plan.items()} == CONDA_WHERE
    assert "numpy=2.3.1=h0_0" in plan["3-blas"]


def test_conda_files_go_with_their_record_and_the_history_goes_last(tmp_path):
    out, _ = conda_split(tmp_path)
    listed = listing_of(out, layers.CONDA_LAYERS)
    everything = [p for paths in listed.values() for p in paths]
    assert len(everything) == len(set(everything))  # no file twice
    found = {p.replace(str(tmp_path / "root"), ""): layer for layer, paths in listed.items() for p in paths}
    env = "/opt/env"
    assert found[f"{env}/lib/libpython3.11.so.1.0"] == "1-python"
    assert found[f"{env}/lib/python3.11/__pycache__/os.cpython-311.pyc"] == "1-python"
    assert found[f"{env}/lib/libgomp.so.1"] == "3-blas" and found[f"{env}/lib/libmkl_rt.so.2"] == "3-blas"
    assert found[f"{env}/lib/libcublas.so.12"] == "2-cuda"
    assert found[f"{env}/lib/python3.11/site-packages/torch/__init__.py"] == "4-torch"
    assert found[f"{env}/conda-meta/pytorch-2.13.0-h0_0.json"] == "4-torch"
    # history and pinned name the cell's specs: they would make the first layer differ between cells
    assert found[f"{env}/conda-meta/history"] == found[f"{env}/conda-meta/pinned"] == "5-packages"
    assert {os.lstat(p).st_mtime for p in [out, *out.rglob("*")]} == {EPOCH}


def test_conda_cells_with_other_specs_share_all_but_the_last_layer(tmp_path):
    _, _ = conda_split(tmp_path / "a")
    extra = dict(CONDA, einops=("0.8", ["python"], ["lib/python3.11/site-packages/einops/__init__.py"]))
    conda_split(tmp_path / "b", extra, history="# cmd: conda create einops\n")
    a = {k: {p.replace(str(tmp_path / "a" / "root"), "") for p in v}
         for k, v in listing_of(tmp_path / "a" / "layers", layers.CONDA_LAYERS).items()}
    b = {k: {p.replace(str(tmp_path / "b" / "root"), "") for p in v}
         for k, v in listing_of(tmp_path / "b" / "layers", layers.CONDA_LAYERS).items()}
    assert {layer for layer in layers.CONDA_LAYERS if a[layer] != b[layer]} == {"5-packages"}
