"""The final norm + LM head + cross-entropy of a Hugging Face Llama on CODA kernels: the loss
without the ``[tokens, vocabulary]`` logits in memory.

``llama_lm_head_ce`` (docs/algebra.md §5) computes each token's loss in the LM head GEMM's epilogue
(target logit + per-tile log-sum-exp, combined by a tiny aux step) — what runs without gradients.
In training the gradient is computed in the forward, row chunk by row chunk, in three GEMM passes
(``lm_head_chunks``: the head storing a chunk's logits, ``dz W`` and ``dzᵀ y``) — so only a
chunk's logits and gradient are ever stored; eager PyTorch keeps all the logits in fp32 (16384
tokens × 128256 classes: 8 GB). Traced calls (``torch.compile``) run ``llama_lm_head_ce_train``
(it keeps each token's log-sum-exp) and ``_bwd_saved`` (it recomputes the logits tile by tile
once, for ``softmax − onehot``) as registered custom ops.

* ``CodaLlamaLMHeadLoss(norm, lm_head)(hidden, labels)``: Hugging Face's causal-LM loss
  (``ForCausalLMLoss``: labels shifted by one, ``ignore_index`` -100, mean over the counted
  tokens or sum / ``num_items_in_batch``) from the hidden states *before* the final norm;
* ``causal_lm_loss(model, input_ids, labels, ...)``: the same for a ``LlamaForCausalLM``: runs
  ``model.model`` (its final norm deferred: it hands its input through) and the fused loss — in
  place of ``model(input_ids, labels=labels).loss``, with the same value and gradients;
* ``fuse_causal_lm_loss(model)``: ``model(..., labels=...)`` itself uses it in training, so code
  that only calls the model (the Hugging Face ``Trainer``) gets the fused loss.
"""

from __future__ import annotations

import functools
import types
import weakref
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from coda.blocks.gemma import GEMMA2_LOGIT_CAP
from coda.primitives.loss_targets import next_token_classes, next_token_targets
from coda.primitives.tracing import traced

from .autograd import ExportedFunction, Tuning, export_autograd
from .checks import check_plain_linear, norm_gamma, rms_norm_form
from .dtypes import autocast_dtype, run_in_dtype
from .kv_cache import discarding_cache
from .lm_head_chunks import chunk_runner, chunked_lm_head_loss
from .probe import causal_lm_head, check_causal_lm_head, probe_forward
from .programs import FAMILIES
from .resolve import dropin_programs


def llama_lm_head_ce_function(
    eps: float, *, verify: bool = False, tune: Tuning = "quick", softcap: float | None = None
) -> ExportedFunction:
    """``f(x, gamma, w_lm, target) -> loss``: per-token cross-entropy (fp32, ``[M]``) of
    ``rmsnorm(x)·γ @ w_lmᵀ`` against ``target`` (class ids in ``[0, V)``), with autograd for
    ``x``, ``gamma`` and ``w_lm``; the Programs are the shipped verified ones
    (``coda.export.programs``), or with ``verify`` verified by the sandbox first. ``softcap``:
    the logits capped at ``softcap · tanh(logits / softcap)`` before the cross-entropy (Gemma
    2's ``final_logit_softcapping``; the ``lm_head_softcap_ce`` kernels cap at 30)."""
    function = _lm_head_function(eps, verify, lm_head_family(softcap))
    function.tune = tune
    return function


def lm_head_family(softcap: float | None) -> str:
    """The shipped LM-head loss family for a logit softcap (None: none); ``ValueError`` for a
    cap no shipped kernel applies."""
    if softcap is None:
        return "llama_lm_head_ce"
    if softcap != GEMMA2_LOGIT_CAP:
        raise ValueError(
            f"final_logit_softcapping {softcap:g}: the shipped softcapped LM-head kernels "
            f"(lm_head_softcap_ce) cap the logits at {GEMMA2_LOGIT_CAP:g}, Gemma 2's"
        )
    return "lm_head_softcap_ce"


@lru_cache(maxsize=8)
def _lm_head_function(eps: float, verify: bool, family: str) -> ExportedFunction:
    # Training runs <family>_train, which also returns each row's log-sum-exp (M floats), and the
    # backward <family>_bwd_saved takes it instead of recomputing the logits for it; without
    # gradients the plain forward runs.
    keys = ("train", "backward_saved", "forward")
    train, backward, forward = dropin_programs(family, keys, eps, verify=verify)
    backward_block = FAMILIES[family].blocks(eps)["backward_saved"]
    return export_autograd(train, backward, backward_block, inference=forward)


