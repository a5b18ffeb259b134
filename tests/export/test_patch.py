"""coda.export.patch_llama: a whole Hugging Face LlamaForCausalLM (random LlamaConfig, no
downloads) with every norm, attention input (Q/K/V + RoPE) and MLP on CODA kernels, through the
interpreter — logits, loss, every parameter's gradient, state dicts and generation against the
unpatched model."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

from coda.export import (
    CodaLlamaAttention,
    CodaLlamaDecoderLayer,
    CodaLlamaMLP,
    DeferredRMSNorm,
    patch_llama,
)

from .copies import clones_of_views_of

transformers = pytest.importorskip("transformers")


def _model(seed: int = 0, **config):  # noqa: ANN003, ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **{
            "hidden_size": 48,
            "intermediate_size": 80,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 96,
            **config,
        }
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a norm applied twice or never shows
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def test_a_patched_llama_matches_the_original_logits_loss_and_gradients() -> None:
    hf = _model()
    patched = patch_llama(copy.deepcopy(hf), verify=False, tune="off")
    for layer in patched.model.layers:
        assert type(layer) is CodaLlamaDecoderLayer and layer.mlp.block.residual
        assert isinstance(layer.post_attention_layernorm, DeferredRMSNorm)
        assert isinstance(layer.input_layernorm, DeferredRMSNorm)
        assert isinstance(layer.mlp, CodaLlamaMLP)
        assert isinstance(layer.self_attn, CodaLlamaAttention)
    ids = torch.randint(0, 96, (2, 7))
    logits, loss, grads = _step(hf, ids)
    got_logits, got_loss, got_grads = _step(patched, ids)
    torch.testing.assert_close(got_logits, logits, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_loss, loss, atol=2e-6, rtol=2e-6)
    assert got_grads.keys() == grads.keys()  # the same parameters, by the same names
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=2e-5, rtol=2e-5, msg=name)


def test_a_patched_layers_backward_copies_no_gradient_and_reads_x_for_no_statistic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Programs one training step's backward runs, step by step (a step is a launch): the
    attention output's two GEMMs only (its residual's gradient is dx_out, handed on: no copying
    launch), and the MLP's and attention input's no rstd pass over x (the training forwards
    return the statistic they computed: one launch fewer each) — the MLP's forward in the same
    launch as its row pass (``rms_rows``)."""
    from coda.primitives.runtime import CompiledProgram

    ran: list = []
    run = CompiledProgram._run  # what every call runs through, recorded or replayed

    def recording(self, prepared, poison):  # noqa: ANN001, ANN202
        ran.append(self.program)
        return run(self, prepared, poison)

    monkeypatch.setattr(CompiledProgram, "_run", recording)
    hf = _model(num_hidden_layers=1, rms_norm_eps=1e-5)  # the blocks under their own names
    model = patch_llama(hf, verify=False, tune="off")
    ids = torch.randint(0, 96, (1, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    steps = {p.block: [(s.kind, getattr(s, "src", None)) for s in p.steps] for p in ran}
    assert [kind for kind, _ in steps["attn_out_bwd"]] == ["gemm", "gemm"]
    for forward, backward, statistic in [
        ("llama_mlp_train", "llama_mlp_bwd_saved", ("rms_rows", "x")),
        ("llama_attn_in_train", "llama_attn_in_bwd_saved", ("rstd", "x")),
    ]:
        assert statistic in steps[forward]  # computed once, by the forward
        assert ("rstd", "x") not in steps[backward] + steps[forward][1:], backward


def test_the_attention_inputs_weight_gradients_are_written_apart_not_copied_from_views(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shipped attention-input backward writes dW_q, dW_k and dW_v as tensors of their own
    (``unpair_rows`` parts): nothing copies them out of one ``[Nq + 2·Nkv, d]`` gradient — and
    every gradient is still the unpatched model's."""
    from coda.primitives.runtime import CompiledProgram

    hf = _model(num_hidden_layers=2, rms_norm_eps=1e-5)  # the shipped Programs' epsilon
    patched = patch_llama(copy.deepcopy(hf), verify=False, tune="off")
    fused_rows = 48 + 2 * 24  # Nq + 2·Nkv: 4 query heads and 2 KV heads of 12
    ran: list[str] = []
    run = CompiledProgram._run

    def recording_run(self, prepared, poison):  # noqa: ANN001, ANN202
        ran.append(self.program.block)
        return run(self, prepared, poison)

    ids = torch.randint(0, 96, (2, 7))
    _, _, grads = _step(hf, ids)
    copied = clones_of_views_of(fused_rows, monkeypatch)
    monkeypatch.setattr(CompiledProgram, "_run", recording_run)
    _, _, got = _step(patched, ids)
    assert ran.count("llama_attn_in_bwd_saved") == 2  # one backward per layer
    assert copied == [], f"copies of rows of a fused QKV gradient: {copied}"
    for name, g in grads.items():
        torch.testing.assert_close(got[name], g, atol=2e-5, rtol=2e-5, msg=name)


@pytest.mark.parametrize(
    "config",
    [
        {"num_key_value_heads": 4},  # multi-head attention
        {"num_key_value_heads": 1, "attn_implementation": "eager"},  # one KV head, eager
        {"head_dim": 8, "num_key_value_heads": 2},  # heads narrower than hidden / heads
    ],
    ids=["mha", "mqa-eager", "head_dim-8"],
)
def test_the_patched_attention_matches_hugging_face(config: dict) -> None:
    """Padding (left, with an attention mask) and attention weights too: Q and K come in the
    kernel's pair order, which leaves every score unchanged."""
    hf = _model(seed=11, **config)
    patched = patch_llama(copy.deepcopy(hf), verify=False, tune="off", attention=True)
    ids = torch.randint(0, 96, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    want, got = hf(**kwargs), patched(**kwargs)
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=2e-5)
    if config.get("attn_implementation") == "eager":  # the module's own attention weights
        x = torch.randn(2, 7, 48)
        cos, sin = hf.model.rotary_emb(x, torch.arange(7)[None].expand(2, 7))
        norm = hf.model.layers[0].input_layernorm
        _, theirs = hf.model.layers[0].self_attn(norm(x), (cos, sin), None)
        _, ours = patched.model.layers[0].self_attn(x, (cos, sin), None)
        torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=2e-5)
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(hf.named_parameters(), patched.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=2e-5, rtol=2e-5, msg=name)


def test_the_mlp_residual_is_fused_unless_asked_not_to() -> None:
    """``fuse_residual`` (default) swaps each ``LlamaDecoderLayer``'s class: its MLP half is one
    ``x + mlp(norm(x))`` call (the ``llama_mlp`` Programs); ``fuse_residual=False`` keeps Hugging
    Face's forward and add (``llama_mlp_branch``). Both equal the original, forward and backward;
    the fused layer still takes positional arguments, and ``mlp(x)`` alone is still the branch."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    hf = _model(seed=2)
    fused = patch_llama(copy.deepcopy(hf), verify=False, tune="off")
    unfused = patch_llama(copy.deepcopy(hf), verify=False, tune="off", fuse_residual=False)
    for layer in unfused.model.layers:
        assert type(layer) is LlamaDecoderLayer and not layer.mlp.block.residual
    ids = torch.randint(0, 96, (2, 7))
    logits, loss, grads = _step(hf, ids)
    mlp_only = patch_llama(copy.deepcopy(hf), verify=False, tune="off", attention=False)
    assert type(mlp_only.model.layers[0]) is CodaLlamaDecoderLayer  # over HF's own attention
    for model in (fused, unfused, mlp_only):
        got_logits, got_loss, got_grads = _step(model, ids)
        torch.testing.assert_close(got_logits, logits, atol=2e-5, rtol=2e-5)
        for name, g in grads.items():
            torch.testing.assert_close(got_grads[name], g, atol=2e-5, rtol=2e-5, msg=name)

    layer, ref = fused.model.layers[0], hf.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)  # Hugging Face's output recorders still find it
    x = torch.randn(2, 7, 48)
    rope = hf.model.rotary_emb(x, torch.arange(7)[None])
    with torch.no_grad():
        # positionally, as the original forward's parameters: (hidden, mask, position_ids, ...)
        want = ref(x, None, None, position_embeddings=rope)
        torch.testing.assert_close(layer(x, None, None, position_embeddings=rope), want)
        branch = ref.mlp(ref.post_attention_layernorm(x))
        torch.testing.assert_close(layer.mlp(x), branch, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(layer.mlp(x, residual=True), x + branch, atol=2e-5, rtol=2e-5)
        with pytest.raises(ValueError, match="needs a block built with residual=True"):
            unfused.model.layers[0].mlp(x, residual=True)


@pytest.mark.parametrize("called_before", [False, True], ids=["patched-fresh", "called-first"])
def test_output_attentions_and_forward_hooks_survive_patching(called_before: bool) -> None:
    """``output_attentions=True`` returns every layer's weights once, equal to the unpatched
    model's, whether Hugging Face installed its output recorders before the patch (a call asked
    for them first) or after; a user's forward hook on a replaced module keeps running."""
    hf = _model(seed=5, attn_implementation="eager")
    model = copy.deepcopy(hf)
    ids = torch.randint(0, 96, (2, 6))
    if called_before:
        model(input_ids=ids, output_attentions=True)
    seen: list[str] = []
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_hook(lambda m, a, out, i=i: seen.append(f"mlp{i}"))
        layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: seen.append(f"attn{i}"))
    patch_llama(model, verify=False, tune="off")
    seen.clear()  # the patch's dataflow probe ran the model (and the hooks) once
    want = hf(input_ids=ids, output_attentions=True, output_hidden_states=True)
    got = model(input_ids=ids, output_attentions=True, output_hidden_states=True)
    assert seen == ["attn0", "mlp0", "attn1", "mlp1"]
    assert len(got.attentions) == len(want.attentions) == 2
    for ours, theirs in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=2e-5)
    assert len(got.hidden_states) == len(want.hidden_states)
    assert model(input_ids=ids).attentions is None


