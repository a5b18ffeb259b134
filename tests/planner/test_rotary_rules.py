"""Attention inputs written from model code — RoPE in Hugging Face's rotate-half order with
separate q, k, v outputs — lowered by the planner and verified by the sandbox (CPU interpreter,
float32 and float16, ragged shapes with M = 1 and d not a multiple of 16): Llama's, Qwen2's
biased projections, Qwen3's and Gemma 3's per-head q/k norms, OLMo 2's norm over the whole q/k
projection."""

from __future__ import annotations

from typing import Any

import pytest

from coda.blocks import Block, HeadRMSNorm, Linear, RMSNorm, RoPE, ShapeSets, TensorSpec
from coda.planner import NoRule, lower
from coda.sandbox import SandboxOptions, evaluate

OPTIONS = SandboxOptions(profile=False, isolate=False, seeds=[0])

ANY_HEAD = [
    {"M": 37, "d": 40, "Nq": 48, "Nkv": 16, "D": 16},  # GQA 3:1, ragged M and d
    {"M": 1, "d": 24, "Nq": 36, "Nkv": 12, "D": 12},  # one token, head_dim no power of two
    {"M": 5, "d": 20, "Nq": 40, "Nkv": 40, "D": 20},  # MHA, heads wider than half a tile
]
POWER_OF_TWO_HEADS = [
    {"M": 37, "d": 40, "Nq": 48, "Nkv": 16, "D": 16},  # GQA 3:1, ragged M and d
    {"M": 1, "d": 24, "Nq": 32, "Nkv": 16, "D": 8},  # one token, four heads in a sub-tile
    {"M": 3, "d": 20, "Nq": 128, "Nkv": 64, "D": 64},  # heads wider than the default sub-tile
]


def _spec(*shape: str, init: str = "activation") -> TensorSpec:
    return TensorSpec(shape=list(shape), init=init)


def attention_input(
    name: str,
    *,
    bias: bool = False,
    qk_norm: dict[str, Any] | None = None,
    whole: bool = False,
    shapes: list[dict[str, int]] = ANY_HEAD,
) -> Block:
    """``h = rmsnorm(x)``; q, k, v = Linears of h; [q/k norms]; q, k through ``RoPE``."""
    inputs = {
        "x": _spec("M", "d"),
        "gamma": _spec("d", init="norm_weight"),
        "w_q": _spec("Nq", "d", init="linear_weight"),
        "w_k": _spec("Nkv", "d", init="linear_weight"),
        "w_v": _spec("Nkv", "d", init="linear_weight"),
        "cos": _spec("M", "D"),
        "sin": _spec("M", "D"),
    }
    graph: list[Any] = [RMSNorm(x="x", weight="gamma", eps=1e-6, out="h")]
    for p, width in (("q", "Nq"), ("k", "Nkv"), ("v", "Nkv")):
        b = None
        if bias:
            b = f"b_{p}"
            inputs[b] = _spec(width)
        graph.append(Linear(x="h", weight=f"w_{p}", bias=b, out=p))
    rotated = {"q": "q", "k": "k"}
    if qk_norm is not None:
        for p, width in (("q", "Nq"), ("k", "Nkv")):
            inputs[f"{p}_norm"] = _spec(width if whole else "D", init="norm_weight")
            op = RMSNorm if whole else HeadRMSNorm
            graph.append(op(x=p, weight=f"{p}_norm", out=f"{p}_normed", **qk_norm))
            rotated[p] = f"{p}_normed"
    graph += [RoPE(x=rotated[p], cos="cos", sin="sin", out=f"{p}_rot") for p in ("q", "k")]
    return Block(
        name=name,
        description=f"{name}: attention input in Hugging Face's rotate-half order",
        inputs=inputs,
        graph=graph,
        outputs=["q_rot", "k_rot", "v"],
        shapes=ShapeSets(cpu=shapes),
    )


