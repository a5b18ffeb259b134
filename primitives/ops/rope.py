"""Pairwise family, rotary position embedding: a 2→2 rotation of adjacent column pairs.

Hugging Face's Llama rotates *halves* of each head: for a head of width D and ``p < D/2``,
``out[p] = x[p]·cos_p − x[p + D/2]·sin_p`` and ``out[p + D/2] = x[p + D/2]·cos_p + x[p]·sin_p``
(``rotate_half``). Partners D/2 apart rarely share an output tile, so CODA permutes the Q/K
weight rows offline (prep ``rope_pairs``) so that partner p and p + D/2 become adjacent columns
``(2p, 2p+1)`` of the GEMM output (docs/algebra.md §2); the rotation is then lane-local in the
epilogue: ``x' = x·cos − y·sin``, ``y' = y·cos + x·sin`` with ``(x, y) = (col 2k, col 2k+1)`` and
the angle of frequency ``p = k mod D/2``. The result is Hugging Face's rotated head in that same
permuted (adjacent-pair) order; attention scores are unchanged because Q and K share the
permutation.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from ..base import EpilogueOp, Name, Port
from ..errors import ProgramError
from ..sizes import SizeExpr
from ..sizes import evaluate as evaluate_size
from .pairwise import contract_pairs, interleave

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..reference import RefEnv
    from ..types import TensorInfo


def check_rope_tables(
    table: Callable[[str], TensorInfo], cos: str, sin: str, rows: int, op: str, row_doc: str
) -> int:
    """The head width D of RoPE tables ``cos``/``sin`` (each ``[rows, D]``, D even, the same
    shapes), or a ``ProgramError`` naming the table; ``table`` looks a name up."""
    shapes = []
    for name in (cos, sin):
        info = table(name)
        if info.shape[0] != rows or info.shape[1] % 2 or info.shape[1] == 0:
            raise ProgramError(
                f"{op} table {name!r} is {info.describe()}; it must be [M, head_dim] with "
                f"M = {rows} rows ({row_doc}) and an even head_dim"
            )
        shapes.append(info.shape)
    if shapes[0] != shapes[1]:
        raise ProgramError(f"{op} tables {cos!r} and {sin!r} differ in shape")
    return shapes[0][1]


def rotate_pairs(
    z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int, *, inverse: bool
) -> torch.Tensor:
    """RoPE on adjacent column pairs of ``z`` in PyTorch (the references of ``rope`` and aux
    ``rope_rows``): pair k uses column ``k mod D/2`` of the tables; columns from ``rotated`` on
    pass through; ``inverse`` rotates by the negative angle."""
    x, y = z[:, 0::2], z[:, 1::2]
    pair = torch.arange(x.shape[1], device=z.device)
    freq = pair % (cos.shape[1] // 2)
    keep = (2 * pair < rotated)[None, :]
    c = torch.where(keep, cos[:, freq], 1.0)
    s = torch.where(keep, sin[:, freq], 0.0)
    if inverse:
        s = -s
    return interleave(x * c - y * s, y * c + x * s)


class Rope(EpilogueOp):
    """Rotate adjacent column pairs of tile ``src`` by per-token angles (RoPE), 2→2.

    ``cos`` and ``sin`` are per-token tables ``[M, D]`` exactly as Hugging Face's
    ``LlamaRotaryEmbedding`` returns them (flattened over batch × sequence; D = head_dim, the two
    halves equal): pair k = columns ``(2k, 2k+1)`` belongs to head ``2k // D`` and uses frequency
    ``p = k mod D/2``, i.e. ``c = cos[i, p]``, ``s = sin[i, p]``; then ``out[:, 2k] = x·c − y·s``
    and ``out[:, 2k+1] = y·c + x·s`` with ``x, y = src[:, 2k], src[:, 2k+1]``. This is Hugging
    Face's ``apply_rotary_pos_emb`` on weights whose rows were permuted with prep ``rope_pairs``.
    ``inverse=True`` rotates by the negative angle (``s → −s``): the backward pass of RoPE.
    ``rotary_cols``: how many leading columns are rotated, as a size expression (e.g. ``"Nq +
    Nkv"`` for a fused QKV projection, so the V columns pass through unchanged, as with cos = 1,
    sin = 0); default: all of src's columns. The rotated width must be a multiple of D.
    """

    op: Literal["rope"] = "rope"
    port: ClassVar = Port.TILE

    src: Name
    cos: Name
    sin: Name
    out: Name
    inverse: bool = False
    rotary_cols: SizeExpr | None = None

    def check(self, env: CheckEnv) -> None:
        contract_pairs(env, self.src, "rope")
        t = env.tile(self.src)
        width = env.cols(t.scale)
        head_dim = self._check_tables(env)
        rotated = width
        if self.rotary_cols is not None:
            rotated = env.program.size(self.rotary_cols, what="rope rotary_cols")
            if not 0 <= rotated <= width:
                raise ProgramError(
                    f"rope rotary_cols {self.rotary_cols!r} = {rotated} is outside src "
                    f"{self.src!r}'s {width} columns"
                )
        if rotated % head_dim:
            raise ProgramError(
                f"rope rotates {rotated} columns of {self.src!r}, which is not a whole number of "
                f"heads of width {head_dim} (the width of {self.cos!r})",
                hint="set rotary_cols to the Q and K columns only (e.g. 'Nq + Nkv'), or check "
                "that cos/sin are [M, head_dim]",
            )
        env.define_local(self.out, t)

    def _check_tables(self, env: CheckEnv) -> int:
        def table(name: str) -> TensorInfo:
            env.tensor(name, role="table")
            return env.program.matrix(name, role="table")

        return check_rope_tables(table, self.cos, self.sin, env.M, "rope", "one per token")

    def reference(self, env: RefEnv) -> None:
        z = env.locals[self.src]
        rotated = evaluate_size(self.rotary_cols, env.sizes) if self.rotary_cols else z.shape[1]
        cos, sin = env.load(self.cos), env.load(self.sin)
        env.locals[self.out] = rotate_pairs(z, cos, sin, rotated, inverse=self.inverse)

    def emit(self, ctx: EmitContext) -> None:
        scale: Fraction = ctx.type_of(self.src).scale
        pairs = ctx.cols(scale / 2)  # pair k of this tile: index vector over the half space
        x, y, p = f"p_{self.out}_x", f"p_{self.out}_y", f"p_{self.out}"
        ctx.split_pairs(ctx.var(self.src), scale, x, y)
        # Frequency of pair k: k mod D/2 (pairs of one head are consecutive; D = the table width).
        ctx.line(f"{p}_freq = {pairs.offs} % ({ctx.shape(self.cos, 1)} // 2)")
        cos = ctx.load_gather(self.cos, f"{p}_freq", pairs.mask, 1.0)
        sin = ctx.load_gather(self.sin, f"{p}_freq", pairs.mask, 0.0)
        if self.rotary_cols is not None:
            # Columns at or past rotary_cols (the V heads) pass through: cos = 1, sin = 0.
            limit = ctx.size(self.rotary_cols, f"rot_{self.out}")
            ctx.line(f"{p}_rot = (2 * {pairs.offs} < {limit})[None, :]")
            ctx.line(f"{p}_cos = tl.where({p}_rot, {cos}, 1.0)")
            ctx.line(f"{p}_sin = tl.where({p}_rot, {sin}, 0.0)")
            cos, sin = f"{p}_cos", f"{p}_sin"
        sign = ("+", "-") if self.inverse else ("-", "+")
        ctx.line(f"{p}_x2 = {x} * {cos} {sign[0]} {y} * {sin}")
        ctx.line(f"{p}_y2 = {y} * {cos} {sign[1]} {x} * {sin}")
        ctx.line(f"{ctx.define(self.out)} = {ctx.join_pairs(f'{p}_x2', f'{p}_y2', scale)}")