def test_attention_false_patches_only_the_mlp_half() -> None:
    model = patch_llama(_model(), verify=False, tune="off", attention=False)
    layer = model.model.layers[0]
    assert type(layer.self_attn).__name__ == "LlamaAttention"
    assert type(layer.input_layernorm).__name__ == "LlamaRMSNorm"
    assert isinstance(layer.mlp, CodaLlamaMLP)
    patch_llama(model, verify=False, tune="off")  # the attention half later
    assert isinstance(layer.self_attn, CodaLlamaAttention)
    assert layer.self_attn.norm.weight is layer.input_layernorm.weight


def test_state_dicts_keep_hugging_face_keys_both_ways() -> None:
    hf, other = _model(seed=1), _model(seed=2)
    patched = patch_llama(copy.deepcopy(other), verify=False, tune="off")
    state = patched.state_dict()
    assert state.keys() == other.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())
    patched.load_state_dict(hf.state_dict())  # a Hugging Face checkpoint loads as is
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        want, got = hf(input_ids=ids).logits, patched(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_a_patched_model_survives_deepcopy_and_torch_save() -> None:
    """The registered ops do not pickle: copies carry how to resolve them (both halves)."""
    import io

    model = patch_llama(_model(seed=12), verify=False, tune="off")
    ids = torch.randint(0, 96, (1, 6))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for other in copies:
            assert torch.equal(other(input_ids=ids).logits, want)
            layer = other.model.layers[0]
            assert layer.self_attn.norm.weight is layer.input_layernorm.weight  # still shared


def test_generation_is_unchanged() -> None:
    hf = _model(seed=3)
    patched = patch_llama(copy.deepcopy(hf), verify=False, tune="off")
    ids = torch.randint(0, 96, (1, 5))
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(ids, **kwargs), hf.generate(ids, **kwargs))


