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
  weight gradients as plain GEMMs, the interleaved one split into gate and up by strided views.
  A GLU of another activation (GeGLU: Gemma) takes the same schedule with its derivative; biased
  projections get their bias gradients as column sums of their incoming gradient (``dz`` in the
  ``dout W_down`` epilogue, ``dout`` in the ``dz W_gu`` one). A post-norm between the down
  projection and the residual add (Gemma 2's sandwich) is differentiated first
  (``BackwardBuilder.post_norm_backward``): its ``dm`` then takes ``dout``'s place — or, for one
  ``[gate; up]`` weight split by ``Chunk`` (Phi-3), un-permuted by aux ``unpair_rows``
  (``rules/chunk.py``). Without a pre-norm (OLMo 2's MLP projects the residual stream itself)
  there is no ``r``, no ``Σ z·dz``: ``dx = dz W_gu`` is a plain GEMM (plus ``dout`` with a
  residual) and ``dW_gu = dzᵀ x``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
from .activation import activation_expr, activation_grad_expr, glu_expr

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
    differentiates_biases = True  # biased gate/up/down projections

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
def gated_unit(b: BackwardBuilder) -> tuple[SwiGLU | GLU, str]:
    """The forward's SwiGLU or GLU and its activation (``silu`` for a SwiGLU)."""
    for op in b.forward.graph:
        if isinstance(op, SwiGLU | GLU):
            return op, op.act if isinstance(op, GLU) else "silu"
    b.fail("expected a SwiGLU or GLU")


def glu_grads(act: str, gate: str, up: str, da: str) -> tuple[str, str]:
    """(d/dgate, d/dup) of ``act(gate) · up`` times the incoming gradient ``da``, as
    expressions (SwiGLU's are ``SWIGLU_DG``/``SWIGLU_DU``)."""
    if act == "silu":
        dg = SWIGLU_DG.replace("x1", up).replace("x0", gate)
        return dg.format(da=da), SWIGLU_DU.replace("x0", gate).format(da=da)
    return (
        f"{da} * {up} * ({activation_grad_expr(act, gate)})",
        f"{da} * {activation_expr(act, gate)}",
    )


def mlp_backward(b: BackwardBuilder) -> None:
    glu, act = gated_unit(b)
    chunked = _chunked_projection(b, glu)
    if chunked is None:
        _, gate = b.find(Linear, out=glu.gate)
        _, up = b.find(Linear, out=glu.up)
    _, down = b.find(Linear, x=glu.out)
    if chunked is None and gate.x != up.x:
        b.fail("gate and up project different inputs")
    h = gate.x if chunked is None else chunked.x
    norm = b.norm(h) if h not in b.forward.inputs else None  # None: no pre-norm (OLMo 2)
    x = norm.x if norm is not None else h  # the MLP half's input (its residual)
    post, residual, dout = _mlp_output(b, down, x)
    if chunked is None:
        interleave = {"kind": "interleave_rows", "first": gate.weight, "second": up.weight}
        w_gu = b.prep(("interleave", gate.weight, up.weight), {**interleave, "out": "w_gu"})
        biases = (gate.bias, up.bias)
    else:  # [gate; up] rows interleaved, as the forward's GEMM reads them (rules/chunk.py)
        rows = str(b.forward.inputs[chunked.weight].shape[0])
        paired = {"kind": "rope_pairs", "weight": chunked.weight, "head_dim": rows}
        w_gu = b.prep(("halves_paired", chunked.weight), {**paired, "out": "w_gu"})
        biases = (None, None)

    def down_grad(a: str) -> str:
        """The gradient reaching the down projection: dout, or dm through the post-norm."""
        return b.post_norm_backward(post, a, down.weight, dout) if post else dout

    if {glu.gate, glu.up} <= set(b.op.saved):
        r = b.rstd(norm) if norm is not None else None
        a_saved = glu.out if glu.out in b.op.saved else None
        if post is not None and a_saved is None:
            b.fail("a post-norm's backward from saved projections needs a = act(g)·u saved too")
        d_down = down_grad(a_saved) if a_saved else dout
        dz, a, partials = _backward_saved(
            b, d_down, down.weight, glu.gate, glu.up, a_saved, act, biases, stats=norm is not None
        )
    else:
        r, dz, a, partials, d_down = _backward_recomputed(
            b, norm, w_gu, down_grad if post else dout, down.weight, act, biases, x=x
        )
    c = b.statistic(partials, norm) if norm is not None else None  # type: ignore[arg-type]
    b.output(down.weight, b.plain_gemm("w_down_grad", f"{d_down}.T", a, "dw_down"))
    extra: list[dict[str, Any]] = []
    if down.bias is not None:  # d b_down = Σ_rows dout, from dout's tiles in the dx epilogue
        colsum, down_partials = b.column_sums("dout_tile", "db_down")
        extra = [{"op": "load_tile", "tensor": d_down, "out": "dout_tile"}, colsum]
    if norm is not None:
        y = b.norm_backward("gate_up_bwd", dz, w_gu, norm, r, c, residual=residual, extra=extra)
    else:
        y = _input_grad(b, dz, w_gu, x, residual, extra)
    if down.bias is not None:
        b.output(down.bias, b.summed_columns(down_partials, "db_down"))
    dw_gu = b.plain_gemm("w_gate_up_grad", f"{dz}.T", y, "dw_gu")
    if chunked is not None:  # back to [gate; up] rows: the inverse of the forward's permutation
        unpair = {"kind": "unpair_rows", "src": dw_gu, "head_dim": rows, "out": "dw_gate_up"}
        b.output(chunked.weight, b.aux(unpair))
        return
    # the interleaved gradient's even rows are the gate's, odd rows the up projection's
    b.output(gate.weight, {"tensor": dw_gu, "dim": 0, "step": 2})
    b.output(up.weight, {"tensor": dw_gu, "dim": 0, "start": "1", "step": 2})


def _input_grad(
    b: BackwardBuilder,
    dz: str,
    w_gu: str,
    x: str,
    residual: str | None,
    extra: list[dict[str, Any]],
) -> str:
    """``dx = dz W_gu`` (``+ dout``, the residual's gradient, in the epilogue) for an MLP without
    a pre-norm, ``extra`` ops on the same tiles; returns ``x``, the weight gradient's operand."""
    dx = b.name("dx")
    add = [{"op": "add_tile", "src": "acc", "tensor": residual, "out": "dx_tile"}]
    value = "dx_tile" if residual else "acc"
    epilogue = [*(add if residual else []), {"op": "store", "src": value, "to": dx}, *extra]
    b.gemm("gate_up_bwd", dz, w_gu, epilogue)
    b.output(x, dx)
    return x


def _mlp_output(b: BackwardBuilder, down: Linear, x: str) -> tuple[RMSNorm | None, str | None, str]:
    """(the post-norm between the down projection and the residual add — Gemma 2's sandwich —
    or None; the residual's gradient joining dx, None for the branch alone; the gradient of the
    sub-layer's output). ``x``: the MLP's input before its pre-norm, the residual."""
    fwd = b.forward
    post = next((o for o in fwd.graph if isinstance(o, RMSNorm) and o.x == down.out), None)
    if post is not None and (down.bias is not None or down.out in fwd.outputs):
        b.fail("a post-norm's input must be the down projection alone, without a bias")
    branch = post.out if post is not None else down.out
    add = next((o for o in fwd.graph if isinstance(o, Add) and branch in o.inputs()), None)
    if add is not None:  # x + mlp(x): the residual's gradient joins the norm's in dx
        if x not in add.inputs() or add.out not in fwd.outputs:
            b.fail("the MLP's output must be added to the norm's input (the residual)")
        dout = b.cotangent(add.out)
        return post, dout, dout
    if branch in fwd.outputs:  # the branch alone (llama_mlp_branch): dx is the norm's
        return post, None, b.cotangent(branch)
    b.fail("the MLP's output must be a block output, or added to the norm's input")


def _chunked_projection(b: BackwardBuilder, glu: SwiGLU | GLU) -> Linear | None:
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
    b: BackwardBuilder,
    dout: str,
    w_down: str,
    g: str,
    u: str,
    a_saved: str | None = None,
    act: str = "silu",
    biases: tuple[str | None, str | None] = (None, None),
    *,
    stats: bool = True,
) -> tuple[str, str, str | None]:
    """da = dout W_down with SwiGLU's (or the GLU's) backward next to the saved g and u (N wide
    each): dz = [dg, du] interleaved, partial Σ (g·dg + u·du), and a = act(g)·u recomputed for the
    down projection's weight gradient — unless the forward saved it too (``a_saved``); the gate's
    and up projection's bias gradients (``biases``) are column sums of dg and du. ``stats=False``
    (no pre-norm to differentiate): no ``Σ z·dz`` partials (None)."""
    bias_sums = [
        (bias, *b.column_sums(d, f"d{bias}"))
        for bias, d in zip(biases, ("dg", "du"), strict=True)
        if bias is not None
    ]
    dz, partials = b.name("dz"), b.name("zdz_partials")
    a = a_saved or b.name("a")
    a_expr = "silu(g_tile) * u_tile" if act == "silu" else glu_expr(act, "g_tile", "u_tile")
    recompute_a = [
        {"op": "map", "expr": a_expr, "out": a},
        {"op": "store", "src": a, "to": a},
    ]
    dg, du = glu_grads(act, "g_tile", "u_tile", "acc")
    # c = Σ z·dz over the projection without its bias: g and u as saved include the biases
    g_proj, u_proj = (
        f"({t} - {col})" if col else t
        for t, col in zip(("g_tile", "u_tile"), _bias_cols(biases), strict=True)
    )
    b.gemm(
        "down_bwd",
        dout,
        w_down,
        [
            {"op": "load_tile", "tensor": g, "out": "g_tile"},
            {"op": "load_tile", "tensor": u, "out": "u_tile"},
            *_load_bias_cols(biases),
            # d/dg silu(g)·u = u·σ(g)·(1 + g(1 − σ(g))), d/du = silu(g) (docs/algebra.md §2);
            # act'(g)·u and act(g) for another activation
            {"op": "map", "expr": dg, "out": "dg"},
            {"op": "map", "expr": du, "out": "du"},
            {"op": "join_pairs", "first": "dg", "second": "du", "out": dz},
            *(
                [
                    {"op": "map", "expr": f"{g_proj} * dg + {u_proj} * du", "out": "zdz_terms"},
                    {"op": "partial_reduce", "src": "zdz_terms", "kind": "sum", "to": partials},
                ]
                if stats
                else []
            ),
            *(colsum for _, colsum, _ in bias_sums),
            {"op": "store", "src": dz, "to": dz},
            *([] if a_saved else recompute_a),
        ],
    )
    for bias, _, bias_partials in bias_sums:
        b.output(bias, b.summed_columns(bias_partials, f"d{bias}"))
    return dz, a, partials if stats else None


def _backward_recomputed(
    b: BackwardBuilder,
    norm: RMSNorm | None,
    w_gu: str,
    dout: str | Callable[[str], str],
    w_down: str,
    act: str = "silu",
    biases: tuple[str | None, str | None] = (None, None),
    *,
    x: str,
) -> tuple[str | None, str, str, str | None, str]:
    """z = r ⊙ (x W_guᵀ) [+ the interleaved biases] recomputed and stored (rounded once, as
    ``nn.Linear`` rounds), then SwiGLU's (or the GLU's) backward next to it; ``Σ z·dz`` is taken
    over the projection without its biases, and the biases' gradients are the column sums of dz's
    gate and up halves. ``dout`` may be a function of ``a`` (a post-norm's backward, which needs
    the down projection recomputed first): then the gate/up GEMM also stores ``a``. Without a
    pre-norm (``norm`` None) ``z = x W_guᵀ`` of the MLP's input ``x``, and neither ``r`` nor the
    partials (None). Returns (r, dz, a, the Σ z·dz partials, the gradient the down projection
    received)."""
    r, folded = b.forward_projection(norm, w_gu) if norm is not None else (None, w_gu)
    # z = r ⊙ (x W_guᵀ): the saved pre-activation [g0, u0, g1, u1, ...], recomputed
    z, a = b.name("z"), b.name("a")
    z_acc = "z_biased" if any(biases) else "z_acc"
    a_first = [] if isinstance(dout, str) else [_contract(act, z_acc, a), _store(a)]
    scale = {"op": "scale_rows", "src": "acc", "vector": r, "out": "z_acc"}
    b.gemm(
        "gate_up",
        x,
        f"{folded}.T",
        [
            scale if r is not None else {"op": "map", "expr": "acc", "out": "z_acc"},
            *_add_pair_biases("z_acc", biases, "z_biased"),
            {"op": "store", "src": z_acc, "to": z},
            *a_first,
        ],
    )
    if not isinstance(dout, str):
        dout = dout(a)
    # da = dout W_down; SwiGLU backward next to the loaded z (2N wide): dz, a, Σ z·dz
    dz = b.name("dz")
    dg, du = glu_grads(act, "x0", "x1", "acc")
    if norm is None:  # no pre-norm: no Σ z·dz to take
        stats, partials = [], None
    elif any(biases):  # Σ (z − b)·dz: each pair's term from its members less their biases
        gate, up = (f"(x{k} - {c})" if c else f"x{k}" for k, c in enumerate(_bias_cols(biases)))
        terms = f"{gate} * ({dg}) + {up} * ({du})"
        stats = [{"op": "pairwise", "src": "z_tile", "expr0": terms, "out": "zdz_terms"}]
        partials = b.name("zdz_partials")
        stats.append({"op": "partial_reduce", "src": "zdz_terms", "kind": "sum", "to": partials})
    else:
        stats, partials = b.zdz_partials("z_tile", dz)
    bias_ops, bias_sums = _pair_column_sums(b, dz, biases)
    b.gemm(
        "down_bwd",
        dout,
        w_down,
        [
            {"op": "load_tile", "tensor": z, "out": "z_tile"},
            *_load_bias_cols(biases),
            {"op": "pairwise", "src": "z_tile", "expr0": dg, "expr1": du, "out": dz},
            *([] if a_first else [_contract(act, "z_tile", a)]),
            *stats,
            *bias_ops,
            {"op": "store", "src": dz, "to": dz},
            *([] if a_first else [_store(a)]),
        ],
    )
    for bias, bias_partials in bias_sums:
        b.output(bias, b.summed_columns(bias_partials, f"d{bias}"))
    return r, dz, a, partials, dout


def _contract(act: str, z: str, out: str) -> dict[str, Any]:
    """The epilogue op ``out = act(g) · u`` of interleaved pairs ``z``."""
    if act == "silu":
        return {"op": "swiglu", "src": z, "out": out}
    return {"op": "pairwise", "src": z, "expr0": glu_expr(act, "x0", "x1"), "out": out}


def _store(value: str) -> dict[str, Any]:
    return {"op": "store", "src": value, "to": value}


def _pair_column_sums(
    b: BackwardBuilder, dz: str, biases: tuple[str | None, str | None]
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Epilogue ops writing partial column sums of the gate's and up projection's halves of the
    interleaved ``dz`` (their bias gradients), and (bias, partials buffer) for each bias."""
    if not any(biases):
        return [], []
    ops: list[dict[str, Any]] = [
        {"op": "split_pairs", "src": dz, "first": "dz_gate", "second": "dz_up"}
    ]
    sums = []
    for bias, half in zip(biases, ("dz_gate", "dz_up"), strict=True):
        if bias is not None:
            colsum, partials = b.column_sums(half, f"d{bias}")
            ops.append(colsum)
            sums.append((bias, partials))
    return ops, sums


# the epilogue names of the gate's and up projection's bias vectors (no "x0"/"x1" inside: the
# SwiGLU templates substitute those)
_BIAS_COLS = ("bias_gate_col", "bias_up_col")


def _bias_cols(biases: tuple[str | None, str | None]) -> tuple[str | None, str | None]:
    """The epilogue value of each bias (None where the projection has none)."""
    g, u = (col if bias else None for bias, col in zip(biases, _BIAS_COLS, strict=True))
    return g, u


def _load_bias_cols(biases: tuple[str | None, str | None]) -> list[dict[str, Any]]:
    """``load_col_vector`` of each bias (N wide: one entry per pair)."""
    return [
        {"op": "load_col_vector", "vector": bias, "out": col}
        for bias, col in zip(biases, _BIAS_COLS, strict=True)
        if bias
    ]


def _add_pair_biases(
    src: str, biases: tuple[str | None, str | None], out: str
) -> list[dict[str, Any]]:
    """Epilogue ops adding the gate's and up projection's biases (pair-wide column vectors) to
    the interleaved pairs of ``src``; none without biases."""
    if not any(biases):
        return []
    terms = [f"x{k} + {c}" if c else f"x{k}" for k, c in enumerate(_bias_cols(biases))]
    return [
        *_load_bias_cols(biases),
        {"op": "pairwise", "src": src, "expr0": terms[0], "expr1": terms[1], "out": out},
    ]
