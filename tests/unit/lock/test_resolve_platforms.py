"""Locking a pip cell for another target than this host (issue 23): uv resolves with the target's
markers, pip picks the one file of each pin. The index is a PEP 503 page tree served on loopback,
its wheels written here, whose metadata carries the markers that decide:

    torch 2.10.0 requires  foo ; platform_machine == "x86_64"
                           bar ; platform_machine == "aarch64"
                           baz ; python_version >= "3.12"

so an aarch64 lock must have bar and not foo, an x86_64 lock the reverse, and a py3.12 lock baz
(pip's own resolver judges all three against the interpreter running it)."""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import os
import stat
import threading
import zipfile
from pathlib import Path

import pytest

from imagefactory.lock import resolve
from imagefactory.lock import lockfile
from imagefactory.config import matrix
from imagefactory.config import platforms
from imagefactory.errors import ConfigError
from imagefactory.config.model import Cell, Matrix

pytest.importorskip("uv")

TORCH_DEPS = ('foo ; platform_machine == "x86_64"', 'bar ; platform_machine == "aarch64"',
              'baz ; python_version >= "3.12"')
ARM, AMD, AMD312 = "py3.11-cpu-openblas-pip-arm64", "py3.11-cpu-openblas-pip", "py3.12-cpu-openblas-pip"


def wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any", requires: tuple[str, ...] = ()) -> Path:
    """A wheel written by hand: METADATA (with Requires-Dist), WHEEL, RECORD."""
    stem = name.replace("-", "_")
    dist = f"{stem}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n"
                                                                                    for r in requires)
    files = {f"{stem}/__init__.py": b"", f"{dist}/METADATA": meta.encode(),
             f"{dist}/WHEEL": f"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: false\nTag: {tag}\n".encode()}
    record = [f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b'=').decode()},{len(v)}"
              for k, v in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{stem}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def simple_index(root: Path, wheels: list[Path]) -> None:
    """root/simple/<name>/index.html, one link per wheel with its sha256 (PEP 503)."""
    by_name: dict[str, list[Path]] = {}
    for w in wheels:
        by_name.setdefault(lockfile.canonical(w.name.split("-")[0]), []).append(w)
    for name, files in by_name.items():
        page = root / "simple" / name
        page.mkdir(parents=True)
        links = "".join(f'<a href="../../files/{w.name}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
                        f"{w.name}</a>\n" for w in files)
        (page / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """(index URL, wheelhouse): foo, bar, baz, numpy and threadpoolctl on the index; torch for
    each arch in the wheelhouse (a CPU amd64 cell without a torch index takes its +cpu wheel there)."""
    root = tmp_path_factory.mktemp("index")
    (root / "files").mkdir()
    served = [wheel(root / "files", n, v) for n, v in
              (("foo", "1.0"), ("bar", "1.0"), ("baz", "1.0"), ("numpy", "2.0.0"), ("threadpoolctl", "3.5.0"))]
    simple_index(root, served)
    house = root / "wheelhouse"
    house.mkdir()
    wheel(house, "torch", "2.10.0+cpu", "py3-none-manylinux_2_28_x86_64", TORCH_DEPS)
    wheel(house, "torch", "2.10.0", "py3-none-manylinux_2_28_aarch64", TORCH_DEPS)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple", house
    server.shutdown()


@pytest.fixture(scope="module")
def locked(index, tmp_path_factory):
    """The matrix's cells locked once: py3.11 for both platforms, py3.12 for amd64."""
    tmp_path = tmp_path_factory.mktemp("locked")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))  # kept: it says where, not what
        env.setenv("UV_INDEX_URL", "https://pypi.org/simple")  # dropped: the matrix's indexes only
        env.setenv("UV_FIND_LINKS", str(tmp_path))
        return _lock_all(tmp_path, *index)


def _lock_all(tmp_path: Path, url: str, house: Path):
    (tmp_path / "matrix.yaml").write_text(f"""\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
  installer: [pip]
  platform: [linux/amd64, linux/arm64]
  include:
    - {{python: "3.12", cuda: "none", blas: openblas, installer: pip, platform: linux/amd64}}
torch: "2.10.0"
pip: {{torch_index_url: null, index_url: "{url}", wheelhouse: "{house}"}}
""")
    m = matrix.load(tmp_path / "matrix.yaml")
    resolve.lock(m, list(m.cells), resolve.Options(), say=lambda _: None)
    return m, {c.id: lockfile.load(m, c) for c in m.cells}