def test_under_autocast_the_patched_model_keeps_hugging_face_precision() -> None:
    """fp32 weights under fp16 autocast (bf16 on a GPU): logits and every gradient held to the
    sandbox's rule against the fp32 model (within 2× Hugging Face's own autocast error plus a
    floor), in Hugging Face's dtypes."""
    from coda.blocks import get_block
    from coda.sandbox import check_output

    hf = _model(seed=4)
    patched = patch_llama(copy.deepcopy(hf), verify=False, tune="off")
    ids = torch.randint(0, 96, (2, 7))
    ref_logits, _, ref_grads = _step(hf, ids)
    with torch.autocast("cpu", dtype=torch.float16):
        hf_logits, _, hf_grads = _step(hf, ids)
        logits, _, grads = _step(patched, ids)
    tol = get_block("llama_mlp").tolerance
    pairs = [("logits", logits, ref_logits, hf_logits)]
    pairs += [(n, grads[n], ref_grads[n], hf_grads[n]) for n in ref_grads]
    for name, got, want, theirs in pairs:
        assert got.dtype == theirs.dtype, name  # fp16 logits (the LM head autocasts), fp32 grads
        c = check_output(name, got, want, theirs, tol, sizes={}, seed=0, run_dtype=torch.float16)
        assert c.passed, c.summary()


