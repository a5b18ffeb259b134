"""Scaling tensors in place by a factor that lives on the device, without reading them when the
factor is exactly 1.

A loss whose gradient is computed in its forward (``coda.export.lm_head_chunks``) hands its
backward's incoming gradient ``g`` — a 0-dim tensor on the GPU, ``1.0`` whenever the loss is
backpropagated as is — to ``t.mul_(g)`` over every gradient it made: the LM head's ``[V, d]``
weight gradient among them, one read and one write of the whole tensor (0.1–0.3 ms of a training
step on an H200) to multiply by one. Asking the host whether ``g`` is 1 would make it wait for the
GPU. ``scale_unless_one`` asks the device instead: each program of its kernel loads ``g`` and
returns at once when it is 1, so the launch — one for all three of the loss's gradients — costs
its few microseconds and nothing is read; any other value (0, a loss scale, NaN) multiplies in
fp32, rounded once to ``t``'s dtype — what ``t.mul_(g)`` computes on the CPU (on a GPU, ``mul_``
first rounds a 0-dim GPU factor to a 16-bit ``t``'s dtype: 0.37 becomes 0.369 in bf16). On the
CPU the host knows ``g`` without waiting, and ``t.mul_(g)`` runs when it is not 1.

The kernel reads the factor when it runs, so a captured CUDA graph replays it correctly with
whatever the factor's memory holds then.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch
import triton.language as tl

from . import backend
from .launch import launch_kernel
from .sizes import cdiv

_BLOCK = 4096  # elements per program per loop step
_PROGRAMS_PER_SM = 4  # programs a launch runs at most per SM; each loops over its share
_PER_LAUNCH = 3  # tensors one launch scales (a loss's dx, dγ and dW: one launch)


@backend.jit
def _scale_in_place_kernel(a_ptr, a_n, b_ptr, b_n, c_ptr, c_n, factor_ptr, BLOCK: tl.constexpr):
    # Up to three flat tensors, each cut into BLOCK-element blocks numbered one tensor after the
    # other; programs stride over the block numbers. All return at once when the factor is
    # exactly 1 (NaN compares unequal, so it multiplies). A tensor not given has n = 0. Each
    # branch names its values apart: Triton types a name once across the branches of an if.
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        a_blocks = tl.cdiv(a_n, BLOCK)
        ab_blocks = a_blocks + tl.cdiv(b_n, BLOCK)
        blocks = ab_blocks + tl.cdiv(c_n, BLOCK)
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        for block in range(tl.program_id(axis=0), blocks, tl.num_programs(axis=0)):
            if block < a_blocks:
                offs = lanes + tl.cast(block, tl.int64) * BLOCK
                ax = tl.load(a_ptr + offs, mask=offs < a_n)
                tl.store(a_ptr + offs, (ax.to(tl.float32) * factor).to(ax.dtype), mask=offs < a_n)
            elif block < ab_blocks:
                offs = lanes + tl.cast(block - a_blocks, tl.int64) * BLOCK
                bx = tl.load(b_ptr + offs, mask=offs < b_n)
                tl.store(b_ptr + offs, (bx.to(tl.float32) * factor).to(bx.dtype), mask=offs < b_n)
            else:
                offs = lanes + tl.cast(block - ab_blocks, tl.int64) * BLOCK
                cx = tl.load(c_ptr + offs, mask=offs < c_n)
                tl.store(c_ptr + offs, (cx.to(tl.float32) * factor).to(cx.dtype), mask=offs < c_n)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def scale_on_device(
    tensors: Sequence[torch.Tensor], factor: torch.Tensor, *, max_programs: int | None = None
) -> None:
    """``t *= factor`` for each of ``tensors`` (contiguous, on ``factor``'s device; any float
    dtypes) by the kernel, three tensors a launch, whose programs return without touching them
    when ``factor`` (one element) is exactly 1. In the CPU's Triton interpreter where there is no
    GPU. ``max_programs``: how many programs share a launch's blocks at most (default: four per
    SM on a GPU, one per block otherwise)."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"scale_on_device needs contiguous tensors, not strides {t.stride()}")
        if factor.numel() != 1 or factor.device != t.device:
            raise ValueError(
                f"scale_on_device needs a one-element factor on {t.device}, not shape "
                f"{tuple(factor.shape)} on {factor.device}"
            )
    present = [t for t in tensors if t.numel()]
    for start in range(0, len(present), _PER_LAUNCH):
        _launch(present[start : start + _PER_LAUNCH], factor, max_programs)


def _launch(ts: list[torch.Tensor], factor: torch.Tensor, max_programs: int | None) -> None:
    """One launch over ``ts`` (one to three non-empty tensors)."""
    programs = sum(cdiv(t.numel(), _BLOCK) for t in ts)
    if max_programs is None and factor.is_cuda:
        max_programs = _PROGRAMS_PER_SM * _sm_count(factor.device)
    if max_programs is not None:
        programs = max(1, min(programs, max_programs))
    absent = (ts[0], 0)  # an n of 0: no block, never read
    pairs = [(t, t.numel()) for t in ts] + [absent] * (_PER_LAUNCH - len(ts))
    args = [value for pair in pairs for value in pair]
    launch_kernel(_scale_in_place_kernel, (programs,), *args, factor, BLOCK=_BLOCK)


def scale_unless_one(tensors: Iterable[torch.Tensor | None], factor: torch.Tensor) -> None:
    """Multiply each tensor (None: skipped) in place by the one-element ``factor`` — unread and
    unchanged when ``factor`` is exactly 1, otherwise the product in fp32 rounded once. On a GPU
    the device decides (``scale_on_device``, one launch for up to three contiguous tensors; one
    that is not contiguous takes ``mul_``); on the CPU the host does (``mul_``, which computes
    the same product there)."""
    ts = [t for t in tensors if t is not None]
    if factor.device.type == "cpu":
        if factor.item() != 1.0:
            for t in ts:
                t.mul_(factor)
        return
    on_device, others = [], []
    for t in ts:
        (on_device if t.is_contiguous() and t.device == factor.device else others).append(t)
    scale_on_device(on_device, factor.reshape(()))
    for t in others:
        t.mul_(factor)
