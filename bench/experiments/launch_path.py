"""Experiment: where the host time of a patched training step's kernel launches goes.

At 2048 tokens a patched step is host-bound (bench/RESULTS.md): its host issues ~90 Triton
launches a step, each either through ``launch_kernel`` (which computes the arguments' signature
and looks the compiled kernel up) or through a ``PinnedLaunch`` (recorded once, no signature).
This times one family's step, eager Hugging Face, ``coda_lm_head`` and
``coda_lm_head_triton`` (``train_step.py``'s variants, same widths: under
``CODA_EPILOGUE_BACKEND=auto`` the patched step on the backends tuning chose and all on Triton),
and for the patched ones counts and times per step, with a wall clock around each call:

* ``launch_kernel`` — every call, a pinned sequence's included (``launch.PinnedSequence`` sends
  those on to a ``PinnedLaunch``): the calls made by code outside a run plan's replay, and their
  time including the launch itself;
* ``PinnedLaunch.__call__`` — relaunches without a signature (device query, ``_run``);
* ``_run`` — the relaunch proper (descriptors expanded, the launcher's C function called);
* ``_device_and_stream`` — the current device and stream, queried per relaunch;
* ``CuteLaunch.__call__`` — a replayed CuTe launch (``CODA_EPILOGUE_BACKEND=auto`` or ``cute``),
  of which ``CuteLaunch.arguments`` builds QuACK's views of the call's tensors and ``cute._run``
  builds the epilogue's arguments and the scheduler's and calls the compiled kernel (TVM-FFI);
* ``VendorProduct.__call__`` — a plain product on cuBLAS (``torch.matmul``).

``host_ms`` is the median host time of a step from an idle GPU (as ``train_step.py --host``);
``host_ms_instrumented`` the same with the timers in place (they add ~1 µs per call), each
function's longest call beside its mean; ``behind_busy_gpu`` (GPU only, ``--busy-ms``, default
30) whether anything in the step waits for the GPU: the host time of steps issued right after
that much GPU work was queued, the wrapped functions' longest calls there, and the profiled ops
that lasted over half of it. Then the floors: one small kernel launched through
``kernel[grid]``, ``launch_kernel`` and a ``PinnedLaunch``, one ``torch.add``, ``torch.empty``
and a 2048² bf16 ``torch.mm`` (µs per call, the GPU kept busy by nothing else). Not part of the
product: a measurement for the runtime.

    python3 bench/experiments/launch_path.py [--family llama] [--tokens 2048] [--busy-ms 30]
        [--out DIR]
    python3 bench/experiments/launch_path.py --dry-run   # CPU interpreter, toy model
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_step as ts  # noqa: E402  (bench/)

VARIANTS = ("hf", "coda_lm_head", "coda_lm_head_triton")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--family", default="llama", help="one of train_step.py's families")
    p.add_argument("--tokens", type=int, default=2048, help="one sequence of this many tokens")
    p.add_argument("--steps", type=int, default=10, help="instrumented steps (after warm-up)")
    p.add_argument(
        "--busy-ms", type=float, default=30.0, help="GPU work queued before a busy step (0: none)"
    )
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy model: checks the script")
    return p.parse_args(argv)


class Timers:
    """Per wrapped function: calls, seconds inside it (inclusive) and its longest call."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()
        self.longest: dict[str, float] = {}

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                self.seconds[label] += took
                self.calls[label] += 1
                self.longest[label] = max(self.longest.get(label, 0.0), took)

        return timed

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        return {
            label: {
                "calls": self.calls[label] / steps,
                "ms": self.seconds[label] * 1e3 / steps,
                "us_each": self.seconds[label] * 1e6 / max(self.calls[label], 1),
                "longest_us": self.longest[label] * 1e6,
            }
            for label in sorted(self.calls)
        }


@contextmanager
def timed_launch_path(timers: Timers) -> Iterator[None]:
    """The launch functions of ``coda.primitives.launch`` (and every ``coda`` module that
    imported ``launch_kernel`` by name) wrapped by ``timers``; restored on exit."""
    from coda.primitives import launch, run_plans
    from coda.primitives.cute import launch as cute

    real_launch = launch.launch_kernel
    importers = [
        m
        for name, m in sys.modules.items()
        if name.startswith("coda.") and getattr(m, "launch_kernel", None) is real_launch
    ]
    saved = (launch._run, launch._device_and_stream, launch.PinnedLaunch.__call__)
    saved_cute = (cute.CuteLaunch.__call__, cute.CuteLaunch.arguments, cute._run)
    saved_vendor = run_plans.VendorProduct.__call__
    wrapped = timers.wrap("launch_kernel", real_launch)
    for module in importers:
        module.launch_kernel = wrapped
    launch._run = timers.wrap("_run", saved[0])
    launch._device_and_stream = timers.wrap("_device_and_stream", saved[1])
    launch.PinnedLaunch.__call__ = timers.wrap("PinnedLaunch.__call__", saved[2])
    cute.CuteLaunch.__call__ = timers.wrap("CuteLaunch.__call__", saved_cute[0])
    cute.CuteLaunch.arguments = timers.wrap("CuteLaunch.arguments", saved_cute[1])
    cute._run = timers.wrap("cute._run", saved_cute[2])
    run_plans.VendorProduct.__call__ = timers.wrap("VendorProduct.__call__", saved_vendor)
    try:
        yield
    finally:
        for module in importers:
            module.launch_kernel = real_launch
        launch._run, launch._device_and_stream, launch.PinnedLaunch.__call__ = saved
        cute.CuteLaunch.__call__, cute.CuteLaunch.arguments, cute._run = saved_cute
        run_plans.VendorProduct.__call__ = saved_vendor


