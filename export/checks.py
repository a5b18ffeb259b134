"""Checks shared by the drop-ins: that a Hugging Face norm computes what the fused kernels do —
``check_rms_norm`` (Llama's RMSNorm ``x̂ · w``, the only form the MLP's kernels take) and
``rms_norm_form`` (also Gemma's ``x̂ · (1 + w)``: the attention-input and LM-head kernels read
``γ = w + offset``, ``norm_gamma``, so the gradient reaches ``w`` unchanged) — and that a model to
patch is not yet wrapped or sharded for data-parallel training — and that the projections whose
weights a kernel reads are plain ``nn.Linear`` modules, when patched (``check_plain_linear``) and
on every call after (``HeldLinears``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from coda.primitives.types import KERNEL_DTYPES

GEMMA_OFFSET = 1.0  # Gemma's RMSNorm scales by (1 + weight)


def check_plain_linear(module: Any, where: str) -> None:
    """``ValueError`` unless ``module`` is a ``torch.nn.Linear`` itself — not a subclass, not a
    wrapper — with its weight in a dtype the kernels compute in (float32, float16, bfloat16;
    ``KERNEL_DTYPES``). The kernels read its ``weight`` (and ``bias``) and compute
    ``x @ weightᵀ``: what a wrapper adds to that product — a LoRA adapter's ``x Aᵀ Bᵀ`` (PEFT's
    ``lora.Linear``, whose ``weight`` is its base layer's), a quantized weight's scales
    (bitsandbytes' ``Linear4bit``) — would be left out without a sign."""
    if type(module) is not nn.Linear:
        kind = f"{type(module).__module__}.{type(module).__qualname__}"
        raise ValueError(
            f"{where} is a {kind}, not a torch.nn.Linear: the kernels read its weight and compute "
            "x @ weightᵀ, which would leave out what it adds (a LoRA adapter's product, a "
            "quantized weight's scales); merge LoRA adapters into the weights first (PEFT's "
            "merge_and_unload) to patch them"
        )
    if module.weight.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"{where}'s weight is {module.weight.dtype}: the kernels compute in float32, float16 "
            "or bfloat16; cast the model to one of those (e.g. model.float()) before patching"
        )


class HeldLinears:
    """The ``nn.Linear`` submodules of a drop-in whose weights its kernels read, as it was built
    with them. ``check(owner)`` raises ``RuntimeError`` when one was replaced since — PEFT's
    ``get_peft_model`` wraps a targeted projection in a LoRA layer, whose adapter the kernels
    would leave out — instead of computing a model without the adapters. Identity, not type, is
    checked: FSDP2 changes a sharded module's class in place."""

    def __init__(self, owner: nn.Module, names: Sequence[str]) -> None:
        self.held = tuple((name, owner._modules[name]) for name in names)

    def check(self, owner: nn.Module) -> None:
        modules = owner._modules
        for name, module in self.held:  # (a loop, not a comprehension: it runs on every call)
            if modules.get(name) is not module:
                kind = type(modules.get(name))
                now = f"{kind.__module__}.{kind.__qualname__}"
                raise RuntimeError(
                    f"{type(owner).__name__}.{name} was replaced by a {now} after patching (PEFT's "
                    "get_peft_model?): the CODA kernels read the projection's weight and would "
                    "leave out what the new module adds. Apply PEFT to the unpatched model — "
                    "patch_model then keeps the adapted projections — or merge the adapters "
                    "(merge_and_unload) before patching"
                )


def check_rms_norm(norm: nn.Module, where: str) -> float:
    """``norm``'s epsilon; ``ValueError`` unless ``norm`` computes ``x · rsqrt(mean(x²) + eps) ·
    weight`` (Llama's RMSNorm; not e.g. Gemma's ``· (1 + weight)`` or a LayerNorm), checked on a
    probe input with its own weight and epsilon — the fused kernels apply exactly that formula."""
    return rms_norm_form(norm, where, offsets=(0.0,))[0]


