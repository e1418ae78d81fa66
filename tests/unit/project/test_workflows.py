"""GitHub Actions workflows: valid YAML, and every `imagefactory` / `bash X` line they run is real.

The checker (`check_workflow_text`) parses each `run:` script the way a shell would split it
(backslash continuations joined, `${{ ... }}` expressions replaced by a placeholder word,
`$( ... )` substitutions checked as commands of their own) and reports:

* `imagefactory <sub>` with a subcommand the CLI does not have;
* options that subcommand does not accept (introspected from the Typer app);
* `bash X` / `sh X` / `sudo [-E] bash X` / `./X` scripts that do not exist in the repository.

Supply chain: every action pinned to a commit SHA, no persisted checkout credentials, no `${{ }}`
inside `run:`, and `zizmor --offline` clean. And the README's test command is what `.ci/run` runs.

What GitHub itself would refuse: a key repeated in a mapping (YAML forbids it, PyYAML keeps the
last one silently; a workflow that repeats `schedule:` never starts, and zizmor does not say so),
anything GitHub's workflow JSON Schema rejects (check-jsonschema's offline copy,
`--builtin-schema vendor.github-workflows`), and a `with:` input the pinned action does not have
(ACTION_INPUTS, read from each action's action.yml at the pinned commit).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from imagefactory.cli.app import app

REPO = Path(__file__).resolve().parents[3]
WORKFLOW_DIR = REPO / ".github" / "workflows"
WORKFLOWS = sorted(p for p in WORKFLOW_DIR.glob("*") if p.suffix in (".yml", ".yaml"))

PLACEHOLDER = "GHA_EXPR"
_EXPR = re.compile(r"\$\{\{.*?\}\}", re.S)
_SUBST = re.compile(r"\$\(([^()]*)\)")
_SEPARATORS = {";", ";;", "&", "&&", "|", "||", "|&", "(", ")", "((", "))", "\n"}
_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}", "time"}
_PREFIXES = {"exec", "command", "nohup", "time"}
# sudo options that take a value (e.g. `sudo -u runner bash x`).
_SUDO_ARG_OPTS = {"-u", "-g", "-C", "-h", "-p", "-r", "-t", "-U", "-D"}
_SHELLS = {"bash", "sh"}
_SHELL_ARG_OPTS = {"-o", "-O", "--rcfile", "--init-file"}


# --------------------------------------------------------------------------- CLI model

def _cli_model():
    """{subcommand: {option: takes_value}} plus the root group's options."""
    group = typer.main.get_command(app)
    subs = {}
    for name, cmd in group.commands.items():
        opts = {"--help": False}
        for p in cmd.params:
            if getattr(p, "param_type_name", "option") != "option":
                continue
            takes_value = not (getattr(p, "is_flag", False) or getattr(p, "count", False))
            for o in list(p.opts) + list(p.secondary_opts):
                opts[o] = takes_value
        subs[name] = opts
    root = {"--help": False}
    for p in group.params:
        for o in list(p.opts) + list(p.secondary_opts):
            root[o] = not getattr(p, "is_flag", False)
    return root, subs


ROOT_OPTS, SUBCOMMANDS = _cli_model()


# --------------------------------------------------------------------------- shell splitting

def _normalise(script: str) -> str:
    script = _EXPR.sub(PLACEHOLDER, script)
    return re.sub(r"\\\r?\n", " ", script)


def _command_strings(script: str) -> list[str]:
    """Every logical line of the script, plus the bodies of `$( ... )` substitutions."""
    script = _normalise(script)
    found = []
    while True:
        m = _SUBST.search(script)
        if not m:
            break
        found.append(m.group(1))
        script = script[: m.start()] + PLACEHOLDER + script[m.end():]
    return [line for text in [script, *found] for line in text.splitlines() if line.strip()]


