"""The backward of a Linear added to the residual (an attention output: Mistral/Llama's ``x +
attn W_oᵀ``, OLMo 2's and Gemma's ``x + RMSNorm(attn W_oᵀ)``), lowered from the forward's ``Add``
and verified by the sandbox against autograd; and the forward graphs it refuses, by name."""

from __future__ import annotations

import pytest

from coda.blocks import Activation, Add, Block, Linear, RMSNorm, ShapeSets, TensorSpec, registry
from coda.blocks.autodiff import backward_block
from coda.blocks.ops import RowRstd
from coda.planner import NoRule, lower
from coda.sandbox import SandboxOptions, evaluate

OPTIONS = SandboxOptions(profile=False, isolate=False, seeds=[0])  # float32 + float16
# ragged M and d (d not a multiple of 16), and one token
RAGGED = ShapeSets(cpu=[{"M": 33, "d": 40, "f": 56}, {"M": 1, "d": 24, "f": 40}])
NORMS = {
    "olmo2": {"eps": 1e-6, "cast": "after_weight"},  # Olmo2RMSNorm: (γ · x̂) in fp32, cast after
    "gemma": {"eps": 1e-6, "offset": 1.0, "cast": "after_weight"},  # x̂ · (1 + γ)
}


def _spec(*shape: str, init: str = "activation") -> TensorSpec:
    return TensorSpec(shape=list(shape), init=init)


def _forward(monkeypatch, branch: list, tail: tuple = (), bias: bool = False) -> Block:  # noqa: ANN001
    """``out = x + branch(attn W_oᵀ)`` (``branch``: ops from ``y`` to ``n``, or none), registered
    for the backward block to find."""
    inputs = {
        "x": _spec("M", "d"),
        "attn": _spec("M", "f"),
        "w_o": _spec("d", "f", init="linear_weight"),
    }
    if any(isinstance(op, RMSNorm) for op in branch):
        inputs["gamma"] = _spec("d", init="norm_weight")
    if bias:
        inputs["b_o"] = _spec("d")
    last = branch[-1].out if branch else "y"
    block = Block(
        name="residual_linear",
        description="out = x + branch(attn @ w_o.T)",
        inputs=inputs,
        graph=[
            Linear(x="attn", weight="w_o", bias="b_o" if bias else None, out="y"),
            *branch,
            Add(a="x", b=last, out="out"),
            *tail,
        ],
        outputs=["out", *(op.out for op in tail)],
        shapes=RAGGED,
    )
    monkeypatch.setitem(registry._BLOCKS, block.name, block)
    return block


def _backward(forward: Block, cotangents: tuple[str, ...] = ("out",)) -> Block:
    wrt = [n for n in forward.inputs if n != "b_o"]
    return backward_block(
        forward,
        name="residual_linear_bwd",
        cotangents={o: _spec("M") if o == "rstd" else _spec("M", "d") for o in cotangents},
        wrt=wrt,
        zeros=["x"],  # no gradient depends on the residual's values: dx = dout
    )


def test_an_attention_output_backward_verifies(monkeypatch) -> None:  # noqa: ANN001
    """Mistral's ``x + attn W_oᵀ``: dx = dout copied, d attn = dout W_o, dW_o = doutᵀ attn."""
    block = _backward(_forward(monkeypatch, []))
    program = lower(block)
    assert [s.kind for s in program.steps] == ["rescale_rows", "gemm", "gemm"]
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


@pytest.mark.parametrize("family", sorted(NORMS))
def test_a_post_norm_attention_output_backward_verifies(monkeypatch, family: str) -> None:  # noqa: ANN001
    """OLMo 2's (and Gemma's offset) post-norm: dm through the norm, dx stored from its GEMM."""
    norm = RMSNorm(x="y", weight="gamma", out="n", **NORMS[family])
    block = _backward(_forward(monkeypatch, [norm]))
    program = lower(block)
    names = [getattr(s, "name", None) for s in program.steps if s.kind == "gemm"]
    assert names == ["post_norm_stats", "post_norm_bwd", "linear_input_grad", "linear_weight_grad"]
    assert set(program.outputs) == {"dattn", "dw_o", "dgamma", "dx"}
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_a_next_norm_statistic_without_a_gradient_is_left_out() -> None:
    """The built-in ``llama_attn_out`` also outputs the next norm's ``rstd``: with no cotangent
    for it the backward is the attention output's."""
    block = backward_block(
        registry.get_block("llama_attn_out"),
        name="llama_attn_out_bwd_x_out",
        cotangents={"x_out": _spec("M", "d")},
        wrt=["attn", "w_o", "x"],
        zeros=["x"],
    )
    report = evaluate(lower(block), block, OPTIONS)
    assert report.verified, report.render_text()


def test_the_gradient_of_a_next_norm_statistic_is_refused_by_name(monkeypatch) -> None:  # noqa: ANN001
    forward = _forward(monkeypatch, [], tail=(RowRstd(x="out", eps=1e-5, out="rstd"),))
    with pytest.raises(NoRule, match=r"the gradient of the statistic 'rstd' \(RowRstd\)"):
        lower(_backward(forward, cotangents=("out", "rstd")))


def test_an_activation_between_linear_and_residual_is_refused_by_name(monkeypatch) -> None:  # noqa: ANN001
    forward = _forward(monkeypatch, [Activation(x="y", kind="relu", out="n")])
    with pytest.raises(NoRule, match=r"its graph is \['Linear', 'Activation', 'Add'\]"):
        lower(_backward(forward))


def test_a_biased_output_projection_is_refused_by_name(monkeypatch) -> None:  # noqa: ANN001
    forward = _forward(monkeypatch, [], bias=True)
    with pytest.raises(NoRule, match=r"has biased Linears \['y'\]"):
        lower(_backward(forward))
