"""Row statistics as partials + aux (docs/algebra.md §3): the epilogue writes one
``partial_reduce`` per row block and a tiny aux step finishes it — ``mean_square``
(``sum_partials`` divided by the width), ``row_rstd`` (``rstd`` of the partials), ``row_dot``
(``Σ a·b`` per row).

A ``row_rstd`` of an RMSNorm's stored input with the norm's epsilon is that norm's own statistic (a
training forward returns it for its backward, ``blocks.llama``'s ``_train`` blocks): it is lowered
where it stands as the norm's ``rstd`` tensor (``ensure_rstd``), made once for both.
"""

from __future__ import annotations

from coda.blocks.ops import MeanSquare, RMSNorm, RowDot, RowRstd

from ..epilogue import Epilogue
from ..registry import Rule
from ..shapes import size_expr_of
from ..state import PlanState
from .rmsnorm import ensure_rstd


class MeanSquareRule(Rule):
    op = MeanSquare
    sink = True

    def fuse(self, ep: Epilogue, op: MeanSquare) -> None:
        p = ep.partials(ep.tile(op.x), "sumsq", f"{op.out}_partials")
        width = size_expr_of(ep.st, op.x, 1)
        ep.aux.append({"kind": "sum_partials", "src": p, "divide_by": width, "out": op.out})


class RowRstdRule(Rule):
    op = RowRstd
    sink = True

    def lower(self, st: PlanState, index: int, op: RowRstd) -> bool:
        """The statistic of an RMSNorm of the same stored value and epsilon: the norm's ``rstd``
        tensor (one aux step for both), the block output ``op.out``; False (left to an
        epilogue) for any other."""
        norm = _norm_of(st, op)
        if norm is None or op.x not in st.available:
            return False
        r = ensure_rstd(st, norm)
        if r != op.out:
            if st.consumers(op.out):
                return False  # a graph op reads it under its own name: not a renamed output
            st.outputs[op.out] = r
        st.available.add(op.out)
        st.done.add(index)
        return True

    def fuse(self, ep: Epilogue, op: RowRstd) -> None:
        p = ep.partials(ep.tile(op.x), "sumsq", f"{op.out}_partials")
        ep.aux.append({"kind": "rstd", "src": p, "eps": op.eps, "out": op.out})


class RowDotRule(Rule):
    op = RowDot
    sink = True

    def fuse(self, ep: Epilogue, op: RowDot) -> None:
        prod = f"{op.out}_terms"
        ep.emit({"op": "map", "expr": f"{ep.tile(op.a)} * {ep.tile(op.b)}", "out": prod})
        p = ep.partials(prod, "sum", f"{op.out}_partials")
        ep.aux.append({"kind": "sum_partials", "src": p, "out": op.out})


def _norm_of(st: PlanState, op: RowRstd) -> RMSNorm | None:
    """The RMSNorm that normalises ``op.x`` with ``op.eps`` (whose statistic ``op`` is), if any."""
    return next(
        (c for _, c in st.consumers(op.x) if isinstance(c, RMSNorm) and c.eps == op.eps), None
    )
