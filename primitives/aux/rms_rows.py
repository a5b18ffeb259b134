"""Aux ``rms_rows``: an RMSNorm of a whole tensor, statistic and all, in one launch — a pre-norm
written as rows.

Where the norm's output ``h = r ⊙ x ⊙ (offset + γ)`` is written once and the GEMMs after it read
``h`` with their weights as they are (instead of γ folded into each weight: cheaper below a few
times the weights' rows in tokens, docs/algebra.md §1), and no epilogue produced ``x`` (a block's
input), nothing has summed ``x``'s squares yet. Aux ``rstd`` then ``norm_rows`` would read every
row twice in two launches; this step reads it twice in one: a first pass per row block sums the
squares and forms ``r = rsqrt(mean_j x² + eps)`` — summed exactly as aux ``rstd`` sums them (the
same chunk width), so ``r`` and ``h`` are the bits of those two steps — and the second writes
``h``, rounded once. ``stat_out`` keeps ``r`` (fp32, one per row) for a backward that reads it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from ..base import AuxStep, Name, RunEnv
from ..checking import ProgramEnv
from ..errors import ProgramError
from ..types import TensorInfo
from .norm_rows import launch_rows


class RmsRows(AuxStep):
    """``out = src · r · (offset + weight)``, ``r = rsqrt(mean_j src² + eps)`` (fp32, kept in
    ``stat_out``): aux ``rstd`` + ``norm_rows`` in one launch, bit for bit."""

    kind: Literal["rms_rows"] = "rms_rows"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    src: Name
    eps: float = Field(1e-6, gt=0, le=1)
    weight: Name
    offset: float = Field(0.0, allow_inf_nan=False)
    out: Name
    stat_out: Name | None = None

    def check(self, env: ProgramEnv) -> None:
        info = env.matrix(self.src, role="src")
        rows, cols = info.shape
        env.vector(self.weight, cols, role="weight", what=f"one scale per column of {self.src!r}")
        if self.stat_out == self.out:
            raise ProgramError(
                f"rms_rows writes out and stat_out to the same name {self.out!r}",
                hint="give the normalised tensor and its row reciprocals different names",
            )
        env.define(self.out, TensorInfo(info.shape, info.dtype, env.where))
        if self.stat_out is not None:
            env.define(self.stat_out, TensorInfo((rows,), "float32", env.where))

    def reference(self, env: RunEnv) -> None:
        src = env.tensors[self.src]
        x = src.to(env.compute)
        r = torch.rsqrt((x * x).mean(dim=1) + self.eps)  # as aux rstd computes it
        out = x * r[:, None] * (self.offset + env.tensors[self.weight].to(env.compute))[None, :]
        exact = env.compute == torch.float64
        env.tensors[self.out] = out if exact else out.to(src.dtype)
        if self.stat_out is not None:
            env.tensors[self.stat_out] = r

    def launch(self, env: RunEnv) -> None:
        src, out, weight = env.tensors[self.src], env.tensors[self.out], env.tensors[self.weight]
        # r written to stat_out; without it, out's memory stands in, never written there
        keep = self.stat_out is not None
        stat = env.tensors[self.stat_out] if keep else out
        launch_rows(src, stat, weight, out, self.offset, stat_eps=self.eps, store_rstd=keep)