def variant_row(name: str, base: Any, ids: Any, args: argparse.Namespace, bench: Any) -> dict:
    triton = ts.split_variant(name)[1] == "triton"
    with ts.programs_on("triton") if triton else nullcontext():  # tuned on Triton too
        model = ts.make_variant(name, base, "bf16", bench, family=args.family)
        step = ts.train_step(model, ts.loss_of(name, bench, args.family), ids, "bf16", bench)
        step()
    step = ts.on_triton(step) if triton else step
    for _ in range(2 if bench.dry_run else 5):
        step()
    row: dict[str, Any] = {"host_ms": ts.host_ms(step, bench, max(args.steps, 3))}
    if name.startswith("coda"):
        timers = Timers()
        with timed_launch_path(timers):
            row["host_ms_instrumented"] = ts.host_ms(step, bench, args.steps)
        row["per_step"] = timers.per_step(args.steps)
    if args.busy_ms > 0 and not bench.dry_run:
        row["behind_busy_gpu"] = behind_busy_gpu(step, bench, args.busy_ms, args.steps)
    return row


def behind_busy_gpu(step: Callable[[], Any], bench: Any, busy_ms: float, steps: int) -> dict:
    """Does anything in a step wait for the GPU? Each of ``steps`` steps is issued right after
    ``busy_ms`` of GPU work was queued (``torch.cuda._sleep``, the device otherwise idle): a step
    whose calls never wait issues in its usual host time, one that waits anywhere takes up to
    ``busy_ms`` longer. Reported: the median host ms, every wrapped launch function's longest
    call, and from one more such step under ``torch.profiler`` (CPU activity) the innermost
    ops and ranges that lasted over half of ``busy_ms`` — the calls that waited."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cycles = int(_cycles_per_ms() * busy_ms)
    timers, samples = Timers(), []
    with timed_launch_path(timers):
        for _ in range(steps):
            bench.synchronize()
            torch.cuda._sleep(cycles)
            start = time.perf_counter()
            step()
            samples.append((time.perf_counter() - start) * 1e3)
    bench.synchronize()
    torch.cuda._sleep(cycles)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    bench.synchronize()
    long_us = busy_ms * 1e3 / 2
    waited = [
        {"name": e.name, "us": e.cpu_time_total}
        for e in prof.events()
        if e.cpu_time_total > long_us
        and not any(c.cpu_time_total > long_us for c in e.cpu_children)
    ]
    return {
        "busy_ms": busy_ms,
        "host_ms": statistics.median(samples),
        "longest_us": {label: t * 1e6 for label, t in sorted(timers.longest.items())},
        "waited": waited,
    }


def _cycles_per_ms() -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spins per millisecond, measured."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def floors_us(bench: Any) -> dict[str, float] | None:
    """Host µs per call of the launch paths and a few PyTorch ops (GPU only)."""
    if bench.dry_run:
        return None
    import torch
    import triton
    import triton.language as tl

    from coda.primitives import launch

    @triton.jit
    def copy_kernel(x, y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < n), mask=i < n)

    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    pinned = launch.PinnedLaunch(copy_kernel, (4,), BLOCK=1024)

    def per_call(fn: Callable[[], Any], calls: int = 2000) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
        return elapsed

    return {
        "kernel[grid]": per_call(lambda: copy_kernel[(4,)](x, y, 4096, BLOCK=1024)),
        "launch_kernel": per_call(
            lambda: launch.launch_kernel(copy_kernel, (4,), x, y, 4096, BLOCK=1024)
        ),
        "PinnedLaunch": per_call(lambda: pinned(x, y, 4096)),
        "torch.add": per_call(lambda: torch.add(x, x, out=y)),
        "torch.empty": per_call(lambda: torch.empty(4096, device="cuda")),
        "torch.mm 2048 bf16": per_call(lambda: a @ a, 300),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv_train = ["--family", args.family, "--batch", "1", "--seq", str(args.tokens)]
    train_args = ts.parse_args(argv_train + (["--dry-run"] if args.dry_run else []))
    bench = ts.start(train_args, "experiments/launch_path.py")
    if bench is None:
        return 1
    import torch

    base = ts.base_model(train_args, bench, args.family)
    shape = (train_args.batch, train_args.seq)
    ids = torch.randint(0, base.config.vocab_size, shape, device=bench.device)
    result: dict[str, Any] = {"family": args.family, "tokens": train_args.seq, "variants": {}}
    for name in VARIANTS:
        result["variants"][name] = row = variant_row(name, base, ids, args, bench)
        print(name, json.dumps(row, indent=1), flush=True)
    result["floors_us"] = floors_us(bench)
    print("floors, µs per call:", json.dumps(result["floors_us"], indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"launch_path_{args.family}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
