"""The attention input of a Hugging Face Llama layer on CODA kernels: input RMSNorm + the Q, K, V
projections + RoPE as one GEMM (``llama_attn_in``, docs/algebra.md §2–3), and its backward.

* ``llama_attn_in_function(eps)``: ``f(x, gamma, w_q, w_k, w_v, cos, sin) -> qkv`` with autograd
  for ``x``, ``gamma`` and the three weights; the backward (``llama_attn_in_bwd_saved``) takes
  the returned ``qkv`` and recomputes no projection, and the input norm's statistic ``rstd_h``,
  which the training forward (``llama_attn_in_train``) returns too and a call does not.
  ``qkv = [q | k | v]`` ``[tokens, Nq + 2·Nkv]``; Q and K are rotated and come in the per-head
  adjacent-pair column order the fused kernel writes (``[r0, r_{D/2}, r1, r_{D/2+1}, …]`` of
  Hugging Face's rotate-half layout) — the
  attention scores, and so the attention output, are the same, because Q and K share the order.
* ``CodaLlamaAttention(attn, norm)``: a ``LlamaAttention`` whose input norm (the layer's
  ``input_layernorm``, which ``patch_llama`` turns into a ``DeferredRMSNorm``), projections and
  rotary embedding run in that one kernel; attention itself (Hugging Face's configured
  implementation: SDPA, eager, flash…), the KV cache and ``o_proj`` are Hugging Face's.
* ``hf_attn_in_function(kernel, eps)`` and the ``Coda<Class>`` drop-ins of Qwen2's, Qwen3's,
  Gemma 3's and OLMo 2's attention: the same with the kernels of ``qwen2_attn_in`` (biased
  projections), ``qwen3_attn_in`` (per-head q/k norms before RoPE), ``gemma3_attn_in`` (the same
  with Gemma's ``x̂ · (1 + w)`` for every norm) or ``olmo2_attn_in`` (no input norm; q/k norms
  over the whole projection), which return q, k and v separately in Hugging Face's own column
  order — the states its forward computes, bit for bit in layout. Gemma 2's attention runs on
  ``llama_attn_in`` (Gemma's ``γ = 1 + w``); its logit softcapping, ``query_pre_attn_scalar``
  scaling and per-layer sliding window are the attention function's arguments, passed as its
  forward passes them.
* ``AttentionRecipe``: which Hugging Face attention class the kernel's input fits, where that
  class keeps its Q/K/V weights (``QKVLayout``: Llama's three projections, or Phi-3's one
  ``qkv_proj`` read as row views) and which keyword arguments its forward hands the attention
  function besides Llama's (Mistral's sliding window). ``coda_attention_class(recipe)`` is the
  drop-in for it: ``CodaLlamaAttention`` for Llama's, else a ``Coda<Class>`` subclass of the
  Hugging Face class, so Hugging Face's output recorders still find it.

Keys in a KV cache are stored in the pair order too, consistently for every later query — a
cache filled by the unpatched model cannot be continued by the patched one (or the reverse).
``CodaLlamaAttention`` is a ``LlamaAttention`` (a subclass, when transformers is installed) and
returns the attention weights as it does, so ``model(..., output_attentions=True)`` collects them:
Hugging Face records the outputs of modules of that class.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from coda.blocks.llama import llama_attn_in_family
from coda.blocks.qwen import (
    gemma3_attn_in_family,
    olmo2_attn_in_family,
    qwen2_attn_in_family,
    qwen3_attn_in_family,
)
from coda.primitives.errors import ProgramError

from .autograd import ExportedFunction, Tuning, export_autograd
from .checks import GEMMA_OFFSET, HeldLinears, check_plain_linear, norm_gamma, rms_norm_form
from .dtypes import autocast_dtype, run_in_dtype
from .heads import split_heads
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
    # for RoPE's inverse (q, k, v are views of it, which attention's own backward may hold too;
    # the memory this costs is not yet measured), and the training forward's norm statistic
    # rstd_h (one float32 a row) instead of a pass over x; without gradients the plain forward
    # runs.
    keys = ("train", "backward_saved", "forward")
    train, backward, forward = dropin_programs("llama_attn_in", keys, eps, verify=verify)
    block = llama_attn_in_family(eps)["backward_saved"]
    return export_autograd(train, backward, block, inference=forward)


@dataclass(frozen=True)
class QKVLayout:
    """Where an attention module keeps its Q, K and V weights: ``projections`` are its
    projection submodules (kept by the drop-in under the same names, so state-dict keys stay);
    ``split(attn)`` returns ``(w_q, w_k, w_v)`` — the Parameters, or row views of one (then
    gradients reach that one Parameter)."""

    name: str
    projections: tuple[str, ...]
    split: Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _separate_qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight


def _concatenated_qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phi-3's ``qkv_proj`` rows: the query heads, then the key heads, then the value heads."""
    weight = attn.qkv_proj.weight
    nq = attn.config.num_attention_heads * attn.head_dim
    nkv = attn.config.num_key_value_heads * attn.head_dim
    return weight[:nq], weight[nq : nq + nkv], weight[nq + nkv :]


