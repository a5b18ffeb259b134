"""``patch_model``: patch whatever a Hugging Face causal LM's decoder layers let the shipped kernels
compute exactly, keep the rest, and say which is which.

A decoder layer has four module kinds (``KINDS``): the input norm + attention input (norm, Q/K/V
projections, RoPE: ``llama_attn_in``, also Gemma 2's with its softcapped scores left to Hugging
Face's attention function; Qwen2's biases: ``qwen2_attn_in``; Qwen3's per-head q/k norms:
``qwen3_attn_in``; Gemma 3's with ``(1 + w)``: ``gemma3_attn_in``; OLMo 2's, no input norm and
q/k norms over the whole projection: ``olmo2_attn_in``), the attention output (``o_proj`` and the
attention residual: ``attn_out``; through Gemma 2/3's ``(1 + w)`` post-norm: ``gemma2_attn_out``;
through OLMo 2's ``x̂ · w`` one: ``olmo2_attn_out`` — installed last, it swaps the layer's class
for one whose forward hands the drop-in the attention before ``o_proj``), the MLP half
(post-attention norm + SwiGLU MLP + residual: ``llama_mlp``; Gemma's GeGLU under its ``(1 + w)``
norm: ``gemma_mlp``; Gemma 2/3's between sandwich norms: ``gemma2_mlp_branch``; OLMo 2's, no
pre-norm and a post-norm: ``olmo2_mlp_branch``) and, once per model, the final norm + LM head loss
(``llama_lm_head_ce``; Gemma 2's logits softcapped at 30: ``lm_head_softcap_ce``). Which recipe
patches a kind is decided by what the modules *are* — their classes and submodules — never by
the model's name; ``config.model_type`` only names the family in the report.

``RECIPES`` is the table: each ``Recipe`` has a ``kind``, an ``applies(module)`` test on the
module's structure (an attention class, an MLP's projection names), a ``prove(recording, name,
layer)`` that raises ``ValueError`` unless the layer computes, on the recorded probe forward
(``coda.export.probe``), exactly what the drop-in does, and a ``build(layer, options)`` that
resolves the drop-in's verified Programs and returns how to install it. Adding a family whose
modules a shipped kernel computes is adding a row (an ``AttentionRecipe`` or ``GateUpLayout``
for another weight layout or attention class), not a branch. A kind that no recipe applies to,
or whose proof fails in any layer, stays Hugging Face's in every layer, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .attention import (
    GEMMA2_ATTENTION,
    GEMMA3_ATTENTION,
    GEMMA_ATTENTION,
    LLAMA_ATTENTION,
    MISTRAL_ATTENTION,
    OLMO2_ATTENTION,
    PHI3_ATTENTION,
    QK_NORM_OFFSETS,
    QWEN2_ATTENTION,
    QWEN3_ATTENTION,
    AttentionRecipe,
    _CodaAttentionIn,
    attend,
    attention_arguments,
    attention_interface,
    check_attention,
    check_head_norms,
    coda_attention_class,
    head_norm_eps,
)
from .attn_out import (
    ATTN_OUT,
    GEMMA2_ATTN_OUT,
    OLMO2_ATTN_OUT,
    AttentionOutputKernel,
    CodaAttentionOutput,
    attention_output_kernel,
    check_o_proj,
    mlp_half_form,
)
from .autograd import Tuning
from .checks import check_not_distributed, check_plain_linear, check_rms_norm, rms_norm_form
from .lm_head import final_logit_softcap, install_fused_loss, lm_head_family
from .mlp import (
    CONCATENATED_GATE_UP,
    GEMMA2_MLP,
    GEMMA_MLP,
    OLMO2_MLP,
    SEPARATE_GATE_UP,
    CodaLlamaMLPBlock,
    GateUpLayout,
    MLPKernel,
    mlp_activation,
    mlp_half_kernel,
)
from .patch import (
    _LAYER_PARTS,
    CodaLlamaMLP,
    _in_layer,
    _LlamaDecoderLayer,
    attention_output_patched,
    install_attention_input,
    install_attention_output,
    install_mlp_half,
)
from .probe import (
    SANDWICH_NORMS,
    Recording,
    causal_lm_head,
    check_attention_arguments,
    check_attention_calls,
    check_attention_formula,
    check_attention_half,
    check_attention_output,
    check_causal_lm_head,
    check_mlp_formula,
    check_mlp_half,
    check_post_norm_mlp_half,
    check_sandwich_attention_half,
    check_sandwich_mlp_half,
    probe_forward,
)

ATTENTION_INPUT = "input norm + attention input"
ATTENTION_OUTPUT = "attention output"
MLP_HALF = "MLP half"
LM_HEAD_LOSS = "final norm + LM head loss"
KINDS = (ATTENTION_INPUT, ATTENTION_OUTPUT, MLP_HALF, LM_HEAD_LOSS)

# config.model_type -> the family's name in reports (unlisted types are named by model_type)
FAMILY_NAMES = {
    "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi-3",
    "gemma": "Gemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3", "gemma3": "Gemma 3",
    "olmo2": "OLMo 2",
}  # fmt: skip


@dataclass(frozen=True)
class Options:
    """What ``patch_model`` was asked for, handed to each recipe's ``build``."""

    verify: bool = False
    saved: bool = True
    tune: Tuning = "quick"
    fuse_gate_up: bool = False
    fuse_residual: bool = True


