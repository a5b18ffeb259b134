"""Backward of a LayerNorm MLP that is not gated: GPT-2's ``out = x + W2·act(W1·LN(x) + b1) + b2``
(LayerNorm with or without β, biased or bias-free Linears, any ``Activation``), or the branch
alone. ``LayerNormRule.differentiate`` (``rules/layernorm.py``) writes this schedule:

1. ``z = r ⊙ (x W1'ᵀ − μ ⊗ s) + W1 β + b1`` recomputed as the forward computes it (γ folded into
   ``W1'``, ``s`` its row sums, ``μ``/``r`` from aux ``mean_rstd``) and stored — or read when the
   forward saved it (so is ``a``, when saved);
2. ``da = dout W2`` with the activation's backward in its epilogue next to the loaded ``z``:
   ``dz = da ⊙ act'(z)``, ``a = act(z)`` (for ``dW2``), partial column sums of ``dz`` (``db1``) and
   partial row sums of LayerNorm's statistics — ``Σ_d dh·γ = Σ_f dz·s`` and
   ``Σ_d dh·γ·x̂ = Σ_f dz·(z − b1 − W1 β)`` (``dh = dz W1`` is not formed yet; both identities
   follow from ``z − b1 − W1β = (x̂ ⊙ γ) W1ᵀ``);
3. ``dh = dz W1`` with LayerNorm's backward in its epilogue:
   ``dx = dout + r ⊙ (dh ⊙ γ − mean(dh·γ) − x̂ · mean(dh·γ·x̂))``, ``h = x̂ ⊙ γ + β`` stored for
   ``dW1``, partial column sums of ``dh·x̂`` (``dγ``), ``dh`` (``dβ``) and ``dout`` (``db2``);
4. ``dW2 = doutᵀ a`` and ``dW1 = dzᵀ h`` as plain GEMMs.

The residual's and the output's shape is the SwiGLU MLP's (``rules/swiglu.py`` ``_mlp_output``);
a post-norm between ``W2`` and the residual add is refused.
"""

from __future__ import annotations

from typing import Any

from coda.blocks.ops import Activation, LayerNorm, Linear

from ..backward import BackwardBuilder
from ..shapes import size_expr_of
from ..state import short_name
from .activation import activation_expr, activation_grad_expr
from .swiglu import _mlp_output


def layer_norm_mlp_backward(b: BackwardBuilder) -> None:
    """The schedule of the module docstring for ``b.forward``; ``b.fail`` names what is off."""
    norm, fc, act, proj = _mlp_ops(b)
    post, residual, dout = _mlp_output(b, proj, norm.x)
    if post is not None:
        b.fail(f"a post-norm ({post.out!r}) after a LayerNorm MLP has no backward rule")
    other = sorted(o for o, c in b.op.cotangents.items() if c != dout)
    if other:
        b.fail(f"only the MLP's output may have a gradient; drop the cotangents of {other}")
    stats = _statistics(b, norm, fc)
    # what the forward saved (the backward block's inputs) is read, not recomputed
    z = fc.out if fc.out in b.op.saved else _recompute_fc(b, norm, fc, stats)
    dz, a, (c_gamma, c_xhat) = _activation_backward(b, norm, fc, act, proj, dout, z, stats)
    b.output(proj.weight, b.plain_gemm("w_proj_grad", f"{dout}.T", a, "dw_proj"))
    stats |= {"c_gamma": c_gamma, "c_xhat": c_xhat}
    h = _norm_backward(b, norm, fc, proj, dz, dout, residual, stats)
    b.output(fc.weight, b.plain_gemm("w_fc_grad", f"{dz}.T", h, "dw_fc"))


def _mlp_ops(b: BackwardBuilder) -> tuple[LayerNorm, Linear, Activation, Linear]:
    """(LayerNorm, first Linear, activation, second Linear) of ``W2·act(W1·LN(x))``."""
    fwd = b.forward
    _, norm = b.find(LayerNorm)
    if norm.x not in fwd.inputs or norm.weight not in fwd.inputs:
        b.fail("the LayerNorm's input and weight must be block inputs")
    if norm.bias is not None and norm.bias not in fwd.inputs:
        b.fail(f"the LayerNorm's bias {norm.bias!r} must be a block input")
    fc = _only_reader(b, norm.out, Linear)
    act = _only_reader(b, fc.out, Activation)
    proj = _only_reader(b, act.out, Linear)
    return norm, fc, act, proj


