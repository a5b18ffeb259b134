"""Pairwise family: maps over adjacent column pairs ``(2k, 2k+1)`` of a tile.

A pairwise map needs both members of a pair in one tile (docs/algebra.md §2): interleave the two
weights' output features (prep ``interleave_rows``) so one GEMM produces ``[g0, u0, g1, u1, …]``,
then contract each pair in the epilogue (``swiglu``: 2→1, the result lives in a column space half as
wide). ``pairwise`` writes any 2→1 or 2→2 map in the expression language (SwiGLU's backward is one),
``split_pairs``/``join_pairs`` move between the interleaved and the two half-width tiles. RoPE, the
2→2 rotation, lives in ``rope.py``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from pydantic import field_validator

from .. import expr as expr_lang
from ..base import EpilogueOp, Name, Port
from ..errors import ProgramError
from ..types import SCALES, LocalType

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..cute.emit import CuteEmitContext
    from ..reference import RefEnv


def _pair_members(ctx: CuteEmitContext, src: str, op: str) -> list[str]:
    """The two members of the pair of ``src`` at the CuTe loop's element (a step contracting
    the accumulator's own pairs loops over pairs, so ``src`` is two scalars there too)."""
    parts = ctx.parts(src)
    if len(parts) != 2:
        ctx.refuse(f"{op} of {src!r}, which is one scalar at the loop's element, not a pair")
    return parts


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

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        gate, up = _pair_members(ctx, self.src, self.op)
        ctx.define(self.out, [f"(F.silu({gate}) * {up})"])


# -- pair plumbing ---------------------------------------------------------------------------------
PAIR_NAMES = ("x0", "x1")


def _check_pair_expression(env: CheckEnv, expr: str, half: LocalType, field: str) -> None:
    """Names in a pairwise expression: x0/x1, pair-wide tiles or column vectors, or row vectors."""
    parsed = expr_lang.parse(expr)
    names = parsed.variables()
    if not names & set(PAIR_NAMES):
        raise ProgramError(
            f"pairwise {field} {expr!r} reads neither x0 nor x1",
            hint="x0 = src[:, 2k] and x1 = src[:, 2k+1] are the members of each pair",
        )
    for name in sorted(names - set(PAIR_NAMES)):
        t = env.local(name, role="expression name")
        if t.kind != "row" and t.scale != half.scale:
            raise ProgramError(
                f"pairwise {field} {expr!r} reads {name!r} ({t.describe()}), but values next to a "
                f"pair must be pair-wide ({half.describe()}) or row vectors",
                hint="e.g. the accumulator of a GEMM whose N is half the width of src",
            )


def _pair_values(env: RefEnv, src: str) -> dict[str, torch.Tensor]:
    z = env.locals[src]
    return {**env.locals, "x0": z[:, 0::2], "x1": z[:, 1::2]}