def _names(found: lockfile.Lock | None) -> set[str]:
    assert found is not None
    return {p.name for p in found.pins}


def test_the_aarch64_lock_follows_aarch64_markers_and_the_x86_64_lock_x86_64_markers(locked):
    m, locks = locked
    assert _names(locks[ARM]) == {"torch", "bar", "numpy", "threadpoolctl"}
    assert _names(locks[AMD]) == {"torch", "foo", "numpy", "threadpoolctl"}
    assert _names(locks[AMD312]) == {"torch", "foo", "baz", "numpy", "threadpoolctl"}  # python_version >= 3.12


def test_the_aarch64_lock_pins_the_aarch64_wheel_and_names_its_resolver_and_platform(locked, index):
    m, locks = locked
    arm = locks[ARM]
    assert arm is not None
    torch = next(p for p in arm.pins if p.name == "torch")
    house = index[1]
    assert torch.version == "2.10.0" and torch.hashes == (
        hashlib.sha256((house / "torch-2.10.0-py3-none-manylinux_2_28_aarch64.whl").read_bytes()).hexdigest(),)
    assert (arm.input("platform") or ("",))[0] == "cp311 manylinux_2_28_aarch64"
    resolver = next(line for line in arm.text.splitlines() if line.startswith("# resolver: "))
    assert resolver.startswith("# resolver: uv ") and "--python-platform aarch64-manylinux_2_28" in resolver
    assert "files picked by pip" in resolver
    amd = locks[AMD]
    assert amd is not None
    assert next(p for p in amd.pins if p.name == "torch").version == "2.10.0+cpu"
    expected = "pip " if resolve.host_is_target(m.cell(AMD)) else "uv "  # pip only where this host is the target
    assert f"# resolver: {expected}" in amd.text


# --------------------------------------------------------------------------- which resolver

def _cell(platform: platforms.Platform, python: str = "3.11", packages: tuple[str, ...] = ()) -> Cell:
    return Cell(python=python, cuda=None, blas="openblas", installer="pip", torch="2.10.0", threads=2,
                base_image="python:3.11-slim-bookworm", platform=platform, packages=packages)


@pytest.mark.parametrize("platform,machine,python,want", [
    (platforms.AMD64, "x86_64", "3.11", True), (platforms.ARM64, "x86_64", "3.11", False),
    (platforms.AMD64, "aarch64", "3.11", False), (platforms.ARM64, "aarch64", "3.11", True),
    (platforms.AMD64, "x86_64", "3.12", False), (platforms.AMD64, "riscv64", "3.11", False),
])
def test_pip_resolves_only_where_this_host_is_the_target(platform, machine, python, want):
    assert resolve.host_is_target(_cell(platform, python), machine=machine, python="3.11") is want


