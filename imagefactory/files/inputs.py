"""Every file imagefactory reads goes through here: only regular files, read within bounds,
and every problem reported as one located, escaped, bounded line (at most MAX_PROBLEMS).

* `read_regular`: the bytes of a regular file within a size cap (a FIFO, a device, a
  directory or a file too big is an InputError, never waited on or read whole);
* `read_yaml_text` / `parse_yaml` / `Located`: the bounded YAML reader with line numbers
  that matrix.py uses (depth, events and alias expansion capped);
* `certificates`: only the parsed CERTIFICATE blocks of a CA file, never the rest of the
  file, such as a private key or an environment dump;
* `wheelhouse_files`: regular files inside the wheelhouse, never a link out of it;
* `Problem`, `show`, `printable`, `config_error`: how a problem becomes a message line.

matrix.py checks CA files and the wheelhouse when the matrix is loaded; render.py calls the
same functions when it writes a context, so what enters an image is what was checked.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import parse_qsl, urlsplit

from imagefactory.errors import ConfigError

if TYPE_CHECKING:  # PyYAML is imported where a document is parsed or walked: --help never reads one
    import yaml

CERT_MAX_BYTES = 1 << 20
# Pseudo file systems: a "file" there is the state of a process or a device, not a certificate.
REFUSED_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
_BEGIN = re.compile(rb"-----BEGIN ([A-Z0-9 ]{1,64})-----")
_END = re.compile(rb"-----END ([A-Z0-9 ]{1,64})-----")
_BASE64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")
MAX_PEM_BLOCKS = 1000  # a public CA bundle holds about 150 certificates
MAX_CA_FILES = 256
GLOB_CHARS = set("*?[")
MAX_WHEELS = 1000
WHEEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,254}")


WHEEL_SUFFIXES = (".whl", ".gz", ".zip")


class InputError(ValueError):
    """The file cannot be used; the message says why."""


def short(path: Path | str, limit: int = 120) -> str:
    """A path as messages show it: cut to `limit` characters (the CLI escapes what it prints)."""
    text = str(path)
    return text if len(text) <= limit else text[:limit] + "..."


def kind(mode: int) -> str:
    """What a file's mode says it is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; InputError (a message without the
    path) for anything else. Opened without blocking, so a FIFO is reported, not waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError("file not found") from None
    except OSError as e:  # ENAMETOOLONG, EACCES, ELOOP, ...
        raise InputError(f"cannot be read: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputError(f"is {kind(mode)}, not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InputError(f"is larger than {limit} bytes")
    return data


def pem_blocks(data: bytes) -> list[tuple[str, bytes, int]]:
    """(label, base64 body, line) of each PEM block, in one pass over the lines (linear time, at
    most MAX_PEM_BLOCKS blocks). A block cut short (a BEGIN without its END, or another
    boundary inside it) is an InputError, not text to skip."""
    blocks: list[tuple[str, bytes, int]] = []
    label: bytes | None = None
    body: list[bytes] = []
    start = 0
    for number, raw in enumerate(data.splitlines(), 1):
        line = raw.strip()
        if label is None:
            m = _BEGIN.fullmatch(line)
            if m:
                label, body, start = m[1], [], number
            continue
        end = _END.fullmatch(line)
        if end and end[1] == label:
            blocks.append((label.decode(), b"".join(body), start))
            label = None
            if len(blocks) > MAX_PEM_BLOCKS:
                raise InputError(f"holds more than {MAX_PEM_BLOCKS} PEM blocks")
        elif line.startswith(b"-----"):
            raise InputError(f"line {start}: the {label.decode()} block is cut short (line {number} is "
                             f"not its END line)")
        else:
            body.append(line)
    if label is not None:
        raise InputError(f"line {start}: the {label.decode()} block is cut short (no END line)")
    return blocks


def in_pseudo_fs(path: Path) -> bool:
    """Whether a resolved path is in /proc, /sys or /dev: the state of a process or a device."""
    return any(path == root or path.is_relative_to(root) for root in REFUSED_ROOTS)


def read_real(path: Path, limit: int) -> tuple[Path, bytes]:
    """(the file `path` leads to, its bytes): links are followed (a Kubernetes secret volume and a
    dotfile manager's ~/.netrc are links), and what they lead to must be a regular file of at most
    `limit` bytes outside /proc, /sys and /dev. InputError (a message without the file's content)
    for anything else. The returned path is what later steps use, so a link swapped after this
    check changes nothing."""
    real = resolved(path)
    if in_pseudo_fs(real):
        raise InputError(f"leads to {short(real)}, in a pseudo file system (/proc, /sys, /dev), not a file")
    return real, read_regular(real, limit)


def wheelhouse_files(root: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """(name in the context, regular file to copy) for each wheel of the wheelhouse, and what is
    refused: a symbolic link leading out of the wheelhouse (or in a loop), a wheel that is not a
    regular file, a name that is not a plain file name (it goes into the context and pip's
    command line as it is)."""
    root = resolved(root)
    files: list[tuple[str, Path]] = []
    refused: list[str] = []
    try:
        entries = sorted(root.iterdir())
    except OSError as e:
        raise InputError(f"cannot be read: {e.strerror}") from None
    for entry in entries:
        if entry.suffix not in WHEEL_SUFFIXES:
            continue
        if len(files) >= MAX_WHEELS:
            refused.append(f"more than {MAX_WHEELS} wheels")
            break
        if not WHEEL_NAME_RE.fullmatch(entry.name):
            refused.append(f"{show(entry.name)} is not a wheel or archive file name (letters, digits, . _ + -)")
            continue
        try:
            target = resolved(entry)
        except InputError as e:
            refused.append(f"{entry.name} {e}")
            continue
        mode = entry.lstat().st_mode
        if stat.S_ISLNK(mode) and not target.is_relative_to(root):
            refused.append(f"{entry.name} is a symbolic link to {short(target)}, outside the wheelhouse")
        elif not target.exists() or not stat.S_ISREG(target.lstat().st_mode):
            what = kind(target.lstat().st_mode) if target.exists() else "a broken link"
            refused.append(f"{entry.name} is {what}, not a regular file")
        else:
            files.append((entry.name, target))
    return files, refused


# Bounds on what a YAML file (the matrix) may cost to read (a real one is a few KB, tens of cells).
YAML_MAX_BYTES = 256 * 1024  # pure-Python YAML parses about 20 KB a second on a busy machine
MAX_DEPTH = 32  # nesting of mappings and sequences
MAX_EVENTS = 20_000  # YAML parser events (scalars, starts, ends)
MAX_VALUES = 20_000  # values after aliases are expanded
MAX_LINE = 400  # characters of one error line
MAX_PROBLEMS = 20  # error lines shown

# scheme://user[:password]@ anywhere in a string (a URL inside an env or label value too). No
# scheme before "://": a pattern that starts with [A-Za-z]+ is quadratic on a long run of letters.
CREDENTIALS_RE = re.compile(r"://[^/?#\s@]*@")
# A query or fragment parameter whose name says it carries a credential: token=, key=, api_key=,
# password=, secret=, sig=, X-Amz-Signature=, X-Amz-Credential=, auth=... (checked per URL).
CREDENTIAL_PARAM_RE = re.compile(r"(?:[a-z0-9]+[_.-])*(?:token|key|apikey|accesstoken|authtoken|password|passwd|pwd|"
                                 r"secret|sig|signature|credentials?|auth|authorization|session)", re.IGNORECASE)
URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,30}://\S{1,4000}")
CREDENTIALS_MESSAGE = ("credentials in a URL (user:password@, or a ?token=/key=/password=/sig= parameter) would be "
                       "baked into an image layer and its history; put the login in a netrc file and build with "
                       "--builder buildkit --netrc PATH (a build secret, never in a layer)")
# Characters the YAML reader refuses; reported by us with their line, not a byte offset. Spelled as
# what is refused (the complement of YAML's printable set: tab, LF, CR, 0x20-0x7E, NEL, 0xA0-0xD7FF,
# 0xE000-0xFFFD, the astral planes): the same set, compiled in 1 ms where the negated class takes 8.
_UNREADABLE = re.compile("[\x00-\x08\x0B\x0C\x0E-\x1F\x7F-\x84\x86-\x9F\uD800-\uDFFF\uFFFE\uFFFF]")


@dataclass(frozen=True)
class Problem:
    line: int
    key: str
    message: str


class Located:
    """Maps key paths of a YAML document to line numbers (1-based). `compose`: where the document
    was not composed (its data came from a cache), composes it on first use, giving the root."""

    def __init__(self, root: yaml.Node | None, compose: Callable[[], yaml.Node | None] | None = None):
        self._root, self._compose = root, compose

    @property
    def root(self) -> yaml.Node | None:
        if self._compose is not None:
            self._root, self._compose = self._compose(), None
        return self._root

    def node(self, path: tuple[Any, ...], *, key: bool = True) -> yaml.Node | None:
        """The node at `path` (for a mapping entry, its key node), or the deepest one found."""
        import yaml

        node = self.root
        for i, part in enumerate(path):
            child = None
            if isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    if k.value == part:
                        child = k if (key and i == len(path) - 1) else v
                        break
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                child = node.value[part]
            if child is None:
                return node
            node = child
        return node

    def line(self, path: tuple[Any, ...], *, key: bool = True) -> int:
        """The line of the value at `path`; for a mapping entry, the line of its key."""
        node = self.node(path, key=key)
        return 1 if node is None else node.start_mark.line + 1

    def source(self, path: tuple[Any, ...]) -> str | None:
        """The text the user typed for the scalar at `path` (3.10, not the float 3.1)."""
        import yaml

        node = self.node(path, key=False)
        return node.value if isinstance(node, yaml.ScalarNode) else None



_STR = "tag:yaml.org,2002:str"
_KEY_KINDS = {"int": "a number", "float": "a number", "bool": "true/false", "null": "null (empty)",
              "timestamp": "a date", "binary": "binary data"}


def has_credentials(text: str) -> bool:
    """Whether `text` holds a URL with userinfo or with a credential-named query parameter."""
    if "://" not in text:
        return False
    if CREDENTIALS_RE.search(text):
        return True
    for url in URL_RE.findall(text[:100_000]):
        try:
            parts = urlsplit(url)
        except ValueError:  # not a URL after all (an unbalanced "[" in its host)
            continue
        for section in (parts.query, parts.fragment):
            for name, _ in parse_qsl(section, keep_blank_values=True):
                if CREDENTIAL_PARAM_RE.fullmatch(name.strip()[:100]):
                    return True
    return False


def structure(root: yaml.Node) -> tuple[list[Problem], int]:
    """Problems of the document's shape, found without expanding aliases: keys that are not
    text, keys given twice, control characters, credentials in URLs. Also the number of
    values the document has once its aliases are expanded."""
    import yaml

    problems: list[Problem] = []
    visited: set[int] = set()
    sizes: dict[int, int] = {}

    def scalar(node: yaml.ScalarNode, path: str) -> None:
        text = node.value
        bad = next((c for c in text if not c.isprintable()), None)
        if node.tag == _STR and bad is not None:
            problems.append(Problem(node.start_mark.line + 1, path or "(top level)",
                                    f"{show(text)} holds the control character {show(bad)[1:-1]}"))
        elif node.tag == _STR and has_credentials(text):
            problems.append(Problem(node.start_mark.line + 1, path or "(top level)", CREDENTIALS_MESSAGE))

    def walk(node: yaml.Node, path: str) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in visited:  # entered, not finished: an alias inside the node it names
            problems.append(Problem(node.start_mark.line + 1, path or "(top level)",
                                    "a recursive alias (an alias inside the value it refers to) would make the "
                                    "value contain itself forever; write the value out"))
            return 1
        size = 1
        if id(node) not in visited:
            visited.add(id(node))
            if isinstance(node, yaml.ScalarNode):
                scalar(node, path)
            elif isinstance(node, yaml.SequenceNode):
                for i, v in enumerate(node.value):
                    size += walk(v, f"{path}[{i}]")
            elif isinstance(node, yaml.MappingNode):
                size += _mapping(node, path, walk, problems)
        sizes[id(node)] = size
        return size

    total = walk(root, "")
    return problems, total


def _mapping(node: yaml.MappingNode, path: str, walk, problems: list[Problem]) -> int:
    import yaml

    seen: set[str] = set()
    size = 0
    for k, v in node.value:
        line = k.start_mark.line + 1
        if not isinstance(k, yaml.ScalarNode):
            problems.append(Problem(line, path or "(top level)", "a key must be text, not a list or mapping"))
            size += 1 + walk(v, path)
            continue
        name = k.value
        sub = f"{path}.{name}" if path else name
        if k.tag not in (_STR, "tag:yaml.org,2002:merge"):
            kind = _KEY_KINDS.get(k.tag.rsplit(":", 1)[-1], k.tag)
            problems.append(Problem(line, sub, f"key {show(name)} is read as {kind}, not text; "
                                               f"quote it (\"{name}\") or rename it"))
        elif name in seen:
            problems.append(Problem(line, sub, "key given twice (the later one would silently win)"))
        else:
            walk(k, sub)  # control characters in a key
        seen.add(name)
        size += 1 + walk(v, sub)
    return size


def show(value: object, limit: int = 80) -> str:
    """A value as it appears in a message: repr (control characters escaped), cut to `limit`."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def escaped(text: str) -> str:
    """`text` with every control or escape character written out (\\x1b), its lines kept: what
    the CLI prints of any message, so no value in it can drive the terminal."""
    return "\n".join("".join(c if c.isprintable() else repr(c)[1:-1] for c in line) for line in text.split("\n"))


def printable(line: str) -> str:
    """One message line safe for a terminal: no control or escape characters, bounded length."""
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    return line if len(line) <= MAX_LINE else f"{line[:MAX_LINE]}... ({len(line) - MAX_LINE} more characters)"



def read_yaml_text(path: Path, shown: str) -> str:
    """The text of a regular, bounded, UTF-8 file; a located error for anything else."""
    try:
        raw = read_regular(path, YAML_MAX_BYTES)
    except InputError as e:
        raise ConfigError(f"{shown}: {'no such matrix file' if str(e) == 'file not found' else e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{shown}:{line}: (yaml): byte 0x{raw[e.start]:02x} is not UTF-8 "
                          f"(save the file as UTF-8)") from None


def parse_yaml(text: str, shown: str) -> tuple[yaml.Node | None, Any]:
    """Compose and construct the document within MAX_DEPTH, MAX_EVENTS and MAX_VALUES."""
    import yaml

    def fail(line: int, message: str) -> ConfigError:
        return ConfigError(f"{shown}:{line}: (yaml): {message}")

    bad = _UNREADABLE.search(text)
    if bad:
        raise fail(text.count("\n", 0, bad.start()) + 1,
                   f"control character {show(bad.group())[1:-1]} is not allowed in a YAML file")
    depth = 0
    for number, line in enumerate(text.splitlines(), 1):  # the scanner slows down with each flow level
        depth = max(0, depth + line.count("[") + line.count("{") - line.count("]") - line.count("}"))
        if depth > MAX_DEPTH:
            raise fail(number, f"nested deeper than {MAX_DEPTH} levels")
    try:
        depth, events = 0, 0
        alias_line: int | None = None
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            events += 1
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            at = event.start_mark.line + 1 if event.start_mark else 1
            if isinstance(event, yaml.AliasEvent) and alias_line is None:
                alias_line = at
            if depth > MAX_DEPTH:
                raise fail(at, f"nested deeper than {MAX_DEPTH} levels")
            if events > MAX_EVENTS:
                raise fail(at, f"more than {MAX_EVENTS} values")
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                return None, None
            problems, size = structure(root)
            if size > MAX_VALUES:
                raise fail(alias_line or 1, f"aliases expand the document to more than {MAX_VALUES} values")
            if problems:
                raise config_error(shown, problems)
            return root, loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise fail(mark.line + 1 if mark else 1, str(e.problem or e)) from None
    except yaml.YAMLError as e:
        raise fail(1, str(e)) from None


def config_error(shown: str, problems: list[Problem]) -> ConfigError:
    """Every problem once, in file order, each line printable and bounded."""
    unique = sorted(set(problems), key=lambda p: (p.line, p.key, p.message))
    lines = [printable(f"{shown}:{p.line}: {p.key}: {p.message}") for p in unique[:MAX_PROBLEMS]]
    if len(unique) > MAX_PROBLEMS:
        lines.append(f"{printable(shown)}: {len(unique) - MAX_PROBLEMS} more problems not shown")
    return ConfigError(lines)


_MORE_RE = re.compile(r"([0-9]+) more problems not shown")


def capped(lines: list[str], limit: int = MAX_PROBLEMS) -> list[str]:
    """At most `limit` message lines, each printable and bounded, and a count of the rest.
    Lines already capped may be capped again: their counts are added up, not shown as problems."""
    hidden = 0
    kept = []
    for line in lines:
        more = _MORE_RE.fullmatch(line)
        if more:
            hidden += int(more[1])
        else:
            kept.append(line)
    out = [printable(line) for line in kept[:limit]]
    hidden += max(0, len(kept) - limit)
    if hidden:
        out.append(f"{hidden} more problems not shown")
    return out


def resolved(path: Path) -> Path:
    """`path` with its links followed; InputError (never RuntimeError) for a loop or an unreadable one."""
    try:
        return Path(path).resolve(strict=False)
    except RuntimeError:  # Python 3.11 raises RuntimeError for a symbolic link loop
        raise InputError("is a symbolic link loop") from None
    except OSError as e:  # Python 3.13: ELOOP, ENAMETOOLONG, ...
        raise InputError(f"cannot be resolved: {e.strerror}") from None


def read_within(path: Path, root: Path, limit: int) -> bytes | None:
    """The bytes of `path`, a regular file of at most `limit` bytes that is, or links to, a file
    inside `root`; None when nothing at all is there. InputError (a message that shows nothing
    of the file) for a link out of `root`, a link loop, a FIFO, a device, a directory, a file too big."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InputError(f"cannot be read: {e.strerror}") from None
    target = Path(path)
    if stat.S_ISLNK(st.st_mode):
        target = resolved(path)
        if not target.is_relative_to(resolved(root)):
            raise InputError(f"is a symbolic link to {short(target)}, outside {short(root)}")
        if not target.exists():
            raise InputError("is a broken symbolic link")
    return read_regular(target, limit)


# -- what the CLI prints -------------------------------------------------------------------------

MAX_LISTED = 8  # names one message lists before "and N more"


def listing(items: list[str] | tuple[str, ...] | set[str] | frozenset[str], limit: int = MAX_LISTED,
            empty: str = "none") -> str:
    """Names joined with commas for a message, at most `limit` of them and how many more. A
    collection, never a bare string (whose characters would be listed one by one)."""
    if isinstance(items, str):
        raise TypeError("listing() takes a collection of names, not one string")
    names = list(items)
    if not names:
        return empty
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def printable_text(text: str) -> str:
    """`text` with every character that could drive a terminal written out (\\x1b, \\u202e), its
    newlines and tabs kept: what the CLI's output streams let through."""
    if text.isascii() and (text.replace("\n", "").replace("\t", "").isprintable()):
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


class EscapingStream:
    """A text stream that escapes whatever is written to it (printable_text), then passes it on:
    the CLI puts its stdout and stderr behind one, so no line it prints, whoever wrote it, can
    carry a terminal escape. `raw` is the stream underneath (for the live display's own codes)."""

    def __init__(self, raw: Any):
        self.raw = raw

    def write(self, text: str) -> int:
        self.raw.write(printable_text(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding, ...
        return getattr(self.raw, name)


# -- values from the environment -----------------------------------------------------------------

DOCKER_CONFIG_MAX_BYTES = 1 << 20  # a config.json with dozens of logins is a few KB
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])"
DOCKER_HOST_RE = re.compile(
    rf"unix://(?P<path>/[^\s\x00]{{1,4000}})|(?:tcp|http|https)://{_HOST}(?::(?P<port>[0-9]{{1,5}}))?/?"
    rf"|ssh://(?:[A-Za-z0-9._-]{{1,64}}@)?{_HOST}(?::(?P<sshport>[0-9]{{1,5}}))?/?|fd://[0-9]{{0,9}}", re.ASCII)


def docker_host(environ: Any = None) -> str | None:
    """$DOCKER_HOST when it is set and well formed (unix:///PATH, tcp://HOST[:PORT], ssh://[USER@]HOST[:PORT]),
    None when unset; ConfigError naming it otherwise (the SDK would raise a traceback)."""
    env = os.environ if environ is None else environ
    value = env.get("DOCKER_HOST")
    if not value:
        return None
    m = DOCKER_HOST_RE.fullmatch(value)
    port = m and (m["port"] or m["sshport"])
    if m is None or (port and not 0 < int(port) <= 65535):
        raise ConfigError(printable(f"$DOCKER_HOST {show(value)}: not an engine address (unix:///var/run/docker.sock, "
                                    f"tcp://HOST:PORT with a port from 1 to 65535, ssh://USER@HOST)"))
    return value


def home(environ: Any = None) -> Path | None:
    """The user's home folder: $HOME, else the passwd entry's; None for a UID with neither (a
    container started as --user 4242 with HOME unset)."""
    env = os.environ if environ is None else environ
    if env.get("HOME"):
        return Path(env["HOME"])
    try:
        import pwd

        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except (KeyError, ImportError, OSError):
        return None


def docker_config_dir(environ: Any = None) -> Path | None:
    """$DOCKER_CONFIG, else ~/.docker; None without a home."""
    env = os.environ if environ is None else environ
    if env.get("DOCKER_CONFIG"):
        return Path(env["DOCKER_CONFIG"])
    where = home(env)
    return where / ".docker" if where is not None else None


def check_docker_config(environ: Any = None) -> bytes | None:
    """The bytes of the Docker CLI's config.json (what the SDK reads for logins), read bounded;
    None when there is none. ConfigError for a FIFO, a device, a huge file: the SDK would hang on
    it or run out of memory."""
    env = os.environ if environ is None else environ
    folder = docker_config_dir(env)
    if folder is None:
        return None
    path = folder / "config.json"
    if not os.path.lexists(path):
        return None
    try:
        return read_real(path, DOCKER_CONFIG_MAX_BYTES)[1]
    except InputError as e:
        raise ConfigError(printable(f"{'$DOCKER_CONFIG' if env.get('DOCKER_CONFIG') else '~/.docker'}"
                                    f"/config.json {short(path)}: {e}")) from None


# -- paths the CLI writes ------------------------------------------------------------------------

def check_output(path: Path, flag: str, *, folder: bool, keep: tuple[Path, ...] = ()) -> None:
    """Whether `path` can be written: a folder (folder=True) or a file, in a place that exists as a
    folder or can be made one, outside /proc, /sys and /dev, and never one of `keep` (the matrix
    file). ConfigError naming the flag otherwise, before anything is written: the OS's own message
    would come mid-run, with exit 1."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(printable(f"{flag} {short(path)}: {why}"))

    try:
        real = resolved(path)
    except InputError as e:
        raise refuse(str(e)) from None
    if in_pseudo_fs(real):
        raise refuse("is in a pseudo file system (/proc, /sys, /dev)")
    if any(real == resolved(k) for k in keep):
        raise refuse("is the matrix file, which is never overwritten")
    if os.path.lexists(real):
        mode = os.lstat(real).st_mode
        if folder and not stat.S_ISDIR(mode):
            raise refuse(f"is {kind(mode)}, not a folder")
        if not folder and not stat.S_ISREG(mode):
            raise refuse(f"is {kind(mode)}, not a regular file")
    parent = real if folder else real.parent
    while not os.path.lexists(parent):
        parent = parent.parent
    if not os.path.isdir(parent):
        raise refuse(f"{short(parent)} is a file where a folder should be")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise refuse(f"{short(parent)} cannot be written")