def _simple_commands(line: str) -> list[list[str]]:
    """Split one line into simple commands (word lists), dropping redirections."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        tokens = list(lex)
    except ValueError as e:  # unbalanced quotes, a heredoc body, ...
        raise _Unparsable(f"{e}: {line!r}") from None
    commands, words, skip_next = [], [], False
    for tok in tokens:
        if skip_next:
            skip_next = False
            continue
        if tok in _SEPARATORS:
            if words:
                commands.append(words)
            words = []
        elif tok and set(tok) <= set("<>&"):
            skip_next = True  # redirection: the next word is its target
            if words and words[-1].isdigit():
                words.pop()  # the fd number in `2> file`
        else:
            words.append(tok)
    if words:
        commands.append(words)
    return commands


class _Unparsable(Exception):
    pass


def _strip_prefixes(words: list[str]) -> list[str]:
    """Drop `FOO=bar`, `sudo [-E] [-u user]`, `env ...`, `exec` and shell keywords in front."""
    i = 0
    while i < len(words):
        w = words[i]
        if w in _KEYWORDS or w in _PREFIXES or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w):
            i += 1
        elif w in ("sudo", "env"):
            i += 1
            while i < len(words) and (words[i].startswith("-") or (w == "env" and "=" in words[i])):
                i += 2 if (w == "sudo" and words[i] in _SUDO_ARG_OPTS) else 1
        else:
            break
    return words[i:]


# --------------------------------------------------------------------------- the checker

def _check_imagefactory(words: list[str]) -> list[str]:
    problems, shown = [], " ".join(words)
    args = words[1:]
    if not args:
        return problems
    sub = args[0]
    if sub.startswith("-"):
        allowed, rest, where = ROOT_OPTS, args, "imagefactory"
    elif sub not in SUBCOMMANDS:
        return [f"unknown subcommand {sub!r} (have {sorted(SUBCOMMANDS)}): {shown}"]
    else:
        allowed, rest, where = SUBCOMMANDS[sub], args[1:], f"imagefactory {sub}"
    i = 0
    while i < len(rest):
        tok = rest[i]
        i += 1
        if tok == "--":
            break
        if tok.startswith("--"):
            name = tok.split("=", 1)[0]
            if name not in allowed:
                problems.append(f"{where}: unknown option {name!r}: {shown}")
            elif allowed[name] and "=" not in tok:
                i += 1  # its value
        elif tok.startswith("-") and len(tok) > 1:
            name = tok[:2]
            if name not in allowed:
                problems.append(f"{where}: unknown option {tok!r}: {shown}")
            elif allowed[name] and len(tok) == 2:
                i += 1
        elif "$" not in tok and PLACEHOLDER not in tok:
            problems.append(f"{where}: unexpected argument {tok!r}: {shown}")
    return problems


def _check_script_ref(words: list[str], base: Path) -> list[str]:
    cmd = words[0]
    if cmd in _SHELLS:
        i = 1
        while i < len(words) and words[i].startswith("-"):
            if not words[i].startswith("--") and "c" in words[i][1:]:
                return []  # inline script, nothing to look up
            i += 2 if words[i] in _SHELL_ARG_OPTS else 1
        if i >= len(words):
            return []
        target = words[i]
    elif cmd.startswith("./"):
        target = cmd
    else:
        return []
    if "$" in target or PLACEHOLDER in target or target.startswith("/"):
        return []
    if not (base / target).is_file():
        return [f"script {target!r} does not exist (relative to {base}): {' '.join(words)}"]
    return []


def check_run_script(script: str, base: Path = REPO) -> list[str]:
    problems = []
    for line in _command_strings(script):
        try:
            commands = _simple_commands(line)
        except _Unparsable as e:
            problems.append(f"cannot split shell line: {e}")
            continue
        for words in commands:
            words = _strip_prefixes(words)
            if not words:
                continue
            if Path(words[0]).name == "imagefactory":
                problems += _check_imagefactory(words)
            problems += _check_script_ref(words, base)
    return problems


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key that appears twice in one mapping (YAML 1.2 forbids
    it; PyYAML keeps the last value without a word; GitHub refuses the workflow)."""


