"""Choosing a fused GEMM step's kernel variant at launch: the Hopper (TMA) mainloop with TMA or
pointer epilogue tiles, or the portable pointer kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from .descriptors import TMA_MAX_BOX, tma_available, tma_compatible
from .ir import GemmEpilogue

Mainloop = Literal["auto", "tma", "tma_mainloop", "pointer"]


def choose_mainloop(
    mainloop: Mainloop,
    step: GemmEpilogue,
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    *,
    epilogue_tiles: Sequence[tuple[torch.Tensor, Sequence[int]]] = (),
) -> str:
    """The kernel variant to launch: ``"tma"`` when descriptors can describe both operands and
    every tile the epilogue moves (``epilogue_tiles``: tensor and block shape), else
    ``"tma_mainloop"`` (the Hopper mainloop, pointer epilogue) when they can describe the
    operands, else ``"pointer"``.

    ``mainloop``: ``"auto"`` as above; ``"tma"`` insists on the Hopper mainloop (an error where
    the operands cannot be described); ``"tma_mainloop"`` also keeps the pointer epilogue;
    ``"pointer"`` the portable kernel. A step whose epilogue moves no tile has no separate
    ``"tma_mainloop"`` kernel: its ``"tma"`` kernel is that."""
    operands = (tensors[step.a.tensor], tensors[step.b.tensor])
    usable = tma_available(device) and all(tma_compatible(t) for t in operands)
    if mainloop in ("tma", "tma_mainloop") and not usable:
        shapes = [f"{tuple(t.shape)} strides {t.stride()}" for t in operands]
        raise RuntimeError(f"the TMA mainloop was requested but cannot describe {shapes} here")
    if mainloop == "pointer" or not usable:
        return "pointer"
    if not epilogue_tiles:
        return "tma"
    tiles_fit = all(tma_compatible(t) and max(b) <= TMA_MAX_BOX for t, b in epilogue_tiles)
    return "tma" if tiles_fit and mainloop != "tma_mainloop" else "tma_mainloop"
