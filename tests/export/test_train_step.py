"""coda.export.capture_train_step on the CPU: every refusal that needs no GPU (no CUDA, CPU
tensors, optimizers that are not capturable, batches unlike the example, gradients already
present or written by the loss function, the shape cap, hyperparameters changed after capture
by real schedulers), the step's eager body, and how a host sync is located and reported. The
captured graphs themselves are checked on a GPU (tests/gpu/test_train_step_gpu.py)."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch
from torch import nn

from coda.export import CaptureError, capture_train_step
from coda.export import train_step as ts

CUDA = torch.device("cuda", 0)


class Tiny(nn.Module):
    """A linear regression with Hugging Face's output shape: ``model(**batch).loss``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> object:
        out = self.proj(x)
        loss = None if y is None else (out - y).pow(2).mean()
        return type("Output", (), {"loss": loss, "logits": out})()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(5, 4, generator=g), "y": torch.randn(5, 3, generator=g)}


def _refusal(model: nn.Module, optimizer: object, batch: object = None, **kw: object) -> str:
    with pytest.raises(CaptureError) as info:
        capture_train_step(model, optimizer, _batch() if batch is None else batch, **kw)
    return str(info.value)


def test_a_model_on_the_cpu_is_refused_naming_the_parameter() -> None:
    model = Tiny()
    msg = _refusal(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "proj.weight is on cpu, not a CUDA device" in msg
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in msg and "run the step eagerly" in msg


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: torch.optim.AdamW(p), "AdamW's param_groups[0] has capturable=False"),
        (lambda p: torch.optim.AdamW(p, fused=True), "fused=True alone is not enough"),
        (lambda p: torch.optim.Adagrad(p), "Adagrad has no capturable flag"),
        (lambda p: torch.optim.LBFGS(p), "LBFGS has no capturable flag"),
        (lambda p: torch.optim.SGD(p, lr=torch.tensor(0.1)), "tensor lr without fused=True"),
    ],
    ids=["adamw", "adamw-fused-only", "adagrad", "lbfgs", "sgd-tensor-lr"],
)
def test_an_optimizer_that_cannot_be_replayed_is_refused_naming_the_flag(make, says) -> None:  # noqa: ANN001
    model = Tiny()
    msg = _refusal(model, make(model.parameters()))
    assert says in msg
    if "capturable=False" in says:  # the fix is spelled out
        assert "capturable=True" in msg and "torch.tensor(1e-4, device='cuda')" in msg


def test_the_optimizer_is_judged_before_the_devices() -> None:
    """A capturable AdamW and SGD pass the optimizer check; the CPU model is what is refused."""
    for make in (
        lambda p: torch.optim.AdamW(p, capturable=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ):
        model = Tiny()
        assert "proj.weight is on cpu" in _refusal(model, make(model.parameters()))


def test_a_tensor_hyperparameter_off_the_model_device_is_refused() -> None:
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4), capturable=True)
    with pytest.raises(CaptureError, match=r"param_groups\[0\]\['lr'\] is a tensor on cpu") as e:
        ts.check_optimizer(opt, CUDA)
    assert "lr=torch.tensor(0.0003, device='cuda:0')" in str(e.value)
    ts.check_optimizer(opt, torch.device("cpu"))  # on the model's device: accepted


def test_the_example_batch_must_be_a_dict_of_tensors() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(CaptureError, match="non-empty dict of tensors.*not list"):
        ts.BatchSpec.of([torch.zeros(2)], cpu)
    with pytest.raises(CaptureError, match=r"not dict \(empty\)"):
        ts.BatchSpec.of({}, cpu)
    with pytest.raises(CaptureError, match=r"example batch\['return_dict'\] is a bool"):
        ts.BatchSpec.of({"x": torch.zeros(2), "return_dict": True}, cpu)


def test_a_call_batch_unlike_the_example_is_refused_naming_the_key() -> None:
    spec = ts.BatchSpec.of(_batch(), torch.device("cpu"))
    assert spec.check({"y": torch.zeros(7, 3), "x": torch.zeros(7, 4)}) == ((7, 4), (7, 3))
    with pytest.raises(CaptureError, match=r"missing \['y'\], unexpected \['z'\]"):
        spec.check({"x": torch.zeros(5, 4), "z": torch.zeros(5, 3)})
    with pytest.raises(CaptureError, match=r"batch\['y'\] is torch.float64.*pass torch.float32"):
        spec.check({"x": torch.zeros(5, 4), "y": torch.zeros(5, 3, dtype=torch.float64)})
    on_gpu = ts.BatchSpec(spec.keys, spec.dtypes, CUDA)
    with pytest.raises(CaptureError, match=r"batch\['x'\] is on cpu, the model on cuda:0"):
        on_gpu.check(_batch())


def test_gradients_present_before_capture_are_refused() -> None:
    model = Tiny()
    model(**_batch()).loss.backward()
    params = list(model.named_parameters())
    with pytest.raises(CaptureError, match="proj.weight already has a gradient.*zero_grad"):
        ts.check_no_grads(params)
    model.zero_grad(set_to_none=True)
    ts.check_no_grads(params)


def test_the_step_body_is_one_eager_training_step() -> None:
    """run_step: gradients from this batch alone (stale ones dropped), then the update; the loss
    comes back detached."""
    model, twin = Tiny(), Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(**_batch()).loss.backward()  # a stale gradient the step must not add
    loss = ts.run_step(model, opt, ts.model_loss, _batch())
    want = twin(**_batch()).loss
    want.backward()
    # the same optimizer's update: p - lr·g may be one fused multiply-add or two roundings,
    # whichever its kernels use on this CPU
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    assert not loss.requires_grad and torch.equal(loss, want.detach())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_loss_function_that_runs_backward_itself_is_refused() -> None:
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def accumulating(m: nn.Module, batch: dict) -> torch.Tensor:
        for half in (slice(0, 2), slice(2, 5)):
            m(batch["x"][half], batch["y"][half]).loss.backward()
        return m(**batch).loss

    with pytest.raises(CaptureError, match="loss_fn ran a backward itself.*proj.weight"):
        ts.run_step(model, opt, accumulating, _batch())


