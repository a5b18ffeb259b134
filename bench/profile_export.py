"""Where one ``llama_mlp`` forward+backward through ``coda.export`` spends its time, by kernel.

``bench/mlp_steps.py`` times each step of the two Programs alone; this profiles the exported op as a
user runs it (``torch.autograd.grad`` through the custom ops, prep included, configs tuned on the
first call) with ``torch.profiler``, so what the op adds around the Programs' kernels — copies,
fills, autograd bookkeeping, host gaps — shows up by name. Prints, per hidden size, the wall time of
one fwd+bwd from an idle GPU (CUDA events, median of the iterations; profiled, and before that the
same iterations without the profiler, whose ranges add host time), the GPU busy time, and the
kernels sorted by total GPU time; full tables go to ``profile_export.json`` in ``--out``.

    python3 bench/profile_export.py [--out DIR] [--sizes 2048,4096] [--iters 5] [--packed]

``--packed``: gate and up as one interleaved ``[2f, d]`` tensor (``packed_gate_up``, what
``CodaLlamaMLPBlock(fuse_gate_up=True)`` trains), so no weight layouts move.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

SIZES = {2048: {"M": 16384, "d": 2048, "f": 8192}, 4096: {"M": 16384, "d": 4096, "f": 14336}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument("--sizes", default="2048,4096", help="hidden sizes d (f follows Llama)")
    p.add_argument("--iters", type=int, default=5, help="profiled fwd+bwd iterations")
    p.add_argument("--packed", action="store_true", help="gate/up as one interleaved tensor")
    return p.parse_args(argv)


def profile_one(sizes: dict[str, int], iters: int, packed: bool = False) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from coda.blocks import get_block
    from coda.export import llama_mlp_function

    block = get_block("llama_mlp")
    inputs = block.make_inputs(sizes, torch.bfloat16, seed=0, device="cuda")
    if packed:
        from coda.export.mlp import interleave_gate_up

        gate_up = interleave_gate_up(inputs.pop("w_gate"), inputs.pop("w_up"))
        inputs = {"x": inputs["x"], "gamma": inputs["gamma"], "w_gate_up": gate_up, **inputs}
    leaves = [t.requires_grad_() for t in inputs.values()]
    dout = torch.randn((sizes["M"], sizes["d"]), device="cuda", dtype=torch.bfloat16)
    fn = llama_mlp_function(1e-5, verify=False, tune="quick", packed_gate_up=packed)

    def step() -> None:
        out = fn(*leaves)
        torch.autograd.grad(out, leaves, dout)

    for _ in range(3):  # the first call tunes
        step()
    torch.cuda.synchronize()
    unprofiled = walls(step, iters)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = walls(step, iters)
    kernels = gpu_work(prof.key_averages(), iters)
    return {
        "sizes": sizes,
        "wall_ms": statistics.median(wall),
        "wall_ms_unprofiled": statistics.median(unprofiled),
        "gpu_busy_ms": sum(k["ms"] for k in kernels),
        "kernels": kernels,
    }


def walls(step: Any, iters: int) -> list[float]:
    """The ms of each of ``iters`` calls of ``step``, each started on an idle GPU (synchronized
    after the one before): CUDA events around the call, so the host's time to its first launch
    counts."""
    import torch

    out = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def gpu_work(events: Any, iters: int) -> list[dict[str, Any]]:
    """The GPU's own work per iteration (kernels, copies, fills), longest first: events that ran
    on the device — not the CPU-side ops, autograd nodes and runtime calls that the profiler also
    credits with their children's device time, nor the device-side copy of a CPU range (a
    ``record_function`` range such as the op's ``coda::…`` name, which the profiler also lays
    on the GPU's timeline over the kernels it launched): either would count each kernel twice."""
    from torch.autograd import DeviceType

    ranges = {e.key for e in events if e.device_type == DeviceType.CPU}
    rows = [
        {"kernel": e.key, "calls": e.count // iters, "ms": e.device_time_total / 1e3 / iters}
        for e in events
        if e.device_type == DeviceType.CUDA and e.device_time_total > 0 and e.key not in ranges
    ]
    return sorted(rows, key=lambda k: -k["ms"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/profile_export.py needs a CUDA GPU (see docs/gpu.md)", file=sys.stderr)
        return 2
    results = [profile_one(SIZES[int(d)], args.iters, args.packed) for d in args.sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_export.json").write_text(json.dumps(results, indent=2))
    for r in results:
        print(
            f"\nd={r['sizes']['d']}: one fwd+bwd {r['wall_ms']:.3f} ms wall profiled, "
            f"{r['wall_ms_unprofiled']:.3f} unprofiled, {r['gpu_busy_ms']:.3f} ms of kernels"
        )
        print("| kernel | calls | ms |\n|---|---|---|")
        for k in r["kernels"][:25]:
            print(f"| {k['kernel'][:90]} | {k['calls']} | {k['ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
