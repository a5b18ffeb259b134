"""A causal LM loss's next-token targets and token weights, in one launch.

Hugging Face's causal-LM loss (``ForCausalLMLoss``) lets position ``t`` predict ``labels[t + 1]``
(the last position predicts nothing), ignores label -100, and averages over the tokens counted —
or divides the sum by ``num_items_in_batch`` where the caller gives it (gradient accumulation).
The fused LM-head loss (``coda.export.lm_head``) takes that as two per-token tensors: ``classes``,
each token's target where it counts and 0 where it does not (any valid class: its weight is 0),
and ``weights``, ``counted / denominator`` in fp32. Made with PyTorch ops that is a pad, a
comparison, a select, a sum, a clamp, a cast and a division — seven ops of at least one kernel
launch each in the forward of every training step, which at a few thousand tokens is bound by the
host's launches (bench/RESULTS.md). ``next_token_targets`` makes both in one launch on a GPU:
one program walks the tokens twice, counting and writing the classes, then writing the weights
(the count is known only once every label was read). On the CPU the host runs the PyTorch ops
(there the kernel would run in Triton's interpreter); they compute the same values, bit for bit.

A label outside the vocabulary ``[0, vocab)`` other than -100 (a tokenizer with tokens the
embedding was not resized for) has no logit: Hugging Face's loss raises ``IndexError`` on the CPU
and stops the process with a device-side assert on a GPU. Given ``vocab``, the host raises the
same ``IndexError`` where the labels are in its memory (the CPU); on a GPU, where looking would
make the host wait for the device every step, such a token's weight is NaN, so the loss and every
gradient it reaches are NaN — never a loss that quietly leaves the token out or scores class 0.
"""

from __future__ import annotations

import torch
import triton.language as tl

from . import backend
from .launch import launch_kernel
from .tracing import traced

IGNORE_INDEX = -100
_BLOCK = 1024  # tokens per loop step of the one program