Install = Callable[[], None]


@dataclass(frozen=True)
class Recipe:
    """How one module kind of a decoder layer is patched (see the module docstring): ``name``
    says which kernel on which weights; ``applies(layer)`` whether the layer's modules have the
    structure this recipe is for; ``prove(recording, name, layer)`` raises ``ValueError``
    (naming the layer) unless the layer computes what the drop-in does; ``build(layer,
    options)`` resolves the drop-in and returns the function that installs it."""

    kind: str
    name: str
    applies: Callable[[nn.Module], bool]
    prove: Callable[[Recording, str, nn.Module], None]
    build: Callable[[nn.Module, Options], Install]


# -- the MLP half ----------------------------------------------------------------------------------


def _mlp_recipe(layout: GateUpLayout) -> Recipe:
    """The MLP half on ``llama_mlp`` for MLPs that keep gate and up as ``layout`` says."""

    def applies(layer: nn.Module) -> bool:
        mlp = getattr(layer, "mlp", None)
        return not isinstance(mlp, CodaLlamaMLP) and hasattr(mlp, layout.weights[0])

    def prove(recording: Recording, name: str, layer: nn.Module) -> None:
        norm = getattr(layer, "post_attention_layernorm", None)
        if norm is None:
            raise ValueError(
                f"{name} has no post_attention_layernorm: the llama_mlp kernels normalize the "
                "MLP's input with it"
            )
        _all_reasons(
            lambda: _in_layer(name, layout.check, layer.mlp),
            lambda: _in_layer(name, check_rms_norm, norm, "post_attention_layernorm"),
            lambda: check_mlp_half(recording, name, layer),
        )
        check_mlp_formula(recording, name, layer.mlp, layout.split(layer.mlp))

    def build(layer: nn.Module, options: Options) -> Install:
        block = CodaLlamaMLPBlock(
            layer.post_attention_layernorm, layer.mlp, verify=options.verify,
            saved=options.saved, tune=options.tune, residual=_fuses_residual(layer, options),
            fuse_gate_up=options.fuse_gate_up and layout is SEPARATE_GATE_UP, layout=layout,
            fuse_now=False,
        )  # fmt: skip

        return lambda: install_mlp_half(layer, block, fuse_residual=_fuses_residual(layer, options))

    return Recipe(MLP_HALF, f"llama_mlp on {layout.name}", applies, prove, build)


def _gemma_mlp_recipe() -> Recipe:
    """Gemma's MLP half on ``gemma_mlp``: a GeGLU (``gelu_pytorch_tanh``) MLP with separate
    gate and up projections under the layer's ``(1 + w)`` ``post_attention_layernorm``, wired
    as Llama's layer (``h + mlp(norm(h))``: Gemma 1). Applies to MLPs whose gate activation is
    tanh-GELU; other layers keep the Llama recipe (and its reasons)."""
    layout = SEPARATE_GATE_UP

    def applies(layer: nn.Module) -> bool:
        mlp = getattr(layer, "mlp", None)
        return (
            not isinstance(mlp, CodaLlamaMLP)
            and hasattr(mlp, layout.weights[0])
            and mlp_activation(mlp) == GEMMA_MLP.act
            and not _sandwiched(layer)
        )

    def prove(recording: Recording, name: str, layer: nn.Module) -> None:
        norm = getattr(layer, "post_attention_layernorm", None)
        if norm is None:
            raise ValueError(
                f"{name} has no post_attention_layernorm: the gemma_mlp kernels normalize the "
                "MLP's input with it"
            )
        _all_reasons(
            lambda: _in_layer(name, _check_kernel, GEMMA_MLP, norm, layer.mlp, None),
            lambda: _in_layer(name, layout.check, layer.mlp, GEMMA_MLP),
            lambda: check_mlp_half(recording, name, layer),
        )
        _check_formula(recording, name, layer.mlp, GEMMA_MLP)

    def build(layer: nn.Module, options: Options) -> Install:
        block = CodaLlamaMLPBlock(
            layer.post_attention_layernorm, layer.mlp, verify=options.verify,
            saved=options.saved, tune=options.tune, residual=_fuses_residual(layer, options),
            fuse_gate_up=options.fuse_gate_up, fuse_now=False,
        )  # fmt: skip

        return lambda: install_mlp_half(layer, block, fuse_residual=False)

    return Recipe(MLP_HALF, f"gemma_mlp on {layout.name}", applies, prove, build)


