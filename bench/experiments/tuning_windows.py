"""Experiment: do tuning's short timing windows rank a step's CuTe and Triton kernels as longer
runs do?

CuTe tuning timed each candidate in 30 ms windows of ``do_bench`` (``timing.interleaved_ms``,
rep 30); ``bench/paper_kernels.py`` times in 100 ms windows. In run 2026-12-03f every paper kernel
that tuning sent to the CuTe backend ran 5–12% slower in the benchmark than tuning had timed it
(``gemm_rmsnorm`` at 8192³: 1.577 ms in tuning, 1.722 in the benchmark, beside cuBLAS's 1.641),
while the kernels tuning kept on Triton matched within 3%. This script's run of 2026-12-03
answered it: the CuTe kernels sustain lower clocks at the power limit than the Triton ones, which
30 ms windows do not reach, and in 100 and 300 ms windows both blocks ran faster on Triton than
on the 128 × 128 CuTe config tuning had pinned. CuTe tuning now times in 100 ms windows
(``timing.sustained_ms``) and pins 128 × 192 tiles there, faster than both (run 2026-12-03j); when
tuning keeps a step on Triton, this script compares the fastest CuTe candidate tuning timed.

This script tunes each block under ``CODA_EPILOGUE_BACKEND=auto``, then times its fused step on
the CuTe config tuning pinned and on its tuned Triton kernel — each as the launch alone (as
tuning times it) and as the whole Program (as the benchmark does) — beside the cuBLAS GEMM of the
same shape, at every window in ``--reps``, in interleaved rounds; after each measurement it reads
the SM clock where NVML answers (``torch.cuda.clock_rate``).

With ``--triton-finalists`` it asks the same of the Triton tuner, which still ranks its
finalists in 20 ms windows (``codegen.tuning.tune_program``): each block is tuned on Triton alone,
and every fused step's finalists (the screen's fastest, which its final round timed) are timed as
their launches at every window beside cuBLAS; ``finalist_ranks`` says, per window, which finalist
each window ranks first and how far tuning's pick is behind it.

    CODA_EPILOGUE_BACKEND=auto python3 bench/experiments/tuning_windows.py \\
        [--blocks gemm_rmsnorm,gemm_swiglu] [--size 8192] [--reps 30,100,300] [--rounds 3] \\
        [--triton-finalists] [--out FILE]

Not product code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

NEEDS_GPU = "tuning_windows.py times kernels on a CUDA GPU; none is available here"


def summarize(samples: dict[str, dict[int, list[float]]], reference: str = "cublas") -> dict:
    """Per variant and window: the median ms over the rounds, and that median over the
    ``reference``'s median at the same window (``samples[variant][rep] = [ms, ...]``)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for variant, by_rep in samples.items():
        out[variant] = {}
        for rep, values in by_rep.items():
            ms = statistics.median(values)
            base = statistics.median(samples[reference][rep])
            out[variant][str(rep)] = {"ms": ms, "over_reference": ms / base}
    return out


def table(summary: dict, reps: list[int]) -> str:
    """Markdown: one row per variant, ms (× the reference) per window."""
    head = "| variant | " + " | ".join(f"{r} ms windows" for r in reps) + " |"
    rule = "|---|" + "---|" * len(reps)
    rows = [
        f"| {variant} | "
        + " | ".join(
            f"{cells[str(r)]['ms']:.3f} ({cells[str(r)]['over_reference']:.3f}×)" for r in reps
        )
        + " |"
        for variant, cells in summary.items()
    ]
    return "\n".join([head, rule, *rows])


