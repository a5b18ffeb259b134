"""Backward of a LayerNorm MLP that is not gated (GPT-2's ``x + c_proj(gelu_tanh(c_fc(ln_2(x))))``),
lowered by the LayerNorm rule from the forward graph and verified by the sandbox (CPU interpreter,
float32 and float16, ragged shapes); the forms it refuses."""

from __future__ import annotations

import pytest

from coda.blocks import (
    Activation,
    Add,
    Block,
    LayerNorm,
    Linear,
    RMSNorm,
    ShapeSets,
    SwiGLU,
    TensorSpec,
)
from coda.blocks.autodiff import backward_block
from coda.blocks.registry import register
from coda.planner import NoRule, lower
from coda.sandbox import SandboxOptions, evaluate

OPTIONS = SandboxOptions(profile=False, isolate=False, seeds=[0])  # float32 + float16
RAGGED = ShapeSets(cpu=[{"M": 33, "d": 40, "f": 56}, {"M": 1, "d": 24, "f": 40}])


def _spec(*shape: str, init: str = "activation") -> TensorSpec:
    return TensorSpec(shape=list(shape), init=init)


def _mlp(name: str, *, biases: bool, residual: bool, kind: str = "gelu_tanh") -> Block:
    """``[x +] W2·act(W1·LN(x) [+ b1]) [+ b2]``, LayerNorm with β when ``biases``."""
    bias = {"b_fc": _spec("f"), "b_proj": _spec("d"), "beta": _spec("d")} if biases else {}
    out = "m" if residual else "out"
    graph = [
        LayerNorm(x="x", weight="gamma", bias="beta" if biases else None, eps=1e-5, out="h"),
        Linear(x="h", weight="w_fc", bias="b_fc" if biases else None, out="z"),
        Activation(x="z", kind=kind, out="a"),
        Linear(x="a", weight="w_proj", bias="b_proj" if biases else None, out=out),
    ]
    if residual:
        graph.append(Add(a="x", b="m", out="out"))
    inputs = {
        "x": _spec("M", "d"),
        "gamma": _spec("d", init="norm_weight"),
        "w_fc": _spec("f", "d", init="linear_weight"),
        "w_proj": _spec("d", "f", init="linear_weight"),
        **bias,
    }
    return Block(
        name=name, description=name, inputs=inputs, graph=graph, outputs=["out"], shapes=RAGGED
    )


def _backward(
    forward: Block, zeros: list[str] | None = None, saved: dict[str, TensorSpec] | None = None
) -> Block:
    register(forward)
    return register(
        backward_block(
            forward,
            name=f"{forward.name}_bwd",
            cotangents={"out": _spec("M", "d")},
            wrt=list(forward.inputs),
            zeros=zeros,
            saved=saved,
        )
    )


def test_gpt2_mlp_backward_verifies() -> None:
    """dz = (dout W2) ⊙ gelu'(z) next to the recomputed z, LayerNorm's backward (β, γ, the mean
    terms) in the dz W1 epilogue; db_fc, db_proj, dγ, dβ as column sums."""
    block = _backward(_mlp("test_gpt2_mlp", biases=True, residual=True), zeros=["b_proj"])
    program = lower(block)
    assert [getattr(s, "name", s.kind) for s in program.steps] == [
        "mean_rstd", "fc", "proj_bwd", "sum_partials", "sum_partials", "sum_partials",
        "w_proj_grad", "fc_bwd", "sum_partials", "sum_partials", "sum_partials", "w_fc_grad",
    ]  # fmt: skip
    assert {"dx", "dgamma", "dbeta", "dw_fc", "db_fc", "dw_proj", "db_proj"} <= set(block.outputs)
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_bias_free_branch_alone_verifies() -> None:
    """No β, no Linear biases, no residual (dx is the norm's alone), exact GELU."""
    block = _backward(_mlp("test_ln_mlp_branch", biases=False, residual=False, kind="gelu"))
    program = lower(block)
    fc_bwd = next(s for s in program.steps if getattr(s, "name", "") == "fc_bwd")
    assert "add_tile" not in [op.op for op in fc_bwd.epilogue]
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_saved_pre_activation_and_activation_spare_the_recomputation() -> None:
    """With ``z`` and ``a`` saved by the forward, no GEMM recomputes ``z`` and the ``dout W2``
    epilogue stores no ``a``; β and b_fc still enter LayerNorm's statistics (c_proj's bias, which
    no gradient depends on, is left out of the forward: a saved value would depend on it)."""
    forward = _mlp("test_gpt2_mlp_saved", biases=True, residual=True)
    graph = [*forward.graph[:3], Linear(x="a", weight="w_proj", out="m"), forward.graph[4]]
    inputs = {n: spec for n, spec in forward.inputs.items() if n != "b_proj"}
    forward = forward.model_copy(update={"graph": graph, "inputs": inputs})
    block = _backward(forward, saved={"z": _spec("M", "f"), "a": _spec("M", "f")})
    program = lower(block)
    names = [getattr(s, "name", s.kind) for s in program.steps]
    assert "fc" not in names
    proj_bwd = next(s for s in program.steps if getattr(s, "name", "") == "proj_bwd")
    assert [op.to for op in proj_bwd.epilogue if op.op == "store"] == ["dz"]
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_a_gated_mlp_after_a_layer_norm_is_refused() -> None:
    forward = Block(
        name="test_ln_swiglu",
        description="out = x + down(silu(gate(LN(x))) * up(LN(x)))",
        inputs={
            "x": _spec("M", "d"),
            "gamma": _spec("d", init="norm_weight"),
            "w_gate": _spec("f", "d", init="linear_weight"),
            "w_up": _spec("f", "d", init="linear_weight"),
            "w_down": _spec("d", "f", init="linear_weight"),
        },
        graph=[
            LayerNorm(x="x", weight="gamma", out="h"),
            Linear(x="h", weight="w_gate", out="g"),
            Linear(x="h", weight="w_up", out="u"),
            SwiGLU(gate="g", up="u", out="a"),
            Linear(x="a", weight="w_down", out="m"),
            Add(a="x", b="m", out="out"),
        ],
        outputs=["out"],
        shapes=RAGGED,
    )
    read_twice = r"'test_ln_swiglu'.*'h' must be read by one Linear only.*Linear\('u'\)"
    with pytest.raises(NoRule, match=read_twice):
        lower(_backward(forward))


def test_a_post_norm_after_a_layer_norm_mlp_is_refused() -> None:
    forward = _mlp("test_ln_mlp_post", biases=False, residual=True)
    graph = [*forward.graph[:3], Linear(x="a", weight="w_proj", out="p")]
    graph += [RMSNorm(x="p", weight="gamma_post", out="m"), Add(a="x", b="m", out="out")]
    forward = forward.model_copy(
        update={"graph": graph, "inputs": {**forward.inputs, "gamma_post": _spec("d")}}
    )
    with pytest.raises(NoRule, match=r"a post-norm \('m'\) after a LayerNorm MLP"):
        lower(_backward(forward))
