"""GPU verification cannot pass an intermediate kept in a lower precision than the block's.

On a GPU the default dtypes are bfloat16 and float16; a program that rounds an intermediate
through a float16 buffer passes both (float16 is the dtype of the float16 run and finer than
bfloat16), so verify adds one float32 run at the smallest shape, which catches it.
"""

from __future__ import annotations

import copy

from coda.sandbox import SandboxOptions, evaluate
from tests.adversarial.programs import BLOCK_FILE, BLOCKS, TWO_BRANCH, gemm, op

BLOCK = BLOCKS["two_branch"]
OPTIONS = SandboxOptions(profile=False)  # the device's default dtypes and seeds
# two_branch with the first branch kept in a float16 buffer that the second one reads (as in
# tests/adversarial/test_value_and_shape_cheats.py)
HALF_BRANCH = [
    gemm("x", "w1.T", op("store", src="acc", to="y1", dtype="float16"), name="branch1"),
    gemm(
        "x",
        "w2.T",
        op("add_tile", src="acc", tensor="y1", out="o"),
        op("store", src="o", to="out"),
        name="branch2",
    ),
]


def test_an_intermediate_rounded_through_float16_fails_the_float32_check() -> None:
    cheat = {**copy.deepcopy(TWO_BRANCH), "steps": HALF_BRANCH}
    report = evaluate(cheat, BLOCK, OPTIONS, block_file=BLOCK_FILE)
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("verify", "mismatch"), report.render_text()
    assert {c.dtype for c in report.checks if not c.passed} == {"float32"}
    assert all(c.passed for c in report.checks if c.dtype in ("bfloat16", "float16"))


def test_the_honest_program_passes_every_dtype() -> None:
    report = evaluate(TWO_BRANCH, BLOCK, OPTIONS, block_file=BLOCK_FILE)
    assert report.verified, report.render_text()
    assert {c.dtype for c in report.checks} == {"bfloat16", "float16", "float32"}
