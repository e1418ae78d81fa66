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
