"""``HeadRMSNorm``: the per-head q/k norm of Qwen3 and Gemma 3, lowered in the epilogue of the
projection that produces it, ahead of RoPE (the chain of ``rope.py``).

The statistic of a head is a sum over its ``head_dim`` columns, so it finishes inside the epilogue
when each sub-tile holds whole heads: epilogue op ``head_rmsnorm`` (a segmented row reduction)
with the norm weight permuted like the projection's rows (prep ``rope_pairs``), and the GEMM's
sub-tiles widened to a multiple of ``head_dim`` (``"auto"`` resolves to such a config). A head
width that is no power of two, or wider than the widest tile (256), cannot fit a sub-tile: the
``head_rmsnorm`` check refuses it, naming the head width, and such a block has no lowering.
"""

from __future__ import annotations

from collections.abc import Callable

from coda.blocks.ops import HeadRMSNorm

from ..epilogue import Epilogue
from ..registry import Rule
from ..state import PlanState


class HeadRMSNormRule(Rule):
    op = HeadRMSNorm

    def unlowered(self, st: PlanState, op: HeadRMSNorm) -> str:
        return (
            "HeadRMSNorm is lowered only between a Linear and a RoPE, in the Linear's epilogue, "
            f"when the RoPE is the only reader of {op.out!r} and the norm the only reader of "
            f"{op.x!r} (neither a block output)"
        )


def head_norm_in_epilogue(
    ep: Epilogue, norm: HeadRMSNorm, cur: str, head: str, paired: Callable[[str], str]
) -> str:
    """Emit the per-head RMSNorm of epilogue value ``cur`` (heads of ``head`` columns, in the
    pair order ``paired`` gives the weights); returns the normalised value."""
    node = {
        "op": "head_rmsnorm",
        "src": cur,
        "weight": paired(norm.weight),
        "head_dim": head,
        "eps": norm.eps,
        "out": f"{norm.out}_normed",
    }
    if norm.offset:
        node["offset"] = norm.offset
    ep.emit(node)
    return node["out"]