def _unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor`: the keys it brings may be overridden, by design
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark)
        except TypeError:
            continue  # an unhashable key: construct_mapping reports it
        if first is not key_node.start_mark:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {key_node.value!r} (first on line {first.line + 1})", key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_workflow(text: str):
    return yaml.load(text, Loader=UniqueKeyLoader)


def triggers(doc: dict):
    """PyYAML (YAML 1.1) reads the bare key `on` as the boolean True."""
    return doc.get("on", doc.get(True))


def check_workflow_text(text: str, repo: Path = REPO) -> list[str]:
    """All problems found in one workflow file's text (empty list: fine)."""
    try:
        doc = load_workflow(text)
    except yaml.YAMLError as e:
        return [f"not valid YAML: {e}"]
    if not isinstance(doc, dict):
        return ["top level is not a mapping"]
    problems = []
    if not triggers(doc):
        problems.append("no `on:` triggers")
    jobs = doc.get("jobs")
    if not isinstance(jobs, dict) or not jobs:
        return problems + ["no jobs"]
    for job_id, job in jobs.items():
        if not isinstance(job, dict):
            problems.append(f"job {job_id}: not a mapping")
            continue
        if "uses" in job:  # reusable workflow call
            continue
        steps = job.get("steps")
        if not isinstance(steps, list) or not steps:
            problems.append(f"job {job_id}: no steps")
            continue
        needs = job.get("needs", [])
        for need in [needs] if isinstance(needs, str) else needs:
            if need not in jobs:
                problems.append(f"job {job_id}: needs unknown job {need!r}")
        job_wd = ((job.get("defaults") or {}).get("run") or {}).get("working-directory")
        job_shell = ((job.get("defaults") or {}).get("run") or {}).get("shell", "bash")
        for n, step in enumerate(steps):
            where = f"job {job_id} step {step.get('name') or step.get('id') or n}"
            if not isinstance(step, dict) or ("run" in step) == ("uses" in step):
                problems.append(f"{where}: needs exactly one of run/uses")
                continue
            if "uses" in step:
                uses = step["uses"]
                if not uses.startswith(("./", "docker://")) and "@" not in uses:
                    problems.append(f"{where}: action {uses!r} is not pinned to a version")
                continue
            shell = str(step.get("shell", job_shell))
            if not (shell.startswith("bash") or shell.startswith("sh")):
                continue
            wd = step.get("working-directory", job_wd)
            base = repo / _EXPR.sub(PLACEHOLDER, wd) if wd else repo
            problems += [f"{where}: {p}" for p in check_run_script(str(step["run"]), base)]
    return problems


# --------------------------------------------------------------------------- the repository's workflows

def _load(path: Path) -> dict:
    return load_workflow(path.read_text())


def test_there_are_workflows():
    names = {p.name for p in WORKFLOWS}
    assert {"ci.yml", "publish.yml"} <= names, names


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_is_clean(path):
    assert check_workflow_text(path.read_text()) == []


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_has_minimal_top_level_permissions(path):
    perms = _load(path).get("permissions")
    assert isinstance(perms, dict), "declare top-level permissions explicitly"
    assert perms.get("contents") == "read"
    assert set(perms.values()) <= {"read", "none", "write"}
    writes = {k for k, v in perms.items() if v == "write"}
    assert writes <= {"packages"}, writes


def test_ci_workflow_shape():
    doc = _load(WORKFLOW_DIR / "ci.yml")
    on = triggers(doc)
    assert "pull_request" in on and "main" in on["push"]["branches"]
    jobs = doc["jobs"]
    assert {"lint-and-unit", "small-matrix"} <= set(jobs)
    assert jobs["small-matrix"]["needs"] in ("lint-and-unit", ["lint-and-unit"])
    runs = "\n".join(s.get("run", "") for s in jobs["lint-and-unit"]["steps"])
    assert "imagefactory render" in runs and "hadolint" in runs and "pytest tests/unit" in runs
    # the unit suite runs these (test_lint.py, this module): not again as steps of their own
    assert not re.search(r"\b(ruff|mypy|zizmor|check-jsonschema)\b", runs), runs
    assert "concurrency" in doc


def test_publish_matrix_comes_from_plan():
    doc = _load(WORKFLOW_DIR / "publish.yml")
    on = triggers(doc)
    assert "workflow_dispatch" in on and "v*" in on["push"]["tags"]
    # weekly, so moved base tags reach users without a matrix change (issue 9)
    assert any(re.fullmatch(r"\S+ \S+ \* \* [0-6]", s.get("cron", "")) for s in on.get("schedule") or []), on
    plan, cell = doc["jobs"]["plan"], doc["jobs"]["cell"]
    strategy = cell["strategy"]
    assert strategy["fail-fast"] is False
    assert re.fullmatch(r"\$\{\{\s*fromJSON\(needs\.plan\.outputs\.matrix\)\s*\}\}", strategy["matrix"])
    assert cell["needs"] in ("plan", ["plan"])
    # plan's output is wired to a step that exists and runs `imagefactory list --format github`.
    m = re.fullmatch(r"\$\{\{\s*steps\.([\w-]+)\.outputs\.matrix\s*\}\}", plan["outputs"]["matrix"])
    assert m, plan["outputs"]
    step = next(s for s in plan["steps"] if s.get("id") == m.group(1))
    assert re.search(r"imagefactory list .*--format github", step["run"])
    assert "GITHUB_OUTPUT" in step["run"]
    summary = doc["jobs"]["summary"]
    assert summary["needs"] in ("cell", ["cell"]) and "always()" in summary["if"]


def test_publish_uses_only_matrix_keys_that_list_emits():
    """`matrix.X` in the cell job must be a key of every entry `imagefactory list --format github` prints."""
    text = (WORKFLOW_DIR / "publish.yml").read_text()
    exprs = " ".join(_EXPR.findall(text))
    used = set(re.findall(r"\bmatrix\.([A-Za-z_][\w-]*)", exprs))
    assert {"cell", "tag"} <= used
    result = CliRunner().invoke(app, ["list", "--matrix", str(REPO / "matrix.yaml"), "--format", "github"])
    assert result.exit_code == 0, result.output
    include = json.loads(result.stdout)["include"]
    assert include
    for entry in include:
        assert used <= set(entry), used - set(entry)


# --------------------------------------------------------------------------- the checker can fail

CRAFTED = """
on: push
jobs:
  x:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - run: |
          imagefactory build --matrix matrix.yaml --only ${{ matrix.cell }} \\
            --no-such-option --plain
"""


def test_checker_reports_bogus_option():
    problems = check_workflow_text(CRAFTED)
    assert len(problems) == 1, problems
    assert "--no-such-option" in problems[0] and "imagefactory build" in problems[0]


def test_checker_accepts_the_same_line_without_the_bogus_option():
    assert check_workflow_text(CRAFTED.replace("--no-such-option ", "")) == []


@pytest.mark.parametrize(
    "script, needle",
    [
        ("imagefactory frobnicate --matrix m.yaml", "unknown subcommand 'frobnicate'"),
        ("imagefactory list --push", "'--push'"),  # exists on build, not on list
        ("imagefactory render -x", "'-x'"),
        ('echo "m=$(imagefactory list --fromat github)" >> "$GITHUB_OUTPUT"', "'--fromat'"),
        ("set -e; imagefactory test --gpus none && imagefactory push --jobs 2", "'--jobs'"),
        ("imagefactory build stray-word", "unexpected argument 'stray-word'"),
        ("sudo -E bash scripts/no-such-script.sh", "scripts/no-such-script.sh"),
        ("bash -eu .ci/nope", ".ci/nope"),
        ("FOO=1 ./scripts/missing.sh --x", "./scripts/missing.sh"),
        ("echo 'unbalanced", "cannot split"),
    ],
)
def test_checker_reports(script, needle):
    problems = check_run_script(script)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize(
    "script",
    [
        "imagefactory build -m matrix.yaml -j 2 --fail-fast --report=build/r.json --gpus none",
        "imagefactory --help",
        "imagefactory list --only ${{ matrix.cell }} --format github 2>&1 | tee out.json",
        "sudo -E bash scripts/ci-setup.sh",
        "bash -c 'anything goes here'",
        "# imagefactory build --bogus  (a comment)",
        "docker pull ${{ matrix.tag }} || true",
        'echo "--not-an-option imagefactory"',
    ],
)
def test_checker_accepts(script):
    assert check_run_script(script) == []


def test_on_key_is_read_despite_yaml_1_1():
    doc = yaml.safe_load("on: [push]\njobs: {}\n")
    assert triggers(doc) == ["push"]
    assert "no `on:` triggers" in check_workflow_text("name: x\njobs:\n  a:\n    steps: [{run: 'true'}]\n")


def test_checker_reports_invalid_yaml_and_missing_steps():
    assert check_workflow_text("on: push\njobs: [unclosed\n")[0].startswith("not valid YAML")
    assert any("no steps" in p for p in check_workflow_text("on: push\njobs:\n  a:\n    runs-on: x\n"))


# --------------------------------------------------------------------------- supply chain: pins and zizmor

_PINNED_USES = re.compile(r"[\w.-]+/[\w./-]+@[0-9a-f]{40} # v\d+\.\d+\.\d+")


def pinning_problems(text: str) -> list[str]:
    """Every `uses:` pinned to a full commit SHA with its `# vX.Y.Z`; every checkout without
    persisted credentials; no `${{ }}` spliced into a `run:` script."""
    problems = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:-\s+)?uses:\s*(.*?)\s*$", line)
        if m and not m.group(1).startswith(("./", "docker://")) and not _PINNED_USES.fullmatch(m.group(1)):
            problems.append(f"not pinned to a commit SHA with a version comment: {m.group(1)}")
    doc = load_workflow(text)
    for job_id, job in (doc.get("jobs") or {}).items():
        for step in job.get("steps") or []:
            if str(step.get("uses", "")).startswith("actions/checkout@"):
                if (step.get("with") or {}).get("persist-credentials") is not False:
                    problems.append(f"job {job_id}: checkout persists credentials")
            if "run" in step and _EXPR.search(str(step["run"])):
                problems.append(f"job {job_id}: ${{{{ }}}} inside run: (pass it through env:)")
    return problems


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_pins_actions_and_keeps_expressions_out_of_scripts(path):
    assert pinning_problems(path.read_text()) == []


@pytest.mark.parametrize(
    "step, needle",
    [
        ("- uses: actions/checkout@v4\n        with: {persist-credentials: false}", "not pinned"),
        ("- uses: actions/checkout@11d5960a326750d5838078e36cf38b85af677262", "not pinned"),
        ("- uses: actions/checkout@11d5960a326750d5838078e36cf38b85af677262 # v4.4.0", "persists credentials"),
        ("- run: echo ${{ github.event.pull_request.title }}", "inside run"),
    ],
)
def test_pinning_checker_reports(step, needle):
    text = f"on: push\njobs:\n  a:\n    runs-on: x\n    steps:\n      {step}\n"
    assert any(needle in p for p in pinning_problems(text)), pinning_problems(text)


def test_publish_runs_weekly_and_caches_no_pip():
    """Base-image fixes reach users without a matrix change; a publish job restores no cache."""
    doc = _load(WORKFLOW_DIR / "publish.yml")
    assert any(s.get("cron") for s in triggers(doc)["schedule"])
    for job in doc["jobs"].values():
        for step in job["steps"]:
            assert "cache" not in (step.get("with") or {}), step


def test_publish_pulls_no_previous_image_and_builds_with_the_registry_cache():
    """The registry is the cache (issue 16): no step pulls a whole previous image; the build
    pushes, which turns the registry cache on, and does not turn it off."""
    doc = _load(WORKFLOW_DIR / "publish.yml")
    runs = [str(step.get("run", "")) for job in doc["jobs"].values() for step in job["steps"]]
    assert not [r for r in runs if "docker pull" in r or "docker image pull" in r], runs
    builds = [r for r in runs if "imagefactory build" in r]
    assert builds and all("--push" in r and "--no-registry-cache" not in r for r in builds), builds
    # the registry's inline cache is BuildKit's: the classic builder would use only local images
    assert all("--builder auto" in r or "--builder buildkit" in r for r in builds), builds


def _zizmor() -> str:
    exe = shutil.which("zizmor") or str(Path(sys.executable).parent / "zizmor")
    if not Path(exe).is_file():
        if os.environ.get("CI"):
            pytest.fail("zizmor is not installed (it is in the test extra: pip install -e '.[test]')")
        pytest.skip("zizmor is not installed; pip install -e '.[test]'")
    return exe


def _zizmor_findings(directory: Path) -> tuple[int, list[str]]:
    proc = subprocess.run([_zizmor(), "--offline", "--format", "json", str(directory)],
                          capture_output=True, text=True, timeout=120)
    findings = json.loads(proc.stdout or "[]")
    return proc.returncode, [f"{f['ident']}: {f.get('desc', '')}" for f in findings]


def test_workflows_are_clean_under_zizmor():
    code, findings = _zizmor_findings(WORKFLOW_DIR)
    assert (code, findings) == (0, [])


def test_zizmor_reports_a_crafted_unsafe_workflow(tmp_path):
    """The zizmor test can fail: the unsafe patterns the workflows avoid are reported."""
    wf = tmp_path / ".github" / "workflows"
    wf.mkdir(parents=True)
    (wf / "bad.yml").write_text(
        "on: push\npermissions: {}\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - uses: actions/checkout@v4\n"
        "      - run: echo \"${{ github.event.head_commit.message }}\"\n")
    code, findings = _zizmor_findings(wf)
    idents = {f.split(":")[0] for f in findings}
    assert code != 0 and {"unpinned-uses", "artipacked", "template-injection"} <= idents, findings


# --------------------------------------------------------------------------- README's commands and .ci/run

CI_RUN = REPO / ".ci" / "run"


def readme_command(section: str) -> str:
    """The one shell block of a README section."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```sh\n(.*?)\n```", body, re.S)
    return block.strip()


