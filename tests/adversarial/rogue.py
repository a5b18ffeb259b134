"""Rogue primitives: each has the *right* PyTorch semantics and a *wrong* Triton emitter.

The IR cannot express a kernel that skips edge tiles, writes into its input or reads past an edge:
the real primitives never do. These plugins do, the way a buggy primitive (or a careless author of
one) would, so the sandbox's verify stage — not its semantics stage — must catch them. Loaded as a
plugin (``SandboxOptions(plugins=[this file])``), in the caller and in the worker.
"""

from __future__ import annotations

from typing import Literal

from coda.primitives.base import Name
from coda.primitives.ops.pairwise import Swiglu
from coda.primitives.ops.reduce import _KINDS, PartialReduce
from coda.primitives.ops.store import Store
from coda.primitives.ops.tile import AddTile
from coda.primitives.ops.vector import AddColVector, ScaleRows


def _store(ctx, op: Store, value: str) -> None:  # noqa: ANN001
    ctx.store_tile(op.to, value, ctx.type_of(op.src).scale, accumulate=False)


class StoreSkipEdges(Store):
    """Store, except in tiles that cross the tensor's edge (they stay unwritten)."""

    op: Literal["store_skip_edges"] = "store_skip_edges"

    def emit(self, ctx) -> None:  # noqa: ANN001
        scale = ctx.type_of(self.src).scale
        mask, ptrs = ctx.tile_mask(scale), f"{ctx.base(self.to)}_ptrs"
        ctx.line(f"{ptrs} = {ctx.tile_ptrs(self.to, scale)}")
        # Count the tile's lanes outside the tensor; store only when there are none.
        ctx.line(f"outside = tl.where({mask}, 0, 1)")
        ctx.line("edge_lanes = tl.sum(tl.sum(outside, axis=1), axis=0)")
        value = f"({ctx.var(self.src)}).to({ctx.pointer(self.to)}.dtype.element_ty)"
        ctx.line(f"tl.store({ptrs}, {value}, mask={mask} & ((outside * 0 + edge_lanes) == 0))")


class StoreZeros(Store):
    """Store zeros instead of the value."""

    op: Literal["store_zeros"] = "store_zeros"

    def emit(self, ctx) -> None:  # noqa: ANN001
        _store(ctx, self, f"{ctx.var(self.src)} * 0.0")


class StoreDividedByZero(Store):
    """Store the value divided by zero (Inf, and NaN where it is zero)."""

    op: Literal["store_divided_by_zero"] = "store_divided_by_zero"

    def emit(self, ctx) -> None:  # noqa: ANN001
        _store(ctx, self, f"{ctx.var(self.src)} / 0.0")


class StoreOverwrite(Store):
    """Store that writes even when ``mode='accumulate'`` (drops what was there)."""

    op: Literal["store_overwrite"] = "store_overwrite"

    def emit(self, ctx) -> None:  # noqa: ANN001
        _store(ctx, self, ctx.var(self.src))


class StoreAndScribble(Store):
    """Store correctly — then zero this tile of ``victim``, a block input."""

    op: Literal["store_and_scribble"] = "store_and_scribble"
    victim: Name

    def check(self, env) -> None:  # noqa: ANN001
        super().check(env)
        env.matching_tile_tensor(self.victim)

    def emit(self, ctx) -> None:  # noqa: ANN001
        super().emit(ctx)
        scale = ctx.type_of(self.src).scale
        ctx.store_tile(self.victim, f"{ctx.var(self.src)} * 0.0", scale, accumulate=False)


class StoreFarAway(Store):
    """Store correctly, then once more 2**40 elements past the tensor (a wild pointer)."""

    op: Literal["store_far_away"] = "store_far_away"

    def emit(self, ctx) -> None:  # noqa: ANN001
        super().emit(ctx)
        scale = ctx.type_of(self.src).scale
        ptrs = ctx.tile_ptrs(self.to, scale)
        ctx.line(f"tl.store({ptrs} + (1 << 40), {ctx.var(self.src)}, mask={ctx.tile_mask(scale)})")


class PartialReduceUnmasked(PartialReduce):
    """Partial reduction that also sums the lanes past the tile's edge (the mainloop's wrapped
    duplicate columns)."""

    op: Literal["partial_reduce_unmasked"] = "partial_reduce_unmasked"

    def emit(self, ctx) -> None:  # noqa: ANN001
        kind = _KINDS[self.kind]
        scale = ctx.type_of(self.src).scale
        value = kind.value.format(v=ctx.var(self.src))
        partial = f"p_{self.to}"
        ctx.line(f"{partial} = {kind.triton}({value}, axis={1 if self.axis == 'row' else 0})")
        ctx.store_partials(self.to, partial, self.axis, scale)


class SwigluSwapped(Swiglu):
    """SwiGLU with gate and up swapped in the kernel: ``silu(up) * gate``."""

    op: Literal["swiglu_swapped"] = "swiglu_swapped"

    def emit(self, ctx) -> None:  # noqa: ANN001
        gate, up = f"p_{self.out}_gate", f"p_{self.out}_up"
        ctx.split_pairs(ctx.var(self.src), ctx.type_of(self.src).scale, gate, up)
        ctx.line(f"{ctx.define(self.out)} = {up} * tl.sigmoid({up}) * {gate}")


class ScaleRowsIgnored(ScaleRows):
    """scale_rows whose kernel never applies the vector."""

    op: Literal["scale_rows_ignored"] = "scale_rows_ignored"

    def emit(self, ctx) -> None:  # noqa: ANN001
        ctx.line(f"{ctx.define(self.out)} = {ctx.var(self.src)}")


class AddColVectorIgnored(AddColVector):
    """add_col_vector whose kernel never adds the vector."""

    op: Literal["add_col_vector_ignored"] = "add_col_vector_ignored"

    def emit(self, ctx) -> None:  # noqa: ANN001
        ctx.line(f"{ctx.define(self.out)} = {ctx.var(self.src)}")


class AddTileIgnored(AddTile):
    """add_tile whose kernel never adds the tile (a skipped residual)."""

    op: Literal["add_tile_ignored"] = "add_tile_ignored"

    def emit(self, ctx) -> None:  # noqa: ANN001
        ctx.line(f"{ctx.define(self.out)} = {ctx.var(self.src)}")


class AddTileRaises(AddTile):
    """add_tile whose emitter has a bug (raises)."""

    op: Literal["add_tile_raises"] = "add_tile_raises"

    def emit(self, ctx) -> None:  # noqa: ANN001
        raise KeyError(f"no Triton variable for {self.tensor!r} (a bug in this emitter)")


class AddTileBadSyntax(AddTile):
    """add_tile whose emitter writes invalid Python."""

    op: Literal["add_tile_bad_syntax"] = "add_tile_bad_syntax"

    def emit(self, ctx) -> None:  # noqa: ANN001
        ctx.line(f"{ctx.define(self.out)} = {ctx.var(self.src)} +* 1")
