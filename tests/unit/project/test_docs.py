"""The documentation cannot drift from what it documents.

* Every relative link in README.md and docs/*.md resolves: the file exists, and a `#anchor`
  names a heading of that file, as GitHub makes anchors from headings.
* docs/matrix.md's key reference ("Every key") documents exactly the keys of
  imagefactory/resources/matrix.schema.json: none missing, none the schema does not have.
* The exit-code tables (README.md, docs/builders.md, `lock --check`'s in docs/locks.md) and the
  `--help` texts name exactly the codes the CLI exits with (errors.py, cli.py), each row saying
  what its code means.
* Every imagefactory command line the docs show (`imagefactory build --push`, `lock --check`)
  names a command the CLI has, options that command has, and an option's choices as they are;
  docs/builders.md's `build` options are exactly `build`'s.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.unit.helpers import package_modules

REPO = Path(__file__).resolve().parents[3]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
SCHEMA = REPO / "imagefactory" / "resources" / "matrix.schema.json"
MATRIX_DOC = REPO / "docs" / "matrix.md"

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text without fenced blocks and code spans (a link inside code is not a link)."""
    return _CODE.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    return _LINK.findall(prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, punctuation dropped
    (letters, digits, `_`, `-` and spaces kept), each space a `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a Markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(doc: Path, root: Path = REPO) -> list[str]:
    broken = []
    for target in links(doc.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or root not in dest.parents:
            broken.append(f"{doc.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{doc.name}: {target}: no such heading in {dest.name}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_the_link_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    """The checker itself can fail: a missing file, a missing heading; code is not a link."""
    (tmp_path / "other.md").write_text("# Other\n\n## The factory (`bench/factory.py`)\n\n## Dup\n\n## Dup\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](other.md#the-factory-benchfactorypy) [ok](other.md#dup-1) [ok](#title)\n"
                   "# Title\n[gone](missing.md) [bad](other.md#nowhere) `[code](nowhere.md)`\n"
                   "```\n[fenced](nowhere.md)\n```\n[web](https://example.com/x)\n")
    assert broken_links(doc, root=tmp_path) == ["a.md: missing.md: no such file",
                                                "a.md: other.md#nowhere: no such heading in other.md"]


# --------------------------------------------------------------------------- matrix reference

def _resolve(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """A schema node with local `$ref`s followed and `allOf` branches merged in."""
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    for branch in node.get("allOf", []):
        branch = _resolve(branch, root)
        node = {**node, "properties": {**branch.get("properties", {}), **node.get("properties", {})}}
    return node


def schema_keys(node: dict[str, Any], root: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Every key path of the schema: `a`, `a.b`, and `a[].b` for the objects in a list."""
    node = _resolve(node, root)
    for name, sub in node.get("properties", {}).items():
        path = prefix + name
        yield path
        sub = _resolve(sub, root)
        yield from schema_keys(sub, root, path + ".")
        items = sub.get("items")
        if isinstance(items, dict):
            yield from schema_keys(items, root, path + "[].")


def documented_keys(text: str) -> list[str]:
    """The keys in the first column of the tables under docs/matrix.md's "Every key"."""
    section = text.split("\n## Every key\n", 1)[1].split("\n## ", 1)[0]
    keys = []
    for row in section.splitlines():
        first = row.split("|")[1].strip() if row.startswith("|") else ""
        if first and first != "key" and not set(first) <= set("-: "):
            assert re.fullmatch(r"`[^`]+`", first), f"one key per row, in backticks: {row}"
            keys.append(first.strip("`"))
    return keys


def test_the_matrix_reference_documents_exactly_the_schemas_keys() -> None:
    schema = json.loads(SCHEMA.read_text())
    in_schema = set(schema_keys(schema, schema))
    documented = documented_keys(MATRIX_DOC.read_text())
    assert len(documented) == len(set(documented)), "a key documented twice"
    assert sorted(in_schema - set(documented)) == [], "schema keys docs/matrix.md does not document"
    assert sorted(set(documented) - in_schema) == [], "keys docs/matrix.md documents that the schema lacks"


def test_the_schema_walk_sees_nested_and_referenced_keys() -> None:
    root = {"$defs": {"u": {"type": "object", "properties": {"uid": {"type": "integer"}}}},
            "properties": {"user": {"$ref": "#/$defs/u"},
                           "inc": {"type": "array", "items": {"properties": {"torch": {}}}}}}
    assert sorted(schema_keys(root, root)) == ["inc", "inc[].torch", "user", "user.uid"]


# --------------------------------------------------------------------------- exit codes

BUILDERS_DOC = REPO / "docs" / "builders.md"
README = REPO / "README.md"
LOCKS_DOC = REPO / "docs" / "locks.md"
PACKAGE = REPO / "imagefactory"

# The words each exit code's row says, in every full exit-code table (README.md, docs/builders.md).
# A code the CLI gains and this table lacks fails test_every_exit_code_of_the_cli_has_a_meaning.
EXIT_MEANINGS = {0: "passed", 1: "failed", 2: "configuration", 3: "Docker engine", 130: "SIGINT", 143: "SIGTERM"}

_EXIT_HEAD = re.compile(r"^\|\s*(?:exit )?code\s*\|\s*meaning\s*\|[ \t]*\n\|[-| :]+\|[ \t]*\n", re.M)


def cli_exit_codes() -> set[int]:
    """Every code the CLI exits with, read from the code: 0, each error class's `exit_code = N`
    (errors.py and any module that subclasses its errors), Interrupted's 128 + SIGINT / SIGTERM,
    and cli.py's literal exits (sys.exit(N), os._exit(N), typer.Exit(N))."""
    import signal

    from imagefactory.errors import ImageFactoryError, Interrupted

    codes = {0, ImageFactoryError.exit_code, Interrupted(signal.SIGINT).exit_code,
             Interrupted(signal.SIGTERM).exit_code}
    for path in package_modules().values():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if (isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == ["exit_code"]
                            and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, int)):
                        codes.add(stmt.value.value)
            elif (path.parent.name == "cli" and isinstance(node, ast.Call)
                  and ast.unparse(node.func) in ("sys.exit", "os._exit", "typer.Exit")
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, int)):
                codes.add(node.args[0].value)
    return codes


