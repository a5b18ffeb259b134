"""Experiment: does the GPU wait for the host inside back-to-back training steps (8192 tokens by
default), and where does the host wait for the GPU?

``bench/train_step.py`` times steps the way ``do_bench`` runs them: one after another with no
synchronization between steps, so the host may run ahead of the GPU by whole steps. Its
``--gaps`` profile instead synchronizes before the profiled step, and so shows every gap of a
host that starts level with the GPU. This script looks at the steady state, for each variant of
``--variants`` (the names of ``train_step.py``; a 4-layer Llama at 3.2 1B widths, bf16, AdamW):

* ``do_bench_ms``: three ``triton.testing.do_bench`` medians of the step (L2 flushed before each);
* ``back_to_back_ms``: 20 steps in a row between two CUDA events, per step (no flush, no sync);
* under ``torch.profiler`` (CPU and CUDA activities), ``--steps`` steps in a row: the GPU's busy
  and idle time per step (the first step's share of the timeline left out), the gaps between
  kernels by length, and the 25 longest with the kernels on either side. The profiler's CPU
  tracing slows the host, so this idle time is an upper bound on the unprofiled step's.

``--host-lead`` measures instead, with no profiler, how far ahead the host is: whether a step
synchronizes anywhere (``torch.cuda.set_sync_debug_mode``), the host's wall time of each of 12
steps in a row (short while the host runs ahead, a GPU step long once CUDA's launch queue is full)
and, from an idle GPU, the host's time to issue the forward and the backward and the time the
GPU then needs to drain.

``--host-stalls`` asks where a host-bound step's host waits for the GPU without a reported sync:
the host's ms in each phase of a step (zero_grad, the embedding, each decoder layer, the loss,
backward, ``AdamW.step``; module hooks mark the layers) issued back to back (the GPU busy with the
step before) against the same phases issued from an idle GPU, median over ``--stall-steps`` steps
each; the caching allocator's cudaMalloc / cudaFree counts over the back-to-back steps; and the
host calls (PyTorch ops, CUDA runtime calls) longer than ``--stall-us`` µs, by name, per step,
profiled both ways and ordered by how much longer they take back to back — a call that blocks on
the GPU is long only there.

``--waits`` asks what a back-to-back step's host waits on when its first op (the embedding) takes
long: ``--stall-steps`` steps in a row, with the garbage collector on and then off, each step's
phase times as ``--host-stalls`` marks them, whether the GPU had finished the step before when
the step began and when its embedding returned (a CUDA event recorded at every step's end,
queried), the host thread's voluntary and involuntary context switches in the step, and the
garbage collector's collections and ms in it; with the machine's CPU steal time over each column.
A first op that waits for the GPU finds it busy and leaves it done; one descheduled by the OS or
the hypervisor counts an involuntary switch or steal; one the collector ran in counts its ms.
Where the step before's optimizer keeps the GPU busy for longer than the host takes to issue it
and the next first op (fused AdamW at 2048 tokens, run 2026-12-04h) the GPU is busy at both
checks in every step, and the two flags tell nothing.

Not part of the product: a measurement to decide whether host work or GPU work limits the step.

    python3 bench/experiments/step_idle.py [--batch 4] [--variants coda_lm_head,liger]
        [--steps 6] [--host-lead | --host-stalls [--stall-us 20] | --waits] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train_step as ts  # noqa: E402  (bench/)
from train_step import Span, busy_intervals, is_gpu_work  # noqa: E402

GAP_BINS = (("<2us", 2.0), ("2-5us", 5.0), ("5-20us", 20.0), ("20-100us", 100.0), (">100us", None))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=4, help="sequences of 2048 tokens")
    p.add_argument("--variants", default="coda_lm_head,liger")
    p.add_argument("--steps", type=int, default=6, help="profiled steps in a row")
    p.add_argument("--host-lead", action="store_true", help="the host's lead, no profiler")
    p.add_argument("--host-stalls", action="store_true", help="where the host waits, by phase")
    p.add_argument("--waits", action="store_true", help="what a long first op waits on")
    p.add_argument("--stall-steps", type=int, default=15, help="steps per --host-stalls column")
    p.add_argument("--stall-us", type=float, default=20.0, help="host calls longer than this")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    return p.parse_args(argv)


def gap_bin(us: float) -> str:
    return next(name for name, upper in GAP_BINS if upper is None or us < upper)


def timeline(kernels: list[Span], start: float, steps: int) -> dict:
    """Busy and idle µs of the GPU from ``start`` to its last kernel's end, per step, with the
    gaps between kernels (each with the kernel before and the one after); ``kernels`` in order
    of their start."""
    gaps, end, last = [], None, None
    for k in kernels:
        if k.end <= start:
            continue
        if end is not None and k.start > end:  # (end, once set, lies past start)
            gaps.append((k.start - end, last, k.name))
        if end is None or k.end > end:
            end, last = k.end, k.name
    finish = max(k.end for k in kernels)
    busy = sum(b - a for a, b in busy_intervals(kernels, start, finish))
    window = finish - start
    counts = {name: 0 for name, _ in GAP_BINS}
    sums = {name: 0.0 for name, _ in GAP_BINS}
    for us, _, _ in gaps:
        counts[gap_bin(us)] += 1
        sums[gap_bin(us)] += us
    gaps.sort(reverse=True)
    return {
        "window_ms_per_step": window / 1e3 / steps,
        "busy_ms_per_step": busy / 1e3 / steps,
        "idle_ms_per_step": (window - busy) / 1e3 / steps,
        "gaps_per_step": len(gaps) / steps,
        "gap_hist_count_per_step": {k: v / steps for k, v in counts.items()},
        "gap_hist_ms_per_step": {k: v / 1e3 / steps for k, v in sums.items()},
        "longest": [(round(us, 1), before[:70], after[:70]) for us, before, after in gaps[:25]],
    }


def measure(step, steps: int) -> dict:  # noqa: ANN001 - a train_step step
    import torch
    import triton
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    do_bench = [
        triton.testing.do_bench(step, warmup=10, rep=1000, return_mode="median") for _ in range(3)
    ]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(20):
        step()
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted(
        Span(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if is_gpu_work(e)
    )
    first, last = kernels[0].start, max(k.end for k in kernels)
    start = first + (last - first) / steps  # the first step's share left out
    return {
        "do_bench_ms": do_bench,
        "back_to_back_ms": begin.elapsed_time(end) / 20,
        **timeline(kernels, start, steps - 1),
    }


def host_lead(step, forward, backward) -> dict:  # noqa: ANN001 - train_step callables
    """Syncs in a step, the host's wall ms per step back to back, and from an idle GPU the host's
    ms to issue ``forward()`` and ``backward(loss)`` and the GPU's ms to drain after them."""
    import time
    import warnings

    import torch

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(1)
    with warnings.catch_warnings(record=True) as syncs:
        warnings.simplefilter("always")
        step()
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    walls = []
    for _ in range(12):
        t = time.perf_counter()
        step()
        walls.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    a = time.perf_counter()
    loss = forward()
    b = time.perf_counter()
    backward(loss)
    c = time.perf_counter()
    torch.cuda.synchronize()
    d = time.perf_counter()
    return {
        "sync_warnings": [str(w.message)[:200] for w in syncs],
        "host_wall_ms_back_to_back": walls,
        "host_forward_ms": (b - a) * 1e3,
        "host_backward_ms": (c - b) * 1e3,
        "gpu_drain_ms": (d - c) * 1e3,
    }


