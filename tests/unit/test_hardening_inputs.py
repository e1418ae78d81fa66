"""Issue 18, section 3: path inputs (CA files, their globs, the wheelhouse) and the shared
reader helpers. Each rule is broken here and must end as one located, printable line, exit 2."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
from cryptography import x509

from imagefactory.config import cacerts
from imagefactory.files import fsutil
from imagefactory.files import bounded
from imagefactory.files import pem
from imagefactory.files import yamlfile
from imagefactory.config import matrix
from imagefactory.render import contexts as render
from imagefactory.errors import ConfigError
from tests.conftest import REPO
from tests.unit.helpers import run_cli

BASE = """\
image: registry.example.com/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [openblas]
torch: "2.7.1"
"""
PIP = BASE.replace("blas: [openblas]", "blas: [openblas]\n  installer: [pip]")
CERT = (REPO / "tests" / "golden" / "certs" / "corp-ca.pem").read_text()
KEY_BODY = "MC4CAQAwBQYDK2VwBCIEIBm5nGyGzDNZm0Ql0sm6yAZdLS0rYH/3wNudt2Wv4nsC"  # PKCS#8 Ed25519 key



def refused(tmp_path: Path, text: str, monkeypatch, capsys) -> str:
    """`render` of this matrix exits 2 with one printable, located line; nothing is written."""
    path = tmp_path / "matrix.yaml"
    path.write_text(text)
    code, out, err = run_cli(["render", "--matrix", str(path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2, err
    (line,) = err.splitlines()
    assert line.startswith(f"error: {path}:") and line.isprintable(), line
    assert not (tmp_path / "out").exists()
    return line


# --------------------------------------------------------------------------- PEM scanning

def test_a_megabyte_of_unterminated_begin_lines_is_refused_as_cut_short(tmp_path, monkeypatch, capsys):
    (tmp_path / "ca.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\n" * ((1 << 20) // 28))
    line = refused(tmp_path, BASE + "ca_certificates: [ca.pem]\n", monkeypatch, capsys)
    assert "ca_certificates[0]: " in line and "line 1: the CERTIFICATE block is cut short" in line


def test_the_scan_is_one_pass_over_the_lines():
    """Structural, not timed: every line is looked at once, whatever the mix of boundaries."""
    data = b"-----BEGIN A-----\n" + b"x\n" * 10 + b"-----END A-----\n"
    assert pem.pem_blocks(data * 3) == [("A", b"x" * 10, 1), ("A", b"x" * 10, 13), ("A", b"x" * 10, 25)]
    with pytest.raises(bounded.InputError, match="more than 1000 PEM blocks"):
        pem.pem_blocks(b"-----BEGIN A-----\n-----END A-----\n" * 1001)


@pytest.mark.parametrize("text, words", [
    (CERT.replace("-----END CERTIFICATE-----\n", ""), "the CERTIFICATE block is cut short (no END line)"),
    (CERT.replace("-----END CERTIFICATE-----", "-----END X509 CRL-----"), "is cut short (line"),
    (CERT + "-----BEGIN PRIVATE KEY-----\n" + KEY_BODY + "\n", "holds a private key (PRIVATE KEY)"),
], ids=["cert-cut-short", "wrong-end", "key-cut-short"])
def test_a_block_cut_short_is_refused(tmp_path, monkeypatch, capsys, text, words):
    (tmp_path / "ca.pem").write_text(text)
    assert words in refused(tmp_path, BASE + "ca_certificates: [ca.pem]\n", monkeypatch, capsys)


def test_a_key_labelled_certificate_is_refused(tmp_path, monkeypatch, capsys):
    assert base64.b64decode(KEY_BODY)[0] == 0x30  # DER, as a certificate starts: the old first-byte check passed it
    (tmp_path / "ca.pem").write_text(f"-----BEGIN CERTIFICATE-----\n{KEY_BODY}\n-----END CERTIFICATE-----\n")
    line = refused(tmp_path, BASE + "ca_certificates: [ca.pem]\n", monkeypatch, capsys)
    assert "ca.pem:1: a CERTIFICATE block does not hold an X.509 certificate" in line


def test_what_enters_the_image_is_the_parsed_certificate(tmp_path):
    (tmp_path / "ca.pem").write_text("junk before\n" + CERT.replace("\n", "\r\n") + "junk after\n")
    out = cacerts.certificates(tmp_path / "ca.pem")
    assert x509.load_pem_x509_certificate(out) == x509.load_pem_x509_certificate(CERT.encode())
    assert b"junk" not in out and b"\r" not in out


def test_a_certificate_file_is_parsed_every_time_and_gives_the_same_bytes(tmp_path, monkeypatch):
    """No cache of checked certificates (its saving, cryptography's import, is a few tens of ms):
    the same bytes are parsed again, give the same bytes, and nothing lands in the cache folder."""
    ca = tmp_path / "ca.pem"
    ca.write_text("junk before\n" + CERT)
    first = cacerts.certificates(ca)
    parsed: list[Path] = []
    real = cacerts._parsed_certificates
    monkeypatch.setattr(cacerts, "_parsed_certificates", lambda path, blocks: parsed.append(path) or real(path, blocks))
    assert cacerts.certificates(ca) == first and len(parsed) == 1
    ca.write_text("other junk\n" + CERT)  # other bytes, the same certificate: the same bytes out
    assert cacerts.certificates(ca) == first and len(parsed) == 2
    assert not (tmp_path / "imagefactory-cache").exists()
    key_file = tmp_path / "key.pem"
    key_file.write_text(f"-----BEGIN CERTIFICATE-----\n{KEY_BODY}\n-----END CERTIFICATE-----\n")
    for tries in (1, 2):  # refused every time: a refusal is never remembered
        with pytest.raises(bounded.InputError, match="does not hold an X.509 certificate"):
            cacerts.certificates(key_file)
        assert len(parsed) == 2 + tries


def test_a_certificate_cryptography_re_encodes_otherwise_is_always_parsed(tmp_path, monkeypatch):
    """The replayed bytes are the plain PEM of the file's DER; where cryptography's re-encoding is
    anything else, the file is never remembered, so what enters the image is always cryptography's."""
    ca = tmp_path / "ca.pem"
    ca.write_text(CERT)
    calls: list[Path] = []
    monkeypatch.setattr(cacerts, "_parsed_certificates", lambda path, blocks: calls.append(path) or b"other\n")
    assert cacerts.certificates(ca) == b"other\n" and cacerts.certificates(ca) == b"other\n"
    assert len(calls) == 2


# --------------------------------------------------------------------------- globs

def test_a_glob_that_walks_directories_is_refused(tmp_path, monkeypatch, capsys):
    line = refused(tmp_path, BASE + 'ca_certificates: ["/*/*/*/*/*/*.pem"]\n', monkeypatch, capsys)
    assert "wildcards are allowed only in the file name" in line


def test_a_glob_lists_one_directory(tmp_path, write_matrix):
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "a.pem").write_text(CERT)
    (tmp_path / "certs" / "sub").mkdir()
    (tmp_path / "certs" / "sub" / "b.pem").write_text("not read")
    m = matrix.load(write_matrix(BASE + "ca_certificates: [certs/*.pem]\n"))
    assert m.ca_certificates == ((tmp_path / "certs" / "a.pem").resolve(),)