def exit_code_tables(text: str) -> list[dict[int, str]]:
    """Each Markdown table headed `| code | meaning |` or `| exit code | meaning |`: code ->
    meaning; a row `130 / 143` gives both codes its meaning."""
    text = _FENCE.sub("", text)
    tables = []
    for head in _EXIT_HEAD.finditer(text):
        table: dict[int, str] = {}
        for row in text[head.end():].splitlines():
            if not row.startswith("|"):
                break
            first, meaning = (cell.strip() for cell in row.strip().strip("|").split("|", 1))
            assert re.fullmatch(r"\d+(?: / \d+)*", first), f"a code, or codes with ' / ', per row: {row}"
            for code in first.split(" / "):
                assert int(code) not in table, f"code {code} twice: {row}"
                table[int(code)] = meaning
        tables.append(table)
    return tables


def exit_code_problems(table: dict[int, str], codes: set[int]) -> list[str]:
    problems = [f"exit code {c}: not documented" for c in sorted(codes - set(table))]
    problems += [f"exit code {c}: documented, but the CLI has no such code" for c in sorted(set(table) - codes)]
    problems += [f"exit code {c}: its meaning does not say {EXIT_MEANINGS[c]!r}: {table[c]}"
                 for c in sorted(set(table) & codes) if c in EXIT_MEANINGS and EXIT_MEANINGS[c] not in table[c]]
    return problems


def test_every_exit_code_of_the_cli_has_a_meaning() -> None:
    assert cli_exit_codes() == set(EXIT_MEANINGS), "a new exit code: document it (README.md, docs/builders.md)"


@pytest.mark.parametrize("doc", [BUILDERS_DOC, README], ids=lambda p: p.name)
def test_the_exit_code_table_is_the_clis(doc: Path) -> None:
    (table,) = exit_code_tables(doc.read_text())
    assert exit_code_problems(table, cli_exit_codes()) == []


def stated_exit_codes(help_text: str) -> set[int]:
    """The codes of a `--help` text's "Exit codes: 0 ...; 1 ...; 130 / 143 ..." sentence."""
    sentence = help_text.split("Exit codes:", 1)[1]
    return {int(c) for part in sentence.split(";") for c in re.findall(r"^\s*(\d+)(?: / (\d+))?", part)[0] if c}


def test_the_help_states_the_clis_exit_codes() -> None:
    """`imagefactory --help` names every code; a command's own help names none the CLI lacks."""
    from typer.main import get_command

    from imagefactory.cli.app import app

    codes = cli_exit_codes()
    assert app.info.help is not None and stated_exit_codes(app.info.help) == codes
    for name, command in get_command(app).commands.items():  # type: ignore[attr-defined]
        if command.help and "Exit codes:" in command.help:
            assert stated_exit_codes(command.help) <= codes, name


