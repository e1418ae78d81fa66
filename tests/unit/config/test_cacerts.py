"""config/cacerts.py: the CA files a matrix names, their globs and links, and what of them enters the image."""

from __future__ import annotations

from pathlib import Path
import pytest
from cryptography import x509
from imagefactory.config import cacerts
from imagefactory.files import bounded
from imagefactory.files import pem
from imagefactory.config import matrix
from imagefactory.render import contexts
from tests.conftest import REPO
from tests.unit.helpers import render_refused as refused
from tests.unit.helpers import GOLDEN_CERT as CERT, KEY_BODY, ONE_CELL as BASE


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
    (ctx,) = contexts.render(m, tmp_path / "out")
    assert [p.name for p in (ctx.path / "certs").iterdir()] == ["ca-00.crt"]
    assert "RUN id" not in ctx.dockerfile.read_text()


def test_a_ca_file_that_links_to_itself(tmp_path, monkeypatch, capsys):
    (tmp_path / "ca.pem").symlink_to("ca.pem")
    line = refused(tmp_path, BASE + "ca_certificates: [ca.pem]\n", monkeypatch, capsys)
    assert "ca_certificates[0]: " in line and "symbolic link loop" in line


# -- moved from test_hardening_iii.py ----------------------------------------


def test_a_ca_file_with_a_private_key_whose_begin_line_is_cut_off_is_refused(tmp_path):

    cert = (REPO / "tests" / "golden" / "certs" / "corp-ca.pem").read_text()
    body = "MC4CAQAwBQYDK2VwBCIEIBm5nGyGzDNZm0Ql0sm6yAZdLS0rYH/3wNudt2Wv4nsC"
    (tmp_path / "ca.pem").write_text(cert + body + "\n-----END PRIVATE KEY-----\n")
    with pytest.raises(bounded.InputError, match="private key"):
        cacerts.certificates(tmp_path / "ca.pem")
    (tmp_path / "ca.pem").write_text(cert)
    assert cacerts.certificates(tmp_path / "ca.pem").startswith(b"-----BEGIN CERTIFICATE-----")
