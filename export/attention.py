"""The attention input of a Hugging Face Llama layer on CODA kernels: input RMSNorm + the Q, K, V
projections + RoPE as one GEMM (``llama_attn_in``, docs/algebra.md §2–3), and its backward.

* ``llama_attn_in_function(eps)``: ``f(x, gamma, w_q, w_k, w_v, cos, sin) -> qkv`` with autograd
  for ``x``, ``gamma`` and the three weights; the backward (``llama_attn_in_bwd_saved``) takes
  the returned ``qkv`` and recomputes no projection. ``qkv = [q | k | v]`` ``[tokens, Nq +
  2·Nkv]``; Q and K are rotated and come in the per-head adjacent-pair column order the fused
  kernel writes (``[r0, r_{D/2}, r1, r_{D/2+1}, …]`` of Hugging Face's rotate-half layout) — the
  attention scores, and so the attention output, are the same, because Q and K share the order.
* ``CodaLlamaAttention(attn, norm)``: a ``LlamaAttention`` whose input norm (the layer's
  ``input_layernorm``, which ``patch_llama`` turns into a ``DeferredRMSNorm``), projections and
  rotary embedding run in that one kernel; attention itself (Hugging Face's configured
  implementation: SDPA, eager, flash…), the KV cache and ``o_proj`` are Hugging Face's.

Keys in a KV cache are stored in the pair order too, consistently for every later query — a
cache filled by the unpatched model cannot be continued by the patched one (or the reverse).
``CodaLlamaAttention`` is a ``LlamaAttention`` (a subclass, when transformers is installed) and
returns the attention weights as it does, so ``model(..., output_attentions=True)`` collects them:
Hugging Face records the outputs of modules of that class.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from coda.blocks.llama import llama_attn_in_family

from .autograd import ExportedFunction, Tuning, export_autograd
from .checks import check_rms_norm
from .dtypes import autocast_dtype, run_in_dtype
from .resolve import dropin_programs


def llama_attn_in_function(
    eps: float, *, verify: bool = False, tune: Tuning = "quick"
) -> ExportedFunction:
    """``f(x, gamma, w_q, w_k, w_v, cos, sin) -> qkv`` (see the module docstring) for an input
    norm's epsilon; ``cos``/``sin`` are ``[tokens, head_dim]`` (Hugging Face's tables, one row
    per token). The Programs are the shipped verified ones (``coda.export.programs``), or with
    ``verify`` verified by the sandbox first (once per process)."""
    function = _attn_in_function(eps, verify)
    function.tune = tune
    return function


@lru_cache(maxsize=8)
def _attn_in_function(eps: float, verify: bool) -> ExportedFunction:
    # The backward takes the forward's output qkv instead of recomputing the QKV projection GEMM
    # for RoPE's inverse and the norm's statistic (q, k, v are views of it, which attention's own
    # backward may hold too; the memory this costs is not yet measured).
    keys = ("forward", "backward_saved")
    forward, backward = dropin_programs("llama_attn_in", keys, eps, verify=verify)
    return export_autograd(forward, backward, llama_attn_in_family(eps)["backward_saved"])


def check_llama_attention(attn: nn.Module) -> None:
    """``ValueError`` unless ``attn`` is a Hugging Face ``LlamaAttention`` with its forward (a
    subclass that overrides it is refused) that projects like ``llama_attn_in``: bias-free q/k/v
    projections, heads of ``head_dim`` with an even width.
    Look-alikes differ where the fused kernel cannot see it (Mistral's sliding window, Qwen3's
    per-head q/k norms before RoPE): they are refused, not silently computed as Llama."""
    try:
        from transformers.models.llama.modeling_llama import LlamaAttention
    except ImportError:  # no transformers: no Hugging Face attention to patch either
        LlamaAttention = None  # noqa: N806
    if LlamaAttention is None or not isinstance(attn, LlamaAttention):
        raise ValueError(
            f"self_attn is a {type(attn).__name__}, not Hugging Face's LlamaAttention: its "
            "forward may differ from what the llama_attn_in kernel computes (e.g. sliding "
            "windows, q/k norms); patch with attention=False to keep it"
        )
    if type(attn).forward is not LlamaAttention.forward:
        raise ValueError(
            f"self_attn is a {type(attn).__name__}, a LlamaAttention with its own forward; the "
            "llama_attn_in kernel computes LlamaAttention's — patch with attention=False to keep it"
        )
    for proj in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(getattr(attn, proj, None), "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"self_attn has no {proj} with a 2-D weight")
        if getattr(attn, proj).bias is not None:
            raise ValueError(f"self_attn.{proj} has a bias; the llama_attn_in block has none")
    head = getattr(attn, "head_dim", None)
    if not isinstance(head, int) or head % 2:
        raise ValueError(f"head_dim {head!r}: RoPE pairs need an even head width")
    for proj in ("q_proj", "k_proj"):
        if getattr(attn, proj).weight.shape[0] % head:
            raise ValueError(f"self_attn.{proj} has no whole number of heads of width {head}")


def _hf_llama_attention() -> type[nn.Module]:
    """Hugging Face's ``LlamaAttention`` class, or ``nn.Module`` without transformers."""
    try:
        from transformers.models.llama.modeling_llama import LlamaAttention
    except ImportError:
        return nn.Module
    return LlamaAttention


