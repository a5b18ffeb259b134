"""Running a Program's prep steps with their chains fused: a weight assembled by ``rope_pairs`` →
``concat_rows`` → ``fold_norm_weight`` is written once, each source weight read once.

Run one by one, the attention input's prep — Q and K rows permuted into RoPE pairs, stacked with
V into one QKV weight, γ folded in — reads and writes the QKV weight three times in four launches,
in every training step's forward and again (without the fold) in its backward. ``run_prep``
instead describes what these steps produce as a ``RowStack`` (which rows of which sources, and the
γ to scale the columns by), composes descriptions along the chain, and writes a stack only where a
tensor is needed: by a later prep step that cannot take a description, by a GEMM or aux step, or
as a block output — an intermediate only the chain reads is never written. On the GPU a stack is
written in one launch of the row kernel (``prep/rows.py``): every part gathered, scaled and placed
into its rows of the result, each source read once — the attention input's QKV weight is one
launch in the forward and one in the backward.

The values are those of running the steps one by one, bit for bit: gathers and stacking copy, and
the fold forms each product in fp32 and rounds once either way. The reference executor runs the
steps one by one (it keeps every intermediate for diagnosis).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..base import PrepStep, RunEnv
from .fold_norm_weight import FoldNormWeight, fold_columns, offset_gamma
from .layout import ConcatRows, RopePairs, pair_rows
from .rows import Part, stack_rows


@dataclass
class RowStack:
    """A prepared weight not yet written: the rows of each part stacked in order — part ``(src,
    pairs)`` contributes ``src`` whole, its rows in order where ``pairs`` is 0 and in RoPE-pair
    order per head of ``pairs`` rows otherwise (``layout.pair_rows``) — with every column then
    scaled by ``gamma`` when given. Never changed once made (not a frozen dataclass only because
    a frozen one's ``__init__`` costs a call per field, and prep describes weights on every
    training step)."""

    parts: tuple[Part, ...]
    gamma: torch.Tensor | None = None

    def write(self, compute: torch.dtype) -> torch.Tensor:
        """The tensor this stack describes."""
        first = self.parts[0][0]
        if len(self.parts) == 1 and not self.parts[0][1] and self.gamma is None:
            return first
        if first.is_cuda and compute != torch.float64:
            return self._write_in_place()
        pieces = [pair_rows(src, pairs) if pairs else src for src, pairs in self.parts]
        stacked = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        return stacked if self.gamma is None else fold_columns(stacked, self.gamma, compute)

    def _write_in_place(self) -> torch.Tensor:
        """The stack written by the row kernel: every part in one launch (``prep/rows.py``)."""
        return stack_rows(self.parts, self.gamma)


def run_prep(steps: Sequence[PrepStep], env: RunEnv, needed: Collection[str]) -> None:
    """Apply ``steps`` to ``env``, fusing ``rope_pairs`` / ``concat_rows`` / ``fold_norm_weight``
    chains; afterwards ``env.tensors`` holds every prep result named in ``needed`` (what the
    Program's steps and outputs read), and no intermediate that only a fused chain read."""
    pending: dict[str, RowStack] = {}
    for step in steps:
        stack = _describe(step, env, pending)
        if stack is not None:
            pending[step.out] = stack  # type: ignore[attr-defined]
            continue
        if pending:  # a step that reads tensors: write the stacks it reads first
            for name in names_in(step.model_dump(exclude={"kind"})) & pending.keys():
                env.tensors[name] = pending.pop(name).write(env.compute)
        step.apply(env)
    for name, stack in pending.items():
        if name in needed:
            env.tensors[name] = stack.write(env.compute)


def _describe(step: PrepStep, env: RunEnv, pending: dict[str, RowStack]) -> RowStack | None:
    """What ``step`` produces as a ``RowStack``, or None where it must run as itself."""
    if isinstance(step, RopePairs):
        w = env.tensors.get(step.weight)  # (a bias or norm weight, 1-D, is permuted as itself)
        return None if w is None or w.dim() != 2 else RowStack(((w, step.head_width(env)),))
    if isinstance(step, ConcatRows):
        parts: list[Part] = []
        for name in step.tensors:
            stack = _unscaled(name, env, pending)
            if stack is None:
                return None
            parts += stack.parts
        return RowStack(tuple(parts))
    if isinstance(step, FoldNormWeight) and step.gamma in env.tensors:
        stack = _unscaled(step.weight, env, pending)
        gamma = offset_gamma(env.tensors[step.gamma], step.offset, env.compute)
        return None if stack is None else RowStack(stack.parts, gamma)
    return None


def _unscaled(name: str, env: RunEnv, pending: dict[str, RowStack]) -> RowStack | None:
    """Tensor ``name`` as an unscaled stack (a written tensor is one whole part), or None."""
    if name in pending:
        stack = pending[name]
        return stack if stack.gamma is None else None
    return RowStack(((env.tensors[name], 0),))


def names_in(value: Any) -> set[str]:
    """Every string inside a node's dump — a superset of the tensor names it reads (a size
    expression or op name that happens to equal a tensor's name only makes that tensor written)."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return set().union(*map(names_in, value))
    return set()