_SANDWICH = SANDWICH_NORMS  # Gemma 2/3's norms before and after the MLP


def _sandwiched(layer: nn.Module) -> bool:
    """Whether ``layer`` has Gemma 2/3's norms before and after its MLP."""
    return all(isinstance(getattr(layer, n, None), nn.Module) for n in _SANDWICH)


def _gemma2_mlp_recipe() -> Recipe:
    """Gemma 2/3's MLP half on ``gemma2_mlp_branch``: ``pre_feedforward_layernorm`` → GeGLU MLP
    → ``post_feedforward_layernorm`` (both ``(1 + w)`` RMSNorms of one epsilon) in the MLP's
    kernels, both norms deferred; the layer's forward adds the residual, as Hugging Face's."""
    layout = SEPARATE_GATE_UP

    def applies(layer: nn.Module) -> bool:
        mlp = getattr(layer, "mlp", None)
        patched = isinstance(mlp, CodaLlamaMLP)
        return not patched and hasattr(mlp, layout.weights[0]) and _sandwiched(layer)

    def prove(recording: Recording, name: str, layer: nn.Module) -> None:
        pre, post = (getattr(layer, n) for n in _SANDWICH)
        _all_reasons(
            lambda: _in_layer(name, _check_kernel, GEMMA2_MLP, pre, layer.mlp, post),
            lambda: _in_layer(name, layout.check, layer.mlp, GEMMA2_MLP),
            lambda: check_sandwich_mlp_half(recording, name, layer, _SANDWICH),
        )
        _check_formula(recording, name, layer.mlp, GEMMA2_MLP)

    def build(layer: nn.Module, options: Options) -> Install:
        pre, post = (getattr(layer, n) for n in _SANDWICH)
        block = CodaLlamaMLPBlock(
            pre, layer.mlp, verify=options.verify, saved=options.saved, tune=options.tune,
            residual=False, fuse_gate_up=options.fuse_gate_up, post_norm=post, fuse_now=False,
        )  # fmt: skip

        return lambda: install_mlp_half(layer, block, fuse_residual=False, norms=_SANDWICH)

    name = f"gemma2_mlp_branch on {layout.name} between {' and '.join(_SANDWICH)}"
    return Recipe(MLP_HALF, name, applies, prove, build)


_POST_NORM = SANDWICH_NORMS[1]  # OLMo 2's post_feedforward_layernorm, without a pre-norm


def _olmo2_mlp_recipe() -> Recipe:
    """OLMo 2's MLP half on ``olmo2_mlp_branch``: the SwiGLU MLP of the residual stream itself
    (no pre-norm) → ``post_feedforward_layernorm`` (``w · x̂``), the norm deferred into the MLP's
    kernels; the layer's forward adds the residual, as Hugging Face's."""
    layout = SEPARATE_GATE_UP

    def applies(layer: nn.Module) -> bool:
        mlp = getattr(layer, "mlp", None)
        patched = isinstance(mlp, CodaLlamaMLP)
        post_only = isinstance(getattr(layer, _POST_NORM, None), nn.Module)
        return (
            not patched and hasattr(mlp, layout.weights[0]) and post_only and not _sandwiched(layer)
        )

    def prove(recording: Recording, name: str, layer: nn.Module) -> None:
        post = getattr(layer, _POST_NORM)
        _all_reasons(
            lambda: _in_layer(name, _check_kernel, OLMO2_MLP, None, layer.mlp, post),
            lambda: _in_layer(name, layout.check, layer.mlp, OLMO2_MLP),
            lambda: check_post_norm_mlp_half(recording, name, layer),
        )
        _check_formula(recording, name, layer.mlp, OLMO2_MLP)

    def build(layer: nn.Module, options: Options) -> Install:
        block = CodaLlamaMLPBlock(
            None, layer.mlp, verify=options.verify, saved=options.saved, tune=options.tune,
            residual=False, fuse_gate_up=options.fuse_gate_up, post_norm=getattr(layer, _POST_NORM),
            fuse_now=False,
        )  # fmt: skip

        return lambda: install_mlp_half(layer, block, fuse_residual=False, norms=(_POST_NORM,))

    return Recipe(
        MLP_HALF, f"olmo2_mlp_branch on {layout.name} before {_POST_NORM}", applies, prove, build
    )


