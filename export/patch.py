"""Patch a whole Hugging Face Llama model in place: every decoder layer's norms, attention input
(Q/K/V projections + RoPE), attention output (``o_proj`` + residual) and MLP run on CODA kernels,
forward and backward.

``patch_llama(model)`` keeps Hugging Face's attention, caches, gradient checkpointing, generation
and state-dict keys. In each layer it swaps modules:

* ``post_attention_layernorm`` (and ``input_layernorm``) → ``DeferredRMSNorm``: hands its input
  through unchanged and keeps the norm's ``weight`` (the same Parameter, the same key) and
  epsilon — the normalization itself runs in the next module's kernels (docs/algebra.md §1: ``r``
  scales the GEMM's accumulator);
* ``mlp`` → ``CodaLlamaMLP``: ``mlp(norm(x))``, or ``x + mlp(norm(x))`` in one call, on the
  ``llama_mlp`` Programs (a ``CodaLlamaMLPBlock``), with the original ``gate_proj`` /
  ``up_proj`` / ``down_proj`` modules as its submodules;
* ``self_attn`` → ``CodaLlamaAttention`` (``attention=True``): the input norm, the three
  projections and RoPE as one ``llama_attn_in`` GEMM, then Hugging Face's attention function,
  cache and ``o_proj``;

and, with ``fuse_residual`` (default), the layer's forward: a Hugging Face ``LlamaDecoderLayer``
becomes a ``CodaLlamaDecoderLayer`` (its class swapped in place — same modules, hooks and keys)
that hands the MLP half's residual to the MLP, so ``h + mlp(norm(h))`` is one ``llama_mlp`` call:
the add happens in the down projection's epilogue and, in the backward, the residual's gradient
is accumulated in the RMSNorm-backward epilogue (docs/algebra.md §3) — two elementwise passes over
the residual stream less per layer and step. Under ``torch.autocast`` the add stays in the residual
stream's dtype, as Hugging Face's. The same layer hands its attention output to a
``CodaAttentionOutput`` (``coda.export.attn_out``): ``self_attn.o_proj`` becomes a
``DeferredOProj`` (same ``weight`` Parameter and key) and ``x + o_proj(a)`` one ``attn_out``
GEMM, the residual added in its epilogue. Other Llama-like layer classes keep their forward
(their MLP half patches all the same; ``patch_model`` patches their attention outputs).

Nothing changes before every replaced module is proven to sit in that dataflow: one forward of
the model on a few tokens, recorded by forward hooks (``coda.export.probe``), and each module's
own checks; anything else is refused with a ``ValueError`` naming the layer, module and reason.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention import CodaLlamaAttention, check_llama_attention
from .attn_out import (
    CodaAttentionOutput,
    CodaDecoderLayer,
    DeferredOProj,
    check_o_proj,
    coda_layer_class,
    hf_layer_class,
    mlp_half_form,
    register_layer_class,
)
from .autograd import Tuning
from .checks import HeldLinears, check_not_distributed, check_rms_norm
from .lm_head import install_fused_loss
from .mlp import CodaLlamaMLPBlock, check_llama_mlp, keep_hf_gate_up_keys
from .probe import (
    causal_lm_head,
    check_attention_half,
    check_attention_output,
    check_causal_lm_head,
    check_mlp_formula,
    check_mlp_half,
    probe_forward,
)


class DeferredRMSNorm(nn.Module):
    """A ``LlamaRMSNorm`` whose normalization runs in the module after it (``CodaLlamaMLP``,
    ``CodaLlamaAttention``): returns its input unchanged. ``weight`` is the original norm's
    Parameter (same state-dict key, same optimizer state); ``variance_epsilon`` its epsilon."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0)))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        shape, eps = tuple(self.weight.shape), self.variance_epsilon
        return f"{shape}, eps={eps}, deferred to the next module"