def test_ci_run_runs_exactly_the_readme_test_command():
    command = readme_command("Running the tests")
    assert "\n" not in command
    # One line that sets up, installs the test extra (hadolint, zizmor) and runs pytest.
    assert re.fullmatch(r"bash scripts/ci-setup\.sh && python3 -m pip install .*'\.\[test\]' && python3 -m pytest -q",
                        command), command
    lines = [ln for ln in CI_RUN.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[-1] == command
    assert check_run_script(command) == []


def test_readme_commands_need_no_sudo():
    for section in ("Quickstart", "Running the tests"):
        assert "sudo" not in readme_command(section)
    assert check_run_script(readme_command("Quickstart")) == []


def test_ci_run_exits_with_pytest_status(tmp_path):
    """.ci/run, with the setup and python3 stubbed: pytest's exit status is the script's, and a failed
    setup stops it before pytest."""
    (tmp_path / ".ci").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(CI_RUN, tmp_path / ".ci" / "run")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "python3"
    stub.write_text('#!/bin/sh\necho "$*" >> "$LOG"\ncase "$*" in *pytest*) exit "$PYTEST_RC";; esac\n')
    stub.chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "LOG": str(tmp_path / "log")}

    def run(setup_rc: int, pytest_rc: int) -> int:
        (tmp_path / "scripts" / "ci-setup.sh").write_text(f"exit {setup_rc}\n")
        (tmp_path / "log").write_text("")
        return subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env={**env, "PYTEST_RC": str(pytest_rc)},
                              timeout=60).returncode

    assert run(0, 0) == 0
    assert (tmp_path / "log").read_text().splitlines() == ["-m pip install -q -e .[test]", "-m pytest -q"]
    assert run(0, 5) == 5
    assert run(3, 0) == 3 and (tmp_path / "log").read_text() == ""