def test_patching_is_checked_before_anything_changes_and_is_idempotent() -> None:
    with pytest.raises(ValueError, match="no decoder layer"):
        patch_llama(torch.nn.Linear(4, 4))
    biased = _model(mlp_bias=True)
    before = [type(layer.mlp) for layer in biased.model.layers]
    with pytest.raises(ValueError, match="has a bias"):
        patch_llama(biased, verify=False)
    assert [type(layer.mlp) for layer in biased.model.layers] == before  # untouched
    biased = _model(attention_bias=True)
    with pytest.raises(ValueError, match="self_attn.q_proj has a bias"):
        patch_llama(biased, verify=False)
    layer = biased.model.layers[0]  # neither half changed
    assert type(layer.mlp).__name__ == "LlamaMLP"
    assert type(layer.self_attn).__name__ == "LlamaAttention"
    model = patch_llama(_model(), verify=False, tune="off")
    mlps = [layer.mlp for layer in model.model.layers]
    assert patch_llama(model, verify=False) is model
    assert [layer.mlp for layer in model.model.layers] == mlps


def test_look_alike_layers_are_refused_not_computed_as_llama() -> None:
    """Qwen3's attention (per-head q/k norms before RoPE) and Mistral's (sliding window) would be
    computed wrong by the Llama kernel: refused with a hint, nothing changed; their MLP half
    (Llama's) still patches. Norms are probed: Gemma's x̂·(1 + w) and a LayerNorm are no RMSNorm
    with weight w."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from coda.export import CodaLlamaMLPBlock

    small = {
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
    }  # fmt: skip
    qwen = Qwen3ForCausalLM(Qwen3Config(**small, head_dim=8))
    mistral = MistralForCausalLM(MistralConfig(**small, sliding_window=4))
    for model, name in ((qwen, "Qwen3Attention"), (mistral, "MistralAttention")):
        with pytest.raises(ValueError, match=f"self_attn is a {name}, not Hugging Face's Llama"):
            patch_llama(model, verify=False, tune="off")
        assert type(model.model.layers[0].mlp).__name__.endswith("MLP")  # untouched
        patch_llama(model, verify=False, tune="off", attention=False)
        assert isinstance(model.model.layers[0].mlp, CodaLlamaMLP)
    mlp = _model().model.layers[0].mlp
    for norm in (GemmaRMSNorm(48), torch.nn.LayerNorm(48)):
        with torch.no_grad():
            norm.weight.normal_()
        with pytest.raises(ValueError, match="RMSNorm"):
            CodaLlamaMLPBlock(norm, mlp, verify=False, tune="off")


def test_casting_a_patched_model_casts_what_the_kernels_read() -> None:
    """model.half() after patching: the blocks read the same (converted) Parameters."""
    hf = _model(seed=6)
    patched = patch_llama(copy.deepcopy(hf), verify=False, tune="off").half()
    layer = patched.model.layers[0]
    assert layer.mlp.block.norm.weight is layer.post_attention_layernorm.weight
    assert layer.mlp.block.mlp.gate_proj.weight.dtype == torch.float16
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        want, got = hf.half()(input_ids=ids).logits, patched(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_a_patched_llama_with_fused_gate_up_trains_like_the_original() -> None:
    """fuse_gate_up: one interleaved parameter per layer whose gradient's even / odd rows are
    Hugging Face's gate / up gradients; state dicts keep Hugging Face's keys both ways."""
    hf = _model(seed=7)
    patched = patch_llama(copy.deepcopy(hf), verify=False, tune="off", fuse_gate_up=True)
    ids = torch.randint(0, 96, (2, 7))
    logits, _, grads = _step(hf, ids)
    got_logits, _, got_grads = _step(patched, ids)
    torch.testing.assert_close(got_logits, logits, atol=2e-5, rtol=2e-5)
    for i in range(2):
        fused = got_grads.pop(f"model.layers.{i}.mlp.gate_up_weight")
        for rows, proj in ((slice(0, None, 2), "gate_proj"), (slice(1, None, 2), "up_proj")):
            want = grads.pop(f"model.layers.{i}.mlp.{proj}.weight")
            torch.testing.assert_close(fused[rows], want, atol=2e-5, rtol=2e-5)
    assert got_grads.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=2e-5, rtol=2e-5, msg=name)
    state = patched.state_dict()
    assert state.keys() == hf.state_dict().keys()
    assert all(torch.allclose(state[k], v) for k, v in hf.state_dict().items())
    other = _model(seed=8)
    patched.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            patched(input_ids=ids).logits, other(input_ids=ids).logits, atol=2e-5, rtol=2e-5
        )


def test_a_failed_patch_leaves_every_layer_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    import coda.export.mlp as mlp_module
    from coda.export import NotVerified

    def unverified(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise NotVerified("llama_mlp_branch_train: not verified")

    monkeypatch.setattr(mlp_module, "llama_mlp_function", unverified)
    model = _model(seed=9)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(NotVerified):
        patch_llama(model, fuse_gate_up=True)
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in model.model.layers)
    assert model.model.layers[0].mlp.gate_proj.weight is not None
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing_recomputes_through_the_patched_layers(reentrant: bool) -> None:
    """Hugging Face's gradient checkpointing reruns each layer in the backward (the first pass of
    the reentrant kind without gradients: the inference Program): same loss and gradients."""
    hf = _model(seed=10).train()
    patched = patch_llama(copy.deepcopy(hf), verify=False, tune="off")
    kwargs = {"use_reentrant": reentrant}
    patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    ids = torch.randint(0, 96, (2, 7))
    _, loss, grads = _step(hf, ids)
    _, got_loss, got_grads = _step(patched, ids)
    torch.testing.assert_close(got_loss, loss, atol=2e-6, rtol=2e-6)
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=2e-5, rtol=2e-5, msg=name)


_SMALL = {
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
}  # fmt: skip


def _types(model: torch.nn.Module) -> list[type]:
    return [type(m) for m in model.modules()]


@pytest.mark.parametrize("attention", [True, False], ids=["attention", "mlp-only"])
def test_a_post_norm_layer_is_refused_naming_the_norm(attention: bool) -> None:
    """OLMo-2 normalizes the attention output with ``post_attention_layernorm`` and feeds the MLP
    the un-normalized residual stream: deferring that norm into the MLP computes another model
    (relative error ≈ 1.4 before the dataflow probe). Refused with the reason, nothing changed."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(0)
    model = Olmo2ForCausalLM(Olmo2Config(**_SMALL, pad_token_id=0, eos_token_id=1)).eval()
    before = _types(model)
    with pytest.raises(ValueError, match=r"model\.layers\.0: post_attention_layernorm normalizes"):
        patch_llama(model, verify=False, tune="off", attention=attention)
    assert _types(model) == before


