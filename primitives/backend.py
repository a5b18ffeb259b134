"""Where kernels run: on a CUDA GPU when there is one, otherwise in Triton's CPU interpreter.

Triton decides per kernel, when ``@triton.jit`` runs, whether it is interpreted, from the environment
variable ``TRITON_INTERPRET``. This module is imported before any kernel is defined or generated and
sets that variable when no GPU is visible, so the same kernels run everywhere: compiled on a GPU,
interpreted (numpy, small shapes) on a CPU. Set ``TRITON_INTERPRET=1`` yourself to force the
interpreter on a GPU machine.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE: str = "cpu" if INTERPRET else "cuda"


def describe() -> str:
    """One line for reports: which device and backend kernels run on."""
    if INTERPRET:
        return "cpu (Triton interpreter)"
    return f"cuda ({torch.cuda.get_device_name()})"
