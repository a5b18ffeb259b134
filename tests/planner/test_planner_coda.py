"""The built-in planner on the paper's ten kernels and the Llama layer blocks, forward and backward:
it finds a Program for each, the sandbox verifies it on the CPU, and the Program has the CODA shape
(what is fused where, what never touches memory, what runs on the vendor GEMM)."""

from __future__ import annotations

import pytest

from coda.blocks import Add, Block, Linear, ShapeSets, TensorSpec, get_block
from coda.blocks.autodiff import backward_block
from coda.blocks.ops import Matmul, RowRstd, TargetLogit
from coda.planner import NoRule, lower
from coda.primitives.ir import GemmEpilogue, OutputView, Program
from coda.sandbox import SandboxOptions, evaluate
from tests.blocks.test_coda_blocks import LAYER_BLOCKS, PAPER_TABLE

FAST = SandboxOptions(isolate=False, seeds=[0])


def _spec(*shape: str, init: str = "activation") -> TensorSpec:
    return TensorSpec(shape=list(shape), init=init)


# only the target logits of x @ w.T are wanted: M dot products, no GEMM
TARGET_ONLY = Block(
    name="target_only",
    description="the target logit of x @ w.T",
    inputs={
        "x": _spec("M", "K"),
        "w": _spec("N", "K", init="linear_weight"),
        "t": TensorSpec(shape=["M"], dtype="int64", init="index", high="N"),
    },
    graph=[
        Linear(x="x", weight="w", out="z"),
        TargetLogit(logits="z", target="t", out="zt"),
    ],
    outputs=["zt"],
    shapes=ShapeSets(cpu=[{"M": 9, "K": 20, "N": 33}], gpu=[{"M": 64, "K": 64, "N": 64}]),
)

# o-proj + residual + the next norm's rstd, then a plain matmul on the result
USER_TAIL = Block(
    name="user_tail",
    description="x1 = x + attn @ w_o.T; r = rstd(x1); y = x1 @ b",
    inputs={
        "x": _spec("M", "d"),
        "attn": _spec("M", "d"),
        "w_o": _spec("d", "d", init="linear_weight"),
        "b": _spec("d", "n", init="linear_weight"),
    },
    graph=[
        Linear(x="attn", weight="w_o", out="o"),
        Add(a="x", b="o", out="x1"),
        RowRstd(x="x1", eps=1e-6, out="r"),
        Matmul(a="x1", b="b", out="y"),
    ],
    outputs=["r", "y"],
    shapes=ShapeSets(cpu=[{"M": 33, "d": 40, "n": 24}, {"M": 8, "d": 16, "n": 48}]),
)


@pytest.mark.parametrize("name", [*PAPER_TABLE, *LAYER_BLOCKS])
def test_planner_finds_a_verified_program(name: str) -> None:
    block = get_block(name)
    program = lower(block)
    report = evaluate(program, block, FAST)
    assert report.verified, report.render_text()


def _gemms(program: Program) -> list[GemmEpilogue]:
    return [s for s in program.steps if isinstance(s, GemmEpilogue)]


def _ops(step: GemmEpilogue) -> list[str]:
    return [op.op for op in step.epilogue]


def test_each_paper_kernel_is_one_fused_gemm() -> None:
    for name in PAPER_TABLE:
        program = lower(get_block(name))
        (gemm,) = _gemms(program)
        assert not gemm.is_plain_store, name
        aux = [s.kind for s in program.steps if not isinstance(s, GemmEpilogue)]
        assert len(aux) <= 1, (name, aux)  # at most one tiny finishing reduction


def test_cross_entropy_never_stores_the_logits() -> None:
    program = lower(get_block("llama_lm_head_ce"))
    (gemm,) = _gemms(program)
    assert _ops(gemm) == ["scale_rows", "partial_reduce"]
    assert [s.kind for s in program.steps] == ["rstd", "gemm", "gather_dot", "lse_combine"]
    # the target logit r_i · x_i · w_folded[t_i] from the operands, not from every logit tile
    gather = program.steps[2]
    assert (gather.a, gather.w, gather.scale) == (gemm.a.tensor, gemm.b.tensor, "rstd_h")
    assert gemm.b.transpose
    assert program.steps[-1].minus == gather.out  # loss = LSE − target logit


