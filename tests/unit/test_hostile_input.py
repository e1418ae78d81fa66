"""Hostile and careless matrix files, through the command line: each ends in exit 2 with one
located line (`FILE:LINE: key.path: message`), and nothing is written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from imagefactory.config import matrix
from imagefactory.render import contexts as render
from tests.unit.helpers import run_cli

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
BASE = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
torch: "2.7.1"
"""
TWO_CELLS = BASE.replace("blas: [openblas]", "blas: [openblas, mkl]")
PIP = BASE.replace("blas: [openblas]", "blas: [openblas]\n  installer: [pip]")
DIGEST = "sha256:" + "ab" * 32
CERT = (GOLDEN / "certs" / "corp-ca.pem").read_text()
KEY = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIBm5nGyGzDNZm0Ql0sm6yAZdLS0rYH/3wNudt2Wv4nsC\n-----END PRIVATE KEY-----\n"


def _billion_laughs() -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def _fifo(name: str) -> Callable[[Path], None]:
    return lambda d: os.mkfifo(d / name)


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(text)


def _outside_link(d: Path) -> None:
    (d / "wheels").mkdir()
    (d / "wheels" / "torch-2.7.1+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel bytes")
    (d / "secret").write_text("root:x:0:0\n")
    (d / "wheels" / "shadow-1.0-py3-none-any.whl").symlink_to(d / "secret")


@dataclass(frozen=True)
class Case:
    id: str
    text: str | bytes  # the whole file
    line: int
    key: str
    words: tuple[str, ...]
    setup: Callable[[Path], None] | None = None