def test_lock_checks_exit_code_table_is_what_it_exits_with() -> None:
    """docs/locks.md's `lock --check` table: each row's code is lock.check_exit's for that case."""
    from imagefactory.lock import resolve
    from imagefactory.errors import ImageFactoryError

    def code(status: str, problems: list[str]) -> int:
        try:
            resolve.check_exit([resolve.Outcome("c", Path("locks/c.txt"), status, problems=problems)])
        except ImageFactoryError as e:
            return e.exit_code
        return 0

    (table,) = exit_code_tables(LOCKS_DOC.read_text())
    assert sorted(table) == [0, 1, 2]
    assert "current" in table[code("current", [])]
    assert "no lock" in table[code(resolve.MISSING, [])]
    assert "stale" in table[code("stale", ["locks/c.txt:1: torch: stale"])]


def test_the_exit_code_check_finds_a_wrong_table() -> None:
    """The checker itself can fail: a missing code, an unknown code, a row that says the wrong thing."""
    text = ("# T\n\n| code | meaning |\n|---|---|\n| 0 | every cell passed |\n| 1 | a cell failed |\n"
            "| 4 | bad configuration |\n| 130 / 143 | SIGINT / SIGTERM |\n\nAfter.\n")
    (table,) = exit_code_tables(text)
    assert table == {0: "every cell passed", 1: "a cell failed", 4: "bad configuration",
                     130: "SIGINT / SIGTERM", 143: "SIGINT / SIGTERM"}
    assert exit_code_problems(table, {0, 1, 2, 130, 143}) == [
        "exit code 2: not documented", "exit code 4: documented, but the CLI has no such code"]
    assert exit_code_problems({**table, 2: "a Docker engine"}, {0, 1, 2}) == [
        "exit code 4: documented, but the CLI has no such code",
        "exit code 130: documented, but the CLI has no such code",
        "exit code 143: documented, but the CLI has no such code",
        "exit code 2: its meaning does not say 'configuration': a Docker engine"]
    assert stated_exit_codes("Exit codes: 0 ok; 2 bad; 130 / 143 stopped.") == {0, 2, 130, 143}


# --------------------------------------------------------------------------- options

def cli_options() -> dict[str, dict[str, Any]]:
    """command -> {option (each of its spellings: --jobs, -j, --keep-going, --fail-fast): its click
    parameter}, from the CLI itself (typer.main.get_command)."""
    from typer.main import get_command

    from imagefactory.cli.app import app

    return {name: {opt: p for p in command.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("-")}
            for name, command in get_command(app).commands.items()}  # type: ignore[attr-defined]


_SHELL_END = re.compile(r"\s(?:\||&&|\|\||;|>|2>|#)\s|\s#")  # where the imagefactory invocation ends
_OPTION = re.compile(r"--?[A-Za-z][\w-]*")
_SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")  # a code span, also one that goes on to the next line


def command_lines(text: str, commands: set[str]) -> list[str]:
    """Every imagefactory command line a Markdown text shows: lines of fenced blocks, and code
    spans, that start with `imagefactory ` (or with a command name and an option: `build --push`);
    cut where the shell goes on (a pipe, `&&`, `;`, a redirect, a comment)."""
    found = []
    for block in _FENCE.finditer(text):
        found += block.group(0).replace("\\\n", " ").splitlines()[1:-1]
    found += [" ".join(span.split()) for span in _SPAN.findall(_FENCE.sub("", text))]
    lines = []
    for line in found:
        line = line.replace("\\|", "|").strip().removeprefix("$ ")
        first = line.split(" ", 1)[0]
        if not line.startswith("imagefactory "):
            if not (set(first.split("|")) <= commands and re.match(r"\S+ -", line)):
                continue
            line = "imagefactory " + line
        lines.append(_SHELL_END.split(line + " ", 1)[0].strip())
    return lines