@backend.jit
def _next_token_targets_kernel(
    labels_ptr, classes_ptr, weights_ptr, den_ptr,
    n, length, stride_row, stride_col, den_value, vocab,
    DEN_FROM_PTR: tl.constexpr, COUNT_DEN: tl.constexpr, IGNORE: tl.constexpr,
    CHECK_RANGE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Token i of the flattened [rows, length] labels is (row, col) = divmod(i, length); its
    # target is labels[row, col + 1], none for the last column.
    counted_total = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        row = i // length
        col = i % length
        has_next = (i < n) & (col + 1 < length)
        offs = row.to(tl.int64) * stride_row + (col + 1).to(tl.int64) * stride_col
        target = tl.load(labels_ptr + offs, mask=has_next, other=IGNORE)
        counted = target != IGNORE
        counted_total += counted.to(tl.int32)
        weight = counted.to(tl.float32)
        if CHECK_RANGE:  # no logit for it: class 0, weight NaN (NaN / the denominator stays NaN)
            outside = counted & ((target < 0) | (target >= vocab))
            counted = counted & ~outside
            weight = tl.where(outside, float("nan"), weight)
        tl.store(classes_ptr + i, tl.where(counted, target, 0), mask=i < n)
        tl.store(weights_ptr + i, weight, mask=i < n)
    if COUNT_DEN:
        denominator = tl.maximum(tl.sum(counted_total, axis=0), 1).to(tl.float32)
    elif DEN_FROM_PTR:
        denominator = tl.load(den_ptr).to(tl.float32)
    else:
        denominator = den_value
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        one = tl.load(weights_ptr + i, mask=i < n)
        tl.store(weights_ptr + i, tl.math.div_rn(one, denominator), mask=i < n)


def next_token_targets(
    labels: torch.Tensor, num_items: int | torch.Tensor | None = None, vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(classes, weights)`` for ``labels`` ``[..., T]`` (integers, -100 ignored), both flat over
    the tokens: token ``t`` of a row targets ``labels[t + 1]`` and the row's last token none;
    ``classes`` holds the target where it counts and 0 elsewhere (``labels``' dtype), ``weights``
    (fp32) ``1 / denominator`` where it counts and 0 elsewhere — the denominator the number of
    tokens counted (at least 1), or ``num_items`` where given (an int or a one-element tensor,
    e.g. Hugging Face's ``num_items_in_batch``). ``vocab``: the number of classes; a target
    outside ``[0, vocab)`` raises ``IndexError`` on the CPU and weighs NaN on a GPU (module
    docstring). One launch on a GPU; PyTorch ops elsewhere."""
    if labels.dim() == 0 or labels.is_floating_point() or labels.is_complex():
        raise ValueError(
            f"labels must be integer class ids with a token dimension, not {labels.dtype} of "
            f"shape {tuple(labels.shape)}"
        )
    if not labels.is_cuda:
        return targets_by_ops(labels, num_items, vocab)
    return targets_on_device(labels, num_items, vocab)


def targets_by_ops(
    labels: torch.Tensor, num_items: int | torch.Tensor | None = None, vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``next_token_targets`` with PyTorch ops (what the kernel computes)."""
    classes, counted, outside = next_token_classes(labels, vocab)
    denominator = (counted | outside).sum().clamp(min=1) if num_items is None else num_items
    weights = counted.to(torch.float32) / denominator
    return classes, torch.where(outside, torch.nan, weights)


def next_token_classes(
    labels: torch.Tensor, vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(classes, counted, outside)`` for ``labels`` ``[..., T]``, flat over the tokens, with
    PyTorch ops: each token's target class (0 where it has none), whether it counts, and whether
    its target lies outside ``[0, vocab)`` (then it neither counts nor has its class; all False
    without ``vocab``). Labels in the host's memory with a target outside raise ``IndexError``."""
    targets = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    counted = targets != IGNORE_INDEX
    outside = torch.zeros_like(counted)
    if vocab is not None:
        outside = counted & ((targets < 0) | (targets >= vocab))
        if _host_reads(targets):
            refuse_outside(targets, outside, vocab)
        counted = counted & ~outside
    return torch.where(counted, targets, 0), counted, outside


def _host_reads(t: torch.Tensor) -> bool:
    """Whether the host can read ``t``'s values without waiting for a device or breaking a trace:
    in CPU memory, nothing tracing or transforming the call (``tracing.traced``)."""
    return not t.is_cuda and not traced((t,))


def refuse_outside(targets: torch.Tensor, outside: torch.Tensor, vocab: int) -> None:
    """``IndexError`` naming the first target in ``outside``, as Hugging Face's loss raises."""
    if bool(outside.any()):
        value = int(targets[outside][0])
        raise IndexError(
            f"label {value} is not a class of the vocabulary [0, {vocab}) nor the ignore index "
            f"{IGNORE_INDEX}: the labels hold a token the LM head has no logit for (a tokenizer "
            "larger than the model's vocabulary? resize the token embeddings)"
        )


def targets_on_device(
    labels: torch.Tensor, num_items: int | torch.Tensor | None = None, vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``next_token_targets`` by the kernel (on the CPU: in Triton's interpreter, where a target
    outside the vocabulary weighs NaN as on a GPU)."""
    rows = labels.reshape(-1, labels.shape[-1])  # a view where the layout allows it
    n = rows.numel()
    classes = torch.empty(n, dtype=labels.dtype, device=labels.device)
    weights = torch.empty(n, dtype=torch.float32, device=labels.device)
    if n == 0:
        return classes, weights
    den = weights  # an unread pointer where the denominator is not a tensor
    value = 1.0
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"num_items must have one element, not {tuple(num_items.shape)}")
        if num_items.device == labels.device:
            den = num_items
        else:  # a CPU tensor: the host has its value without waiting
            value = float(num_items.item())
    elif num_items is not None:
        value = float(num_items)
    launch_kernel(
        _next_token_targets_kernel, (1,),
        rows, classes, weights, den, n, rows.shape[1], rows.stride(0), rows.stride(1), value,
        0 if vocab is None else vocab,
        DEN_FROM_PTR=den is not weights, COUNT_DEN=num_items is None, IGNORE=IGNORE_INDEX,
        CHECK_RANGE=vocab is not None, BLOCK=_BLOCK,
    )  # fmt: skip
    return classes, weights
