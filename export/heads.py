"""q, k and v as attention heads of one packed projection, with one copy in the backward.

The attention input's kernel writes ``qkv = [q | k | v]`` ``[B, T, Nq + 2·Nkv]``; an attention
function takes heads ``[B, heads, T, D]``. As plain views (``split``, ``view``, ``transpose``)
the forward copies nothing, but autograd's backward of those views does twice: the attention's
head gradients come back in ``[B, heads, T, D]`` order, ``view``'s backward cannot view such a
transposed gradient as ``[B, T, heads·D]`` and copies it (a clone per head gradient that is not
laid out as its projection), and ``split``'s backward then concatenates the three into a third
tensor. ``split_heads`` returns the same views; its backward writes the three gradients into the
packed ``[B, T, Nq + 2·Nkv]`` gradient with one ``torch.cat`` that reads each where it lies.
"""

from __future__ import annotations

from typing import Any

import torch


class _SplitHeads(torch.autograd.Function):
    """Forward: the ``[B, heads, T, D]`` views of ``qkv``'s column blocks; backward: their
    gradients packed back in one ``cat`` (zeros for a part that got no gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, qkv: torch.Tensor, widths: tuple[int, ...], head_dim: int
    ) -> tuple[torch.Tensor, ...]:
        ctx.packed_shape = qkv.shape
        ctx.head_counts = tuple(w // head_dim for w in widths)
        ctx.head_dim = head_dim
        parts = qkv.split(list(widths), dim=-1)
        return tuple(p.view(*qkv.shape[:-1], -1, head_dim).transpose(1, 2) for p in parts)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:
        batch, tokens = ctx.packed_shape[0], ctx.packed_shape[1]
        present = next(g for g in grads if g is not None)
        heads = [
            g.transpose(1, 2)
            if g is not None
            else present.new_zeros(batch, tokens, count, ctx.head_dim)
            for g, count in zip(grads, ctx.head_counts, strict=True)
        ]
        return torch.cat(heads, dim=2).view(ctx.packed_shape), None, None


def split_heads(
    qkv: torch.Tensor, widths: tuple[int, ...], head_dim: int
) -> tuple[torch.Tensor, ...]:
    """The heads ``[B, widths[i] / head_dim, T, head_dim]`` of ``qkv`` ``[B, T, sum(widths)]``'s
    consecutive column blocks, as views (each width a multiple of ``head_dim``); the backward
    packs their gradients into ``qkv``'s in one ``torch.cat``."""
    if qkv.dim() != 3:
        raise ValueError(f"split_heads takes qkv [B, T, N], got shape {tuple(qkv.shape)}")
    if sum(widths) != qkv.shape[-1] or any(w % head_dim for w in widths):
        raise ValueError(
            f"split_heads: widths {widths} must sum to qkv's {qkv.shape[-1]} columns and each "
            f"be a multiple of head_dim {head_dim}"
        )
    return _SplitHeads.apply(qkv, tuple(widths), head_dim)