CASES = [
    # Patterns anchored with $ let a final newline through; whole values are checked now.
    Case("python-newline", BASE.replace('["3.11"]', '["3.11\\n"]'), 3, "matrix.python[0]", ("control character \\n",)),
    Case("cuda-newline", BASE.replace('["none"]', '["12.6\\n"]'), 4, "matrix.cuda[0]", ("\\n",)),
    Case("torch-newline", BASE.replace('"2.7.1"', '"2.7.1\\n"'), 6, "torch", ("control character \\n",)),
    Case("package-newline", BASE + 'packages: ["scipy\\n"]\n', 7, "packages[0]", ("control character \\n",)),
    Case("image-newline", BASE.replace("image: registry.example.com/ml/train",
                                       'image: "registry.example.com/ml/train\\n"'), 1, "image", ("\\n",)),
    Case("env-value-newline", BASE + 'env: {FOO: "bar\\nRUN id"}\n', 7, "env.FOO", ("control character \\n",)),
    Case("user-newline", BASE + 'user: {name: "trainer\\n"}\n', 7, "user.name", ("\\n",)),
    Case("channel-newline", BASE + 'conda: {channels: ["conda-forge\\n"]}\n', 7, "conda.channels[0]", ("\\n",)),
    Case("template-newline", BASE + 'tags: {template: "{image}:x\\n"}\n', 7, "tags.template", ("\\n",)),
    # Keys that are not text.
    Case("env-int-key", BASE + "env: {42: x}\n", 7, "env.42", ("read as a number", "quote it")),
    Case("label-bool-key", BASE + "labels: {true: x}\n", 7, "labels.true", ("read as true/false",)),
    Case("label-date-key", BASE + "labels: {2024-01-01: x}\n", 7, "labels.2024-01-01", ("read as a date",)),
    Case("top-null-key", BASE + "null: b\n", 7, "null", ("read as null",)),
    Case("axis-int-key", BASE.replace("  blas: [openblas]", "  blas: [openblas]\n  3: x"), 6, "matrix.3",
         ("read as a number",)),
    Case("complex-key", BASE + "? [a, b]\n: c\n", 7, "(top level)", ("must be text",)),
    # Resource exhaustion.
    Case("alias-bomb", BASE + _billion_laughs(), 8, "(yaml)", ("aliases expand the document",)),
    Case("nested-flow", BASE + "x: " + "[" * 500 + "\n", 7, "(yaml)", ("nested deeper than",)),
    Case("nested-block", BASE + "".join(f"{' ' * i}k{i}:\n" for i in range(40)), 39, "(yaml)", ("nested deeper",)),
    Case("many-values", BASE + "x: [" + "1," * 25000 + "1]\n", 7, "(yaml)", ("more than 20000 values",)),
    # Types.
    Case("threads-float", BASE + "threads: 4.0\n", 7, "threads", ("a thread count, or auto, got float",)),
    Case("uid-float", BASE + "user: {uid: 1000.0}\n", 7, "user.uid", ("expected integer, got float",)),
    Case("threads-bool", BASE + "threads: true\n", 7, "threads", ("a thread count, or auto, got bool",)),
    Case("python-float", BASE.replace('["3.11"]', "[3.10]"), 3, "matrix.python[0]", ('write "3.10"',)),
    Case("python-3.1", BASE.replace('["3.11"]', '["3.1"]'), 3, "matrix.python[0]", ("'3.1' is not allowed",)),
    Case("python-3.99", BASE.replace('["3.11"]', '["3.99"]'), 3, "matrix.python[0]", ("'3.99' is not allowed",)),
    Case("torch-date", BASE.replace('"2.7.1"', "2024-01-01"), 6, "torch", ("expected string, got date",)),
    Case("template-lone-open", BASE + 'tags: {template: "{image}:{"}\n', 7, "tags.template", ("braces only",)),
    Case("template-lone-close", BASE + 'tags: {template: "{image}:x}"}\n', 7, "tags.template", ("braces only",)),
    Case("template-positional", BASE + 'tags: {template: "{image}:{0}"}\n', 7, "tags.template", ("unknown field",)),
    # Tags shared by two cells would overwrite each other on push.
    Case("same-release-tag", TWO_CELLS + 'tags: {template: "{image}:latest"}\n', 7, "tags.template",
         ("would both be tagged",)),
    Case("same-hash-tag", TWO_CELLS + 'tags: {hash_template: "{image}:fixed"}\n', 7, "tags.hash_template",
         ("with {hash} in it",)),  # refused for lacking the hash, before two cells can share it
    # Credentials in any URL-bearing value.
    Case("conda-installer-creds", BASE + 'conda: {installer_url: "https://u:p@mirror.example.com/x.sh", '
         f'sha256: "{"0" * 64}"}}\n', 7, "conda.installer_url", ("credentials",)),
    Case("conda-channel-creds", BASE + 'conda: {channels: ["https://u:p@conda.example.com/cf"]}\n', 7,
         "conda.channels[0]", ("credentials",)),
    Case("env-url-creds", BASE + 'env: {HF_ENDPOINT: "https://tok@hf.example.com"}\n', 7, "env.HF_ENDPOINT",
         ("credentials",)),
    Case("label-url-creds", BASE + 'labels: {org.example.src: "https://u:p@git.example.com/r"}\n', 7,
         "labels.org.example.src", ("credentials",)),
    Case("include-env-creds", BASE.replace("  blas: [openblas]", '  blas: [openblas]\n  include:\n'
         '    - {blas: openblas, env: {U: "s3://key:secret@bucket"}}'), 7, "matrix.include[0].env.U",
         ("credentials",)),
    Case("pip-extra-index-creds", BASE + 'pip: {extra_index_urls: ["https://u:p@idx.example.com/simple"]}\n', 7,
         "pip.extra_index_urls[0]", ("credentials",)),
    # CA certificates: regular files, certificates only.
    Case("ca-fifo", BASE + "ca_certificates: [ca.pem]\n", 7, "ca_certificates[0]", ("is a FIFO",), _fifo("ca.pem")),
    Case("ca-directory", BASE + "ca_certificates: [ca.pem]\n", 7, "ca_certificates[0]", ("is a directory",),
         lambda d: (d / "ca.pem").mkdir()),
    Case("ca-proc", BASE + "ca_certificates: [/proc/self/environ]\n", 7, "ca_certificates[0]",
         ("pseudo file system",)),
    Case("ca-with-key", BASE + "ca_certificates: [ca.pem]\n", 7, "ca_certificates[0]", ("private key",),
         _write("ca.pem", CERT + KEY)),
    Case("ca-bad-base64", BASE + "ca_certificates: [ca.pem]\n", 7, "ca_certificates[0]", ("base64",),
         _write("ca.pem", "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n")),
    Case("ca-missing", BASE + "ca_certificates: [ca.pem]\n", 7, "ca_certificates[0]", ("file not found",)),
    # Wheelhouse: a link out of it is refused.
    Case("wheel-link-out", PIP + "pip: {wheelhouse: wheels, torch_index_url: null}\n", 8, "pip.wheelhouse",
         ("outside the wheelhouse",), _outside_link),
    # Smaller ones.
    Case("nul-byte", BASE.encode() + b"env: {A: \"x\x00\"}\n", 7, "(yaml)", ("control character \\x00",)),
    Case("not-utf8", BASE.encode() + b"labels: {a: \"caf\xe9\"}\n", 7, "(yaml)", ("byte 0xe9 is not UTF-8",)),
    Case("escape-in-key", BASE + 'env: {"\\e[2K\\rerror: forged": x}\n', 7, "env.\\x1b[2K\\rerror: forged",
         ("control character \\x1b",)),
    Case("escape-in-value", BASE + 'labels: {a: "\\e]0;title\\a"}\n', 7, "labels.a", ("control character \\x1b",)),
    Case("builtin-label", BASE + "labels: {io.imagefactory.cell: fake}\n", 7, "labels.io.imagefactory.cell",
         ("set by imagefactory",)),
    Case("pep508-bang", PIP + "packages: [scipy!1.0]\n", 8, "packages[0]", ("not a pip requirement",)),
    Case("pep508-tilde", PIP + "packages: [pandas~2]\n", 8, "packages[0]", ("not a pip requirement",)),
    Case("pep508-single-eq", PIP + "packages: [requests=2.0]\n", 8, "packages[0]", ("not a pip requirement",)),
    Case("conda-spec-bang", BASE + "packages: [scipy!1.0]\n", 7, "packages[0]", ("not a conda package spec",)),
    Case("base-image-venv", PIP + "base_images: {pip: venv}\n", 8, "base_images.pip", ("build stage",)),
    Case("base-image-bad-digest", BASE + 'base_images: {conda: "debian@sha256:abc"}\n', 7, "base_images.conda",
         ("malformed",)),
    Case("long-image", BASE.replace("ml/train", "a" * 300), 1, "image", ("too long (at most 255)",)),
    Case("long-wheelhouse", PIP + f"pip: {{wheelhouse: {'w' * 300}, torch_index_url: null}}\n", 8, "pip.wheelhouse",
         ("cannot be read: File name too long",)),
    Case("long-ca-name", BASE + f"ca_certificates: [{'c' * 300}.pem]\n", 7, "ca_certificates[0]",
         ("File name too long",)),
    Case("long-value", BASE.replace('"2.7.1"', '"' + "9" * 100_000 + '"'), 6, "torch", ("more characters",)),
]



