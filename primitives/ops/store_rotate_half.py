"""Store family, RoPE layout: write a tile whose heads are in adjacent-pair order back in Hugging
Face's rotate-half column order.

``rope`` rotates adjacent column pairs, so the Q/K weights are permuted by prep ``rope_pairs``
and the GEMM's heads come out as ``[x0, x_{D/2}, x1, x_{D/2+1}, …]``. A block written from model
code wants Hugging Face's order ``[x0, x1, …, x_{D/2}, …]``: ``store_rotate_half`` puts every
column back where it belongs while storing, so the permutation costs no register shuffle, only
different store addresses (within each head, the even columns of the tile land in its first half
and the odd ones in its second half).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from ..base import EpilogueOp, Name, Port
from ..errors import ProgramError
from ..sizes import SizeExpr
from ..sizes import evaluate as evaluate_size
from ..types import StoreDtype, TensorInfo

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..reference import RefEnv


def rotate_half_columns(width: int, head_dim: int, rotated: int) -> torch.Tensor:
    """Where each column of a pair-order tile goes: column ``h·D + 2p + e`` (``e`` ∈ {0, 1},
    ``p < D/2``) to ``h·D + e·D/2 + p``; columns from ``rotated`` on stay where they are."""
    cols = torch.arange(width)
    j = cols % head_dim
    dest = cols - j + j // 2 + (j % 2) * (head_dim // 2)
    return torch.where(cols < rotated, dest, cols)


class StoreRotateHalf(EpilogueOp):
    """Store tile ``src`` (heads in adjacent-pair order) to new tensor ``to`` in Hugging Face's
    rotate-half order: the inverse of prep ``rope_pairs``, rounding once.

    Column ``h·D + 2p + e`` goes to ``h·D + e·D/2 + p`` (D = ``head_dim``, a size expression).
    Columns from ``rotary_cols`` on (default: none) stay in place. ``dtype`` as ``store``.
    """

    op: Literal["store_rotate_half"] = "store_rotate_half"
    port: ClassVar = Port.SINK

    src: Name
    to: Name
    head_dim: SizeExpr
    rotary_cols: SizeExpr | None = None
    dtype: StoreDtype = "auto"

    def check(self, env: CheckEnv) -> None:
        t = env.tile(self.src)
        width = env.cols(t.scale)
        head = env.program.size(self.head_dim, what="store_rotate_half head_dim")
        rotated = width
        if self.rotary_cols is not None:
            rotated = env.program.size(self.rotary_cols, what="store_rotate_half rotary_cols")
        if head <= 0 or head % 2 or not 0 <= rotated <= width or rotated % head:
            raise ProgramError(
                f"store_rotate_half: {rotated} rotated columns of {self.src!r} ({width} wide) "
                f"are not a whole number of heads of even width head_dim = {head}",
                hint="head_dim is the width of the cos/sin tables; rotary_cols the Q (and K) "
                "columns only, e.g. 'Nq + Nkv'",
            )
        dtype = "act" if self.dtype == "auto" else self.dtype
        env.define_tensor(self.to, TensorInfo((env.M, width), dtype, env.program.where))

    def _columns(self, env: RefEnv, width: int) -> torch.Tensor:
        head = evaluate_size(self.head_dim, env.sizes)
        rotated = evaluate_size(self.rotary_cols, env.sizes) if self.rotary_cols else width
        return rotate_half_columns(width, head, rotated)

    def reference(self, env: RefEnv) -> None:
        value = env.locals[self.src]
        dest = self._columns(env, value.shape[1]).to(value.device)
        out = torch.empty_like(value)
        out[:, dest] = value
        env.tensors[self.to] = out.to(env.store_dtype(self.dtype))

    def emit(self, ctx: EmitContext) -> None:
        scale = ctx.type_of(self.src).scale
        cols = ctx.cols(scale)
        d = ctx.size(self.head_dim, f"head_{self.to}")
        dest = f"p_{self.to}_dest"
        ctx.line(f"{dest}_j = {cols.offs} % {d}")
        ctx.line(f"{dest} = {cols.offs} - {dest}_j + {dest}_j // 2 + ({dest}_j % 2) * ({d} // 2)")
        if self.rotary_cols is not None:
            limit = ctx.size(self.rotary_cols, f"rot_{self.to}")
            ctx.line(f"{dest} = tl.where({cols.offs} < {limit}, {dest}, {cols.offs})")
        ptr = ctx.pointer(self.to)
        ptrs = (
            f"{ptr} + offs_cm64[:, None] * {ctx.stride(self.to, 0, 'm')}"
            f" + {dest}[None, :] * {ctx.stride(self.to, 1, 'n')}"
        )
        ctx.line(f"{ctx.base(self.to)}_ptrs = {ptrs}")
        value = f"({ctx.var(self.src)}).to({ptr}.dtype.element_ty)"
        ctx.line(f"tl.store({ctx.base(self.to)}_ptrs, {value}, mask={ctx.tile_mask(scale)})")