def final_logit_softcap(model: nn.Module) -> float | None:
    """``model.config.final_logit_softcapping`` (Gemma 2's), or None when the config has none
    (what the logits are is proven on the probe forward, ``check_causal_lm_head``)."""
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return float(cap) if isinstance(cap, int | float) and cap else None


class CodaLlamaLMHeadLoss(nn.Module):
    """Hugging Face's causal-LM loss from the last hidden states before the final norm, for a
    ``LlamaRMSNorm`` (``model.model.norm``; or Gemma's ``x̂ · (1 + w)``, the kernel then applying
    ``γ = 1 + w``) + ``lm_head``, on CODA kernels (no ``[tokens, vocabulary]`` logits).

    ``forward(hidden, labels, num_items_in_batch=None)``: ``hidden`` ``[..., T, d]``, ``labels``
    ``[..., T]`` (token ids; -100 is ignored); position t predicts ``labels[t + 1]``. The loss is
    the mean over the counted tokens, or their sum divided by ``num_items_in_batch`` when given —
    as ``LlamaForCausalLM`` computes it (with no token counted it is 0 with zero gradients, where
    PyTorch's mean cross-entropy gives NaN). A label outside ``[0, V)`` other than -100 raises
    ``IndexError`` on the CPU, as PyTorch's loss does; on a GPU (where checking would make the
    host wait for the device every step) it makes the loss and the gradients NaN
    (``loss_targets``). Parameters must have ``hidden``'s dtype, except under
    ``torch.autocast`` with fp32 weights, where the head runs in the autocast dtype (as
    Hugging Face's ``lm_head`` does) and the loss stays fp32. ``softcap``: the logits are
    ``softcap · tanh(lm_head(norm(h)) / softcap)`` (Gemma 2's ``final_logit_softcapping``, 30).
    In training the gradient is computed in the forward, ``chunk_rows`` rows at a time (None, the
    default: ``lm_head_chunks.chunk_rows`` of the batch, vocabulary and width).
    """

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Module,
        *,
        verify: bool = False,
        tune: Tuning = "quick",
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        family = lm_head_family(softcap)
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError(f"lm_head has a bias; the {family} block has none")
        check_plain_linear(lm_head, "lm_head")
        eps, self.norm_offset = rms_norm_form(norm, "the final norm")
        self.norm, self.lm_head, self.softcap = norm, lm_head, softcap
        self.function = llama_lm_head_ce_function(eps, verify=verify, tune=tune, softcap=softcap)
        self._chunks = (eps, verify, family, softcap)  # chunk_runner's arguments
        # rows per chunk in training (None: chunk_rows of the batch, vocabulary and width)
        self.chunk_rows: int | None = None
        # the model's loss_function when its loss was proven (changed_since)
        self.model_loss_function: Any = None

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        if labels.shape != hidden.shape[:-1]:
            raise ValueError(
                f"labels {tuple(labels.shape)} must have hidden's shape without its last dim, "
                f"{tuple(hidden.shape[:-1])}"
            )
        x = hidden.reshape(-1, hidden.shape[-1])
        weights = [norm_gamma(self.norm.weight, self.norm_offset), self.lm_head.weight]
        amp = autocast_dtype(x, weights)  # under autocast: as Hugging Face's lm_head
        vocab = self.lm_head.weight.shape[0]
        if _trains(x, *weights):
            # position t predicts labels[t + 1], the last none; an ignored token gets a valid
            # class (0) and weight 0: its gradient is zero (one launch on a GPU)
            classes, token_weights = next_token_targets(labels, num_items_in_batch, vocab)
            return self._training_loss(amp or x.dtype, x, weights, classes, token_weights)
        # the same targets, by PyTorch ops (a label outside the vocabulary: NaN, as in training)
        classes, counted, outside = next_token_classes(labels, vocab)
        per_token = run_in_dtype(self.function, amp or x.dtype, x, *weights, classes)
        total = (per_token * torch.where(outside, torch.nan, counted.to(per_token.dtype))).sum()
        if num_items_in_batch is None:
            return total / counted.sum().clamp(min=1)
        return total / num_items_in_batch

    def _training_loss(
        self,
        dtype: torch.dtype,
        x: torch.Tensor,
        weights: list[torch.Tensor],
        classes: torch.Tensor,
        token_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The loss with its gradient computed now, in row chunks (``lm_head_chunks``): each
        token weighs ``token_weights`` (``loss_targets.next_token_targets``: counted / the
        number counted or ``num_items_in_batch``) — the same reduction as the per-token path,
        as the ``dloss`` of the chunk Program."""
        runner = chunk_runner(*self._chunks)
        runner.tune = self.function.tune
        x, *weights = (t.to(dtype) for t in (x, *weights))
        with torch.autocast(x.device.type, enabled=False):
            return chunked_lm_head_loss(
                runner, x, *weights, classes, token_weights, rows=self.chunk_rows
            )


def _trains(*tensors: torch.Tensor) -> bool:
    """Whether a gradient will be asked of this call (grad mode on, an input that requires
    one) and it runs eagerly: then the chunked path computes it in the forward. Traced calls
    (``torch.compile``, dispatch modes) take the registered ops, which autograd sees as one."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and not traced(tensors)


# One loss module per model, built on first use (its Programs resolved once per process) and
# kept in the model's own __dict__ (not as a submodule: no parameter is registered twice), so a
# copy of the model carries its own, tied to the copy's norm and head.
_LOSS_ATTR = "_coda_lm_head_loss"
# models whose head was proven to be what the fused loss computes (check_fused_loss_fits)
_CHECKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    verify: bool = False,
    tune: Tuning = "quick",
    **model_kwargs: Any,
) -> torch.Tensor:
    """``model(input_ids, labels=labels).loss`` of a Hugging Face ``LlamaForCausalLM`` with the
    final norm, LM head and cross-entropy fused on CODA kernels (no logits in memory).

    Runs the base model ``model.model`` (attention masks, positions and the like pass through
    ``model_kwargs``) with its final norm deferred for that call — it returns its input, since
    the normalization runs in the fused loss's kernels and Hugging Face's norm would only cost
    its kernels — and returns ``CodaLlamaLMHeadLoss`` of the base model's last hidden states:
    same value, same gradients for every parameter. (Hooks on the final norm still run; a
    forward hook there sees the un-normalized states.) The first call for a model not yet
    checked (by ``fuse_causal_lm_loss`` or ``patch_llama(fused_loss=True)``) first proves that
    its loss is that (``check_fused_loss_fits``; ``ValueError``).

    The final norm is made deferrable on first use (``DeferrableForward``: an instance
    ``forward`` that hands its input through while a fused loss runs, and runs the norm
    otherwise), so a call changes no module and ``torch.compile(fullgraph=True)`` traces it
    whole (the loss module is built outside the graph, at ``install_fused_loss`` or first use).

    ``use_cache`` is left to the model's config, as ``model(...)`` leaves it: with
    ``use_cache=False`` and no attention mask, Hugging Face checks the position ids for packed
    sequences with a ``.all()`` that makes the host wait for the GPU every step (measured on an
    H200, 4-layer training step: the GPU idled 5.3 ms of a 36.7 ms step with it, 1.3 of 34.5 for
    the same patched model's own forward, which keeps the cache). Where the config has it on and
    the call passes no cache of its own, the base model gets a cache that keeps nothing
    (``kv_cache.discarding_cache``): the loss never returns the cache, so the keys and values
    are not copied into one.
    """
    loss_module = model.__dict__.get(_LOSS_ATTR)
    if loss_module is None or changed_since(model, loss_module):
        loss_module = _loss_module(model, verify=verify, tune=tune)
    base, norm = model.model, model.model.norm
    loss_module.function.tune = tune
    _deferrable(norm)  # (again, if another patch set a forward on it since: it becomes inner)
    norm._coda_deferred, norm._coda_deferred_calls = True, 0
    try:
        out = base(input_ids=input_ids, **model_kwargs, **discarding_cache(base, model_kwargs))
    finally:
        norm._coda_deferred = False
    if norm._coda_deferred_calls != 1:
        calls = norm._coda_deferred_calls
        raise RuntimeError(f"the final norm ran {calls} times in one forward; expected once")
    # the deferred norm's output is its input: the hidden states the fused loss normalizes
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return loss_module(hidden, labels, num_items_in_batch)