def option_problems(line: str, options: dict[str, dict[str, Any]]) -> list[str]:
    """What in one documented command line the CLI does not have: a command, an option of that
    command, or (for `--opt a|b|c` of an option with choices) its choices."""
    words = [w.strip("[](),") for w in line.split()[1:]]
    if not words or words[0].startswith("-") or words[0].isupper():  # `imagefactory --help`, `COMMAND --help`
        return [f"{line}: {w}: not an option of imagefactory" for w in words if _OPTION.fullmatch(w) and w != "--help"]
    problems = []
    named = words[0].split("|")
    for command in named:
        if command not in options:
            problems.append(f"{line}: no command {command!r}")
    for i, word in enumerate(words[1:], 1):
        opt = word.split("=", 1)[0]
        if not _OPTION.fullmatch(opt) or opt == "--help":
            continue
        for command in (c for c in named if c in options):
            param = options[command].get(opt)
            if param is None:
                problems.append(f"{line}: {opt}: not an option of `imagefactory {command}`")
                continue
            choices = getattr(param.type, "choices", None)
            value = word.split("=", 1)[1] if "=" in word else (words[i + 1] if i + 1 < len(words) else "")
            if choices and "|" in value and set(value.split("|")) != set(choices):
                problems.append(f"{line}: {opt} {value}: the choices are {'|'.join(choices)}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_documented_command_line_has_the_clis_options(doc: Path) -> None:
    options = cli_options()
    lines = command_lines(doc.read_text(), set(options))
    assert [p for line in lines for p in option_problems(line, options)] == []


def section(text: str, heading: str) -> str:
    """The text under `## heading`, to the next `## `."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def bullet_options(text: str) -> list[tuple[str, str]]:
    """(option, what follows it in its code span) for each option a bullet of `text` leads with:
    the code spans before the bullet's first colon outside code (`--keep-going` (the default) or
    `--fail-fast`: ...)."""
    out = []
    for line in text.splitlines():
        if not line.startswith("- `"):
            continue
        for part in re.split(r"(`[^`]*`)", line[2:]):
            if part.startswith("`"):
                words = part.strip("`").split()
                if words and _OPTION.fullmatch(words[0]):
                    out.append((words[0], " ".join(words[1:])))
            elif ":" in part:
                break
    return out


def test_builders_md_documents_exactly_builds_options() -> None:
    """docs/builders.md's "`build` options" bullets lead with options `build` has (with its choices),
    and, with the paragraph above them (--matrix, --only), name every option `build` has."""
    text = BUILDERS_DOC.read_text()
    options = cli_options()
    build = options["build"]
    listed = bullet_options(section(text, "`build` options"))
    assert listed, "no option bullets found"
    problems = [p for opt, rest in listed for p in option_problems(f"imagefactory build {opt} {rest}", options)]
    assert problems == []
    page = text.split("\n## ", 1)[0] + section(text, "`build` options")
    mentioned = set(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", page))
    params = {id(p): p for p in build.values()}.values()
    missing = sorted(p.opts[0] for p in params if not mentioned & {*p.opts, *p.secondary_opts})
    assert missing == [], "build options docs/builders.md does not describe"


def test_builders_md_names_the_commands_that_take_matrix_and_only() -> None:
    intro = BUILDERS_DOC.read_text().split("\n## ", 1)[0]
    options = cli_options()
    without_matrix = re.search(r"`--matrix FILE`.*?every command but (.*?), and", intro, re.S)
    with_only = re.search(r"`--only CELL-ID`.*? on (.*?)\.", intro, re.S)
    assert without_matrix and with_only, "the sentence on --matrix and --only has changed: update this test"
    assert set(re.findall(r"`(\w+)`", without_matrix[1])) == {c for c, o in options.items() if "--matrix" not in o}
    assert set(re.findall(r"`(\w+)`", with_only[1])) == {c for c, o in options.items() if "--only" in o}


def test_the_option_check_finds_a_wrong_option_command_or_choice() -> None:
    options = cli_options()
    text = ("Run `imagefactory build --push --nope` or `test --retest`, then\n\n```sh\n"
            "imagefactory list --format table|xml   # a comment --not-checked\n"
            "imagefactory frobnicate --x | grep --count y\n```\n"
            "`docker buildx build --load` `imagefactory COMMAND --help` `imagefactory push --atomic`\n")
    lines = command_lines(text, set(options))
    assert lines == ["imagefactory list --format table|xml", "imagefactory frobnicate --x",
                     "imagefactory build --push --nope", "imagefactory test --retest",
                     "imagefactory COMMAND --help", "imagefactory push --atomic"]
    assert [p for line in lines for p in option_problems(line, options)] == [
        "imagefactory list --format table|xml: --format table|xml: the choices are table|json|github",
        "imagefactory frobnicate --x: no command 'frobnicate'",
        "imagefactory build --push --nope: --nope: not an option of `imagefactory build`"]
    assert bullet_options("- `-j N` (or `--jobs N`): cells\n- `--a` x: `--b`\n- plain `--c`\n") == [
        ("-j", "N"), ("--jobs", "N"), ("--a", "")]