def test_uv_command_targets_the_cell_with_the_matrixs_indexes_only(tmp_path, monkeypatch):
    m = Matrix(path=tmp_path / "matrix.yaml", image="r.example.com/ml/train", cells=(_cell(platforms.ARM64),))
    cmd = resolve.uv_command("uv", m, m.cells[0], tmp_path / "r.in", tmp_path / "o.txt", tmp_path / "c.txt")
    joined = " ".join(cmd)
    for part in ("pip compile --no-config", "--generate-hashes", "--python-platform aarch64-manylinux_2_28",
                 "--python-version 3.11", "--only-binary :all:", "--index-strategy unsafe-best-match",
                 "--index-url https://pypi.org/simple", f"--constraint {tmp_path / 'c.txt'}"):
        assert part in joined, part
    assert cmd.count("--extra-index-url") == 1 and "--extra-index-url https://download.pytorch.org/whl/cpu" in joined
    assert "--find-links" not in cmd and cmd[-3:] == ["--output-file", str(tmp_path / "o.txt"), str(tmp_path / "r.in")]
    for name in ("UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS", "UV_CONSTRAINT", "UV_TORCH_BACKEND"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("UV_HTTP_TIMEOUT", "60")
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv("PIP_CERT", "/etc/ssl/certs/ca.pem")
    env = resolve._uv_env()
    assert not {"UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS", "UV_CONSTRAINT", "UV_TORCH_BACKEND"} & set(env)
    assert env["UV_HTTP_TIMEOUT"] == "60" and env["UV_NO_CONFIG"] == "1" and env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca.pem"


@pytest.mark.parametrize("spec", ["scipy -r /etc/passwd", "scipy #x", "scipy\n--index-url https://evil", "-e ."])
def test_a_requirement_that_a_requirements_file_would_read_as_an_option_is_refused(tmp_path, spec):
    cell = _cell(platforms.ARM64, packages=(spec,))
    m = Matrix(path=tmp_path / "matrix.yaml", image="r.example.com/ml/train", cells=(cell,))
    with pytest.raises(ConfigError, match=f"cell {cell.id}: requirement .* cannot be locked"):
        resolve._requirements(m, cell)
    ok = _cell(platforms.ARM64, packages=('scipy>=1.11 ; python_version >= "3.10"', "Pillow[avif]==11.0"))
    assert resolve._requirements(m, ok).splitlines()[-2:] == list(ok.packages)


# --------------------------------------------------------------------------- uv failing, hanging, lying

def _fake_uv(tmp_path: Path, monkeypatch, script: str) -> None:
    exe = tmp_path / "uv"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(resolve, "_uv_binary", lambda cell: str(exe))


def _arm_matrix(tmp_path: Path) -> Matrix:
    return Matrix(path=tmp_path / "matrix.yaml", image="r.example.com/ml/train", cells=(_cell(platforms.ARM64),))


def test_uv_failing_is_one_escaped_line_naming_the_cell(tmp_path, monkeypatch):
    _fake_uv(tmp_path, monkeypatch, "printf 'noise\\n\\033[2Jx: no solution for torch==2.10.0\\n' >&2; exit 1\n")
    m = _arm_matrix(tmp_path)
    with pytest.raises(resolve.ResolveError) as e:
        resolve.resolve(m, m.cells[0], {})
    assert e.value.message.startswith(f"cell {m.cells[0].id}: uv could not resolve: noise | ")
    assert "\x1b" not in e.value.message and "\\x1b[2J" in e.value.message and "\n" not in e.value.message


def test_uv_hanging_is_stopped(tmp_path, monkeypatch):
    _fake_uv(tmp_path, monkeypatch, "sleep 30\n")
    monkeypatch.setattr(resolve, "RESOLVE_TIMEOUT", 0.5)
    m = _arm_matrix(tmp_path)
    with pytest.raises(resolve.ResolveError, match=f"cell {m.cells[0].id}: uv did not finish within 0 s"):
        resolve.resolve(m, m.cells[0], {})


def test_uv_answering_anything_but_pins_is_refused(tmp_path, monkeypatch):
    # the last two arguments are --output-file OUT and the requirements file
    body = "torch==2.10.0 \\\\\n    --hash=sha256:" + "a" * 64 + "\\n--index-url https://evil.example/simple\\n"
    _fake_uv(tmp_path, monkeypatch, f'eval out=\\${{$(($# - 1))}}; printf "{body}" > "$out"\n')
    m = _arm_matrix(tmp_path)
    with pytest.raises(resolve.ResolveError, match="uv printed 1 line.* first line 3: '--index-url https://evil"):
        resolve.resolve(m, m.cells[0], {})


def test_uv_missing_is_a_resolve_error_naming_the_cell(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "uv", None)  # `import uv` raises ImportError
    with pytest.raises(resolve.ResolveError, match="cell py3.11-cpu-openblas-pip-arm64: locking for linux/arm64 "
                                                "Python 3.11 needs uv"):
        resolve._uv_binary(_cell(platforms.ARM64))
    assert os.environ.get("UV_NO_CONFIG") is None  # the host's env is never changed, only the child's


def test_pips_pick_must_be_one_of_uvs_files_and_cover_uvs_pins_exactly():
    resolved = [lockfile.Pin("torch", "2.10.0", ("a" * 64, "b" * 64), 1), lockfile.Pin("bar", "1.0", ("c" * 64,), 2)]
    cell = _cell(platforms.ARM64)
    resolve._agree([("bar", "1.0", "c" * 64), ("torch", "2.10.0", "b" * 64)], resolved, cell)
    for picked, why in ([[("bar", "1.0", "c" * 64), ("torch", "2.10.0", "d" * 64)], "pip picked torch 2.10.0"],
                        [[("bar", "1.0.1", "c" * 64), ("torch", "2.10.0", "a" * 64)], "pip picked bar 1.0.1"],
                        [[("torch", "2.10.0", "a" * 64)], "pip found no file for bar"],
                        [[("bar", "1.0", "c" * 64), ("torch", "2.10.0", "a" * 64), ("foo", "1", "e" * 64)],
                         "pip picked foo 1"]):
        with pytest.raises(resolve.ResolveError, match=why):
            resolve._agree(picked, resolved, cell)
