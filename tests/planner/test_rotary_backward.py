"""Backward of attention inputs in Hugging Face's order — Qwen2's biased projections, Qwen3's
per-head q/k norms, Gemma 3's (``1 + w``), OLMo 2's over the whole projection (with and without
an input norm), Llama's from saved outputs — lowered by the planner from the forward graph and
verified by the sandbox (CPU interpreter, float32 and float16, ragged shapes, MHA and GQA); the
aux step ``rotary_input_grad``'s pieces against autograd; the forms the rule refuses."""

from __future__ import annotations

import pytest
import torch

from coda.blocks import Block, TensorSpec, get_block
from coda.blocks.autodiff import backward_block
from coda.blocks.functional import head_rms_norm, rope
from coda.blocks.ops import HeadRMSNorm, Linear, RMSNorm
from coda.blocks.registry import register
from coda.planner import NoRule, lower
from coda.primitives import Program
from coda.primitives.aux.rotary_grad import head_norm_backward, rope_transpose
from coda.sandbox import evaluate
from coda.sandbox.compare import assert_close
from tests.helpers import DTYPE_TOL, make_inputs, run_both

from .test_rotary_rules import GEMMA3, LLAMA, OLMO2, OPTIONS, QWEN2, QWEN3, attention_input


def _backward(forward: Block, *, saved: bool = False, zeros: bool = True) -> Block:
    """The backward block of ``forward`` for every floating input but the tables; biases left
    out (``zeros``: no gradient depends on them) unless ``saved`` or ``zeros=False``. The forward
    is registered under a name of its own (``qwen2_attn_in`` is also a built-in block's)."""
    forward = register(forward.model_copy(update={"name": f"test_{forward.name}"}))
    cot = {o: TensorSpec(shape=["M", "Nq" if o == "q_rot" else "Nkv"]) for o in forward.outputs}
    wrt = [n for n in forward.inputs if n not in ("cos", "sin")]
    biases = [n for n in forward.inputs if n.startswith("b_")]
    suffix = "_bwd_saved" if saved else "_bwd"
    return register(
        backward_block(
            forward,
            name=forward.name + suffix + ("" if zeros else "_with_biases"),
            cotangents=cot,
            wrt=wrt,
            saved=cot if saved else None,
            zeros=biases if zeros and not saved else None,
        )
    )


def _kinds(block: Block) -> list[str]:
    return [s.kind for s in lower(block).steps]


def test_qwen2_backward_recomputes_the_projection_and_sums_the_bias_gradients() -> None:
    """dz from the gradients of q_rot, k_rot, v (RoPE transposed); db_q, db_k, db_v its column
    sums; the biases themselves are no inputs of the backward (no gradient depends on them)."""
    block = _backward(QWEN2)
    assert not {"b_q", "b_k", "b_v"} & set(block.inputs)
    assert {"db_q", "db_k", "db_v"} <= set(block.outputs)
    program = lower(block)
    assert [s.kind for s in program.steps] == [
        "rstd", "gemm", "rotary_input_grad", "gemm", "sum_partials", "gemm", "split_rows",
    ]  # fmt: skip
    # the weights' gradients: tensors of their own, copied out of dW_qkv by one launch
    split = program.steps[-1]
    assert [(p.out, p.rows) for p in split.parts] == [
        ("dw_q", "Nq"), ("dw_k", "Nkv"), ("dw_v", "Nkv"),
    ]  # fmt: skip
    assert {n: program.outputs[n] for n in ("dw_q", "dw_k", "dw_v")} == {
        "dw_q": "dw_q", "dw_k": "dw_k", "dw_v": "dw_v",
    }  # fmt: skip
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_qwen3_backward_runs_the_per_head_norms_backward() -> None:
    block = _backward(QWEN3)
    program = lower(block)
    grad = next(s for s in program.steps if s.kind == "rotary_input_grad")
    assert grad.head_norm == ["q_norm", "k_norm"] and grad.z is not None
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_gemma3_backward_scales_the_per_head_norms_by_one_plus_weight() -> None:
    """Gemma 3's q/k norms scale by ``1 + w`` (rounded after the weight): their backward uses
    ``1 + w``, their weight gradients keep the form ``Σ dn ⊙ q̂``."""
    block = _backward(GEMMA3)
    program = lower(block)
    grad = next(s for s in program.steps if s.kind == "rotary_input_grad")
    assert grad.head_norm == ["q_norm", "k_norm"] and grad.head_offset == 1.0
    assert Program.parse(program.canonical_json()) == program  # the offset survives JSON
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def _without_input_norm(forward: Block) -> Block:
    """``forward`` with its Linears reading ``x`` itself (OLMo 2: no input norm)."""
    graph = [
        op.model_copy(update={"x": "x"}) if isinstance(op, Linear) else op
        for op in forward.graph
        if op.out != "h"
    ]
    inputs = {n: s for n, s in forward.inputs.items() if n != "gamma"}
    name = f"{forward.name}_no_input_norm"
    return forward.model_copy(update={"name": name, "graph": graph, "inputs": inputs})


