"""A whole training step — forward, backward and the optimizer's update — captured in one CUDA graph
and replayed: ``step = capture_train_step(model, optimizer, example_batch)``, then
``loss = step(batch)`` once per step.

At small batches a training step is host-bound: the GPU waits while Python launches kernels one by
one (a patched Llama step at 2048 tokens: 18.1 ms eager, 11.5 ms in one graph on the H200 —
bench/RESULTS.md). A CUDA graph replays every launch of the step with one call. It lives beside
the drop-ins (``patch_llama``, ``patch_model``) because it is how their host work stops counting
at small batches, but it takes any model, patched or not: it needs nothing from the rest of coda.

PyTorch's whole-network capture recipe, which this module applies and checks:

* **Warm-up, eagerly, on a side stream.** The first ``warmup`` calls for each batch shape run the
  step eagerly (each one a real training step on its batch: nothing is run twice or skipped) on a
  side stream, so Triton compiles, coda's ops tune and record run plans, cuBLAS picks its
  algorithms and the optimizer creates its state outside the capture. The next call captures.
* **Gradients allocated inside the graph.** Every step sets the gradients to ``None`` first
  (``optimizer.zero_grad(set_to_none=True)`` and the model's), so the captured backward allocates
  them from the graph's memory and each replay overwrites them: ``p.grad`` after a call holds that
  call's gradients. There is no accumulation across calls (one call is one optimizer step);
  gradients written between calls (an eager ``backward()``, ``zero_grad(set_to_none=False)``,
  clipping after the step) are refused at the next call rather than silently overwritten.
* **A capturable optimizer.** A graph replays the kernels it recorded, with the numbers they were
  launched with: a step count kept on the host would stay at its captured value. PyTorch's
  optimizers keep it on the device when constructed with ``capturable=True``; their ``step()``
  refuses to be captured otherwise (``fused=True`` alone is not enough). ``SGD`` keeps no step
  count and is accepted as it is. Other optimizers are refused.
* **Learning-rate schedulers.** A float ``lr`` is frozen into the graph. Give the optimizer a
  one-element tensor on the model's device (``lr=torch.tensor(1e-4, device="cuda")``): the fused
  and capturable implementations read it from device memory at every replay, and PyTorch's
  schedulers write a tensor ``lr`` in place (``fill_``: every ``torch.optim.lr_scheduler``
  class goes through ``_update_param_group_val`` in torch 2.13; ``ReduceLROnPlateau`` also reads
  it with ``float()``, a sync between calls), so ``scheduler.step()`` between calls reaches the
  next replay. ``SGD`` reads a tensor ``lr`` from memory only with ``fused=True``. Any other
  change to a parameter group after capture — a float ``lr`` set by a scheduler,
  ``OneCycleLR``'s momentum, a replaced tensor, ``load_state_dict`` — is refused at the next
  call, naming the group and key.
* **No host synchronization.** A ``.item()``, ``.tolist()``, ``.cpu()`` or a Python ``if`` on a
  tensor's value cannot be captured (and would freeze the value read at capture). The capture
  runs under ``torch.cuda.set_sync_debug_mode("warn")`` and a sync there is refused naming its
  ``file:line`` (the innermost frame, and the first outside PyTorch). It is watched during the
  capture rather than the warm-up because libraries skip their syncs only while a stream
  captures (transformers' ``is_tracing`` checks ``torch.cuda.is_current_stream_capturing()``
  before reading an attention mask's values), and the first warm-up step syncs legitimately
  (autotuning).
* **One graph per batch shape.** A graph's shapes are fixed; each distinct set of batch shapes gets
  its own warm-up, capture, static input buffers and memory pool, up to ``max_graphs`` (then a
  refusal naming the shapes held; pad batches to a few lengths).

What a call returns: the graph's static loss tensor, overwritten by the next call (``clone()`` it
to keep it; ``float(loss)`` syncs, so read it only when needed). The static batch buffers are
overwritten by every call. The graph reads and writes the model's parameters, gradients and
optimizer state by address: keep the returned step (it holds them) as long as it replays, update
parameters only in place, and capture a new step after replacing parameters or the optimizer's
state. Not covered: a loss scaler (``GradScaler`` reads ``found_inf`` on the host; bf16 needs
none), gradient clipping inside the step, and data-parallel wrappers (DDP, FSDP), which are not
tested here.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
Shapes = tuple[tuple[int, ...], ...]

SYNC_WARNING = "synchronizing CUDA operation"  # the text of torch's sync debug mode's warning
_TORCH_DIR = str(Path(torch.__file__).parent)
_THIS_FILE = __file__
_WARNINGS_FILE = warnings.__file__
_SYNC_EXAMPLES = (
    "a .item(), .tolist(), .cpu(), print(tensor), a Python `if` on a tensor's value, or a "
    "GradScaler's step"
)


class CaptureError(RuntimeError):
    """A training step that ``capture_train_step`` refuses to capture or to replay; the message
    names the tensor, parameter, parameter group or source line at fault and what to change."""


def model_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The default loss: ``model(**batch).loss`` (Hugging Face's, with ``labels`` in the batch;
    a model patched with ``fused_loss=True`` computes it without logits in training)."""
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        raise CaptureError(
            f"model(**batch) returned no loss ({type(out).__name__}; batch keys "
            f"{sorted(batch)}): put the targets in the batch (Hugging Face: 'labels') or pass "
            "loss_fn=lambda model, batch: <a scalar loss tensor>"
        )
    return loss


