"""Reduce family: per-tile partial reductions, finished later by a tiny ``Aux`` step.

Statistics of a tensor that a GEMM produces come from that GEMM's epilogue (docs/algebra.md §1):
each output tile writes its partial sums of squares into a ``[M, ⌈N/BN⌉]`` buffer (one column per
column block, ``partials_shape``), and ``rstd`` finishes ``r = rsqrt(Σ partials / N + eps)``.
Cross-entropy (§5) uses kind ``lse``: each tile keeps an online (max, sum-exp) per row over its
columns and writes the tile's log-sum-exp ``m + log Σ exp(v − m)``; ``lse_combine`` merges the
tiles' values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from ..base import EpilogueOp, Name, Port
from ..types import PartialsInfo, TensorInfo

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..cute.emit import CuteEmitContext
    from ..reference import RefEnv


@dataclass(frozen=True)
class _Kind:
    value: str  # the Triton expression reduced, in terms of {v}
    neutral: float  # what masked-out elements contribute
    triton: str  # the Triton reduction
    torch: Callable[[torch.Tensor, int], torch.Tensor]

    @property
    def neutral_code(self) -> str:
        return "float('-inf')" if math.isinf(self.neutral) else repr(self.neutral)


_KINDS = {
    "sum": _Kind("{v}", 0.0, "tl.sum", lambda x, d: x.sum(d)),
    "sumsq": _Kind("{v} * {v}", 0.0, "tl.sum", lambda x, d: (x * x).sum(d)),
    "max": _Kind("{v}", -math.inf, "tl.max", lambda x, d: x.amax(d)),
    # The tile's log-sum-exp; the Triton side is written out in ``_emit_lse``.
    "lse": _Kind("{v}", -math.inf, "", lambda x, d: torch.logsumexp(x, d)),
}


class PartialReduce(EpilogueOp):
    """Write per-tile partial reductions of tile ``src`` to a new program tensor ``to`` (fp32).

    ``kind``: ``sum``, ``sumsq`` (sum of squares, for RMSNorm statistics), ``max``, or ``lse``
    (the tile's log-sum-exp ``log Σ exp(src)`` over its part of the row, for cross-entropy).
    ``axis="row"``: each tile reduces its columns: ``to`` is ``[M, ⌈W/BLOCK_N⌉]`` (W = src's
    width). ``axis="col"``: each tile reduces its rows: ``[W, ⌈M/BLOCK_M⌉]``. Elements outside
    the tensor's edges never contribute. Finish the partials with an aux step: ``rstd`` (sumsq),
    ``sum_partials`` (sum), ``lse_combine`` (lse).
    """

    op: Literal["partial_reduce"] = "partial_reduce"
    port: ClassVar = Port.SINK

    src: Name
    kind: Literal["sum", "sumsq", "max", "lse"]
    axis: Literal["row", "col"] = "row"
    to: Name

    def check(self, env: CheckEnv) -> None:
        t = env.tile(self.src)
        width = env.cols(t.scale)
        rows, length = (env.M, width) if self.axis == "row" else (width, env.M)
        info = PartialsInfo(self.kind, self.axis, length, env.program.where)
        env.define_tensor(self.to, TensorInfo((rows,), "float32", env.program.where, info))

    def reference(self, env: RefEnv) -> None:
        kind = _KINDS[self.kind]
        x = env.locals[self.src]
        if self.axis == "col":
            x, block = x.transpose(0, 1), env.block_m
        else:
            # the sub-tile width of src's column space (N/2 after a pair contraction, ...)
            block = env.epilogue_block_n * x.shape[1] // env.N
        rows, width = x.shape
        nblocks = -(-width // block)
        pad = torch.full(
            (rows, nblocks * block - width), kind.neutral, dtype=x.dtype, device=x.device
        )
        blocks = torch.cat([x, pad], dim=1).reshape(rows, nblocks, block)
        env.tensors[self.to] = kind.torch(blocks, 2).to(env.partials_dtype)

    def emit(self, ctx: EmitContext) -> None:
        kind = _KINDS[self.kind]
        scale = ctx.type_of(self.src).scale
        v = kind.value.format(v=ctx.var(self.src))
        dim = 1 if self.axis == "row" else 0
        # Only the reduced axis needs its edge masked: partials of lanes past the other edge are
        # never stored (the store masks them), so masking them too is work for nothing.
        edge = f"{ctx.cols(scale).mask}[None, :]" if dim == 1 else f"{ctx.rows().mask}[:, None]"
        masked = f"tl.where({edge}, {v}, {kind.neutral_code})"
        partial = f"p_{self.to}"
        if self.kind == "lse":
            _emit_lse(ctx, partial, masked, dim)
        else:
            ctx.line(f"{partial} = {kind.triton}({masked}, axis={dim})")
        ctx.store_partials(self.to, partial, self.axis, scale)

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        ctx.reduce(self.to, self.axis, self.kind, ctx.parts(self.src))


def _emit_lse(ctx: EmitContext, partial: str, masked: str, dim: int) -> None:
    """``partial = m + log Σ exp(v − m)`` along ``dim``, ``m`` the tile's max (stable)."""
    expand = "[:, None]" if dim == 1 else "[None, :]"
    ctx.line(f"{partial}_v = {masked}")
    ctx.line(f"{partial}_max = tl.max({partial}_v, axis={dim})")
    # Lanes past the edge are -inf everywhere; shift them by 0 instead of -inf (their result is
    # never stored), so exp never sees inf - inf.
    ctx.line(f"{partial}_max = tl.where({partial}_max == float('-inf'), 0.0, {partial}_max)")
    ctx.line(f"{partial}_sum = tl.sum(tl.exp({partial}_v - {partial}_max{expand}), axis={dim})")
    # A real lane's sum is ≥ 1 (its max contributes exp(0)); the floor only keeps log(0) off the
    # never-stored lanes past the edge.
    ctx.line(f"{partial} = {partial}_max + tl.log(tl.maximum({partial}_sum, 1e-30))")