def _check_kernel(
    kernel: MLPKernel, norm: nn.Module | None, mlp: nn.Module, post_norm: nn.Module | None
) -> None:
    """``ValueError`` unless ``kernel`` is what computes these modules' MLP half."""
    found = mlp_half_kernel(norm, mlp, post_norm)[1]
    if found is not kernel:
        raise ValueError(
            f"the MLP half is computed by the {found.name} kernels, not {kernel.name}'s"
        )


def _check_formula(recording: Recording, name: str, mlp: nn.Module, kernel: MLPKernel) -> None:
    check_mlp_formula(recording, name, mlp, act=kernel.act, kernels=kernel.name)


def _fuses_residual(layer: nn.Module, options: Options) -> bool:
    """Whether the layer's MLP half adds its residual in the MLP's kernels: a Hugging Face
    ``LlamaDecoderLayer`` (its class becomes ``CodaLlamaDecoderLayer``); other layer classes
    keep their forward and add, so that Hugging Face's output recorders still find them."""
    return options.fuse_residual and type(layer) is _LlamaDecoderLayer


# -- the attention input ---------------------------------------------------------------------------


def _attention_recipe(recipe: AttentionRecipe) -> Recipe:
    """The input norm + attention input on ``llama_attn_in`` for ``recipe``'s attention class."""

    def applies(layer: nn.Module) -> bool:
        attn, cls = getattr(layer, "self_attn", None), recipe.resolve()
        return cls is not None and cls in type(attn).__mro__ and not _patched_attention(attn)

    def prove(recording: Recording, name: str, layer: nn.Module) -> None:
        attn, norm = layer.self_attn, getattr(layer, "input_layernorm", None)
        if not recipe.input_norm:  # OLMo 2's: the attention module alone is replaced
            _all_reasons(
                lambda: _in_layer(name, check_attention, attn, recipe),
                lambda: check_attention_calls(recording, name, layer),
            )
        else:
            if norm is None:
                raise ValueError(_no_input_norm(name))
            _all_reasons(
                lambda: _in_layer(name, check_attention, attn, recipe),
                lambda: _in_layer(name, rms_norm_form, norm, "input_layernorm"),
                lambda: _attention_half(recording, name, layer),
            )
        if recipe.qk_norms and recipe.input_norm:
            eps = rms_norm_form(norm, "input_layernorm")[0]
            _in_layer(name, check_head_norms, attn, eps, recipe.kernel)
        attention = attention_interface(attn.config, recipe)

        def run(q: Any, k: Any, v: Any, mask: Any, kwargs: dict[str, Any]) -> Any:
            return attend(attn, recipe, attention, q, k, v, mask, kwargs)

        check_attention_formula(
            recording, name, attn, recipe.layout.split(attn), run, **_kernel_extras(recipe, attn)
        )
        check_attention_arguments(
            recording, name, attn, lambda kwargs: attention_arguments(attn, recipe, kwargs)
        )

    def build(layer: nn.Module, options: Options) -> Install:
        cls = coda_attention_class(recipe)
        norm = layer.input_layernorm if recipe.input_norm else None
        attn = cls(layer.self_attn, norm, verify=options.verify, tune=options.tune)

        return lambda: install_attention_input(layer, attn, defer_norm=recipe.input_norm)

    name = f"{recipe.kernel} on {recipe.class_name}'s {recipe.layout.name}"
    return Recipe(ATTENTION_INPUT, name, applies, prove, build)


def _attention_half(recording: Recording, name: str, layer: nn.Module) -> None:
    """The layer's attention half as the patched layer computes it (``check_attention_half``),
    or between sandwich norms (Gemma 2/3: ``check_sandwich_attention_half``)."""
    post = isinstance(getattr(layer, "post_attention_layernorm", None), nn.Module)
    if post and _sandwiched(layer):
        check_sandwich_attention_half(recording, name, layer)
    else:
        check_attention_half(recording, name, layer)


def _kernel_extras(recipe: AttentionRecipe, attn: nn.Module) -> dict[str, Any]:
    """What the recipe's kernel adds to the plain projections, as ``check_attention_formula``
    takes it: Qwen2's biases, Qwen3's and Gemma 3's per-head q/k norms (Gemma's with their
    offset), OLMo 2's q/k norms over the whole projection."""
    if recipe.kernel == "qwen2_attn_in":
        return {"biases": (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)}
    if recipe.qk_norms is None:
        return {}
    norms = (attn.q_norm.weight, attn.k_norm.weight, head_norm_eps(attn, recipe.kernel))
    if recipe.qk_norms == "whole":
        return {"whole_norms": norms}
    return {"head_norms": norms, "norm_offset": QK_NORM_OFFSETS.get(recipe.kernel, 0.0)}


