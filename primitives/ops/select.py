"""Select family: per-row column indices — pick the target logit, or mark it in a one-hot tile.

Cross-entropy in the LM head's epilogue (docs/algebra.md §5) needs ``logits[i, t_i]`` for the loss
and ``onehot(t)`` for its gradient ``softmax − onehot``. Each output tile sees only its own columns,
so the tile that holds column ``t_i`` writes row i's target logit; no tile ever needs the whole row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from ..base import EpilogueOp, Name, Port
from ..errors import ProgramError
from ..types import LocalType, TensorInfo

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..reference import RefEnv


def _check_index(env: CheckEnv, index: str) -> None:
    info = env.vector(index, env.M, role="index", what="one column index per row, M")
    if info.dtype != "int64":
        raise ProgramError(
            f"index {index!r} must be an int64 tensor of column indices, but it is {info.dtype}"
        )


def _in_range(index: torch.Tensor, width: int) -> torch.Tensor:
    return (index >= 0) & (index < width)


class SelectColumn(EpilogueOp):
    """Write ``to[i] = src[i, index[i]]`` (fp32, length M): e.g. the target logit of each token.

    ``index`` is an int64 program tensor of length M (the targets). The tile whose columns contain
    ``index[i]`` writes row i, so no tile needs the whole row. Rows whose index is outside
    ``[0, W)`` (W = src's width; e.g. an ignore_index of -100) get 0.0. ``to`` is a new program
    tensor; combine it with ``lse_combine(minus=to)`` for the per-token cross-entropy loss.
    """

    op: Literal["select_column"] = "select_column"
    port: ClassVar = Port.SINK

    src: Name
    index: Name
    to: Name

    def check(self, env: CheckEnv) -> None:
        env.tile(self.src)
        _check_index(env, self.index)
        env.define_tensor(self.to, TensorInfo((env.M,), "float32", env.program.where))

    def reference(self, env: RefEnv) -> None:
        z = env.locals[self.src]
        index = env.tensors[self.index]
        valid = _in_range(index, z.shape[1])
        picked = z[torch.arange(z.shape[0], device=z.device), torch.where(valid, index, 0)]
        env.tensors[self.to] = torch.where(valid, picked, 0.0).to(env.partials_dtype)

    def emit(self, ctx: EmitContext) -> None:
        scale = ctx.type_of(self.src).scale
        rows, cols = ctx.rows(), ctx.cols(scale)
        p = f"p_{self.to}"
        ptrs = f"{ctx.pointer(self.index)} + {rows.offs} * {ctx.stride(self.index, 0, '')}"
        ctx.line(f"{p}_index = tl.load({ptrs}, mask={rows.mask}, other=-1)")
        # No edge masks: a column past N can only match an index ≥ N, and `here` below keeps
        # such rows (and rows past M, by the store's mask) from being written.
        ctx.line(f"{p}_hit = {cols.offs}[None, :] == {p}_index[:, None]")
        # At most one column of the row matches, so the masked sum is that element.
        ctx.line(f"{p} = tl.sum(tl.where({p}_hit, {ctx.var(self.src)}, 0.0), axis=1)")
        # The row's index falls in this sub-tile's columns: range arithmetic on the row vector,
        # not a second reduction over the tile (one fewer tile of live values in the epilogue).
        start, extent = ctx.col_start(scale), ctx.extent(scale)
        in_tile = f"({p}_index >= {start}) & ({p}_index < {start} + {ctx.block(scale)})"
        ctx.line(f"{p}_here = {in_tile} & ({p}_index < {extent})")
        out = f"{ctx.pointer(self.to)} + {rows.offs} * {ctx.stride(self.to, 0, '')}"
        ctx.line(f"tl.store({out}, {p}, mask={rows.mask} & {p}_here)")
        # An index outside [0, W) is held by no tile: the sub-tile holding column 0 (start_n == 0)
        # writes 0.0 for it, so exactly one program does. (A mask, not an `if`: Triton 3.6 cannot
        # flatten a persistent loop around this conditional store — seen on the H200. The
        # condition on start_n is broadcast to a row tensor: a scalar bool mask breaks the
        # interpreter.)
        first = f"({p}_index * 0 + start_n == 0)"
        ctx.line(f"{p}_none = (({p}_index < 0) | ({p}_index >= {extent})) & {first}")
        ctx.line(f"tl.store({out}, tl.zeros_like({p}), mask={rows.mask} & {p}_none)")


class Onehot(EpilogueOp):
    """A one-hot tile from per-row column indices: ``out[i, j] = 1.0 if j == index[i] else 0.0``.

    ``out`` has the accumulator's width N (e.g. the gradient of cross-entropy, ``softmax(z) −
    onehot(t)``, written with ``map``). ``index`` is an int64 program tensor of length M; a row
    whose index is outside ``[0, N)`` is all zeros.
    """

    op: Literal["onehot"] = "onehot"
    port: ClassVar = Port.ROW

    index: Name
    out: Name

    def check(self, env: CheckEnv) -> None:
        _check_index(env, self.index)
        env.define_local(self.out, LocalType("tile"))

    def reference(self, env: RefEnv) -> None:
        index = env.tensors[self.index]
        cols = torch.arange(env.N, device=index.device)
        env.locals[self.out] = (cols[None, :] == index[:, None]).to(env.compute)

    def emit(self, ctx: EmitContext) -> None:
        rows, cols = ctx.rows(), ctx.cols(LocalType("tile").scale)
        ptrs = f"{ctx.pointer(self.index)} + {rows.offs} * {ctx.stride(self.index, 0, '')}"
        index = f"p_{self.out}_index"
        ctx.line(f"{index} = tl.load({ptrs}, mask={rows.mask}, other=-1)")
        ctx.line(
            f"{ctx.define(self.out)} = tl.where({cols.offs}[None, :] == {index}[:, None], 1.0, 0.0)"
        )
