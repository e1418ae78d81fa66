"""report.html in a real browser: Debian's chromium, headless, renders the catalogue of
tests/fixtures/report/ (two cells of a real report, the second failing `torch.compile` in the
`hpc` launch mode) from a file:// URL, as a CI artifact is opened. The test reads the DOM as the
browser built it and keeps a screenshot in build/catalog.png (uploaded with the CI artifacts).

No engine is needed. Without chromium this is skipped locally and fails in CI
(scripts/ci-setup.sh installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from imagefactory.report import catalog
from tests.integration.helpers import unavailable

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "report"
SCREENSHOT = REPO / "build" / "catalog.png"


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless chromium with a new, empty profile and nothing it would fetch on its own."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        unavailable("no chromium (apt-get install -y chromium)")
    profile.mkdir(exist_ok=True)
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run",
                           f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120)


class Dom(HTMLParser):
    """The elements of the browser's DOM dump: (tag, attributes, text inside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str], list[str]]] = []
        self._open: list[int] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}, []))
        if tag not in ("meta", "br", "img", "link", "input"):
            self._open.append(len(self.elements) - 1)

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self.elements[self._open.pop()][0] == tag:
                break

    def handle_data(self, data: str) -> None:
        for i in self._open:
            self.elements[i][2].append(data)

    def find(self, tag: str, **attrs: str) -> list[tuple[dict[str, str], str]]:
        return [(a, " ".join("".join(text).split())) for t, a, text in self.elements
                if t == tag and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[Dom, dict]:
    root = tmp_path_factory.mktemp("catalog")
    for name in ("report.json", "bench.json"):
        shutil.copy(FIXTURE / name, root / name)
    html = catalog.write(catalog.read_report(root / "report.json"), root / "report.json")
    url = html.as_uri()
    SCREENSHOT.parent.mkdir(exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    shot = chromium(root / "profile-shot", "--hide-scrollbars", "--window-size=1280,2400",
                    f"--screenshot={SCREENSHOT}", url)
    assert SCREENSHOT.exists() and SCREENSHOT.stat().st_size > 10_000, shot.stderr[-2000:]
    dumped = chromium(root / "profile-dom", "--dump-dom", url)
    assert dumped.returncode == 0 and "</html>" in dumped.stdout, dumped.stderr[-2000:]
    dom = Dom()
    dom.feed(dumped.stdout)
    return dom, json.loads((root / "report.json").read_text())


def test_the_grid_holds_every_cell(page):
    dom, doc = page
    (grid, _), = dom.find("table", id="matrix-grid")
    tiles = {a["data-cell"]: a["data-verdict"] for a, _ in dom.find("a") if "data-cell" in a}
    assert sorted(tiles) == sorted(c["cell"] for c in doc["cells"])
    headers = [text for _, text in dom.find("th")]
    assert headers[:2] == ["Python", "CPU"] and "3.11" in headers and "3.12" in headers


def test_the_failed_cell_shows_as_failed_with_its_failing_checks(page):
    dom, doc = page
    failed = [c for c in doc["cells"] if c["status"] == "check-failed"]
    assert [c["cell"] for c in failed] == ["py3.12-cpu-openblas-pip"]
    tiles = {a["data-cell"]: (a, text) for a, text in dom.find("a") if "data-cell" in a}
    attrs, text = tiles["py3.12-cpu-openblas-pip"]
    assert attrs["data-verdict"] == "fail" and "verdict-fail" in attrs["class"].split()
    assert "check-failed" in text and "hpc: torch.compile" in text
    assert tiles["py3.11-cpu-openblas-pip"][0]["data-verdict"] == "pass"
    shown = [(a["data-mode"], a["data-check"], text) for a, text in dom.find("li") if "data-check" in a]
    assert [(m, n) for m, n, _ in shown] == [("hpc", "torch.compile")]
    assert "--tmpfs /tmp:exec" in shown[0][2]  # the fix the check names


def test_the_pull_commands_are_the_pushed_digests(page):
    dom, doc = page
    good = next(c for c in doc["cells"] if c["publish"] == "published")
    pulls = [text for _, text in dom.find("pre", **{"class": "pull-digest"})]
    expected = {f"docker pull {p['ref'].rsplit(':', 1)[0]}@{p['digest']}" for p in good["pushed"]}
    assert pulls and set(pulls) == expected
    assert {text for _, text in dom.find("pre", **{"class": "pull-tag"})} == {f"docker pull {p['ref']}"
                                                                             for p in good["pushed"]}
    lines = " ".join(text for _, text in dom.find("pre", **{"class": "launch-line"}))
    assert re.search(r"apptainer exec docker://\S+@" + good["pushed"][0]["digest"], lines)


def test_the_page_is_self_contained(page):
    dom, _ = page
    assert not dom.find("script") and not dom.find("link") and not dom.find("img")
    assert not [a for t, a, _ in dom.elements if any(k in a for k in ("src", "srcset"))]
