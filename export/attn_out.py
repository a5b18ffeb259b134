"""The attention-output drop-in: a decoder layer's ``o_proj`` and attention residual (and the
post-norm between them, where the layer has one) in one CODA kernel, forward and backward.

Hugging Face's layers compute ``h = x + o_proj(a)`` (Llama, Mistral, Qwen2/3, Phi-3, Gemma) or
``h = x + post_attention_layernorm(o_proj(a))`` (Gemma 2/3's sandwich norm, OLMo 2's post-norm),
``a`` the attention's heads concatenated and ``x`` the layer's input. ``CodaAttentionOutput``
computes ``h`` on the ``attn_out`` Programs (or ``gemma2_attn_out``: a ``(1 + w)`` post-norm;
``olmo2_attn_out``: an ``x̂ · w`` one): the residual is added in ``o_proj``'s epilogue, and the
post-norm's statistic is summed there and finished by aux ``norm_rows`` together with the add.

It needs the attention's output before ``o_proj`` and the residual, so the layer hands them over:
``self_attn.o_proj`` becomes a ``DeferredOProj`` (passes its input through, keeps the ``weight``
Parameter under its key), a post-norm a ``DeferredRMSNorm``, and the layer's class a
``CodaDecoderLayer`` subclass of its own class (``coda_layer_class``: swapped in place, so
modules, hooks and state-dict keys stay) whose forward is Hugging Face's with the attention
output computed by the drop-in. The MLP half after it keeps its layer's form
(``coda_mlp_half``: ``h + mlp(post_attention_layernorm(h))``, Phi-3's with its
``resid_mlp_dropout``, Gemma 2/3's sandwich, OLMo 2's ``h + post_feedforward_layernorm(mlp(h))``,
or ``CodaLlamaDecoderLayer``'s MLP with its residual in its own kernels), which the patch proves
on the probe forward before installing it. Consequence: ``self_attn`` called by itself returns
the attention *before* ``o_proj`` once the layer is patched.

Under ``torch.autocast`` with weights and residual stream in another dtype (Hugging Face's mixed
precision) the drop-in computes what the modules do, with them: ``o_proj`` (and the post-norm's
own forward, with the weight the model holds now) in the autocast dtype, the add in the residual
stream's dtype — no kernel fuses anything there.

Not done: handing the MLP half's RMSNorm its statistic ``rstd`` from this epilogue (the
``llama_attn_out`` block's ``RowRstd``). The MLP-half kernels compute ``rstd`` themselves; they
would need variants that take it as an input before the statistic could be handed on.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from .autograd import ExportedFunction, Tuning, export_autograd
from .checks import GEMMA_OFFSET, check_plain_linear, rms_norm_form
from .dtypes import autocast_dtype
from .programs import FAMILIES, SHIPPED_EPS
from .resolve import dropin_programs


@dataclass(frozen=True)
class AttentionOutputKernel:
    """The shipped block family that computes one form of attention output: ``name`` (the
    family in ``coda.export.programs``), with a post-norm of ``offset`` (0: ``x̂ · w``; 1:
    Gemma's ``x̂ · (1 + w)``) between ``o_proj`` and the add when ``post_norm``."""

    name: str
    post_norm: bool
    offset: float = 0.0

    @property
    def formula(self) -> str:
        """What the kernels compute, for reports and errors."""
        if not self.post_norm:
            return "x + o_proj(a)"
        norm = "x̂ · (1 + w)" if self.offset else "x̂ · w"
        return f"x + post_attention_layernorm(o_proj(a)) ({norm})"


ATTN_OUT = AttentionOutputKernel("attn_out", post_norm=False)
GEMMA2_ATTN_OUT = AttentionOutputKernel("gemma2_attn_out", post_norm=True, offset=GEMMA_OFFSET)
OLMO2_ATTN_OUT = AttentionOutputKernel("olmo2_attn_out", post_norm=True)


def attention_output_kernel(post_norm: nn.Module | None) -> tuple[float, AttentionOutputKernel]:
    """``(eps, kernel)`` for an attention output with ``post_norm`` (or none): the plain
    ``attn_out`` kernels, or the post-norm ones of the norm's form; ``ValueError`` naming the
    norm when it is no RMSNorm of either form."""
    if post_norm is None:
        return SHIPPED_EPS, ATTN_OUT
    eps, offset = rms_norm_form(post_norm, "post_attention_layernorm")
    return eps, GEMMA2_ATTN_OUT if offset else OLMO2_ATTN_OUT


def attention_output_function(
    kernel: AttentionOutputKernel, eps: float, *, verify: bool = False, tune: Tuning = "quick"
) -> ExportedFunction:
    """``f(attn, w_o, x[, gamma]) -> x_out`` with autograd: ``kernel``'s forward Program and its
    backward (gradients of ``attn``, ``w_o``, ``x`` and the post-norm's ``gamma``, the norm's own
    weight), at the post-norm's epsilon ``eps``; the shipped verified Programs unless
    ``verify`` (then verified by the sandbox, once per process)."""
    function = _attention_output_function(kernel.name, eps, verify)
    function.tune = tune
    return function


@lru_cache(maxsize=16)
def _attention_output_function(name: str, eps: float, verify: bool) -> ExportedFunction:
    forward, backward = dropin_programs(name, ("forward", "backward"), eps, verify=verify)
    return export_autograd(forward, backward, FAMILIES[name].blocks(eps)["backward"])


class DeferredOProj(nn.Module):
    """An ``o_proj`` whose product runs in the layer's attention-output kernel: returns its input
    unchanged. ``weight`` is the original projection's Parameter (same key, same optimizer
    state); ``in_features`` / ``out_features`` are its sizes."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.weight = linear.weight
        self.out_features, self.in_features = linear.weight.shape

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias=False, "
            "deferred to the layer's attention output"
        )


class CodaAttentionOutput:
    """``x + [post_norm](o_proj(a))`` of one decoder layer on CODA kernels (module docstring).

    ``o_proj`` is the layer's ``self_attn.o_proj`` (a bias-free linear) and ``post_norm`` its
    ``post_attention_layernorm`` where it normalizes the attention output (Gemma 2/3, OLMo 2),
    else None. Not a module: the layer holds it outside its module tree, and each call reads the
    weights from the modules that hold them in the model then (the ``DeferredOProj`` and
    ``DeferredRMSNorm`` put in their places), so FSDP2's gathered parameters and
    ``load_state_dict(assign=True)`` are what the kernels read and what gets the gradients.
    """

    def __init__(
        self,
        o_proj: nn.Module,
        post_norm: nn.Module | None = None,
        *,
        verify: bool = False,
        tune: Tuning = "quick",
    ) -> None:
        check_o_proj(o_proj)
        self.eps, self.kernel = attention_output_kernel(post_norm)
        self.post_norm = post_norm  # Hugging Face's module: its forward serves under autocast
        self.verify = verify
        self.function = attention_output_function(self.kernel, self.eps, verify=verify, tune=tune)

    # The exported function holds process-wide registered ops, which neither pickle nor copy:
    # copies carry how to resolve it and resolve it again.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tune"] = state.pop("function").tune
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        tune = state.pop("_tune")
        self.__dict__.update(state)
        self.function = attention_output_function(
            self.kernel, self.eps, verify=self.verify, tune=tune
        )

    def weights(self, layer: nn.Module) -> list[torch.Tensor]:
        """``o_proj``'s weight (and the post-norm's), as ``layer``'s modules hold them now."""
        w_o = layer.self_attn.o_proj.weight
        return [w_o, layer.post_attention_layernorm.weight] if self.kernel.post_norm else [w_o]

    def __call__(self, layer: nn.Module, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x + [post_norm](attn @ w_oᵀ)`` for ``attn`` ``[..., heads·D]`` (the attention before
        ``o_proj``) and the residual ``x`` ``[..., d]``, with ``layer``'s weights."""
        weights = self.weights(layer)
        flat_x = x.reshape(-1, x.shape[-1])
        if autocast_dtype(flat_x, [attn, *weights]) is not None:
            return x + self._modules_forward(attn, weights)
        out = self.function(attn.reshape(-1, attn.shape[-1]), weights[0], flat_x, *weights[1:])
        return torch.ops.aten._unsafe_view(out, x.shape)  # a tensor of its own, as mlp.py's

    def _modules_forward(self, attn: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """``[post_norm](o_proj(attn))`` as Hugging Face's modules compute it (under autocast),
        with the weights the model holds now."""
        y = nn.functional.linear(attn, weights[0])
        if not self.kernel.post_norm:
            return y
        return torch.func.functional_call(self.post_norm, {"weight": weights[1]}, (y,))


def check_o_proj(o_proj: Any) -> None:
    """``ValueError`` unless ``o_proj`` is a bias-free linear projection (a module with a 2-D
    ``weight`` whose recorded output the probe checks is ``a @ weightᵀ``)."""
    weight = getattr(o_proj, "weight", None)
    if not isinstance(o_proj, nn.Module) or not isinstance(weight, torch.Tensor):
        raise ValueError(
            f"self_attn.o_proj ({type(o_proj).__name__}) has no weight: the attention-output "
            "kernels compute x + a @ o_proj.weightᵀ"
        )
    if weight.dim() != 2:
        raise ValueError(f"self_attn.o_proj.weight is {weight.dim()}-D, not a [d, heads·D] matrix")
    check_plain_linear(o_proj, "self_attn.o_proj")
    if getattr(o_proj, "bias", None) is not None:
        raise ValueError(
            "self_attn.o_proj has a bias (attention_bias=True?); the attention-output kernels "
            "have none"
        )


# -- the decoder layer -----------------------------------------------------------------------------


def _fused_mlp_half(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return layer.mlp(h, residual=True)  # CodaLlamaMLP: h + mlp(norm(h)) in its kernels


def _pre_norm_mlp_half(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    out = layer.mlp(layer.post_attention_layernorm(h))
    dropout = getattr(layer, "resid_mlp_dropout", None)  # Phi-3's
    return h + (out if dropout is None else dropout(out))


def _sandwich_mlp_half(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    mlp = layer.mlp(layer.pre_feedforward_layernorm(h))
    return h + layer.post_feedforward_layernorm(mlp)


def _post_norm_mlp_half(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h + layer.post_feedforward_layernorm(layer.mlp(h))


# How a patched layer's MLP half runs, by the name a layer keeps in ``coda_mlp_half``.
MLP_HALVES = {
    "fused": _fused_mlp_half,
    "pre_norm": _pre_norm_mlp_half,
    "sandwich": _sandwich_mlp_half,
    "post_norm": _post_norm_mlp_half,
}


class CodaDecoderLayer(nn.Module):
    """The forward of a patched decoder layer (a mixin before a Hugging Face layer class).

    Hugging Face's forward, generically: ``x`` through ``input_layernorm`` (where the layer has
    one; OLMo 2's has none), ``self_attn`` with the layer's other arguments by name (its
    forward's defaults for those the caller leaves out), then the
    attention output — ``coda_attention_output(layer, a, x)`` (a ``CodaAttentionOutput``), or
    ``x + a`` where the layer keeps Hugging Face's ``o_proj`` — and the MLP half
    ``MLP_HALVES[coda_mlp_half]``. Which forms a layer has is proven on the probe forward
    before its class is swapped to one with this forward; ``hf_layer_class`` is the Hugging
    Face class whose positional parameters the forward takes.
    """

    hf_layer_class: type = nn.Module
    coda_mlp_half = "fused"
    coda_attention_output: CodaAttentionOutput | None = None
    # hf_layer_class's forward: its parameters after hidden_states and their defaults (read per
    # class when it is made, not in forward: torch.compile warns of tracing a cached function)
    hf_parameters: tuple[str, ...] = ()
    hf_defaults: dict[str, Any] = {}  # noqa: RUF012 - per class, set by __init_subclass__

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.hf_parameters = layer_parameters(cls.hf_layer_class)
        cls.hf_defaults = layer_defaults(cls.hf_layer_class)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:  # positional arguments by the original forward's names
            kwargs.update(zip(self.hf_parameters, args, strict=False))
        kwargs = {**self.hf_defaults, **kwargs}  # as the original passes them
        residual = hidden_states
        norm = self._modules.get("input_layernorm")
        if norm is not None:
            hidden_states = norm(hidden_states)
        attn = self.self_attn(hidden_states=hidden_states, **kwargs)[0]
        output = self.coda_attention_output
        h = residual + attn if output is None else output(self, attn, residual)
        return MLP_HALVES[self.coda_mlp_half](self, h)


@functools.cache
def layer_parameters(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s parameters after ``hidden_states``, in order."""
    names = list(inspect.signature(cls.forward).parameters)
    return tuple(n for n in names[2:] if n not in ("args", "kwargs"))


@functools.cache
def layer_defaults(cls: type) -> dict[str, Any]:
    """The defaults of ``cls.forward``'s named parameters after ``hidden_states``: what a Hugging
    Face layer hands its ``self_attn`` when its caller leaves them out (``use_cache=False``, …)."""
    parameters = inspect.signature(cls.forward).parameters
    return {
        n: parameters[n].default
        for n in layer_parameters(cls)
        if parameters[n].default is not inspect.Parameter.empty
    }


_LAYER_CLASSES: dict[type, type] = {}


def coda_layer_class(base: type) -> type:
    """The patched-layer class for the Hugging Face layer class ``base``: ``CodaDecoderLayer``'s
    forward on ``base`` (still an instance of it: Hugging Face's output recorders and gradient
    checkpointing find it), named ``Coda<base>`` in this module so a pickled model finds it.
    ``register_layer_class`` gives a base a class of its own (``CodaLlamaDecoderLayer``)."""
    if base in _LAYER_CLASSES:
        return _LAYER_CLASSES[base]
    name = f"Coda{base.__name__}"
    doc = f"``{base.__name__}`` whose forward is ``CodaDecoderLayer``'s."
    cls = type(name, (CodaDecoderLayer, base), {"hf_layer_class": base, "__doc__": doc})
    cls.__module__, cls.__qualname__ = __name__, name
    setattr(sys.modules[__name__], name, cls)
    _LAYER_CLASSES[base] = cls
    return cls


def register_layer_class(base: type, cls: type) -> None:
    """Use ``cls`` (a ``CodaDecoderLayer`` subclass of ``base``) as ``base``'s patched class."""
    _LAYER_CLASSES[base] = cls


def hf_layer_class(layer: nn.Module) -> type:
    """The Hugging Face class of ``layer``, patched or not."""
    cls = type(layer)
    return cls.hf_layer_class if issubclass(cls, CodaDecoderLayer) else cls


def __getattr__(name: str) -> Any:
    """``Coda<Layer>`` classes built on first use (a pickled model loads in a process that has
    not built them yet): the base is the class of that name in a loaded transformers module."""
    base_name = name.removeprefix("Coda")
    if name.startswith("Coda"):
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith("transformers.models."):
                continue
            base = getattr(module, base_name, None)
            if isinstance(base, type) and issubclass(base, nn.Module):
                return coda_layer_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def mlp_half_form(layer: nn.Module) -> str:
    """Which of ``MLP_HALVES`` a layer's MLP half is, by its modules: a patched layer's own;
    Gemma 2/3's sandwich (``pre_`` and ``post_feedforward_layernorm``); OLMo 2's post-norm
    (``post_feedforward_layernorm``, no ``input_layernorm``); else ``h +
    mlp(post_attention_layernorm(h))``. The probe proves the form (``coda.export.probe``)."""
    if isinstance(layer, CodaDecoderLayer):
        return layer.coda_mlp_half
    modules = layer._modules
    if modules.get("pre_feedforward_layernorm") is not None and "post_feedforward_layernorm" in (
        modules
    ):
        return "sandwich"
    if modules.get("post_feedforward_layernorm") is not None and "input_layernorm" not in modules:
        return "post_norm"
    return "pre_norm"
