"""The bounded YAML reader (depth, events and alias expansion capped) with line numbers (`Located`),
and how its problems become one located line each (at most MAX_PROBLEMS).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from imagefactory.errors import ConfigError
from imagefactory.files.bounded import InputError, read_regular
from imagefactory.credentials import CREDENTIALS_MESSAGE, has_credentials
from imagefactory.terminal import printable, show

if TYPE_CHECKING:  # PyYAML is imported where a document is parsed or walked: --help never reads one
    import yaml


# Bounds on what a YAML file (the matrix) may cost to read (a real one is a few KB, tens of cells).
YAML_MAX_BYTES = 256 * 1024  # pure-Python YAML parses about 20 KB a second on a busy machine


MAX_DEPTH = 32  # nesting of mappings and sequences


MAX_EVENTS = 20_000  # YAML parser events (scalars, starts, ends)


MAX_VALUES = 20_000  # values after aliases are expanded


MAX_PROBLEMS = 20  # error lines shown


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
