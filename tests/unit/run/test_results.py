"""report/cell.py's size facts: what report.md and the catalogue say of an image's pull cost, from
CellReport.sizes; a report.json without sizes (older) or with odd values shows none of them."""

from __future__ import annotations

import json

from imagefactory.report import catalog, summary
from imagefactory.run.results import PASSED, PUBLISHED, CellReport, size_facts

SIZES = {"compressed": 425_500_000, "layers": 14, "largest_layer": 220_073_746, "compression": "gzip",
         "fetch_after": {"py3.11-cpu-openblas-pip-b": 4_255_000},
         "previous": {"digest": "sha256:" + "a" * 64, "fetch": 220_000_000},
         "budget": {"limit": 6_000_000_000, "measured": 425_000_000, "how": "estimated", "over": False}}


def test_the_facts_give_size_layers_largest_and_what_a_node_fetches():
    facts = dict(size_facts(SIZES))
    assert facts["pull size"] == "426 MB compressed (gzip) in 14 layers, largest 220 MB"
    assert facts["a node holding py3.11-cpu-openblas-pip-b fetches"] == "4.25 MB (1.0%)"
    assert facts["a node holding the release it replaced fetches"] == "220 MB (51.7%)"
    assert facts["size budget"] == "6 GB: 425 MB before the push (estimated), within"


def test_odd_values_are_left_out_never_shown_raw():
    odd = {"compressed": "lots", "layers": True, "largest_layer": -1, "fetch_after": {"x": "<b>"},
           "previous": {"fetch": None}, "budget": []}
    assert size_facts(odd) == [] and size_facts({}) == []


def test_report_md_and_the_catalogue_show_them_and_an_older_report_json_still_reads(tmp_path):
    r = CellReport(cell="py3.11-cpu-openblas-pip", status=PASSED, publish=PUBLISHED, sizes=SIZES)
    assert "- pull size: 426 MB compressed (gzip) in 14 layers, largest 220 MB" in summary.summary([r])
    path, _ = summary.write([r], tmp_path / "report.json", gpus=False)
    assert json.loads(path.read_text())["cells"][0]["sizes"] == SIZES
    assert catalog.read_report(path)[0].sizes == SIZES
    assert "largest 220 MB" in path.with_suffix(".html").read_text()
    doc = json.loads(path.read_text())
    del doc["cells"][0]["sizes"]  # written before sizes existed
    path.write_text(json.dumps(doc))
    assert catalog.read_report(path)[0].sizes == {}