def capture_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: Mapping[str, torch.Tensor],
    loss_fn: LossFn | None = None,
    *,
    warmup: int = 3,
    max_graphs: int = 4,
) -> CapturedTrainStep:
    """``model``'s training step with ``optimizer`` as a callable that replays a CUDA graph:
    ``loss = step(batch)`` does ``optimizer.zero_grad(set_to_none=True)``,
    ``loss_fn(model, batch).backward()`` and ``optimizer.step()`` (default loss:
    ``model(**batch).loss``) and returns the loss — the graph's static tensor, overwritten by the
    next call (clone it to keep it).

    ``example_batch`` (a dict of CUDA tensors such as ``input_ids``, ``labels``,
    ``attention_mask``) fixes the batch's keys, dtypes and device; nothing is run on it. Each new
    set of batch shapes runs ``warmup`` eager steps, then is captured on its next call; at most
    ``max_graphs`` shapes are held. Everything that cannot be captured faithfully is refused
    with ``CaptureError`` (the module docstring lists what and why): no CUDA or a tensor on the
    CPU, an optimizer that is not capturable (naming the flag), gradients already present or
    written between calls, a host synchronization in the step (naming its line), a
    hyperparameter changed after capture."""
    return CapturedTrainStep(
        model, optimizer, example_batch, loss_fn, warmup=warmup, max_graphs=max_graphs
    )


# --- what is checked before anything runs ------------------------------------------------------