class CodaLlamaMLP(nn.Module):
    """``mlp(norm(x))`` of one decoder layer on CODA kernels, in place of its ``LlamaMLP``.

    The original MLP's submodules (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``; or
    Phi-3's ``gate_up_proj``, ``down_proj``, ``activation_fn``) are this module's, under the same
    names (Hugging Face's keys); the computation is ``block`` (a ``CodaLlamaMLPBlock(norm, mlp)``,
    built with or without its residual; held outside the module tree so no parameter is
    registered twice). A block built with ``fuse_gate_up`` puts its ``gate_up_weight`` here (the
    projections then hold no weight); state dicts keep ``gate_proj.weight`` / ``up_proj.weight``.

    Each call hands the block the weights as the model's modules hold them then (``weights``):
    ``norm`` (the layer's ``post_attention_layernorm``, not registered here) and this module's
    own. Whatever registers new parameters on the model's modules — FSDP2's ``fully_shard``
    (full weights while a layer runs, shards between), ``load_state_dict(assign=True)`` — is
    then what the kernels read and what gets the gradients.
    """

    _HF_KEYS = ("gate_proj.weight", "up_proj.weight")

    def __init__(
        self,
        block: CodaLlamaMLPBlock,
        norm: nn.Module | None = None,
        post_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        for name, child in block.mlp.named_children():
            setattr(self, name, child)
        linears = [n for n, child in self.named_children() if isinstance(child, nn.Linear)]
        self._held = HeldLinears(self, linears)  # the projections whose weights the kernels read
        if block.fused:
            self.gate_up_weight = block.gate_up_weight
            keep_hf_gate_up_keys(self)
        object.__setattr__(self, "block", block)  # not a submodule: see the class docstring
        object.__setattr__(self, "norm", block.norm if norm is None else norm)  # the layer's
        # a block with a post-norm (Gemma 2/3's post_feedforward_layernorm): the layer's too
        post = block.post_norm if post_norm is None else post_norm
        object.__setattr__(self, "post_norm", post)

    def weights(self) -> list[torch.Tensor]:
        """γ, the gate and up weights (or the packed one), the down weight (and the post-norm's
        weight): read from the modules that hold them now, in the order
        ``CodaLlamaMLPBlock.weights`` lists them."""
        self._held.check(self)
        fused = self.block.fused
        gate_up = [self.gate_up_weight] if fused else [*self.block.layout.split(self)]
        pre = [] if self.norm is None else [self.norm.weight]  # None: no pre-norm (OLMo 2)
        post = [] if self.post_norm is None else [self.post_norm.weight]
        return [*pre, *gate_up, self.down_proj.weight, *post]

    def forward(self, x: torch.Tensor, *, residual: bool = False) -> torch.Tensor:
        """``mlp(norm(x))``, as the ``LlamaMLP`` it replaces returns after its norm; with
        ``residual``, ``x + mlp(norm(x))`` in one call (``CodaLlamaDecoderLayer``'s), which
        needs a block built with ``residual=True``."""
        if not residual:
            return self.block.branch(x, self.weights())
        if not self.block.residual:
            raise ValueError(
                "CodaLlamaMLP(residual=True) needs a block built with residual=True "
                "(patch_llama(fuse_residual=True) builds one)"
            )
        return self.block(x, self.weights())


def _hf_llama_decoder_layer() -> type[nn.Module]:
    """Hugging Face's ``LlamaDecoderLayer`` class, or ``nn.Module`` without transformers."""
    try:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    except ImportError:
        return nn.Module
    return LlamaDecoderLayer


_LlamaDecoderLayer = _hf_llama_decoder_layer()


class CodaLlamaDecoderLayer(CodaDecoderLayer, _LlamaDecoderLayer):
    """A ``LlamaDecoderLayer`` whose MLP half adds its residual inside the MLP's kernels (and
    whose attention output runs on the ``attn_out`` kernels once installed).

    Never constructed: ``patch_llama(fuse_residual=True)`` swaps a patched layer's class to this
    one, so the layer keeps its modules, parameters, hooks and state-dict keys (and stays an
    instance of ``LlamaDecoderLayer``). ``forward`` is Hugging Face's (``CodaDecoderLayer``'s) —
    input norm (deferred), attention, ``residual +`` (or ``o_proj`` and the add as one
    ``attn_out`` call, ``install_attention_output``) — except its last lines:
    ``mlp(h, residual=True)`` computes ``h + mlp(post_attention_layernorm(h))`` as one
    ``llama_mlp`` call (the norm is deferred into it). Arguments after ``hidden_states`` go to
    ``self_attn`` by name, as Hugging Face's layer passes them.
    """

    hf_layer_class = _LlamaDecoderLayer


register_layer_class(_LlamaDecoderLayer, CodaLlamaDecoderLayer)


def patch_llama(
    model: nn.Module,
    *,
    verify: bool = False,
    saved: bool = True,
    tune: Tuning = "quick",
    fuse_gate_up: bool = False,
    fused_loss: bool = False,
    attention: bool = True,
    fuse_residual: bool = True,
) -> nn.Module:
    """Run every decoder layer's ``post_attention_layernorm`` + ``mlp`` on CODA kernels, in place;
    returns ``model``. ``attention`` (default): also its ``input_layernorm`` + ``self_attn``'s
    projections and RoPE (``CodaLlamaAttention``; attention that is not Hugging Face's
    ``LlamaAttention`` or has biases raises ``ValueError`` before any change, as does a norm that
    is not Llama's RMSNorm).

    Layers are the submodules that have both a ``post_attention_layernorm`` and an ``mlp``
    (``LlamaDecoderLayer``, and the same layout in Llama-like models); layers already patched are
    left alone. ``verify``, ``saved``, ``tune``, ``fuse_gate_up``: as ``CodaLlamaMLPBlock`` (the
    shipped verified Programs by default; ``verify=True`` verifies them in the sandbox, once per
    process and epsilon). Without ``fuse_gate_up`` the parameters
    stay the same objects (an optimizer built before patching keeps working); with it each
    layer's gate and up weights become one new parameter — build the optimizer after, and
    patch before wrapping the model for DDP or sharding it with FSDP2 (a model already wrapped
    or sharded is refused: ``check_not_distributed``). Every
    replaced module is checked first, on one probe forward of the model and by itself
    (``_prove``): a layer wired otherwise (OLMo-2's post-norms, a scaled residual) or a module
    the kernels cannot compute (a mixture of experts, a bias, an activation other than SiLU)
    raises ``ValueError`` naming the layer and module before any layer is changed.
    ``fused_loss``: also ``fuse_causal_lm_loss(model)`` — in training, ``model(..., labels=...)``
    computes the loss with the final norm, LM head and cross-entropy fused and returns no logits.
    ``fuse_residual`` (default): each Hugging Face ``LlamaDecoderLayer`` becomes a
    ``CodaLlamaDecoderLayer`` (class swapped in place), whose MLP half adds its residual in the
    down projection's epilogue (and its gradient in the backward's) and whose attention output
    ``x + o_proj(a)`` runs on the ``attn_out`` kernels (``o_proj`` deferred into them; an
    ``o_proj`` with a bias is refused — patch with ``fuse_residual=False``); ``False`` keeps
    Hugging Face's forward, its ``o_proj`` and both adds. ``attention`` does not decide the
    attention output: with ``attention=False`` Hugging Face's attention runs and hands the layer
    its output before ``o_proj``.
    """
    check_not_distributed(model)
    layers = [
        m
        for m in model.modules()
        if hasattr(m, "post_attention_layernorm") and hasattr(m, "mlp")
        and not isinstance(m.mlp, CodaLlamaMLP)
    ]  # fmt: skip
    if not layers and not any(isinstance(m, CodaLlamaMLP) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} has no decoder layer with a post_attention_layernorm and an "
            "mlp: patch_llama patches Llama-style decoder layers"
        )
    options: dict[str, Any] = {
        "verify": verify, "saved": saved, "tune": tune, "fuse_gate_up": fuse_gate_up,
        "residual": fuse_residual, "fuse_now": False,
    }  # fmt: skip
    attended = [m for m in model.modules() if _unpatched_attention(m)] if attention else []
    # o_proj + the attention residual: in Hugging Face's LlamaDecoderLayers, as the MLP's residual
    outputs = [layer for layer in layers if fuse_residual and type(layer) is _LlamaDecoderLayer]
    _prove(model, layers, attended, fused_loss, outputs)
    blocks = [
        CodaLlamaMLPBlock(layer.post_attention_layernorm, layer.mlp, **options) for layer in layers
    ]
    attns = [
        CodaLlamaAttention(layer.self_attn, layer.input_layernorm, verify=verify, tune=tune)
        for layer in attended
    ]
    attn_outs = [
        CodaAttentionOutput(layer.self_attn.o_proj, verify=verify, tune=tune) for layer in outputs
    ]  # every Program resolved before the first layer changes
    for layer, block in zip(layers, blocks, strict=True):
        fused = fuse_residual and type(layer) is _LlamaDecoderLayer
        install_mlp_half(layer, block, fuse_residual=fused)
    for layer, attn in zip(attended, attns, strict=True):
        install_attention_input(layer, attn)
    for layer, output in zip(outputs, attn_outs, strict=True):
        install_attention_output(layer, output)
    if fused_loss:
        install_fused_loss(model, verify=verify, tune=tune)
    return model


