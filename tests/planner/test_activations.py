"""Biased Linears, elementwise activations and GLUs with any activation, lowered by the planner
and verified by the sandbox (GPT-2's MLP, Gemma's GeGLU MLP)."""

from __future__ import annotations

import pytest

from coda.blocks import (
    GLU,
    Activation,
    Add,
    Block,
    Linear,
    RMSNorm,
    ShapeSets,
    SwiGLU,
    TensorSpec,
    registry,
)
from coda.blocks.autodiff import backward_block
from coda.blocks.ops import ActivationKind, Concat
from coda.planner import NoRule, lower
from coda.planner.rules.activation import ACTIVATION_EXPR
from coda.sandbox import SandboxOptions, evaluate
from coda.sandbox.report import StageResult
from coda.sandbox.stages import semantics, validate

OPTIONS = SandboxOptions(profile=False, isolate=False, seeds=[0])  # float32 + float16
RAGGED = ShapeSets(cpu=[{"M": 33, "d": 40, "f": 56}, {"M": 7, "d": 24, "f": 40}])


def _spec(*shape: str, init: str = "activation") -> TensorSpec:
    return TensorSpec(shape=list(shape), init=init)


def _block(name: str, graph: list, inputs: dict[str, TensorSpec], out: str = "out") -> Block:
    return Block(
        name=name, description=name, inputs=inputs, graph=graph, outputs=[out], shapes=RAGGED
    )


MLP_INPUTS = {
    "x": _spec("M", "d"),
    "w_fc": _spec("f", "d", init="linear_weight"),
    "b_fc": _spec("f"),
    "w_proj": _spec("d", "f", init="linear_weight"),
    "b_proj": _spec("d"),
}


def gpt2_mlp(kind: ActivationKind = "gelu_tanh", cap: float | None = None) -> Block:
    """GPT-2's MLP: ``c_proj(act(c_fc(x)))``, both Linears biased."""
    return _block(
        f"mlp_{kind}",
        [
            Linear(x="x", weight="w_fc", bias="b_fc", out="h"),
            Activation(x="h", kind=kind, cap=cap, out="a"),
            Linear(x="a", weight="w_proj", bias="b_proj", out="out"),
        ],
        MLP_INPUTS,
    )


GEMMA_MLP = _block(
    "gemma_mlp",
    [
        RMSNorm(x="x", weight="gamma", eps=1e-6, out="h"),
        Linear(x="h", weight="w_gate", out="g"),
        Linear(x="h", weight="w_up", out="u"),
        GLU(gate="g", up="u", act="gelu_tanh", out="a"),
        Linear(x="a", weight="w_down", out="m"),
        Add(a="x", b="m", out="out"),
    ],
    {
        "x": _spec("M", "d"),
        "gamma": _spec("d", init="norm_weight"),
        "w_gate": _spec("f", "d", init="linear_weight"),
        "w_up": _spec("f", "d", init="linear_weight"),
        "w_down": _spec("d", "f", init="linear_weight"),
    },
)


def _verify(block: Block):  # noqa: ANN202
    program = lower(block)
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()
    return program


def _algebra_holds(block: Block) -> None:
    """validate + semantics (float64 reference executor) only: milliseconds, no kernel run."""
    results: list[StageResult] = []
    program, _ = validate(lower(block), block, block.shapes.cpu, results)
    assert program is not None, results[-1].message
    semantics(program, block, block.shapes.cpu, results, seed=0, drawn=1)
    assert results[-1].status == "passed", results[-1].message


def test_gpt2_mlp_biases_and_gelu_tanh_join_the_epilogues() -> None:
    program = _verify(gpt2_mlp())
    fc, proj = program.steps
    assert [op.op for op in fc.epilogue] == ["add_col_vector", "map", "store"]
    assert "tanh" in fc.epilogue[1].expr
    assert [op.op for op in proj.epilogue] == ["add_col_vector", "store"]


