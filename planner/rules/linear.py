"""``Linear``: every ``Linear`` becomes (part of) a ``gemm`` step ``acc = x @ Wᵀ`` whose epilogue
absorbs what it can (``epilogue.emit_gemm``).

* **pairwise interleave** (``swiglu.gate_up_pair``): two Linears of the same input whose outputs
  meet in a ``SwiGLU`` become one GEMM over ``interleave_rows(gate, up)`` with ``swiglu`` in its
  epilogue; when the gate and up projections are block outputs themselves (a training forward
  saving them for its backward), ``split_pairs`` stores them too.
* **fused QKV with RoPE** (``rope.qkv_group``): Linears of one input whose results are
  concatenated become one GEMM over the concatenated weights.
* **row-scale commutation** (``rmsnorm.commute``): a Linear of an RMSNorm output runs on the norm's
  input with ``scale_rows(acc, r)``.
* **LayerNorm in the epilogue** (``layernorm.apply_in_epilogue``): a Linear of a LayerNorm output
  runs on the norm's input with ``r ⊙ (acc − μ ⊗ s) + c``.
"""

from __future__ import annotations

from coda.blocks.ops import Linear

from ..epilogue import Epilogue, emit_gemm
from ..registry import Rule
from ..state import PlanState
from .layernorm import apply_in_epilogue, layer_norm_of
from .rmsnorm import commute
from .rope import lower_qkv, qkv_group
from .swiglu import gate_up_pair


class LinearRule(Rule):
    op = Linear

    def lower(self, st: PlanState, index: int, op: Linear) -> bool:
        group = qkv_group(st, index, op)
        if group is not None:
            lower_qkv(st, group)
        else:
            lower_linear(st, index, op)
        return True


def lower_linear(st: PlanState, i: int, op: Linear) -> None:
    """A Linear (or a gate/up pair into a SwiGLU) and everything its epilogue can absorb."""
    pair = gate_up_pair(st, i, op)
    ep = Epilogue(st)
    if pair is not None:
        gate, up, glu, indices = pair
        weights = [gate.weight, up.weight]
        node = {"kind": "interleave_rows", "first": gate.weight, "second": up.weight}
        weight = st.prepare(("interleave", *weights), {**node, "out": f"w_{gate.out}_{up.out}"})
        value = f"{gate.out}{up.out}"
    else:
        glu, indices, weights, weight, value = None, [i], [op.weight], op.weight, op.out
    layer_norm = layer_norm_of(st, op)
    if layer_norm is not None:
        a, weight, cur = apply_in_epilogue(st, layer_norm, weight, ep, value)
    else:
        a, scale = commute(st, i, op, weight)
        cur = "acc"
        if scale is not None:
            weight = scale[1]
            ep.emit({"op": "scale_rows", "src": "acc", "vector": scale[0], "out": value})
            cur = value
        ep.products[cur] = (a, weight, scale[0] if scale is not None else None)
    if glu is not None:
        if {gate.out, up.out} & set(st.block.outputs):
            # the gate and up projections themselves are wanted (saved for a backward pass)
            node = {"op": "split_pairs", "src": cur, "first": gate.out, "second": up.out}
            ep.emit(node)
            for half in (gate.out, up.out):
                ep.result(half, half)
        ep.emit({"op": "swiglu", "src": cur, "out": glu.out})
        cur, value = glu.out, glu.out
    ep.result(value, cur)
    st.done.update(indices)
    emit_gemm(st, i, ep, a, f"{weight}.T", weights, value)
