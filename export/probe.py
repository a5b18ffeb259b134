"""The proof ``patch_llama`` and ``fuse_causal_lm_loss`` ask for before they change a model: that
every module they replace sits in the dataflow their kernels compute.

A patched decoder layer computes ``h = x + self_attn(input_layernorm(x))`` (the input norm inside
the attention's QKV kernel) and ``out = h + mlp(post_attention_layernorm(h))`` (the norm inside the
MLP's kernels; with ``fuse_residual`` the add too), and the fused loss is the cross-entropy of
``lm_head(norm(hidden))`` (``model.model.norm``). The module checks (``check_llama_mlp``,
``check_rms_norm``, ``check_llama_attention``) prove what each module computes, but not how the
layer wires them: OLMo-2's ``post_attention_layernorm`` is an RMSNorm of the attention *output*
(a post-norm) and its MLP takes the un-normalized residual stream — a pass-through in its place
computes another model.

``probe_forward`` runs the model once on a few tokens with forward hooks on the modules involved
and records what each received and returned; ``check_mlp_half``, ``check_attention_half``,
``check_mlp_formula`` and ``check_causal_lm_head`` (and their kin for sandwich and post-norm
layers) compare the recorded tensors with the patched dataflow and raise ``ValueError`` naming
the module and what differs; ``check_attention_arguments`` runs an attention module's forward
again on a recorded call to see what it hands Hugging Face's attention function. The probe
leaves the model as it was: no gradients, eval mode for the call (dropout off; each module's
mode restored), the RNG state restored, buffers a forward re-assigns put back, and no cache kept
(``use_cache`` is left to the config, as ``model(...)`` leaves it — ``False`` would make Hugging
Face inspect the position ids with a host sync — and the cache the forward returns is dropped).
Forward hooks registered on the model run for the probe's call as for any other.

Hooks on the real forward rather than a ``torch.fx`` trace: Hugging Face decoder layers take
``**kwargs``, caches and data-dependent mask code that often does not trace, and hooks record the
arguments the model's own forward passes (rotary tables, masks) through whatever wrappers it has.
The proof holds for the probe's input: a forward that branched on its input's length or values
could wire its modules differently for another.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from .attn_out import DeferredOProj, hf_layer_class, layer_defaults, layer_parameters

PROBE_TOKENS = 5  # tokens of the probe sequence (batch 1)


@dataclass(frozen=True)
class Call:
    """One recorded call of a module: its arguments and what it returned."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any

    def input(self, name: str = "hidden_states") -> Any:
        """The argument ``name`` (by keyword), else the first positional argument."""
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[0] if self.args else None

    def result(self) -> Any:
        """The returned tensor: a tuple's first item, a model output's ``last_hidden_state``."""
        out = self.output
        if isinstance(out, tuple | list):
            return out[0] if out else None
        hidden = getattr(out, "last_hidden_state", None)
        return hidden if hidden is not None else out


