"""lockfile.py's reading of a lock's lines: each package pinned by one sha256, nothing else.

The judging of a lock against its cell (stale inputs, variants, completeness) is in
test_lock.py and test_hardening_locks.py; the solve that writes conda locks in test_condasolve.py.
"""

from __future__ import annotations

import hashlib

import pytest

from imagefactory.lock import lockfile
from imagefactory.errors import ConfigError

URL = "https://conda.anaconda.org/conda-forge/linux-64/numpy-2.0.2-py311h9cb892a_1.conda"
SHA256 = hashlib.sha256(b"numpy").hexdigest()
MD5 = hashlib.md5(b"numpy").hexdigest()  # 32 hex: what `conda list --explicit --md5` writes


def parse(tmp_path, installer: str, body: str) -> lockfile.Lock:
    path = tmp_path / "lock.txt"
    head = "@EXPLICIT\n" if installer == "conda" else ""
    path.write_text(f"{lockfile.FIRST_LINE}x\n# input cell: x\n{head}{body}")
    return lockfile.parse(path, installer)


def refused(tmp_path, installer: str, body: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse(tmp_path, installer, body)
    return err.value.problems


def test_a_conda_line_with_its_sha256_is_read():
    pin = lockfile.conda_pin(f"{URL}#{SHA256}", 4)
    assert pin is not None and (pin.name, pin.version, pin.build, pin.hashes, pin.url, pin.line) == (
        "numpy", "2.0.2", "py311h9cb892a_1", (SHA256,), URL, 4)


def test_a_conda_line_with_an_md5_is_refused_located_and_named(tmp_path):
    assert lockfile.conda_pin(f"{URL}#{MD5}", 4) is None
    (line,) = refused(tmp_path, "conda", f"{URL}#{MD5}\n")
    assert line.startswith(f"{tmp_path / 'lock.txt'}:4: (lock): malformed line"), line
    assert "is an md5" in line and "sha256" in line


@pytest.mark.parametrize("digest", [SHA256[:-1], SHA256 + "0", SHA256.upper(), MD5 + MD5[:31], "", "sha256:" + SHA256,
                                    MD5 + "0" * 32 + MD5])
def test_a_conda_line_with_anything_but_one_sha256_is_refused(tmp_path, digest):
    assert lockfile.conda_pin(f"{URL}#{digest}", 4) is None
    (line,) = refused(tmp_path, "conda", f"{URL}#{digest}\n")
    assert ":4: (lock): malformed line" in line


@pytest.mark.parametrize("hashes", [f"--hash=sha256:{MD5}", f"--hash=md5:{MD5}", f"--hash=sha256:{SHA256[:-1]}",
                                    f"--hash=sha256:{SHA256.upper()}", f"--hash=sha384:{SHA256}{MD5}"])
def test_a_pip_line_with_anything_but_sha256_hashes_is_refused(tmp_path, hashes):
    (line,) = refused(tmp_path, "pip", f"numpy==2.0.2 {hashes}\n")
    assert ":3: (lock): malformed line" in line


def test_a_pip_line_with_its_sha256_is_read(tmp_path):
    lock = parse(tmp_path, "pip", f"numpy==2.0.2 \\\n    --hash=sha256:{SHA256}\n")
    assert [(p.name, p.version, p.hashes, p.line) for p in lock.pins] == [("numpy", "2.0.2", (SHA256,), 3)]


def test_a_conda_line_before_explicit_is_refused(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text(f"{lockfile.FIRST_LINE}x\n{URL}#{SHA256}\n@EXPLICIT\n")
    with pytest.raises(ConfigError) as err:
        lockfile.parse(path, "conda")
    assert any(":2: (lock): malformed line" in p for p in err.value.problems), err.value.problems
