"""Reduce family, segmented: RMSNorm of each head of a tile, inside the epilogue.

Qwen3's and Gemma 3's ``q_norm``/``k_norm`` normalise every head (``head_dim`` columns) of the q/k
projection on its own. The statistic of a head is a row reduction over a column *segment*, so it
finishes in the epilogue when every head lies inside one sub-tile: ``head_rmsnorm`` requires
epilogue sub-tiles a multiple of ``head_dim`` columns wide (a power of two), and the config
``"auto"`` resolves to such tiles (``CheckEnv.require_columns``). Within a tile each head's sum
of squares is a masked row sum, one per head of the sub-tile, broadcast back over its columns.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from pydantic import Field

from ..base import EpilogueOp, Name, Port
from ..errors import ProgramError
from ..sizes import SizeExpr
from ..sizes import evaluate as evaluate_size

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..reference import RefEnv

# The widest sub-tile a config can have (block_n ≤ 256): heads wider than this never fit one.
MAX_HEAD_DIM = 256


class HeadRmsnorm(EpilogueOp):
    """RMSNorm of each ``head_dim``-wide head of tile ``src`` on its own: ``out = src ·
    rsqrt(mean over the head of src² + eps) · (offset + weight[j mod head_dim])``.

    ``head_dim``: a power of two ≤ 256 dividing src's width (space N); ``weight`` ``[head_dim]``
    in the tile's per-head column order (``rope_pairs`` it like the projection). Sub-tiles must
    hold whole heads: ``"auto"`` widens them; an explicit config needs ``block_n //
    epilogue_subtiles`` a multiple of ``head_dim``.
    """

    op: Literal["head_rmsnorm"] = "head_rmsnorm"
    port: ClassVar = Port.TILE

    src: Name
    weight: Name
    head_dim: SizeExpr
    eps: float = Field(1e-6, gt=0, le=1)
    offset: float = Field(0.0, allow_inf_nan=False)
    out: Name

    def check(self, env: CheckEnv) -> None:
        t = env.tile(self.src)
        if t.scale != Fraction(1):
            raise ProgramError(
                f"head_rmsnorm needs src {self.src!r} in the accumulator's column space N, but "
                f"it is {t.describe()}",
                hint="normalise the heads before any pair contraction",
            )
        width = env.cols(t.scale)
        head = env.program.size(self.head_dim, what="head_rmsnorm head_dim")
        if head <= 0 or head & (head - 1) or head > MAX_HEAD_DIM or width % head:
            raise ProgramError(
                f"head_rmsnorm head_dim = {head} must be a power of two ≤ {MAX_HEAD_DIM} dividing "
                f"src {self.src!r}'s {width} columns (whole heads must fit one epilogue sub-tile)",
                hint="a head width that is no power of two has no in-epilogue lowering",
            )
        env.vector(self.weight, head, role="weight", what="one value per column of a head")
        env.require_columns(head)
        env.define_local(self.out, t)

    def reference(self, env: RefEnv) -> None:
        z = env.locals[self.src]
        head = evaluate_size(self.head_dim, env.sizes)
        heads = z.reshape(z.shape[0], -1, head)
        r = torch.rsqrt((heads * heads).mean(dim=2, keepdim=True) + self.eps)
        weight = self.offset + env.load(self.weight)
        env.locals[self.out] = (heads * r * weight).reshape(z.shape)

    def emit(self, ctx: EmitContext) -> None:
        scale = ctx.type_of(self.src).scale
        cols = ctx.cols(scale)
        d = ctx.size(self.head_dim, f"head_{self.out}")
        x, p = ctx.var(self.src), f"p_{self.out}"
        # The sub-tile starts at a multiple of D (its width is one), so the heads it holds are
        # local columns [h·D, (h+1)·D) for h < EPI_N // D.
        ctx.line(f"{p}_head = ({cols.offs} - {ctx.col_start(scale)}) // {d}")
        ctx.line(f"{p}_sq = {x} * {x}")
        ctx.line(f"{p}_ms = tl.zeros_like({x})")
        ctx.line(f"for {p}_h in range(0, {ctx.block(scale)} // {d}):")
        with ctx.body.indent():
            ctx.line(f"{p}_in = ({p}_head == {p}_h)[None, :]")
            ctx.line(f"{p}_sum = tl.sum(tl.where({p}_in, {p}_sq, 0.0), axis=1)")
            ctx.line(f"{p}_ms = tl.where({p}_in, {p}_sum[:, None] / {d}, {p}_ms)")
        stride = ctx.stride(self.weight, 0, "")
        ptrs = f"{ctx.pointer(self.weight)} + ({cols.offs} % {d}) * {stride}"
        ctx.line(f"{p}_w = tl.load({ptrs}, mask={cols.mask}, other=0.0).to(tl.float32)[None, :]")
        weight = f"({self.offset!r} + {p}_w)" if self.offset else f"{p}_w"
        ctx.line(f"{ctx.define(self.out)} = {x} * tl.rsqrt({p}_ms + {self.eps!r}) * {weight}")