SEPARATE_QKV = QKVLayout("q_proj, k_proj, v_proj", ("q_proj", "k_proj", "v_proj"), _separate_qkv)
CONCATENATED_QKV = QKVLayout("qkv_proj = [q; k; v]", ("qkv_proj",), _concatenated_qkv)


def _no_extras(_attn: nn.Module) -> dict[str, Any]:
    return {}


def _config_sliding_window(attn: nn.Module) -> dict[str, Any]:
    """What Mistral's and Phi-3's forwards pass: the config's sliding window (None: none)."""
    return {"sliding_window": getattr(attn.config, "sliding_window", None)}


@dataclass(frozen=True)
class AttentionRecipe:
    """A Hugging Face attention class whose forward is Llama's but for where it keeps Q/K/V
    (``layout``) and what more it hands the attention function (``extras(attn)``, keyword
    arguments; the attention function itself stays Hugging Face's). ``hf_class`` is the class's
    import path; ``resolve()`` the class, or None when the installed transformers lacks it."""

    hf_class: str
    layout: QKVLayout = SEPARATE_QKV
    extras: Callable[[nn.Module], dict[str, Any]] = _no_extras
    # the block family whose kernels compute the class's attention input: ``llama_attn_in``
    # (bias-free projections, one [q | k | v] output), ``qwen2_attn_in`` (biased projections),
    # ``qwen3_attn_in`` / ``gemma3_attn_in`` (per-head q/k norms before RoPE, ``x̂ · w`` /
    # ``x̂ · (1 + w)``) or ``olmo2_attn_in`` (no input norm, q/k norms over the whole
    # projection), all but the first in Hugging Face's order
    kernel: str = "llama_attn_in"

    @property
    def input_norm(self) -> bool:
        """Whether the kernel normalizes the attention's input (all but OLMo 2's)."""
        return self.kernel != "olmo2_attn_in"

    @property
    def qk_norms(self) -> str | None:
        """The kernel's q/k norms: ``"head"`` (per head), ``"whole"`` (over the projection) or
        None."""
        return QK_NORMS.get(self.kernel)

    @property
    def class_name(self) -> str:
        return self.hf_class.rsplit(".", 1)[1]

    def resolve(self) -> type[nn.Module] | None:
        module, name = self.hf_class.rsplit(".", 1)
        try:
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None


LLAMA_ATTENTION = AttentionRecipe("transformers.models.llama.modeling_llama.LlamaAttention")
GEMMA_ATTENTION = AttentionRecipe("transformers.models.gemma.modeling_gemma.GemmaAttention")
MISTRAL_ATTENTION = AttentionRecipe(
    "transformers.models.mistral.modeling_mistral.MistralAttention",
    extras=_config_sliding_window,
)
PHI3_ATTENTION = AttentionRecipe(
    "transformers.models.phi3.modeling_phi3.Phi3Attention",
    layout=CONCATENATED_QKV,
    extras=_config_sliding_window,
)