def test_target_logit_of_a_weight_without_rows_uses_the_epilogue() -> None:
    # B given as [K, N]: a gathered column would be a strided read per element, so select_column
    # takes the target logit from the tile; and a block wanting only target logits needs no GEMM
    program = lower(get_block("gemm_partial_cross_entropy"))
    assert _ops(_gemms(program)[0])[0] == "select_column"
    program = lower(TARGET_ONLY)
    assert [s.kind for s in program.steps] == ["gather_dot"]
    assert evaluate(program, TARGET_ONLY, FAST).verified


def test_attention_input_is_one_gemm_with_rope_and_v_passing_through() -> None:
    program = lower(get_block("llama_attn_in"))
    assert [p.kind for p in program.prep] == [
        "rope_pairs",
        "rope_pairs",
        "concat_rows",
        "fold_norm_weight",
    ]
    assert {p.weight for p in program.prep if p.kind == "rope_pairs"} == {"w_q", "w_k"}
    (gemm,) = _gemms(program)
    rope = next(op for op in gemm.epilogue if op.op == "rope")
    assert rope.rotary_cols == "Nq + Nkv"


def test_attention_output_writes_the_next_norms_statistic_from_its_epilogue() -> None:
    program = lower(get_block("llama_attn_out"))
    (gemm,) = _gemms(program)
    assert _ops(gemm) == ["add_tile", "partial_reduce", "store"]
    assert program.steps[-1].kind == "rstd"


def test_mlp_backward_schedule() -> None:
    program = lower(get_block("llama_mlp_bwd"))
    gemms = _gemms(program)
    assert [g.is_plain_store for g in gemms] == [False, False, True, False, True]
    down_bwd, gate_up_bwd = gemms[1], gemms[3]
    assert "pairwise" in _ops(down_bwd) and "swiglu" in _ops(down_bwd)  # SwiGLU bwd + recompute
    assert _ops(gate_up_bwd).count("partial_reduce") == 1  # dγ partials
    assert "add_tile" in _ops(gate_up_bwd)  # the residual's gradient joins dx here
    assert isinstance(program.outputs["dw_gate"], OutputView)  # de-interleaved by a view
    assert program.outputs["dw_gate"].step == 2


def test_training_forward_saves_what_its_backward_uses() -> None:
    train = lower(get_block("llama_mlp_train"))
    gate_up = _gemms(train)[0]
    assert _ops(gate_up)[:3] == ["scale_rows", "split_pairs", "swiglu"]
    # a = silu(g)·u is written for the down projection but not returned: the backward
    # recomputes it where it reads g and u
    assert {op.to for op in gate_up.epilogue if op.op == "store"} == {"g", "u", "a"}
    assert set(train.outputs) == {"out", "g", "u", "rstd_h"}
    saved = lower(get_block("llama_mlp_bwd_saved"))
    gemms = _gemms(saved)
    assert [g.is_plain_store for g in gemms] == [False, True, False, True]  # no GEMM recomputed
    assert gemms[0].a.tensor == "dout" and "join_pairs" in _ops(gemms[0])
    assert {op.to for op in gemms[0].epilogue if op.op == "store"} == {"dz", "a"}
    assert gemms[1].b.tensor == "a"  # dW_down = doutᵀ · a


@pytest.mark.parametrize(
    ("forward", "backward"),
    [
        ("llama_mlp_train", "llama_mlp_bwd_saved"),
        ("llama_attn_in_train", "llama_attn_in_bwd_saved"),
        ("gemma2_mlp_branch_train", "gemma2_mlp_branch_bwd_saved"),  # and a post-norm's own
    ],
)
def test_the_training_forward_hands_its_norm_statistic_to_the_backward(
    forward: str, backward: str
) -> None:
    # the forward's one rstd pass over x is also its output rstd_h; the backward reads that
    # instead of a pass of its own (the post-norm's statistic, of a GEMM output, stays)
    train = lower(get_block(forward))
    (rstd,) = [s for s in train.steps if s.kind == "rstd" and s.src == "x"]
    assert train.outputs["rstd_h"] == rstd.out
    saved = lower(get_block(backward))
    assert "rstd_h" in saved.inputs
    assert not any(s.kind == "rstd" and s.src == "x" for s in saved.steps)
    rows = [op.vector for g in _gemms(saved) for op in g.epilogue if op.op == "load_row_vector"]
    assert "rstd_h" in rows  # the norm's backward scales by it


def test_a_row_statistic_of_another_epsilon_is_not_the_norms() -> None:
    train = get_block("llama_mlp_train")
    other = RowRstd(x="x", eps=1e-3, out="rstd_h")
    block = train.model_copy(update={"name": "other_eps", "graph": [*train.graph[:-1], other]})
    with pytest.raises(NoRule, match="row_rstd"):
        lower(block)