def interleave(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``out[:, 2k] = first[:, k]``, ``out[:, 2k+1] = second[:, k]``."""
    rows, half = first.shape
    return torch.stack([first, second], dim=2).reshape(rows, 2 * half)


class Pairwise(EpilogueOp):
    """Map each adjacent column pair of tile ``src`` through expressions: 2→1 or 2→2.

    In each expression (``map``'s language) ``x0 = src[:, 2k]``, ``x1 = src[:, 2k+1]``; other
    names are pair-wide epilogue values (half of src's columns, indexed by k) or row vectors.
    With ``expr0`` alone: 2→1, ``out[:, k] = expr0`` (half src's width); with ``expr1`` too: 2→2,
    ``out[:, 2k] = expr0``, ``out[:, 2k+1] = expr1``. SwiGLU backward from a saved ``z = [g0, u0,
    g1, u1, ...]`` (2N wide, load_tile) and ``da = acc`` (N wide): ``{"op": "pairwise", "src":
    "z", "expr0": "acc * x1 * sigmoid(x0) * (1 + x0 * (1 - sigmoid(x0)))", "expr1": "acc *
    silu(x0)", "out": "dz"}``.
    """

    op: Literal["pairwise"] = "pairwise"
    port: ClassVar = Port.APPLY

    src: Name
    expr0: str
    expr1: str | None = None
    out: Name

    @field_validator("expr0", "expr1")
    @classmethod
    def _parses(cls, value: str | None) -> str | None:
        """The expression re-printed from its parsed tree (``Map._parses``)."""
        return None if value is None else expr_lang.canonical(value)

    def check(self, env: CheckEnv) -> None:
        half = contract_pairs(env, self.src, "pairwise")
        for name in PAIR_NAMES:
            if name in env.locals:
                raise ProgramError(
                    f"epilogue value {name!r} clashes with the pair member of the same name",
                    hint="x0 and x1 are reserved inside pairwise expressions; rename that value",
                )
        _check_pair_expression(env, self.expr0, half, "expr0")
        if self.expr1 is None:
            env.define_local(self.out, half)
            return
        _check_pair_expression(env, self.expr1, half, "expr1")
        env.define_local(self.out, env.tile(self.src))

    def reference(self, env: RefEnv) -> None:
        values = _pair_values(env, self.src)
        first = expr_lang.parse(self.expr0).evaluate(values.__getitem__, env.compute)
        if self.expr1 is None:
            env.locals[self.out] = first
            return
        second = expr_lang.parse(self.expr1).evaluate(values.__getitem__, env.compute)
        env.locals[self.out] = interleave(first, second)

    def emit(self, ctx: EmitContext) -> None:
        scale: Fraction = ctx.type_of(self.src).scale
        x0, x1 = f"p_{self.out}_x0", f"p_{self.out}_x1"
        ctx.split_pairs(ctx.var(self.src), scale, x0, x1)
        names = {"x0": x0, "x1": x1}
        var = lambda n: names.get(n) or ctx.var(n)  # noqa: E731
        first = expr_lang.parse(self.expr0).to_triton(var)
        if self.expr1 is None:
            ctx.line(f"{ctx.define(self.out)} = {first}")
            return
        second = expr_lang.parse(self.expr1).to_triton(var)
        ctx.line(f"p_{self.out}_0 = {first}")
        ctx.line(f"p_{self.out}_1 = {second}")
        joined = ctx.join_pairs(f"p_{self.out}_0", f"p_{self.out}_1", scale)
        ctx.line(f"{ctx.define(self.out)} = {joined}")

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        x0, x1 = _pair_members(ctx, self.src, self.op)
        names = {"x0": x0, "x1": x1}
        var = lambda n: names.get(n) or ctx.parts(n)[0]  # noqa: E731  (others are pair-wide)
        exprs = [self.expr0] if self.expr1 is None else [self.expr0, self.expr1]
        ctx.define(self.out, [ctx.expression(e, var) for e in exprs])


class SplitPairs(EpilogueOp):
    """Split tile ``src`` into its pair members: ``first = src[:, 0::2]``, ``second =
    src[:, 1::2]``.

    Both results have half of src's columns (e.g. the gate and up halves of an interleaved
    ``[g0, u0, g1, u1, ...]`` accumulator, to store them separately or use them in a map).
    """

    op: Literal["split_pairs"] = "split_pairs"
    port: ClassVar = Port.APPLY

    src: Name
    first: Name
    second: Name

    def check(self, env: CheckEnv) -> None:
        half = contract_pairs(env, self.src, "split_pairs")
        env.define_local(self.first, half)
        env.define_local(self.second, half)

    def reference(self, env: RefEnv) -> None:
        z = env.locals[self.src]
        env.locals[self.first], env.locals[self.second] = z[:, 0::2], z[:, 1::2]

    def emit(self, ctx: EmitContext) -> None:
        scale: Fraction = ctx.type_of(self.src).scale
        first, second = ctx.define(self.first), ctx.define(self.second)
        ctx.split_pairs(ctx.var(self.src), scale, first, second)

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        first, second = _pair_members(ctx, self.src, self.op)
        ctx.define(self.first, [first])
        ctx.define(self.second, [second])


class JoinPairs(EpilogueOp):
    """Interleave two equally wide tiles column by column: ``out[:, 2k] = first[:, k]``,
    ``out[:, 2k+1] = second[:, k]``.

    ``out`` is twice as wide as ``first`` (e.g. ``[dg, du]`` gradients joined into the
    interleaved layout of the fused gate/up weight).
    """

    op: Literal["join_pairs"] = "join_pairs"
    port: ClassVar = Port.APPLY

    first: Name
    second: Name
    out: Name

    def check(self, env: CheckEnv) -> None:
        a = env.tile(self.first, role="first")
        b = env.tile(self.second, role="second")
        if a.scale != b.scale:
            raise ProgramError(
                f"join_pairs needs equally wide tiles, but {self.first!r} is {a.describe()} and "
                f"{self.second!r} is {b.describe()}"
            )
        if a.scale * 2 not in SCALES:
            raise ProgramError(
                f"join_pairs of {a.describe()} tiles would leave the supported column spaces "
                "(N/2, N, 2N)"
            )
        env.define_local(self.out, LocalType("tile", a.scale * 2))

    def reference(self, env: RefEnv) -> None:
        env.locals[self.out] = interleave(env.locals[self.first], env.locals[self.second])

    def emit(self, ctx: EmitContext) -> None:
        scale = ctx.type_of(self.first).scale * 2
        joined = ctx.join_pairs(ctx.var(self.first), ctx.var(self.second), scale)
        ctx.line(f"{ctx.define(self.out)} = {joined}")

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        first, second = ctx.parts(self.first), ctx.parts(self.second)
        if len(first) != 1 or ctx.width(self.out) != 2:
            ctx.refuse("join_pairs of tiles not as wide as the accumulator")
        ctx.define(self.out, [first[0], second[0]])