_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _prove(
    model: nn.Module,
    layers: list[nn.Module],
    attended: list[nn.Module],
    fused_loss: bool,
    outputs: list[nn.Module],
) -> None:
    """``ValueError`` (naming the layer, the module and the reason) unless every module about to
    be replaced sits where the patched layer computes with it and computes what its kernel does.

    One probe forward of the model (``coda.export.probe``) records each layer's dataflow: the MLP
    half must be ``h + mlp(post_attention_layernorm(h))``, the attention half (``attended``)
    ``x + self_attn(input_layernorm(x))`` with the rotary tables of the heads' width, and with
    ``fused_loss`` the logits ``lm_head(model.model.norm(h))`` and the loss their mean
    next-token cross-entropy, and for the attention outputs (``outputs``) ``x + o_proj(a)``
    reaching the MLP half with ``self_attn`` returning its ``o_proj``'s output (``a`` the
    attention before it). Then each module itself (``o_proj`` a bias-free linear): the MLP's
    projections and SiLU (and its recorded output recomputed from its weights), the attention
    class and projections, every norm an RMSNorm with a weight (``check_rms_norm``)."""
    if not (layers or attended or fused_loss or outputs):
        return
    names = {m: n for n, m in model.named_modules()}
    named = [(names.get(layer) or type(layer).__name__, layer) for layer in layers]
    named_attn = [(names.get(layer) or type(layer).__name__, layer) for layer in attended]
    head, head_error = _causal_lm_head(model) if fused_loss else ([], None)
    watched = list(head)
    for layer in dict.fromkeys([*layers, *attended]):
        parts = (getattr(layer, part, None) for part in _LAYER_PARTS)
        watched += [layer, *(p for p in parts if isinstance(p, nn.Module))]
    o_projs = (getattr(layer.self_attn, "o_proj", None) for layer in outputs)
    watched += [o_proj for o_proj in o_projs if isinstance(o_proj, nn.Module)]
    recording = probe_forward(model, watched, labels=fused_loss and head_error is None)
    for name, layer in named:
        check_mlp_half(recording, name, layer)
    for name, layer in named_attn:
        check_attention_half(recording, name, layer)
    for name, layer in named:
        _in_layer(name, check_llama_mlp, layer.mlp)
        check_mlp_formula(recording, name, layer.mlp)
        _in_layer(name, check_rms_norm, layer.post_attention_layernorm, "post_attention_layernorm")
    for name, layer in named_attn:
        _in_layer(name, check_llama_attention, layer.self_attn)
        _in_layer(name, check_rms_norm, layer.input_layernorm, "input_layernorm")
    for layer in outputs:
        name = names.get(layer) or type(layer).__name__
        try:
            _in_layer(name, check_o_proj, getattr(layer.self_attn, "o_proj", None))
            check_attention_output(recording, name, layer, "post_attention_layernorm")
        except ValueError as e:
            raise ValueError(
                f"{e} — patch with fuse_residual=False to keep o_proj and the attention residual"
            ) from e
    if head_error is not None:  # after the layers': theirs say more about the model
        raise head_error
    if fused_loss:
        check_causal_lm_head(recording, model)
        check_rms_norm(head[1], "model.model.norm")


