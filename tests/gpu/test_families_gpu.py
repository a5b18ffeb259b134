"""The families suite (``evals/suites/families``) on the GPU: every suite block — forward and
backward — that the built-in planner lowers, its Program verified by the sandbox in bfloat16 and
float16 at each of the block's GPU shape sets (compiled Triton). A block the planner does not
lower is skipped with its refusal (the rules for it are the planner's to grow); with
``CODA_TEST_DEVICE=cpu`` the file runs through the interpreter at each block's first CPU shape
set (set ``CODA_TEST_DTYPES=float32,float16`` there: bf16 ``tl.dot`` is wrong in the
interpreter)."""

from __future__ import annotations

import os

import pytest

from coda.blocks import get_block
from coda.evals.suites import load_suite, load_suite_blocks
from coda.planner import lower_partial
from coda.sandbox import SandboxOptions, evaluate

pytestmark = pytest.mark.cpu_capable

DTYPES = os.environ.get("CODA_TEST_DTYPES", "bfloat16,float16").split(",")
SUITE = load_suite("families")  # the toml only: the blocks are captured in the fixture


@pytest.fixture(scope="module")
def suite_loaded() -> None:
    load_suite_blocks(SUITE)


@pytest.mark.parametrize("name", SUITE.blocks)
def test_family_block_verifies_on_the_gpu(suite_loaded: None, name: str) -> None:
    block = get_block(name)
    lowering = lower_partial(block)
    if lowering.program is None:
        first = next(u for u in lowering.unlowered if u.after is None)
        pytest.skip(f"the planner does not lower it: {first.line()}")
    shapes = block.shapes.gpu or block.shapes.cpu
    if os.environ.get("CODA_TEST_DEVICE") == "cpu":  # a check of this file without a GPU
        shapes = block.shapes.cpu[:1]
    options = SandboxOptions(shapes=shapes, dtypes=DTYPES, seeds=[0], profile=False, isolate=False)
    report = evaluate(lowering.program, block, options)
    assert report.verified, report.render_text()
    assert {c.dtype for c in report.checks} == set(DTYPES)