@pytest.mark.parametrize("input_norm", [True, False], ids=["input_norm", "olmo2"])
def test_whole_projection_norms_run_their_backward_in_the_grad_pass(input_norm: bool) -> None:
    """q/k RMS-normed over the whole projection (OLMo 2): ``rotary_input_grad`` takes each row's
    statistics over the part, weight gradients ``[Nq]``, ``[Nkv]``; without an input norm
    ``dx = dz W_qkv`` is a plain GEMM and ``dW = dzᵀ x``."""
    forward = OLMO2 if input_norm else _without_input_norm(OLMO2)
    block = _backward(forward)
    program = lower(block)
    grad = next(s for s in program.steps if s.kind == "rotary_input_grad")
    assert grad.whole_norm and grad.head_norm == ["q_norm", "k_norm"]
    assert Program.parse(program.canonical_json()) == program  # whole_norm survives JSON
    assert ("rstd" in [s.kind for s in program.steps]) == input_norm
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_saved_outputs_spare_the_projection_gemm() -> None:
    """Without per-head norms the saved q_rot, k_rot, v give c: no GEMM recomputes z."""
    block = _backward(LLAMA, saved=True)
    assert _kinds(block) == [
        "rstd", "rotary_input_grad", "gemm", "sum_partials", "gemm", "split_rows",
    ]  # fmt: skip
    report = evaluate(lower(block), block, OPTIONS)
    assert report.verified, report.render_text()


def test_rope_transpose_is_ropes_gradient_on_any_tables() -> None:
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(3, 24, dtype=torch.float64, generator=g) for _ in range(2))
    cos, sin = (torch.randn(3, 8, dtype=torch.float64, generator=g) for _ in range(2))
    x.requires_grad_(True)
    (expected,) = torch.autograd.grad(rope(x, cos, sin), x, dy)
    torch.testing.assert_close(rope_transpose(dy, cos, sin), expected)


@pytest.mark.parametrize(
    ("offset", "cast"), [(0.0, "before_weight"), (1.0, "after_weight")], ids=["qwen3", "gemma3"]
)
def test_head_norm_backward_is_autograds(offset: float, cast: str) -> None:
    g = torch.Generator().manual_seed(0)
    z, dy = (torch.randn(4, 16, dtype=torch.float64, generator=g) for _ in range(2))
    w = torch.rand(8, dtype=torch.float64, generator=g) - 0.5
    z.requires_grad_(True)
    w.requires_grad_(True)
    expected = torch.autograd.grad(head_rms_norm(z, w, 1e-6, offset, cast), (z, w), dy)
    got = head_norm_backward(dy, z.detach(), w.detach(), 1e-6, offset)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_per_head_and_whole_projection_norms_mixed_are_refused() -> None:
    """q normed per head, k over the whole projection: one kind serves all rotated parts."""
    graph = [
        HeadRMSNorm(x=op.x, weight=op.weight, out=op.out, eps=op.eps)
        if isinstance(op, RMSNorm) and op.out == "q_normed"
        else op
        for op in OLMO2.graph
    ]
    inputs = {**OLMO2.inputs, "q_norm": TensorSpec(shape=["D"], init="norm_weight")}
    forward = OLMO2.model_copy(
        update={"name": "mixed_norms_attn_in", "graph": graph, "inputs": inputs}
    )
    with pytest.raises(NoRule, match=r"mix HeadRMSNorm \(per head\) and RMSNorm"):
        lower(_backward(forward))


def test_per_head_norms_with_different_offsets_are_refused() -> None:
    """One ``head_offset`` serves every rotated part: q scaled by ``1 + w``, k by ``w`` is not
    taken, and the refusal names each norm's offset."""
    k_norm_plain = {"offset": 0.0, "cast": "before_weight"}
    graph = [
        op.model_copy(update=k_norm_plain) if op.out == "k_normed" else op for op in GEMMA3.graph
    ]
    assert any(isinstance(op, HeadRMSNorm) and op.out == "k_normed" for op in graph)
    forward = GEMMA3.model_copy(update={"name": "mixed_offsets_attn_in", "graph": graph})
    offsets = r"different offsets \+ weight \({'q_normed': 1\.0, 'k_normed': 0\.0}\)"
    with pytest.raises(NoRule, match=offsets):
        lower(_backward(forward))


