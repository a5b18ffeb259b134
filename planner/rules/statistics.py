"""Row statistics as partials + aux (docs/algebra.md §3): the epilogue writes one
``partial_reduce`` per row block and a tiny aux step finishes it — ``mean_square``
(``sum_partials`` divided by the width), ``row_rstd`` (``rstd`` of the partials), ``row_dot``
(``Σ a·b`` per row).
"""

from __future__ import annotations

from coda.blocks.ops import MeanSquare, RowDot, RowRstd

from ..epilogue import Epilogue
from ..registry import Rule
from ..shapes import size_expr_of


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
