"""Aux ``unpair_rows``: undo ``rope_pairs`` on a weight gradient.

A program whose Q/K weights were permuted into adjacent-pair order (prep ``rope_pairs``) computes
the weight gradient ``dzᵀ y`` in that same order; this step puts the rows back into Hugging Face's
rotate-half order. It moves a weight-sized tensor once (``index_select``, a plain gather: no
arithmetic to fuse), which is small next to the GEMMs that produce it.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..base import AuxStep, Name, RunEnv
from ..checking import ProgramEnv
from ..errors import ProgramError
from ..prep.layout import row_order_on
from ..sizes import SizeExpr
from ..sizes import evaluate as evaluate_size
from ..types import TensorInfo


class UnpairRows(AuxStep):
    """Inverse of prep ``rope_pairs`` on the leading rows of a 2-D tensor: ``out`` = ``src`` with
    each head's rows moved from adjacent-pair order back to rotate-half order.

    Within each head of ``head_dim`` rows (a size expression), old row ``e·D/2 + p`` is taken from
    row ``2p + e`` of ``src``. ``rows``: how many leading rows are permuted (e.g. ``"Nq + Nkv"``
    for the Q and K part of a fused QKV weight gradient; the rest are copied); default: all.
    """

    kind: Literal["unpair_rows"] = "unpair_rows"
    src: Name
    head_dim: SizeExpr
    out: Name
    rows: SizeExpr | None = None

    def check(self, env: ProgramEnv) -> None:
        info = env.matrix(self.src, role="src")
        head_dim = env.size(self.head_dim, what="unpair_rows head_dim")
        rows = env.size(self.rows, what="unpair_rows rows") if self.rows else info.shape[0]
        if head_dim <= 0 or head_dim % 2 or rows % head_dim or not 0 <= rows <= info.shape[0]:
            raise ProgramError(
                f"unpair_rows: {rows} leading rows of {self.src!r} ({info.describe()}) are not a "
                f"whole number of heads of even width head_dim = {head_dim}"
            )
        env.define(self.out, TensorInfo(info.shape, info.dtype, env.where))

    def _order(self, env: RunEnv, src: torch.Tensor) -> torch.Tensor:
        total = src.shape[0]
        rows = evaluate_size(self.rows, env.sizes) if self.rows else total
        head_dim = evaluate_size(self.head_dim, env.sizes)
        return row_order_on(src.device, rows, head_dim, total, inverse=True)

    def reference(self, env: RunEnv) -> None:
        src = env.tensors[self.src]
        env.tensors[self.out] = src[self._order(env, src)]

    def launch(self, env: RunEnv) -> None:
        src = env.tensors[self.src]
        order = self._order(env, src)
        torch.index_select(src, 0, order, out=env.tensors[self.out])