@dataclass(frozen=True)
class BatchSpec:
    """The keys, dtypes and device every batch must have (those of the example batch); the
    shapes may vary — each distinct set gets its own graph."""

    keys: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    device: torch.device

    @classmethod
    def of(cls, batch: Any, device: torch.device) -> BatchSpec:
        """The spec of ``batch``, refused unless it is a non-empty dict of tensors on
        ``device``."""
        if not isinstance(batch, Mapping) or not batch:
            raise CaptureError(
                f"the example batch must be a non-empty dict of tensors (e.g. {{'input_ids': "
                f"ids, 'labels': ids}}), not {type(batch).__name__}"
                + (" (empty)" if isinstance(batch, Mapping) else "")
            )
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                raise CaptureError(
                    f"example batch[{key!r}] is a {type(value).__name__}, not a tensor: a graph "
                    "freezes non-tensor arguments at their captured value — pass constant "
                    "options inside loss_fn instead"
                )
        spec = cls(tuple(batch), tuple(t.dtype for t in batch.values()), device)
        spec.check(batch, what="example batch")
        return spec

    def check(self, batch: Any, what: str = "batch") -> Shapes:
        """``batch``'s shapes in the spec's key order; ``CaptureError`` naming the key whose
        presence, type, dtype or device differs from the example's."""
        if not isinstance(batch, Mapping):
            raise CaptureError(f"the {what} must be a dict of tensors, not {type(batch).__name__}")
        if batch.keys() != set(self.keys):
            missing = sorted(set(self.keys) - batch.keys())
            extra = sorted(batch.keys() - set(self.keys))
            raise CaptureError(
                f"the {what}'s keys differ from the example batch's {list(self.keys)}: "
                f"missing {missing}, unexpected {extra} — capture another step for other keys"
            )
        shapes = []
        for key, dtype in zip(self.keys, self.dtypes, strict=True):
            t = batch[key]
            if not isinstance(t, torch.Tensor):
                raise CaptureError(f"{what}[{key!r}] is a {type(t).__name__}, not a tensor")
            if t.dtype != dtype:
                raise CaptureError(
                    f"{what}[{key!r}] is {t.dtype}, the example batch's was {dtype}: copying "
                    f"it into the graph's {dtype} buffer would convert it — pass {dtype}"
                )
            if t.device != self.device:
                raise CaptureError(
                    f"{what}[{key!r}] is on {t.device}, the model on {self.device}: a graph "
                    f"reads its inputs from device memory — move the batch with "
                    f".to('{self.device}', non_blocking=True) (from pinned memory) first"
                )
            shapes.append(tuple(t.shape))
        return tuple(shapes)


def model_device(model: nn.Module) -> torch.device:
    """The one CUDA device holding all of ``model``'s parameters and buffers; ``CaptureError``
    naming the first one elsewhere (or saying that this machine has no CUDA at all)."""
    devices: dict[torch.device, str] = {}
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if not tensors:
        raise CaptureError(f"{type(model).__name__} has no parameters or buffers to train")
    for name, t in tensors:
        if t.device.type != "cuda":
            cuda = (
                "move the model with model.to('cuda') before building the optimizer"
                if torch.cuda.is_available()
                else "this machine has no CUDA device (torch.cuda.is_available() is False): "
                "CUDA graphs need one — run the step eagerly here"
            )
            raise CaptureError(f"{name} is on {t.device}, not a CUDA device: {cuda}")
        devices.setdefault(t.device, name)
    if len(devices) > 1:
        where = ", ".join(f"{name} on {d}" for d, name in devices.items())
        raise CaptureError(
            f"the model spans several devices ({where}): one CUDA graph runs on one device — "
            "put the model on one GPU (a model split across devices is not supported)"
        )
    return next(iter(devices))


