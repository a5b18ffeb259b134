"""Fixtures shared by the primitives tests."""

from __future__ import annotations

import pytest

from coda.blocks import get_block
from coda.planner import lower


@pytest.fixture
def mlp():  # noqa: ANN201
    """llama_mlp: the block, its planned Program and the block's first CPU shape set."""
    block = get_block("llama_mlp")
    program = lower(block)
    sizes = block.shapes.cpu[0]
    return block, program, sizes
