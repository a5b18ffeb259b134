"""Value types shared by the IR, the analysis, both executors and codegen.

Two namespaces exist in a Program:

* **program tensors** — block inputs, prep results, what steps store; described by ``TensorInfo``
  (a concrete shape at one binding of the symbolic sizes, and a dtype class);
* **epilogue values** — what lives in registers inside one ``GemmEpilogue`` (``acc`` and the
  results of epilogue ops); described by ``LocalType``: a tile, a row vector or a column vector,
  over a *column space* that is a fixed fraction of the GEMM's N (``1`` for the accumulator,
  ``1/2`` after a 2→1 pair contraction such as SwiGLU, ``2`` for a tile twice as wide, e.g. saved
  pre-activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import torch

# "act" is the run's activation dtype (float32 / float16 / bfloat16, chosen when the program runs);
# the others are fixed. A kernel casts stores to the destination pointer's element type, so the
# generated source never depends on which dtype "act" is.
DtypeClass = Literal["act", "float32", "float16", "bfloat16", "int64"]
StoreDtype = Literal["auto", "float32", "float16", "bfloat16"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
}
ACT_DTYPES = ("float32", "float16", "bfloat16")
# the activation dtypes the kernels compute in (a run in another is refused)
KERNEL_DTYPES = frozenset(TORCH_DTYPES[d] for d in ACT_DTYPES)

# The column spaces an epilogue value may live in, relative to the GEMM's N.
SCALES = (Fraction(1, 2), Fraction(1), Fraction(2))


def torch_dtype(dtype: DtypeClass | str, act: torch.dtype) -> torch.dtype:
    """Resolve a dtype class to a torch dtype, given the run's activation dtype."""
    return act if dtype in ("act", "auto") else TORCH_DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def scale_name(scale: Fraction) -> str:
    """``N``, ``N/2``, ``2N`` — how a column space is written in messages."""
    if scale == 1:
        return "N"
    if scale.denominator == 1:
        return f"{scale.numerator}N"
    return f"N/{scale.denominator}" if scale.numerator == 1 else f"{scale}N"


@dataclass(frozen=True)
class PartialsInfo:
    """A buffer of per-tile partial reductions, ``[rows, ⌈cols / BLOCK⌉]`` (one column per tile).

    The physical width depends on the tile size the producing kernel runs with, so it is fixed only
    when the program runs (``partials_shape``); ``length`` is the extent that was reduced.
    """

    kind: str  # sum | sumsq | max | lse
    axis: Literal["row", "col"]
    length: int
    producer: str  # the GemmEpilogue step that writes it


@dataclass(frozen=True)
class TensorInfo:
    """A program tensor at one binding of the block's symbolic sizes."""

    shape: tuple[int, ...]
    dtype: DtypeClass
    producer: str  # "input", "prep[i]" or "steps[i]"
    partials: PartialsInfo | None = None

    def describe(self) -> str:
        if self.partials is not None:
            p = self.partials
            return f"partials({p.kind}, axis={p.axis}) of {self.shape[0]} rows"
        return f"[{', '.join(map(str, self.shape))}] {self.dtype}"


def partials_shape(rows: int, cols: int, block: int) -> tuple[int, int]:
    """The one home of the partials shape rule: one fp32 column per tile of ``block`` columns."""
    return (rows, -(-cols // block))


@dataclass(frozen=True)
class LocalType:
    """The type of an epilogue value: a tile, a length-M row vector or a column vector."""

    kind: Literal["tile", "row", "col"]
    scale: Fraction = Fraction(1)

    def describe(self) -> str:
        if self.kind == "row":
            return "row vector [M]"
        if self.kind == "col":
            return f"column vector [{scale_name(self.scale)}]"
        return f"tile [M, {scale_name(self.scale)}]"


TILE = LocalType("tile", Fraction(1))