def rms_norm_form(
    norm: nn.Module, where: str, offsets: tuple[float, ...] = (0.0, GEMMA_OFFSET)
) -> tuple[float, float]:
    """``(eps, offset)``: ``norm`` computes ``x · rsqrt(mean(x²) + eps) · (weight + offset)`` for
    one of ``offsets`` (0: Llama's RMSNorm; 1: Gemma's), checked on a probe input with its own
    weight and epsilon; else ``ValueError``. A kernel that applies ``γ = weight + offset``
    (``norm_gamma``) computes exactly that norm (in a low-precision dtype up to where ``1 + w`` is
    rounded: Gemma's own norm adds it in fp32)."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        raise ValueError(f"{where} ({type(norm).__name__}) is no RMSNorm with a weight and eps")
    if weight.is_meta:
        return float(eps), offsets[0]  # nothing to compute with; checked once weights exist
    with torch.no_grad():
        w = weight.detach().float().cpu()
        probe = torch.linspace(-3, 3, 2 * w.numel()).reshape(2, -1)
        normed = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + float(eps))
        try:
            got = _run_on_probe(norm, probe)
        except Exception as e:  # noqa: BLE001 - a module that cannot run the probe is not one
            raise ValueError(f"{where} ({type(norm).__name__}) failed on a probe: {e}") from e
    offset = next((o for o in offsets if _near(got, normed * (w + o))), None)
    if offset is None:
        forms = " or ".join("weight" if not o else f"({o:g} + weight)" for o in offsets)
        hint = "" if GEMMA_OFFSET in offsets else _offset_hint(got, normed * (1 + w))
        raise ValueError(
            f"{where} ({type(norm).__name__}) is not x · rsqrt(mean(x²) + eps) · {forms}, the "
            f"RMSNorm the fused kernels compute{hint}"
        )
    return float(eps), offset


def norm_gamma(weight: torch.Tensor, offset: float) -> torch.Tensor:
    """The ``γ`` a fused kernel applies for a norm of form ``offset``: the weight itself, or
    ``weight + offset`` (a new tensor whose gradient is the weight's)."""
    return weight if not offset else weight + offset


def _near(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def _offset_hint(got: torch.Tensor, gemma: torch.Tensor) -> str:
    """What the norm computes instead, when it is Gemma's ``x̂ · (1 + weight)`` (``gemma``)."""
    if _near(got, gemma):
        return " — it computes x̂ · (1 + weight), Gemma's RMSNorm, which these kernels do not apply"
    return ""


def _run_on_probe(norm: nn.Module, probe: torch.Tensor) -> torch.Tensor:
    """``norm`` applied to ``probe`` (in the weight's dtype and device), as fp32 on the CPU."""
    weight = norm.weight
    return norm(probe.to(device=weight.device, dtype=weight.dtype)).float().cpu()


def check_not_distributed(model: nn.Module) -> None:
    """``ValueError`` if ``model`` is already wrapped (``DistributedDataParallel``,
    ``DataParallel``, FSDP1) or sharded (DTensor parameters: FSDP2's ``fully_shard``, tensor
    parallelism): patching replaces modules and, with ``fuse_gate_up``, parameters, which a
    wrapper built before would not see — patch the model first, then wrap or shard it."""
    wrappers: tuple[type, ...] = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    wrapper = next(((n, m) for n, m in model.named_modules() if isinstance(m, wrappers)), None)
    if wrapper is not None:
        name, module = wrapper
        what = f"module {name!r} is a" if name else "the model is a"
        raise ValueError(
            f"{what} {type(module).__name__}: patch the model before wrapping it for "
            "data-parallel training (patch_llama(model), then DistributedDataParallel(model)); "
            "a wrapper built first does not see the modules and parameters the patch replaces"
        )
    sharded = next((n for n, p in model.named_parameters() if _is_dtensor(p)), None)
    if sharded is not None:
        raise ValueError(
            f"parameter {sharded!r} is a DTensor (sharded, e.g. by FSDP2's fully_shard): patch the "
            "full model first, then fully_shard each decoder layer and the root"
        )


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