def _clock_mhz() -> float | None:
    import torch

    try:
        return float(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 - NVML missing or not answering: no clock recorded
        return None


def measure(
    fns: dict[str, Callable[[], object]], reps: list[int], rounds: int
) -> tuple[dict[str, dict[int, list[float]]], dict[str, list[float]]]:
    """Every function at every window, in ``rounds`` interleaved rounds (the order rotating);
    the ms samples and the SM clocks read after each."""
    import triton

    names = list(fns)
    samples: dict[str, dict[int, list[float]]] = {n: {r: [] for r in reps} for n in names}
    clocks: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        for rep in reps:
            for name in order:
                ms = triton.testing.do_bench(fns[name], warmup=10, rep=rep, return_mode="median")
                samples[name][rep].append(float(ms))
                clock = _clock_mhz()
                if clock is not None:
                    clocks[name].append(clock)
    return samples, clocks


class TunedBlock(NamedTuple):
    """A paper kernel's block at ``M = N = K = size``, lowered, compiled and tuned (quick space),
    run once; ``cublas`` launches the GEMM alone on the same inputs."""

    sizes: dict[str, int]
    compiled: Any
    prepared: dict[str, Any]
    tensors: dict[str, Any]
    tuning: dict[str, Any]
    cublas: Callable[[], object]


def tuned_block(name: str, size: int, backend: str | None = None) -> TunedBlock:
    """Block ``name`` tuned as the benchmark tunes it; ``backend`` (``"triton"``) overrides the
    compiled Program's epilogue backend before tuning (default: the environment's)."""
    import torch

    from coda.blocks.ops import Linear, Matmul
    from coda.blocks.registry import get_block
    from coda.planner import lower
    from coda.primitives import analyze, compile_program
    from coda.primitives.codegen.tuning import QUICK_SPACE, tune_program

    block = get_block(name)
    (sizes,) = [s for s in block.shapes.bench if s["M"] == size]
    inputs = block.make_inputs(sizes, torch.bfloat16, seed=0, device="cuda")
    program = lower(block)
    compiled = compile_program(program, analyze(program, sizes))
    if backend is not None:
        compiled.epilogue_backend = backend
    prepared = compiled.prepare(inputs)
    tuning = tune_program(compiled, prepared, space=QUICK_SPACE)
    tensors = compiled.run(prepared)
    (gemm,) = [op for op in block.graph if isinstance(op, Linear | Matmul)]
    return TunedBlock(sizes, compiled, prepared, tensors, tuning, lambda: gemm.call(inputs))


def block_row(name: str, size: int, reps: list[int], rounds: int) -> dict[str, Any]:
    sizes, compiled, prepared, tensors, tuning, cublas = tuned_block(name, size)
    fns: dict[str, Callable[[], object]] = {"cublas": cublas}
    pinned = dict(compiled.cute_configs)
    fastest = {step: _fastest_cute(tuning[step]) for step in pinned if step in tuning}
    cute_configs = {step: config for step, config in fastest.items() if config is not None}
    if not cute_configs:
        raise SystemExit(
            f"{name}: no step ran on the CuTe backend (run under CODA_EPILOGUE_BACKEND=auto on a "
            "Hopper GPU with the CuTe DSL and QuACK installed)"
        )
    for step, config in cute_configs.items():
        prefix = f"{step}: " if len(cute_configs) > 1 else ""
        for label, choice in (("cute", config), ("triton", None)):
            compiled.cute_configs[step] = choice
            fns[f"{prefix}{label} launch"] = compiled.step_launch(step, tensors)
            fns[f"{prefix}{label} program"] = _program_at(compiled, step, choice, prepared)
    compiled.cute_configs.update(pinned)
    samples, clocks = measure(fns, reps, rounds)
    return {
        "block": name,
        "sizes": sizes,
        "tuning": {s: r.as_dict() for s, r in tuning.items() if hasattr(r, "as_dict")},
        "samples": {v: {str(r): ms for r, ms in by.items()} for v, by in samples.items()},
        "clocks_mhz": clocks,
        "summary": summarize(samples),
    }


def triton_finalists_row(name: str, size: int, reps: list[int], rounds: int) -> dict[str, Any]:
    """Block ``name`` tuned on Triton alone; each fused step's finalists timed as launches at
    every window in ``reps`` beside the cuBLAS GEMM, and how each window ranks them."""
    sizes, compiled, _, tensors, tuning, cublas = tuned_block(name, size, backend="triton")
    fns: dict[str, Callable[[], object]] = {"cublas": cublas}
    finalists: dict[str, list[str]] = {}  # per step, its finalists' labels, tuning's pick first
    configs: dict[str, str] = {}
    for step, trials in _finalists(tuning).items():
        pinned = compiled.configs[step]
        for i, trial in enumerate(trials):
            label = f"{step}: finalist {i} ({trial.final_ms:.3f} ms in tuning)"
            compiled.configs[step] = trial.config
            fns[label], configs[label] = compiled.step_launch(step, tensors), str(trial.config)
            finalists.setdefault(step, []).append(label)
        compiled.configs[step] = pinned
    if not finalists:
        raise SystemExit(f"{name}: no fused step had finalists to rank (a tuning cache answered?)")
    samples, clocks = measure(fns, reps, rounds)
    summary = summarize(samples)
    ranks = {step: finalist_ranks(summary, labels, reps) for step, labels in finalists.items()}
    return {
        "block": name,
        "sizes": sizes,
        "tuning": {s: r.as_dict() for s, r in tuning.items() if hasattr(r, "as_dict")},
        "configs": configs,
        "samples": {v: {str(r): ms for r, ms in by.items()} for v, by in samples.items()},
        "clocks_mhz": clocks,
        "summary": summary,
        "ranks": ranks,
    }


def _finalists(tuning: dict[str, Any]) -> dict[str, list[Any]]:
    """Per step tuned here (not from the cache), the trials its final round timed, fastest first
    (tuning's pick first); steps with fewer than two left out: nothing to rank."""
    out = {}
    for step, result in tuning.items():
        timed = [t for t in getattr(result, "trials", []) if t.final_ms is not None]
        if len(timed) >= 2:
            out[step] = sorted(timed, key=lambda t: t.final_ms)
    return out


def finalist_ranks(summary: dict, labels: list[str], reps: list[int]) -> dict[str, dict]:
    """Per window: the finalist it ranks first, and tuning's pick (``labels[0]``) over that one's
    time (1.0: the window agrees with tuning)."""
    out = {}
    for rep in reps:
        ms = {label: summary[label][str(rep)]["ms"] for label in labels}
        first = min(ms, key=ms.__getitem__)
        out[str(rep)] = {"first": first, "pick_over_first": ms[labels[0]] / ms[first]}
    return out


def _fastest_cute(result: Any) -> Any:
    """The CuTe config of a step's tuning result that timed fastest — the pinned one when tuning
    chose CuTe, else the fastest CuTe candidate it timed (None: none launched)."""
    from coda.primitives.cute.tuning import TRITON, candidates

    if result.best is not None:
        return result.best
    by_label = {str(c): c for c in candidates(loads_tiles=True)}
    timed = [label for label in result.times if label != TRITON and label in by_label]
    return by_label[min(timed, key=result.times.__getitem__)] if timed else None


def _program_at(compiled: Any, step: str, choice: Any, prepared: dict) -> Callable[[], object]:
    """The whole Program with ``step`` pinned to ``choice`` (a CuTe config, or None: Triton) on
    every call (the variants of one Program are timed interleaved)."""

    def run() -> object:
        compiled.cute_configs[step] = choice
        return compiled.run(prepared)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="gemm_rmsnorm,gemm_swiglu")
    p.add_argument("--size", type=int, default=8192, help="M = N = K")
    p.add_argument("--reps", default="30,100,300", help="do_bench windows, ms")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="write every sample as JSON here")
    p.add_argument(
        "--triton-finalists", action="store_true",
        help="rank the Triton tuner's finalists per window instead (see the docstring)",
    )  # fmt: skip
    args = p.parse_args(argv)
    reps = [int(r) for r in args.reps.split(",")]
    import torch

    if not torch.cuda.is_available():
        print(NEEDS_GPU, file=sys.stderr)
        return 2
    rows = []
    measure_row = triton_finalists_row if args.triton_finalists else block_row
    for name in args.blocks.split(","):
        row = measure_row(name, args.size, reps, args.rounds)
        rows.append(row)
        print(f"{name} {row['sizes']}\n{table(row['summary'], reps)}\n", flush=True)
        for step, by_rep in row.get("ranks", {}).items():
            for rep, rank in by_rep.items():
                print(f"  {step}, {rep} ms windows: first {rank['first']!r}, tuning's pick "
                      f"{rank['pick_over_first']:.3f}× its time", flush=True)  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
