"""What a patched model meets after patching, in training scripts: a head resized or wrapped, a
loss function or softcap changed, loss arguments and outputs the fused loss does not take, a
dtype the kernels do not compute in, a gate and up projection frozen apart. Each either computes
what Hugging Face's model computes or stops with the reason — never trains a different model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from coda.export import CodaLlamaMLPBlock, patch_llama, patch_model

from .test_patch import _model

transformers = pytest.importorskip("transformers")


def _pair(seed: int, **config: object) -> tuple[nn.Module, nn.Module]:
    """A random Llama in training mode and its copy patched with the fused loss."""
    hf = _model(seed=seed, **config).train()
    return hf, patch_llama(copy.deepcopy(hf), verify=False, tune="off", fused_loss=True)


def _batch(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _loss_and_grads(model: nn.Module, **batch: object) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(hf: nn.Module, coda: nn.Module, **batch: object) -> None:
    (want, want_grads), (got, grads) = _loss_and_grads(hf, **batch), _loss_and_grads(coda, **batch)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-5, rtol=2e-5, msg=name)


def test_a_head_resized_after_patching_is_the_head_the_fused_loss_trains() -> None:
    hf, coda = _pair(seed=31)
    for model in (hf, coda):
        model.resize_token_embeddings(128)  # an untied head: a new nn.Linear
    ids, labels = _batch()
    labels[1, 4] = 120  # a token only the resized vocabulary has
    _assert_same_step(hf, coda, input_ids=ids, labels=labels)
    assert coda.lm_head.weight.grad is not None


class _Wrapped(nn.Module):
    """A stand-in for an adapter wrapping the head (PEFT's ``ModulesToSaveWrapper``)."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner, self.weight = inner, inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 1.5


def test_a_head_wrapped_after_patching_stops_the_training_forward() -> None:
    _, coda = _pair(seed=32)
    coda.lm_head = _Wrapped(coda.lm_head)
    ids, labels = _batch()
    with pytest.raises(RuntimeError, match=r"model.lm_head was replaced \(now a _Wrapped\)"):
        coda(input_ids=ids, labels=labels)


def test_a_loss_function_set_after_patching_is_proven_again() -> None:
    hf, coda = _pair(seed=33)
    ids, labels = _batch()
    standard = hf.loss_function
    for model in (hf, coda):  # the same loss under another function: proven, fused again
        model.loss_function = lambda *args, **kwargs: standard(*args, **kwargs)
    _assert_same_step(hf, coda, input_ids=ids, labels=labels)

    def smoothed(logits: torch.Tensor, labels: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return standard(logits, labels, **kwargs) * 0.9 + 0.1 * logits.float().logsumexp(-1).mean()

    coda.loss_function = smoothed
    with pytest.raises(RuntimeError, match="model.loss_function was changed after the fused loss"):
        coda(input_ids=ids, labels=labels)


def test_a_softcap_set_after_patching_that_the_model_does_not_apply_stops_the_forward() -> None:
    _, coda = _pair(seed=34)
    coda.config.final_logit_softcapping = 30.0  # Llama's forward never caps its logits
    ids, labels = _batch()
    with pytest.raises(RuntimeError, match="final_logit_softcapping changed from None to 30.0"):
        coda(input_ids=ids, labels=labels)


def test_shift_labels_and_hidden_states_take_the_class_forward() -> None:
    hf, coda = _pair(seed=35, attn_implementation="eager")  # sdpa returns no attention maps
    ids, labels = _batch()
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    shifted[0, 5] = -100  # not what shifting labels gives
    _assert_same_step(hf, coda, input_ids=ids, labels=labels, shift_labels=shifted)
    _assert_same_step(hf, coda, input_ids=ids, labels=labels, output_hidden_states=True)
    out = coda(input_ids=ids, labels=labels, output_hidden_states=True, output_attentions=True)
    ref = hf(input_ids=ids, labels=labels, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == 3
    assert len(out.attentions) == len(ref.attentions) == 2
    for got, want in zip(out.hidden_states, ref.hidden_states, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    coda.config.output_hidden_states = True  # asked by the config
    assert len(coda(input_ids=ids, labels=labels).hidden_states) == 3
    coda.config.output_hidden_states = False
    assert coda(input_ids=ids, labels=labels).logits is None  # the fused loss again


def test_float64_is_kept_at_patching_and_refused_after() -> None:
    model = _model(seed=36).double()
    report = patch_model(model, tune="off", fused_loss=True)
    assert not any(report.patched(kind) for kind in report.lines), report
    assert "weight is torch.float64: the kernels compute in float32, float16 or bfloat16" in str(
        report
    )
    patched = _model(seed=36)
    patch_model(patched, tune="off")
    patched.double()
    with pytest.raises(TypeError, match="activations in torch.float64"):
        patched(input_ids=_batch()[0])


@pytest.mark.parametrize("frozen", ["gate_proj", "up_proj"])
def test_gate_and_up_frozen_apart_are_not_fused_into_one_flag(frozen: str) -> None:
    model = _model(seed=37)
    getattr(model.model.layers[1].mlp, frozen).weight.requires_grad_(False)
    report = patch_model(model, tune="off", fuse_gate_up=True)
    assert report.lines["MLP half"].startswith("kept: model.layers.1: fuse_gate_up: ")
    layer = model.model.layers[0]  # built before layer 1 was refused: its weights not moved
    assert {"gate_proj.weight", "up_proj.weight"} <= dict(layer.mlp.named_parameters()).keys()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="fuse_gate_up: mlp.gate_proj.weight"):
        patch_llama(model, tune="off", fuse_gate_up=True)
    after = model.state_dict()  # no layer changed
    assert after.keys() == before.keys() and all(after[k].equal(v) for k, v in before.items())
    layer.mlp.up_proj.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        CodaLlamaMLPBlock(layer.post_attention_layernorm, layer.mlp, tune="off", fuse_gate_up=True)