def _layer_sliding_window(attn: nn.Module) -> dict[str, Any]:
    """What Qwen2's and Qwen3's forwards pass: the module's own sliding window (set per layer
    from ``config.layer_types``; None: none)."""
    return {"sliding_window": getattr(attn, "sliding_window", None)}


QWEN2_ATTENTION = AttentionRecipe(
    "transformers.models.qwen2.modeling_qwen2.Qwen2Attention",
    extras=_layer_sliding_window,
    kernel="qwen2_attn_in",
)
QWEN3_ATTENTION = AttentionRecipe(
    "transformers.models.qwen3.modeling_qwen3.Qwen3Attention",
    extras=_layer_sliding_window,
    kernel="qwen3_attn_in",
)
# Gemma 3: local (sliding) and global layers, each handed the rotary tables of its own base by
# the model; the forward passes its module's sliding window (no logit softcapping)
GEMMA3_ATTENTION = AttentionRecipe(
    "transformers.models.gemma3.modeling_gemma3.Gemma3Attention",
    extras=_layer_sliding_window,
    kernel="gemma3_attn_in",
)
OLMO2_ATTENTION = AttentionRecipe(
    "transformers.models.olmo2.modeling_olmo2.Olmo2Attention", kernel="olmo2_attn_in"
)


def _gemma2_extras(attn: nn.Module) -> dict[str, Any]:
    """What Gemma 2's forward passes: its layer's sliding window (None on global layers) and
    the attention-logit softcap (``softcap · tanh(scores / softcap)``, applied by the attention
    function to the scores, which the pair order of q and k leaves unchanged)."""
    return {**_layer_sliding_window(attn), "softcap": getattr(attn, "attn_logit_softcapping", None)}


GEMMA2_ATTENTION = AttentionRecipe(
    "transformers.models.gemma2.modeling_gemma2.Gemma2Attention", extras=_gemma2_extras
)
# the q/k norms of each kernel's block: per head (weight [head_dim]) or over the whole
# projection (weights [Nq], [Nkv]), and the offset their weights take (Gemma's 1 + w)
QK_NORMS = {"qwen3_attn_in": "head", "gemma3_attn_in": "head", "olmo2_attn_in": "whole"}
QK_NORM_OFFSETS = {"gemma3_attn_in": GEMMA_OFFSET}


def check_llama_attention(attn: nn.Module) -> None:
    """``ValueError`` unless ``attn`` is a Hugging Face ``LlamaAttention`` with its forward (a
    subclass that overrides it is refused) that projects like ``llama_attn_in``: bias-free q/k/v
    projections, heads of ``head_dim`` with an even width.
    Look-alikes differ where the fused kernel cannot see it (Mistral's sliding window, Qwen3's
    per-head q/k norms before RoPE): they are refused, not silently computed as Llama."""
    check_attention(attn, LLAMA_ATTENTION)


