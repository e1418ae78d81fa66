"""config/model.py's sizes (parse_size, human) and the matrix keys it reads: size_budget (file and include entry) and compression
(file and tags.compression), each mistake one located line."""

from __future__ import annotations

from pathlib import Path

import pytest

from imagefactory.config import matrix
from imagefactory.config.model import human, parse_size
from imagefactory.errors import ConfigError
from tests.unit.helpers import ONE_PIP_CELL

BASE = "\n" + ONE_PIP_CELL


@pytest.mark.parametrize("text,expected", [(1, 1), (123456, 123456), ("6GB", 6_000_000_000),
                                           ("900MiB", 900 << 20), ("1.5 GiB", 3 << 29), ("0.5kB", 500),
                                           ("1TiB", 1 << 40)])
def test_sizes_parse_whole(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["6 GBs", "6gb", "GB", "6GB\n", " 6GB", "-1", "1e9", "0B", "2TB", 0, True,
                                  "01GB", "1.2345GB", 2 << 40])
def test_other_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_human_sizes():
    assert [human(n) for n in (512, 1540, 220_073_746, 1_430_000_000)] == ["512 B", "1.54 kB", "220 MB", "1.43 GB"]


def _error(write_matrix, text: str) -> str:
    with pytest.raises(ConfigError) as e:
        matrix.load(write_matrix(text))
    assert len(e.value.problems) == 1, e.value.problems
    return e.value.problems[0]


def test_a_malformed_budget_is_one_line_naming_file_line_and_key(write_matrix):
    line = _error(write_matrix, BASE + 'size_budget: "6 GBs"\n')
    assert ":8: size_budget: '6 GBs' is malformed" in line and "900MiB" in line
    line = _error(write_matrix, BASE.replace("installer: [pip]", "installer: [pip]\n  include:\n"
                                             "    - {installer: pip, size_budget: 6gb}"))
    assert ":8: matrix.include[0].size_budget: '6gb' is malformed" in line


def test_a_budget_past_a_tebibyte_is_refused_at_its_line(write_matrix):
    line = _error(write_matrix, BASE + "size_budget: 2TB\n")
    assert ":8: size_budget: '2TB' is 2000000000000 bytes" in line


def test_compression_is_per_matrix_and_per_registry(write_matrix):
    m = matrix.load(write_matrix(BASE + "compression: zstd\ntags: {registries: [ghcr.io], compression: "
                                        "{ghcr.io: gzip}}\n"))
    assert (m.compression_for("registry.example.com"), m.compression_for("ghcr.io")) == ("zstd", "gzip")
    assert matrix.load(write_matrix(BASE)).compression_for("registry.example.com") == "gzip"


def test_a_compression_for_a_registry_nothing_goes_to_or_an_unknown_one_is_refused(write_matrix):
    line = _error(write_matrix, BASE + "tags: {compression: {quay.io: zstd}}\n")
    assert ":8: tags.compression.quay.io: 'quay.io' is not a registry this matrix pushes to" in line
    line = _error(write_matrix, BASE + "compression: brotli\n")
    assert ":8: compression: 'brotli' is not allowed (allowed: gzip, zstd, estargz)" in line
    line = _error(write_matrix, BASE + "compression: eStargz\n")
    assert ":8: compression: 'eStargz' is not allowed" in line
    assert matrix.load(write_matrix(BASE + "compression: estargz\n")).compression_for("registry.example.com") == "estargz"


def test_the_schema_offers_gzip_and_exactly_the_compressions_buildkit_is_asked_for():
    import json

    from imagefactory.config import registries
    from imagefactory.engine import buildkit

    schema = json.loads((Path(matrix.__file__).parent.parent / "resources" / "matrix.schema.json").read_text())
    assert tuple(schema["$defs"]["compression"]["enum"]) == ("gzip", *registries.RECOMPRESSED)
    assert buildkit.RECOMPRESSED is registries.RECOMPRESSED  # the one list push's check and buildx's guard read
