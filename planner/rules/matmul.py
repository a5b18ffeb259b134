"""``Matmul``: ``a @ b`` of two materialised tensors is a ``gemm`` step whose epilogue absorbs
what it can (``epilogue.emit_gemm``)."""

from __future__ import annotations

from coda.blocks.ops import Matmul

from ..epilogue import Epilogue, emit_gemm
from ..registry import Rule
from ..state import NoRule, PlanState


class MatmulRule(Rule):
    op = Matmul

    def lower(self, st: PlanState, index: int, op: Matmul) -> bool:
        for name in (op.a, op.b):
            if name not in st.available:
                raise NoRule(index, op, f"its input {name!r} is not materialised earlier")
        ep = Epilogue(st)
        ep.result(op.out, "acc")
        st.done.add(index)
        emit_gemm(st, index, ep, op.a, op.b, [op.out], op.out)
        return True