def _patched_attention(attn: Any) -> bool:
    return isinstance(attn, _CodaAttentionIn)


def _no_input_norm(name: str) -> str:
    return (
        f"{name} has no input_layernorm: the layer does not normalize its input before "
        "attention (post-norms, as OLMo 2's), and the kernels of this attention class "
        "normalize it (olmo2_attn_in, which does not, is proven for Olmo2Attention only)"
    )


# -- the attention output --------------------------------------------------------------------------

# The module whose input is what the attention output hands the MLP half, per MLP-half form.
_MLP_HALF_INPUT = {
    "pre_norm": "post_attention_layernorm", "fused": "post_attention_layernorm",
    "sandwich": "pre_feedforward_layernorm", "post_norm": "mlp",
}  # fmt: skip


def _post_normed(layer: nn.Module) -> bool:
    """Whether ``layer``'s ``post_attention_layernorm`` normalizes the attention output: a layer
    with a ``post_feedforward_layernorm`` (Gemma 2/3's sandwich, OLMo 2's post-norms)."""
    return isinstance(layer._modules.get("post_feedforward_layernorm"), nn.Module)


def _post_norm_offset(layer: nn.Module) -> float | None:
    """The form (offset) of ``layer``'s ``post_attention_layernorm`` as an RMSNorm, or None."""
    try:
        return rms_norm_form(layer.post_attention_layernorm, "post_attention_layernorm")[1]
    except (AttributeError, ValueError):
        return None


def _attention_output_recipe(kernel: AttentionOutputKernel) -> Recipe:
    """``o_proj`` + the attention residual on ``kernel``'s Programs: ``attn_out`` for layers that
    add ``o_proj``'s output to the residual, ``gemma2_attn_out`` / ``olmo2_attn_out`` for layers
    whose ``post_attention_layernorm`` (of that form) normalizes it first."""

    def applies(layer: nn.Module) -> bool:
        o_proj = getattr(getattr(layer, "self_attn", None), "o_proj", None)
        if not isinstance(o_proj, nn.Module) or attention_output_patched(layer):
            return False
        if not kernel.post_norm:
            return not _post_normed(layer)
        return _post_normed(layer) and _post_norm_offset(layer) == kernel.offset

    def prove(recording: Recording, name: str, layer: nn.Module) -> None:
        form = mlp_half_form(layer)
        norm = layer.post_attention_layernorm if kernel.post_norm else None
        _all_reasons(
            lambda: _in_layer(name, check_o_proj, layer.self_attn.o_proj),
            lambda: _in_layer(name, _check_layer_dropouts, layer),
            lambda: _in_layer(name, _check_mlp_half_modules, layer, form),
        )
        _MLP_HALF_CHECKS[form](recording, name, layer)
        eps = attention_output_kernel(norm)[0]
        post = (norm, eps, kernel.offset) if norm is not None else None
        check_attention_output(recording, name, layer, _MLP_HALF_INPUT[form], post)

    def build(layer: nn.Module, options: Options) -> Install:
        norm = layer.post_attention_layernorm if kernel.post_norm else None
        output = CodaAttentionOutput(
            layer.self_attn.o_proj, norm, verify=options.verify, tune=options.tune
        )
        return lambda: install_attention_output(layer, output)

    return Recipe(ATTENTION_OUTPUT, f"{kernel.name}: {kernel.formula}", applies, prove, build)


_MLP_HALF_CHECKS: dict[str, Callable[[Recording, str, nn.Module], None]] = {
    "pre_norm": check_mlp_half,
    "fused": check_mlp_half,
    "sandwich": check_sandwich_mlp_half,
    "post_norm": check_post_norm_mlp_half,
}


def _check_layer_dropouts(layer: nn.Module) -> None:
    """``ValueError`` for a dropout of the layer's own with ``p > 0`` but Phi-3's
    ``resid_mlp_dropout`` (which the patched forward applies): Hugging Face's forward may apply
    it in training where the patched one does not (Phi-3's ``resid_attn_dropout`` on
    ``o_proj``'s output before the add, with ``resid_pdrop > 0``) — the probe runs in eval mode,
    where a dropout shows nothing."""
    for child, module in layer.named_children():
        p = float(getattr(module, "p", 0.0)) if isinstance(module, nn.Dropout) else 0.0
        if p > 0 and child != "resid_mlp_dropout":
            raise ValueError(
                f"{child} has p = {p:g}: in training the layer drops parts of its values "
                "(o_proj's output before the residual add?), which the patched layer's forward "
                "does not — set that dropout to 0 to patch the attention output"
            )


