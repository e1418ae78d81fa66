"""How any value becomes a line a terminal shows: escaped, printable, capped in length and count.
"""

from __future__ import annotations

from typing import Any


MAX_LINE = 400  # characters of one error line


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