class CodaLlamaAttention(_hf_llama_attention()):
    """``self_attn(input_layernorm(x))`` of one decoder layer with the norm, Q/K/V projections and
    RoPE in one CODA kernel (``llama_attn_in``), in place of its ``LlamaAttention``.

    ``attn`` is the original ``LlamaAttention`` — its ``q_proj``, ``k_proj``, ``v_proj`` and
    ``o_proj`` become this module's (same parameters and state-dict keys) — and ``norm`` the
    layer's ``input_layernorm``, whose ``weight`` the kernel applies (the layer hands this module
    the un-normalized ``x`` once the norm is a ``DeferredRMSNorm``). ``forward`` takes what
    ``LlamaAttention.forward`` takes and returns ``(attn_output, attn_weights)``. Parameters must
    have ``x``'s dtype, or run under ``torch.autocast`` (then the kernel runs in the autocast
    dtype, as Hugging Face's projections do).
    """

    def __init__(
        self, attn: nn.Module, norm: nn.Module, *, verify: bool = False, tune: Tuning = "quick"
    ) -> None:
        nn.Module.__init__(self)  # not LlamaAttention's: it would build new projections
        check_llama_attention(attn)
        self.eps = check_rms_norm(norm, "input_layernorm")
        self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        self.o_proj = attn.o_proj
        for name in ("config", "layer_idx", "head_dim", "num_key_value_groups", "scaling"):
            setattr(self, name, getattr(attn, name, None))
        self.attention_dropout = float(getattr(attn, "attention_dropout", 0.0))
        self.is_causal = bool(getattr(attn, "is_causal", True))
        object.__setattr__(self, "norm", norm)  # the layer's module: not registered twice
        self._tune = tune
        self.function = llama_attn_in_function(self.eps, verify=verify, tune=tune)
        # looked up here, not in forward: torch.compile traces no import or signature inspection
        self._attention = _attention_interface(self.config)
        self._cache_takes_kwargs = _cache_update_takes_kwargs()

    def __getstate__(self) -> dict[str, Any]:  # the registered op neither pickles nor copies
        state = self.__dict__.copy()
        state["_tune"] = state.pop("function").tune
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.function = llama_attn_in_function(self.eps, verify=False, tune=self._tune)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[tokens, Nq + 2·Nkv]`` from ``x`` ``[..., hidden]`` and Hugging Face's rotary tables
        ``[..., T, head_dim]`` (broadcast over the batch when it is 1)."""
        flat = x.reshape(-1, x.shape[-1])
        weights = [self.norm.weight, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        tables = [
            t.expand(*x.shape[:-1], t.shape[-1]).reshape(flat.shape[0], -1) for t in (cos, sin)
        ]
        dtype = autocast_dtype(x, weights) or x.dtype  # under autocast: as HF's projections
        return run_in_dtype(self.function, dtype, flat, *weights, *tables)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if position_embeddings is None:
            raise ValueError("CodaLlamaAttention needs position_embeddings (cos, sin)")
        batch = hidden_states.shape[:-1]
        cos, sin = position_embeddings
        qkv = self.qkv(hidden_states, cos, sin).view(*batch, -1)
        widths = [self.q_proj.weight.shape[0], self.k_proj.weight.shape[0]]
        q, k, v = qkv.split([widths[0], widths[1], widths[1]], dim=-1)
        q, k, v = (t.view(*batch, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            if self._cache_takes_kwargs:  # newer transformers: the call's keyword arguments
                k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
            else:  # older: a dict of the rotary tables and positions
                tables = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
                k, v = cache.update(k, v, self.layer_idx, tables)
        impl, attention = self._attention
        if impl != getattr(self.config, "_attn_implementation", None):  # switched since
            self._attention = _attention_interface(self.config)
            attention = self._attention[1]
        out, weights = attention(
            self, q, k, v, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **kwargs,
        )  # fmt: skip
        out = out.reshape(*batch, -1).contiguous()
        return self.o_proj(out), weights


def _cache_update_takes_kwargs() -> bool:
    """Whether the installed transformers' ``Cache.update`` takes the attention call's keyword
    arguments (``kwargs=``, newer versions) rather than a ``cache_kwargs`` dict (older)."""
    from transformers.cache_utils import Cache

    return "cache_kwargs" not in inspect.signature(Cache.update).parameters


def _attention_interface(config: Any) -> tuple[str | None, Any]:
    """``(config._attn_implementation, Hugging Face's attention function for it)`` (eager by
    default), looked up as the installed transformers does."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    impl = getattr(config, "_attn_implementation", None)
    lookup = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)
    if lookup is not None:
        return impl, lookup(impl, eager_attention_forward)
    if impl in (None, "eager"):
        return impl, eager_attention_forward
    return impl, ALL_ATTENTION_FUNCTIONS[impl]
