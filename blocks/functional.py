"""PyTorch semantics of the high-level block ops, following Hugging Face's Llama modules.

These functions are shown verbatim to LLMs as part of a block's reference source, and the block's
reference runs exactly that source. They compute in the input dtype except where Hugging Face does
not (``LlamaRMSNorm`` takes its statistics in fp32 and rounds back before multiplying by γ); given
float64 inputs everything is float64, which is how the sandbox builds its high-precision reference.
"""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: ``weight * (x / sqrt(mean(x**2, -1) + eps))``, statistics in (at least)
    fp32.
    """
    dtype = x.dtype
    xf = x.to(torch.promote_types(dtype, torch.float32))
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear without bias: ``x @ weight.T`` with ``weight`` of shape ``[out, in]``."""
    return F.linear(x, weight)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """LlamaMLP's activation: ``silu(gate) * up``."""
    return F.silu(gate) * up


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A residual connection."""
    return a + b
