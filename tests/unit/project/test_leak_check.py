"""The suite's own leak check (tests/leaks.py): what a place holds after the run that it did not
hold before is named, once per place and kind; what it held before, or no longer holds, is not.
The check of a real run (an image, a /tmp file planted by hand) is in docs/testing.md."""

from __future__ import annotations

from tests import leaks


def test_what_a_place_gained_is_named_and_nothing_else():
    before = {"engine": leaks.Snapshot({"images": {"a", "b"}, "volumes": set()}),
              "/tmp": leaks.Snapshot({"entries": {"x"}})}
    after = {"engine": leaks.Snapshot({"images": {"a", "c"}, "volumes": set()}),
             "/tmp": leaks.Snapshot({"entries": {"x"}})}
    assert leaks.leaks(before, after) == ["engine: 1 new images left behind: c"]


def test_a_place_read_only_once_is_not_compared():
    before = {"engine": leaks.Snapshot({"images": {"a"}})}
    assert leaks.leaks(before, {}) == []
    assert leaks.leaks({}, {"engine": leaks.Snapshot({"images": {"a"}})}) == []


def test_a_long_list_is_cut_at_eight_with_the_count():
    before = {"r": leaks.Snapshot({"tags": set()})}
    after = {"r": leaks.Snapshot({"tags": {f"t{i:02d}" for i in range(12)}})}
    [line] = leaks.leaks(before, after)
    assert line.endswith("t07, ... (12 in all)") and "t08" not in line


def test_tmp_entries_are_read_but_pytests_own_folder_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(leaks, "TMP", tmp_path)
    (tmp_path / leaks.KEPT_TMP[0]).mkdir()
    readers = {"tmp": leaks._tmp}
    before = leaks.snapshot(readers)
    (tmp_path / "left-by-a-test").write_text("x")
    assert leaks.leaks(before, leaks.snapshot(readers)) == ["tmp: 1 new entries left behind: left-by-a-test"]


def test_a_place_that_does_not_answer_is_left_out():
    def broken() -> dict[str, set[str]]:
        raise OSError("no engine")

    assert leaks.snapshot({"engine": broken}) == {}
