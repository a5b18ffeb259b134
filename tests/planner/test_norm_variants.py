"""RMSNorm variants: Gemma's ``x̂ · (1 + γ)`` and the two casting conventions, from the graph op's
reference (against Hugging Face's modules) through the planner to a verified Program."""

from __future__ import annotations

import pytest
import torch

from coda.blocks import Add, Block, LayerNorm, Linear, RMSNorm, ShapeSets, SwiGLU, TensorSpec
from coda.blocks import functional as fn
from coda.planner import LoweringOptions, NoRule, lower
from coda.primitives import Program
from coda.sandbox import SandboxOptions, evaluate

OPTIONS = SandboxOptions(profile=False, isolate=False, seeds=[0])


def test_rms_norm_casts_like_llama_and_gemma_bit_for_bit() -> None:
    """``cast="before_weight"`` is LlamaRMSNorm, ``offset=1, cast="after_weight"`` GemmaRMSNorm,
    in fp16 to the bit; the two conventions round differently."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 40, generator=gen).half()
    gamma = (torch.randn(40, generator=gen) * 0.3).half()
    llama, gemma = LlamaRMSNorm(40, eps=1e-6).half(), GemmaRMSNorm(40, eps=1e-6).half()
    with torch.no_grad():
        llama.weight.copy_(gamma)
        gemma.weight.copy_(gamma)
        assert torch.equal(fn.rms_norm(x, gamma, 1e-6), llama(x))
        got = fn.rms_norm(x, gamma, 1e-6, offset=1.0, cast="after_weight")
        assert torch.equal(got, gemma(x))
        assert not torch.equal(got, fn.rms_norm(x, gamma, 1e-6, offset=1.0))


def _spec(*shape: str, init: str = "activation") -> TensorSpec:
    return TensorSpec(shape=list(shape), init=init)


GEMMA_NORM_LINEAR = Block(
    name="gemma_norm_linear",
    description="y = GemmaRMSNorm(x) @ W.T: x̂ · (1 + γ) formed in fp32, rounded once",
    inputs={"x": _spec("M", "d"), "gamma": _spec("d"), "w": _spec("n", "d", init="linear_weight")},
    graph=[
        RMSNorm(x="x", weight="gamma", eps=1e-6, offset=1.0, cast="after_weight", out="h"),
        Linear(x="h", weight="w", out="y"),
    ],
    outputs=["y"],
    shapes=ShapeSets(cpu=[{"M": 33, "d": 40, "n": 24}, {"M": 7, "d": 24, "n": 56}]),
)


def test_gemma_norm_folds_one_plus_gamma_and_verifies() -> None:
    program = lower(GEMMA_NORM_LINEAR)
    (fold,) = program.prep
    assert fold.kind == "fold_norm_weight" and fold.offset == 1.0
    rstd, gemm = program.steps
    assert rstd.kind == "rstd" and gemm.a.tensor == "x"
    assert [op.op for op in gemm.epilogue] == ["scale_rows", "store"]
    report = evaluate(program, GEMMA_NORM_LINEAR, OPTIONS)
    assert report.verified, report.render_text()


def test_gemma_norm_without_the_offset_fails_verification() -> None:
    """Folding γ alone (Llama's fold) is a different function: the sandbox rejects it."""
    data = lower(GEMMA_NORM_LINEAR).model_dump(mode="json")
    for node in data["prep"]:
        node["offset"] = 0.0
    report = evaluate(Program.parse(data), GEMMA_NORM_LINEAR, OPTIONS)
    assert not report.verified and "FAILED at semantics" in report.render_text()


def test_a_norm_with_an_offset_folds_even_when_gamma_could_be_a_side_output() -> None:
    """``x ⊙ γ`` as a side output would drop the offset: the planner folds ``1 + γ`` instead."""
    block = GEMMA_NORM_LINEAR.model_copy(
        update={
            "name": "gemma_tail",
            "inputs": {**GEMMA_NORM_LINEAR.inputs, "w0": _spec("d", "d", init="linear_weight")},
            "graph": [Linear(x="x", weight="w0", out="x1"), *_renamed(GEMMA_NORM_LINEAR.graph)],
        }
    )
    program = lower(block, LoweringOptions(gamma="side_output"))
    assert [(p.kind, p.offset) for p in program.prep] == [("fold_norm_weight", 1.0)]
    epilogues = [getattr(step, "epilogue", []) for step in program.steps]
    assert all(op.op != "scale_cols" for ops in epilogues for op in ops)


def test_a_norm_with_an_offset_in_a_row_pass_keeps_its_offset() -> None:
    """``gamma="rows"``: the row pass applies Gemma's ``1 + γ``; no weight is folded; the norm of
    the block's input computes its statistic in the same launch (``rms_rows``, no ``rstd``)."""
    program = lower(GEMMA_NORM_LINEAR, LoweringOptions(gamma="rows"))
    assert program.prep == []
    rows = next(step for step in program.steps if step.kind == "rms_rows")
    assert (rows.src, rows.weight, rows.offset, rows.eps) == ("x", "gamma", 1.0, 1e-6)
    assert not any(step.kind == "rstd" for step in program.steps)
    gemm = next(step for step in program.steps if step.kind == "gemm")
    assert gemm.a.tensor == rows.out and [op.op for op in gemm.epilogue] == ["store"]
    report = evaluate(program, GEMMA_NORM_LINEAR, OPTIONS)
    assert report.verified, report.render_text()


def _renamed(graph: list) -> list:
    """``graph`` reading ``x1`` where it read ``x``."""
    return [op.model_copy(update={"x": "x1"}) if op.x == "x" else op for op in graph]


@pytest.mark.parametrize("cast", ["before_weight", "after_weight"])
def test_the_reference_source_names_non_default_fields_only(cast: str) -> None:
    op = RMSNorm(x="x", weight="g", out="h", cast=cast)
    extra = "" if cast == "before_weight" else ", cast='after_weight'"
    assert op.source() == f"h = rms_norm(x, g, eps=1e-06{extra})"


def _layer_norm_block(bias: bool) -> Block:
    extra = {"beta": _spec("d")} if bias else {}
    return Block(
        name="gpt2_ln_linear" if bias else "ln_linear",
        description="y = LayerNorm(x) @ W.T (GPT-2's ln_1 into c_attn, without its bias)",
        inputs={
            "x": _spec("M", "d"),
            "gamma": _spec("d", init="norm_weight"),
            **extra,
            "w": _spec("n", "d", init="linear_weight"),
        },
        graph=[
            LayerNorm(x="x", weight="gamma", bias="beta" if bias else None, eps=1e-5, out="h"),
            Linear(x="h", weight="w", out="y"),
        ],
        outputs=["y"],
        shapes=ShapeSets(cpu=[{"M": 33, "d": 40, "n": 24}, {"M": 7, "d": 24, "n": 56}]),
    )


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_layer_norm_into_a_linear_verifies(bias: bool) -> None:
    block = _layer_norm_block(bias)
    program = lower(block)
    kinds = ["fold_norm_weight", "matvec"] + (["matvec"] if bias else [])
    assert [p.kind for p in program.prep] == kinds
    stats, gemm = program.steps
    assert stats.kind == "mean_rstd" and gemm.a.tensor == "x"
    ops = ["load_row_vector", "load_col_vector", "map", "scale_rows"]
    assert [op.op for op in gemm.epilogue] == ops + (["add_col_vector"] if bias else []) + ["store"]
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_layer_norm_without_the_mean_correction_fails_verification() -> None:
    """``r ⊙ (x W'ᵀ)`` alone is an RMSNorm-like product, not a LayerNorm: the sandbox rejects it."""
    block = _layer_norm_block(bias=False)
    data = lower(block).model_dump(mode="json")
    gemm = data["steps"][1]
    gemm["epilogue"] = [op for op in gemm["epilogue"] if op["op"] not in ("load_row_vector",)]
    (centered,) = [op for op in gemm["epilogue"] if op["op"] == "map"]
    centered["expr"] = "acc"
    report = evaluate(Program.parse(data), block, OPTIONS)
    assert not report.verified and "FAILED at semantics" in report.render_text()


def test_a_layer_norm_read_by_a_non_gemm_has_no_lowering() -> None:
    block = _layer_norm_block(bias=False).model_copy(update={"outputs": ["h", "y"]})
    with pytest.raises(NoRule, match="its output 'h' feeds a block output"):
        lower(block)


def test_the_backward_of_an_offset_norm_scales_by_offset_plus_gamma(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Gemma norm's backward folds ``1 + γ`` into the recomputed projection and uses it in
    ``dx`` and ``y``; its algebra matches autograd of the forward in float64."""
    from coda.blocks import get_block, registry
    from coda.blocks.autodiff import backward_block
    from coda.sandbox.report import StageResult
    from coda.sandbox.stages import semantics, validate

    llama = get_block("llama_mlp")
    graph = [
        op.model_copy(update={"offset": 1.0}) if isinstance(op, RMSNorm) else op
        for op in llama.graph
    ]
    gemma = llama.model_copy(update={"name": "gemma_mlp", "graph": graph})
    monkeypatch.setitem(registry._BLOCKS, gemma.name, gemma)
    cotangent = {"out": TensorSpec(shape=["M", "d"])}
    bwd = backward_block(gemma, name="gemma_mlp_bwd", cotangents=cotangent, wrt=["x", "gamma"])
    program = lower(bwd)
    assert [(p.kind, p.offset) for p in program.prep if p.kind == "fold_norm_weight"] == [
        ("fold_norm_weight", 1.0)
    ]
    (norm_bwd,) = [s for s in program.steps if getattr(s, "name", "") == "gate_up_bwd"]
    maps = [op.expr for op in norm_bwd.epilogue if op.op == "map"]
    assert all("(gamma_col + 1)" in e for e in maps[:2]) and "gamma_col" not in maps[2]
    results: list[StageResult] = []
    checked, _ = validate(program, bwd, bwd.shapes.cpu[:2], results)
    assert checked is not None, results[-1].message
    semantics(checked, bwd, bwd.shapes.cpu[:2], results, seed=0, drawn=1)
    assert results[-1].status == "passed", results[-1].message


LN_MLP = Block(
    name="ln_swiglu_mlp",
    description="out = x + down(silu(gate(LN(x))) * up(LN(x))): two GEMMs read one LayerNorm",
    inputs={
        "x": _spec("M", "d"),
        "gamma": _spec("d", init="norm_weight"),
        "beta": _spec("d"),
        "w_gate": _spec("f", "d", init="linear_weight"),
        "w_up": _spec("f", "d", init="linear_weight"),
        "w_down": _spec("d", "f", init="linear_weight"),
    },
    graph=[
        LayerNorm(x="x", weight="gamma", bias="beta", out="h"),
        Linear(x="h", weight="w_gate", out="g"),
        Linear(x="h", weight="w_up", out="u"),
        SwiGLU(gate="g", up="u", out="a"),
        Linear(x="a", weight="w_down", out="m"),
        Add(a="x", b="m", out="out"),
    ],
    outputs=["out"],
    shapes=ShapeSets(cpu=[{"M": 33, "d": 40, "f": 56}, {"M": 7, "d": 24, "f": 40}]),
)


def test_a_layer_norm_into_an_interleaved_gate_up_pair_verifies() -> None:
    """The pair's interleaved weight is folded and corrected as one: μ ⊗ s then SwiGLU."""
    program = lower(LN_MLP)
    gate_up = program.steps[1]
    assert [op.op for op in gate_up.epilogue][-3:] == ["add_col_vector", "swiglu", "store"]
    report = evaluate(program, LN_MLP, OPTIONS)
    assert report.verified, report.render_text()