def test_exact_gelu_runs_erf_in_the_kernel() -> None:
    program = _verify(gpt2_mlp("gelu"))
    assert "erf" in program.steps[0].epilogue[1].expr


@pytest.mark.parametrize(
    "kind,cap", [(k, 30.0 if k == "softcap" else None) for k in ACTIVATION_EXPR]
)
def test_every_activation_kind_matches_its_pytorch_semantics(kind: str, cap: float | None) -> None:
    _algebra_holds(gpt2_mlp(kind, cap))  # type: ignore[arg-type]


def test_softcap_needs_its_cap() -> None:
    with pytest.raises(ValueError, match="cap is required by softcap"):
        Activation(x="h", kind="softcap", out="a")


def test_gemma_geglu_mlp_interleaves_gate_and_up() -> None:
    program = _verify(GEMMA_MLP)
    assert [p.kind for p in program.prep] == ["interleave_rows", "fold_norm_weight"]
    gate_up = program.steps[1]
    assert [op.op for op in gate_up.epilogue] == ["scale_rows", "pairwise", "store"]
    assert "x1" in gate_up.epilogue[1].expr0 and "tanh" in gate_up.epilogue[1].expr0


def test_glu_of_two_inputs_reads_the_stored_gate() -> None:
    block = _block(
        "glu_two_inputs",
        [
            Linear(x="x", weight="w_gate", out="g"),
            Linear(x="y", weight="w_up", out="u"),
            GLU(gate="g", up="u", act="quick_gelu", out="out"),
        ],
        {
            "x": _spec("M", "d"),
            "y": _spec("M", "d"),
            "w_gate": _spec("f", "d", init="linear_weight"),
            "w_up": _spec("f", "d", init="linear_weight"),
        },
    )
    program = _verify(block)
    gate, up = program.steps
    assert [op.op for op in gate.epilogue] == ["store"]
    assert [op.op for op in up.epilogue] == ["load_tile", "map", "store"]


@pytest.mark.parametrize(
    "unit",
    [GLU(gate="g", up="u", act="gelu_tanh", out="a"), SwiGLU(gate="g", up="u", out="a")],
    ids=["geglu", "swiglu"],
)
def test_biased_gate_and_up_add_their_biases_in_the_pair_contraction(unit) -> None:  # noqa: ANN001
    inputs = {**MLP_INPUTS, "w_up": _spec("f", "d", init="linear_weight"), "b_up": _spec("f")}
    block = _block(
        "biased_glu",
        [
            Linear(x="x", weight="w_fc", bias="b_fc", out="g"),
            Linear(x="x", weight="w_up", bias="b_up", out="u"),
            unit,
            Linear(x="a", weight="w_proj", bias="b_proj", out="out"),
        ],
        inputs,
    )
    program = _verify(block)
    assert [p.kind for p in program.prep] == ["interleave_rows"]
    gate_up = program.steps[0].epilogue
    assert [op.op for op in gate_up] == ["load_col_vector", "load_col_vector", "pairwise", "store"]
    assert {gate_up[0].vector, gate_up[1].vector} == {"b_fc", "b_up"}


def test_a_vector_added_after_a_linear_is_a_bias() -> None:
    block = _block(
        "linear_plus_vector",
        [Linear(x="x", weight="w_fc", out="h"), Add(a="h", b="b_fc", out="out")],
        {k: MLP_INPUTS[k] for k in ("x", "w_fc", "b_fc")},
    )
    program = lower(block)
    assert [op.op for op in program.steps[0].epilogue] == ["add_col_vector", "store"]
    _algebra_holds(block)


def test_a_biased_linear_after_rmsnorm_scales_rows_before_the_bias() -> None:
    block = _block(
        "norm_linear_bias",
        [
            RMSNorm(x="x", weight="gamma", out="h"),
            Linear(x="h", weight="w_fc", bias="b_fc", out="out"),
        ],
        {
            **{k: MLP_INPUTS[k] for k in ("x", "w_fc", "b_fc")},
            "gamma": _spec("d", init="norm_weight"),
        },
    )
    program = lower(block)
    assert [op.op for op in program.steps[-1].epilogue] == ["scale_rows", "add_col_vector", "store"]
    _algebra_holds(block)