def phase_step(model, loss_fn, ids, bench):  # noqa: ANN001 - train_step parts
    """``train_step``'s step (fused AdamW) as a function returning the host's perf_counter at
    each boundary, in order: ``start``, after ``zero_grad``, after the embedding and after each
    decoder layer's forward (module hooks), ``forward`` (the loss returned), ``backward``,
    ``optimizer``."""
    import time

    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    marks: list[tuple[str, float]] = []
    inner = model.model
    modules = [("embed", inner.embed_tokens)]
    modules += [(f"layer{i}", layer) for i, layer in enumerate(inner.layers)]
    for name, module in modules:
        module.register_forward_hook(
            lambda *_, name=name: marks.append((name, time.perf_counter()))
        )

    def step() -> list[tuple[str, float]]:
        marks.clear()
        marks.append(("start", time.perf_counter()))
        optimizer.zero_grad(set_to_none=True)
        marks.append(("zero_grad", time.perf_counter()))
        loss = ts.setting_loss(model, loss_fn, ids, "bf16", bench)
        marks.append(("forward", time.perf_counter()))
        loss.backward()
        marks.append(("backward", time.perf_counter()))
        optimizer.step()
        marks.append(("optimizer", time.perf_counter()))
        return list(marks)

    return step


def phases_of(marks: list[tuple[str, float]]) -> dict:
    """One step's host ms from each mark to the next (named by the later one), and the whole
    step's."""
    phases = {name: (t - marks[i][1]) * 1e3 for i, (name, t) in enumerate(marks[1:])}
    return {"phases_ms": phases, "step_ms": (marks[-1][1] - marks[0][1]) * 1e3}


