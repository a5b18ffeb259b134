"""``Linear``: every ``Linear`` becomes (part of) a ``gemm`` step ``acc = x @ Wᵀ`` whose epilogue
absorbs what it can (``epilogue.emit_gemm``).

* **pairwise interleave** (``swiglu.gate_up_pair``): two Linears of the same input whose outputs
  meet in a ``SwiGLU`` become one GEMM over ``interleave_rows(gate, up)`` with ``swiglu`` in its
  epilogue; when the gate and up projections are block outputs themselves (a training forward
  saving them for its backward), ``split_pairs`` stores them too.
* **fused QKV with RoPE** (``rope.qkv_group``): Linears of one input whose results are
  concatenated become one GEMM over the concatenated weights.
* **RoPE in Hugging Face's order** (``rope.separate_qkv``, ``rope.rotary_chain``): unbiased Q, K,
  V Linears whose outputs (Q and K through ``RoPE``) are the block's become one GEMM; otherwise
  a Linear whose output goes through an optional ``HeadRMSNorm``/``RMSNorm`` into a ``RoPE`` runs
  on ``rope_pairs`` of its weight with the rotation in its epilogue and a column-permuting store.
* **chunked GLU** (``chunk.chunked_glu``): one Linear whose output is split by ``Chunk(2)`` into
  a GLU's gate and up (Phi-3's ``gate_up_proj``) runs on its weight's two row halves interleaved.
* **bias**: ``add_col_vector(acc, bias)`` after any row scale (``diag(r)·(x W) + b``).
* **GLU with any activation** (``glu``): an interleaved gate/up pair into a ``GLU`` contracts
  with ``pairwise`` (``act(x0) * x1``) instead of ``swiglu``; biased gate/up projections add
  their biases inside that expression (``act(x0 + b_g) * (x1 + b_u)``).
* **row-scale commutation** (``rmsnorm.commute``): a Linear of an RMSNorm output runs on the norm's
  input with ``scale_rows(acc, r)``.
* **LayerNorm in the epilogue** (``layernorm.apply_in_epilogue``): a Linear of a LayerNorm output
  runs on the norm's input with ``r ⊙ (acc − μ ⊗ s) + c``.
"""

from __future__ import annotations

from typing import Any

from coda.blocks.ops import GLU, Linear, SwiGLU

from ..epilogue import Epilogue, emit_gemm
from ..registry import Rule
from ..state import PlanState
from .activation import glu_expr
from .chunk import chunked_glu
from .layernorm import apply_in_epilogue, layer_norm_of
from .rmsnorm import commute
from .rope import (
    lower_qkv,
    lower_rotary,
    lower_separate_qkv,
    qkv_group,
    rotary_chain,
    separate_qkv,
)
from .swiglu import gate_up_pair


class LinearRule(Rule):
    op = Linear

    def lower(self, st: PlanState, index: int, op: Linear) -> bool:
        group = qkv_group(st, index, op)
        parts = separate_qkv(st, index, op) if group is None else None
        chain = rotary_chain(st, index, op) if group is None and parts is None else None
        if group is not None:
            lower_qkv(st, group)
        elif parts is not None:
            lower_separate_qkv(st, parts)
        elif chain is not None:
            lower_rotary(st, chain)
        else:
            lower_linear(st, index, op)
        return True


def contract_pair(ep: Epilogue, gate: Linear, up: Linear, glu: SwiGLU | GLU) -> dict[str, Any]:
    """The epilogue op contracting interleaved ``[gate, up]`` pairs: ``swiglu``, or ``pairwise``
    for another activation or biased projections (each bias a pair-wide column vector)."""
    if gate.bias is None and up.bias is None and isinstance(glu, SwiGLU):
        return {"op": "swiglu"}
    g, u = (f"(x{k} + {ep.col(p.bias)})" if p.bias else f"x{k}" for k, p in enumerate((gate, up)))
    return {"op": "pairwise", "expr0": glu_expr(glu.act if isinstance(glu, GLU) else "silu", g, u)}


def lower_linear(st: PlanState, i: int, op: Linear) -> None:
    """A Linear (or a gate/up pair into a SwiGLU) and everything its epilogue can absorb."""
    pair = gate_up_pair(st, i, op)
    chunked = chunked_glu(st, i, op) if pair is None else None
    ep = Epilogue(st)
    bias = None  # a pair's biases join its pairwise expression
    if pair is not None:
        gate, up, glu, indices = pair
        weights = [gate.weight, up.weight]
        node = {"kind": "interleave_rows", "first": gate.weight, "second": up.weight}
        weight = st.prepare(("interleave", *weights), {**node, "out": f"w_{gate.out}_{up.out}"})
        value, halves = f"{gate.out}{up.out}", (gate.out, up.out)
    elif chunked is not None:  # one weight's two row halves, interleaved (rules/chunk.py)
        glu, indices, weights = chunked.glu, chunked.indices, [op.weight]
        weight, bias, value = chunked.paired_weight(st), chunked.paired_bias(st), op.out
        halves = chunked.halves
    else:
        glu, indices, weights, weight, value = None, [i], [op.weight], op.weight, op.out
        bias = op.bias
    layer_norm = layer_norm_of(st, op)
    if layer_norm is not None:
        normed = value if bias is None else f"{value}_unbiased"
        a, weight, cur = apply_in_epilogue(st, layer_norm, weight, ep, normed)
    else:
        a, scale = commute(st, i, op, weight)
        cur = "acc"
        if scale is not None:
            weight = scale[1]
            cur = value if bias is None else f"{value}_unbiased"
            ep.emit({"op": "scale_rows", "src": "acc", "vector": scale[0], "out": cur})
        ep.products[cur] = (a, weight, scale[0] if scale is not None else None)
    if bias is not None:
        ep.emit({"op": "add_col_vector", "src": cur, "vector": bias, "out": value})
        cur = value
    if glu is not None:
        if set(halves) & set(st.block.outputs):
            # the gate and up projections themselves are wanted (saved for a backward pass)
            node = {"op": "split_pairs", "src": cur, "first": halves[0], "second": halves[1]}
            ep.emit(node)
            for half in halves:
                ep.result(half, half)
        contraction = chunked.contraction() if chunked else contract_pair(ep, gate, up, glu)
        ep.emit({**contraction, "src": cur, "out": glu.out})
        cur, value = glu.out, glu.out
    ep.result(value, cur)
    st.done.update(indices)
    emit_gemm(st, i, ep, a, f"{weight}.T", weights, value)
