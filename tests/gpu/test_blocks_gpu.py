"""The paper's ten kernels and the Llama layer blocks, forward and backward, on the GPU: the
planner's Program verified by the sandbox in bfloat16 and float16 at each block's first GPU shape
set (compiled Triton, the default 128-wide tiles)."""

from __future__ import annotations

import os

import pytest

from coda.blocks import get_block
from coda.planner import lower
from coda.sandbox import SandboxOptions, evaluate
from tests.blocks.test_coda_blocks import LAYER_BLOCKS, PAPER_TABLE

DTYPES = os.environ.get("CODA_TEST_DTYPES", "bfloat16,float16").split(",")


@pytest.mark.parametrize("name", [*PAPER_TABLE, *LAYER_BLOCKS, "llama_mlp"])
def test_block_verifies_on_the_gpu(name: str) -> None:
    block = get_block(name)
    shapes = block.shapes.gpu[:1] if block.shapes.gpu else block.shapes.cpu
    if os.environ.get("CODA_TEST_DEVICE") == "cpu":  # a check of this file without a GPU
        shapes = block.shapes.cpu[:1]
    options = SandboxOptions(shapes=shapes, dtypes=DTYPES, seeds=[0], profile=False, isolate=False)
    report = evaluate(lower(block), block, options)
    assert report.verified, report.render_text()
