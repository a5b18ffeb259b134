"""A patched Llama trained by the Hugging Face ``Trainer``, unchanged: a tiny random
``LlamaForCausalLM`` and its ``patch_llama`` copy, trained a few steps each on the same in-memory
batches with the same seed, log the same losses and gradient norms — with the packed gate/up
parameter, with gradient checkpointing, and with the fused loss under gradient accumulation
(the Trainer hands the model ``num_items_in_batch``)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from coda.export import patch_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own dependency

STEPS = 4
VOCAB = 64


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1, so a norm applied twice or never shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


class _Tokens(torch.utils.data.Dataset):
    """Sixteen sequences of 6 random tokens, the labels of each ignored (-100) at a different
    number of positions: the mean loss over a batch of several micro-batches then differs from
    the mean of their means (the Trainer's ``num_items_in_batch`` matters)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (16, 6), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[: i % 4] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def _train(model: torch.nn.Module, out: Path, **args: object) -> list[tuple[float, float]]:
    """``(loss, grad_norm)`` of each step the Trainer logs."""
    from transformers import Trainer, TrainingArguments

    arguments = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1,
        learning_rate=1e-2, save_strategy="no", report_to="none", seed=0, use_cpu=True,
        disable_tqdm=True, **args,
    )  # fmt: skip
    trainer = Trainer(model=model, args=arguments, train_dataset=_Tokens())
    trainer.train()
    logged = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == STEPS
    return logged


@pytest.mark.parametrize(
    ("patch", "args"),
    [
        ({}, {}),
        ({"fuse_gate_up": True}, {}),
        ({}, {"gradient_checkpointing": True}),
        ({"fused_loss": True}, {"gradient_accumulation_steps": 2}),
    ],
    ids=["patched", "fuse_gate_up", "gradient_checkpointing", "fused_loss-accumulated"],
)
def test_the_trainer_logs_the_unpatched_model_s_losses(
    patch: dict, args: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import coda.export.lm_head as lm_head

    fused_calls = []
    fused_loss = lm_head.causal_lm_loss

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        fused_calls.append(k.get("num_items_in_batch"))
        return fused_loss(*a, **k)

    monkeypatch.setattr(lm_head, "causal_lm_loss", counted)
    hf = _model()
    want = _train(copy.deepcopy(hf), tmp_path / "hf", **args)
    assert not fused_calls
    coda = patch_llama(copy.deepcopy(hf), verify=False, tune="off", **patch)
    got = _train(coda, tmp_path / "coda", **args)
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, want, strict=True)):
        assert loss == pytest.approx(want_loss, rel=1e-5), f"step {step + 1}: loss"
        assert norm == pytest.approx(want_norm, rel=1e-5), f"step {step + 1}: grad_norm"
    if patch.get("fused_loss"):  # every micro-batch's loss fused, with the batch's token count
        assert len(fused_calls) == STEPS * args["gradient_accumulation_steps"]
        assert all(n is not None for n in fused_calls)