# --------------------------------------------------------------------------- what GitHub would refuse

# publish.yml as it once was: `schedule:` twice under `on:`. GitHub refuses the file, so the
# workflow never starts; PyYAML's safe_load and zizmor both accept it.
DUPLICATE_TRIGGER = """\
on:
  schedule:
    - cron: "17 4 * * 1"
  workflow_dispatch:
  schedule:
    - cron: "17 4 * * 1"
permissions:
  contents: read
jobs:
  a:
    runs-on: ubuntu-latest
    steps:
      - run: echo hi
"""


def test_workflows_have_no_duplicate_keys():
    for path in WORKFLOWS:
        load_workflow(path.read_text())  # raises on a repeated key


def test_a_repeated_key_is_refused_where_pyyaml_would_keep_the_last():
    assert "schedule" in triggers(yaml.safe_load(DUPLICATE_TRIGGER))  # what a plain loader lets through
    problems = check_workflow_text(DUPLICATE_TRIGGER)
    assert len(problems) == 1 and "duplicate key 'schedule' (first on line 2)" in problems[0], problems
    once = DUPLICATE_TRIGGER.replace('  schedule:\n    - cron: "17 4 * * 1"\npermissions', "permissions")
    assert check_workflow_text(once) == []
    nested = once.replace("      - run: echo hi\n", "      - run: echo hi\n        run: echo ho\n")
    problems = check_workflow_text(nested)
    assert len(problems) == 1 and "duplicate key 'run' (first on line 11)" in problems[0], problems