def _only_reader(b: BackwardBuilder, value: str, kind: type) -> Any:
    """The one op reading ``value``, which must be a ``kind`` and ``value`` no block output."""
    readers = [o for o in b.forward.graph if value in o.inputs()]
    if len(readers) != 1 or not isinstance(readers[0], kind) or value in b.forward.outputs:
        found = [f"{type(o).__name__}({o.out!r})" for o in readers]
        b.fail(
            f"expected LayerNorm → Linear → Activation → Linear, each value read once: {value!r} "
            f"must be read by one {kind.__name__} only and be no block output, but is read by "
            f"{found or 'nothing'} (a gated MLP after a LayerNorm has no backward rule)"
        )
    return readers[0]


def _statistics(b: BackwardBuilder, norm: LayerNorm, fc: Linear) -> dict[str, str]:
    """μ and r (aux ``mean_rstd``), ``W1' = W1·diag(γ)``, its row sums ``s`` and ``W1 β`` (prep,
    shared with a forward in the same Program), by role."""
    mean, rstd = b.name(f"mean_{norm.out}"), b.name(f"rstd_{norm.out}")
    b.st.steps.append(
        {"kind": "mean_rstd", "src": norm.x, "eps": norm.eps, "mean": mean, "out": rstd}
    )
    fold = {"kind": "fold_norm_weight", "weight": fc.weight, "gamma": norm.weight}
    folded = b.prep(("fold", fc.weight, norm.weight), {**fold, "out": f"{fc.weight}_folded"})
    rowsum = {"kind": "matvec", "weight": folded, "out": f"{folded}_rowsum"}
    stats = {"mean": mean, "rstd": rstd, "folded": folded, "s": b.prep(("rowsum", folded), rowsum)}
    if norm.bias is not None:
        node = {"kind": "matvec", "weight": fc.weight, "vector": norm.bias}
        key = ("matvec", fc.weight, norm.bias)
        out = f"{fc.weight}_{short_name(norm.bias)}"
        stats["w_beta"] = b.prep(key, {**node, "out": out})
    return stats


def _biases(fc: Linear, stats: dict[str, str]) -> list[tuple[str, str]]:
    """(column vector, epilogue name) of what ``z`` adds to ``r ⊙ (x W1'ᵀ − μ ⊗ s)``: ``W1 β``
    and ``b1`` where present."""
    found = [(stats.get("w_beta"), "w_beta_col"), (fc.bias, "b_fc_col")]
    return [(vector, col) for vector, col in found if vector is not None]


def _load_cols(cols: list[tuple[str, str]]) -> list[dict[str, Any]]:
    return [{"op": "load_col_vector", "vector": v, "out": col} for v, col in cols]


def _recompute_fc(b: BackwardBuilder, norm: LayerNorm, fc: Linear, stats: dict[str, str]) -> str:
    """``z = LN(x) W1ᵀ + b1`` as the forward's epilogue forms it, stored (rounded once)."""
    z = b.name("z")
    biases = _biases(fc, stats)
    added = "".join(f" + {col}" for _, col in biases)
    b.gemm(
        "fc",
        norm.x,
        f"{stats['folded']}.T",
        [
            {"op": "load_row_vector", "vector": stats["mean"], "out": "mu_row"},
            {"op": "load_col_vector", "vector": stats["s"], "out": "s_col"},
            {"op": "map", "expr": "acc - mu_row * s_col", "out": "centered"},
            {"op": "scale_rows", "src": "centered", "vector": stats["rstd"], "out": "z_normed"},
            *_load_cols(biases),
            {"op": "map", "expr": f"z_normed{added}", "out": z},
            {"op": "store", "src": z, "to": z},
        ],
    )
    return z