@pytest.mark.parametrize(
    ("loss_fn", "says"),
    [
        (lambda m, b: m(**b).logits, r"got a \(5, 3\) tensor"),
        (lambda m, b: m(**b).loss.detach(), "requires_grad=False"),
        (lambda m, b: 1.0, "got a float"),
        (lambda m, b: m(b["x"]).loss, "model\\(\\*\\*batch\\) returned no loss"),
    ],
    ids=["not-scalar", "no-grad", "not-a-tensor", "no-labels"],
)
def test_a_loss_that_is_no_scalar_with_a_gradient_is_refused(loss_fn, says) -> None:  # noqa: ANN001
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    call = ts.model_loss if "no loss" in says else loss_fn
    batch = {"x": _batch()["x"]} if "no loss" in says else _batch()
    with pytest.raises(CaptureError, match=says):
        ts.run_step(model, opt, call, batch)


def test_new_shapes_past_the_cap_are_refused_naming_the_shapes_held() -> None:
    cache = ts.ShapeCache(("input_ids", "labels"), cap=2)
    a = cache.get(((1, 8), (1, 8)))
    cache.get(((1, 16), (1, 16)))
    assert cache.get(((1, 8), (1, 8))) is a
    with pytest.raises(CaptureError) as info:
        cache.get(((1, 32), (1, 32)))
    msg = str(info.value)
    assert "input_ids [1, 32], labels [1, 32]) past max_graphs=2" in msg
    assert "input_ids [1, 8], labels [1, 8]; input_ids [1, 16], labels [1, 16]" in msg


def test_a_float_lr_changed_by_a_scheduler_after_capture_is_refused() -> None:
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    snap = ts.GroupSnapshot.of(opt)
    snap.check(opt)
    opt.step()
    sched.step()
    with pytest.raises(CaptureError) as info:
        snap.check(opt)
    msg = str(info.value)
    assert "SGD's param_groups[0]['lr'] changed from 0.1 to 0.05" in msg
    assert "silently ignored" in msg and "lr=torch.tensor(<lr>, device='cuda')" in msg


def test_a_tensor_lr_written_in_place_by_a_scheduler_is_accepted() -> None:
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), fused=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    snap = ts.GroupSnapshot.of(opt)
    lr = opt.param_groups[0]["lr"]
    for _ in range(2):
        opt.step()
        sched.step()
        snap.check(opt)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.025)
    opt.param_groups[0]["lr"] = torch.tensor(0.025)  # a new tensor: the graph reads the old one
    with pytest.raises(CaptureError, match=r"\['lr'\] is no longer the tensor.*fill_"):
        snap.check(opt)


def test_momentum_cycled_by_one_cycle_lr_is_refused() -> None:
    model = Tiny()
    lr = torch.tensor(0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    snap = ts.GroupSnapshot.of(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # capturable=True stepping uncaptured
        opt.step()
    sched.step()
    with pytest.raises(CaptureError, match=r"\['betas'\] changed from .*cycle_momentum=False"):
        snap.check(opt)


def test_a_replaced_optimizer_state_is_refused() -> None:
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snap = ts.GroupSnapshot.of(opt)
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(CaptureError, match=r"param_groups\[0\] was replaced.*load_state_dict"):
        snap.check(opt)


def _syncing_call() -> None:
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # SYNC


def test_sync_warnings_are_recorded_with_their_line_and_others_pass_through() -> None:
    found: list[list[traceback.FrameSummary]] = []
    with ts.recording_sync_warnings(found):
        for _ in range(2):
            _syncing_call()  # every occurrence, not once per line (warnings' default)
    assert len(found) == 2
    with pytest.warns(UserWarning, match="something else"), ts.recording_sync_warnings(found):
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert len(found) == 2
    site = ts.blame(found[0])
    assert site.startswith(f"{__file__}:") and "in _syncing_call" in site and "# SYNC" in site
    msg = ts.sync_message(found)
    assert msg.count("_syncing_call") == 1 and "would be frozen into every replay" in msg


def test_a_sync_inside_pytorch_is_blamed_on_the_caller_too() -> None:
    here = traceback.extract_stack()[-1]
    inside = traceback.FrameSummary(
        f"{ts._TORCH_DIR}/_tensor.py", 123, "item", lookup_line=False, line="return x.item()"
    )
    site = ts.blame([here, inside])
    assert site.startswith(f"{ts._TORCH_DIR}/_tensor.py:123 in item: `return x.item()`")
    assert f"called from {__file__}:{here.lineno} in " in site


def test_a_failed_capture_names_the_line_that_raised() -> None:
    def fails() -> None:
        raise RuntimeError("operation not permitted when stream is capturing")  # RAISES

    try:
        fails()
    except RuntimeError as e:
        msg = ts.capture_failure(e)
    assert "in fails: `raise RuntimeError(" in msg and "not permitted when stream" in msg


def test_warmup_and_max_graphs_must_be_positive() -> None:
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert "warmup must be an int >= 1, got 0" in _refusal(model, opt, warmup=0)
    assert "max_graphs must be an int >= 1, got 0" in _refusal(model, opt, max_graphs=0)
