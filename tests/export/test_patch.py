"""coda.export.patch_llama: a whole Hugging Face LlamaForCausalLM (random LlamaConfig, no
downloads) with every post-attention norm + MLP on CODA kernels, through the interpreter —
logits, loss, every parameter's gradient, state dicts and generation against the unpatched model."""

from __future__ import annotations

import copy

import pytest
import torch

from coda.export import CodaLlamaMLP, DeferredRMSNorm, patch_llama

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
        assert isinstance(layer.post_attention_layernorm, DeferredRMSNorm)
        assert isinstance(layer.mlp, CodaLlamaMLP)
    ids = torch.randint(0, 96, (2, 7))
    logits, loss, grads = _step(hf, ids)
    got_logits, got_loss, got_grads = _step(patched, ids)
    torch.testing.assert_close(got_logits, logits, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_loss, loss, atol=2e-6, rtol=2e-6)
    assert got_grads.keys() == grads.keys()  # the same parameters, by the same names
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=2e-5, rtol=2e-5, msg=name)


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
    model = patch_llama(_model(), verify=False, tune="off")
    mlps = [layer.mlp for layer in model.model.layers]
    assert patch_llama(model, verify=False) is model
    assert [layer.mlp for layer in model.model.layers] == mlps


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
