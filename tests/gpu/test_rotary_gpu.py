"""RoPE in Hugging Face's order with q/k norms on the GPU (skipped without one): the new primitives
in bfloat16 at real head widths (128, and 256 whose heads need wider epilogue sub-tiles than the
default), and the attention-input blocks of Llama, Qwen2, Qwen3, Gemma 3 and OLMo 2 verified by
the sandbox in bfloat16 and float16; the shipped Qwen2/Qwen3 blocks and their backwards."""

from __future__ import annotations

import os

import pytest
import torch

from coda.blocks import get_block
from coda.planner import lower
from coda.sandbox import SandboxOptions, evaluate
from tests.planner.test_rotary_rules import GEMMA3, LLAMA, OLMO2, QWEN2, QWEN3
from tests.primitives.test_ops import CASES, _run_case
from tests.primitives.test_rotary_pieces import check_head_rmsnorm, check_rescale_rows

DTYPES = os.environ.get("CODA_TEST_DTYPES", "bfloat16,float16").split(",")
DEVICE = os.environ.get("CODA_TEST_DEVICE", "cuda")


@pytest.mark.parametrize("head", [128, 256])
def test_head_rmsnorm_bf16_gpu(head: int) -> None:
    sizes = {"M": 300, "N": 6 * head, "K": 200, "D": head}
    check_head_rmsnorm(sizes, 1.0, torch.bfloat16, device=DEVICE)


def test_rescale_rows_bf16_gpu() -> None:
    check_rescale_rows({"M": 300, "N": 1000, "K": 200}, torch.bfloat16, device=DEVICE)


@pytest.mark.parametrize("name", ["rope_full", "store_rotate_half"])
def test_rotation_and_rotate_half_store_bf16_gpu(name: str) -> None:
    """At N = 1024 the test's head width is 16; real heads are covered by the blocks below."""
    _run_case(CASES[name], {"M": 300, "N": 1024, "K": 200}, torch.bfloat16, device=DEVICE)


GPU_SHAPES = {
    LLAMA.name: {"M": 1000, "d": 1024, "Nq": 1024, "Nkv": 256, "D": 128},
    QWEN2.name: {"M": 1000, "d": 896, "Nq": 896, "Nkv": 128, "D": 64},
    QWEN3.name: {"M": 1000, "d": 1024, "Nq": 2048, "Nkv": 1024, "D": 128},
    GEMMA3.name: {"M": 500, "d": 1152, "Nq": 1024, "Nkv": 256, "D": 256},
    OLMO2.name: {"M": 1000, "d": 1024, "Nq": 1024, "Nkv": 1024, "D": 128},
}


@pytest.mark.parametrize("block", [LLAMA, QWEN2, QWEN3, GEMMA3, OLMO2], ids=lambda b: b.name)
def test_attention_input_blocks_verify_on_the_gpu(block) -> None:  # noqa: ANN001
    shapes = [GPU_SHAPES[block.name]]
    if DEVICE == "cpu":  # a check of this file without a GPU
        shapes = block.shapes.cpu[:1]
    options = SandboxOptions(shapes=shapes, dtypes=DTYPES, seeds=[0], profile=False, isolate=False)
    report = evaluate(lower(block), block, options)
    assert report.verified, report.render_text()


@pytest.mark.parametrize(
    "name", ["qwen2_attn_in", "qwen2_attn_in_bwd", "qwen3_attn_in", "qwen3_attn_in_bwd"]
)
def test_qwen_attention_inputs_and_their_backwards_verify_on_the_gpu(name: str) -> None:
    """The shipped Qwen2/Qwen3 blocks at Qwen2-0.5B's and Qwen3-0.6B's widths; the backwards run
    aux ``rotary_input_grad`` (RoPE transposed, per-head norm backward, bias gradients)."""
    block = get_block(name)
    shapes = block.shapes.cpu[:1] if DEVICE == "cpu" else block.shapes.gpu[:1]
    options = SandboxOptions(shapes=shapes, dtypes=DTYPES, seeds=[0], profile=False, isolate=False)
    report = evaluate(lower(block), block, options)
    assert report.verified, report.render_text()
