"""Row and column scalings in an epilogue: ``scale_rows`` (a per-row vector), ``scale_cols`` (a
per-column vector), and ``apply_rstd`` (``x ⊙ r ⊙ γ``: an RMSNorm's output from its rstd).
"""

from __future__ import annotations

from coda.blocks.ops import ApplyRstd, ScaleCols, ScaleRows

from ..epilogue import Epilogue
from ..registry import Rule


class ScaleRowsRule(Rule):
    op = ScaleRows

    def fuse(self, ep: Epilogue, op: ScaleRows) -> None:
        ep.define(op.out, {"op": "scale_rows", "src": ep.tile(op.x), "vector": op.r})


class ScaleColsRule(Rule):
    op = ScaleCols

    def fuse(self, ep: Epilogue, op: ScaleCols) -> None:
        ep.define(op.out, {"op": "scale_cols", "src": ep.tile(op.x), "vector": op.v})


class ApplyRstdRule(Rule):
    op = ApplyRstd

    def fuse(self, ep: Epilogue, op: ApplyRstd) -> None:
        x, r, g = ep.tile(op.x), ep.row(op.rstd), ep.col(op.gamma)
        ep.define(op.out, {"op": "map", "expr": f"{x} * {r} * {g}"})