# The modules each MLP-half form's forward calls, besides the attention output's.
_MLP_HALF_MODULES = {
    "pre_norm": ("post_attention_layernorm", "mlp"), "fused": ("post_attention_layernorm", "mlp"),
    "sandwich": ("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"),
    "post_norm": ("mlp", "post_feedforward_layernorm"),
}  # fmt: skip


def _check_mlp_half_modules(layer: nn.Module, form: str) -> None:
    missing = [
        m for m in _MLP_HALF_MODULES[form] if not isinstance(getattr(layer, m, None), nn.Module)
    ]
    if missing:
        raise ValueError(
            f"the layer has no {', '.join(missing)}: a patched layer runs its MLP half as "
            f"{form.replace('_', '-')} layers do (a parallel attention and MLP, another layout?)"
        )


# The table: the first recipe of a kind that applies to a layer is the one tried.
ATTENTION_RECIPES = (
    LLAMA_ATTENTION, GEMMA_ATTENTION, MISTRAL_ATTENTION, PHI3_ATTENTION, QWEN2_ATTENTION,
    QWEN3_ATTENTION, GEMMA2_ATTENTION, GEMMA3_ATTENTION, OLMO2_ATTENTION,
)  # fmt: skip
RECIPES: tuple[Recipe, ...] = (
    *(_attention_recipe(recipe) for recipe in ATTENTION_RECIPES),
    _gemma2_mlp_recipe(),
    _olmo2_mlp_recipe(),
    _gemma_mlp_recipe(),
    _mlp_recipe(SEPARATE_GATE_UP),
    _mlp_recipe(CONCATENATED_GATE_UP),
    *(_attention_output_recipe(k) for k in (ATTN_OUT, GEMMA2_ATTN_OUT, OLMO2_ATTN_OUT)),
)


def _all_reasons(*checks: Callable[[], None]) -> None:
    """Run every check; ``ValueError`` with all their reasons, in order, if any fails (a
    module can be off in more than one way, and each says what a kernel would need)."""
    reasons = []
    for check in checks:
        try:
            check()
        except ValueError as e:
            reasons.append(str(e))
    if reasons:
        raise ValueError("; ".join(reasons))


# -- kinds no recipe applies to --------------------------------------------------------------------


def _unmatched(kind: str, name: str, layer: nn.Module, family: str) -> str:
    """Why no recipe of ``kind`` applies to ``layer``: what its modules are instead."""
    if kind == ATTENTION_INPUT:
        return _unmatched_attention(name, layer, family)
    if kind == ATTENTION_OUTPUT:
        return _unmatched_attention_output(name, layer)
    mlp = getattr(layer, "mlp", None)
    return (
        f"{name}.mlp ({type(mlp).__name__}) has neither gate_proj/up_proj/down_proj nor "
        "gate_up_proj/down_proj (a mixture of experts, a two-matrix MLP?): the llama_mlp "
        "kernels compute one SwiGLU MLP"
    )


def _unmatched_attention_output(name: str, layer: nn.Module) -> str:
    attn = getattr(layer, "self_attn", None)
    if not isinstance(getattr(attn, "o_proj", None), nn.Module):
        return (
            f"{name}.self_attn ({type(attn).__name__}) has no o_proj module: the attention-output "
            "kernels compute x + o_proj(a)"
        )
    try:  # a post-norm layer whose post_attention_layernorm is of no kernel's form
        rms_norm_form(layer.post_attention_layernorm, "post_attention_layernorm")
    except (AttributeError, ValueError) as e:
        return f"{name}: {e}; the post-norm attention-output kernels apply x̂ · w or x̂ · (1 + w)"
    return f"{name}: no attention-output recipe applies to {type(layer).__name__}"


def _unmatched_attention(name: str, layer: nn.Module, family: str) -> str:
    attn = getattr(layer, "self_attn", None)
    cls = type(attn).__name__
    if getattr(layer, "input_layernorm", None) is None:
        return _no_input_norm(name)
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return (
            f"{name}.self_attn ({cls}): q/k RMSNorm ({family}) has no shipped kernel yet for "
            "this class — per-head norms before RoPE are proven for Qwen3Attention "
            "(qwen3_attn_in) and Gemma3Attention (gemma3_attn_in), norms over the whole "
            "projection for Olmo2Attention (olmo2_attn_in)"
        )
    biased = [
        p for p in ("q_proj", "k_proj", "v_proj", "qkv_proj")
        if getattr(getattr(attn, p, None), "bias", None) is not None
    ]  # fmt: skip
    if biased:
        return (
            f"{name}.self_attn ({cls}): {'/'.join(biased)} with biases ({family}) — the "
            "llama_attn_in kernel has none"
        )
    return _with_norm_reason(name, layer) + (
        f"{name}.self_attn ({cls}): no attention recipe for this class (its forward may "
        "differ from Llama's: scaling, softcapping, sliding windows, partial rotary); recipes "
        f"cover {', '.join(r.class_name for r in ATTENTION_RECIPES)}"
    )