def test_a_mixture_of_experts_mlp_is_refused_not_an_attribute_error() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    model = MixtralForCausalLM(MixtralConfig(**_SMALL, num_local_experts=4)).eval()
    before = _types(model)
    for attention in (True, False):
        with pytest.raises(ValueError, match=r"model\.layers\.0: mlp \(MixtralSparseMoeBlock\)"):
            patch_llama(model, verify=False, tune="off", attention=attention)
    assert _types(model) == before


def test_the_dataflow_probe_leaves_the_model_as_it_was() -> None:
    """Training mode (dropout on) and the RNG state survive the probe forward; no gradient or
    parameter changes. Weights on the meta device are refused: there is nothing to probe with."""
    model = _model(seed=13, attention_dropout=0.5).train()
    model.model.layers[1].eval()  # modes are restored per module
    modes = [m.training for m in model.modules()]
    params = {n: p.clone() for n, p in model.named_parameters()}
    state = torch.get_rng_state()
    patch_llama(model, verify=False, tune="off", fused_loss=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert [m.training for m in model.modules()] == modes
    for name, p in model.named_parameters():
        assert p.grad is None and torch.equal(p, params[name]), name
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**_SMALL))
    with pytest.raises(ValueError, match="meta device"):
        patch_llama(meta, verify=False, tune="off")