def median_phases(rows: list[dict]) -> dict[str, float]:
    """The median of each phase's ms over ``phases_of`` rows, and of the whole step's
    (``step``)."""
    import statistics

    out = {p: statistics.median(r["phases_ms"][p] for r in rows) for p in rows[0]["phases_ms"]}
    out["step"] = statistics.median(r["step_ms"] for r in rows)
    return out


def phase_ms(steps: list[list[tuple[str, float]]]) -> dict[str, float]:
    """Median host ms from each mark to the next (named by the later one) and of the whole step,
    over steps."""
    return median_phases([phases_of(marks) for marks in steps])


ALLOCATOR_COUNTS = (
    "num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams",
)  # fmt: skip


def allocator_counts() -> dict[str, int]:
    """The caching allocator's counts of cudaMalloc / cudaFree calls, retries and full syncs."""
    import torch

    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def host_stalls(step, steps: int, stall_us: float) -> dict:  # noqa: ANN001 - phase_step's step
    """Phase times back to back and from an idle GPU; the host calls by name, profiled both ways,
    ordered by how much longer they take back to back (a call that waits for the GPU tops it)."""
    import torch

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    idle = []
    for _ in range(steps):
        torch.cuda.synchronize()
        idle.append(step())
    torch.cuda.synchronize()
    for _ in range(3):
        step()
    before = allocator_counts()
    back = [step() for _ in range(steps)]
    torch.cuda.synchronize()
    after = allocator_counts()
    calls_idle = host_calls(step, steps, stall_us, synchronize=True)
    calls_back = host_calls(step, steps, stall_us, synchronize=False)
    names = set(calls_idle) | set(calls_back)
    zero = (0.0, 0.0, 0.0)
    rows = []
    for name in names:
        _, ms_i, max_i = calls_idle.get(name, zero)
        n_b, ms_b, max_b = calls_back.get(name, zero)
        rows.append({
            "name": name[:90], "more_ms": round(ms_b - ms_i, 3), "back_ms": round(ms_b, 3),
            "idle_ms": round(ms_i, 3), "per_step": round(n_b, 2), "back_max_us": round(max_b),
            "idle_max_us": round(max_i),
        })  # fmt: skip
    rows.sort(key=lambda r: -r["more_ms"])
    return {
        "from_idle_ms": phase_ms(idle),
        "back_to_back_ms": phase_ms(back),
        "allocator_calls_back_to_back": {k: after[k] - before[k] for k in ALLOCATOR_COUNTS},
        "host_calls_longer_back_to_back": rows[:40],
    }


