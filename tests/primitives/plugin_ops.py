"""A user plugin as the README describes it: one extra epilogue primitive, defined outside coda.

Loaded by file path (``load_plugins(["…/plugin_ops.py"])``) in the tests of the plugin mechanism and
in sandbox workers; never imported by name, so it registers only when a test asks for it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from coda.primitives import EpilogueOp, Port, ProgramError
from coda.primitives.base import Name


class AddTileScaled(EpilogueOp):
    """Add ``alpha`` times a program tensor: ``out = src + alpha * tensor`` (same shape as src)."""

    op: Literal["add_tile_scaled"] = "add_tile_scaled"
    port: ClassVar = Port.TILE

    src: Name
    tensor: Name
    alpha: float = 1.0
    out: Name

    def check(self, env) -> None:  # noqa: ANN001
        t = env.tile(self.src)
        _info, scale = env.matching_tile_tensor(self.tensor)
        if scale != t.scale:
            raise ProgramError(f"tensor {self.tensor!r} must have the width of {self.src!r}")
        env.define_local(self.out, t)

    def reference(self, env) -> None:  # noqa: ANN001
        env.locals[self.out] = env.locals[self.src] + self.alpha * env.load(self.tensor)

    def emit(self, ctx) -> None:  # noqa: ANN001
        tile = ctx.load_tile(self.tensor, ctx.type_of(self.src).scale)
        ctx.line(f"{ctx.define(self.out)} = {ctx.var(self.src)} + {self.alpha!r} * {tile}")