def _causal_lm_head(model: nn.Module) -> tuple[list[nn.Module], ValueError | None]:
    """``causal_lm_head(model)`` as a list, or no modules and its ``ValueError``."""
    try:
        return list(causal_lm_head(model)), None
    except ValueError as e:
        return [], e


def _in_layer(name: str, check: Any, *args: Any) -> None:
    """``check(*args)``, its ``ValueError`` prefixed with the layer's name."""
    try:
        check(*args)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


_FORWARD_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def install_mlp_half(
    layer: nn.Module,
    block: CodaLlamaMLPBlock,
    *,
    fuse_residual: bool,
    norms: tuple[str, ...] = ("post_attention_layernorm",),
) -> None:
    """Run ``layer``'s MLP half on ``block``: each of ``norms`` (the MLP's input norm, then its
    post-norm if it has one; only the post-norm for a block without a pre-norm, OLMo 2's)
    becomes a ``DeferredRMSNorm`` and ``mlp`` a ``CodaLlamaMLP`` that
    reads the norms' weights from them — the modules that own them in the model, not the replaced
    norms (``CodaLlamaMLP``'s docstring says why); with ``fuse_residual`` the layer's class
    becomes ``CodaLlamaDecoderLayer`` (the residual added in the MLP's kernels)."""
    block.fuse_weights()  # (built with fuse_now=False: no module changed before installing)
    deferred: list[nn.Module | None] = [DeferredRMSNorm(getattr(layer, name)) for name in norms]
    for name, module in zip(norms, deferred, strict=True):
        _replace(layer, name, module)
    if block.norm is None:  # the post-norm alone
        deferred.insert(0, None)
    _replace(layer, "mlp", CodaLlamaMLP(block, *deferred))
    if fuse_residual:
        layer.__class__ = CodaLlamaDecoderLayer


