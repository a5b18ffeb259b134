"""The environments primitives type-check against.

``ProgramEnv`` holds the program tensors defined so far (at one binding of the symbolic sizes);
``CheckEnv`` adds, for one ``GemmEpilogue``, the GEMM's sizes and the epilogue values in registers.
Primitives raise ``ProgramError`` without a location; the analysis adds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from .errors import ProgramError, did_you_mean
from .sizes import evaluate as evaluate_size
from .types import LocalType, TensorInfo, scale_name


@dataclass
class ProgramEnv:
    """Program tensors visible at the current point of the program."""

    tensors: dict[str, TensorInfo]
    where: str = "input"  # producer label of the node being checked: "prep[0]", "steps[2]", ...
    sizes: dict[str, int] = field(default_factory=dict)  # the binding being checked

    def size(self, expr: str, *, what: str) -> int:
        """Evaluate a size expression (``"Nq + Nkv"``) at this binding."""
        return evaluate_size(expr, self.sizes, what=what)

    @property
    def inputs(self) -> set[str]:
        return {n for n, t in self.tensors.items() if t.producer == "input"}

    def tensor(self, name: str, *, role: str = "tensor") -> TensorInfo:
        if name not in self.tensors:
            raise ProgramError(
                f"{role} {name!r} is not a program tensor at this point",
                hint=did_you_mean(name, self.tensors)
                + " (a tensor can be used only after the step that produces it)",
                subject=name,
            )
        return self.tensors[name]

    def matrix(self, name: str, *, role: str) -> TensorInfo:
        info = self.tensor(name, role=role)
        if info.partials is not None or len(info.shape) != 2:
            raise ProgramError(f"{role} {name!r} must be a 2-D tensor, but it is {info.describe()}")
        return info

    def vector(self, name: str, length: int, *, role: str, what: str) -> TensorInfo:
        info = self.tensor(name, role=role)
        if info.partials is not None or info.shape != (length,):
            raise ProgramError(
                f"{role} {name!r} must be a vector of length {length} ({what}), "
                f"but it is {info.describe()}"
            )
        return info

    def define(self, name: str, info: TensorInfo) -> None:
        self.check_new(name)
        self.tensors[name] = info

    def check_new(self, name: str) -> None:
        if name in self.tensors:
            prev = self.tensors[name].producer
            what = "a block input" if prev == "input" else f"already produced by {prev}"
            raise ProgramError(
                f"tensor {name!r} is {what}",
                hint="pick a new name (program tensors are written once; gradients that add up "
                "use store(mode='accumulate'))",
            )


@dataclass
class CheckEnv:
    """One ``GemmEpilogue``: the GEMM's sizes, the program tensors, and the epilogue values."""

    program: ProgramEnv
    M: int
    N: int
    K: int
    locals: dict[str, LocalType] = field(default_factory=dict)
    writes: dict[str, TensorInfo] = field(default_factory=dict)  # tensors this kernel creates
    accumulates: set[str] = field(default_factory=set)  # existing tensors it adds into
    # every epilogue sub-tile's width (EPI_N) must be a multiple of this: an op reducing over
    # whole column segments inside a tile (``head_rmsnorm``) raises it with ``require_columns``
    column_multiple: int = 1

    def require_columns(self, multiple: int) -> None:
        """Every epilogue sub-tile must hold a multiple of ``multiple`` columns (a power of two)."""
        self.column_multiple = max(self.column_multiple, multiple)

    # -- epilogue values -------------------------------------------------------------------------
    def local(self, name: str, *, role: str = "value") -> LocalType:
        if name not in self.locals:
            hint = did_you_mean(name, self.locals)
            if name in self.program.tensors:
                hint = (
                    f"{name!r} is a program tensor, not an epilogue value: bring it into registers "
                    "with load_tile / add_tile / scale_rows / scale_cols first"
                )
            raise ProgramError(f"{role} {name!r} is not an epilogue value here", hint=hint)
        return self.locals[name]

    def tile(self, name: str, *, role: str = "src") -> LocalType:
        t = self.local(name, role=role)
        if t.kind != "tile":
            raise ProgramError(f"{role} {name!r} must be a tile, but it is a {t.describe()}")
        return t

    def define_local(self, name: str, t: LocalType) -> None:
        if name in self.locals:
            raise ProgramError(
                f"epilogue value {name!r} is already defined",
                hint="epilogue values are single-assignment: give the result a new name",
            )
        if name in self.program.tensors:
            raise ProgramError(
                f"epilogue value {name!r} would shadow the program tensor of the same name",
                hint="pick another name for the epilogue value",
            )
        self.locals[name] = t

    def cols(self, scale: Fraction) -> int:
        """Width of a column space, which must be a whole number of columns."""
        width = self.N * scale
        if width.denominator != 1:
            raise ProgramError(
                f"the GEMM's N = {self.N} is odd, so the column space {scale_name(scale)} is not "
                "whole: a pairwise op needs an even number of columns",
                hint="pairs are adjacent columns (2k, 2k+1); make the GEMM's output width even",
            )
        return int(width)

    # -- program tensors -------------------------------------------------------------------------
    # Reads see only tensors that exist before this kernel runs: a tile cannot read what other
    # tiles of the same kernel write. New tensors become visible to the steps after this one.
    def tensor(self, name: str, *, role: str = "tensor") -> TensorInfo:
        if name in self.writes:
            raise ProgramError(
                f"{role} {name!r} is written by this same kernel, which cannot also read it",
                hint="read it in a later step",
            )
        return self.program.tensor(name, role=role)

    def vector(self, name: str, length: int, *, role: str, what: str) -> TensorInfo:
        self.tensor(name, role=role)
        return self.program.vector(name, length, role=role, what=what)

    def define_tensor(self, name: str, info: TensorInfo) -> None:
        """A sink creates program tensor ``name`` (visible after this step)."""
        if name in self.writes or name in self.accumulates:
            raise ProgramError(f"tensor {name!r} is written twice by this kernel")
        self.program.check_new(name)
        self.writes[name] = info

    def matching_tile_tensor(
        self, name: str, *, role: str = "tensor"
    ) -> tuple[TensorInfo, Fraction]:
        """A 2-D tensor read tile by tile: M rows and N/2, N or 2N columns; returns its space."""
        self.tensor(name, role=role)
        info = self.program.matrix(name, role=role)
        rows, cols = info.shape
        if rows != self.M:
            raise ProgramError(
                f"{role} {name!r} has {rows} rows but the GEMM's output has M = {self.M}"
            )
        scale = Fraction(cols, self.N)
        if scale not in (Fraction(1, 2), Fraction(1), Fraction(2)):
            raise ProgramError(
                f"{role} {name!r} has {cols} columns; a tile tensor must have N/2, N or 2N columns "
                f"(N = {self.N})"
            )
        return info, scale
