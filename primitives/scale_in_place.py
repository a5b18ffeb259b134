"""Scaling tensors in place by a factor that lives on the device, without reading them when the
factor is exactly 1.

A loss whose gradient is computed in its forward (``coda.export.lm_head_chunks``) hands its
backward's incoming gradient ``g`` — a 0-dim tensor on the GPU, ``1.0`` whenever the loss is
backpropagated as is — to ``t.mul_(g)`` over every gradient it made: the LM head's ``[V, d]``
weight gradient among them, one read and one write of the whole tensor (0.1–0.3 ms of a training
step on an H200) to multiply by one. Asking the host whether ``g`` is 1 would make it wait for the
GPU. ``scale_unless_one`` asks the device instead: each program of its kernel loads ``g`` and
returns at once when it is 1, so the launch costs its few microseconds and nothing is read; any
other value (0, a loss scale, NaN) multiplies in fp32, rounded once to ``t``'s dtype — what
``t.mul_(g)`` computes on the CPU (on a GPU, ``mul_`` first rounds a 0-dim GPU factor to a 16-bit
``t``'s dtype: 0.37 becomes 0.369 in bf16). On the CPU the host knows ``g`` without waiting, and
``t.mul_(g)`` runs when it is not 1.

The kernel reads the factor when it runs, so a captured CUDA graph replays it correctly with
whatever the factor's memory holds then.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import triton.language as tl

from . import backend
from .launch import launch_kernel
from .sizes import cdiv

_BLOCK = 4096  # elements per program per loop step
_PROGRAMS_PER_SM = 4  # programs a launch runs at most per SM; each loops over its share


@backend.jit
def _scale_in_place_kernel(t_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    # Programs stride over the flat tensor BLOCK elements at a time; all return at once when the
    # factor is exactly 1 (NaN compares unequal, so it multiplies).
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        pid = tl.program_id(axis=0)
        step = tl.num_programs(axis=0) * BLOCK
        for start in range(pid * BLOCK, n, step):
            offs = tl.arange(0, BLOCK).to(tl.int64) + start
            mask = offs < n
            x = tl.load(t_ptr + offs, mask=mask)
            tl.store(t_ptr + offs, (x.to(tl.float32) * factor).to(x.dtype), mask=mask)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def scale_on_device(
    t: torch.Tensor, factor: torch.Tensor, *, max_programs: int | None = None
) -> None:
    """``t *= factor`` (``t`` contiguous, ``factor`` one element on ``t``'s device) by the kernel,
    whose programs return without touching ``t`` when ``factor`` is exactly 1. In the CPU's
    Triton interpreter where there is no GPU. ``max_programs``: how many programs share the
    tensor at most (default: four per SM on a GPU, one per block of elements otherwise)."""
    if not t.is_contiguous():
        raise ValueError(f"scale_on_device needs a contiguous tensor, not strides {t.stride()}")
    if factor.numel() != 1 or factor.device != t.device:
        raise ValueError(
            f"scale_on_device needs a one-element factor on {t.device}, not shape "
            f"{tuple(factor.shape)} on {factor.device}"
        )
    n = t.numel()
    if n == 0:
        return
    programs = cdiv(n, _BLOCK)
    if max_programs is None and t.is_cuda:
        max_programs = _PROGRAMS_PER_SM * _sm_count(t.device)
    if max_programs is not None:
        programs = max(1, min(programs, max_programs))
    launch_kernel(_scale_in_place_kernel, (programs,), t, factor, n, BLOCK=_BLOCK)


def scale_unless_one(tensors: Iterable[torch.Tensor | None], factor: torch.Tensor) -> None:
    """Multiply each tensor (None: skipped) in place by the one-element ``factor`` — unread and
    unchanged when ``factor`` is exactly 1, otherwise the product in fp32 rounded once. On a GPU
    the device decides (``scale_on_device``; a tensor that is not contiguous takes ``mul_``); on
    the CPU the host does (``mul_``, which computes the same product there)."""
    ts = [t for t in tensors if t is not None]
    if factor.device.type == "cpu":
        if factor.item() != 1.0:
            for t in ts:
                t.mul_(factor)
        return
    for t in ts:
        if t.is_contiguous() and t.device == factor.device:
            scale_on_device(t, factor.reshape(()))
        else:
            t.mul_(factor)