def changed_since(model: nn.Module, loss: CodaLlamaLMHeadLoss) -> str:
    """What of ``model`` the fused loss ``loss`` was built for has changed since ("" if nothing):
    its head module (``resize_token_embeddings`` of an untied head, PEFT wrapping ``lm_head``),
    its final norm module, the config's ``final_logit_softcapping``, or ``model.loss_function``
    (set on the model after the loss was proven). The kernels read the weights of the modules
    they were built with: computing on with those would train a model the caller no longer has.
    A few attribute reads a call."""
    head = getattr(model, "lm_head", None)
    if head is not loss.lm_head:
        return f"model.lm_head was replaced (now a {type(head).__qualname__})"
    if model.model.norm is not loss.norm:
        return "model.model.norm was replaced"
    cap = final_logit_softcap(model)
    if cap != loss.softcap:
        return f"config.final_logit_softcapping changed from {loss.softcap} to {cap}"
    if getattr(model, "loss_function", None) is not loss.model_loss_function:
        return "model.loss_function was changed"
    return ""


@torch.compiler.disable
def _loss_module(model: nn.Module, *, verify: bool, tune: Tuning) -> CodaLlamaLMHeadLoss:
    """The fused loss module of ``model``, built (and the model's head checked, unless it was)
    on first use, and built again — the model proven anew — when what it was built for changed
    (``changed_since``; ``RuntimeError`` when the fused loss cannot compute the new head or
    loss); its final norm made deferrable. Outside any ``torch.compile`` graph: it probes the
    model and resolves Programs (``install_fused_loss`` builds it up front)."""
    old = model.__dict__.get(_LOSS_ATTR)
    change = changed_since(model, old) if old is not None else ""
    if old is None or change:
        if change:
            _CHECKED.discard(model)  # proven for what it was: prove it anew
        try:
            loss = _build_loss_module(model, verify=verify, tune=tune)
        except ValueError as e:
            if not change:
                raise
            raise RuntimeError(
                f"{change} after the fused loss was installed, and the fused loss does not "
                f"compute the model's loss now: {e}. Make such changes before patching (the "
                "loss is then kept as Hugging Face's, with the reason), or undo this one"
            ) from e
        object.__setattr__(model, _LOSS_ATTR, loss)
        _deferrable(model.model.norm)
    return model.__dict__[_LOSS_ATTR]


