"""Aux ``norm_rows`` (a post-norm's finishing pass) in bfloat16 on a GPU against the formula, and
the post-norm blocks and the shipped attention-output Programs verified by the sandbox in bfloat16
and float16 (skipped without a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from coda.blocks.ops import RowRstd
from coda.planner import lower
from coda.primitives import Program
from coda.sandbox import SandboxOptions, evaluate
from coda.sandbox.compare import assert_close
from tests.helpers import DTYPE_TOL, make_inputs, run_both
from tests.planner.test_post_norms import GEMMA, GEMMA2_MLP, OLMO2, post_norm_block
from tests.primitives.test_aux_prep import NORM_ROWS


@pytest.mark.parametrize("sizes", [{"M": 300, "N": 2050, "K": 200}, {"M": 1, "N": 258, "K": 64}])
def test_norm_rows_bf16_gpu(sizes: dict[str, int]) -> None:
    inputs = make_inputs(NORM_ROWS, sizes, torch.bfloat16, device="cuda")
    got, ref, _ = run_both(NORM_ROWS, inputs)
    atol, rtol = DTYPE_TOL[torch.bfloat16]
    y, gamma, x = got["y"].double(), inputs["gamma"].double(), inputs["x"].double()
    xhat = y / (y.pow(2).mean(1, keepdim=True) + 1e-6).sqrt()
    assert_close(got["h"], x + xhat * (1 + gamma), atol=atol * 2, rtol=rtol * 2, what="h")
    assert_close(got["n"], xhat * gamma, atol=atol * 2, rtol=rtol * 2, what="n")
    for name in ("h", "n"):
        assert_close(got[name], ref[name], atol=atol, rtol=rtol, what=f"{name} vs reference")


@pytest.mark.parametrize(
    "which", ["gemma_post_norm", "olmo2_post_norm", "gemma_attn_out", "gemma2_mlp"]
)
def test_post_norm_blocks_verify_on_the_gpu(which: str) -> None:
    block = {
        "gemma_post_norm": lambda: post_norm_block(GEMMA),
        "olmo2_post_norm": lambda: post_norm_block(OLMO2),
        "gemma_attn_out": lambda: post_norm_block(
            GEMMA, outputs=("h", "rstd_h"), tail=(RowRstd(x="h", eps=1e-6, out="rstd_h"),)
        ),
        "gemma2_mlp": lambda: GEMMA2_MLP,
    }[which]()
    shapes = [{"M": 1000, "d": 1000, "f": 2744}]
    options = SandboxOptions(
        shapes=shapes, dtypes=["bfloat16", "float16"], seeds=[0], profile=False, isolate=False
    )
    report = evaluate(lower(block), block, options)
    assert report.verified, report.render_text()


@pytest.mark.parametrize(
    "name",
    [
        f"{base}{suffix}"
        for base in ("attn_out", "gemma2_attn_out", "olmo2_attn_out")
        for suffix in ("", "_bwd")
    ],
)
def test_the_shipped_attention_output_programs_verify_in_bf16(name: str) -> None:
    """The attention-output drop-in's shipped Programs (``coda.export.programs``), forward and
    backward, at their blocks' GPU shape sets in bfloat16 and float16."""
    from coda.blocks import get_block
    from coda.export.programs import program_file

    block = get_block(name)
    program = Program.parse(json.loads(program_file(name).read_text())["program"])
    options = SandboxOptions(
        shapes=block.shapes.gpu, dtypes=["bfloat16", "float16"], seeds=[0], profile=False,
        isolate=False,
    )  # fmt: skip
    report = evaluate(program, block, options)
    assert report.verified, report.render_text()
