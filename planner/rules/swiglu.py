"""SwiGLU: ``silu(gate) ⊙ up`` of two projections of one input, forward and backward
(docs/algebra.md §2).

* **pairwise interleave** (``gate_up_pair``, used by the Linear rule): two Linears of the same
  input whose outputs meet in a ``SwiGLU`` become one GEMM over ``interleave_rows(gate, up)``
  with ``swiglu`` in its epilogue. A ``SwiGLU`` no such pair produces has no lowering.
* ``swiglu_pairs`` / ``swiglu_pairs_backward`` (kernel-level ops on interleaved ``[g, u]`` pairs)
  fuse into an epilogue as ``swiglu`` / ``pairwise``.
* **backward** of an MLP ``x + down(silu(gate(h)) · up(h))`` with ``h = rmsnorm(x)·γ`` (or the
  branch alone): SwiGLU's backward in the epilogue of ``dout W_down`` next to the saved or
  recomputed gate/up projections, then the RMSNorm backward in the epilogue of ``dz W_gu``, and the
  weight gradients as plain GEMMs, the interleaved one split into gate and up by strided views —
  or, for one ``[gate; up]`` weight split by ``Chunk`` (Phi-3), un-permuted by aux
  ``unpair_rows`` (``rules/chunk.py``).
"""

from __future__ import annotations

from coda.blocks.ops import (
    GLU,
    Add,
    Chunk,
    Linear,
    RMSNorm,
    SwiGLU,
    SwiGLUPairs,
    SwiGLUPairsBackward,
)

from ..backward import BackwardBuilder
from ..epilogue import Epilogue
from ..registry import Rule, inputs_not_joined
from ..state import PlanState

# d/dx0 and d/dx1 of silu(x0)·x1 times the incoming gradient {da} (``pairwise``'s expressions)
SWIGLU_DG = "{da} * x1 * sigmoid(x0) * (1 + x0 * (1 - sigmoid(x0)))"
SWIGLU_DU = "{da} * silu(x0)"


def gate_up_pair(
    st: PlanState, i: int, op: Linear
) -> tuple[Linear, Linear, SwiGLU | GLU, list[int]] | None:
    """(gate, up, swiglu or glu, their graph indices) when Linear ``op`` (graph op ``i``) is half
    of a SwiGLU (or GLU) whose other half projects the same input and is not lowered yet; biased
    projections pair only when neither is a block output (the stored halves would lack the
    biases)."""
    users = st.consumers(op.out)
    if len(users) != 1 or not isinstance(users[0][1], SwiGLU | GLU):
        return None
    k, glu = users[0]
    other = glu.up if glu.gate == op.out else glu.gate
    found = st.producer(other)
    if (
        found is None
        or not isinstance(found[1], Linear)
        or found[1].x != op.x
        or found[0] in st.done
    ):
        return None
    j, partner = found
    if (op.bias or partner.bias) and {op.out, partner.out} & set(st.block.outputs):
        return None
    gate, up = (op, partner) if glu.gate == op.out else (partner, op)
    return gate, up, glu, [i, j, k]


class SwiGLURule(Rule):
    op = SwiGLU
    backward_of = "an RMSNorm followed by a SwiGLU MLP with residual"

    def unlowered(self, st: PlanState, op: SwiGLU) -> str:
        return inputs_not_joined(st, op)

    def differentiate(self, b: BackwardBuilder) -> None:
        mlp_backward(b)


class SwiGLUPairsRule(Rule):
    op = SwiGLUPairs

    def fuse(self, ep: Epilogue, op: SwiGLUPairs) -> None:
        ep.define(op.out, {"op": "swiglu", "src": ep.tile(op.x)})


class SwiGLUPairsBackwardRule(Rule):
    op = SwiGLUPairsBackward

    def fuse(self, ep: Epilogue, op: SwiGLUPairsBackward) -> None:
        da = ep.tile(op.da)
        node = {
            "op": "pairwise",
            "src": ep.tile(op.z),
            "expr0": SWIGLU_DG.format(da=da),
            "expr1": SWIGLU_DU.format(da=da),
        }
        ep.define(op.out, node)


