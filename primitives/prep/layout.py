"""Weight-layout prep: make pairwise epilogues possible and fuse projections (γ folding: prep
``fold_norm_weight``).

Weights use ``nn.Linear``'s layout ``[out_features, in_features]``; a GEMM ``x @ Wᵀ`` has one output
column per row of ``W``. Prep runs at the start of each Program call, before its GEMMs: in training
the weights change every step, so it is part of every step's time.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..base import Name, PrepStep, RunEnv
from ..checking import ProgramEnv
from ..errors import ProgramError
from ..sizes import SizeExpr
from ..sizes import evaluate as evaluate_size
from ..types import TensorInfo


class InterleaveRows(PrepStep):
    """Interleave the rows of two equally shaped weights: ``out[2k] = first[k]``, ``out[2k+1] =
    second[k]``.

    For ``nn.Linear`` weights ``[out, in]`` this interleaves output features, so ``x @ outᵀ`` yields
    adjacent column pairs ``(first_k, second_k)`` — e.g. ``first=w_gate, second=w_up`` gives the
    ``[g0, u0, g1, u1, …]`` layout that ``swiglu`` contracts in one fused GEMM.

    Free when they are ``w[0::2]`` and ``w[1::2]`` of one buffer (``coda.export``'s packed
    gate/up weight): the output is that buffer.
    """

    kind: Literal["interleave_rows"] = "interleave_rows"
    first: Name
    second: Name
    out: Name

    def check(self, env: ProgramEnv) -> None:
        a = env.matrix(self.first, role="first")
        b = env.matrix(self.second, role="second")
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ProgramError(
                f"interleave_rows needs equally shaped weights, but {self.first!r} is "
                f"{a.describe()} and {self.second!r} is {b.describe()}"
            )
        env.define(self.out, TensorInfo((2 * a.shape[0], a.shape[1]), a.dtype, env.where))

    def apply(self, env: RunEnv) -> None:
        a, b = env.tensors[self.first], env.tensors[self.second]
        packed = interleaved_buffer(a, b)
        env.tensors[self.out] = interleave_rows(a, b) if packed is None else packed


def interleave_rows(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """A new ``[2r, c]`` tensor: ``first``'s rows at even indices, ``second``'s at odd."""
    return torch.stack([first, second], dim=1).reshape(2 * first.shape[0], first.shape[1])


def interleaved_buffer(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """The row-major ``[2r, c]`` tensor whose even rows are ``first`` and odd rows ``second``, as a
    view of their shared storage — or None when they are not laid out that way."""
    if first.dim() != 2 or first.shape != second.shape or first.dtype != second.dtype:
        return None
    rows, cols = first.shape
    offset = first.storage_offset()
    if (
        first.device != second.device
        or first.stride() != (2 * cols, 1)
        or second.stride() != (2 * cols, 1)
        or second.storage_offset() != offset + cols
    ):
        return None
    # one storage: views of one base tensor (a packed weight's two row views, on every training
    # step: no storage looked up), or one memory
    base = first._base
    if (base is None or base is not second._base) and (
        first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    ):
        return None
    return first.as_strided((2 * rows, cols), (cols, 1), offset)


def pair_rows(
    w: torch.Tensor, head_dim: int, rows: int | None = None, inverse: bool = False
) -> torch.Tensor:
    """``w`` (a weight ``[rows, …]`` or a vector) with each head of ``head_dim`` rows in RoPE-pair
    order: new row ``h·D + 2p + e`` is old row ``h·D + e·D/2 + p`` for e ∈ {0, 1}, p < D/2 — or,
    with ``inverse``, back to rotate-half order. Only the first ``rows`` rows (all by default)
    are permuted; the rest are kept.

    The rows reshaped, transposed and reshaped back (a new tensor; with heads of 2 rows, whose
    order is the identity, possibly a view of ``w``): no index tensor, so nothing is built per
    shape, kept per device, or copied from host memory (the row kernel and ``unpair_rows``'s
    kernel compute the same order from ``head_dim``)."""
    rows = w.shape[0] if rows is None else rows
    head = w[:rows]
    heads, half = rows // head_dim, head_dim // 2
    split = (heads, half, 2) if inverse else (heads, 2, half)
    permuted = head.reshape(*split, *w.shape[1:]).transpose(1, 2).reshape(head.shape)
    return permuted if rows == w.shape[0] else torch.cat([permuted, w[rows:]])


class RopePairs(PrepStep):
    """Permute an ``nn.Linear`` weight's rows (output features) per head from Hugging Face's
    rotate-half order to adjacent pairs, for ``rope`` in the epilogue.

    Within each head of ``head_dim`` rows (a size expression, e.g. ``"D"``), new row ``2p + e``
    is old row ``e·D/2 + p``: the partners of rotate-half (p and p + D/2) become output columns
    ``(2p, 2p+1)`` of ``x @ outᵀ``. Apply it to the Q and K projection weights only (V is not
    rotated). The GEMM's output is then Hugging Face's in that same per-head order. Vectors
    (a bias, a norm weight) are permuted the same way.
    """

    kind: Literal["rope_pairs"] = "rope_pairs"
    weight: Name
    head_dim: SizeExpr
    out: Name

    def check(self, env: ProgramEnv) -> None:
        w = env.tensor(self.weight, role="weight")
        if len(w.shape) not in (1, 2) or w.partials is not None:
            raise ProgramError(
                f"rope_pairs: weight {self.weight!r} is {w.describe()}; it must be a weight "
                "[heads·head_dim, d] or a vector [heads·head_dim]"
            )
        head_dim = env.size(self.head_dim, what="rope_pairs head_dim")
        if head_dim <= 0 or head_dim % 2 or w.shape[0] % head_dim:
            raise ProgramError(
                f"rope_pairs: weight {self.weight!r} has {w.shape[0]} rows, which is not a whole "
                f"number of heads of even width head_dim = {head_dim}",
                hint="pass the Q or K projection weight [heads·head_dim, d] (or its bias) and "
                "the head width",
            )
        env.define(self.out, TensorInfo(w.shape, w.dtype, env.where))

    def apply(self, env: RunEnv) -> None:
        env.tensors[self.out] = pair_rows(env.tensors[self.weight], self.head_width(env))

    def head_width(self, env: RunEnv) -> int:
        """``head_dim`` at this call's sizes."""
        return evaluate_size(self.head_dim, env.sizes)


class ConcatRows(PrepStep):
    """Stack weights along their rows (output features): ``out = cat(tensors, dim=0)``.

    For ``nn.Linear`` weights ``[out_i, in]`` this fuses projections of one input into one GEMM,
    e.g. ``[w_q; w_k; w_v]`` for a fused QKV projection whose output columns are q | k | v.
    """

    kind: Literal["concat_rows"] = "concat_rows"
    tensors: list[Name] = Field(min_length=2, max_length=8)
    out: Name

    def check(self, env: ProgramEnv) -> None:
        infos = [env.matrix(name, role="tensor") for name in self.tensors]
        first = infos[0]
        for name, info in zip(self.tensors, infos, strict=True):
            if info.shape[1] != first.shape[1] or info.dtype != first.dtype:
                raise ProgramError(
                    f"concat_rows needs equally wide tensors of one dtype, but "
                    f"{self.tensors[0]!r} is {first.describe()} and {name!r} is {info.describe()}"
                )
        rows = sum(info.shape[0] for info in infos)
        env.define(self.out, TensorInfo((rows, first.shape[1]), first.dtype, env.where))

    def apply(self, env: RunEnv) -> None:
        env.tensors[self.out] = torch.cat([env.tensors[n] for n in self.tensors], dim=0)
