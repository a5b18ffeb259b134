"""Vector family: broadcast a length-M (row) or length-N (column) vector over a tile.

Row scales are how a norm runs in the epilogue (docs/algebra.md §1): ``(diag(r)·x·diag(γ))·W =
diag(r)·((x⊙γ)·W)``, so ``scale_rows(acc, r)`` applies RMSNorm's ``r`` after the product; column
vectors are biases and per-feature scales.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, ClassVar, Literal

from ..base import EpilogueOp, Name, Port
from ..errors import ProgramError
from ..types import SCALES, LocalType

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..cute.emit import CuteEmitContext
    from ..reference import RefEnv


class _VectorOp(EpilogueOp):
    """Shared by the four vector primitives: ``out = src ∘ vector`` broadcast along ``axis``."""

    axis: ClassVar[Literal["row", "col"]]
    combine: ClassVar[Literal["*", "+"]]

    src: Name
    vector: Name
    out: Name

    def check(self, env: CheckEnv) -> None:
        t = env.tile(self.src)
        if self.axis == "row":
            env.vector(self.vector, env.M, role="vector", what="one value per row, M")
        else:
            width = env.cols(t.scale)
            env.vector(self.vector, width, role="vector", what="one value per column of src")
        env.define_local(self.out, t)

    def reference(self, env: RefEnv) -> None:
        v = env.row(self.vector) if self.axis == "row" else env.col(self.vector)
        src = env.locals[self.src]
        env.locals[self.out] = src * v if self.combine == "*" else src + v

    def emit(self, ctx: EmitContext) -> None:
        scale = ctx.type_of(self.src).scale
        v = ctx.load_row(self.vector) if self.axis == "row" else ctx.load_col(self.vector, scale)
        ctx.line(f"{ctx.define(self.out)} = {ctx.var(self.src)} {self.combine} {v}")

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        parts = ctx.parts(self.src)
        if self.axis == "col" and len(parts) != 1:
            ctx.refuse(f"{self.op} on a pair-wide tile (a 2N column vector)")
        v = ctx.vector(self.vector, self.axis)
        ctx.define(self.out, [f"({p} {self.combine} {v})" for p in parts])


class ScaleRows(_VectorOp):
    """Multiply each row i of tile ``src`` by ``vector[i]``: ``out[i, j] = src[i, j] * vector[i]``.

    ``vector`` is a program tensor of length M (one value per output row), e.g. the RMSNorm
    reciprocal ``r`` from an ``rstd`` step. This is how a norm that precedes a GEMM is applied in
    that GEMM's epilogue: ``rmsnorm(x) @ W == diag(r) · ((x ⊙ γ) @ W)``.
    """

    op: Literal["scale_rows"] = "scale_rows"
    port: ClassVar = Port.ROW
    axis: ClassVar = "row"
    combine: ClassVar = "*"


class ScaleCols(_VectorOp):
    """Multiply each column j of tile ``src`` by ``vector[j]``: ``out[i, j] = src[i, j] *
    vector[j]``.

    ``vector`` is a program tensor with one value per column of ``src`` (N columns for the
    accumulator, N/2 after ``swiglu``), e.g. a norm weight γ applied as a side output ``x ⊙ γ``.
    """

    op: Literal["scale_cols"] = "scale_cols"
    port: ClassVar = Port.COL
    axis: ClassVar = "col"
    combine: ClassVar = "*"


class AddRowVector(_VectorOp):
    """Add ``vector[i]`` to every element of row i: ``out[i, j] = src[i, j] + vector[i]``.

    ``vector`` is a program tensor of length M.
    """

    op: Literal["add_row_vector"] = "add_row_vector"
    port: ClassVar = Port.ROW
    axis: ClassVar = "row"
    combine: ClassVar = "+"


class AddColVector(_VectorOp):
    """Add ``vector[j]`` to every element of column j: ``out[i, j] = src[i, j] + vector[j]`` (a
    bias).

    ``vector`` is a program tensor with one value per column of ``src``.
    """

    op: Literal["add_col_vector"] = "add_col_vector"
    port: ClassVar = Port.COL
    axis: ClassVar = "col"
    combine: ClassVar = "+"


class LoadRowVector(EpilogueOp):
    """Bring a length-M program tensor into registers as row vector ``out`` (``out[i] =
    vector[i]``, fp32).

    Use it in ``map``/``pairwise`` expressions, where it broadcasts along each row — e.g. RMSNorm's
    ``r`` and the statistic ``c`` in the backward epilogue ``r * (acc * gamma - r * x * c)``.
    """

    op: Literal["load_row_vector"] = "load_row_vector"
    port: ClassVar = Port.ROW

    vector: Name
    out: Name

    def check(self, env: CheckEnv) -> None:
        env.vector(self.vector, env.M, role="vector", what="one value per row, M")
        env.define_local(self.out, LocalType("row"))

    def reference(self, env: RefEnv) -> None:
        env.locals[self.out] = env.row(self.vector)

    def emit(self, ctx: EmitContext) -> None:
        ctx.line(f"{ctx.define(self.out)} = {ctx.load_row(self.vector)}")

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        ctx.define(self.out, [ctx.vector(self.vector, "row")])


class LoadColVector(EpilogueOp):
    """Bring a per-column program tensor into registers as column vector ``out`` (fp32).

    ``vector`` has one value per column of a column space of this GEMM: length N (the
    accumulator's), N/2 (after a pair contraction) or 2N; ``out`` lives in that space and
    broadcasts down each column in ``map`` expressions — e.g. a norm weight γ.
    """

    op: Literal["load_col_vector"] = "load_col_vector"
    port: ClassVar = Port.COL

    vector: Name
    out: Name

    def check(self, env: CheckEnv) -> None:
        info = env.tensor(self.vector, role="vector")
        length = info.shape[0] if len(info.shape) == 1 and info.partials is None else -1
        scale = Fraction(length, env.N) if length > 0 else None
        if scale not in SCALES:
            raise ProgramError(
                f"vector {self.vector!r} is {info.describe()}; a column vector must have N/2, N "
                f"or 2N values (N = {env.N})"
            )
        env.define_local(self.out, LocalType("col", scale))

    def reference(self, env: RefEnv) -> None:
        env.locals[self.out] = env.col(self.vector)

    def emit(self, ctx: EmitContext) -> None:
        scale = ctx.type_of(self.out).scale
        ctx.line(f"{ctx.define(self.out)} = {ctx.load_col(self.vector, scale)}")

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        if ctx.scale(self.out) != 1:
            ctx.refuse(f"column vector {self.vector!r} is not N wide")
        ctx.define(self.out, [ctx.vector(self.vector, "col")])