def test_granite_scales_are_refused_where_they_are_not_one() -> None:
    """Granite's layers add ``residual_multiplier · mlp(norm(h))`` and its logits are divided by
    ``logits_scaling``: at 1 the MLP half and the head compute Llama's and patch; otherwise the
    layer (``attention=False``) or the fused loss is refused, the model untouched."""
    from transformers import GraniteConfig, GraniteForCausalLM

    from coda.export import causal_lm_loss, fuse_causal_lm_loss

    def granite(**config: float) -> torch.nn.Module:
        torch.manual_seed(0)
        return GraniteForCausalLM(GraniteConfig(**_SMALL, **config)).eval()

    model = granite(residual_multiplier=0.5)
    before = _types(model)
    with pytest.raises(ValueError, match=r"model\.layers\.0: the layer's output is not h \+ mlp"):
        patch_llama(model, verify=False, tune="off", attention=False)
    assert _types(model) == before
    model = granite(logits_scaling=2.0)
    with pytest.raises(ValueError, match="logits are not lm_head's output"):
        patch_llama(model, verify=False, tune="off", attention=False, fused_loss=True)
    assert _types(model) == before
    with pytest.raises(ValueError, match="logits are not lm_head's output"):
        fuse_causal_lm_loss(model, verify=False)
    ids = torch.randint(0, 64, (1, 5))
    with pytest.raises(ValueError, match="logits are not lm_head's output"):
        causal_lm_loss(model, ids, ids, verify=False)
    patch_llama(model, verify=False, tune="off", attention=False)  # the layers alone: Llama's
    assert isinstance(model.model.layers[0].mlp, CodaLlamaMLP)


def test_torch_compile_traces_a_patched_training_step_whole() -> None:
    """``torch.compile(patch_llama(model, fuse_gate_up=True, fused_loss=True), fullgraph=True)``:
    forward with labels (the fused loss) and backward trace with no graph break — the custom ops
    have fake implementations, the final norm defers without changing the module tree — and give
    the eager patched model's loss and gradients. Nothing the patched model runs makes Dynamo
    warn (a cached function's call in the layer's forward did, naming coda's file)."""
    model = patch_llama(
        _model(num_hidden_layers=1).train(), verify=False, tune="off", fuse_gate_up=True,
        fused_loss=True,
    )  # fmt: skip
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 96, (1, 9))
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(input_ids=ids, labels=ids).loss
    got.backward()
    dynamo = [str(w.message) for w in caught if "Dynamo detected" in str(w.message)]
    assert not dynamo, dynamo
    torch.testing.assert_close(got, loss, atol=1e-6, rtol=1e-6)
    grads = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-6, rtol=1e-6, msg=name)


def test_the_probe_drops_its_cache_without_the_deprecated_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's model output keeps no key/value cache, under the field name the installed
    transformers uses (``cache`` or ``past_key_values``), and patching never reads the other
    name's compatibility property — which logs a deprecation warning in releases that renamed
    the field."""
    from transformers import DynamicCache
    from transformers.utils import generic

    from coda.export.probe import probe_forward

    logged: list[str] = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda msg, *a, **k: logged.append(msg))
    model = _model(seed=5)
    recording = probe_forward(model, [model.model.layers[0]])
    out = recording.output
    names = [f.name for f in dataclasses.fields(out) if f.name in ("cache", "past_key_values")]
    assert names and all(getattr(out, n) is None for n in names)
    assert not any(isinstance(v, DynamicCache) for v in out.values())
    patch_llama(model, verify=False, tune="off", fused_loss=True)
    assert not [m for m in logged if "deprecated" in m], logged