def test_lm_head_training_forward_keeps_the_logsumexp_for_its_backward() -> None:
    # the loss and lse share one partial log-sum-exp in the epilogue: no second reduction
    train = lower(get_block("llama_lm_head_ce_train"))
    (gemm,) = _gemms(train)
    assert _ops(gemm) == ["scale_rows", "partial_reduce"]
    combines = [s for s in train.steps if s.kind == "lse_combine"]
    assert {c.out for c in combines} == {"loss", "lse"}
    assert len({c.src for c in combines}) == 1
    # with lse saved the backward recomputes the logits once (dz), not twice (lse, then dz)
    recompute = lower(get_block("llama_lm_head_ce_bwd"))
    saved = lower(get_block("llama_lm_head_ce_bwd_saved"))
    assert [g.name for g in _gemms(recompute)][:2] == ["lm_head_lse", "lm_head_bwd"]
    assert [g.name for g in _gemms(saved)] == ["lm_head_bwd", "lm_head_dx", "lm_head_grad"]
    assert "lse" in saved.inputs and not any(s.kind == "lse_combine" for s in saved.steps)


def test_attention_input_epsilon_variants_verify() -> None:
    # Hugging Face's LlamaConfig defaults to eps 1e-6: patch_llama's attention uses these blocks
    from coda.blocks.llama import llama_attn_in_family

    family = llama_attn_in_family(1e-6)
    assert get_block("llama_attn_in_eps1e-06_bwd") is family["backward"]
    assert family["backward"].graph[0].forward == "llama_attn_in_eps1e-06"
    for block in family.values():
        assert evaluate(lower(block), block, FAST).verified, block.name


def test_attention_input_backward_puts_qk_rows_back() -> None:
    program = lower(get_block("llama_attn_in_bwd"))
    assert any(s.kind == "unpair_rows" for s in program.steps)
    first = _gemms(program)[0]
    rope = next(op for op in first.epilogue if op.op == "rope")
    assert rope.inverse and rope.rotary_cols == "Nq + Nkv"


@pytest.mark.parametrize("name", ["llama_attn_in_bwd", "llama_attn_in_bwd_saved"])
def test_attention_input_backward_writes_each_weight_gradient_apart(name: str) -> None:
    # one unpair_rows gather writes dW_q, dW_k (Q/K rows put back) and dW_v (copied) as tensors
    # of their own: no block output is a row view of one fused gradient for a caller to copy
    program = lower(get_block(name))
    (unpair,) = [s for s in program.steps if s.kind == "unpair_rows"]
    assert unpair.out is None and unpair.rows == "Nq + Nkv" and unpair.head_dim == "D"
    parts = [(p.out, p.rows) for p in unpair.parts or []]
    assert parts == [("dw_q", "Nq"), ("dw_k", "Nkv"), ("dw_v", "Nkv")]
    assert {n: program.outputs[n] for n in ("dw_q", "dw_k", "dw_v")} == {n: n for n, _ in parts}
    assert not any(isinstance(v, OutputView) for v in program.outputs.values())


def test_attention_input_backward_from_the_saved_output_recomputes_no_projection() -> None:
    # qkv kept by the forward: the inverse rotation and c = Σ qkv·dqkv / d in one rope_rows pass,
    # then only the dx GEMM (norm backward in its epilogue) and the weight gradient
    program = lower(get_block("llama_attn_in_bwd_saved"))
    (rope,) = [s for s in program.steps if s.kind == "rope_rows"]
    assert (rope.src, rope.dot, rope.divide_by) == ("dqkv", "qkv", "d") and rope.inverse
    assert [g.name for g in _gemms(program)] == ["qkv_bwd", "w_qkv_grad"]
    assert not any(p.kind == "fold_norm_weight" for p in program.prep)


def test_a_user_block_mixing_old_and_new_ops() -> None:
    program = lower(USER_TAIL)
    assert evaluate(program, USER_TAIL, FAST).verified


def test_backward_of_an_unsupported_forward_names_it() -> None:
    fwd = get_block("gemm_rmsnorm")
    bwd = backward_block(
        fwd,
        name="gemm_rmsnorm_bwd",
        cotangents={"d": TensorSpec(shape=["M", "N"])},
        wrt=["a", "b"],
    )
    with pytest.raises(NoRule, match="no backward rule for forward block 'gemm_rmsnorm'"):
        lower(bwd)
