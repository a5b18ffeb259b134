"""An RMSNorm's backward as kernel-level ops in an epilogue (docs/algebra.md §4):
``rms_norm_backward`` (``dx = r ⊙ (dy ⊙ γ − x̂ · c)``) and ``rms_norm_weight_grad``
(``dγ = Σ_rows dy ⊙ x̂``, partial column sums per row block finished by an aux step).
"""

from __future__ import annotations

from coda.blocks.ops import RMSNormBackward, RMSNormWeightGrad

from ..epilogue import Epilogue
from ..registry import Rule


class RMSNormBackwardRule(Rule):
    op = RMSNormBackward

    def fuse(self, ep: Epilogue, op: RMSNormBackward) -> None:
        # dx = r ⊙ (dy ⊙ γ − x̂ · c) with x̂ = r ⊙ x (docs/algebra.md §4)
        dy, x, r = ep.tile(op.dy), ep.tile(op.x), ep.row(op.rstd)
        g, c = ep.col(op.gamma), ep.row(op.c)
        ep.define(op.out, {"op": "map", "expr": f"{r} * ({dy} * {g} - {r} * {x} * {c})"})


class RMSNormWeightGradRule(Rule):
    op = RMSNormWeightGrad
    sink = True

    def fuse(self, ep: Epilogue, op: RMSNormWeightGrad) -> None:
        # dγ = Σ_rows dy ⊙ x̂: partial column sums per row block, summed by an aux step
        dy, x, r = ep.tile(op.dy), ep.tile(op.x), ep.row(op.rstd)
        prod = f"{op.out}_terms"
        ep.emit({"op": "map", "expr": f"{dy} * {x} * {r}", "out": prod})
        p = ep.partials(prod, "sum", f"{op.out}_partials", axis="col")
        ep.aux.append({"kind": "sum_partials", "src": p, "dtype": "act", "out": op.out})