def check_optimizer(optimizer: Any, device: torch.device | None = None) -> None:
    """``CaptureError`` unless ``optimizer``'s ``step()`` can be replayed from a graph: a
    ``torch.optim`` optimizer constructed with ``capturable=True`` in every group, or ``SGD``;
    a tensor hyperparameter must be on ``device`` (the model's), where kernels read it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CaptureError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer)}")
    name = type(optimizer).__name__
    for i, group in enumerate(optimizer.param_groups):
        _check_group_capturable(optimizer, name, i, group)
        for key, value in group.items():
            if key == "params" or not isinstance(value, torch.Tensor):
                continue
            if device is not None and value.device != device:
                raise CaptureError(
                    f"{name}'s param_groups[{i}][{key!r}] is a tensor on {value.device}: the "
                    f"step reads it as a number, frozen at capture — make it a tensor on "
                    f"{device}, e.g. {key}=torch.tensor({_number(value)}, device='{device}')"
                )


def _check_group_capturable(optimizer: Any, name: str, i: int, group: dict) -> None:
    """One parameter group's capture flags (see ``check_optimizer``)."""
    if "capturable" in optimizer.defaults:
        if not group.get("capturable", False):
            fused = (
                " (fused=True alone is not enough: step() refuses a capture unless capturable=True)"
                if group.get("fused")
                else ""
            )
            raise CaptureError(
                f"{name}'s param_groups[{i}] has capturable=False{fused}: its step count lives "
                f"on the host and a graph would replay the captured one — construct it with "
                f"capturable=True, e.g. torch.optim.{name}(params, lr=torch.tensor(1e-4, "
                f"device='cuda'), capturable=True{', fused=True' if 'fused' in group else ''})"
            )
    elif isinstance(optimizer, torch.optim.SGD):
        if isinstance(group["lr"], torch.Tensor) and not group.get("fused"):
            raise CaptureError(
                f"SGD's param_groups[{i}] has a tensor lr without fused=True: its foreach and "
                "for-loop steps read a tensor lr on the host (a sync, not capturable) — "
                "construct it with fused=True, or give it a float lr (then constant)"
            )
    else:
        raise CaptureError(
            f"{name} has no capturable flag: a graph cannot replay a step that keeps state on "
            "the host. Use a torch.optim optimizer constructed with capturable=True (Adam, "
            "AdamW — also fused=True —, NAdam, RAdam, Adamax, RMSprop, Rprop, Adadelta, ASGD) "
            "or SGD"
        )


def _number(value: torch.Tensor) -> str:
    """A tensor hyperparameter's value for a message (it is on the host or tiny)."""
    return f"{float(value.detach().cpu().reshape(-1)[0]):g}" if value.numel() == 1 else "..."


def check_no_grads(params: list[tuple[str, nn.Parameter]]) -> None:
    """``CaptureError`` naming the first parameter that already has a gradient: every step starts
    from none, so it would be discarded (gradients accumulated before capturing, or an eager
    step that did not zero them)."""
    for name, p in params:
        if p.grad is not None:
            raise CaptureError(
                f"{name} already has a gradient: each captured step computes its gradients from "
                "its own batch alone and would discard it (one call is one optimizer step; no "
                "accumulation across calls) — finish the eager step (optimizer.step()) or call "
                "optimizer.zero_grad(set_to_none=True) before capture_train_step"
            )


# --- the step itself ---------------------------------------------------------------------------


def run_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, batch: dict
) -> torch.Tensor:
    """One training step, eager or under capture: gradients to ``None`` (so a capture allocates
    them in the graph's memory), the loss, its backward, the optimizer's step; returns the loss,
    detached. ``CaptureError`` if the loss is not a scalar tensor with a gradient, or if
    ``loss_fn`` already ran a backward itself (its gradients would be added to this step's)."""
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
        what = (
            f"a {tuple(loss.shape)} tensor (requires_grad={loss.requires_grad})"
            if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}"
        )
        raise CaptureError(
            f"the loss must be a scalar tensor with a gradient, got {what}: return e.g. "
            "loss.mean(), computed from the model's outputs in training mode"
        )
    written = next((n for n, p in model.named_parameters() if p.grad is not None), None)
    if written is not None:
        raise CaptureError(
            f"loss_fn ran a backward itself ({written} has a gradient before the step's "
            "backward): the step calls loss.backward() once — return the loss instead "
            "(for several micro-batches, return the sum of their losses: one call is one "
            "optimizer step)"
        )
    loss.backward()
    optimizer.step()
    return loss.detach()


@dataclass
class _Graph:
    """What one batch shape holds: its eager warm-up count, then its graph, the static batch the
    graph reads, the static loss it writes and the gradient tensors it writes (one per trained
    parameter; ``None`` for one the loss does not reach)."""

    warmed: int = 0
    graph: Any = None
    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    grads: list[torch.Tensor | None] = field(default_factory=list)