def install_attention_input(layer: nn.Module, attn: nn.Module, *, defer_norm: bool = True) -> None:
    """Run ``layer``'s input norm and attention input on ``attn`` (a ``CodaLlamaAttention`` or
    its kin), which then reads the norm's weight from the ``DeferredRMSNorm`` put in its place;
    ``defer_norm=False``: replace the attention alone (no input norm in its kernel: OLMo 2's)."""
    if not defer_norm:
        _replace(layer, "self_attn", attn)
        return
    deferred = DeferredRMSNorm(layer.input_layernorm)
    _replace(layer, "input_layernorm", deferred)
    _replace(layer, "self_attn", attn)
    object.__setattr__(attn, "norm", deferred)  # as CodaLlamaAttention holds its norm


def install_attention_output(layer: nn.Module, output: CodaAttentionOutput) -> None:
    """Run ``layer``'s ``o_proj`` and attention residual (and the post-norm between them, where
    ``output`` has one) on ``output``: ``self_attn.o_proj`` becomes a ``DeferredOProj``, the
    post-norm a ``DeferredRMSNorm``, and the layer's class its ``CodaDecoderLayer`` subclass
    (``coda_layer_class``), which hands ``output`` the attention before ``o_proj`` and the
    residual and keeps the MLP half's form (``mlp_half_form``, taken before the swap). Install
    after the layer's attention input and MLP half: it defers the ``o_proj`` of the ``self_attn``
    the layer has then."""
    mlp_half = mlp_half_form(layer)
    attn = layer.self_attn
    _replace(attn, "o_proj", DeferredOProj(attn.o_proj))
    if output.kernel.post_norm:
        norm = layer.post_attention_layernorm
        _replace(layer, "post_attention_layernorm", DeferredRMSNorm(norm))
    layer.__class__ = coda_layer_class(hf_layer_class(layer))
    layer.coda_mlp_half = mlp_half
    layer.coda_attention_output = output


def attention_output_patched(layer: nn.Module) -> bool:
    """Whether ``layer``'s attention output already runs on a ``CodaAttentionOutput``."""
    return isinstance(getattr(layer, "coda_attention_output", None), CodaAttentionOutput)


def _replace(layer: nn.Module, name: str, new: nn.Module) -> None:
    """``layer.<name> = new``, ``new`` in the replaced module's training mode (the attention's
    dropout follows it) and with its forward hooks."""
    old = getattr(layer, name)
    new.train(old.training)
    _carry_forward_hooks(old, new)
    setattr(layer, name, new)


def _carry_forward_hooks(old: nn.Module, new: nn.Module) -> None:
    """Forward (pre-)hooks registered on a module being replaced run on its replacement, which
    takes the same inputs and returns the same outputs: Hugging Face's output recorders (installed
    on the first call that asked for ``output_attentions``) and a user's own hooks keep working.
    (A handle returned when such a hook was registered no longer removes it: it points at the
    replaced module.)"""
    for attr in _FORWARD_HOOKS:
        getattr(new, attr).update(getattr(old, attr))


def _unpatched_attention(module: nn.Module) -> bool:
    """A decoder layer with an ``input_layernorm`` and a ``self_attn`` not yet patched."""
    norm, attn = getattr(module, "input_layernorm", None), getattr(module, "self_attn", None)
    return norm is not None and attn is not None and not isinstance(attn, CodaLlamaAttention)