def _build_loss_module(model: nn.Module, *, verify: bool, tune: Tuning) -> CodaLlamaLMHeadLoss:
    """A fused loss module for ``model`` as it is now, its head proven first unless it was
    (``check_fused_loss_fits``)."""
    if model not in _CHECKED:
        check_fused_loss_fits(model)
    loss = CodaLlamaLMHeadLoss(
        model.model.norm, model.lm_head, verify=verify, tune=tune,
        softcap=final_logit_softcap(model),
    )  # fmt: skip
    loss.model_loss_function = getattr(model, "loss_function", None)
    return loss


def _deferrable(norm: nn.Module) -> None:
    """Give ``norm`` (once) an instance ``forward`` (``DeferrableForward``) that returns its
    input unchanged while ``norm._coda_deferred`` is set and runs the norm otherwise."""
    if not isinstance(vars(norm).get("forward"), DeferrableForward):
        inner = vars(norm).get("forward")  # another patch's, if any
        norm._coda_deferred, norm._coda_deferred_calls = False, 0
        norm.forward = DeferrableForward(norm, inner)


class DeferrableForward:
    """The final norm's forward once a fused loss has used it: while ``norm._coda_deferred`` is
    set (``causal_lm_loss`` sets it around the base model's forward) it returns its input and
    counts the call in ``norm._coda_deferred_calls``; otherwise it runs the norm — ``inner``, a
    forward an earlier patch set on the instance, or the class's. An object rather than a bound
    function, so copies and pickles of the model keep it, tied to their own norm."""

    def __init__(self, norm: nn.Module, inner: Any = None) -> None:
        self.norm, self.inner = norm, inner

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        if norm._coda_deferred:
            norm._coda_deferred_calls += 1
            return hidden_states
        if self.inner is not None:
            return self.inner(hidden_states)
        return type(norm).forward(norm, hidden_states)