class ShapeCache:
    """The per-shape entries, at most ``cap`` of them: a new shape past the cap is refused with
    the shapes held, since each graph holds its own activation memory."""

    def __init__(self, keys: tuple[str, ...], cap: int) -> None:
        self.keys, self.cap = keys, cap
        self.entries: dict[Shapes, _Graph] = {}

    def get(self, shapes: Shapes) -> _Graph:
        """The entry for ``shapes``, created if there is room."""
        entry = self.entries.get(shapes)
        if entry is not None:
            return entry
        if len(self.entries) >= self.cap:
            held = "; ".join(self.describe(s) for s in self.entries)
            raise CaptureError(
                f"a batch of new shapes ({self.describe(shapes)}) past max_graphs={self.cap}: "
                f"graphs are held for {held}. Pad batches to a few fixed lengths, or raise "
                "max_graphs (each graph keeps its own activation memory)"
            )
        entry = self.entries[shapes] = _Graph()
        return entry

    def describe(self, shapes: Shapes) -> str:
        """``input_ids [2, 512], labels [2, 512]``."""
        return ", ".join(f"{k} {list(s)}" for k, s in zip(self.keys, shapes, strict=True))


@dataclass
class GroupSnapshot:
    """The optimizer's parameter groups as a graph was captured with them: each group dict, its
    number of parameters and every other entry's value (tensors by identity)."""

    groups: list[tuple[dict, int, dict[str, Any]]]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> GroupSnapshot:
        return cls(
            [
                (g, len(g["params"]), {k: v for k, v in g.items() if k != "params"})
                for g in optimizer.param_groups
            ]
        )

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """``CaptureError`` naming the first group entry that changed since capture: the graph
        would replay the captured value (or read the replaced object's memory)."""
        name = type(optimizer).__name__
        if len(optimizer.param_groups) != len(self.groups):
            raise CaptureError(
                f"{name} has {len(optimizer.param_groups)} param_groups, {len(self.groups)} when "
                "the step was captured: the graph updates only those — capture a new step"
            )
        for i, (group, count, values) in enumerate(self.groups):
            now = optimizer.param_groups[i]
            if now is not group or len(now["params"]) != count:
                raise CaptureError(
                    f"{name}'s param_groups[{i}] was replaced or its parameters changed since "
                    "the step was captured (load_state_dict, add_param_group): the graph reads "
                    "the old state by address — capture a new step"
                )
            for key, then in values.items():
                if not _same(now.get(key), then):
                    raise CaptureError(_changed(name, i, key, then, now.get(key)))


def _same(now: Any, then: Any) -> bool:
    """Whether a group entry still holds what it held at capture: the same object, or an equal
    number, flag or tuple of numbers (a tensor only as the same object)."""
    if now is then:
        return True
    if isinstance(now, torch.Tensor) or isinstance(then, torch.Tensor):
        return False
    if isinstance(now, tuple) and isinstance(then, tuple):
        return len(now) == len(then) and all(map(_same, now, then))
    try:
        return bool(now == then)
    except (TypeError, ValueError, RuntimeError):  # e.g. an array: not comparable as one value
        return False


def _changed(name: str, i: int, key: str, then: Any, now: Any) -> str:
    """The message for a parameter group entry changed after capture."""
    if isinstance(then, torch.Tensor):
        what = f"is no longer the tensor it was captured with (now {type(now).__name__})"
        fix = f"update it in place ({key}.fill_(...), as LRScheduler does)"
    else:
        what = f"changed from {then!r} to {now!r}"
        fix = (
            "construct the optimizer with lr=torch.tensor(<lr>, device='cuda') — schedulers "
            "then write it in place and the graph reads it"
            if key == "lr"
            else "keep it fixed (OneCycleLR: cycle_momentum=False)"
        )
    return (
        f"{name}'s param_groups[{i}][{key!r}] {what} since the step was captured: the graph "
        f"replays the captured value, so the change would be silently ignored — {fix}"
    )


# --- host synchronizations ---------------------------------------------------------------------


@contextmanager
def recording_sync_warnings(found: list[list[traceback.FrameSummary]]) -> Iterator[None]:
    """Append the Python stack of every sync-debug warning (``SYNC_WARNING``) issued inside the
    block to ``found``, each occurrence, instead of showing it; other warnings pass through."""
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        shown = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
            if SYNC_WARNING in str(message):
                found.append(traceback.extract_stack()[:-1])
            else:
                shown(message, category, filename, lineno, *rest)

        warnings.showwarning = show
        yield