def _with_norm_reason(name: str, layer: nn.Module) -> str:
    """``"<why the input norm is no Llama RMSNorm>; "``, or nothing when it is one."""
    try:
        _in_layer(name, rms_norm_form, layer.input_layernorm, "input_layernorm")
    except ValueError as e:
        return f"{e}; "
    return ""


# -- the report ------------------------------------------------------------------------------------


@dataclass
class PatchReport:
    """What ``patch_model`` did: per module kind (``KINDS``), ``"patched (<recipe>)"`` or
    ``"kept: <reason>"``. ``str(report)`` is one line per kind under the family's name."""

    family: str
    layers: int
    lines: dict[str, str] = field(default_factory=dict)
    model: nn.Module | None = field(default=None, repr=False)

    def patched(self, kind: str) -> bool:
        return self.lines[kind].startswith("patched")

    def __str__(self) -> str:
        head = f"{self.family}, {self.layers} decoder layers:"
        return "\n".join([head, *(f"  {kind}: {self.lines[kind]}" for kind in KINDS)])


def family_name(model: nn.Module) -> str:
    """``config.model_type``'s family name (``FAMILY_NAMES``), else the model type or class."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model_type, str):
        return type(model).__name__
    return FAMILY_NAMES.get(model_type, model_type)


# -- patch_model -----------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules with both a ``self_attn`` and an ``mlp``."""
    return [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]


def patch_model(
    model: nn.Module,
    *,
    verify: bool = False,
    saved: bool = True,
    tune: Tuning = "quick",
    fuse_gate_up: bool = False,
    fused_loss: bool = False,
    attention: bool = True,
    fuse_residual: bool = True,
    verbose: bool = False,
) -> PatchReport:
    """Patch, in place, every module kind of ``model``'s decoder layers that a recipe
    (``RECIPES``) proves computes exactly what its shipped verified kernel computes; keep the
    rest as Hugging Face's. Returns a ``PatchReport`` (printed with ``verbose``): per kind
    ``patched`` or ``kept: <reason>`` — never a silent difference.

    One probe forward (``coda.export.probe``) records every layer; for each kind, the first
    recipe that applies to a layer's modules must prove itself on every layer (its module
    checks, the layer's recorded dataflow and the module's recorded output recomputed the way
    the drop-in computes it), else the kind is kept in every layer with the first failing
    layer's reasons. Every drop-in is built (its Programs resolved) before any module changes.
    ``attention=False`` keeps the attention input; ``fuse_residual=False`` keeps the attention
    output (``o_proj`` and the add) as Hugging Face's; ``fused_loss`` also fuses the final norm,
    LM head and cross-entropy (``fuse_causal_lm_loss``'s training forward) when the probe proves
    the logits and loss are Hugging Face's plain ones. ``verify``, ``saved``, ``tune``,
    ``fuse_gate_up``, ``fuse_residual``: as ``patch_llama`` (``fuse_gate_up`` applies to MLPs
    with separate gate and up projections; Phi-3's ``gate_up_proj`` is read as row views of
    its one Parameter). Layers already patched stay as they are (patching twice changes
    nothing). ``ValueError`` for a model with no decoder layer (``self_attn`` + ``mlp``), and
    for one already wrapped for DDP or sharded by FSDP2 (patch first, then wrap).
    """
    check_not_distributed(model)
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no decoder layer (a module with a self_attn and an "
            "mlp): patch_model patches the decoder layers of Hugging Face causal LMs"
        )
    family = family_name(model)
    options = Options(verify, saved, tune, fuse_gate_up, fuse_residual)
    names = {m: n for n, m in model.named_modules()}
    named = [(names.get(layer) or type(layer).__name__, layer) for layer in layers]
    report = PatchReport(family, len(layers), model=model)
    head, head_error = _lm_head(model) if fused_loss else ([], None)
    installs: list[Install] = []
    with _dropout_off(model):  # recorded and recomputed alike: no unit dropped at random
        recording = _probe(model, layers, head, labels=fused_loss and head_error is None)
        for kind in (ATTENTION_INPUT, MLP_HALF, ATTENTION_OUTPUT):  # the order they install in
            if kind == ATTENTION_INPUT and not attention:
                report.lines[kind] = "kept: attention=False"
                continue
            if kind == ATTENTION_OUTPUT and not fuse_residual:
                report.lines[kind] = (
                    "kept: fuse_residual=False (o_proj and the add are Hugging Face's)"
                )
                continue
            report.lines[kind], built = _patch_kind(kind, named, recording, family, options)
            installs += built
        report.lines[LM_HEAD_LOSS] = _lm_head_line(model, recording, fused_loss, head_error)
    for install in installs:
        install()
    if report.patched(LM_HEAD_LOSS):
        install_fused_loss(model, verify=verify, tune=tune)
    if verbose:
        print(report)
    return report