class Recording:
    """Every call of the watched modules during one probe forward, and the model's output."""

    def __init__(self) -> None:
        self.calls: dict[nn.Module, list[Call]] = {}
        self.output: Any = None
        self.input_ids: torch.Tensor | None = None

    def of(self, module: nn.Module | None) -> list[Call]:
        return self.calls.get(module, []) if module is not None else []

    def hook(self, module: nn.Module) -> Any:
        def record(_m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self.calls.setdefault(module, []).append(Call(args, dict(kwargs), output))

        return record


def probe_forward(model: nn.Module, watched: list[nn.Module], *, labels: bool = False) -> Recording:
    """Run ``model(input_ids=…)`` (and ``labels=`` the same ids) once on ``PROBE_TOKENS`` tokens,
    recording every call of the ``watched`` modules; the model is left as it was (module
    docstring). ``ValueError`` for weights on the meta device or a forward that fails."""
    _refuse_meta(model)
    recording = Recording()
    ids = _probe_ids(model)
    kwargs: dict[str, Any] = {"input_ids": ids}
    if labels:
        kwargs["labels"] = ids
    handles = [  # first: a module's own output, before hooks (carried to its replacement) run
        m.register_forward_hook(recording.hook(m), with_kwargs=True, prepend=True)
        for m in dict.fromkeys(watched)
    ]
    modes = {m: m.training for m in model.modules()}
    buffers = {(m, n): b for m in model.modules() for n, b in m._buffers.items()}
    cuda = sorted({t.device.index or 0 for t in _tensors(model) if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            model.eval()
            try:
                recording.output = model(**kwargs)
            except Exception as e:  # noqa: BLE001 - any failure: the proof cannot be made
                raise ValueError(
                    f"{type(model).__name__}: the dataflow probe model(input_ids=<1×"
                    f"{PROBE_TOKENS} tokens>) failed ({type(e).__name__}: {e}); the patch proves "
                    "each replaced module's place on one forward before changing anything"
                ) from e
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
        for (module, name), buffer in buffers.items():
            if module._buffers.get(name) is not buffer:
                module._buffers[name] = buffer
    recording.input_ids = ids
    _drop_cache(recording.output)
    return recording


def _drop_cache(output: Any) -> None:
    """The probe's key/value cache goes now, not with the record: a model output's cache field
    (``cache`` in recent transformers 5 releases, ``past_key_values`` before) set to None under
    its own name — as an item too, which the attribute alone leaves holding the cache; the old
    name's compatibility property (which logs a deprecation) is never touched."""
    if not is_dataclass(output) or not isinstance(output, dict):
        return
    for field in fields(output):
        if field.name in _OUTPUT_CACHES and field.name in output:
            output[field.name] = None


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _refuse_meta(model: nn.Module) -> None:
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"{type(model).__name__}: {meta} is on the meta device; the patch proves each "
            "replaced module's place by running the model once on a few tokens — load or "
            "materialize the weights (e.g. to_empty() + load_state_dict) before patching"
        )


def _probe_ids(model: nn.Module) -> torch.Tensor:
    """``[1, PROBE_TOKENS]`` token ids inside the vocabulary, on the embedding's device."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    vocab = getattr(embed, "num_embeddings", None) or getattr(
        getattr(model, "config", None), "vocab_size", None
    )
    if not isinstance(vocab, int) or vocab < 2:
        raise ValueError(
            f"{type(model).__name__}: no input embedding with a vocabulary to probe the "
            "forward with; the patch needs model(input_ids=...) to run"
        )
    device = weight.device if isinstance(weight, torch.Tensor) else _tensors(model)[0].device
    return ((torch.arange(PROBE_TOKENS) * 7 + 1) % vocab).view(1, -1).to(device)


# -- comparisons -----------------------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """The same tensor object, or equal tensors (a view or a copy of it)."""
    if a is b:
        return True
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def close(got: Any, want: Any) -> bool:
    """Equal up to rounding in the coarser of the two dtypes: ``max|got − want|`` within
    ``max(4 eps, 1e-5)`` of ``max|want|`` — an op done in another order passes; a norm, scale or
    residual more or less does not."""
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return False
    if got.shape != want.shape:
        return False
    eps = max(_eps(got.dtype), _eps(want.dtype))
    diff = (got.double() - want.double()).abs().max()
    return bool(diff <= max(4 * eps, 1e-5) * want.double().abs().max().clamp(min=1e-30))


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


# -- the decoder layer -----------------------------------------------------------------------------


def _per_call(name: str, what: str, calls: list[Call], layer_calls: int) -> None:
    if len(calls) != layer_calls:
        raise ValueError(
            f"{name}.{what} ran {len(calls)} times in {layer_calls} calls of the layer; the "
            f"patched layer calls it once per call"
        )


def layer_calls(recording: Recording, name: str, layer: nn.Module) -> list[Call]:
    """The layer's recorded calls; ``ValueError`` if the probe forward never called it."""
    calls = recording.of(layer)
    if not calls:
        raise ValueError(
            f"{name}: the layer did not run in the model's forward (probed on {PROBE_TOKENS} "
            "tokens), so its dataflow cannot be proven; the patch replaces only layers the "
            "forward calls"
        )
    return calls


def check_mlp_half(recording: Recording, name: str, layer: nn.Module) -> None:
    """``ValueError`` unless every call of ``layer`` computed ``out = h + mlp(n)`` with ``n``
    ``post_attention_layernorm(h)``'s output itself and ``h`` the norm's input — what the patched
    MLP half (norm deferred into the MLP's kernels) computes."""
    calls = layer_calls(recording, name, layer)
    norms = recording.of(layer.post_attention_layernorm)
    mlps = recording.of(layer.mlp)
    _per_call(name, "post_attention_layernorm", norms, len(calls))
    _per_call(name, "mlp", mlps, len(calls))
    attns = recording.of(getattr(layer, "self_attn", None))
    attns = attns if len(attns) == len(calls) else [None] * len(calls)
    for call, norm, mlp, attn in zip(calls, norms, mlps, attns, strict=True):
        h = norm.input()
        if not same(mlp.input(), norm.result()):
            raise ValueError(_mlp_input_reason(name, h, attn))
        if not close(call.result(), h + mlp.result()):
            raise ValueError(
                f"{name}: the layer's output is not h + mlp(post_attention_layernorm(h)) with h "
                "the norm's input (a norm or scale after the MLP, or a residual other than h?); "
                "the patched layer computes exactly that — the MLP kernels do not fit this layer"
            )


def _mlp_input_reason(name: str, h: Any, attn: Call | None) -> str:
    if attn is not None and same(h, attn.result()):
        return (
            f"{name}: post_attention_layernorm normalizes the attention output (a post-norm), "
            "and the MLP does not receive its output; the patched layer would compute "
            "mlp(post_attention_layernorm(h)) on the residual stream h — another model. "
            "The MLP kernels do not fit post-norm layers"
        )
    return (
        f"{name}: the MLP does not receive post_attention_layernorm's output; the patched layer "
        "computes mlp(post_attention_layernorm(h)) — the MLP kernels do not fit this layer"
    )


def check_attention_half(recording: Recording, name: str, layer: nn.Module) -> None:
    """``ValueError`` unless every call of ``layer`` with input ``x`` handed
    ``input_layernorm(x)``'s output itself to ``self_attn`` as its hidden states, with rotary
    tables of the heads' width, and ``x + self_attn(...)`` to its MLP half (the post-attention
    norm's input, or the MLP's in a layer whose MLP half adds its residual)."""
    calls = layer_calls(recording, name, layer)
    norms, attns = recording.of(layer.input_layernorm), recording.of(layer.self_attn)
    _per_call(name, "input_layernorm", norms, len(calls))
    _per_call(name, "self_attn", attns, len(calls))
    nexts = recording.of(getattr(layer, "post_attention_layernorm", None))
    nexts = nexts if len(nexts) == len(calls) else recording.of(getattr(layer, "mlp", None))
    _per_call(name, "mlp", nexts, len(calls))
    for call, norm, attn, after in zip(calls, norms, attns, nexts, strict=True):
        x = call.input()
        if not same(norm.input(), x):
            raise ValueError(f"{name}: input_layernorm does not normalize the layer's input")
        if not same(attn.input(), norm.result()):
            raise ValueError(
                f"{name}: self_attn does not receive input_layernorm's output as hidden_states; "
                "the patched attention normalizes its input itself"
            )
        _check_rotary(name, layer.self_attn, attn)
        if not close(after.input(), x + _projected(layer.self_attn, attn.result())):
            raise ValueError(
                f"{name}: what reaches the MLP half is not x + self_attn(input_layernorm(x)) "
                "(a norm or scale of the attention output?); the patched layer computes exactly "
                "that — patch with attention=False to keep this attention half"
            )


def _projected(attn: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """``self_attn``'s output after ``o_proj``: itself, or — in a layer whose attention output
    is patched (``o_proj`` deferred to the layer's kernel) — ``out`` times ``o_proj``'s weight."""
    o_proj = getattr(attn, "o_proj", None)
    if not isinstance(o_proj, DeferredOProj):
        return out
    with torch.no_grad():
        return F.linear(out, o_proj.weight)


def check_sandwich_attention_half(recording: Recording, name: str, layer: nn.Module) -> None:
    """``ValueError`` unless every call of ``layer`` with input ``x`` handed
    ``input_layernorm(x)``'s output itself to ``self_attn`` as its hidden states, with rotary
    tables of the heads' width, ``post_attention_layernorm`` normalized the attention's output
    itself, and ``x + post_attention_layernorm(self_attn(...))`` reached the MLP half
    (``pre_feedforward_layernorm``'s input): Gemma 2/3's attention half between sandwich norms,
    what the patched layer computes with the input norm deferred into the attention's kernel."""
    calls = layer_calls(recording, name, layer)
    parts = ("input_layernorm", "self_attn", "post_attention_layernorm", SANDWICH_NORMS[0])
    norms, attns, posts, nexts = (recording.of(getattr(layer, p, None)) for p in parts)
    for part, recorded in zip(parts, (norms, attns, posts, nexts), strict=True):
        _per_call(name, part, recorded, len(calls))
    for call, norm, attn, post, after in zip(calls, norms, attns, posts, nexts, strict=True):
        x = call.input()
        for what, got, want in (
            ("input_layernorm does not normalize the layer's input", norm.input(), x),
            ("self_attn does not receive input_layernorm's output", attn.input(), norm.result()),
            (f"{parts[2]} does not normalize the attention's output", post.input(), attn.result()),
        ):  # fmt: skip
            if not same(got, want):
                raise ValueError(
                    f"{name}: {what}; the patched attention half computes exactly that"
                )
        _check_rotary(name, layer.self_attn, attn)
        if not close(after.input(), x + post.result()):
            raise ValueError(
                f"{name}: what reaches the MLP half is not x + post_attention_layernorm(self_attn("
                "input_layernorm(x))) (a residual other than x, a scale?); the patched layer "
                "computes exactly that — patch with attention=False to keep this attention half"
            )


def check_attention_calls(recording: Recording, name: str, layer: nn.Module) -> None:
    """``ValueError`` unless ``self_attn`` ran once in every call of ``layer``, with rotary
    tables of the heads' width: all a drop-in that replaces the attention module alone (no input
    norm deferred into it: OLMo 2's layers normalize after their sub-layers) needs of the layer —
    what it computes from its arguments is ``check_attention_formula``'s to prove."""
    calls = layer_calls(recording, name, layer)
    attns = recording.of(layer.self_attn)
    _per_call(name, "self_attn", attns, len(calls))
    for attn in attns:
        _check_rotary(name, layer.self_attn, attn)


def _check_rotary(name: str, attn: nn.Module, call: Call) -> None:
    tables = call.kwargs.get("position_embeddings")
    if tables is None and len(call.args) > 1:
        tables = call.args[1]
    head = getattr(attn, "head_dim", None)
    if not isinstance(head, int):
        raise ValueError(
            f"{name}.self_attn ({type(attn).__name__}) has no head_dim: not the multi-head "
            "attention whose input the llama_attn_in kernel computes"
        )
    ok = isinstance(tables, tuple | list) and len(tables) == 2
    if not ok or any(not isinstance(t, torch.Tensor) or t.shape[-1] != head for t in tables):
        raise ValueError(
            f"{name}.self_attn: no rotary tables (cos, sin) of the head width {head} among its "
            "arguments; the llama_attn_in kernel rotates whole heads with the tables the layer "
            "passes"
        )


# the gate activations of the shipped MLP kernels, by ``coda.export.mlp.activation_name``'s names
_GLU_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def check_mlp_formula(
    recording: Recording,
    name: str,
    mlp: nn.Module,
    gate_up: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    act: str = "silu",
    kernels: str = "llama_mlp",
) -> None:
    """``ValueError`` unless each recorded call of ``mlp`` returned ``down(act(gate(x)) ·
    up(x))`` of its projections' weights — the kernels read the weights alone, so a wrapper
    that adds to a projection (an adapter) or scales the output is refused. ``gate_up``: the
    gate and up weights as the kernels will read them (row views of a fused ``gate_up_proj``),
    by default ``gate_proj``'s and ``up_proj``'s; ``act``: the gate activation (``silu`` or
    ``gelu_tanh``) of the ``kernels`` named in the message."""
    w_gate, w_up = gate_up or (mlp.gate_proj.weight, mlp.up_proj.weight)
    w_down, fn = mlp.down_proj.weight, _GLU_ACTIVATIONS[act]
    for call in recording.of(mlp):
        x = call.input()
        want = call.result()
        with torch.no_grad():
            got = F.linear(fn(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
        if not close(got, want):
            raise ValueError(
                f"{name}.mlp ({type(mlp).__name__}) returned something other than "
                f"down_proj({act}(gate_proj(x)) · up_proj(x)) of its projections' weights, "
                f"which the {kernels} kernels compute"
            )


SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def check_sandwich_mlp_half(
    recording: Recording, name: str, layer: nn.Module, norms: tuple[str, str] = SANDWICH_NORMS
) -> None:
    """``ValueError`` unless every call of ``layer`` computed ``out = h +
    post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`` (Gemma 2/3's MLP half
    between sandwich norms; ``norms`` names the two), each module handing its output itself to
    the next — what the patched MLP half (both norms deferred into the MLP's kernels)
    computes."""
    calls = layer_calls(recording, name, layer)
    parts = (norms[0], "mlp", norms[1])
    pres, mlps, posts = (recording.of(getattr(layer, p)) for p in parts)
    for part, recorded in zip(parts, (pres, mlps, posts), strict=True):
        _per_call(name, part, recorded, len(calls))
    for call, pre, mlp, post in zip(calls, pres, mlps, posts, strict=True):
        for what, got, want in (
            (f"mlp does not receive {norms[0]}'s output", mlp.input(), pre.result()),
            (f"{norms[1]} does not normalize the MLP's output", post.input(), mlp.result()),
        ):  # fmt: skip
            if not same(got, want):
                raise ValueError(f"{name}: {what}; the patched MLP half computes exactly that")
        if not close(call.result(), pre.input() + post.result()):
            raise ValueError(
                f"{name}: the layer's output is not h + post_feedforward_layernorm(mlp("
                "pre_feedforward_layernorm(h))) with h the pre-norm's input (a residual other "
                "than h, a scale?); the patched layer computes exactly that"
            )


def check_post_norm_mlp_half(recording: Recording, name: str, layer: nn.Module) -> None:
    """``ValueError`` unless every call of ``layer`` computed ``out = h +
    post_feedforward_layernorm(mlp(h))`` with ``h`` the MLP's own input (OLMo 2's MLP half: no
    pre-norm), the post-norm receiving the MLP's output itself — what the patched MLP half (the
    post-norm deferred into the MLP's kernels) computes."""
    calls = layer_calls(recording, name, layer)
    norm = SANDWICH_NORMS[1]
    mlps, posts = recording.of(layer.mlp), recording.of(getattr(layer, norm))
    _per_call(name, "mlp", mlps, len(calls))
    _per_call(name, norm, posts, len(calls))
    for call, mlp, post in zip(calls, mlps, posts, strict=True):
        if not same(post.input(), mlp.result()):
            raise ValueError(
                f"{name}: {norm} does not normalize the MLP's output; the patched MLP half "
                "computes exactly that"
            )
        if not close(call.result(), mlp.input() + post.result()):
            raise ValueError(
                f"{name}: the layer's output is not h + {norm}(mlp(h)) with h the MLP's input "
                "(a pre-norm the MLP does not see, a residual other than h, a scale?); the "
                "patched layer computes exactly that"
            )


def check_attention_formula(
    recording: Recording,
    name: str,
    attn: nn.Module,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    attend: Any,
    *,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    norm_offset: float = 0.0,
    whole_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """``ValueError`` unless each recorded call of ``attn`` returned what the patched attention
    computes from the same arguments: ``o_proj`` of ``attend(q, k, v, mask, kwargs)`` (the
    Hugging Face attention function with the drop-in's arguments, no cache) with ``q, k, v``
    the hidden states times ``qkv``'s weights (as the kernel will read them: a fused
    projection's row views) plus ``biases`` if given, q and k through per-head RMSNorms
    ``x̂ · weight`` if ``head_norms`` (the q and k weights and the epsilon the kernel applies),
    rotated in Hugging Face's rotate-half order by the recorded tables. Proves on the probe that
    the drop-in reads the right rows and passes what the module's own forward passes.
    ``norm_offset``: the per-head norms' weight offset (1: Gemma 3's ``x̂ · (1 + w)``, formed in
    fp32 and cast after); ``whole_norms``: q and k instead through RMSNorms over the whole
    projection (OLMo 2's ``w · x̂``, cast after the weight), with their weights and epsilon."""
    head = attn.head_dim
    for call in recording.of(attn):
        x, (cos, sin) = call.input(), _tables(call)
        kwargs = {k: v for k, v in call.kwargs.items() if k not in _ATTENTION_OWN}
        mask = call.kwargs.get("attention_mask", call.args[2] if len(call.args) > 2 else None)
        with torch.no_grad():
            flat = [
                F.linear(x, w, b) for w, b in zip(qkv, biases or (None, None, None), strict=True)
            ]
            if whole_norms is not None:
                w_qn, w_kn, eps = whole_norms
                flat[:2] = [
                    _head_norm(t, w, eps, cast_after=True)
                    for t, w in zip(flat, (w_qn, w_kn), strict=False)
                ]
            q, k, v = (t.view(*x.shape[:-1], -1, head).transpose(1, 2) for t in flat)
            if head_norms is not None:
                w_qn, w_kn, eps = head_norms
                q, k = (_head_norm(t, w, eps, norm_offset) for t, w in ((q, w_qn), (k, w_kn)))
            q, k = (_rotate(t, cos, sin) for t in (q, k))
            out, _ = attend(q, k, v, mask, kwargs)
            got = attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())
        if not close(got, call.result()):
            raise ValueError(
                f"{name}.self_attn ({type(attn).__name__}) returned something other than "
                "o_proj(attention(rope(x Wqᵀ), rope(x Wkᵀ), x Wvᵀ)) (with the biases, or per-head "
                "q/k norms before the rotation, its kernel adds) with the weights and arguments "
                "the attention drop-in uses; its forward differs from the one the drop-in "
                "mirrors"
            )


def check_attention_arguments(
    recording: Recording,
    name: str,
    attn: nn.Module,
    passes: Any,
) -> None:
    """``ValueError`` unless, for each recorded call of ``attn``, its own forward hands Hugging
    Face's attention function the keyword arguments the drop-in hands it: ``passes(kwargs)``,
    ``kwargs`` the call's arguments for the attention function. The forward runs again on the
    recorded arguments (no cache, no hooks, the RNG state kept) with the attention function it
    looks up watched, so what it passes — dropout, scaling, a sliding window, a logit softcap —
    is compared by value, which the probe's 5 tokens alone need not show (a window longer than
    them, scores far below the cap). Transformers without
    ``ALL_ATTENTION_FUNCTIONS.get_interface`` are not watched."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry

    lookup = getattr(registry, "get_interface", None)
    if lookup is None:
        return
    for call in recording.of(attn):
        seen: list[dict[str, Any]] = []
        inputs = {k: v for k, v in call.kwargs.items() if k not in _CACHES}
        shadowed = registry.__dict__.get("get_interface")
        registry.get_interface = _watched(lookup, seen)
        cuda = sorted({t.device.index or 0 for t in _tensors(attn) if t.device.type == "cuda"})
        try:  # the forward itself: no hooks run, the RNG state is kept
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                type(attn).forward(attn, *call.args[:3], **inputs)  # never a cache
        finally:
            if shadowed is None:
                del registry.get_interface
            else:
                registry.get_interface = shadowed
        own = {k: v for k, v in call.kwargs.items() if k not in _ATTENTION_OWN}
        if len(seen) != 1 or not _same_arguments(seen[0], passes(own)):
            got = _describe_arguments(seen[0]) if len(seen) == 1 else f"{len(seen)} calls"
            raise ValueError(
                f"{name}.self_attn ({type(attn).__name__}) hands its attention function "
                f"{got}, the drop-in would hand {_describe_arguments(passes(own))}; the drop-in "
                "passes what the forward it mirrors passes"
            )


def _watched(lookup: Any, seen: list[dict[str, Any]]) -> Any:
    """``get_interface`` whose attention functions record their keyword arguments in ``seen``."""

    def get_interface(impl: Any, default: Any) -> Any:
        function = lookup(impl, default)

        def spy(*args: Any, **kwargs: Any) -> Any:
            seen.append(kwargs)
            return function(*args, **kwargs)

        return spy

    return get_interface


_CACHES = ("past_key_values", "cache", "past_key_value")
_OUTPUT_CACHES = ("cache", "past_key_values")  # a model output's cache field, new name first


def _same_arguments(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(same(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _describe_arguments(kwargs: dict[str, Any]) -> str:
    """``{name: value}`` with tensors as their shapes."""
    shown = {
        k: f"<tensor {tuple(v.shape)}>" if isinstance(v, torch.Tensor) else v
        for k, v in sorted(kwargs.items())
    }
    return str(shown)


# the attention forward's own arguments; the rest go to the attention function
_ATTENTION_OWN = (
    "hidden_states", "position_embeddings", "attention_mask", "past_key_values", "cache",
    "past_key_value",
)  # fmt: skip


def _tables(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    tables = call.kwargs.get("position_embeddings")
    return tables if tables is not None else call.args[1]


def _head_norm(
    t: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, cast_after: bool = False
) -> torch.Tensor:
    """RMSNorm ``x̂ · (offset + weight)`` over the last axis of ``t`` (each head of ``[B, heads,
    T, D]``, or a whole projection), statistics in fp32: ``x̂`` cast to ``t``'s dtype before
    the weight (Qwen3's), or the product formed in fp32 and cast after (``offset`` or
    ``cast_after``: Gemma 3's, OLMo 2's)."""
    tf = t.float()
    normed = tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)
    if not offset and not cast_after:
        return weight * normed.to(t.dtype)
    return (normed * (offset + weight.float())).to(t.dtype)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``apply_rotary_pos_emb`` on one of ``[B, heads, T, D]``, in ``t``'s dtype
    (OLMo 2's tables stay fp32 and its rotation casts back; Llama's tables come in ``t``'s)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return (t * cos + rotated * sin).to(t.dtype)


# -- the attention output --------------------------------------------------------------------------


def check_attention_output(
    recording: Recording,
    name: str,
    layer: nn.Module,
    after: str,
    post_norm: tuple[nn.Module, float, float] | None = None,
) -> None:
    """``ValueError`` unless every call of ``layer`` with input ``x`` ran ``self_attn`` on
    ``input_layernorm(x)``'s output itself (on ``x`` itself in a layer without that norm),
    ``self_attn`` returned its ``o_proj``'s output itself, and what reaches the MLP half (the
    input of the layer's module ``after``) is ``x + o_proj(a)`` recomputed from ``o_proj``'s
    recorded input ``a`` and weight — with ``post_norm = (norm, eps, offset)``, ``x +
    norm(o_proj(a))``, the norm receiving the attention's output itself and recomputed as
    ``ŷ · (offset + weight)`` in fp32. What the attention-output drop-in computes from the
    attention before ``o_proj`` and the residual."""
    calls = layer_calls(recording, name, layer)
    o_proj = layer.self_attn.o_proj
    parts = {"self_attn": layer.self_attn, "self_attn.o_proj": o_proj, after: getattr(layer, after)}
    norm = layer._modules.get("input_layernorm")
    if norm is not None:
        parts["input_layernorm"] = norm
    if post_norm is not None:
        parts["post_attention_layernorm"] = post_norm[0]
    recorded = {part: recording.of(module) for part, module in parts.items()}
    for part, part_calls in recorded.items():
        _per_call(name, part, part_calls, len(calls))
    for i, call in enumerate(calls):
        at = {part: part_calls[i] for part, part_calls in recorded.items()}
        _check_attention_wiring(name, call, at)
        _check_attention_arguments(name, hf_layer_class(layer), call, at["self_attn"])
        y = at["self_attn.o_proj"].input()
        with torch.no_grad():
            branch = F.linear(y, o_proj.weight)
            if post_norm is not None:
                if not same(at["post_attention_layernorm"].input(), at["self_attn"].result()):
                    raise ValueError(
                        f"{name}: post_attention_layernorm does not normalize the attention "
                        "output; the post-norm attention-output kernels compute x + "
                        "post_attention_layernorm(o_proj(a))"
                    )
                branch = _post_norm(branch, *post_norm)
            want = call.input() + branch
        if not close(at[after].input(), want):
            form = "post_attention_layernorm(o_proj(a))" if post_norm else "o_proj(a)"
            raise ValueError(
                f"{name}: what reaches the MLP half ({after}'s input) is not x + {form} with x "
                "the layer's input and a o_proj's input (a scale, a dropout, another residual?); "
                "the attention-output kernels compute exactly that"
            )


def _check_attention_wiring(name: str, call: Call, at: dict[str, Call]) -> None:
    """The layer's input through ``input_layernorm`` (if any) to ``self_attn``, and ``self_attn``
    returning its ``o_proj``'s output."""
    x, attn, o_proj = call.input(), at["self_attn"], at["self_attn.o_proj"]
    norm = at.get("input_layernorm")
    if norm is not None and not (same(norm.input(), x) and same(attn.input(), norm.result())):
        raise ValueError(
            f"{name}: self_attn does not receive input_layernorm(x) with x the layer's input; "
            "the patched layer computes self_attn(input_layernorm(x))"
        )
    if norm is None and not same(attn.input(), x):
        raise ValueError(f"{name}: self_attn does not receive the layer's input")
    if not same(attn.result(), o_proj.result()):
        raise ValueError(
            f"{name}: self_attn does not return its o_proj's output (something after o_proj?); "
            "the attention-output kernels apply o_proj to what self_attn computes before it"
        )


def _check_attention_arguments(name: str, cls: type, call: Call, attn: Call) -> None:
    """``self_attn`` received, by name, exactly the layer's arguments after ``hidden_states``
    (the layer forward's defaults for those its caller left out) — what a patched layer's
    forward hands it; a layer that changes, adds or drops one (a per-layer choice of rotary
    tables, a mask of its own) is another forward."""
    given = dict(zip(layer_parameters(cls), call.args[1:], strict=False))
    want = {**layer_defaults(cls), **given, **call.kwargs}
    got = {k: v for k, v in attn.kwargs.items() if k != "hidden_states"}
    differ = sorted(k for k in {*want, *got} if k not in want or k not in got)
    differ += sorted(k for k in want.keys() & got.keys() if not _same_argument(want[k], got[k]))
    if attn.args or differ:
        what = "positional arguments" if attn.args else ", ".join(differ)
        raise ValueError(
            f"{name}: self_attn does not receive the layer's own arguments by name ({what} "
            "differ); the patched layer hands self_attn its arguments as they come"
        )


def _same_argument(a: Any, b: Any) -> bool:
    if a is b or same(a, b):
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are not the same
        return False


def _post_norm(y: torch.Tensor, norm: nn.Module, eps: float, offset: float) -> torch.Tensor:
    """``y · rsqrt(mean(y²) + eps) · (offset + weight)`` in fp32, cast to ``y``'s dtype."""
    yf = y.float()
    normed = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + norm.weight.float())).to(y.dtype)


# -- the final norm and LM head --------------------------------------------------------------------


def causal_lm_head(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """``(model.model, model.model.norm, model.lm_head)``, what the fused loss replaces;
    ``ValueError`` naming what is missing."""
    base = getattr(model, "model", None)
    norm, head = getattr(base, "norm", None), getattr(model, "lm_head", None)
    for what, module in (("model.model", base), ("model.model.norm", norm), ("lm_head", head)):
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"{type(model).__name__} has no {what}: the fused loss replaces a causal LM's "
                "final norm (model.model.norm) and lm_head, as LlamaForCausalLM has them"
            )
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"lm_head ({type(head).__name__}) has no [vocabulary, hidden] weight")
    if getattr(head, "bias", None) is not None:
        raise ValueError("lm_head has a bias; the llama_lm_head_ce block has none")
    return base, norm, head


def check_causal_lm_head(
    recording: Recording, model: nn.Module, softcap: float | None = None
) -> None:
    """``ValueError`` unless the probe forward (with labels) computed the logits as
    ``lm_head(norm(h))`` — ``norm`` the base model's last module, the logits ``lm_head``'s output
    itself (no softcapping or logit scale), a plain ``x @ Wᵀ`` head — and its loss as the mean
    next-token cross-entropy of those logits: what the fused loss computes instead. With
    ``softcap`` (Gemma 2's ``final_logit_softcapping``) the model's logits must be ``softcap ·
    tanh(lm_head(norm(h)) / softcap)`` instead, and the loss theirs."""
    base, norm, head = causal_lm_head(model)
    bases, norms, heads = (recording.of(m) for m in (base, norm, head))
    for what, calls in (("model.model", bases), ("model.model.norm", norms), ("lm_head", heads)):
        if len(calls) != 1:
            raise ValueError(
                f"{what} ran {len(calls)} times in one forward; the fused loss runs it once"
            )
    hidden, logits_in, logits = norms[0].result(), heads[0].input(), heads[0].result()
    if not same(bases[0].result(), hidden):
        raise ValueError(
            "model.model.norm's output is not model.model's last hidden state; the fused loss "
            "normalizes the final norm's input and projects it"
        )
    if not same(logits_in, hidden):
        raise ValueError("lm_head does not receive model.model.norm's output")
    with torch.no_grad():
        plain = F.linear(logits_in, head.weight)
    if not close(plain, logits):
        raise ValueError(f"lm_head ({type(head).__name__}) is not x @ weightᵀ")
    out = recording.output
    if softcap is not None:
        capped = softcap * torch.tanh(logits / softcap)
        if not close(getattr(out, "logits", None), capped):
            raise ValueError(
                f"the model's logits are not {softcap:g} · tanh(lm_head(norm(x)) / {softcap:g}) "
                "(its final_logit_softcapping); the fused loss takes the cross-entropy of "
                "exactly those"
            )
        logits = out.logits
    elif not same(getattr(out, "logits", None), logits):
        raise ValueError(
            "the model's logits are not lm_head's output (final-logit softcapping or a logit "
            "scale?); the fused loss takes the cross-entropy of lm_head(norm(x)) itself"
        )
    _check_loss(getattr(out, "loss", None), logits, recording.input_ids)


def _check_loss(loss: Any, logits: torch.Tensor, labels: torch.Tensor | None) -> None:
    if not isinstance(loss, torch.Tensor) or labels is None:
        raise ValueError("model(input_ids=..., labels=...) returned no loss to compare with")
    flat = logits[..., :-1, :].reshape(-1, logits.shape[-1]).float()
    want = F.cross_entropy(flat, labels[..., 1:].reshape(-1).to(flat.device))
    if not torch.allclose(loss.detach().float(), want, rtol=1e-4, atol=1e-6):
        raise ValueError(
            f"the model's loss {float(loss):.6g} is not the mean next-token cross-entropy of its "
            f"logits ({float(want):.6g}), Hugging Face's causal-LM loss that the fused loss "
            "computes"
        )
