"""``HeadRMSNorm``: the per-head q/k norm of Qwen3 and Gemma 3, lowered in the epilogue of the
projection that produces it, ahead of RoPE (the chain of ``rope.py``).

The statistic of a head is a sum over its ``head_dim`` columns, so it finishes inside the epilogue
when each sub-tile holds whole heads: epilogue op ``head_rmsnorm`` (a segmented row reduction)
with the norm weight permuted like the projection's rows (prep ``rope_pairs``), and the GEMM's
sub-tiles widened to a multiple of ``head_dim`` (``"auto"`` resolves to such a config). A head
width that is no power of two, or wider than the widest tile (256), cannot fit a sub-tile: the
rule raises ``NoRule`` naming the head width (no lowering across tiles exists yet: it would need
per-head partial sums and a finishing pass before the rotation, since γ does not commute with
it). The sandbox's drawn shapes keep such a head width a power of two (``blocks/draws.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from coda.blocks.ops import HeadRMSNorm
from coda.primitives.ops.head_rmsnorm import MAX_HEAD_DIM

from ..epilogue import Epilogue
from ..registry import Rule
from ..shapes import binding_shapes
from ..state import NoRule, PlanState


class HeadRMSNormRule(Rule):
    op = HeadRMSNorm

    def unlowered(self, st: PlanState, op: HeadRMSNorm) -> str:
        return (
            "HeadRMSNorm is lowered only between a Linear and a RoPE, in the Linear's epilogue, "
            f"when the RoPE is the only reader of {op.out!r} and the norm the only reader of "
            f"{op.x!r} (neither a block output)"
        )


def head_norm_in_epilogue(
    ep: Epilogue,
    found: tuple[int, HeadRMSNorm],
    cur: str,
    head: str,
    paired: Callable[[str], str],
) -> str:
    """Emit the per-head RMSNorm (graph op ``found``) of epilogue value ``cur`` (heads of
    ``head`` columns, in the pair order ``paired`` gives the weights); returns the normalised
    value. ``NoRule`` when a head width of the block's shape sets cannot fit a sub-tile."""
    index, norm = found
    widths = sorted({shapes[norm.weight][0] for _, shapes in binding_shapes(ep.st)})
    unfit = [w for w in widths if w & (w - 1) or w > MAX_HEAD_DIM]
    if unfit:
        raise NoRule(
            index,
            norm,
            f"its head width {unfit[0]} (the length of {norm.weight!r}) is no power of two "
            f"≤ {MAX_HEAD_DIM}: a per-head norm runs inside an epilogue sub-tile holding whole "
            "heads, which only such widths fit (there is no lowering of it across tiles)",
        )
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
