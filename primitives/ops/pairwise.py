"""Pairwise family: maps over adjacent column pairs ``(2k, 2k+1)`` of a tile.

A pairwise map needs both members of a pair in one tile (CODA_MATH §2): interleave the two weights'
output features (prep ``interleave_rows``) so one GEMM produces ``[g0, u0, g1, u1, …]``, then
contract each pair in the epilogue. The result lives in a column space half as wide.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from ..base import EpilogueOp, Name, Port
from ..errors import ProgramError
from ..types import SCALES, LocalType

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..reference import RefEnv


def contract_pairs(env: CheckEnv, src: str, op: str) -> LocalType:
    """Type of a 2→1 pair contraction of tile ``src``: same rows, half the columns."""
    t = env.tile(src)
    half = t.scale / 2
    if half not in SCALES:
        raise ProgramError(
            f"{op} of {src!r} ({t.describe()}) would leave the supported column spaces"
        )
    width = env.cols(t.scale)
    if width % 2:
        raise ProgramError(
            f"{op} needs adjacent column pairs, but {src!r} has an odd width {width}",
            hint="pairs are columns (2k, 2k+1): the width must be even",
        )
    return LocalType("tile", half)


class Swiglu(EpilogueOp):
    """SwiGLU on adjacent column pairs: ``out[:, k] = silu(src[:, 2k]) * src[:, 2k+1]``.

    Column 2k of ``src`` is the gate ``g_k`` and column 2k+1 the up projection ``u_k`` — the layout
    ``interleave_rows(first=w_gate, second=w_up)`` gives a fused gate/up GEMM. ``out`` has half the
    columns of ``src`` (N/2 for the accumulator); store it to an ``[M, N/2]`` tensor.
    """

    op: Literal["swiglu"] = "swiglu"
    port: ClassVar = Port.APPLY

    src: Name
    out: Name

    def check(self, env: CheckEnv) -> None:
        env.define_local(self.out, contract_pairs(env, self.src, "swiglu"))

    def reference(self, env: RefEnv) -> None:
        z = env.locals[self.src]
        gate, up = z[:, 0::2], z[:, 1::2]
        env.locals[self.out] = torch.nn.functional.silu(gate) * up

    def emit(self, ctx: EmitContext) -> None:
        scale: Fraction = ctx.type_of(self.src).scale
        gate, up = f"p_{self.out}_gate", f"p_{self.out}_up"
        ctx.split_pairs(ctx.var(self.src), scale, gate, up)
        ctx.line(f"{ctx.define(self.out)} = {gate} * tl.sigmoid({gate}) * {up}")