def fuse_causal_lm_loss(
    model: nn.Module, *, verify: bool = False, tune: Tuning = "quick"
) -> nn.Module:
    """Make ``model(..., labels=...)`` of a ``LlamaForCausalLM`` in training mode compute its loss
    with ``causal_lm_loss`` and return it with ``logits=None`` (no logits are made — as
    Liger-Kernel's fused linear cross-entropy does); in eval mode, or without labels, the
    original forward runs and returns logits (also for ``inputs_embeds`` instead of
    ``input_ids``, for a call asking for hidden states or attention maps, and for one passing
    ``shift_labels`` or ``ignore_index``). In place; returns ``model``.

    The head is proven again on the first call after the model's ``lm_head`` or final norm was
    replaced, its ``final_logit_softcapping`` or its ``loss_function`` changed
    (``changed_since``): ``resize_token_embeddings`` of an untied head then trains the new head;
    a change the fused loss cannot compute — PEFT wrapping ``lm_head``, a custom loss — raises
    ``RuntimeError`` instead of training the model as it was.

    The model's own class forward is called for the rest, so copies (``copy.deepcopy``) keep
    working on themselves. Checked first (``check_fused_loss_fits``): a model whose logits or
    loss are not those of ``lm_head(model.model.norm(h))`` is refused with ``ValueError``.
    """
    check_fused_loss_fits(model)
    return install_fused_loss(model, verify=verify, tune=tune)


def check_fused_loss_fits(model: nn.Module) -> None:
    """``ValueError`` unless ``model`` computes what the fused loss replaces: one probe forward
    with labels (``coda.export.probe``) shows the logits are ``lm_head``'s output of
    ``model.model.norm``'s (the base model's last module), ``lm_head`` a bias-free ``x @ Wᵀ``,
    the loss the mean next-token cross-entropy — no logit scale or other loss; softcapping only
    as the config's ``final_logit_softcapping`` says, at a cap a shipped kernel applies (Gemma
    2's 30) — and the final norm is Llama's or Gemma's RMSNorm (``rms_norm_form``)."""
    softcap = final_logit_softcap(model)
    lm_head_family(softcap)
    recording = probe_forward(model, list(causal_lm_head(model)), labels=True)
    check_causal_lm_head(recording, model, softcap)
    rms_norm_form(causal_lm_head(model)[1], "model.model.norm")
    _CHECKED.add(model)


def install_fused_loss(
    model: nn.Module, *, verify: bool = False, tune: Tuning = "quick"
) -> nn.Module:
    """``fuse_causal_lm_loss`` without its check, for a caller that made it already
    (``patch_llama`` probes the head with the layers, before changing any)."""
    _CHECKED.add(model)
    _loss_module(model, verify=verify, tune=tune)  # built now: a compiled forward traces it whole
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # The class forward's signature (``__wrapped__``): the Trainer keeps only the batch columns
    # the model's forward names, and would drop ``input_ids`` for a bare ``*args, **kwargs``.
    @functools.wraps(type(model).forward)
    def forward(self: nn.Module, *args: Any, labels: Any = None, **kwargs: Any) -> Any:
        if not _fused_call(self, args, labels, kwargs):
            return type(self).forward(self, *args, labels=labels, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)  # no logits are made
        input_ids = kwargs.pop("input_ids")
        loss = causal_lm_loss(
            self, input_ids, labels, num_items_in_batch=num_items, verify=verify, tune=tune,
            **kwargs,
        )  # fmt: skip
        return CausalLMOutputWithPast(loss=loss, logits=None)

    model.forward = types.MethodType(forward, model)
    return model


# Loss arguments of Hugging Face's causal-LM loss that the fused loss does not take (targets
# given already shifted, as context parallelism passes them; another ignored label), and the
# outputs it does not return: a call with any of them runs the class forward.
_CLASS_LOSS_ARGUMENTS = ("shift_labels", "ignore_index")
_CLASS_OUTPUTS = ("output_hidden_states", "output_attentions")


def _fused_call(model: nn.Module, args: tuple, labels: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the fused loss's forward computes this call: a training call with ``labels`` and
    ``input_ids`` by keyword, no loss argument it does not take (``_CLASS_LOSS_ARGUMENTS``), and
    no hidden states or attention maps asked for, by the call or the config
    (``_CLASS_OUTPUTS``: the fused forward returns the loss alone). Otherwise the class forward
    runs and computes the same loss with its logits."""
    if labels is None or not model.training or args or kwargs.get("input_ids") is None:
        return False
    if any(kwargs.get(name) is not None for name in _CLASS_LOSS_ARGUMENTS):
        return False
    config = getattr(model, "config", None)
    for name in _CLASS_OUTPUTS:
        asked = kwargs.get(name)
        if asked if asked is not None else getattr(config, name, False):
            return False
    return True
