"""cli/options.py: the shared flags, each declared once, parsed into the fields of each command's settings type."""

from __future__ import annotations

import dataclasses

import pytest

from imagefactory.cli import options
from imagefactory.config import matrix
from imagefactory.errors import ConfigError
from imagefactory.run import context
from tests.conftest import REPO

GOLDEN = REPO / "tests" / "golden" / "matrix.yaml"


def test_every_flag_sets_an_options_field_or_is_read_by_the_cli():
    fields = {f.name for kind in options.TYPES.values() for f in dataclasses.fields(kind)}
    for name in options.FLAGS:
        assert name in options.NOT_OPTIONS or options.FIELD.get(name, name) in fields, name


def test_settings_name_the_fields_and_invert_keep_going():
    got = options.settings({"matrix": GOLDEN, "only": None, "live": None, "keep_going": True, "push_tries": 3,
                            "retry_delay": 0.5, "jobs": 2}, {"push": True})
    assert got == {"fail_fast": False, "attempts": 3, "backoff": 0.5, "jobs": 2, "push": True}
    assert list(got)[-1] == "push"  # the fixed fields last: the summary line's order
    assert options.settings({"keep_going": False}, {}) == {"fail_fast": True}


def test_select_keeps_the_matrix_order_and_refuses_an_unknown_id():
    m = matrix.load(GOLDEN)
    ids = [c.id for c in m.cells]
    assert [c.id for c in options.select(m, None)] == ids
    assert [c.id for c in options.select(m, list(reversed(ids[:2])))] == ids[:2]
    with pytest.raises(ConfigError, match="--only no-such-cell: no such cell"):
        options.select(m, ["no-such-cell"])


def test_an_invocation_holds_the_fields_its_command_has_flags_for():
    inv = options._invocation("list", {"matrix": GOLDEN, "only": None}, {})
    assert inv.fields == () and inv.options == context.Settings() and inv.cells == list(inv.matrix.cells)
    inv = options._invocation("test", {"matrix": GOLDEN, "only": None, "jobs": 3, "keep_going": False}, {})
    assert inv.fields == ("jobs", "fail_fast") and inv.options.jobs == 3 and inv.options.fail_fast
    assert inv.summary().startswith(f"imagefactory test: {len(inv.cells)} cell(s) of ")


def _commands() -> dict[str, object]:
    """Every command of the app that takes shared flags, by the name options.TYPES knows it by."""
    from imagefactory.cli import app

    out = {}
    for info in app.app.registered_commands:
        fn = info.callback
        if hasattr(fn, "shared"):
            out[info.name or fn.__name__.replace("_", "-")] = fn
    return out


def test_each_command_type_holds_exactly_the_settings_its_flags_set():
    """A command's settings type holds the fields its @shared flags set, its fixed ones (push=True)
    and the few its type documents as set without a shared flag (NO_SHARED_FLAG): nothing else, so a
    step of one command cannot read another's settings (issue 33: bench has no push settings)."""
    commands = _commands()
    assert set(options.TYPES) <= set(commands)
    for name, fn in commands.items():
        names, fixed = fn.shared  # type: ignore[attr-defined]
        kind = options.TYPES.get(name, context.Settings)
        flagged = {options.FIELD.get(n, n) for n in names if n not in options.NOT_OPTIONS} | set(fixed)
        assert flagged.isdisjoint(kind.NO_SHARED_FLAG), name
        assert {f.name for f in dataclasses.fields(kind)} == flagged | set(kind.NO_SHARED_FLAG), name
    assert {f.name for f in dataclasses.fields(context.BenchOptions)} == {"work_dir", "gpus", "budget"}


def test_the_summary_line_keeps_the_order_of_the_old_options():
    """Every command's start line lists its settings in one order (context.ORDER), whatever the
    order its groups compose in: the line `build` printed before the split, byte for byte."""
    o = context.BuildOptions(jobs=3, gpus="none", cache_from=("a:1", "b:2"), push=True, sign="/k")  # type: ignore[arg-type]
    names = tuple(f.name for f in dataclasses.fields(o))
    assert o.summary(names) == (
        "work-dir=build report=build/report.json jobs=3 fail-fast=False gpus=none network=host pull=missing "
        "retest=False probe-shm=1g probe-timeout=300.0 cache-from=a:1,b:2 registry-cache=None verdicts-dir=None "
        "builder=classic buildx-builder=None netrc=None push=True atomic=False attempts=4 backoff=2.0 git-sha=None "
        "today=None sign=/k")
    assert context.MergeOptions(attempts=5).summary(("report", "attempts", "backoff", "push")) == \
        "report=build/report.json push=False attempts=5 backoff=2.0"
    assert set(context.ORDER) == {f.name for kind in options.TYPES.values() for f in dataclasses.fields(kind)}