@contextmanager
def watching_syncs(found: list[list[traceback.FrameSummary]]) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("warn")`` inside the block (restored after), each sync's
    stack recorded in ``found``."""
    before = torch.cuda.get_sync_debug_mode()
    with recording_sync_warnings(found):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)


def blame(stack: list[traceback.FrameSummary]) -> str:
    """Where a stack points: its innermost frame outside the warnings machinery and this module
    and, when that one is inside PyTorch, also the innermost frame outside PyTorch (the call in
    the model's or the caller's code that led there)."""
    frames = [f for f in stack if f.filename not in (_THIS_FILE, _WARNINGS_FILE)]
    if not frames:
        return "an unknown line"
    inner = frames[-1]
    text = _frame(inner)
    if inner.filename.startswith(_TORCH_DIR):
        outer = next((f for f in reversed(frames) if not f.filename.startswith(_TORCH_DIR)), None)
        if outer is not None:
            text += f", called from {_frame(outer)}"
    return text


def _frame(frame: traceback.FrameSummary) -> str:
    """``path:line in function: `source```."""
    source = f": `{frame.line.strip()}`" if frame.line else ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}{source}"


def sync_message(stacks: list[list[traceback.FrameSummary]]) -> str:
    """The refusal for host synchronizations seen during capture, each distinct site once."""
    sites = list(dict.fromkeys(blame(s) for s in stacks))
    shown = "; ".join(sites[:3]) + (f" (and {len(sites) - 3} more)" if len(sites) > 3 else "")
    return (
        f"the step synchronizes the host with the GPU at {shown}. A CUDA graph cannot hold a "
        "host sync, and the value read at capture would be frozen into every replay. Remove it "
        f"from the step ({_SYNC_EXAMPLES}); read values such as the loss after the call instead"
    )


def capture_failure(error: BaseException) -> str:
    """The refusal for a capture that raised without a sync seen: the error and its line."""
    stack = traceback.extract_tb(error.__traceback__)
    return (
        f"capturing the step in a CUDA graph failed at {blame(stack)}: {type(error).__name__}: "
        f"{error}. Every operation in the step must be a GPU launch on the current stream "
        f"without host synchronization ({_SYNC_EXAMPLES}), CPU tensors or new CUDA streams"
    )


# --- the callable ------------------------------------------------------------------------------


class CapturedTrainStep:
    """A training step replayed from CUDA graphs, one per batch shape (see
    ``capture_train_step``). ``step(batch)`` returns the loss; ``captured_shapes`` lists the
    batch shapes with a graph. It holds the model, optimizer and graphs: keep it while it
    replays."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        example_batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn | None = None,
        *,
        warmup: int = 3,
        max_graphs: int = 4,
    ) -> None:
        for name, value in (("warmup", warmup), ("max_graphs", max_graphs)):
            if not isinstance(value, int) or value < 1:
                raise CaptureError(f"{name} must be an int >= 1, got {value!r}")
        check_optimizer(optimizer)
        device = model_device(model)
        self.spec = BatchSpec.of(example_batch, device)
        check_optimizer(optimizer, device)
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        check_no_grads(self.params)
        self.model, self.optimizer = model, optimizer
        self.loss_fn: LossFn = loss_fn or model_loss
        self.warmup = warmup
        self.cache = ShapeCache(self.spec.keys, max_graphs)
        self.snapshot: GroupSnapshot | None = None
        self._side = torch.cuda.Stream(device)
        self._current: _Graph | None = None
        self._seen: list[tuple[torch.Tensor | None, int]] = [(None, 0)] * len(self.params)

    @property
    def captured_shapes(self) -> list[str]:
        """The batch shapes that have a graph, e.g. ``['input_ids [1, 2048], labels [1,
        2048]']``."""
        return [self.cache.describe(s) for s, e in self.cache.entries.items() if e.graph]

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One training step on ``batch``; returns its loss (the static tensor once captured)."""
        shapes = self.spec.check(batch)
        self._check_grads_untouched()
        if self.snapshot is not None:
            self.snapshot.check(self.optimizer)
        entry = self.cache.get(shapes)
        if entry.graph is None and entry.warmed < self.warmup:
            loss = self._eager(dict(batch))
            entry.warmed += 1
        else:
            if entry.graph is None:
                self._capture(entry, dict(batch))
            else:
                for key, static in entry.batch.items():
                    static.copy_(batch[key])
            self._attach(entry)
            entry.graph.replay()
            loss = entry.loss
        self._seen = [(p.grad, _version(p.grad)) for _, p in self.params]
        return loss

    def _eager(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A warm-up step, eagerly on the side stream (the optimizer's warning that a capturable
        instance runs uncaptured is expected here and silenced)."""
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            loss = run_step(self.model, self.optimizer, self.loss_fn, batch)
        torch.cuda.current_stream().wait_stream(self._side)
        self._current = None
        return loss

    def _capture(self, entry: _Graph, batch: dict[str, torch.Tensor]) -> None:
        """Capture the step on copies of ``batch`` (its static buffers) into ``entry``; refuse a
        capture that failed or synchronized, leaving no gradient behind."""
        static = {k: t.clone() for k, t in batch.items()}
        graph = torch.cuda.CUDAGraph()
        syncs: list[list[traceback.FrameSummary]] = []
        raised: list[Exception] = []  # the step's own error (the capture's end may raise another)
        stream = torch.cuda.current_stream()  # a failed capture's end leaves its stream current
        try:
            with torch.cuda.graph(graph):
                try:
                    with watching_syncs(syncs):
                        loss = run_step(self.model, self.optimizer, self.loss_fn, static)
                except Exception as e:
                    raised.append(e)
                    raise
        except Exception as e:
            torch.cuda.set_stream(stream)
            self._drop_grads()
            error = raised[0] if raised else e
            if isinstance(error, CaptureError):
                raise error from None
            raise CaptureError(sync_message(syncs) if syncs else capture_failure(error)) from e
        if syncs:
            self._drop_grads()
            raise CaptureError(sync_message(syncs))
        entry.graph, entry.batch, entry.loss = graph, static, loss
        entry.grads = [p.grad for _, p in self.params]
        if self.snapshot is None:
            self.snapshot = GroupSnapshot.of(self.optimizer)

    def _attach(self, entry: _Graph) -> None:
        """Point every parameter's ``.grad`` at ``entry``'s gradient tensors (the ones its replay
        writes) when another graph or an eager step ran last."""
        if self._current is not entry:
            for (_, p), g in zip(self.params, entry.grads, strict=True):
                p.grad = g
            self._current = entry

    def _drop_grads(self) -> None:
        """Every gradient to ``None`` (after a refused capture: none may point into its memory)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self._current = None

    def _check_grads_untouched(self) -> None:
        """``CaptureError`` naming the first parameter whose gradient was replaced or written
        since the last call; ``None`` (``zero_grad(set_to_none=True)``) is allowed — each step
        writes all gradients anew."""
        for (name, p), (grad, version) in zip(self.params, self._seen, strict=True):
            if p.grad is None:
                if grad is not None:  # set to None since: attach the replay's tensors again
                    self._current = None
                continue
            if p.grad is grad and p.grad._version == version:
                continue
            raise CaptureError(
                f"{name}'s gradient was written outside the captured step since the last call "
                "(an eager backward(), zero_grad(set_to_none=False), clipping or scaling after "
                "the step): each step computes its gradients from its own batch and overwrites "
                "them, so what was added would be lost. One call is one optimizer step: put "
                "micro-batches in one batch, and set gradients to None (not zero) between calls"
            )


def _version(t: torch.Tensor | None) -> int:
    return 0 if t is None else t._version