def test_merge_keys_may_override_what_they_bring():
    text = "x: &base {a: 1, b: 2}\ny:\n  <<: *base\n  a: 3\n"
    assert load_workflow(text)["y"] == {"a": 3, "b": 2}


def _check_jsonschema() -> list[str]:
    try:
        import check_jsonschema  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("check-jsonschema is not installed (it is in the test extra: pip install -e '.[test]')")
        pytest.skip("check-jsonschema is not installed; pip install -e '.[test]'")
    return [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
            "--output-format", "json"]


def schema_problems(paths: list[Path]) -> list[str]:
    """What GitHub's workflow JSON Schema (check-jsonschema's offline copy, `--builtin-schema
    vendor.github-workflows`) says about each file; files that do not parse are problems too."""
    proc = subprocess.run([*_check_jsonschema(), *map(str, paths)], capture_output=True, text=True, timeout=120)
    result = json.loads(proc.stdout)
    problems = [f"{e['filename']}: {e['path']}: {(e.get('best_match') or e)['message']}" for e in result["errors"]]
    problems += [f"{e['filename']}: {e['message']}" for e in result.get("parse_errors", [])]
    assert (proc.returncode == 0) == (problems == []), (proc.returncode, proc.stdout, proc.stderr)
    return problems


def test_workflows_match_githubs_workflow_schema():
    assert schema_problems(WORKFLOWS) == []


@pytest.mark.parametrize("text, needle", [
    (DUPLICATE_TRIGGER, "Failed to parse"),
    ("on: push\njobs:\n  a:\n    runs-on: x\n    timeout-minute: 5\n    steps: [{run: echo}]\n", "'timeout-minute'"),
    ("on: psuh\njobs:\n  a:\n    runs-on: x\n    steps: [{run: echo}]\n", "$.on"),
    ("on: push\njobs:\n  a:\n    runs-on: x\n    steps: [{run: echo, uses: actions/checkout@v4}]\n", "$.jobs.a"),
    ("on: push\npermissions: {contents: maybe}\njobs:\n  a:\n    runs-on: x\n    steps: [{run: echo}]\n",
     "$.permissions"),
])
def test_the_schema_check_refuses_a_broken_workflow(tmp_path, text, needle):
    path = tmp_path / "bad.yml"
    path.write_text(text)
    problems = schema_problems([path])
    assert problems and any(needle in p for p in problems), problems


