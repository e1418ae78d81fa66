"""files/yamlfile.py: the one YAML reader, its caps and the characters it refuses."""

from __future__ import annotations

import re
import pytest
from imagefactory.files import yamlfile
from imagefactory.config import matrix
from imagefactory.errors import ConfigError


def test_capped_adds_up_what_was_capped_before():
    once = yamlfile.capped([f"p{i}" for i in range(30)])
    assert once[-1] == "10 more problems not shown" and len(once) == 21
    twice = yamlfile.capped(once + ["q\x1b"])
    assert twice[:20] == once[:20] and twice[-1] == "11 more problems not shown"
    assert yamlfile.capped(["a\x1b[2Kb"]) == ["a\\x1b[2Kb"]


def test_the_matrix_reader_is_the_shared_one():
    assert matrix._parse is yamlfile.parse_yaml and matrix._read is yamlfile.read_yaml_text
    with pytest.raises(ConfigError, match=re.escape("x.yaml:1: (yaml): nested deeper than 32 levels")):
        yamlfile.parse_yaml("[" * 40, "x.yaml")


def test_the_refused_characters_are_exactly_what_pyyaml_refuses():
    """yamlfile._UNREADABLE names what is refused (its complement compiles 8x faster at import): over
    every code point it must match exactly what PyYAML's reader refuses."""
    import yaml.reader

    pass
    every = "".join(map(chr, range(0x110000)))
    ours = [m.start() for m in yamlfile._UNREADABLE.finditer(every)]
    assert ours == [m.start() for m in yaml.reader.Reader.NON_PRINTABLE.finditer(every)]
    assert len(ours) == 2111
