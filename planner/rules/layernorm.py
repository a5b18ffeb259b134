"""``LayerNorm``: lowered into the GEMMs that read it, never as a pass of its own.

``LN(x)·Wᵀ = r ⊙ (x W'ᵀ − μ ⊗ s) + c``: the GEMM runs on ``x`` itself with ``γ`` folded into its
weight (prep ``fold_norm_weight``: ``W' = W·diag(γ)``); ``μ`` and ``r`` come from one aux
``mean_rstd`` step over ``x``; ``s`` (the row sums of ``W'``) and ``c = W β`` (when the LayerNorm
has a bias) are prep ``matvec`` steps. The epilogue loads ``μ`` and ``s`` for the rank-one
correction ``acc − μ ⊗ s`` (``map``), then ``scale_rows`` by ``r`` and ``add_col_vector`` of ``c``.

A LayerNorm whose output anything but a GEMM reads (or that is a block output) has no lowering.
Its rule also differentiates a forward block that starts with a LayerNorm: GPT-2's MLP
(``rules/layernorm_backward.py``).
"""

from __future__ import annotations

from coda.blocks.ops import LayerNorm, Linear

from ..backward import BackwardBuilder
from ..epilogue import Epilogue
from ..registry import Rule
from ..state import NoRule, PlanState, short_name
from .layernorm_backward import layer_norm_mlp_backward


class LayerNormRule(Rule):
    op = LayerNorm
    backward_of = "a LayerNorm followed by a non-gated MLP (any activation) with residual"
    differentiates_biases = True  # biased LayerNorm and Linears (GPT-2)

    def lower(self, st: PlanState, index: int, op: LayerNorm) -> bool:
        """Check that only GEMMs read the norm (each applies it in its epilogue)."""
        st.require_gemm_readers(index, op, "a LayerNorm", "x W'ᵀ − μ ⊗ colsum(W'), scaled by rstd")
        st.done.add(index)
        return True

    def differentiate(self, b: BackwardBuilder) -> None:
        layer_norm_mlp_backward(b)


def layer_norm_of(st: PlanState, op: Linear) -> tuple[int, LayerNorm] | None:
    """(graph index, LayerNorm) when Linear ``op`` reads a LayerNorm's output, else None."""
    found = st.producer(op.x)
    if found is not None and isinstance(found[1], LayerNorm):
        return found[0], found[1]
    return None


def apply_in_epilogue(
    st: PlanState, found: tuple[int, LayerNorm], weight: str, ep: Epilogue, value: str
) -> tuple[str, str, str]:
    """Lower ``LN(x) @ weightᵀ`` into ``ep``: (the GEMM's A operand ``x``, the folded weight it
    multiplies, the epilogue value holding the result)."""
    index, norm = found
    if norm.x not in st.available:
        raise NoRule(index, norm, f"its input {norm.x!r} is not materialised before the GEMM")
    mean, rstd = _statistics(st, norm)
    node = {"kind": "fold_norm_weight", "weight": weight, "gamma": norm.weight}
    folded = st.prepare(("fold", weight, norm.weight), {**node, "out": f"{weight}_folded"})
    sums = st.prepare(
        ("rowsum", folded), {"kind": "matvec", "weight": folded, "out": f"{folded}_rowsum"}
    )
    centered = f"{value}_centered"
    ep.emit({"op": "map", "expr": f"acc - {ep.row(mean)} * {ep.col(sums)}", "out": centered})
    scaled = value if norm.bias is None else f"{value}_normed"
    ep.emit({"op": "scale_rows", "src": centered, "vector": rstd, "out": scaled})
    if norm.bias is not None:
        node = {"kind": "matvec", "weight": weight, "vector": norm.bias}
        bias = st.prepare(
            ("matvec", weight, norm.bias), {**node, "out": f"{weight}_{short_name(norm.bias)}"}
        )
        ep.emit({"op": "add_col_vector", "src": scaled, "vector": bias, "out": value})
    return norm.x, folded, value


def _statistics(st: PlanState, norm: LayerNorm) -> tuple[str, str]:
    """The norm's (mean, rstd) tensors: one aux ``mean_rstd`` step over its input, added once."""
    if norm.out not in st.rstd:
        mean, rstd = f"mean_{norm.out}", f"rstd_{norm.out}"
        step = {"kind": "mean_rstd", "src": norm.x, "eps": norm.eps, "mean": mean, "out": rstd}
        st.steps.append(step)
        st.rstd[norm.out] = rstd
    return f"mean_{norm.out}", st.rstd[norm.out]
