"""Prep ``matvec``: a weight times a vector (or its row sums), the per-output-feature constants of a
LayerNorm folded into the ``nn.Linear`` after it.

``LN(x)·Wᵀ = r ⊙ (x W'ᵀ − μ ⊗ s) + c`` with ``W' = W·diag(γ)`` (prep ``fold_norm_weight``): ``s``
is the row sums of ``W'`` (``matvec`` without ``vector``) and ``c = W β`` (``matvec`` of the
LayerNorm's bias), a column vector the epilogue adds (``add_col_vector``).
"""

from __future__ import annotations

from typing import Literal

import torch

from ..base import Name, PrepStep, RunEnv
from ..checking import ProgramEnv
from ..types import TensorInfo


class MatVec(PrepStep):
    """``out[o] = Σ_i weight[o, i] · vector[i]`` (fp32, length ``out_features``); without
    ``vector``, the row sums ``Σ_i weight[o, i]``.

    ``weight`` is ``[out, in]`` and ``vector`` has length ``in``. For a LayerNorm before a GEMM:
    the row sums of the γ-folded weight feed ``acc − μ ⊗ s`` (``load_row_vector`` /
    ``load_col_vector`` + ``map``), and ``W β`` is the bias ``add_col_vector`` adds.
    """

    kind: Literal["matvec"] = "matvec"
    weight: Name
    vector: Name | None = None
    out: Name

    def check(self, env: ProgramEnv) -> None:
        w = env.matrix(self.weight, role="weight")
        if self.vector is not None:
            env.vector(self.vector, w.shape[1], role="vector", what="one value per input feature")
        env.define(self.out, TensorInfo((w.shape[0],), "float32", env.where))

    def apply(self, env: RunEnv) -> None:
        wide = torch.float64 if env.compute == torch.float64 else torch.float32
        w = env.tensors[self.weight].to(wide)
        if self.vector is None:
            env.tensors[self.out] = w.sum(dim=1)
        else:
            env.tensors[self.out] = w @ env.tensors[self.vector].to(wide)
