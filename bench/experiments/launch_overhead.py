"""Experiment: how much host time does one Program run cost, and where does it go?

At M = N = K = 4096 ``gemm_residual_partial_rmsnorm`` timed 0.32–0.35 ms with ``do_bench`` but
0.23 ms replayed from a CUDA graph (GEMM alone 0.19 / 0.20): the run is host-bound, the GPU waits
for launches. This measures, for a few paper kernels:

* ``host_us``: host time of one ``CompiledProgram.run`` at a tiny size (M = N = K = 256, where
  the GPU finishes long before the host enqueues the next call: wall time per call = host time),
  and the same for each of its steps alone (``gemm:<name>``, ``aux:<name>``);
* floors: an empty Triton kernel launch with 3 arguments, one ``torch.empty``, one ``torch.sum``;
* ``sum_partials`` finished by the Triton combine kernel (the primitive) or by two torch ops;
* at M = N = K = 4096: ``do_bench`` and CUDA-graph milliseconds of the run with each
  ``sum_partials`` variant, next to the cuBLAS GEMM alone;
* ``--cprofile``: where the host time of one fused-GEMM launch goes (``cProfile`` of 200 launches
  of the first kernel's GEMM step at the tiny size, the 25 functions with the most own time).

Not part of the product: a measurement to decide what to change in the runtime.

    python3 bench/experiments/launch_overhead.py [--out DIR] [--kernels a,b] [--cprofile]
    python3 bench/experiments/launch_overhead.py --dry-run   # CPU interpreter, toy sizes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KERNELS = "gemm_residual_partial_rmsnorm,gemm_swiglu,gemm_partial_cross_entropy"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument("--kernels", default=KERNELS, help="comma-separated paper kernel blocks")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: checks the script")
    p.add_argument("--cprofile", action="store_true", help="profile one fused-GEMM launch")
    return p.parse_args(argv)


DEVICE = "cuda"


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_us(fn: Callable[[], Any], calls: int = 200) -> float:
    """Median host microseconds per call over 5 batches of ``calls`` (synchronised between
    batches, not within: at tiny sizes the GPU keeps up and the host's enqueue time is measured)."""
    fn()
    _sync()
    calls = calls if DEVICE == "cuda" else 2
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - start) / calls * 1e6)
        _sync()
    return statistics.median(batches)


def torch_sum_partials(self: Any, env: Any) -> None:
    """``sum_partials`` finished with torch ops (a sum and a scaled copy: two launches)."""
    import torch

    total = env.tensors[self.src].sum(dim=1)
    torch.mul(total, self._scale(env), out=env.tensors[self.out])


def floors() -> dict[str, float]:
    import torch

    from coda.primitives import backend

    @backend.jit  # compiled on a GPU, interpreted on a CPU (a dry run)
    def empty_kernel(a, b, n):  # noqa: ANN001, ANN202
        pass

    x = torch.zeros(1024, device=DEVICE)
    return {
        "triton_empty_kernel": host_us(lambda: empty_kernel[(1,)](x, x, 1)),
        "torch_empty": host_us(lambda: torch.empty(1024, device=DEVICE)),
        "torch_sum": host_us(lambda: x.sum()),
    }


def kernel_rows(name: str) -> dict[str, Any]:
    from coda.blocks import get_block
    from coda.planner import lower

    block = get_block(name)
    program = lower(block)
    row: dict[str, Any] = {"block": name}
    small, sizes_to_time = (256, (256, 4096)) if DEVICE == "cuda" else (32, (32,))
    for n in sizes_to_time:
        sizes = {k: n if k in ("M", "N", "K") else v for k, v in block.shapes.bench[0].items()}
        row |= _time_size(block, program, sizes, host=n == small)
    return row