def assert_one_located_line(err: str, path: Path | str, line: int | None, key: str | None) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    (only,) = lines
    prefix = f"error: {path}:{line}: {key}: " if line is not None else f"error: {path}: "
    assert only.startswith(prefix), (prefix, only)
    assert all(c.isprintable() for c in only), repr(only)
    assert len(only) < 600, len(only)
    return only


@pytest.mark.parametrize("command", ["list", "render"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_exits_2_with_one_located_line_and_writes_nothing(case, command, tmp_path, monkeypatch, capsys):
    path = tmp_path / "matrix.yaml"
    if isinstance(case.text, bytes):
        path.write_bytes(case.text)
    else:
        path.write_text(case.text)
    if case.setup:
        case.setup(tmp_path)
    out = tmp_path / "out"
    args = [command, "--matrix", str(path)] + (["--out", str(out)] if command == "render" else [])
    code, stdout, err = run_cli(args, monkeypatch, capsys)
    assert code == 2, err
    only = assert_one_located_line(err, path, case.line, case.key)
    for word in case.words:
        assert word in only, only
    assert stdout == ""
    assert not out.exists()


def test_cases_are_many_and_distinct():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("setup, words", [
    (lambda p: Path("/dev/zero"), "is a character device, not a regular file"),
    (lambda p: (os.mkfifo(p), p)[1], "is a FIFO (named pipe), not a regular file"),
    (lambda p: (p.mkdir(), p)[1], "is a directory, not a regular file"),
    (lambda p: (p.write_text(BASE + "#" * (matrix.MAX_BYTES + 1)), p)[1], "is larger than"),
], ids=["dev-zero", "fifo", "directory", "too-large"])
def test_matrix_that_is_not_a_small_regular_file(setup, words, tmp_path, monkeypatch, capsys):
    path = setup(tmp_path / "matrix.yaml")
    code, _, err = run_cli(["render", "--matrix", str(path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2
    assert words in assert_one_located_line(err, path, None, None)
    assert not (tmp_path / "out").exists()


def test_dev_zero_through_a_real_process(tmp_path):
    r = subprocess.run([sys.executable, "-m", "imagefactory", "list", "--matrix", "/dev/zero"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and r.stderr == "error: /dev/zero: is a character device, not a regular file\n"


def test_mixed_non_text_keys_are_each_located(write_matrix):
    with pytest.raises(matrix.ConfigError) as e:
        matrix.load(write_matrix(BASE + "1: a\nnull: b\n"))
    assert [p.split(": ", 1)[0].rsplit(":", 1)[-1] for p in e.value.problems] == ["7", "8"]
    assert "1: key '1' is read as a number" in e.value.problems[0]
    assert "null: key 'null' is read as null" in e.value.problems[1]


def test_no_escape_sequence_reaches_the_terminal(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(BASE + 'env: {"\\e[2K\\rerror: all good": x}\n')
    r = subprocess.run([sys.executable, "-m", "imagefactory", "list", "--matrix", str(path)],
                       capture_output=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and b"\x1b" not in r.stderr and b"\r" not in r.stderr
    assert r.stderr.count(b"\n") == 1


@pytest.mark.parametrize("value", ["3.11\n", "12.6\n", "scipy\n", "2.7.1\n", "trainer\n"])
def test_schema_patterns_match_whole_strings(value):
    # Without the walk that refuses control characters: the patterns alone refuse a final newline.
    data = {"image": "r.example.com/ml/t", "torch": "2.7.1", "matrix": {"python": ["3.11"], "cuda": ["none"],
            "blas": ["mkl"]}}
    field = {"3.11\n": ("matrix", "python"), "12.6\n": ("matrix", "cuda"), "scipy\n": ("packages",),
             "2.7.1\n": ("torch",), "trainer\n": ("user", "name")}[value]
    if field[0] == "matrix":
        data["matrix"][field[1]] = [value]
    elif field == ("packages",):
        data["packages"] = [value]
    elif field == ("user", "name"):
        data["user"] = {"name": value}
    else:
        data["torch"] = value
    assert list(matrix.Validator(matrix.schema()).iter_errors(data))
    assert matrix.is_reference("debian:bookworm") and not matrix.is_reference("debian:bookworm\n")


def test_an_alias_is_walked_once_and_a_small_one_still_works(write_matrix):
    m = matrix.load(write_matrix(BASE + "env: &e {ab: x}\nlabels: *e\n"))
    assert dict(m.cells[0].env) == {"ab": "x"} and dict(m.cells[0].labels) == {"ab": "x"}
    problems, size = matrix._structure(yaml.compose(BASE + _billion_laughs()))
    assert problems == [] and size > 9 ** 8  # counted, never walked: the walk visits each node once


def test_condarc_channels_keep_their_type(tmp_path, write_matrix):
    m = matrix.load(write_matrix(BASE + 'conda: {channels: ["null", "yes", "1.5", "conda-forge"]}\n'))
    (ctx,) = render.render(m, tmp_path / "out")
    assert yaml.safe_load((ctx.path / "condarc").read_text())["channels"] == ["null", "yes", "1.5", "conda-forge"]


def test_only_certificate_blocks_enter_the_context(tmp_path, write_matrix):
    crl = "-----BEGIN X509 CRL-----\nMAA=\n-----END X509 CRL-----\n"
    (tmp_path / "ca.pem").write_text("# corporate bundle\n" + CERT + crl + "trailing text\n")
    m = matrix.load(write_matrix(BASE + "ca_certificates: [ca.pem]\n"))
    (ctx,) = render.render(m, tmp_path / "out")
    copied = (ctx.path / "certs" / "ca-00.crt").read_text()
    assert copied.startswith("-----BEGIN CERTIFICATE-----\n") and copied.endswith("-----END CERTIFICATE-----\n")
    assert "corporate" not in copied and "trailing" not in copied and "CRL" not in copied
    assert copied.count("BEGIN") == 1
    # A key added after the matrix was checked is still refused when the context is written.
    (tmp_path / "ca.pem").write_text(CERT + KEY)
    with pytest.raises(matrix.ConfigError, match="private key"):
        render.render(m, tmp_path / "out2")
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
        contexts = [render.render(m, out)[0] for out in outs]
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
        render.render(m, tmp_path / "out")
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
    (ctx,) = render.render(m, tmp_path / "out")
    froms = [line for line in ctx.dockerfile.read_text().splitlines() if line.startswith("FROM ")]
    assert froms and all(line.split()[1] == expected for line in froms)


def test_digest_pinned_cell_in_an_include_entry(write_matrix):
    text = BASE.replace("  blas: [openblas]", f'  blas: [openblas]\n  include:\n    - {{blas: openblas, '
                        f'base_image: "debian:bookworm-slim@{DIGEST}"}}')
    assert matrix.load(write_matrix(text)).cells[0].base_image == f"debian:bookworm-slim@{DIGEST}"

