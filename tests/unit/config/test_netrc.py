"""Index logins: the netrc file (bad input, the hosts it names, which cells need it, refusal under
the classic builder) and the credential-in-a-URL rule that now names --netrc."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from imagefactory.config import matrix
from imagefactory.config import netrc
from imagefactory.render import contexts
from imagefactory.engine.api import Builder
from imagefactory.errors import ConfigError
from tests.unit.helpers import hardening_project, one_error

SECRET = "Sup3r-S3cret-pw"
MATRIX = textwrap.dedent("""\
    image: registry.example.com/ml/train
    matrix:
      python: ["3.11"]
      cuda: ["none"]
      blas: [openblas]
      installer: [pip]
    torch: "2.13.0"
    threads: 2
    pip:
      torch_index_url: "https://torch.example.com/whl/{variant}"
      extra_index_urls: ["https://pkgs.example.com:8443/simple"]
    """)


@pytest.fixture
def m(tmp_path):
    path = tmp_path / "matrix.yaml"
    path.write_text(MATRIX)
    return matrix.load(path)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "netrc"
    path.write_text(text)
    return path


def test_hosts_are_machine_names_and_default_is_any(tmp_path):
    text = (f"machine PKGS.example.com login me password {SECRET}\n"
            f"macdef init\nmachine macro.example.com\n\n"
            f"machine other.example.org\n  login you\n  password {SECRET}\ndefault login a password b\n")
    assert netrc.hosts(text) == {"pkgs.example.com", "other.example.org", netrc.ANY_HOST}
    loaded = netrc.load(write(tmp_path, text))
    assert SECRET not in repr(loaded)


def test_needs_compares_hosts_without_ports(m, tmp_path):
    cell = m.cells[0]
    assert netrc.cell_hosts(m, cell) == {"pkgs.example.com", "torch.example.com"}
    assert netrc.needs(netrc.load(write(tmp_path, "machine pkgs.example.com login a password b\n")), m, cell)
    assert not netrc.needs(netrc.load(write(tmp_path, "machine pypi.org login a password b\n")), m, cell)
    assert netrc.needs(netrc.load(write(tmp_path, "default login a password b\n")), m, cell)


@pytest.mark.parametrize("make, words", [
    (lambda d: os.symlink("/proc/self/environ", d / "netrc"), "pseudo file system"),  # issue 25, item 1
    (lambda d: (d / "netrc").mkdir(), "is a directory"),
    (lambda d: os.mkfifo(d / "netrc"), "is a FIFO"),
    (lambda d: None, "file not found"),
    (lambda d: (d / "netrc").write_bytes(b"machine x login a password \xff\n"), "not UTF-8"),
    (lambda d: (d / "netrc").write_text("#" * (netrc.MAX_BYTES + 1)), "larger than"),
])
def test_a_bad_netrc_is_exit_2(tmp_path, make, words):
    make(tmp_path)
    with pytest.raises(ConfigError) as e:
        netrc.load(tmp_path / "netrc")
    assert e.value.exit_code == 2 and words in e.value.message and "--netrc" in e.value.message


def test_an_unreadable_netrc_is_exit_2(tmp_path, monkeypatch):
    """Root (these tests' user) reads any mode, so the open itself fails as it does for a user
    without access."""
    path = write(tmp_path, "machine x login a password b\n")
    real_open = os.open

    def refuse(p, *args, **kwargs):
        if Path(p) == path:
            raise PermissionError(13, "Permission denied")
        return real_open(p, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(ConfigError, match="cannot be read: Permission denied"):
        netrc.load(path)


def test_resolve_warns_for_other_hosts_and_mounts_nothing(m, tmp_path):
    said: list[str] = []
    path = write(tmp_path, f"machine elsewhere.example.org login a password {SECRET}\n")
    assert netrc.resolve(path, m, m.cells, buildkit=True, warn=said.append) is None
    assert len(said) == 1 and "names no host" in said[0] and "pkgs.example.com" in said[0]
    assert SECRET not in said[0]


def test_resolve_refuses_a_needed_login_under_classic_saying_why(m, tmp_path):
    path = write(tmp_path, f"machine pkgs.example.com login a password {SECRET}\n")
    with pytest.raises(ConfigError) as e:
        netrc.resolve(path, m, m.cells, buildkit=False, warn=print)
    text = "\n".join(e.value.problems)
    assert "classic builder has no build secrets" in text and "--builder buildkit" in text
    assert SECRET not in text
    assert netrc.resolve(path, m, m.cells, buildkit=True, warn=print) is not None


def test_default_path_is_netrc_variable_then_home(tmp_path):
    assert netrc.default_path({"NETRC": "/x/y", "HOME": str(tmp_path)}) == Path("/x/y")
    assert netrc.default_path({"HOME": str(tmp_path)}) is None
    (tmp_path / ".netrc").write_text("")
    assert netrc.default_path({"HOME": str(tmp_path)}) == tmp_path / ".netrc"


def test_render_refuses_a_secret_mount_for_the_classic_builder(m):
    with pytest.raises(ConfigError, match="needs the BuildKit builder"):
        contexts.dockerfile_text(m, m.cells[0], None, [], locked=False, builder=Builder.classic, netrc=True)


def test_the_secret_mount_is_in_the_install_runs_only(m):
    """The one install RUN under BuildKit (torch's install and the other packages': each may come
    from a protected index)."""
    text = contexts.dockerfile_text(m, m.cells[0], None, [], locked=False, builder=Builder.buildkit, netrc=True)
    mounts = [line for line in text.splitlines() if "type=secret" in line]
    installs = [line for line in text.splitlines() if line.startswith("RUN ") and "pip install" in text.split(line, 1)[1][:400]]
    assert len(mounts) == 1 and all(line.startswith("RUN --mount=type=cache") for line in mounts)
    assert mounts == installs
    assert "ENV NETRC" not in text and "ARG" not in text
    # NETRC is exported inside that RUN's shell, never in an ENV instruction
    env_lines = [line for line in text.splitlines() if line.startswith("ENV")]
    assert not any("NETRC" in line for line in env_lines)


@pytest.mark.parametrize("url", [
    "https://idx.example.com/simple?token=abc123",
    "https://idx.example.com/simple?page=1&api_key=abc123",
    "https://idx.example.com/simple?password=abc",
    "https://blob.example.com/c?sv=1&sig=abc%2F",
    "https://s3.example.com/w?X-Amz-Signature=abc&X-Amz-Credential=k",
    "https://idx.example.com/simple#access_token=abc",
    "https://user:pw@idx.example.com/simple",
])
def test_credentials_anywhere_in_a_url_are_refused_naming_netrc(tmp_path, url):
    path = tmp_path / "matrix.yaml"
    path.write_text(MATRIX.replace("https://pkgs.example.com:8443/simple", url))
    with pytest.raises(ConfigError) as e:
        matrix.load(path)
    text = "\n".join(e.value.problems)
    assert "pip.extra_index_urls[0]" in text and "credentials in a URL" in text and "--netrc" in text
    assert "abc123" not in text


@pytest.mark.parametrize("url", ["https://idx.example.com/simple?page=2", "https://idx.example.com/s?monkey=1",
                                 "https://idx.example.com/s?keyboard=us"])
def test_harmless_query_parameters_pass(tmp_path, url):
    path = tmp_path / "matrix.yaml"
    path.write_text(MATRIX.replace("https://pkgs.example.com:8443/simple", url))
    assert matrix.load(path).pip.extra_index_urls == (url,)


def test_the_settings_line_shows_the_netrc_path_and_nothing_of_its_content(tmp_path):
    from imagefactory.run.context import BuildOptions

    path = tmp_path / "netrc"
    path.write_text(f"machine pkgs.example.com login me password {SECRET}\n")
    loaded = netrc.load(path)
    assert loaded.hosts == {"pkgs.example.com"}
    assert BuildOptions(netrc=loaded).summary(("netrc",)) == f"netrc={path}"


# --------------------------------------------------------------------------- comments and machine names

@pytest.mark.parametrize("text", [
    "#comment machine c.example.com\n",  # a # word, not a lone #: still a comment to the end of the line
    "#machine c.example.com login a password b\n",
    "#: machine c.example.com\n",
    "machine a.example.com login u password p #old: machine c.example.com\n",  # a # word where a keyword goes
    "default login u password p\n  # machine c.example.com\n",
])
def test_a_machine_named_in_a_comment_is_not_a_host(text):
    assert "c.example.com" not in netrc.hosts(text)
    assert netrc.hosts(text + "machine b.example.com password p\n") >= {"b.example.com"}  # the next line is read


def test_a_value_that_starts_with_a_hash_is_a_value_not_a_comment():
    """Python's netrc (requests, pip) reads `password #x` as the password #x, and the words after
    it as more of the file: so does the scan."""
    text = "machine a.example.com login u password #x machine c.example.com login v password w\n"
    assert netrc.hosts(text) == {"a.example.com", "c.example.com"}


@pytest.mark.parametrize("name", ["pkgs.example.com:8443", "pkgs.example.com/simple", "pkgs.example.com.",
                                  "https://pkgs.example.com", "pkgs.example.com@evil", "-pkgs.example.com",
                                  "pkgs..example.com:80"])
def test_a_machine_name_with_a_port_path_or_scheme_names_no_host(m, tmp_path, name):
    """requests and curl look a login up by the bare host name: a machine `host:port` or `host/path`
    is a login no client sends, so the scan keeps none of it (not the host before the `:` or `/`)."""
    text = f"machine {name} login a password {SECRET}\n"
    assert netrc.hosts(text) == set()
    said: list[str] = []
    assert netrc.resolve(write(tmp_path, text), m, m.cells, buildkit=False, warn=said.append) is None
    assert len(said) == 1 and "names no host" in said[0] and SECRET not in said[0]


@pytest.mark.parametrize("name", ["pkgs.example.com", "PKGS.Example.COM", '"pkgs.example.com"', "10.0.0.7",
                                  "a", "x-1.example.com"])
def test_a_host_name_or_address_is_a_host(name):
    assert netrc.hosts(f"machine {name} login a password b\n") == {name.strip('"').lower()}


IPV6_MATRIX = MATRIX.replace("https://pkgs.example.com:8443/simple", "http://[::1]:8080/simple")


@pytest.mark.parametrize("name", ["[::1]", "::1", '"[::1]"'])
def test_an_ipv6_index_host_matches_its_machine_with_or_without_brackets(tmp_path, name):
    """A URL's IPv6 host is compared as urlsplit gives it, without brackets; a netrc may name it
    either way (Python's netrc, in pip and conda, looks `::1` up; a client that keeps the brackets `[::1]`)."""
    path = tmp_path / "matrix.yaml"
    path.write_text(IPV6_MATRIX)
    m = matrix.load(path)
    assert "::1" in netrc.cell_hosts(m, m.cells[0])
    loaded = netrc.load(write(tmp_path, f"machine {name} login a password {SECRET}\n"))
    assert netrc.needs(loaded, m, m.cells[0])
    said: list[str] = []
    assert netrc.resolve(loaded.path, m, m.cells, buildkit=True, warn=said.append) == loaded and said == []
    other = netrc.load(write(tmp_path, f"machine [::2] login a password {SECRET}\n"))
    assert not netrc.needs(other, m, m.cells[0])


@pytest.mark.parametrize("url", ["http://[::1]evil/simple", "https://[::1/simple", "https://[zz::1]/simple",
                                 "https://[::1]:99999999/simple", "https://[::1]]/simple", "http://[fd00::7]:8080/simple"])
def test_an_ipv6_index_url_is_checked_whole(tmp_path, url):
    """Brackets only around an address right after the scheme, a port after them at most; plain http
    only to loopback ([::1]), as for any other host."""
    path = tmp_path / "matrix.yaml"
    path.write_text(MATRIX.replace("https://pkgs.example.com:8443/simple", url))
    with pytest.raises(ConfigError, match="extra_index_urls"):
        matrix.load(path)


@pytest.mark.parametrize("name", ["[::1", "::1]", "[fe80::1%eth0]", "[1.2.3.4]", "[:::]", "abc:8443", "[]",
                                  "[::1]:8080", "[[::1]]"])
def test_a_broken_ipv6_machine_names_no_host(name):
    assert netrc.hosts(f"machine {name} login a password b\n") == set()


def test_needs_matches_the_whole_host_only(m, tmp_path):
    """pkgs.example.com's login is not for pkgs.example.com.evil.org, nor example.com's for pkgs.example.com."""
    cell = m.cells[0]
    for other in ("example.com", "pkgs.example", "kgs.example.com", "pkgs.example.com.evil.org"):
        assert not netrc.needs(netrc.load(write(tmp_path, f"machine {other} login a password b\n")), m, cell), other


# -- moved from test_hardening_iii.py ----------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A matrix in an empty folder, the cwd; no netrc, no Docker config, no engine address."""
    return hardening_project(tmp_path, monkeypatch)


def test_proc_self_environ_is_not_a_netrc_directly_or_through_a_linked_folder(tmp_path):
    os.symlink("/proc/self", tmp_path / "me")
    for path in (Path("/proc/self/environ"), tmp_path / "me" / "environ"):
        with pytest.raises(ConfigError, match="pseudo file system"):
            netrc.load(path)


def test_an_environment_value_saying_default_never_makes_a_default_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEFACTORY_PROBE", "x default y")
    os.symlink("/proc", tmp_path / "p")
    with pytest.raises(ConfigError, match="pseudo file system"):
        netrc.load(tmp_path / "p" / str(os.getpid()) / "environ")


@pytest.mark.parametrize("where", ["/dev/null", "/sys/kernel/notes"])
def test_devices_and_sysfs_are_not_a_netrc(where):
    if not os.path.exists(where):
        pytest.skip(f"{where} is not here")
    with pytest.raises(ConfigError, match="pseudo file system"):
        netrc.load(Path(where))


def test_a_kubernetes_secret_volume_and_a_dotfile_link_are_accepted(tmp_path):
    """A secret volume: netrc -> ..data/netrc, ..data -> ..2026_12_01/; a dotfile manager: a link."""
    stamp = tmp_path / "..2026_12_01"
    stamp.mkdir()
    (stamp / "netrc").write_text("machine pkgs.example.com login a password b\n")
    os.symlink(stamp.name, tmp_path / "..data")
    os.symlink("..data/netrc", tmp_path / "netrc")
    got = netrc.load(tmp_path / "netrc")
    assert got.hosts == {"pkgs.example.com"}
    assert got.path == stamp.resolve() / "netrc"  # what is mounted is the file, not the link
    dot = tmp_path / "dotfiles"
    dot.mkdir()
    (dot / "netrc").write_text("machine x.example.com login a password b\n")
    os.symlink(dot / "netrc", tmp_path / ".netrc")
    assert netrc.load(tmp_path / ".netrc").hosts == {"x.example.com"}


@pytest.mark.parametrize("text, hosts", [
    ("machine\npkgs.example.com login a password b\n", {"pkgs.example.com"}),
    ('machine "pkgs.example.com" login a password b\n', {"pkgs.example.com"}),
    ("machine a.example.com login u password machine\n", {"a.example.com"}),
    ("machine a.example.com login u password default\n", {"a.example.com"}),
    ('machine a.example.com login u password "x machine b.example.com"\n', {"a.example.com"}),
    ("machine a.example.com\n  login u\n  password\n    default\nmachine b.example.com password p\n",
     {"a.example.com", "b.example.com"}),
    ("# machine c.example.com\nmachine a.example.com password p\n", {"a.example.com"}),
    ("macdef init\nmachine m.example.com\n\nmachine a.example.com password p\n", {"a.example.com"}),
    ("machine a.example.com password p\ndefault login x password y\n", {"a.example.com", netrc.ANY_HOST}),
])
def test_hosts_are_read_with_netrcs_grammar(text, hosts):
    assert netrc.hosts(text) == hosts


def test_the_scan_agrees_with_pythons_netrc(tmp_path):
    import netrc as stdlib

    text = ('machine\n"a.example.com" login u password machine\nmachine b.example.com login "v w" password '
            'default\ndefault login d password "machine c.example.com"\n')
    (tmp_path / "n").write_text(text)
    (tmp_path / "n").chmod(0o600)
    parsed = stdlib.netrc(str(tmp_path / "n"))
    want = set(parsed.hosts) | ({netrc.ANY_HOST} if "default" in parsed.hosts else set())
    assert netrc.hosts(text) == {h for h in want if h != "default"} | {netrc.ANY_HOST}


def test_a_netrc_with_nul_bytes_is_refused(tmp_path):
    (tmp_path / "n").write_bytes(b"machine a.example.com\0 password p\n")
    with pytest.raises(ConfigError, match="NUL"):
        netrc.load(tmp_path / "n")


def test_the_token_scan_is_bounded():
    with pytest.raises(ValueError, match="more than"):
        netrc.hosts("x " * (netrc.MAX_TOKENS + 1))


@pytest.mark.parametrize("source", ["NETRC", "HOME"])
def test_a_login_in_netrc_or_home_refuses_a_classic_build_as_the_flag_does(project, monkeypatch, capsys, source):
    text = "machine pkgs.example.com login a password b\n"
    if source == "NETRC":
        (project / "logins").write_text(text)
        monkeypatch.setenv("NETRC", str(project / "logins"))
    else:
        (project / "home").mkdir()
        (project / "home" / ".netrc").write_text(text)
    line = one_error(["build", "--builder", "classic"], monkeypatch, capsys)
    assert "installs from pkgs.example.com" in line and "classic builder has no build secrets" in line
    assert not (project / "build").exists()


def test_a_default_entry_refusal_names_hosts_not_characters(project, monkeypatch, capsys):
    (project / "logins").write_text("default login a password b\n")
    line = one_error(["build", "--builder", "classic", "--netrc", "logins"], monkeypatch, capsys)
    assert "installs from download.pytorch.org, pkgs.example.com, whose login" in line and "i, t, s" not in line