def test_a_glob_matching_too_many_files_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "certs").mkdir()
    for i in range(pem.MAX_CA_FILES + 1):
        (tmp_path / "certs" / f"{i}.pem").write_text(CERT)
    line = refused(tmp_path, BASE + "ca_certificates: [certs/*.pem]\n", monkeypatch, capsys)
    assert f"matches {pem.MAX_CA_FILES + 1} files, more than {pem.MAX_CA_FILES}" in line


def test_a_matched_name_never_reaches_the_context_or_the_dockerfile(tmp_path, write_matrix):
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "a\nRUN id.pem").write_text(CERT)
    m = matrix.load(write_matrix(BASE + "ca_certificates: [certs/*.pem]\n"))
    (ctx,) = render.render(m, tmp_path / "out")
    assert [p.name for p in (ctx.path / "certs").iterdir()] == ["ca-00.crt"]
    assert "RUN id" not in ctx.dockerfile.read_text()


def test_a_wheel_name_with_a_newline_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.7.1+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")
    (tmp_path / "wheels" / "x\nRUN id-1.0-py3-none-any.whl").write_bytes(b"wheel")
    line = refused(tmp_path, PIP + "pip: {wheelhouse: wheels, torch_index_url: null}\n", monkeypatch, capsys)
    assert "pip.wheelhouse: 'x\\nRUN id-1.0-py3-none-any.whl' is not a wheel or archive file name" in line