def host_calls(step, steps: int, over_us: float, *, synchronize: bool) -> dict:  # noqa: ANN001
    """Per host event name (PyTorch ops, CUDA runtime and driver calls, nested ones counted in
    each) over ``steps`` profiled steps, those longer than ``over_us`` µs: count per step, ms per
    step and the longest µs; ``synchronize``: each step starts from an idle GPU."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            if synchronize:
                torch.cuda.synchronize()
            step()
        torch.cuda.synchronize()
    found: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        us = e.time_range.end - e.time_range.start
        if not is_gpu_work(e) and us > over_us and "Synchronize" not in e.name:
            found[e.name].append(us)
    return {n: (len(v) / steps, sum(v) / 1e3 / steps, max(v)) for n, v in found.items()}


def cpu_steal_ticks() -> int | None:
    """The machine's CPU steal time so far (clock ticks, all CPUs; ``/proc/stat``), or None
    where the file or the field is missing."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8])
    except (OSError, IndexError, ValueError):
        return None


class StepWatch:
    """What happens around one back-to-back step besides its own work: the garbage collector's
    collections and ms (``gc.callbacks``), the thread's context switches, and whether the GPU
    had finished the step before (``prev``, an event recorded at its end) at the step's start and
    when its embedding returned (``embedded``, a forward hook on the embedding calls it)."""

    def __init__(self) -> None:
        self.prev = None
        self.gc_started: float | None = None
        self.row: dict = {}

    def on_gc(self, phase: str, info: dict) -> None:
        import time

        if phase == "start":
            self.gc_started = time.perf_counter()
        elif self.gc_started is not None:
            self.row["gc_ms"] = (
                self.row.get("gc_ms", 0.0) + (time.perf_counter() - self.gc_started) * 1e3
            )
            self.row["gc_generations"] = self.row.get("gc_generations", []) + [info["generation"]]
            self.gc_started = None

    def begin(self) -> None:
        import resource

        use = resource.getrusage(resource.RUSAGE_THREAD)
        self.row = {"gpu_done_at_start": self.gpu_done(), "_csw": (use.ru_nvcsw, use.ru_nivcsw)}

    def embedded(self, *_: object) -> None:
        self.row.setdefault("gpu_done_after_embed", self.gpu_done())

    def end(self, marks: list[tuple[str, float]]) -> dict:
        import resource

        import torch

        use = resource.getrusage(resource.RUSAGE_THREAD)
        nvcsw, nivcsw = self.row.pop("_csw")
        self.prev = torch.cuda.Event()
        self.prev.record()
        return {
            **self.row, "voluntary_switches": use.ru_nvcsw - nvcsw,
            "involuntary_switches": use.ru_nivcsw - nivcsw, **phases_of(marks),
        }  # fmt: skip

    def gpu_done(self) -> bool | None:
        return None if self.prev is None else bool(self.prev.query())


def step_waits(step, embedding, steps: int, *, collect: bool) -> dict:  # noqa: ANN001
    """``steps`` back-to-back steps of ``phase_step``'s ``step`` watched by ``StepWatch`` (the
    garbage collector on or, ``collect`` False, off), after 5 unwatched; the rows, and the CPU
    steal ticks over them."""
    import gc

    import torch

    watch = StepWatch()
    hook = embedding.register_forward_hook(watch.embedded)
    enabled = gc.isenabled()
    gc.callbacks.append(watch.on_gc)
    try:
        (gc.enable if collect else gc.disable)()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        steal = cpu_steal_ticks()
        rows = []
        for _ in range(steps + 1):  # the first row only records the event the next one reads
            watch.begin()
            rows.append(watch.end(step()))
        torch.cuda.synchronize()
        after = cpu_steal_ticks()
    finally:
        gc.callbacks.remove(watch.on_gc)
        (gc.enable if enabled else gc.disable)()
        hook.remove()
    return {"rows": rows[1:], "steal_ticks": None if steal is None else after - steal}


