"""files/pem.py: the PEM scan, bounded and one pass, refusing blocks cut short and keys labelled certificates."""

from __future__ import annotations

import base64
import pytest
from imagefactory.files import bounded
from imagefactory.files import pem
from tests.unit.helpers import render_refused as refused
from tests.unit.helpers import GOLDEN_CERT as CERT, KEY_BODY, ONE_CELL as BASE


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
