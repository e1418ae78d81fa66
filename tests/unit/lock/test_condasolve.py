"""Conda cells locked without conda: py-rattler solves against a channel's repodata.

The channel here is repodata only (a solve never downloads a package), served over loopback
HTTP like a real channel, with a path that wants a login and one whose repodata is corrupt.
The packages are named and built as conda-forge's are (`libblas 3.9.0 *_mkl`, pytorch
`cpu_mkl_...` and `cpu_generic_...`, `nomkl`), so the cell's own specs and the lock's checks
(lockfile.py) judge the result. The real channel build and the builds from its locks are in
tests/integration/test_conda.py.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import json
import shutil
import threading
from pathlib import Path

import pytest

from imagefactory.lock import condasolve
from imagefactory.lock import resolve
from imagefactory.lock import lockfile
from imagefactory.config import matrix
from imagefactory.errors import ConfigError
from tests.conda_channel.server import QuietServer
from tests.unit import helpers

LOGIN = ("lockuser", "lock-secret-pw")


class _Result:
    def __init__(self, code: int, out: str, err: str):
        self.exit_code, self.output = code, out + err


@pytest.fixture
def run_cli(monkeypatch, capsys):
    def run(*args: str, env: dict[str, str] | None = None) -> _Result:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        return _Result(*helpers.run_cli(list(args), monkeypatch, capsys))
    return run


def _record(name: str, version: str, build: str, depends: list[str], number: int = 0) -> dict:
    return {"name": name, "version": version, "build": build, "build_number": number, "depends": depends,
            "sha256": hashlib.sha256(f"{name}-{version}-{build}".encode()).hexdigest(), "md5": "0" * 32,
            "size": 1000, "subdir": "linux-64", "timestamp": 1760000000000, "license": "BSD-3-Clause"}


def _packages() -> dict[str, dict]:
    py = "python >=3.11,<3.12.0a0"
    recs = [
        _record("python", "3.11.7", "h0_0_cpython", []),
        _record("numpy", "1.24.2", "py311_0", [py, "libblas >=3.9.0,<4.0a0", "liblapack >=3.9.0,<4.0a0"]),
        _record("threadpoolctl", "3.5.0", "pyhd8ed1ab_0", [py]),
        _record("mkl", "2025.3.0", "h0_0", ["intel-openmp", "__glibc >=2.17"]),
        _record("intel-openmp", "2025.3.0", "h0_0", []),
        _record("libopenblas", "0.3.21", "pthreads_h0_0", []),
        _record("nomkl", "1.0", "h5ca1d4c_0", []),
        _record("pytorch", "2.13.0", "cpu_mkl_py311_h1_100", [py, "libblas * *mkl", "mkl"], 100),
        _record("pytorch", "2.13.0", "cpu_generic_py311_h1_0", [py, "nomkl"]),
        _record("pytorch", "2.13.0", "cuda129_mkl_py311_h1_300", [py, "libblas * *mkl", "mkl", "__cuda",
                                                                 "cuda-version >=12.9,<13"], 300),
        _record("cuda-version", "12.9", "h0_3", []),
    ]
    for lib in ("libblas", "libcblas", "liblapack"):
        for blas, dep, number in (("mkl", "mkl", 1), ("openblas", "libopenblas", 0)):
            extra = [] if lib == "libblas" else [f"libblas 3.9.0 *_{blas}"]
            recs.append(_record(lib, "3.9.0", f"{number + 30}_{blas}", [dep, *extra], number))
    return {f"{r['name']}-{r['version']}-{r['build']}.conda": r for r in recs}


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # quiet
        pass

    def do_GET(self):
        if self.path.startswith("/private/"):
            want = "Basic " + base64.b64encode(f"{LOGIN[0]}:{LOGIN[1]}".encode()).decode()
            if self.headers.get("Authorization") != want:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="channel"')
                self.end_headers()
                return
        if self.path.startswith("/corrupt/") and self.path.endswith("repodata.json"):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"packages": [truncated')
            return
        super().do_GET()


@pytest.fixture(scope="module")
def channel_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("channels")
    for name in ("main", "private", "corrupt", "nosha"):
        for subdir, packages in (("linux-64", _packages()), ("noarch", {})):
            if name == "nosha" and packages:  # one record with an md5 only, as older conda repodata has
                del packages["threadpoolctl-3.5.0-pyhd8ed1ab_0.conda"]["sha256"]
            (root / name / subdir).mkdir(parents=True)
            (root / name / subdir / "repodata.json").write_text(json.dumps(
                {"info": {"subdir": subdir}, "packages": {}, "packages.conda": packages}))
    # Its request errors (rattler hanging up on one subdir once the other failed) are logged apart,
    # not printed into the output of the command under test.
    server = QuietServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _project(tmp_path: Path, channel: str, blas: str = "mkl", extra: str = "") -> Path:
    (tmp_path / "matrix.yaml").write_text(f"""\