# --------------------------------------------------------------------------- link loops

def test_a_ca_file_that_links_to_itself(tmp_path, monkeypatch, capsys):
    (tmp_path / "ca.pem").symlink_to("ca.pem")
    line = refused(tmp_path, BASE + "ca_certificates: [ca.pem]\n", monkeypatch, capsys)
    assert "ca_certificates[0]: " in line and "symbolic link loop" in line


def test_a_wheelhouse_entry_that_links_to_itself(tmp_path, monkeypatch, capsys):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.7.1+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")
    (tmp_path / "wheels" / "loop-1.0-py3-none-any.whl").symlink_to("loop-1.0-py3-none-any.whl")
    line = refused(tmp_path, PIP + "pip: {wheelhouse: wheels, torch_index_url: null}\n", monkeypatch, capsys)
    assert "pip.wheelhouse: loop-1.0-py3-none-any.whl is a symbolic link loop" in line


def test_a_wheelhouse_that_links_to_itself(tmp_path, monkeypatch, capsys):
    (tmp_path / "wheels").symlink_to("wheels")
    line = refused(tmp_path, PIP + "pip: {wheelhouse: wheels, torch_index_url: null}\n", monkeypatch, capsys)
    assert "pip.wheelhouse: is a symbolic link loop" in line


# --------------------------------------------------------------------------- shared helpers

def test_capped_adds_up_what_was_capped_before():
    once = yamlfile.capped([f"p{i}" for i in range(30)])
    assert once[-1] == "10 more problems not shown" and len(once) == 21
    twice = yamlfile.capped(once + ["q\x1b"])
    assert twice[:20] == once[:20] and twice[-1] == "11 more problems not shown"
    assert yamlfile.capped(["a\x1b[2Kb"]) == ["a\\x1b[2Kb"]


def test_sha256_file_and_atomic_write(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    fsutil.atomic_write(path, "{}")
    fsutil.atomic_write(path, b"new", durable=True)
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]
    assert fsutil.sha256_file(path) == "11507a0e2f5e69d5dfa40a62a1bd7b6ee57e6bcd85c67c9b8431b36fff21c437"

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(fsutil.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fsutil.atomic_write(path, "half")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_the_matrix_reader_is_the_shared_one():
    assert matrix._parse is yamlfile.parse_yaml and matrix._read is yamlfile.read_yaml_text
    with pytest.raises(ConfigError, match=re.escape("x.yaml:1: (yaml): nested deeper than 32 levels")):
        yamlfile.parse_yaml("[" * 40, "x.yaml")


def test_the_refused_characters_are_exactly_what_pyyaml_refuses():
    """yamlfile._UNREADABLE names what is refused (its complement compiles 8x faster at import): over
    every code point it must match exactly what PyYAML's reader refuses."""
    import yaml.reader

    pass
    every = "".join(map(chr, range(0x110000)))
    ours = [m.start() for m in yamlfile._UNREADABLE.finditer(every)]
    assert ours == [m.start() for m in yaml.reader.Reader.NON_PRINTABLE.finditer(every)]
    assert len(ours) == 2111