LLAMA = attention_input("hf_llama_attn_in")
QWEN2 = attention_input("qwen2_attn_in", bias=True)
QWEN3 = attention_input("qwen3_attn_in", qk_norm={"eps": 1e-6}, shapes=POWER_OF_TWO_HEADS)
GEMMA3 = attention_input(
    "gemma3_attn_in",
    qk_norm={"eps": 1e-6, "offset": 1.0, "cast": "after_weight"},
    shapes=POWER_OF_TWO_HEADS,
)
OLMO2 = attention_input("olmo2_attn_in", qk_norm={"eps": 1e-6}, whole=True)


def _ops(program: Any, step: int) -> list[str]:
    return [op.op for op in program.steps[step].epilogue]


def test_llama_q_k_v_are_one_gemm_stored_in_rotate_half_order() -> None:
    """One GEMM over [rope_pairs(w_q); rope_pairs(w_k); w_v]: V passes the rotation, the store
    puts Q/K columns back in rotate-half order, and q_rot, k_rot, v are column views of it."""
    program = lower(LLAMA)
    kinds = [p.kind for p in program.prep]
    assert kinds == ["rope_pairs", "rope_pairs", "concat_rows", "fold_norm_weight"]
    assert [s.kind for s in program.steps] == ["rstd", "gemm"]
    assert _ops(program, 1) == ["scale_rows", "rope_full", "store_rotate_half"]
    views = {name: (v.start, v.stop) for name, v in program.outputs.items()}
    assert views == {
        "q_rot": ("0", "Nq"),
        "k_rot": ("Nq", "Nq + Nkv"),
        "v": ("Nq + Nkv", "Nq + Nkv + Nkv"),
    }
    report = evaluate(program, LLAMA, OPTIONS)
    assert report.verified, report.render_text()


def test_qwen2_bias_is_added_before_the_rotation() -> None:
    """One GEMM per projection (fused Q/K/V concatenates weights only, not biases)."""
    program = lower(QWEN2)
    assert [s.kind for s in program.steps] == ["rstd", "gemm", "gemm", "gemm"]
    assert _ops(program, 3) == ["scale_rows", "add_col_vector", "store"]  # v: no rotation
    assert _ops(program, 1) == ["scale_rows", "add_col_vector", "rope_full", "store_rotate_half"]
    paired = {p.weight for p in program.prep if p.kind == "rope_pairs"}
    assert paired == {"w_q", "w_k", "b_q", "b_k"}
    report = evaluate(program, QWEN2, OPTIONS)
    assert report.verified, report.render_text()


@pytest.mark.parametrize("block", [QWEN3, GEMMA3], ids=lambda b: b.name)
def test_per_head_norms_run_in_the_epilogue(block: Block) -> None:
    program = lower(block)
    assert _ops(program, 1) == ["scale_rows", "head_rmsnorm", "rope_full", "store_rotate_half"]
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_olmo2_whole_projection_norm_finishes_after_the_rotation() -> None:
    program = lower(OLMO2)
    assert _ops(program, 1) == [
        "scale_rows",
        "partial_reduce",
        "load_col_vector",
        "map",
        "rope_full",
        "store_rotate_half",
    ]
    assert [s.kind for s in program.steps[2:4]] == ["rstd", "rescale_rows"]
    report = evaluate(program, OLMO2, OPTIONS)
    assert report.verified, report.render_text()


def test_a_rope_whose_input_is_also_an_output_has_no_lowering() -> None:
    outputs = ["q_rot", "k_rot", "v", "q"]
    block = LLAMA.model_copy(update={"name": "q_also_out", "outputs": outputs})
    with pytest.raises(NoRule, match=r"rope\(out='q_rot'\).*'q' is a block output"):
        lower(block)


def test_a_head_width_no_sub_tile_fits_is_refused_by_the_planner() -> None:
    block = attention_input("qwen3_d12", qk_norm={"eps": 1e-6}, shapes=ANY_HEAD)
    with pytest.raises(NoRule, match=r"head_rmsnorm\(out='q_normed'\).*head width 12"):
        lower(block)