def _probe(
    model: nn.Module, layers: list[nn.Module], head: list[nn.Module], *, labels: bool
) -> Recording:
    watched = list(head)
    for layer in layers:
        parts = [getattr(layer, part, None) for part in (*_LAYER_PARTS, *_SANDWICH)]
        parts.append(getattr(getattr(layer, "self_attn", None), "o_proj", None))
        watched += [layer, *(p for p in parts if isinstance(p, nn.Module))]
    return probe_forward(model, watched, labels=labels)


@contextmanager
def _dropout_off(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode for the block when the model trains with attention dropout
    (an attention's ``attention_dropout`` above 0) and no other, each module's mode restored
    after. A recorded output with random units dropped cannot be recomputed to prove a drop-in;
    the attention drop-ins pass that dropout on as Hugging Face's forwards do
    (``attention_arguments``: the module's ``attention_dropout`` while training), so the probe
    and the proofs are made on the deterministic forward. Any other dropout (an ``nn.Dropout``,
    e.g. Phi-3's residual dropout, which a fused residual add would skip) keeps the model's own
    mode: its random outputs then fail the proofs of what they reach, which are kept."""
    if not model.training or not _attention_dropout_only(model):
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _attention_dropout_only(model: nn.Module) -> bool:
    """Whether a training forward of ``model`` drops units at random only inside attention."""
    modules = list(model.modules())
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in modules):
        return False
    rates = [getattr(m, "attention_dropout", None) for m in modules]
    return any(isinstance(p, int | float) and p > 0 for p in rates)


def _patch_kind(
    kind: str,
    named: list[tuple[str, nn.Module]],
    recording: Recording,
    family: str,
    options: Options,
) -> tuple[str, list[Install]]:
    """``(report line, installers)`` for one kind over every layer: each unpatched layer's
    first applicable recipe proven and built, or the first failure as the reason (a drop-in
    refuses at construction what its kernels cannot run, e.g. a head width)."""
    installs: list[Install] = []
    done: set[str] = set()
    for name, layer in named:
        if _already_patched(kind, layer):
            done.add("already patched")
            continue
        recipe = next((r for r in RECIPES if r.kind == kind and r.applies(layer)), None)
        if recipe is None:
            return f"kept: {_unmatched(kind, name, layer, family)}", []
        try:
            recipe.prove(recording, name, layer)
        except ValueError as e:
            return f"kept: {e}", []
        try:
            installs.append(recipe.build(layer, options))
        except ValueError as e:
            return f"kept: {name}: {e}", []
        done.add(recipe.name)
    return f"patched ({', '.join(sorted(done))})", installs


def _already_patched(kind: str, layer: nn.Module) -> bool:
    if kind == MLP_HALF:
        return isinstance(getattr(layer, "mlp", None), CodaLlamaMLP)
    if kind == ATTENTION_OUTPUT:
        return attention_output_patched(layer)
    return _patched_attention(getattr(layer, "self_attn", None))


def _lm_head(model: nn.Module) -> tuple[list[nn.Module], ValueError | None]:
    try:
        return list(causal_lm_head(model)), None
    except ValueError as e:
        return [], e


def _lm_head_line(
    model: nn.Module, recording: Recording, fused_loss: bool, error: ValueError | None
) -> str:
    """The final norm + LM head loss: patched when asked and proven (``check_causal_lm_head``,
    with the config's ``final_logit_softcapping`` if any; the final norm Llama's or Gemma's
    RMSNorm), else kept with the reason."""
    if not fused_loss:
        return "kept: fused_loss=False (patch_model(fused_loss=True) fuses it in training)"
    softcap = final_logit_softcap(model)
    if error is None:
        try:
            _all_reasons(
                lambda: lm_head_family(softcap),
                lambda: check_causal_lm_head(recording, model, softcap),
                lambda: rms_norm_form(causal_lm_head(model)[1], "model.model.norm"),
                lambda: check_plain_linear(model.lm_head, "lm_head"),  # as the loss module will
            )
        except ValueError as e:
            error = e
    if error is not None:
        return f"kept: {error}"
    if softcap is not None:
        return (
            f"patched (lm_head_softcap_ce: final norm + LM head + logits capped at {softcap:g} + "
            "cross-entropy, logits a row chunk at a time)"
        )
    return (
        "patched (llama_lm_head_ce: final norm + LM head + cross-entropy, logits a row chunk at a "
        "time)"
    )
