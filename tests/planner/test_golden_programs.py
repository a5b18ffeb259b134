"""The planner's Programs for every built-in block and lowering option equal the golden files
(``golden_programs.py`` says what they hold and how to regenerate them)."""

from __future__ import annotations

import json

import pytest

from .golden_programs import GOLDEN, golden_blocks, lowerings, path_of

BLOCKS = {block.name: block for block in golden_blocks()}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_lowering_matches_the_golden_program(name: str) -> None:
    block = BLOCKS[name]
    expected = json.loads(path_of(block).read_text())
    actual = lowerings(block)
    for label in expected:
        assert actual[label] == expected[label], f"{name} under {label}"
    assert actual.keys() == expected.keys()


def test_every_golden_file_belongs_to_a_block() -> None:
    assert {p.stem for p in GOLDEN.glob("*.json")} == set(BLOCKS)