# -- backward of x + down(silu(gate(h)) · up(h)), or the branch alone -----------------------------
def mlp_backward(b: BackwardBuilder) -> None:
    fwd = b.forward
    _, glu = b.find(SwiGLU)
    chunked = _chunked_projection(b, glu)
    if chunked is None:
        _, gate = b.find(Linear, out=glu.gate)
        _, up = b.find(Linear, out=glu.up)
    _, down = b.find(Linear, x=glu.out)
    if chunked is None and gate.x != up.x:
        b.fail("gate and up project different inputs")
    norm = b.norm(gate.x if chunked is None else chunked.x)
    add = next((o for o in fwd.graph if isinstance(o, Add) and down.out in o.inputs()), None)
    if add is not None:  # x + mlp(x): the residual's gradient joins the norm's in dx
        if norm.x not in add.inputs() or add.out not in fwd.outputs:
            b.fail("the MLP's output must be added to the norm's input (the residual)")
        dout = b.cotangent(add.out)
    elif down.out in fwd.outputs:  # the branch alone (llama_mlp_branch): dx is the norm's
        dout = b.cotangent(down.out)
    else:
        b.fail("the MLP's output must be a block output, or added to the norm's input")
    if chunked is None:
        interleave = {"kind": "interleave_rows", "first": gate.weight, "second": up.weight}
        w_gu = b.prep(("interleave", gate.weight, up.weight), {**interleave, "out": "w_gu"})
    else:  # [gate; up] rows interleaved, as the forward's GEMM reads them (rules/chunk.py)
        rows = str(fwd.inputs[chunked.weight].shape[0])
        paired = {"kind": "rope_pairs", "weight": chunked.weight, "head_dim": rows}
        w_gu = b.prep(("halves_paired", chunked.weight), {**paired, "out": "w_gu"})
    if {glu.gate, glu.up} <= set(b.op.saved):
        r = b.rstd(norm)
        a_saved = glu.out if glu.out in b.op.saved else None
        dz, a, partials = _backward_saved(b, dout, down.weight, glu.gate, glu.up, a_saved)
    else:
        r, dz, a, partials = _backward_recomputed(b, norm, w_gu, dout, down.weight)
    c = b.statistic(partials, norm)
    b.output(down.weight, b.plain_gemm("w_down_grad", f"{dout}.T", a, "dw_down"))
    residual = dout if add is not None else None
    y = b.norm_backward("gate_up_bwd", dz, w_gu, norm, r, c, residual=residual)
    dw_gu = b.plain_gemm("w_gate_up_grad", f"{dz}.T", y, "dw_gu")
    if chunked is not None:  # back to [gate; up] rows: the inverse of the forward's permutation
        unpair = {"kind": "unpair_rows", "src": dw_gu, "head_dim": rows, "out": "dw_gate_up"}
        b.output(chunked.weight, b.aux(unpair))
        return
    # the interleaved gradient's even rows are the gate's, odd rows the up projection's
    b.output(gate.weight, {"tensor": dw_gu, "dim": 0, "step": 2})
    b.output(up.weight, {"tensor": dw_gu, "dim": 0, "start": "1", "step": 2})


