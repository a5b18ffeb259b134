"""TMA tensor descriptors: whether a device and a tensor can use them, the block shape of each
descriptor parameter of a generated kernel, and building descriptors without Triton's checks for a
run's replay (``run_plans``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host tensor descriptors: pointer kernels only
    TensorDescriptor = None

from . import backend
from .codegen.context import Param
from .ir import MainloopConfig


@functools.lru_cache(maxsize=16)
def tma_available(device: torch.device) -> bool:
    """Tensor descriptors exist in this Triton and the device has a copy engine for them
    (Hopper or newer; the CPU interpreter emulates them)."""
    if TensorDescriptor is None:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9
    return backend.INTERPRET


def tma_compatible(t: torch.Tensor) -> bool:
    """A TMA descriptor needs the last dim contiguous and 16-byte aligned base and strides."""
    itemsize = t.element_size()
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * itemsize) % 16 == 0
        and t.data_ptr() % 16 == 0
    )


# The most elements a TMA box spans along one dimension.
TMA_MAX_BOX = 256


def _descriptor_defaults() -> dict[str, Any] | None:
    """The defaults of ``TensorDescriptor``'s fields after (base, shape, strides, block_shape),
    or None where it is not the plain dataclass this module knows how to fill."""
    if TensorDescriptor is None or not dataclasses.is_dataclass(TensorDescriptor):
        return None
    fields = dataclasses.fields(TensorDescriptor)
    if [f.name for f in fields[:4]] != ["base", "shape", "strides", "block_shape"]:
        return None
    if any(f.default is dataclasses.MISSING for f in fields[4:]):
        return None
    return {f.name: f.default for f in fields[4:]}


_DESCRIPTOR_DEFAULTS = _descriptor_defaults()


class DescriptorTemplate:
    """A TMA descriptor's fields but its base — shape, strides, block shape and
    ``TensorDescriptor``'s defaults — worked out once for a replay that builds the same
    descriptor on another base at every call (``on``)."""

    __slots__ = ("shape", "strides", "block", "fields")

    def __init__(self, shape: Sequence[int], strides: Sequence[int], block: list[int]) -> None:
        self.shape, self.strides, self.block = tuple(shape), tuple(strides), block
        defaults = _DESCRIPTOR_DEFAULTS
        self.fields = None if defaults is None else {**defaults, "block_shape": block}

    def on(self, base: torch.Tensor) -> Any:
        """``TensorDescriptor(base, shape, strides, block)`` without its ``__post_init__`` checks
        (a few microseconds per descriptor, a hundred descriptors per training step); its own
        lists of shape and strides, as a checked one has."""
        if self.fields is None:
            return TensorDescriptor(base, list(self.shape), list(self.strides), self.block)
        desc = object.__new__(TensorDescriptor)
        desc.__dict__ = {
            **self.fields, "base": base, "shape": list(self.shape), "strides": list(self.strides)
        }  # fmt: skip
        return desc


def unchecked_descriptor(
    base: torch.Tensor, shape: list[int], strides: list[int], block: list[int]
) -> Any:
    """``TensorDescriptor(base, shape, strides, block)`` without its checks
    (``DescriptorTemplate.on``)."""
    return DescriptorTemplate(shape, strides, block).on(base)


def descriptor_block(p: Param, cfg: MainloopConfig) -> list[int]:
    """The block shape of descriptor parameter ``p`` under ``cfg``, in elements."""
    epi_n = cfg.epilogue_block_n  # one epilogue sub-tile (the TMA tiles of the epilogue)
    blocks = {
        "BLOCK_SIZE_M": cfg.block_m,
        "BLOCK_SIZE_N": cfg.block_n,
        "BLOCK_SIZE_K": cfg.block_k,
        "EPI_N": epi_n,
        "EPI_N//2": epi_n // 2,
        "EPI_N*2": epi_n * 2,
    }
    return [blocks[b] for b in p.block or ()]
