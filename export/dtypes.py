"""The dtype a drop-in's kernels run in, and running an exported op in it.

Hugging Face's mixed precision keeps fp32 weights and residual stream and runs the projections
in ``torch.autocast``'s dtype; the exported ops run in one dtype, so the drop-ins cast as the
projections would (``autocast_dtype``, ``run_in_dtype``).
"""

from __future__ import annotations

from typing import Any

import torch

from .autograd import ExportedFunction


def autocast_dtype(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.dtype | None:
    """The dtype the kernels must run in instead of ``x``'s: ``torch.autocast``'s, when it is on
    and ``x`` is in another dtype (Hugging Face's mixed precision: the caller casts ``x`` and the
    weights). None when ``x``'s own dtype is used — then every weight must have it (TypeError)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype != torch.get_autocast_dtype(device):
        return torch.get_autocast_dtype(device)
    for w in weights:  # (a loop, not a comprehension: no call on every forward)
        if w.dtype != x.dtype:
            raise TypeError(
                f"parameters of dtype {w.dtype} next to activations of dtype {x.dtype}: "
                "cast the modules to the activation dtype (e.g. model.to(torch.bfloat16)), or "
                "run under torch.autocast"
            )
    return None


def run_in_dtype(function: ExportedFunction, dtype: torch.dtype, *tensors: torch.Tensor) -> Any:
    """``function(*tensors)`` with the floating-point tensors cast to ``dtype`` (what autocast
    would do to a projection's input and weight) and autocast off around the exported op."""
    cast = [t.to(dtype) if t.dtype != dtype and t.is_floating_point() else t for t in tensors]
    device = cast[0].device.type
    if not torch.is_autocast_enabled(device):  # nothing to turn off (no context: host time)
        return function(*cast)
    with torch.autocast(device, enabled=False):
        return function(*cast)
