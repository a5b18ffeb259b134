"""Tile family: bring an M×N program tensor (a residual, a saved activation) into registers.

A residual add ``x_new = x + y·W`` is ``add_tile(acc, x)`` in the epilogue of ``y·W``
(docs/algebra.md §3). Loaded tiles are fp32 and zero outside the tensor's edges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from ..base import EpilogueOp, Name, Port
from ..errors import ProgramError
from ..types import LocalType, scale_name

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..cute.emit import CuteEmitContext
    from ..reference import RefEnv


class AddTile(EpilogueOp):
    """Add a program tensor elementwise: ``out = src + tensor`` (e.g. the residual of a block).

    ``tensor`` must have the shape of ``src``: M rows and as many columns as ``src`` has
    (N for the accumulator). It is read in its own dtype and added in fp32.
    """

    op: Literal["add_tile"] = "add_tile"
    port: ClassVar = Port.TILE

    src: Name
    tensor: Name
    out: Name

    def check(self, env: CheckEnv) -> None:
        t = env.tile(self.src)
        want = (env.M, env.cols(t.scale))
        env.tensor(self.tensor)
        info = env.program.matrix(self.tensor, role="tensor")
        if info.shape != want:
            raise ProgramError(
                f"tensor {self.tensor!r} is {list(info.shape)} but src {self.src!r} is "
                f"{list(want)} ([M, {scale_name(t.scale)}])",
                hint="add_tile needs a tensor of exactly src's shape",
            )
        env.define_local(self.out, t)

    def reference(self, env: RefEnv) -> None:
        env.locals[self.out] = env.locals[self.src] + env.load(self.tensor)

    def emit(self, ctx: EmitContext) -> None:
        scale = ctx.type_of(self.src).scale
        tile = ctx.load_tile(self.tensor, scale)
        ctx.line(f"{ctx.define(self.out)} = {ctx.var(self.src)} + {tile}")

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        src = ctx.parts(self.src)
        tile = ctx.tile(self.tensor, ctx.scale(self.src))
        ctx.define(self.out, [f"({a} + {b})" for a, b in zip(src, tile, strict=True)])


class LoadTile(EpilogueOp):
    """Load this output tile's block of a program tensor into registers as epilogue value ``out``.

    ``tensor`` has M rows and N/2, N or 2N columns (N = the GEMM's output width); the loaded value
    lives in that column space, e.g. a saved ``[M, 2N]`` pre-activation ``z = [g, u]`` interleaved,
    read next to the ``[M, N]`` accumulator of a backward GEMM. Values are fp32.
    """

    op: Literal["load_tile"] = "load_tile"
    port: ClassVar = Port.TILE

    tensor: Name
    out: Name

    def check(self, env: CheckEnv) -> None:
        _, scale = env.matching_tile_tensor(self.tensor)
        env.define_local(self.out, LocalType("tile", scale))

    def reference(self, env: RefEnv) -> None:
        env.locals[self.out] = env.load(self.tensor)

    def emit(self, ctx: EmitContext) -> None:
        scale = ctx.type_of(self.out).scale
        ctx.line(f"{ctx.define(self.out)} = {ctx.load_tile(self.tensor, scale)}")

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        ctx.define(self.out, ctx.tile(self.tensor, ctx.scale(self.out)))