image: 127.0.0.1:5000/ml/train
matrix:
  python: ["3.11"]
  cuda: ["none"]
  blas: [{blas}]
  installer: [conda]
torch: "2.13.0"
threads: 2
conda:
  version: "0.0.1-0"
  sha256: {"e" * 64}
  installer_url: {channel}/installer.sh
  channels: [{channel}]
{extra}""")
    return tmp_path / "matrix.yaml"


def test_a_conda_cell_is_locked_without_conda_and_its_lock_is_current(channel_server, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no conda (nor anything else) on PATH
    path = _project(tmp_path, f"{channel_server}/main")
    m = matrix.load(path)
    [outcome] = resolve.lock(m, list(m.cells), resolve.Options(), say=lambda _: None)
    assert outcome.status == resolve.WRITTEN
    text = outcome.path.read_text()
    assert "# resolver: py-rattler" in text and "@EXPLICIT" in text
    urls = [line for line in text.splitlines() if line.startswith("http")]
    names = {u.rsplit("/", 1)[1].rsplit("-", 2)[0] for u in urls}
    assert {"python", "numpy", "pytorch", "libblas", "mkl", "threadpoolctl"} <= names
    assert "libopenblas" not in names and "nomkl" not in names
    assert any("/pytorch-2.13.0-cpu_mkl_py311_h1_100.conda#" in u for u in urls)
    assert all(u.startswith(f"{channel_server}/main/linux-64/") for u in urls)
    assert lockfile.load(m, m.cells[0]) is not None  # current: every rule of lockfile.py holds
    assert [o.status for o in resolve.check(m, list(m.cells))] == [resolve.CURRENT]


def test_the_openblas_cell_gets_the_generic_build_and_the_openblas_switch(channel_server, tmp_path):
    m = matrix.load(_project(tmp_path, f"{channel_server}/main", blas="openblas"))
    body, how = resolve.resolve(m, m.cells[0], {})
    assert "pytorch-2.13.0-cpu_generic_py311" in body and "libblas-3.9.0-30_openblas" in body
    assert "_mkl.conda" not in body and "/mkl-" not in body and "nomkl-1.0" in body


def test_a_cuda_cell_solves_with_a_cuda_virtual_package(channel_server):
    specs = ["python=3.11", "pytorch=2.13.0=cuda129*", "cuda-version=12.9", "libblas=*=*mkl"]
    found = condasolve.solve("c", [f"{channel_server}/main"], specs, cuda="12.9")
    assert any(r.build.startswith("cuda129_") for r in found)
    with pytest.raises(condasolve.SolveError, match=r"cannot be satisfied.*__cuda"):
        condasolve.solve("c", [f"{channel_server}/main"], specs, cuda=None)  # a CPU machine's solve


def test_an_unsolvable_cell_is_exit_2_naming_cell_and_conflict_in_one_line(channel_server, tmp_path, run_cli):
    path = _project(tmp_path, f"{channel_server}/main", extra="packages: [scipy]\n")
    r = run_cli("lock", "--matrix", str(path))
    assert r.exit_code == 2
    [line] = r.output.strip().splitlines()[-1:]
    assert "cell py3.11-cpu-mkl-conda:" in line and "scipy" in line and "cannot be satisfied" in line
    assert not (tmp_path / "locks").exists()  # nothing half-written


@pytest.mark.parametrize("where, why", [
    ("corrupt", "repodata is not valid"),
    ("nowhere", "could not be reached"),
    ("private", "refused access"),
])
def test_channel_failures_are_one_located_line_and_write_nothing(channel_server, tmp_path, where, why, run_cli):
    url = f"{channel_server}/{where}" if where != "nowhere" else "http://127.0.0.1:9/conda"
    path = _project(tmp_path, url)
    r = run_cli("lock", "--matrix", str(path), env={"NETRC": "", "HOME": str(tmp_path)})
    assert r.exit_code == 2, r.output
    last = r.output.strip().splitlines()[-1]
    assert "cell py3.11-cpu-mkl-conda:" in last and why in last and url in last
    assert "Traceback" not in r.output
    assert not (tmp_path / "locks").exists()


def test_the_channel_servers_request_errors_stay_out_of_the_output(capsys):
    """A request the handler fails on (as a client hanging up mid-response does) is kept in the
    server's errors, not printed as socketserver's traceback into what the tests above read."""
    import urllib.request

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            raise ConnectionResetError("the client hung up")

    server = QuietServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/x", timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    out, err = capsys.readouterr()
    assert out == err == ""
    assert len(server.errors) == 1 and "ConnectionResetError: the client hung up" in server.errors[0]


def test_a_package_the_channel_gives_no_sha256_is_refused_by_the_solve_naming_it(channel_server, tmp_path, run_cli):
    """rattler answers with sha256 None for a record that has an md5 only; the solve refuses it
    (exit 2, one line naming the package), not the lock writer later."""
    path = _project(tmp_path, f"{channel_server}/nosha")
    r = run_cli("lock", "--matrix", str(path))
    assert r.exit_code == 2, r.output
    [line] = r.output.strip().splitlines()[-1:]
    assert line.startswith("error: cell py3.11-cpu-mkl-conda: the channel gives threadpoolctl 3.5.0 pyhd8ed1ab_0 ("), line
    assert "no sha256" in line and "Traceback" not in r.output
    assert not (tmp_path / "locks").exists()


class _Name:
    def __init__(self, name: str):
        self.normalized = name


class _Found:  # what the solve reads of a rattler RepoDataRecord
    def __init__(self, name: str, sha256: object):
        self.name, self.version, self.build, self.sha256 = _Name(name), "1.0", "h0_0", sha256
        self.url = f"https://conda.example.com/c/linux-64/{name}-1.0-h0_0.conda"


@pytest.mark.parametrize("sha256, words", [
    (None, "no sha256"),
    (b"", "no sha256"),
    (hashlib.md5(b"x").digest(), "a malformed sha256 '"),  # 16 bytes: an md5 where the sha256 goes
    (hashlib.sha256(b"x").digest() + b"\0", "a malformed sha256 '"),
    ("not hex", "a malformed sha256 'not hex'"),
], ids=["none", "empty", "md5-bytes", "65-bytes", "not-hex"])
def test_a_solved_record_without_one_good_sha256_is_refused(monkeypatch, sha256, words):
    async def solved(*args, **kwargs):
        return [_Found("good", hashlib.sha256(b"good").digest()), _Found("odd", sha256)]

    monkeypatch.setattr(condasolve, "_solve", solved)
    with pytest.raises(condasolve.SolveError) as e:
        condasolve.solve("c1", ["https://conda.example.com/c"], ["odd"])
    [line] = e.value.problems
    assert line.startswith("cell c1: the channel gives odd 1.0 h0_0 (https://conda.example.com/c/linux-64/odd-1.0") and words in line
    assert e.value.exit_code == 2


def test_a_solved_record_with_its_sha256_is_returned(monkeypatch):
    async def solved(*args, **kwargs):
        return [_Found("b", hashlib.sha256(b"b").digest()), _Found("a", hashlib.sha256(b"a").hexdigest())]

    monkeypatch.setattr(condasolve, "_solve", solved)
    found = condasolve.solve("c1", ["https://conda.example.com/c"], ["a", "b"])
    assert [(r.name, r.sha256) for r in found] == [("a", hashlib.sha256(b"a").hexdigest()),
                                                   ("b", hashlib.sha256(b"b").hexdigest())]


def test_a_private_channel_is_locked_with_the_netrc_login_and_the_login_stays_out(channel_server, tmp_path, run_cli):
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1\n  login {LOGIN[0]}\n  password {LOGIN[1]}\n")
    netrc.chmod(0o600)
    path = _project(tmp_path, f"{channel_server}/private")
    r = run_cli("lock", "--matrix", str(path), "--netrc", str(netrc))
    assert r.exit_code == 0, r.output
    text = (tmp_path / "locks" / "py3.11-cpu-mkl-conda.txt").read_text()
    assert LOGIN[1] not in text and LOGIN[1] not in r.output and LOGIN[0] not in text


def test_a_lock_line_off_the_cells_channels_is_refused_by_check(channel_server, tmp_path):
    m = matrix.load(_project(tmp_path, f"{channel_server}/main"))
    resolve.lock(m, list(m.cells), resolve.Options(), say=lambda _: None)
    path = lockfile.path_for(m, m.cells[0])
    text = path.read_text()
    moved = text.replace(f"{channel_server}/main/linux-64/numpy", "https://evil.example.com/main/linux-64/numpy")
    assert moved != text
    path.write_text(moved)
    [o] = resolve.check(m, list(m.cells))
    assert o.status == resolve.STALE and any("numpy" in p and "one of the matrix's channels" in p for p in o.problems)
    with pytest.raises(ConfigError):
        resolve.check_exit([o])


def test_the_solver_error_is_flattened_and_bounded():
    class SolverError(Exception):
        pass

    tree = "Cannot solve:\n└─ a 1 would require\n   └─ b, for which no candidates were found.\n" + "x" * 5000
    line = condasolve.explain("c1", SolverError(tree))
    assert "\n" not in line and "└" not in line and len(line) < 800 and line.startswith("cell c1: ")


def test_without_py_rattler_the_lock_says_what_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_rattler(name, *args, **kwargs):
        if name == "rattler" or name.startswith("rattler."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_rattler)
    with pytest.raises(condasolve.SolveError, match="needs py-rattler"):
        condasolve.solve("c", ["http://127.0.0.1:9/x"], ["python"])


def test_the_solve_sends_no_host_login_without_a_netrc(channel_server, tmp_path, run_cli):
    """Without --netrc the default netrc ($NETRC, else ~/.netrc) is the login, as for builds;
    with neither, no login is sent (rattler is pointed at an empty netrc)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text(f"machine 127.0.0.1 login {LOGIN[0]} password {LOGIN[1]}\n")
    (home / ".netrc").chmod(0o600)
    path = _project(tmp_path, f"{channel_server}/private")
    r = run_cli("lock", "--matrix", str(path), env={"HOME": str(home), "NETRC": ""})
    assert r.exit_code == 0, r.output  # the user's default netrc is the login, as build's --netrc default
    shutil.rmtree(tmp_path / "locks")
    r = run_cli("lock", "--matrix", str(path), env={"HOME": str(tmp_path), "NETRC": ""})
    assert r.exit_code == 2 and "refused access" in r.output
