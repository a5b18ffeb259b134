"""Where kernels run: on a CUDA GPU when there is one, otherwise in Triton's CPU interpreter.

Triton decides whether a function is interpreted when ``@triton.jit`` runs — for its own standard
library (``tl.sum``, ``tl.max``, ...) that is when ``triton.language`` is first imported — from the
environment variable ``TRITON_INTERPRET``. This module sets that variable when no GPU is visible and
must therefore be imported before Triton: every coda package that uses Triton imports it first. If
Triton was imported earlier on a machine without a GPU, this module says so and how to fix it rather
than letting kernels fail later with an obscure interpreter error. Set ``TRITON_INTERPRET=1``
yourself to force the interpreter on a GPU machine.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE: str = "cpu" if INTERPRET else "cuda"


def _check_triton_import_order() -> None:
    language = sys.modules.get("triton.language")
    if INTERPRET and language is not None and type(language.sum).__name__ != "InterpretedFunction":
        raise ImportError(
            "triton was imported before coda on a machine without a GPU, so Triton's standard "
            "library was built for compilation, not for the CPU interpreter. Import coda before "
            "triton, or set TRITON_INTERPRET=1 in the environment before starting Python."
        )


_check_triton_import_order()


def describe() -> str:
    """One line for reports: which device and backend kernels run on."""
    if INTERPRET:
        return "cpu (Triton interpreter)"
    return f"cuda ({torch.cuda.get_device_name()})"
