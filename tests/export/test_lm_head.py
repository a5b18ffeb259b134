"""coda.export.causal_lm_loss / CodaLlamaLMHeadLoss: Hugging Face's causal-LM loss of a random
LlamaForCausalLM with the final norm, LM head and cross-entropy fused (no [tokens, vocabulary]
logits), through the interpreter — value and every parameter's gradient against
``model(..., labels=...).loss``."""

from __future__ import annotations

import copy

import pytest
import torch

from coda.export import CodaLlamaLMHeadLoss, causal_lm_loss, patch_llama

from .test_patch import _model

transformers = pytest.importorskip("transformers")


def _loss_and_grads(model, loss_fn) -> tuple[torch.Tensor, dict]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt whose tokens are not trained on
    labels[1, -2] = -100
    return labels


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_the_fused_loss_equals_hugging_face_s(tied: bool) -> None:
    model = _model(seed=11, tie_word_embeddings=tied)
    ids = torch.randint(0, 96, (2, 9))
    labels = _labels(ids)
    want, want_grads = _loss_and_grads(model, lambda: model(input_ids=ids, labels=labels).loss)
    # verified once: the final norm's epsilon (1e-6) makes its own llama_lm_head_ce variant
    got, grads = _loss_and_grads(model, lambda: causal_lm_loss(model, ids, labels, tune="off"))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-6, rtol=1e-5, msg=name)


def test_num_items_in_batch_and_masks_pass_through() -> None:
    model = _model(seed=12)
    ids = torch.randint(0, 96, (2, 9))
    labels, mask = _labels(ids), torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0  # left padding

    def hf() -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=40).loss

    def coda() -> torch.Tensor:
        return causal_lm_loss(
            model, ids, labels, num_items_in_batch=40, attention_mask=mask, verify=False
        )

    (want, want_grads), (got, grads) = _loss_and_grads(model, hf), _loss_and_grads(model, coda)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-6, rtol=1e-5, msg=name)


def test_with_patch_llama_the_whole_step_runs_on_coda_kernels() -> None:
    hf = _model(seed=13)
    patched = patch_llama(copy.deepcopy(hf), verify=False, tune="off")
    ids = torch.randint(0, 96, (2, 9))
    labels = _labels(ids)
    want, want_grads = _loss_and_grads(hf, lambda: hf(input_ids=ids, labels=labels).loss)
    got, grads = _loss_and_grads(
        patched, lambda: causal_lm_loss(patched, ids, labels, verify=False, tune="off")
    )
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-5, rtol=2e-5, msg=name)


def test_under_autocast_the_loss_keeps_hugging_face_precision() -> None:
    """fp32 weights under fp16 autocast (bf16 on a GPU): loss and gradients held to the sandbox's
    rule against the fp32 run, next to Hugging Face's own autocast error."""
    model = _model(seed=14)
    ids = torch.randint(0, 96, (2, 9))
    check_fp16_autocast_precision(
        model, ids, lambda labels: causal_lm_loss(model, ids, labels, verify=False, tune="off")
    )


def check_fp16_autocast_precision(model, ids, loss_fn, after_reference=None) -> None:  # noqa: ANN001
    """``loss_fn(labels)`` under fp16 autocast: its loss and every gradient held to the sandbox's
    rule (``llama_lm_head_ce``'s tolerance) against the fp32 run of Hugging Face's loss, next to
    Hugging Face's own fp16 autocast error. ``after_reference()``, if given, runs between the
    fp32 reference and the autocast runs."""
    from coda.blocks import get_block
    from coda.sandbox import check_output

    labels = _labels(ids)
    ref, ref_grads = _loss_and_grads(model, lambda: model(input_ids=ids, labels=labels).loss)
    if after_reference is not None:
        after_reference()
    with torch.autocast("cpu", dtype=torch.float16):
        hf, hf_grads = _loss_and_grads(model, lambda: model(input_ids=ids, labels=labels).loss)
        got, grads = _loss_and_grads(model, lambda: loss_fn(labels))
    tol = get_block("llama_lm_head_ce").tolerance
    pairs = [("loss", got, ref, hf)] + [(n, grads[n], ref_grads[n], hf_grads[n]) for n in ref_grads]
    for name, g, want, theirs in pairs:
        assert g.dtype == theirs.dtype == torch.float32, name
        c = check_output(name, g, want, theirs, tol, sizes={}, seed=0, run_dtype=torch.float16)
        assert c.passed, c.summary()


def test_bad_input_gets_a_specific_error() -> None:
    model = _model(seed=15)
    loss = CodaLlamaLMHeadLoss(model.model.norm, model.lm_head, verify=False, tune="off")
    with pytest.raises(ValueError, match="must have hidden's shape without its last dim"):
        loss(torch.randn(2, 9, 48), torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="or run under torch.autocast"):
        loss(torch.randn(2, 9, 48, dtype=torch.float16), torch.zeros(2, 9, dtype=torch.long))
    head = torch.nn.Linear(48, 96, bias=True)
    with pytest.raises(ValueError, match="lm_head has a bias"):
        CodaLlamaLMHeadLoss(model.model.norm, head, verify=False)