# The inputs of every action the workflows use, read from the action's action.yml at the pinned
# commit (each `# vX.Y.Z` tag points at that commit): https://github.com/OWNER/REPO/blob/SHA/action.yml.
# A new action, or a new pin, needs its row here; `choices` are the values its description lists.
ACTION_INPUTS: dict[str, dict] = {
    "actions/checkout@11d5960a326750d5838078e36cf38b85af677262": {
        "version": "v4.4.0", "required": set(),
        "inputs": {"repository", "ref", "token", "ssh-key", "ssh-known-hosts", "ssh-strict", "ssh-user",
                   "persist-credentials", "path", "clean", "filter", "sparse-checkout",
                   "sparse-checkout-cone-mode", "fetch-depth", "fetch-tags", "show-progress", "lfs",
                   "submodules", "set-safe-directory", "github-server-url", "allow-unsafe-pr-checkout"},
        "choices": {}},
    "actions/setup-python@a26af69be951a213d495a4c3e4e4022e16d87065": {
        "version": "v5.6.0", "required": set(),
        "inputs": {"python-version", "python-version-file", "cache", "architecture", "check-latest", "token",
                   "cache-dependency-path", "update-environment", "allow-prereleases", "freethreaded"},
        "choices": {"cache": {"pip", "pipenv", "poetry"}}},
    "docker/login-action@c94ce9fb468520275223c153574b00df6fe4bcc9": {
        "version": "v3.7.0", "required": set(),
        "inputs": {"registry", "username", "password", "ecr", "scope", "logout", "registry-auth"},
        "choices": {}},
    "actions/upload-artifact@ea165f8d65b6e75b540449e92b4886f43607fa02": {
        "version": "v4.6.2", "required": {"path"},
        "inputs": {"name", "path", "if-no-files-found", "retention-days", "compression-level", "overwrite",
                   "include-hidden-files"},
        "choices": {"if-no-files-found": {"warn", "error", "ignore"}}},
    "actions/download-artifact@d3f86a106a0bac45b974a628896c90dbdf5c8093": {
        "version": "v4.3.0", "required": set(),
        "inputs": {"name", "artifact-ids", "path", "pattern", "merge-multiple", "github-token", "repository",
                   "run-id"},
        "choices": {}},
}


