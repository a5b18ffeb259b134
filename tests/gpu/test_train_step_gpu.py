"""coda.export.capture_train_step on a GPU in bfloat16 (skipped without one): a tiny patched Llama
(``patch_llama``, packed gate/up, fused loss) and Qwen3 (``patch_model``, fused loss) trained by
the captured step and eagerly — each step's loss, the last gradients and the parameters equal to
bf16 tolerance; a learning-rate scheduler writing a tensor lr reaches the replays; batches of two
shapes get a graph each and a third past ``max_graphs`` is refused; a host sync in the loss, a
float lr changed by a scheduler and an eager backward between calls are refused."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from coda.export import CaptureError, capture_train_step, patch_llama, patch_model
from coda.export.families import ATTENTION_INPUT, LM_HEAD_LOSS, MLP_HALF

transformers = pytest.importorskip("transformers")
CUDA = torch.device("cuda")
CONFIG = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "use_cache": False,
}  # fmt: skip
STEPS, WARMUP = 6, 2  # steps 1-2 eager, 3 captured and replayed, 4-6 replayed


def _hf(family: str) -> nn.Module:
    """A random tiny model in bf16 on the GPU, norms away from 1."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**CONFIG, head_dim=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.to(CUDA, torch.bfloat16).train()


def _patched(hf: nn.Module, family: str) -> nn.Module:
    model = copy.deepcopy(hf)
    if family == "llama":
        return patch_llama(model, fuse_gate_up=True, fused_loss=True)
    report = patch_model(model, fused_loss=True)
    assert all(report.patched(k) for k in (ATTENTION_INPUT, MLP_HALF, LM_HEAD_LOSS)), str(report)
    return model


def _adamw(model: nn.Module, lr: float | torch.Tensor = 1e-3) -> torch.optim.Optimizer:
    lr = torch.tensor(lr, device=CUDA) if isinstance(lr, float) else lr
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)


def _batches(n: int, tokens: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of 2 × ``tokens`` random ids, two label positions ignored."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, CONFIG["vocab_size"], (2, tokens), device=CUDA, generator=g)
        labels = ids.clone()
        labels[0, 2] = labels[1, 5] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _eager_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable:
    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _train(step: Callable, batches: list, sched: object = None, after: Callable | None = None):  # noqa: ANN202
    losses = []
    for i, batch in enumerate(batches):
        losses.append(step(batch).clone())
        if sched is not None:
            sched.step()
        if after is not None:
            after(i)
    return losses


def _assert_same_training(got: nn.Module, want: nn.Module, got_losses: list, want_losses: list):  # noqa: ANN202
    for i, (a, b) in enumerate(zip(got_losses, want_losses, strict=True)):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-5, msg=f"step {i + 1}'s loss")
    pairs = zip(got.named_parameters(), want.parameters(), strict=True)
    for (name, p), q in pairs:
        torch.testing.assert_close(p, q, msg=name)  # bf16: rtol 1.6e-2, atol 1e-5
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=f"{name}.grad")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_captured_patched_model_trains_like_the_eager_one(family: str) -> None:
    hf = _hf(family)
    graphed, eager = _patched(hf, family), _patched(hf, family)
    batches = _batches(STEPS)
    opt = _adamw(graphed)
    step = capture_train_step(graphed, opt, batches[0], warmup=WARMUP)
    got = _train(step, batches)
    assert step.captured_shapes == ["input_ids [2, 16], labels [2, 16]"]
    want = _train(_eager_step(eager, _adamw(eager)), batches)
    _assert_same_training(graphed, eager, got, want)
    assert not torch.equal(got[-1], got[-2])  # each replay wrote its own batch's loss


def test_a_scheduler_writing_a_tensor_lr_reaches_the_replays() -> None:
    """LambdaLR takes lr to 0 from step 5: the replayed steps 5 and 6 leave the weights as step 4
    left them, and every step matches eager training under the same schedule."""
    hf = _hf("llama")
    graphed, eager = _patched(hf, "llama"), _patched(hf, "llama")
    batches = _batches(STEPS, seed=1)

    def schedule(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
        opt = _adamw(model)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 if k < 4 else 0.0)

    opt, sched = schedule(graphed)
    step = capture_train_step(graphed, opt, batches[0], warmup=WARMUP)
    seen: dict[int, list[torch.Tensor]] = {}
    got = _train(step, batches, sched, lambda i: seen.update({i: _params(graphed)}))
    assert any(not torch.equal(a, b) for a, b in zip(seen[2], seen[3], strict=True))
    for i in (4, 5):
        assert all(torch.equal(a, b) for a, b in zip(seen[3], seen[i], strict=True)), i
    eager_opt, eager_sched = schedule(eager)
    want = _train(_eager_step(eager, eager_opt), batches, eager_sched)
    _assert_same_training(graphed, eager, got, want)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_each_batch_shape_gets_its_graph_up_to_the_cap() -> None:
    hf = _hf("llama")
    graphed, eager = _patched(hf, "llama"), _patched(hf, "llama")
    short, long = _batches(STEPS, tokens=16, seed=2), _batches(STEPS, tokens=24, seed=3)
    batches = [b for pair in zip(short, long, strict=True) for b in pair]  # alternating
    step = capture_train_step(graphed, _adamw(graphed), short[0], warmup=WARMUP, max_graphs=2)
    got = _train(step, batches)
    assert len(step.captured_shapes) == 2
    want = _train(_eager_step(eager, _adamw(eager)), batches)
    _assert_same_training(graphed, eager, got, want)
    with pytest.raises(CaptureError, match=r"input_ids \[2, 32\].*past max_graphs=2"):
        step(_batches(1, tokens=32)[0])


def test_a_host_sync_in_the_loss_is_refused_naming_its_line() -> None:
    model = _patched(_hf("llama"), "llama")
    logged = []

    def logging_loss(m: nn.Module, batch: dict) -> torch.Tensor:
        loss = m(**batch).loss
        logged.append(float(loss))  # SYNCS
        return loss

    batches = _batches(WARMUP + 1)
    step = capture_train_step(model, _adamw(model), batches[0], logging_loss, warmup=WARMUP)
    _train(step, batches[:WARMUP])  # eager warm-up: the sync is allowed there
    with pytest.raises(CaptureError) as info:
        step(batches[WARMUP])
    msg = str(info.value)
    assert f"{__file__}:" in msg and "logging_loss" in msg and "# SYNCS" in msg, msg
    assert all(p.grad is None for p in model.parameters())
    assert torch.isfinite(model(**batches[0]).loss)  # the model still runs on this stream


def test_a_float_lr_changed_after_capture_is_refused() -> None:
    model = _patched(_hf("llama"), "llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    batches = _batches(WARMUP + 2)
    step = capture_train_step(model, opt, batches[0], warmup=WARMUP)
    _train(step, batches[: WARMUP + 1], sched)  # a float lr may change while the step is eager
    with pytest.raises(CaptureError, match=r"\['lr'\] changed from .* silently ignored"):
        step(batches[-1])


def test_an_eager_backward_between_calls_is_refused() -> None:
    model = _patched(_hf("llama"), "llama")
    batches = _batches(WARMUP + 3)
    step = capture_train_step(model, _adamw(model), batches[0], warmup=WARMUP)
    _train(step, batches[: WARMUP + 1])
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)  # allowed: the next replay attaches its gradients again
    step(batches[WARMUP + 1])
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    model(**batches[0]).loss.backward()  # accumulating into the graph's gradients
    with pytest.raises(CaptureError, match="gradient was written outside the captured step"):
        step(batches[-1])