@pytest.mark.parametrize("label", [96, 500, -5])
def test_a_label_outside_the_vocabulary_raises_as_hugging_face_s_loss(label: int) -> None:
    """A label the head has no logit for (a tokenizer larger than the vocabulary) raises
    ``IndexError`` in training and in evaluation, as Hugging Face's loss does — never a loss
    that scores class 0 or leaves the token out."""
    model = _model(seed=17)
    ids = torch.randint(0, 96, (2, 6))
    labels = ids.clone()
    labels[1, 3] = label
    with pytest.raises(IndexError, match="Target"):
        model(input_ids=ids, labels=labels)
    with pytest.raises(IndexError, match=f"label {label} is not a class of the vocabulary"):
        causal_lm_loss(model, ids, labels, verify=False, tune="off")
    with torch.no_grad(), pytest.raises(IndexError, match=f"label {label} is not a class"):
        causal_lm_loss(model, ids, labels, verify=False, tune="off")


def test_a_batch_with_no_counted_token_has_zero_loss_and_gradients() -> None:
    model = _model(seed=16)
    ids = torch.randint(0, 96, (1, 5))
    labels = torch.full_like(ids, -100)
    loss, grads = _loss_and_grads(
        model, lambda: causal_lm_loss(model, ids, labels, verify=False, tune="off")
    )
    assert loss.item() == 0.0
    assert all(not g.any() for g in grads.values())


def test_a_fused_loss_model_trains_like_hugging_face_and_evaluates_with_logits() -> None:
    """patch_llama(fused_loss=True): in training model(..., labels=...) returns the fused loss
    and no logits (what the Hugging Face Trainer calls); in eval mode, or without labels,
    logits as before. Copies run on themselves."""
    hf = _model(seed=17).train()
    coda = patch_llama(copy.deepcopy(hf), verify=False, tune="off", fused_loss=True)
    ids = torch.randint(0, 96, (2, 9))
    labels = _labels(ids)

    def loss_of(model):  # noqa: ANN001, ANN202
        return lambda: model(input_ids=ids, labels=labels, num_items_in_batch=11).loss

    want, want_grads = _loss_and_grads(hf, loss_of(hf))
    got, grads = _loss_and_grads(coda, loss_of(coda))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-5, rtol=2e-5, msg=name)
    assert coda(input_ids=ids, labels=labels).logits is None  # training: no logits made
    assert coda(input_ids=ids).logits.shape == (2, 9, 96)  # no labels: logits
    copied = copy.deepcopy(coda).eval()
    with torch.no_grad():
        out, ref = copied(input_ids=ids, labels=labels), hf.eval()(input_ids=ids, labels=labels)
    assert copied.forward.__self__ is copied
    torch.testing.assert_close(out.logits, ref.logits, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.loss, ref.loss, atol=2e-6, rtol=2e-6)


def test_the_loss_builds_masks_as_the_model_s_own_forward_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With use_cache=False and no attention mask, Hugging Face looks for packed sequences in the
    # position ids with a `.all()` — a host sync each training step (5 ms of GPU idle per step on
    # the H200). model(input_ids, labels=...) keeps the config's cache and skips that check, and
    # so must the fused loss.
    from transformers import masking_utils

    calls: list[int] = []
    real = masking_utils.find_packed_sequence_indices

    def counted(position_ids: torch.Tensor) -> torch.Tensor | None:
        calls.append(1)
        return real(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    model = _model(seed=13)
    ids = torch.randint(0, 96, (2, 9))
    model(input_ids=ids, labels=ids)
    assert calls == []
    causal_lm_loss(model, ids, ids, verify=False, tune="off")
    assert calls == []
    causal_lm_loss(model, ids, ids, verify=False, tune="off", use_cache=False)  # asked for
    assert calls == [1]


def test_the_final_norm_is_not_computed_twice() -> None:
    """The fused loss normalizes in its own kernels: Hugging Face's final norm does not run its
    math in ``causal_lm_loss`` (its output was discarded), and is itself again afterwards — also
    when the base model raises."""
    model = _model(seed=14)
    ids = torch.randint(0, 96, (2, 9))
    norm = model.model.norm
    calls: list[int] = []
    real = type(norm).forward

    def counted(self, hidden_states):  # noqa: ANN001, ANN202
        calls.append(1)
        return real(self, hidden_states)

    causal_lm_loss(model, ids, ids, verify=False, tune="off")  # built once (it probes the norm)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(norm), "forward", counted)
        model(input_ids=ids)
        assert len(calls) == 1 + 2 * model.config.num_hidden_layers  # HF's own forward
        calls.clear()
        loss = causal_lm_loss(model, ids, ids, verify=False, tune="off")
        # the layers' norms run as before; the final one does not
        assert len(calls) == 2 * model.config.num_hidden_layers
    assert not norm._coda_deferred and torch.isfinite(loss)
    loss.backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
    embeds = torch.zeros(2, 9, model.config.hidden_size)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        causal_lm_loss(model, ids, ids, verify=False, tune="off", inputs_embeds=embeds)
    assert not norm._coda_deferred
    d = model.config.hidden_size  # the norm normalizes again: rms of ones is one
    torch.testing.assert_close(norm(torch.ones(1, d)), norm.weight.detach().expand(1, d))
    # a forward another patch set on the instance still runs outside the fused loss
    norm.forward = lambda hidden_states: hidden_states * 2
    causal_lm_loss(model, ids, ids, verify=False, tune="off")
    torch.testing.assert_close(norm(torch.ones(1, d)), 2 * torch.ones(1, d))