def test_an_activation_of_a_block_input_names_the_op() -> None:
    block = _block(
        "act_of_input", [Activation(x="x", kind="relu", out="out")], {"x": _spec("M", "d")}
    )
    with pytest.raises(NoRule, match=r"graph\[0\] activation\(out='out'\): no lowering rule"):
        lower(block)


def test_the_backward_of_a_biased_mlp_gives_the_bias_gradient(monkeypatch) -> None:  # noqa: ANN001
    """``d b_down = Σ_rows dout``: column sums of the incoming gradient in the dx epilogue (the
    planner's Programs for biased MLPs are verified in ``test_gemma_training.py``)."""
    forward = _block(
        "biased_swiglu_mlp",
        [
            RMSNorm(x="x", weight="gamma", out="h"),
            Linear(x="h", weight="w_gate", out="g"),
            Linear(x="h", weight="w_up", out="u"),
            SwiGLU(gate="g", up="u", out="a"),
            Linear(x="a", weight="w_down", bias="b_down", out="m"),
            Add(a="x", b="m", out="out"),
        ],
        {**GEMMA_MLP.inputs, "b_down": _spec("d")},
    )
    monkeypatch.setitem(registry._BLOCKS, forward.name, forward)
    backward = backward_block(
        forward,
        name="biased_swiglu_mlp_bwd",
        cotangents={"out": _spec("M", "d")},
        wrt=["x", "b_down"],
    )
    program = lower(backward)
    (db_down,) = [s for s in program.steps if s.kind == "sum_partials" and s.out == "db_down"]
    (dx_step,) = [s for s in program.steps if getattr(s, "name", "") == "gate_up_bwd"]
    (colsum,) = [op for op in dx_step.epilogue if getattr(op, "to", "") == db_down.src]
    assert colsum.axis == "col" and program.outputs["db_down"] == "db_down"


def test_a_fused_qkv_of_biased_linears_is_refused_by_name() -> None:
    block = _block(
        "biased_kv",
        [
            Linear(x="x", weight="w_k", bias="b_k", out="k"),
            Linear(x="x", weight="w_v", out="v"),
            Concat(parts=["k", "v"], out="out"),
        ],
        {
            "x": _spec("M", "d"),
            "w_k": _spec("f", "d", init="linear_weight"),
            "w_v": _spec("f", "d", init="linear_weight"),
            "b_k": _spec("f"),
        },
    )
    with pytest.raises(NoRule, match=r"its parts \['k'\] are biased Linears"):
        lower(block)


def test_gpt2_block_mlp_half_layer_norm_biases_and_gelu_verify() -> None:
    """GPT-2's ``x + c_proj(gelu_tanh(c_fc(ln_2(x))))``: the LayerNorm's rank-one correction
    and β, the c_fc bias and the activation in one epilogue; c_proj's bias and the residual in
    the other."""
    from coda.blocks import LayerNorm

    block = _block(
        "gpt2_mlp_half",
        [
            LayerNorm(x="x", weight="gamma", bias="beta", eps=1e-5, out="h"),
            Linear(x="h", weight="w_fc", bias="b_fc", out="f1"),
            Activation(x="f1", kind="gelu_tanh", out="a"),
            Linear(x="a", weight="w_proj", bias="b_proj", out="m"),
            Add(a="x", b="m", out="out"),
        ],
        {**MLP_INPUTS, "gamma": _spec("d", init="norm_weight"), "beta": _spec("d")},
    )
    program = _verify(block)
    fc = next(s for s in program.steps if getattr(s, "name", None) and s.kind == "gemm")
    ops = [op.op for op in fc.epilogue]
    assert ops.count("add_col_vector") == 2 and "scale_rows" in ops  # β·W and the c_fc bias
