"""Map family: an elementwise expression over epilogue values, in fp32."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import field_validator

from .. import expr as expr_lang
from ..base import EpilogueOp, Name, Port
from ..errors import ProgramError
from ..types import LocalType

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..cute.emit import CuteEmitContext
    from ..reference import RefEnv


class Map(EpilogueOp):
    """Compute ``out`` elementwise from epilogue values with a small expression, in fp32.

    ``expr`` uses epilogue value names (``acc`` and results of earlier ops), numbers, ``+ - * /``,
    unary ``-``, ``x ** k`` (integer k, |k| ≤ 4) and the functions exp, log, sigmoid, silu, tanh,
    erf, sqrt, rsqrt, abs, min(a, b), max(a, b), where(a > b, x, y). Tiles, row vectors and column
    vectors broadcast like ``[M, W]``, ``[M, 1]`` and ``[1, W]`` tensors; all tiles and column
    vectors named in one expression must share a column space. Example: ``{"op": "map", "expr":
    "silu(g) * u", "out": "a"}``.
    """

    op: Literal["map"] = "map"
    port: ClassVar = Port.APPLY

    expr: str
    out: Name

    @field_validator("expr")
    @classmethod
    def _parses(cls, value: str) -> str:
        # Raises ProgramError (a ValueError) naming the offending construct; the Program keeps the
        # expression re-printed from its parsed tree, never the submitted text.
        return expr_lang.canonical(value)

    def result_type(self, env: CheckEnv) -> LocalType:
        parsed = expr_lang.parse(self.expr)
        names = sorted(parsed.variables())
        if not names:
            raise ProgramError(f"map expression {self.expr!r} reads no epilogue value")
        types = {n: env.local(n, role="expression name") for n in names}
        scales = {t.scale for t in types.values() if t.kind != "row"}
        if len(scales) > 1:
            listing = ", ".join(f"{n}: {t.describe()}" for n, t in types.items())
            raise ProgramError(
                f"map expression {self.expr!r} mixes column spaces ({listing})",
                hint="values of different widths cannot be combined elementwise; "
                "contract pairs first (swiglu) or load a matching tile",
            )
        kinds = {t.kind for t in types.values()}
        scale = scales.pop() if scales else types[names[0]].scale
        if "tile" in kinds or kinds == {"row", "col"}:
            return LocalType("tile", scale)
        return LocalType(kinds.pop(), scale)

    def check(self, env: CheckEnv) -> None:
        env.define_local(self.out, self.result_type(env))

    def reference(self, env: RefEnv) -> None:
        parsed = expr_lang.parse(self.expr)
        env.locals[self.out] = parsed.evaluate(env.locals.__getitem__, env.compute)

    def emit(self, ctx: EmitContext) -> None:
        code = expr_lang.parse(self.expr).to_triton(ctx.var)
        ctx.line(f"{ctx.define(self.out)} = {code}")

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        # a pair-wide result is the expression on each member (row vectors shared by both)
        parts = [
            ctx.expression(self.expr, lambda n, k=k: ctx.part(n, k))
            for k in range(ctx.width(self.out))
        ]
        ctx.define(self.out, parts)
