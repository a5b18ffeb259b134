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
from typing import TYPE_CHECKING, Any, ClassVar, Literal

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
    z: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotated: int,
    *,
    inverse: bool,
    full_tables: bool = False,
) -> torch.Tensor:
    """RoPE on adjacent column pairs of ``z`` in PyTorch (the references of ``rope``,
    ``rope_full`` and aux ``rope_rows``): pair k uses column ``p = k mod D/2`` of the tables
    (``full_tables``: its second member column ``p + D/2``); columns from ``rotated`` on pass
    through; ``inverse`` rotates by the negative angle."""
    x, y = z[:, 0::2], z[:, 1::2]
    pair = torch.arange(x.shape[1], device=z.device)
    half = cos.shape[1] // 2
    freq = pair % half
    keep = (2 * pair < rotated)[None, :]

    def angle(column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(keep, cos[:, column], 1.0), torch.where(keep, sin[:, column], 0.0)

    c, s = angle(freq)
    c2, s2 = angle(freq + half) if full_tables else (c, s)
    if inverse:
        s, s2 = -s, -s2
    return interleave(x * c - y * s, y * c2 + x * s2)


class Rope(EpilogueOp):
    """Rotate adjacent column pairs of tile ``src`` by per-token angles (RoPE), 2→2.

    ``cos``/``sin``: Hugging Face's per-token tables ``[M, D]`` (D = head_dim, two equal halves).
    Pair k = columns ``(2k, 2k+1)`` of head ``2k // D`` uses ``c, s = cos[i, p], sin[i, p]`` with
    ``p = k mod D/2``: ``out[:, 2k] = x·c − y·s``, ``out[:, 2k+1] = y·c + x·s`` — Hugging Face's
    ``apply_rotary_pos_emb`` on weights whose rows prep ``rope_pairs`` permuted. ``inverse``:
    the negative angle (RoPE's backward). ``rotary_cols``: leading columns rotated, a size
    expression (``"Nq + Nkv"`` leaves a fused QKV's V as is); default all; a multiple of D.
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
        check_rotation(self, env)

    def reference(self, env: RefEnv) -> None:
        reference_rotation(self, env, inverse=self.inverse, full_tables=False)

    def emit(self, ctx: EmitContext) -> None:
        emit_rotation(self, ctx, inverse=self.inverse, full_tables=False)


# -- shared with ``rope_full`` (its ``op`` is any node with src, cos, sin, out, rotary_cols) ------
def check_rotation(op: Any, env: CheckEnv) -> None:
    """Types of a pair rotation of tile ``op.src`` by tables ``op.cos``/``op.sin``."""
    contract_pairs(env, op.src, op.op)
    t = env.tile(op.src)
    width = env.cols(t.scale)

    def table(name: str) -> TensorInfo:
        env.tensor(name, role="table")
        return env.program.matrix(name, role="table")

    head_dim = check_rope_tables(table, op.cos, op.sin, env.M, op.op, "one per token")
    rotated = width
    if op.rotary_cols is not None:
        rotated = env.program.size(op.rotary_cols, what=f"{op.op} rotary_cols")
        if not 0 <= rotated <= width:
            raise ProgramError(
                f"{op.op} rotary_cols {op.rotary_cols!r} = {rotated} is outside src "
                f"{op.src!r}'s {width} columns"
            )
    if rotated % head_dim:
        raise ProgramError(
            f"{op.op} rotates {rotated} columns of {op.src!r}, which is not a whole number of "
            f"heads of width {head_dim} (the width of {op.cos!r})",
            hint="set rotary_cols to the Q and K columns only (e.g. 'Nq + Nkv'), or check "
            "that cos/sin are [M, head_dim]",
        )
    env.define_local(op.out, t)


def reference_rotation(op: Any, env: RefEnv, *, inverse: bool, full_tables: bool) -> None:
    """``rotate_pairs`` of ``op.src`` into ``op.out``."""
    z = env.locals[op.src]
    rotated = evaluate_size(op.rotary_cols, env.sizes) if op.rotary_cols else z.shape[1]
    cos, sin = env.load(op.cos), env.load(op.sin)
    env.locals[op.out] = rotate_pairs(
        z, cos, sin, rotated, inverse=inverse, full_tables=full_tables
    )


def emit_rotation(op: Any, ctx: EmitContext, *, inverse: bool, full_tables: bool) -> None:
    """The rotation of ``op.src``'s pairs in Triton (``full_tables``: the second member of a
    pair reads its own angle, table column ``p + D/2``)."""
    scale: Fraction = ctx.type_of(op.src).scale
    pairs = ctx.cols(scale / 2)  # pair k of this tile: index vector over the half space
    x, y, p = f"p_{op.out}_x", f"p_{op.out}_y", f"p_{op.out}"
    ctx.split_pairs(ctx.var(op.src), scale, x, y)
    # Frequency of pair k: k mod D/2 (pairs of one head are consecutive; D = the table width).
    ctx.line(f"{p}_freq = {pairs.offs} % ({ctx.shape(op.cos, 1)} // 2)")
    angles = [
        (
            ctx.load_gather(op.cos, f"{p}_freq", pairs.mask, 1.0),
            ctx.load_gather(op.sin, f"{p}_freq", pairs.mask, 0.0),
        )
    ]
    if full_tables:
        ctx.line(f"{p}_freq2 = {p}_freq + {ctx.shape(op.cos, 1)} // 2")
        cos2 = ctx.load_gather(op.cos, f"{p}_freq2", pairs.mask, 1.0, tag="2")
        angles.append((cos2, ctx.load_gather(op.sin, f"{p}_freq2", pairs.mask, 0.0, tag="2")))
    if op.rotary_cols is not None:
        # Columns at or past rotary_cols (the V heads) pass through: cos = 1, sin = 0.
        limit = ctx.size(op.rotary_cols, f"rot_{op.out}")
        ctx.line(f"{p}_rot = (2 * {pairs.offs} < {limit})[None, :]")
        for k, (cos, sin) in enumerate(list(angles)):
            tag = "2" if k else ""
            ctx.line(f"{p}_cos{tag} = tl.where({p}_rot, {cos}, 1.0)")
            ctx.line(f"{p}_sin{tag} = tl.where({p}_rot, {sin}, 0.0)")
            angles[k] = (f"{p}_cos{tag}", f"{p}_sin{tag}")
    (cos, sin), (cos2, sin2) = angles[0], angles[-1]
    sign = ("+", "-") if inverse else ("-", "+")
    ctx.line(f"{p}_x2 = {x} * {cos} {sign[0]} {y} * {sin}")
    ctx.line(f"{p}_y2 = {y} * {cos2} {sign[1]} {x} * {sin2}")
    ctx.line(f"{ctx.define(op.out)} = {ctx.join_pairs(f'{p}_x2', f'{p}_y2', scale)}")
