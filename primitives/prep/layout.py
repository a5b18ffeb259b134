"""Weight-layout prep: make pairwise epilogues possible and fold norm weights into GEMM weights.

Weights use ``nn.Linear``'s layout ``[out_features, in_features]``; a GEMM ``x @ Wᵀ`` has one output
column per row of ``W``. Prep runs once per weight (not per call) and is not part of kernel timings.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..base import Name, PrepStep, RunEnv
from ..checking import ProgramEnv
from ..errors import ProgramError
from ..types import TensorInfo


class InterleaveRows(PrepStep):
    """Interleave the rows of two equally shaped weights: ``out[2k] = first[k]``, ``out[2k+1] =
    second[k]``.

    For ``nn.Linear`` weights ``[out, in]`` this interleaves output features, so ``x @ outᵀ`` yields
    adjacent column pairs ``(first_k, second_k)`` — e.g. ``first=w_gate, second=w_up`` gives the
    ``[g0, u0, g1, u1, …]`` layout that ``swiglu`` contracts in one fused GEMM.
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
        env.tensors[self.out] = torch.stack([a, b], dim=1).reshape(2 * a.shape[0], a.shape[1])


class FoldNormWeight(PrepStep):
    """Fold a norm weight γ into the following ``nn.Linear`` weight: ``out = weight · diag(γ)``.

    ``weight`` is ``[out, in]`` and ``gamma`` has length ``in``: ``out[o, i] = weight[o, i] *
    γ[i]``, computed in fp32 and rounded once to the weight's dtype. Then ``rmsnorm(x) @ weightᵀ ==
    diag(r) · (x @ outᵀ)``: the norm becomes ``rstd`` + ``scale_rows`` (CODA_MATH §1).
    """

    kind: Literal["fold_norm_weight"] = "fold_norm_weight"
    weight: Name
    gamma: Name
    out: Name

    def check(self, env: ProgramEnv) -> None:
        w = env.matrix(self.weight, role="weight")
        env.vector(self.gamma, w.shape[1], role="gamma", what="one value per input feature")
        env.define(self.out, TensorInfo(w.shape, w.dtype, env.where))

    def apply(self, env: RunEnv) -> None:
        w, gamma = env.tensors[self.weight], env.tensors[self.gamma]
        compute = torch.promote_types(env.compute, torch.float32)
        env.tensors[self.out] = (w.to(compute) * gamma.to(compute)[None, :]).to(w.dtype)
