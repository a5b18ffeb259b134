"""The cross-entropy recogniser: ``F.cross_entropy(logits.float(), target, reduction="none")``
(Hugging Face's causal-LM loss per token, targets already shifted) as ``CrossEntropy``.

The block op upcasts the logits itself, so a ``.float()`` on them is absorbed. A class weight,
label smoothing, an ``ignore_index`` other than the default or a reduction other than ``"none"``
stays opaque, and says so."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from ..ops import CrossEntropy
from .nodes import Found, Ref, arg, dtype, is_op, rank, see_through, upcast_of

if TYPE_CHECKING:
    from .matcher import Matcher

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def cross_entropy(m: Matcher, n: fx.Node) -> Found | None:
    if unsupported(n) is not None or not is_op(n, "cross_entropy_loss"):
        return None
    logits, target = see_through(n.args[0]), see_through(n.args[1])
    if rank(logits) != 2 or rank(target) != 1 or dtype(target) != torch.int64:
        return None
    source = upcast_of(logits)
    return Found(CrossEntropy, "loss", {"logits": Ref(source), "target": Ref(target)})


def unsupported(n: fx.Node) -> str | None:
    """Why a ``cross_entropy_loss`` node is not the block op (``None`` when it is, or is no
    cross-entropy)."""
    if not is_op(n, "cross_entropy_loss"):
        return None
    reduction = _REDUCTIONS.get(arg(n, 3, "reduction", 1), "?")
    if reduction != "none":
        return (
            f"F.cross_entropy with reduction={reduction!r}: the block op is the per-token loss; "
            "pass reduction='none' and reduce outside the block"
        )
    if arg(n, 2, "weight") is not None:
        return "F.cross_entropy with class weights: no block op weights classes"
    if arg(n, 4, "ignore_index", -100) != -100:
        return "F.cross_entropy with an ignore_index: weight the per-token loss instead"
    if arg(n, 5, "label_smoothing", 0.0) != 0.0:
        return "F.cross_entropy with label_smoothing: no block op smooths labels"
    return None