def summarize_waits(rows: list[dict], long_ms: float = 1.0) -> dict:
    """Median ms per phase and per step; the steps whose embedding phase took over ``long_ms``,
    and of those how many began with the GPU busy, found it done after the embedding, were
    switched out involuntarily, or ran the garbage collector; and the median step with the GPU
    busy at its start against idle."""
    import statistics

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    medians = median_phases(rows)
    long = [r for r in rows if r["phases_ms"].get("embed", 0.0) > long_ms]
    busy = [r["step_ms"] for r in rows if r.get("gpu_done_at_start") is False]
    idle = [r["step_ms"] for r in rows if r.get("gpu_done_at_start") is True]
    return {
        "steps": len(rows),
        "median_ms": {p: ms for p, ms in medians.items() if p != "step"},
        "median_step_ms": medians["step"],
        "gc_ms_per_step": sum(r.get("gc_ms", 0.0) for r in rows) / len(rows),
        "long_embed": {
            "steps": len(long),
            "gpu_busy_at_start": sum(r.get("gpu_done_at_start") is False for r in long),
            "gpu_done_after_embed": sum(r.get("gpu_done_after_embed") is True for r in long),
            "involuntary_switch": sum(r["involuntary_switches"] > 0 for r in long),
            "garbage_collected": sum("gc_ms" in r for r in long),
        },
        "median_step_ms_gpu_busy_at_start": median(busy),
        "median_step_ms_gpu_idle_at_start": median(idle),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from paper_kernels import Bench

    if not torch.cuda.is_available():
        print("step_idle.py needs a CUDA GPU (it times training steps on it)", file=sys.stderr)
        return 2
    bench = Bench(False)
    base = ts.base_model(argparse.Namespace(layers=None, vocab=None), bench)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, 2048), device="cuda")
    results = {}
    for name in args.variants.split(","):
        model = ts.make_variant(name, base, "bf16", bench)
        loss_fn = ts.loss_of(name, bench)
        if args.host_stalls or args.waits:  # the same step, marking its phases
            step = phase_step(model, loss_fn, ids, bench)
        else:
            step = ts.train_step(model, loss_fn, ids, "bf16", bench)
        if args.waits:
            results[name] = {}
            for collect in (True, False):
                watched = step_waits(
                    step, model.model.embed_tokens, args.stall_steps, collect=collect
                )
                watched["summary"] = summarize_waits(watched["rows"])
                results[name]["gc_on" if collect else "gc_off"] = watched
                print(
                    name, "gc", "on" if collect else "off", json.dumps(watched["summary"], indent=1)
                )
                print("  steal ticks:", watched["steal_ticks"])
        elif args.host_stalls:
            results[name] = host_stalls(step, args.stall_steps, args.stall_us)
            print(name, json.dumps(results[name], indent=1))
        elif args.host_lead:

            def forward(model=model, loss_fn=loss_fn):  # noqa: ANN001, ANN202
                model.zero_grad(set_to_none=True)
                return ts.setting_loss(model, loss_fn, ids, "bf16", bench)

            results[name] = host_lead(step, forward, lambda loss: loss.backward())
            print(name, json.dumps(results[name], indent=1))
        else:
            results[name] = measure(step, args.steps)
            shown = {k: v for k, v in results[name].items() if k != "longest"}
            print(name, json.dumps(shown, indent=1))
            for gap in results[name]["longest"]:
                print("  ", gap)
        del model, step
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    kind = "waits" if args.waits else "host_stalls" if args.host_stalls else None
    kind = kind or ("host_lead" if args.host_lead else "step_idle")
    with open(os.path.join(args.out, f"{kind}-b{args.batch}.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
