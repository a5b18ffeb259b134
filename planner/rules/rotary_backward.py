"""Backward of an attention input in Hugging Face's order (docs/algebra.md §4–5): ``h =
rmsnorm(x)·γ`` (or ``h = x``: OLMo 2 has no input norm); q, k, v = Linears of h (biases
optional); q, k each through an optional per-head RMSNorm (Qwen3's ``q_norm``/``k_norm``; Gemma
3's, scaled by ``1 + w``) or RMSNorm over the whole projection (OLMo 2's), and ``RoPE``; the
rotated q, k and v are block outputs.

Schedule (``RoPERule.differentiate``):

1. ``z = r ⊙ (x (W_qkv·diag γ)ᵀ)`` recomputed, one GEMM over ``concat_rows`` of the three weights
   (Hugging Face's row order: nothing is paired) — skipped when the backward block receives the
   forward's outputs (``saved``) and no per-head norm needs the projection;
2. aux ``rotary_input_grad``: ``dz = [RoPEᵀ dq_rot | RoPEᵀ dk_rot | dv]`` (through the per-head
   norms' backward), the input norm's statistic ``c`` and the per-head norms' weight gradients;
3. the RMSNorm backward in the epilogue of ``dh = dz W_qkv`` (``BackwardBuilder.norm_backward``):
   ``dx``, ``dγ`` — without an input norm ``dx = dz W_qkv`` alone;
4. ``dW_qkv = dzᵀ y`` on the vendor GEMM, split into the three weights' gradients by one aux
   ``split_rows`` (tensors of their own, not row views); the biases' gradients are the column
   sums of each part of ``dz`` (from ``rotary_input_grad``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coda.blocks.ops import HeadRMSNorm, Linear, RMSNorm, RoPE

from ..backward import BackwardBuilder
from ..shapes import size_expr_of
from ..state import PlanState
from .rope import rotary_chain

EXPECTED = (
    "expected a block input, or an RMSNorm of one, feeding Linears (q, k, v; biases optional), q "
    "and k each through an optional HeadRMSNorm (or RMSNorm over the whole projection) into a "
    "RoPE whose output is a block output, v a block output"
)


@dataclass
class Part:
    """One projection: its Linear, and for a rotated part its optional per-head norm and RoPE;
    ``out`` is the block output it ends in."""

    linear: Linear
    out: str
    norm: HeadRMSNorm | RMSNorm | None = None
    rope: RoPE | None = None


def rotary_parts(b: BackwardBuilder) -> tuple[RMSNorm | None, list[Part]]:
    """The input norm (``None`` where the Linears read a block input) and the projections of the
    forward block (rotated parts first), or ``NoRule`` naming what does not match."""
    st = PlanState(b.forward, b.st.options)
    _, first = b.find(Linear)
    norm = None if first.x in b.forward.inputs else b.norm(first.x)
    h = norm.out if norm is not None else first.x
    rotated, plain = [], []
    for j, lin in st.consumers(h):
        if not isinstance(lin, Linear):
            b.fail(f"{EXPECTED}; the projections' input {h!r} is also read by {lin.op}")
        chain = rotary_chain(st, j, lin)
        if chain is not None:
            head = chain.norm[1] if chain.norm is not None else None
            rope = chain.rope[1]
            rotated.append(Part(lin, rope.out, head, rope))
        else:
            plain.append(Part(lin, lin.out))
    parts = [*rotated, *plain]
    _check_parts(b, parts)
    return norm, parts


def _check_parts(b: BackwardBuilder, parts: list[Part]) -> None:
    """``NoRule`` unless the parts fit the schedule: outputs nothing else reads, one cos/sin
    pair, biases on all or none, per-head norms on all rotated parts or none (one epsilon, one
    offset)."""
    rotated = [p for p in parts if p.rope is not None]
    if not rotated:
        b.fail(f"{EXPECTED}; no Linear of the norm's output goes into a RoPE")
    for p in parts:
        readers = [op.op for op in b.forward.graph if p.out in op.inputs()]
        if p.out not in b.forward.outputs or readers:
            b.fail(f"{EXPECTED}; {p.out!r} must be a block output that no op reads")
    if len({(p.rope.cos, p.rope.sin) for p in rotated}) > 1:  # type: ignore[union-attr]
        b.fail("its RoPEs use different cos/sin tables")
    biased = [p.linear.out for p in parts if p.linear.bias is not None]
    if biased and len(biased) != len(parts):
        b.fail(f"only {biased} of the projections are biased; give every projection a bias or none")
    norms = [p.norm for p in rotated if p.norm is not None]
    if norms and len(norms) != len(rotated):
        b.fail("only some rotated projections have a q/k norm; give each one or none")
    if len({type(n) for n in norms}) > 1:
        b.fail(
            "its q/k norms mix HeadRMSNorm (per head) and RMSNorm (whole projection); the "
            "backward rule takes one kind for all"
        )
    if len({n.eps for n in norms}) > 1:
        b.fail("its q/k norms use different epsilons; the backward rule takes one")
    offsets = {n.out: n.offset for n in norms}
    if len(set(offsets.values())) > 1:
        b.fail(
            f"its q/k norms scale by different offsets + weight ({offsets}); the backward "
            "rule takes one offset for all (0: Qwen3's q/k norms, 1: Gemma 3's)"
        )


def rotary_input_backward(b: BackwardBuilder) -> None:
    """Write the schedule of the module docstring into ``b``."""
    norm, parts = rotary_parts(b)
    weights = [p.linear.weight for p in parts]
    w_qkv = b.prep(
        ("concat", *weights), {"kind": "concat_rows", "tensors": weights, "out": "w_qkv"}
    )
    node = _grad_node(b, norm, parts)
    r = _projection_or_saved(b, norm, parts, w_qkv, node)
    dz = b.aux(node)
    heads = [p.norm for p in parts if p.norm is not None]
    for n, grad in zip(heads, node.get("norm_grads", []), strict=False):
        b.output(n.weight, grad)
    for p, grad in zip(parts, node.get("bias_grads", []), strict=False):
        b.output(p.linear.bias, grad)  # type: ignore[arg-type]
    if norm is not None:
        y = b.norm_backward("qkv_bwd", dz, w_qkv, norm, r, node["dot_out"], residual=None)
    else:  # no input norm: dx = dz W_qkv, and the weights' gradient is dzᵀ x
        b.output(parts[0].linear.x, b.plain_gemm("qkv_bwd", dz, w_qkv, "dx"))
        y = parts[0].linear.x
    dw = b.plain_gemm("w_qkv_grad", f"{dz}.T", y, "dw_qkv")
    # one copy writes each weight's gradient as a tensor of its own
    widths = [size_expr_of(b.st, p.linear.weight, 0) for p in parts]
    b.weight_gradients({"kind": "split_rows", "src": dw}, [p.linear.weight for p in parts], widths)


def _grad_node(b: BackwardBuilder, norm: RMSNorm | None, parts: list[Part]) -> dict[str, Any]:
    """The ``rotary_input_grad`` step, but for where z comes from (``_projection_or_saved``)."""
    rotated = [p for p in parts if p.rope is not None]
    rope = rotated[0].rope
    assert rope is not None
    node: dict[str, Any] = {
        "kind": "rotary_input_grad",
        "grads": [b.cotangent(p.out) for p in parts],
        "rotated": len(rotated),
        "cos": rope.cos,
        "sin": rope.sin,
        "out": "dz",
    }
    if norm is not None:  # the input norm's c = Σ z·dz / d; no input norm (OLMo 2): none to make
        node |= {"dot_out": b.name("c"), "divide_by": size_expr_of(b.st, norm.x, 1)}
    biases = [p.linear.bias for p in parts if p.linear.bias is not None]
    if biases:
        node["bias_grads"] = [b.name(f"d{bias}") for bias in biases]
    heads = [p.norm for p in rotated if p.norm is not None]
    if heads:
        node |= {
            "head_norm": [n.weight for n in heads],
            "eps": heads[0].eps,
            "norm_grads": [b.name(f"d{n.weight}") for n in heads],
        }
        if heads[0].offset:  # Gemma 3's x̂ · (1 + w)
            node["head_offset"] = heads[0].offset
        if isinstance(heads[0], RMSNorm):  # OLMo 2's: over the whole projection
            node["whole_norm"] = True
    return node


def _projection_or_saved(
    b: BackwardBuilder, norm: RMSNorm | None, parts: list[Part], w_qkv: str, node: dict[str, Any]
) -> str | None:
    """Give ``node`` the saved outputs (no q/k norm, all saved) or the projection ``z``
    recomputed by a GEMM, and the biases where it needs them; returns the input norm's ``r``
    (``None`` without one)."""
    heads = "head_norm" in node
    saved = not heads and all(p.out in b.op.saved for p in parts)
    biases = [p.linear.bias for p in parts if p.linear.bias is not None]
    if biases and (heads or saved):
        dropped = [bias for bias in biases if bias in b.op.zeros]
        if dropped:
            b.fail(
                f"the backward block leaves the biases {dropped} out (zeros), but "
                + ("the per-head norms after them" if heads else "the saved outputs")
                + " depend on them: give them as inputs"
            )
        node["bias"] = biases
    if saved:
        node["saved"] = [p.out for p in parts]
        return b.rstd(norm) if norm is not None else None
    z = b.name("z")
    if norm is None:
        # z = x W_qkvᵀ kept in fp32: the q/k norms' statistics read it unrounded (in 16 bits a
        # one-row weight gradient of a whole-projection norm lands just outside the tolerance)
        epilogue = [{"op": "store", "src": "acc", "to": z, "dtype": "float32"}]
        b.gemm("qkv_recompute", parts[0].linear.x, f"{w_qkv}.T", epilogue)
        node["z"] = z
        return None
    r, folded = b.forward_projection(norm, w_qkv)
    epilogue = [
        {"op": "scale_rows", "src": "acc", "vector": r, "out": "z_tile"},
        {"op": "store", "src": "z_tile", "to": z},
    ]
    b.gemm("qkv_recompute", norm.x, f"{folded}.T", epilogue)
    node["z"] = z
    return r