def _activation_backward(
    b: BackwardBuilder,
    norm: LayerNorm,
    fc: Linear,
    act: Activation,
    proj: Linear,
    dout: str,
    z: str,
    stats: dict[str, str],
) -> tuple[str, str, tuple[str, str]]:
    """``da = dout W2`` with ``dz = da ⊙ act'(z)`` and ``a = act(z)`` stored (unless saved),
    ``db1`` from dz's column sums, and LayerNorm's two row statistics (``mean(dh·γ)``,
    ``mean(dh·γ·x̂)`` over the norm's width) from partial row sums. Returns (dz, a, (the two
    statistics))."""
    dz = b.name("dz")
    a_saved = act.out in b.op.saved
    a = act.out if a_saved else b.name("a")
    recompute_a = [
        {"op": "map", "expr": activation_expr(act.kind, "z_tile", act.cap), "out": a},
        {"op": "store", "src": a, "to": a},
    ]
    biases = _biases(fc, stats)
    z_normed = "z_tile" + "".join(f" - {col}" for _, col in biases)  # (x̂ ⊙ γ) W1ᵀ
    gamma_partials, xhat_partials = b.name("dh_gamma_partials"), b.name("dh_xhat_partials")
    bias_sum: list[dict[str, Any]] = []
    if fc.bias is not None:
        colsum, db_partials = b.column_sums(dz, f"d{fc.bias}")
        bias_sum = [colsum]
    b.gemm(
        "proj_bwd",
        dout,
        proj.weight,
        [
            {"op": "load_tile", "tensor": z, "out": "z_tile"},
            {"op": "map", "expr": _grad(act, "z_tile", "acc"), "out": dz},
            {"op": "store", "src": dz, "to": dz},
            *([] if a_saved else recompute_a),
            {"op": "load_col_vector", "vector": stats["s"], "out": "s_col"},
            *_load_cols(biases),
            # Σ_d dh·γ = Σ_f dz·s and Σ_d dh·γ·x̂ = Σ_f dz·(x̂ ⊙ γ) W1ᵀ, partial per N-tile
            {"op": "map", "expr": f"{dz} * s_col", "out": "dh_gamma_terms"},
            {"op": "partial_reduce", "src": "dh_gamma_terms", "kind": "sum", "to": gamma_partials},
            {"op": "map", "expr": f"{dz} * ({z_normed})", "out": "dh_xhat_terms"},
            {"op": "partial_reduce", "src": "dh_xhat_terms", "kind": "sum", "to": xhat_partials},
            *bias_sum,
        ],
    )
    if fc.bias is not None:
        b.output(fc.bias, b.summed_columns(db_partials, f"d{fc.bias}"))
    width = size_expr_of(b.st, norm.x, 1)
    means = tuple(
        b.aux({"kind": "sum_partials", "src": p, "divide_by": width, "out": out})
        for p, out in ((gamma_partials, "c_gamma"), (xhat_partials, "c_xhat"))
    )
    return dz, a, means


def _grad(act: Activation, z: str, da: str) -> str:
    """``da ⊙ act'(z)`` as a ``map`` expression."""
    return f"{da} * ({activation_grad_expr(act.kind, z, act.cap)})"


def _norm_backward(
    b: BackwardBuilder,
    norm: LayerNorm,
    fc: Linear,
    proj: Linear,
    dz: str,
    dout: str,
    residual: str | None,
    stats: dict[str, str],
) -> str:
    """``dh = dz W1`` with LayerNorm's backward in its epilogue (dx, dγ, dβ) and ``db2`` from
    dout's tiles; returns the stored ``h = x̂ ⊙ γ + β`` for ``dW1``."""
    dx, h = b.name("dx"), b.name("h")
    beta = [("beta_col", norm.bias)] if norm.bias is not None else []
    sums = [("acc * xhat", norm.weight), *(("acc", bias) for _, bias in beta)]
    if proj.bias is not None:
        sums.append(("dout_tile", proj.bias))
    partials = []
    colsum_ops: list[dict[str, Any]] = []
    for k, (expr, wrt) in enumerate(sums):
        colsum, p = b.column_sums(f"colsum_{k}", f"d{wrt}")
        colsum_ops += [{"op": "map", "expr": expr, "out": f"colsum_{k}"}, colsum]
        partials.append((wrt, p))
    dx_norm = "dx_norm" if residual else dx
    # the residual branch's gradient joins here: dx = dout + the norm's part
    join = {"op": "add_tile", "src": dx_norm, "tensor": residual, "out": dx}
    join_residual = [join] if residual else []
    b.gemm(
        "fc_bwd",
        dz,
        fc.weight,
        [
            {"op": "load_tile", "tensor": norm.x, "out": "x_tile"},
            {"op": "load_row_vector", "vector": stats["mean"], "out": "mu_row"},
            {"op": "load_row_vector", "vector": stats["rstd"], "out": "r_row"},
            {"op": "load_row_vector", "vector": stats["c_gamma"], "out": "c_gamma_row"},
            {"op": "load_row_vector", "vector": stats["c_xhat"], "out": "c_xhat_row"},
            {"op": "load_col_vector", "vector": norm.weight, "out": "gamma_col"},
            *({"op": "load_col_vector", "vector": v, "out": col} for col, v in beta),
            {"op": "map", "expr": "(x_tile - mu_row) * r_row", "out": "xhat"},
            # dx = r ⊙ (dh ⊙ γ − mean(dh·γ) − x̂ · mean(dh·γ·x̂)); acc = dh
            {
                "op": "map",
                "expr": "r_row * (acc * gamma_col - c_gamma_row - xhat * c_xhat_row)",
                "out": dx_norm,
            },
            *join_residual,
            {"op": "store", "src": dx, "to": dx},
            {"op": "map", "expr": "xhat * gamma_col" + (" + beta_col" if beta else ""), "out": h},
            {"op": "store", "src": h, "to": h},
            *([{"op": "load_tile", "tensor": dout, "out": "dout_tile"}] if proj.bias else []),
            *colsum_ops,
        ],
    )
    b.output(norm.x, dx)
    for wrt, p in partials:
        b.output(wrt, b.summed_columns(p, f"d{wrt}"))
    return h