def check_attention(attn: nn.Module, recipe: AttentionRecipe) -> None:
    """``ValueError`` unless ``attn`` is an instance of ``recipe``'s Hugging Face class with that
    class's own forward, its Q/K/V projections (``recipe.layout``) 2-D weights of whole heads of
    an even ``head_dim``, with biases exactly when the recipe's kernel adds them
    (``qwen2_attn_in``), and per-head q/k RMSNorms when its kernel applies them
    (``qwen3_attn_in``)."""
    cls, name = recipe.resolve(), recipe.class_name
    if cls is None or not isinstance(attn, cls):
        raise ValueError(
            f"self_attn is a {type(attn).__name__}, not Hugging Face's {name}: its "
            "forward may differ from what the llama_attn_in kernel computes (e.g. sliding "
            "windows, q/k norms); patch with attention=False to keep it"
        )
    if type(attn).forward is not cls.forward:
        raise ValueError(
            f"self_attn is a {type(attn).__name__}, a {name} with its own forward; the "
            f"{recipe.kernel} kernel computes {name}'s — patch with attention=False to keep it"
        )
    biased = recipe.kernel == "qwen2_attn_in"
    for proj in recipe.layout.projections:
        weight = getattr(getattr(attn, proj, None), "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"self_attn has no {proj} with a 2-D weight")
        check_plain_linear(getattr(attn, proj), f"self_attn.{proj}")
        if (getattr(attn, proj).bias is not None) != biased:
            has = "has a bias" if not biased else "has no bias"
            want = "adds one to each projection" if biased else "has none"
            raise ValueError(f"self_attn.{proj} {has}; the {recipe.kernel} block {want}")
    head = getattr(attn, "head_dim", None)
    if not isinstance(head, int) or head % 2:
        raise ValueError(f"head_dim {head!r}: RoPE pairs need an even head width")
    w_q, w_k, w_v = recipe.layout.split(attn)
    for proj, weight in (("q", w_q), ("k", w_k)):
        if weight.shape[0] % head or weight.shape[0] == 0:
            raise ValueError(
                f"self_attn's {proj} rows are no whole number of heads of width {head}"
            )
    if w_v.shape[0] != w_k.shape[0]:
        raise ValueError(
            f"self_attn's v rows ({w_v.shape[0]}) are not as many as its k rows ({w_k.shape[0]})"
        )
    if recipe.qk_norms:
        head_norm_eps(attn, recipe.kernel)


def check_head_norms(attn: nn.Module, input_eps: float, kernel: str = "qwen3_attn_in") -> None:
    """``ValueError`` unless ``attn``'s q/k norms (``head_norm_eps``) use the input norm's
    epsilon ``input_eps``: ``kernel`` (``qwen3_attn_in``, ``gemma3_attn_in``) has one epsilon
    for all its norms (the config's ``rms_norm_eps``)."""
    eps = head_norm_eps(attn, kernel)
    if eps != input_eps:
        raise ValueError(
            f"self_attn's q_norm/k_norm epsilon {eps:g} is not input_layernorm's {input_eps:g}; "
            f"the {kernel} kernel applies one epsilon to every norm"
        )


def head_norm_eps(attn: nn.Module, kernel: str = "qwen3_attn_in") -> float:
    """The epsilon of ``attn``'s ``q_norm`` and ``k_norm``; ``ValueError`` unless both are
    RMSNorms of the form ``kernel`` applies with one epsilon: ``x̂ · weight`` over each head
    (``qwen3_attn_in``, weights ``[head_dim]``), ``x̂ · (1 + weight)`` over each head
    (``gemma3_attn_in``) or ``x̂ · weight`` over the whole projection (``olmo2_attn_in``,
    weights as wide as the q and k projections)."""
    whole = QK_NORMS.get(kernel) == "whole"
    offset = QK_NORM_OFFSETS.get(kernel, 0.0)
    w_q, w_k, _ = _separate_qkv(attn) if whole else (None, None, None)
    found = []
    for name, weight in (("q_norm", w_q), ("k_norm", w_k)):
        norm = getattr(attn, name, None)
        if norm is None:
            raise ValueError(f"self_attn has no {name}: the {kernel} kernel applies one")
        eps, _ = rms_norm_form(norm, f"self_attn.{name}", offsets=(offset,))
        want = (weight.shape[0],) if whole else (attn.head_dim,)
        if norm.weight.shape != want:
            what = "row of its projection" if whole else "column of a head"
            how = "the whole projection" if whole else "each head"
            raise ValueError(
                f"self_attn.{name}'s weight is {tuple(norm.weight.shape)}, not one value per "
                f"{what} {want}: the {kernel} kernel normalizes {how}"
            )
        found.append(eps)
    if found[0] != found[1]:
        raise ValueError(
            f"self_attn's q_norm and k_norm use different epsilons {found}; the {kernel} "
            "kernel applies one"
        )
    return found[0]


def _hf_llama_attention() -> type[nn.Module]:
    """Hugging Face's ``LlamaAttention`` class, or ``nn.Module`` without transformers."""
    return LLAMA_ATTENTION.resolve() or nn.Module


class _CodaAttentionIn(nn.Module):
    """``self_attn(input_layernorm(x))`` with the norm, Q/K/V projections and RoPE in one CODA
    kernel (``llama_attn_in``); the subclasses (``coda_attention_class``) add the Hugging Face
    attention class and ``recipe``.

    ``attn`` is the original attention module — its projections (``recipe.layout``) and
    ``o_proj`` become this module's (same parameters and state-dict keys) — and ``norm`` the
    layer's ``input_layernorm``, whose ``weight`` the kernel applies (``1 + weight`` for Gemma's
    RMSNorm: ``rms_norm_form``; the layer hands this module the un-normalized ``x`` once the norm
    is a ``DeferredRMSNorm``). ``forward`` takes what the Hugging Face forward takes and returns
    ``(attn_output, attn_weights)``. Parameters must have ``x``'s dtype, or run under
    ``torch.autocast`` (then the kernel runs in the autocast dtype, as Hugging Face's
    projections do).
    """

    recipe: AttentionRecipe = LLAMA_ATTENTION

    def __init__(
        self,
        attn: nn.Module,
        norm: nn.Module | None,
        *,
        verify: bool = False,
        tune: Tuning = "quick",
    ) -> None:
        nn.Module.__init__(self)  # not the Hugging Face class's: it would build new projections
        check_attention(attn, self.recipe)
        if self.recipe.input_norm:
            if norm is None:
                raise ValueError(f"the {self.recipe.kernel} kernel needs the input_layernorm")
            self.eps, self.norm_offset = rms_norm_form(norm, "input_layernorm")
        else:  # OLMo 2: no input norm, the q/k norms' epsilon
            self.eps, self.norm_offset = head_norm_eps(attn, self.recipe.kernel), 0.0
        for proj in (*self.recipe.layout.projections, "o_proj"):
            setattr(self, proj, getattr(attn, proj))
        # the projections the kernel reads (o_proj is called as a module)
        self._held = HeldLinears(self, self.recipe.layout.projections)
        names = ("config", "layer_idx", "head_dim", "num_key_value_groups", "scaling")
        for name in (*names, "layer_type", "sliding_window", "attn_logit_softcapping"):
            setattr(self, name, getattr(attn, name, None))
        self.num_key_value_heads = getattr(attn, "num_key_value_heads", None)
        self.attention_dropout = float(getattr(attn, "attention_dropout", 0.0))
        self.is_causal = bool(getattr(attn, "is_causal", True))
        object.__setattr__(self, "norm", norm)  # the layer's module: not registered twice
        self._tune = tune
        self._take_extras(attn)
        self.function = self._exported(verify, tune)
        self._check_sizes()
        # looked up here, not in forward: torch.compile traces no import or signature inspection
        self._attention = _attention_interface(self.config, self.recipe)
        self._cache_takes_kwargs = _cache_update_takes_kwargs()

    def __getstate__(self) -> dict[str, Any]:  # the registered op neither pickles nor copies
        state = self.__dict__.copy()
        state["_tune"] = state.pop("function").tune
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.function = self._exported(False, self._tune)

    def _take_extras(self, attn: nn.Module) -> None:
        """Take what the kernel applies besides the projections and the input norm (none here)."""

    def _exported(self, verify: bool, tune: Tuning) -> ExportedFunction:
        """The exported kernels this drop-in runs (``llama_attn_in``'s)."""
        return llama_attn_in_function(self.eps, verify=verify, tune=tune)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[tokens, Nq + 2·Nkv]`` from ``x`` ``[..., hidden]`` and Hugging Face's rotary tables
        ``[..., T, head_dim]`` (broadcast over the batch when it is 1)."""
        return self._qkv(x, cos, sin, self.recipe.layout.split(self))

    def _qkv(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        projections: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``qkv`` with the Q, K and V weights given (``recipe.layout.split(self)``)."""
        arguments = self._arguments(x, cos, sin, projections)
        return run_in_dtype(self.function, self._dtype(x, arguments), *arguments)

    def _weights(self, projections: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The kernel's arguments between ``x`` and the rotary tables: the input norm's γ
        (``norm_gamma``), then the Q, K and V weights."""
        return [norm_gamma(self.norm.weight, self.norm_offset), *projections]

    def _arguments(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        projections: tuple[torch.Tensor, ...],
    ) -> list[torch.Tensor]:
        """The exported function's arguments for ``x`` ``[..., hidden]`` and the rotary tables
        ``[..., T, head_dim]``: the tokens as rows, the weights (``_weights``), the tables
        broadcast over the batch."""
        self._held.check(self)
        flat = x.reshape(-1, x.shape[-1])
        tables = [
            t.expand(*x.shape[:-1], t.shape[-1]).reshape(flat.shape[0], -1) for t in (cos, sin)
        ]
        return [flat, *self._weights(projections), *tables]

    @staticmethod
    def _dtype(x: torch.Tensor, arguments: list[torch.Tensor]) -> torch.dtype:
        """The dtype the kernels run in: autocast's, as Hugging Face's projections, else ``x``'s
        (which every weight — ``arguments`` between the rows and the tables — must have)."""
        return autocast_dtype(x, arguments[1:-2]) or x.dtype

    def _check_sizes(self) -> None:
        """``ValueError`` unless the exported Programs accept this module's sizes (its weights'
        shapes, its head width) — at construction, where a report can keep the module, rather
        than at the first forward."""
        projections = self.recipe.layout.split(self)
        w = projections[0]
        x = torch.empty(1, 2, w.shape[1], dtype=w.dtype, device="meta")
        table = torch.empty(1, 2, self.head_dim, dtype=w.dtype, device="meta")
        try:
            self.function.check_arguments(*self._arguments(x, table, table, projections))
        except ProgramError as e:
            raise ValueError(
                f"the {self.recipe.kernel} kernels cannot run {type(self).__name__} at its sizes "
                f"(hidden {w.shape[1]}, head_dim {self.head_dim}): {e}"
            ) from None

    def project_heads(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q, k and v as heads ``[B, heads, T, head_dim]`` from ``x`` ``[B, T, hidden]``:
        views of ``qkv`` whose backward packs the three gradients in one copy
        (``heads.split_heads``)."""
        projections = self.recipe.layout.split(self)
        qkv = self._qkv(x, cos, sin, projections).view(*x.shape[:-1], -1)
        nkv = projections[1].shape[0]
        widths = (qkv.shape[-1] - 2 * nkv, nkv, nkv)
        return split_heads(qkv, widths, self.head_dim)

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
            raise ValueError(f"{type(self).__name__} needs position_embeddings (cos, sin)")
        batch = hidden_states.shape[:-1]
        cos, sin = position_embeddings
        q, k, v = self.project_heads(hidden_states, cos, sin)
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            if self._cache_takes_kwargs:  # newer transformers: the call's keyword arguments
                k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
            else:  # older: a dict of the rotary tables and positions
                tables = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
                k, v = cache.update(k, v, self.layer_idx, tables)
        impl, attention = self._attention
        if impl != getattr(self.config, "_attn_implementation", None):  # switched since
            self._attention = _attention_interface(self.config, self.recipe)
            attention = self._attention[1]
        out, weights = attend(self, self.recipe, attention, q, k, v, attention_mask, kwargs)
        return self.o_proj(out.reshape(*batch, -1).contiguous()), weights


def attend(
    attn: nn.Module,
    recipe: AttentionRecipe,
    attention: Callable[..., Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hugging Face's ``attention`` function on rotated heads ``[B, heads, T, D]``, with the
    arguments the recipe's Hugging Face forward passes it (dropout while training, scaling, the
    recipe's extras, the call's other keyword arguments); ``attn`` is the module it reads its
    head counts from (the original or the drop-in)."""
    return attention(attn, q, k, v, mask, **attention_arguments(attn, recipe, kwargs))


def attention_arguments(
    attn: nn.Module, recipe: AttentionRecipe, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The keyword arguments ``attend`` hands the attention function: dropout (while
    training), ``attn.scaling``, the recipe's extras, then the call's ``kwargs``."""
    dropout = 0.0 if not attn.training else float(getattr(attn, "attention_dropout", 0.0))
    return {"dropout": dropout, "scaling": attn.scaling, **recipe.extras(attn), **kwargs}


class CodaLlamaAttention(_CodaAttentionIn, _hf_llama_attention()):
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

    recipe = LLAMA_ATTENTION


class _CodaAttentionInHFOrder(_CodaAttentionIn):
    """The attention input on a Hugging Face-order kernel (``recipe.kernel``: ``qwen2_attn_in``,
    ``qwen3_attn_in``): q, k, v come out as three tensors in Hugging Face's own rotate-half
    column order — exactly the states Hugging Face's forward hands its attention function (and
    its KV cache) — with the projections' biases (Qwen2) or the per-head ``q_norm``/``k_norm``
    (Qwen3, kept as this module's submodules) applied in the kernel. The backward recomputes the
    projection (``<kernel>_bwd``)."""

    def _take_extras(self, attn: nn.Module) -> None:
        """The per-head ``q_norm``/``k_norm`` (Qwen3, Gemma 3, OLMo 2), checked, kept as this
        module's submodules."""
        if self.recipe.qk_norms:
            if self.recipe.input_norm:
                check_head_norms(attn, self.eps, self.recipe.kernel)
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm

    def _exported(self, verify: bool, tune: Tuning) -> ExportedFunction:
        return hf_attn_in_function(self.recipe.kernel, self.eps, verify=verify, tune=tune)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        arguments = self._arguments(x, cos, sin, self.recipe.layout.split(self))
        q, k, v = run_in_dtype(self.function, self._dtype(x, arguments), *arguments)
        return q.view(*x.shape[:-1], -1), k.view(*x.shape[:-1], -1), v.view(*x.shape[:-1], -1)

    def _weights(self, projections: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """γ (none for OLMo 2), the Q, K and V weights, then Qwen2's biases or the q/k norms'
        weights."""
        if self.recipe.kernel == "qwen2_attn_in":
            extra = [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]
        else:
            extra = [self.q_norm.weight, self.k_norm.weight]
        return [*self._gamma(), *projections, *extra]

    def project_heads(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``project``'s q, k and v (three tensors of the kernel) as heads ``[B, heads, T, D]``."""
        heads = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = self.project(x, cos, sin)
        return (
            q.view(heads).transpose(1, 2),
            k.view(heads).transpose(1, 2),
            v.view(heads).transpose(1, 2),
        )

    def _gamma(self) -> list[torch.Tensor]:
        """The input norm's weight as the kernel's block takes it (none for OLMo 2's): the block
        of ``gemma3_attn_in`` applies Gemma's ``1 + w`` itself, the others take ``γ``
        (``norm_gamma``: ``1 + w`` for a Gemma norm)."""
        if not self.recipe.input_norm:
            return []
        offset = self.norm_offset - INPUT_NORM_OFFSETS.get(self.recipe.kernel, 0.0)
        return [norm_gamma(self.norm.weight, offset)]


# the offset each Hugging Face-order block's input norm applies itself (Gemma 3's 1 + w)
INPUT_NORM_OFFSETS = {"gemma3_attn_in": GEMMA_OFFSET}
_HF_ORDER_FAMILIES = {
    "qwen2_attn_in": qwen2_attn_in_family,
    "qwen3_attn_in": qwen3_attn_in_family,
    "gemma3_attn_in": gemma3_attn_in_family,
    "olmo2_attn_in": olmo2_attn_in_family,
}


def hf_attn_in_function(
    kernel: str, eps: float, *, verify: bool = False, tune: Tuning = "quick"
) -> ExportedFunction:
    """``f(x, [gamma,] w_q, w_k, w_v, <b_q, b_k, b_v | q_norm, k_norm>, cos, sin) -> (q_rot,
    k_rot, v)`` for ``kernel`` (``qwen2_attn_in``, ``qwen3_attn_in``, ``gemma3_attn_in`` or
    ``olmo2_attn_in``, which has no ``gamma``: the block's inputs in order) at an RMSNorm
    epsilon, with autograd for every input but the tables; the shipped
    verified Programs, or with ``verify`` verified by the sandbox first (once per process)."""
    function = _hf_attn_in_function(kernel, eps, verify)
    function.tune = tune
    return function


@lru_cache(maxsize=8)
def _hf_attn_in_function(kernel: str, eps: float, verify: bool) -> ExportedFunction:
    forward, backward = dropin_programs(kernel, ("forward", "backward"), eps, verify=verify)
    return export_autograd(forward, backward, _HF_ORDER_FAMILIES[kernel](eps)["backward"])


_DROP_INS: dict[AttentionRecipe, type[nn.Module]] = {LLAMA_ATTENTION: CodaLlamaAttention}


@functools.cache
def coda_attention_class(recipe: AttentionRecipe) -> type[nn.Module]:
    """The drop-in class for ``recipe``'s Hugging Face attention: ``CodaLlamaAttention`` for
    Llama's, else ``Coda<Class>``, a subclass of that class (built once, named in this module so
    a pickled model finds it). ``ValueError`` when the installed transformers lacks the class."""
    if recipe in _DROP_INS:
        return _DROP_INS[recipe]
    base = recipe.resolve()
    if base is None:
        raise ValueError(f"the installed transformers has no {recipe.hf_class}")
    name = f"Coda{base.__name__}"
    doc = f"``{base.__name__}`` with its input norm, Q/K/V and RoPE in ``{recipe.kernel}``."
    dropin = _CodaAttentionIn if recipe.kernel == "llama_attn_in" else _CodaAttentionInHFOrder
    cls = type(name, (dropin, base), {"recipe": recipe, "__doc__": doc})
    cls.__module__, cls.__qualname__ = __name__, name
    setattr(sys.modules[__name__], name, cls)
    return cls


def _cache_update_takes_kwargs() -> bool:
    """Whether the installed transformers' ``Cache.update`` takes the attention call's keyword
    arguments (``kwargs=``, newer versions) rather than a ``cache_kwargs`` dict (older)."""
    from transformers.cache_utils import Cache

    return "cache_kwargs" not in inspect.signature(Cache.update).parameters


def attention_interface(config: Any, recipe: AttentionRecipe) -> Callable[..., Any]:
    """Hugging Face's attention function for ``config._attn_implementation``, the recipe's
    module's ``eager_attention_forward`` by default, looked up as the installed transformers
    does."""
    return _attention_interface(config, recipe)[1]


def _attention_interface(config: Any, recipe: AttentionRecipe) -> tuple[str | None, Any]:
    """``(config._attn_implementation, attention_interface(config, recipe))``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cls = recipe.resolve()
    eager = getattr(sys.modules[cls.__module__], "eager_attention_forward", None) if cls else None
    if eager is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as eager
    impl = getattr(config, "_attn_implementation", None)
    lookup = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)
    if lookup is not None:
        return impl, lookup(impl, eager)
    if impl in (None, "eager"):
        return impl, eager
    return impl, ALL_ATTENTION_FUNCTIONS[impl]


_RECIPES = {
    r.class_name: r
    for r in (
        LLAMA_ATTENTION, GEMMA_ATTENTION, MISTRAL_ATTENTION, PHI3_ATTENTION, QWEN2_ATTENTION,
        QWEN3_ATTENTION, GEMMA2_ATTENTION, GEMMA3_ATTENTION, OLMO2_ATTENTION,
    )
}  # fmt: skip


def __getattr__(name: str) -> Any:
    """``Coda<Class>`` drop-in classes built on first use (a model pickled with one loads in a
    process that has not built it yet)."""
    recipe = _RECIPES.get(name.removeprefix("Coda")) if name.startswith("Coda") else None
    if recipe is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return coda_attention_class(recipe)
