"""Prep ``fold_norm_weight``: fold an RMSNorm's γ into the ``nn.Linear`` weight that follows it.

In training this runs in every forward and backward call (the weights change every step), over
weights as large as the LM head's: on the GPU it is one Triton pass that reads the weight once and
writes it once, vectorized along rows (``prep/rows.py``) — PyTorch's broadcasting multiply
(``w * γ[None, :]``) takes a slower, unvectorized path for the broadcast operand. After
``rope_pairs`` / ``concat_rows`` the runtime folds in the same pass that gathers and stacks the
rows (``prep/fusion.py``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from ..base import Name, PrepStep, RunEnv
from ..checking import ProgramEnv
from ..types import TensorInfo
from .rows import scale_columns


class FoldNormWeight(PrepStep):
    """Fold a norm weight γ into the following ``nn.Linear`` weight: ``out = weight · diag(offset +
    γ)``.

    ``weight`` is ``[out, in]`` and ``gamma`` has length ``in``: ``out[o, i] = weight[o, i] *
    (offset + γ[i])``, computed in fp32 and rounded once to the weight's dtype. Then ``rmsnorm(x)
    @ weightᵀ == diag(r) · (x @ outᵀ)``: the norm becomes ``rstd`` + ``scale_rows``
    (docs/algebra.md §1). ``offset`` is 0 for Llama's γ and 1 for Gemma's ``x̂ · (1 + γ)``.
    """

    kind: Literal["fold_norm_weight"] = "fold_norm_weight"
    weight: Name
    gamma: Name
    out: Name
    offset: float = Field(0.0, allow_inf_nan=False)

    @model_serializer(mode="wrap")
    def _omit_zero_offset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A fold without an offset serializes as before the field existed (its canonical JSON,
        hence the Program's hash, does not change)."""
        data = handler(self)
        if not self.offset:
            data.pop("offset", None)
        return data

    def check(self, env: ProgramEnv) -> None:
        w = env.matrix(self.weight, role="weight")
        env.vector(self.gamma, w.shape[1], role="gamma", what="one value per input feature")
        env.define(self.out, TensorInfo(w.shape, w.dtype, env.where))

    def apply(self, env: RunEnv) -> None:
        w, gamma = env.tensors[self.weight], env.tensors[self.gamma]
        env.tensors[self.out] = fold_columns(
            w, offset_gamma(gamma, self.offset, env.compute), env.compute
        )


def offset_gamma(gamma: torch.Tensor, offset: float, compute: torch.dtype) -> torch.Tensor:
    """The column scale ``offset + γ``: γ itself when ``offset`` is 0, else formed in fp32 (float64
    for the exact reference executor) so the sum is not rounded to γ's 16-bit dtype before the
    fold multiplies by it."""
    if not offset:
        return gamma
    wide = torch.float64 if compute == torch.float64 else torch.float32
    return gamma.to(wide) + offset


def fold_columns(w: torch.Tensor, gamma: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """``w · diag(γ)`` in ``w``'s dtype: exact in float64 for the reference executor
    (``compute=float64``), else each product formed in fp32 and rounded once."""
    if compute == torch.float64:  # the exact reference executor
        return (w.double() * gamma.double()[None, :]).to(w.dtype)
    if w.is_cuda:
        # the fp32 formula of the last branch, bit for bit, in one pass (every training step)
        return scale_columns(w, gamma)
    if w.dtype in _HALF and gamma.dtype == w.dtype:
        # PyTorch multiplies 16-bit tensors in fp32 and rounds once, and the product of two
        # 16-bit floats is exact in fp32: the same bits as the fp32 formula, without fp32 copies
        return w * gamma[None, :]
    return (w.float() * gamma.float()[None, :]).to(w.dtype)


_HALF = (torch.bfloat16, torch.float16)