def _chunked_projection(b: BackwardBuilder, glu: SwiGLU) -> Linear | None:
    """The Linear whose output ``chunk(2)`` splits into the SwiGLU's gate (part 0) and up (part
    1) — Phi-3's ``gate_up_proj`` — or None when gate and up are not chunks of one value."""
    found = [o for o in b.forward.graph if isinstance(o, Chunk) and o.out in (glu.gate, glu.up)]
    if not found:
        return None
    parts = {o.out: o for o in found}
    gate, up = parts.get(glu.gate), parts.get(glu.up)
    if gate is None or up is None or gate.x != up.x or gate.chunks != 2 or up.chunks != 2:
        b.fail("gate and up must both be halves (chunk(2)) of one projection, or two Linears")
    if (gate.index, up.index) != (0, 1):
        b.fail("the gate must be part 0 of chunk(2) and up part 1 (Phi-3's gate_up_proj order)")
    _, linear = b.find(Linear, out=gate.x)
    if linear.bias is not None:
        b.fail(f"the gate/up projection {linear.out!r} has a bias; the backward takes none")
    return linear


def _backward_saved(
    b: BackwardBuilder, dout: str, w_down: str, g: str, u: str, a_saved: str | None = None
) -> tuple[str, str, str]:
    """da = dout W_down with SwiGLU's backward next to the saved g and u (N wide each):
    dz = [dg, du] interleaved, partial Σ (g·dg + u·du), and a = silu(g)·u recomputed for the
    down projection's weight gradient — unless the forward saved it too (``a_saved``)."""
    dz, partials = b.name("dz"), b.name("zdz_partials")
    a = a_saved or b.name("a")
    recompute_a = [
        {"op": "map", "expr": "silu(g_tile) * u_tile", "out": a},
        {"op": "store", "src": a, "to": a},
    ]
    b.gemm(
        "down_bwd",
        dout,
        w_down,
        [
            {"op": "load_tile", "tensor": g, "out": "g_tile"},
            {"op": "load_tile", "tensor": u, "out": "u_tile"},
            # d/dg silu(g)·u = u·σ(g)·(1 + g(1 − σ(g))), d/du = silu(g) (docs/algebra.md §2)
            {
                "op": "map",
                "expr": "acc * u_tile * sigmoid(g_tile) * (1 + g_tile * (1 - sigmoid(g_tile)))",
                "out": "dg",
            },
            {"op": "map", "expr": "acc * silu(g_tile)", "out": "du"},
            {"op": "join_pairs", "first": "dg", "second": "du", "out": dz},
            {"op": "map", "expr": "g_tile * dg + u_tile * du", "out": "zdz_terms"},
            {"op": "partial_reduce", "src": "zdz_terms", "kind": "sum", "to": partials},
            {"op": "store", "src": dz, "to": dz},
            *([] if a_saved else recompute_a),
        ],
    )
    return dz, a, partials


def _backward_recomputed(
    b: BackwardBuilder, norm: RMSNorm, w_gu: str, dout: str, w_down: str
) -> tuple[str, str, str, str]:
    """z = r ⊙ (x W_guᵀ) recomputed and stored, then SwiGLU's backward next to it."""
    r, folded = b.forward_projection(norm, w_gu)
    # z = r ⊙ (x W_guᵀ): the saved pre-activation [g0, u0, g1, u1, ...], recomputed
    z = b.name("z")
    b.gemm(
        "gate_up",
        norm.x,
        f"{folded}.T",
        [
            {"op": "scale_rows", "src": "acc", "vector": r, "out": "z_acc"},
            {"op": "store", "src": "z_acc", "to": z},
        ],
    )
    # da = dout W_down; SwiGLU backward next to the loaded z (2N wide): dz, a, Σ z·dz
    dz, a = b.name("dz"), b.name("a")
    stats, partials = b.zdz_partials("z_tile", dz)
    b.gemm(
        "down_bwd",
        dout,
        w_down,
        [
            {"op": "load_tile", "tensor": z, "out": "z_tile"},
            {
                "op": "pairwise",
                "src": "z_tile",
                "expr0": SWIGLU_DG.format(da="acc"),
                "expr1": SWIGLU_DU.format(da="acc"),
                "out": dz,
            },
            {"op": "swiglu", "src": "z_tile", "out": a},
            *stats,
            {"op": "store", "src": dz, "to": dz},
            {"op": "store", "src": a, "to": a},
        ],
    )
    return r, dz, a, partials