def _time_size(block: Any, program: Any, sizes: dict[str, int], host: bool) -> dict[str, Any]:
    """host: host microseconds of the run (both sum_partials variants) and of each step alone;
    else do_bench and CUDA-graph milliseconds of the run and of the cuBLAS GEMM alone."""
    import torch
    import triton

    from coda.blocks.ops import Linear, Matmul
    from coda.primitives import analyze, compile_program
    from coda.primitives.aux.partials import SumPartials
    from coda.primitives.ir import GemmEpilogue

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    inputs = block.make_inputs(sizes, dtype, seed=0, device=DEVICE)
    compiled = compile_program(program, analyze(program, sizes))
    prepared = compiled.prepare(inputs)
    (gemm,) = [op for op in block.graph if isinstance(op, Linear | Matmul)]
    row: dict[str, Any] = {}

    def run() -> None:
        compiled.run(prepared)

    original = SumPartials.launch
    for variant, launch in (("triton_combine", original), ("torch_ops", torch_sum_partials)):
        SumPartials.launch = launch  # type: ignore[method-assign]
        try:
            if host:
                row[f"host_us[{variant}]"] = host_us(run)
            else:
                row[f"do_bench_ms[{variant}]"] = triton.testing.do_bench(run, return_mode="median")
                row[f"graph_ms[{variant}]"] = triton.testing.do_bench_cudagraph(
                    run, return_mode="median"
                )
        finally:
            SumPartials.launch = original  # type: ignore[method-assign]
    row[f"correct[{sizes['M']}]"] = _correct(block, compiled, prepared, inputs, sizes)
    if not host:
        row["gemm_ms"] = triton.testing.do_bench(lambda: gemm.call(inputs), return_mode="median")
        row["gemm_graph_ms"] = triton.testing.do_bench_cudagraph(
            lambda: gemm.call(inputs), return_mode="median"
        )
        return row
    tensors = compiled.run(prepared)
    env = _env(compiled, tensors)
    for step, name in zip(program.steps, program.step_names(), strict=True):
        if isinstance(step, GemmEpilogue):
            row[f"host_us[gemm:{name}]"] = host_us(
                lambda s=name: compiled.run_gemm_step(s, tensors)
            )
        else:
            row[f"host_us[aux:{name}]"] = host_us(lambda st=step: st.launch(env))
    return row


def launch_profile(name: str) -> str:
    """cProfile of 200 launches of ``name``'s fused GEMM step at the tiny size (own time)."""
    import cProfile
    import io
    import pstats

    import torch

    from coda.blocks import get_block
    from coda.planner import lower
    from coda.primitives import analyze, compile_program
    from coda.primitives.ir import GemmEpilogue

    block = get_block(name)
    program = lower(block)
    n = 256 if DEVICE == "cuda" else 32
    sizes = {k: n if k in ("M", "N", "K") else v for k, v in block.shapes.bench[0].items()}
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    inputs = block.make_inputs(sizes, dtype, seed=0, device=DEVICE)
    compiled = compile_program(program, analyze(program, sizes))
    tensors = compiled.run(compiled.prepare(inputs))
    step = next(s for s, _ in zip(program.steps, program.step_names(), strict=True))
    assert isinstance(step, GemmEpilogue)
    host_us(lambda: compiled.run_gemm_step(step.name, tensors))  # warm
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(200 if DEVICE == "cuda" else 2):
        compiled.run_gemm_step(step.name, tensors)
    profiler.disable()
    _sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def _correct(block: Any, compiled: Any, prepared: Any, inputs: Any, sizes: dict) -> bool:
    """The run's outputs against the block's float32 reference (the sandbox's rule)."""
    from coda.sandbox.compare import check_output

    outs = compiled.program.select_outputs(compiled.run(prepared), sizes)
    upcast = {n: t.float() if t.is_floating_point() else t for n, t in inputs.items()}
    ref32, theirs = block.reference(upcast), block.reference(inputs)
    dtype = next(iter(inputs.values())).dtype
    return all(
        check_output(o, outs[o], ref32[o], theirs[o], block.tolerance, sizes=sizes, seed=0,
                     run_dtype=dtype).passed
        for o in block.outputs
    )  # fmt: skip


def _env(compiled: Any, tensors: dict[str, Any]) -> Any:
    from coda.primitives.base import RunEnv

    info = compiled.info_for({n: tensors[n] for n in compiled.program.inputs})
    return RunEnv(tensors, info.tensors, sizes=info.sizes)


def start(dry_run: bool, script: str) -> bool:
    """Pick the device (a dry run: the CPU, where coda's kernels and this script's run in
    Triton's interpreter); False, with a message, when a real run finds no GPU."""
    global DEVICE
    if dry_run:
        DEVICE = "cpu"
    import torch

    if not dry_run and not torch.cuda.is_available():
        print(f"bench/experiments/{script} needs a CUDA GPU (see docs/gpu.md)", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not start(args.dry_run, "launch_overhead.py"):
        return 2
    if args.cprofile:
        save(args.out, "launch_profile.txt", launch_profile(args.kernels.split(",")[0]))
        return 0
    result = {"floors_us": floors(), "kernels": [kernel_rows(k) for k in args.kernels.split(",")]}
    save(args.out, "launch_overhead.json", json.dumps(result, indent=2))
    return 0


def save(folder: str, name: str, text: str) -> None:
    """Write ``text`` to ``folder/name`` (the folder made if needed) and print it."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / name).write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
