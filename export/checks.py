"""Checks that a Hugging Face norm computes what the fused kernels do (Llama's RMSNorm), shared by
the MLP, attention and LM-head drop-ins."""

from __future__ import annotations

import torch
from torch import nn


def check_rms_norm(norm: nn.Module, where: str) -> float:
    """``norm``'s epsilon; ``ValueError`` unless ``norm`` computes ``x · rsqrt(mean(x²) + eps) ·
    weight`` (Llama's RMSNorm; not e.g. Gemma's ``· (1 + weight)`` or a LayerNorm), checked on a
    probe input with its own weight and epsilon — the fused kernels apply exactly that formula."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        raise ValueError(f"{where} ({type(norm).__name__}) is no RMSNorm with a weight and eps")
    if weight.is_meta:
        return float(eps)  # nothing to compute with; checked again once the weights exist
    with torch.no_grad():
        w = weight.detach().float().cpu()
        probe = torch.linspace(-3, 3, 2 * w.numel()).reshape(2, -1)
        normed = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + float(eps))
        want = normed * w
        try:
            got = _run_on_probe(norm, probe)
        except Exception as e:  # noqa: BLE001 - a module that cannot run the probe is not one
            raise ValueError(f"{where} ({type(norm).__name__}) failed on a probe: {e}") from e
    if not _near(got, want):
        raise ValueError(
            f"{where} ({type(norm).__name__}) is not x · rsqrt(mean(x²) + eps) · weight, the "
            f"RMSNorm the fused kernels compute{_offset_hint(got, normed * (1 + w))}"
        )
    return float(eps)


def _near(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def _offset_hint(got: torch.Tensor, gemma: torch.Tensor) -> str:
    """What the norm computes instead, when it is Gemma's ``x̂ · (1 + weight)`` (``gemma``)."""
    if _near(got, gemma):
        return " — it computes x̂ · (1 + weight), Gemma's RMSNorm, which no shipped kernel applies"
    return ""


def _run_on_probe(norm: nn.Module, probe: torch.Tensor) -> torch.Tensor:
    """``norm`` applied to ``probe`` (in the weight's dtype and device), as fp32 on the CPU."""
    weight = norm.weight
    return norm(probe.to(device=weight.device, dtype=weight.dtype)).float().cpu()
