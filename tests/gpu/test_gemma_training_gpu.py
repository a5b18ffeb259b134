"""The Gemma-shaped training blocks of ``tests/planner/test_gemma_training.py`` (softcapped LM head
+ cross-entropy and its backward, the GeGLU MLP backward under a ``(1 + γ)`` norm, Gemma 2's
sandwich-norm MLP backward, bias gradients) verified by the sandbox in bfloat16 and float16 on a
GPU (skipped without one)."""

from __future__ import annotations

import pytest

from coda.blocks import Block, registry
from coda.planner import lower
from coda.sandbox import SandboxOptions, evaluate
from tests.planner.test_gemma_training import (
    MLP_SAVED,
    _biased_bwd,
    _lm_head_bwd,
    _mlp_bwd,
    _sandwich_bwd,
    biased_lm_head,
    biased_mlp,
    gemma_mlp,
    lm_head_block,
)

LM_SHAPES = [{"M": 1000, "d": 1024, "V": 32000}]
MLP_SHAPES = [{"M": 1000, "d": 1000, "f": 2744}]


def _blocks(which: str) -> tuple[Block, list[dict[str, int]]]:
    if which == "lm_head":
        return lm_head_block(), LM_SHAPES
    if which == "lm_head_bwd":
        return _lm_head_bwd(lm_head_block()), LM_SHAPES
    if which == "biased_lm_head_bwd":
        return _lm_head_bwd(biased_lm_head(), wrt_bias=True), LM_SHAPES
    if which == "geglu_mlp_bwd":
        return _mlp_bwd(gemma_mlp()), MLP_SHAPES
    if which == "sandwich_mlp_bwd":
        return _sandwich_bwd(), MLP_SHAPES
    if which == "biased_mlp_bwd":
        return _biased_bwd(biased_mlp(("gate", "up"))), MLP_SHAPES
    return _biased_bwd(biased_mlp(("gate", "up")), saved=dict(MLP_SAVED)), MLP_SHAPES


@pytest.mark.parametrize(
    "which",
    [
        "lm_head",
        "lm_head_bwd",
        "biased_lm_head_bwd",
        "geglu_mlp_bwd",
        "sandwich_mlp_bwd",
        "biased_mlp_bwd",
        "biased_mlp_bwd_saved",
    ],
)
def test_gemma_training_blocks_verify_on_the_gpu(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "_BLOCKS", dict(registry._BLOCKS))
    block, shapes = _blocks(which)
    options = SandboxOptions(
        shapes=shapes, dtypes=["bfloat16", "float16"], seeds=[0], profile=False, isolate=False
    )
    report = evaluate(lower(block), block, options)
    assert report.verified, report.render_text()