def test_biases_left_out_where_the_backward_needs_them_are_refused() -> None:
    qwen3_biased = attention_input("qwen3_biased", bias=True, qk_norm={"eps": 1e-6})
    with pytest.raises(NoRule, match=r"leaves the biases \['b_q', 'b_k', 'b_v'\] out.*per-head"):
        lower(_backward(qwen3_biased))


def test_biased_linears_elsewhere_name_the_rule_that_takes_them() -> None:
    """A bias on Llama's fused-QKV attention input (pair order, one Concat output): that backward
    rule takes bias-free Linears only, and the refusal names the rules that take biases."""
    attn = get_block("llama_attn_in")
    graph = [op.model_copy(update={"bias": "b_q"}) if op.out == "q" else op for op in attn.graph]
    inputs = {**attn.inputs, "b_q": TensorSpec(shape=["Nq"])}
    forward = register(
        attn.model_copy(update={"name": "biased_q_llama_attn_in", "graph": graph, "inputs": inputs})
    )
    shapes = get_block("llama_attn_in_bwd").shapes
    block = backward_block(
        forward,
        name="biased_q_llama_attn_in_bwd",
        cotangents={"qkv": TensorSpec(shape=["M", "Nqkv"])},
        wrt=["x"],
        shapes=shapes,
    )
    with pytest.raises(NoRule, match=r"\['q'\].*but for .*attention input in Hugging Face's"):
        lower(block)


def _grad_program(*, saved: bool, head_offset: float = 0.0, whole: bool = False) -> Program:
    """``rotary_input_grad`` alone on biased q, k, v: from the saved outputs, or from ``z`` with
    per-head norms (``whole``: norms over each part's row) scaled by ``head_offset + w`` (both
    paths need the biases)."""
    parts = {"q": "Nq", "k": "Nkv", "v": "Nkv"}
    inputs: dict = {f"g{p}": ["M", n] for p, n in parts.items()}
    inputs |= {f"b{p}": [n] for p, n in parts.items()}
    inputs |= {"cos": ["M", "D"], "sin": ["M", "D"]}
    step = {
        "kind": "rotary_input_grad",
        "grads": ["gq", "gk", "gv"],
        "rotated": 2,
        "cos": "cos",
        "sin": "sin",
        "bias": ["bq", "bk", "bv"],
        "bias_grads": ["dbq", "dbk", "dbv"],
        "dot_out": "c",
        "divide_by": "D + 8",
        "out": "dz",
    }
    outputs = ["dz", "c", "dbq", "dbk", "dbv"]
    if saved:
        inputs |= {f"s{p}": ["M", n] for p, n in parts.items()}
        step["saved"] = ["sq", "sk", "sv"]
    else:
        inputs |= {
            "z": ["M", "Nz"],
            "wq": ["Nq" if whole else "D"],
            "wk": ["Nkv" if whole else "D"],
        }
        step |= {"z": "z", "head_norm": ["wq", "wk"], "eps": 1e-6, "norm_grads": ["dwq", "dwk"]}
        step |= {"head_offset": head_offset, "whole_norm": whole}
        outputs += ["dwq", "dwk"]
    return Program.parse(
        {"block": "test", "inputs": inputs, "steps": [step], "outputs": {o: o for o in outputs}}
    )


@pytest.mark.parametrize(
    ("saved", "head_offset", "whole"),
    [(True, 0.0, False), (False, 0.0, False), (False, 1.0, False), (False, 1.0, True)],
    ids=["saved", "head_norms", "offset_head_norms", "offset_whole_norms"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rotary_input_grad_kernel_with_biases_at_a_head_width_no_power_of_two(
    saved: bool, head_offset: float, whole: bool, dtype: torch.dtype
) -> None:
    """The paths no verifiable block reaches with its biases given (a Qwen2 backward leaves them
    out): the kernel against the float64 reference, 13 rows, heads of width 12."""
    program = _grad_program(saved=saved, head_offset=head_offset, whole=whole)
    sizes = {"M": 13, "Nq": 36, "Nkv": 12, "D": 12, "Nz": 60}
    inputs = make_inputs(program, sizes, dtype)
    got, _, exact = run_both(program, inputs)
    atol, rtol = DTYPE_TOL[dtype]
    for name, want in exact.items():
        assert_close(got[name].double(), want, atol=atol * 4, rtol=rtol * 4, what=name)