def used_actions(text: str) -> dict[str, str]:
    """`uses:` references of the steps, with the version each one's comment names."""
    found = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:-\s+)?uses:\s*(\S+)(?:\s+#\s*(\S+))?\s*$", line)
        if m and not m.group(1).startswith(("./", "docker://")):
            found[m.group(1)] = m.group(2) or ""
    return found


def action_input_problems(text: str) -> list[str]:
    """Every `uses:` step names an action of ACTION_INPUTS at the version its comment says,
    passes only inputs that action has (with a listed value where it lists them), and every
    input it requires."""
    problems = []
    for ref, comment in used_actions(text).items():
        row = ACTION_INPUTS.get(ref)
        if row and comment != row["version"]:
            problems.append(f"{ref}: the comment says {comment or 'nothing'}, the pinned commit is {row['version']}")
    for job_id, job in (load_workflow(text).get("jobs") or {}).items():
        for n, step in enumerate(job.get("steps") or []):
            ref = step.get("uses")
            if not ref or ref.startswith(("./", "docker://")):
                continue
            where = f"job {job_id} step {step.get('name') or n} ({ref.split('@')[0]})"
            row = ACTION_INPUTS.get(ref)
            if row is None:
                problems.append(f"{where}: {ref} is not in ACTION_INPUTS: read its action.yml at that commit")
                continue
            given = step.get("with") or {}
            problems += [f"{where}: no input {k!r} (it has {sorted(row['inputs'])})"
                         for k in given if k not in row["inputs"]]
            problems += [f"{where}: required input {k!r} missing" for k in sorted(row["required"] - set(given))]
            for k, allowed in row["choices"].items():
                value = given.get(k)
                if isinstance(value, str) and "${{" not in value and value not in allowed:
                    problems.append(f"{where}: {k}: {value!r} is not one of {sorted(allowed)}")
    return problems


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_passes_only_inputs_the_pinned_actions_have(path):
    assert action_input_problems(path.read_text()) == []


def test_every_row_of_the_input_table_is_used():
    used = {ref for path in WORKFLOWS for ref in used_actions(path.read_text())}
    assert set(ACTION_INPUTS) == used, set(ACTION_INPUTS) ^ used


UPLOAD = "actions/upload-artifact@ea165f8d65b6e75b540449e92b4886f43607fa02"


@pytest.mark.parametrize("step, needle", [
    (f"- uses: {UPLOAD} # v4.6.2\n        with: {{path: x, retention_days: 3}}", "no input 'retention_days'"),
    (f"- uses: {UPLOAD} # v4.6.2\n        with: {{name: x}}", "required input 'path' missing"),
    (f"- uses: {UPLOAD} # v4.6.2\n        with: {{path: x, if-no-files-found: fail}}", "'fail' is not one of"),
    (f"- uses: {UPLOAD} # v4.5.0\n        with: {{path: x}}", "the pinned commit is v4.6.2"),
    ("- uses: actions/cache@0400d5f644dc74513175e3cd8d07132dd4860809 # v4.2.4\n        with: {path: x}",
     "not in ACTION_INPUTS"),
])
def test_the_input_check_refuses_a_broken_step(step, needle):
    text = f"on: push\njobs:\n  a:\n    runs-on: x\n    steps:\n      {step}\n"
    problems = action_input_problems(text)
    assert len(problems) == 1 and needle in problems[0], problems
    assert action_input_problems(text.replace(step, f"- uses: {UPLOAD} # v4.6.2\n        with: {{path: x}}")) == []


# --------------------------------------------------------------------------- per-platform jobs and the merge

def _runner(cell_job: dict, platform: str) -> str:
    """The runner the cell job's `runs-on` expression picks for a cell of `platform`: the expression
    `matrix.platform == 'P' && 'R' || 'D'` evaluated as GitHub would (a literal is taken as is)."""
    runs_on = cell_job["runs-on"]
    m = re.fullmatch(r"\$\{\{\s*matrix\.platform\s*==\s*'([^']+)'\s*&&\s*'([^']+)'\s*\|\|\s*'([^']+)'\s*\}\}",
                     runs_on)
    if m is None:
        return runs_on
    return m.group(2) if platform == m.group(1) else m.group(3)


def test_each_cell_job_runs_on_a_native_runner_of_its_platform():
    doc = _load(WORKFLOW_DIR / "publish.yml")
    result = CliRunner().invoke(app, ["list", "--matrix", str(REPO / "matrix.yaml"), "--format",
                                      "github"])
    assert result.exit_code == 0, result.output
    assert {e["platform"] for e in json.loads(result.stdout)["include"]} <= {"linux/amd64", "linux/arm64"}
    assert _runner(doc["jobs"]["cell"], "linux/arm64") == "ubuntu-24.04-arm"
    assert _runner(doc["jobs"]["cell"], "linux/amd64") == "ubuntu-latest"


def test_the_merge_job_runs_after_every_cell_job_and_merges_their_reports():
    doc = _load(WORKFLOW_DIR / "publish.yml")
    merge = doc["jobs"]["merge"]
    needs = [merge["needs"]] if isinstance(merge["needs"], str) else merge["needs"]
    assert "cell" in needs and "always()" in merge["if"]  # a failed cell job refuses its list, by name
    download = next(s for s in merge["steps"] if s.get("uses", "").startswith("actions/download-artifact@"))
    folder = download["with"]["path"]
    # the artifacts the cell jobs upload are the ones the merge job downloads
    upload = next(s for s in doc["jobs"]["cell"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    prefix = download["with"]["pattern"].rstrip("*")
    assert upload["with"]["name"].startswith(prefix) and "report-" in upload["with"]["path"]
    runs = [s["run"] for s in merge["steps"] if "imagefactory merge" in s.get("run", "")]
    assert len(runs) == 1 and re.search(rf"--reports\s+{re.escape(folder)}\b", runs[0]), runs
    assert "--matrix matrix.yaml" in runs[0]
    # the registry login reaches the command through env:, from the secrets, as the cell job's does
    assert merge["env"] == doc["jobs"]["cell"]["env"]
    assert "permissions" not in merge  # the workflow's contents: read holds


def test_the_runner_check_can_fail():
    job = {"runs-on": "${{ matrix.platform == 'linux/arm64' && 'ubuntu-latest' || 'ubuntu-latest' }}"}
    assert _runner(job, "linux/arm64") != "ubuntu-24.04-arm"
    assert _runner({"runs-on": "ubuntu-latest"}, "linux/arm64") == "ubuntu-latest"
