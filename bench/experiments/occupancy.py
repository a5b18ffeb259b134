"""Experiment: can a second resident program per SM hide the reducing epilogues?

The five paper kernels whose epilogues reduce across the tile (row partials of RMSNorm, LSE and
target select of cross-entropy, the SwiGLU-backward statistic) stay 1.05–1.16× the cuBLAS GEMM at
M = N = K = 8192 while the elementwise ones reach 1.00–1.02× (bench/RESULTS.md). In a persistent
kernel with one program per SM the tensor cores idle while that program runs its epilogue. A
second resident program overlaps one program's epilogue with the other's mainloop — what a
warp-specialized "ping-pong" GEMM gets from two consumer warpgroups — provided registers and
shared memory let two be resident: narrower tiles, one warpgroup each, fewer pipeline stages, or
a register cap (``maxnreg``).

For each kernel (and ``gemm_swiglu``, whose epilogue does not reduce, as a control) this times
fixed ``MainloopConfig``s — the current tuned leaders with one program per SM, and 128×128 /
64×256 tiles with two — against the cuBLAS GEMM of the same shape, interleaved, every config's
outputs checked against the reference executor (the tuner's own check). Per config: ms,
registers, spills, shared memory, and how many programs the SM can hold by those numbers.

Not part of the product: a measurement to decide the tuning space.

    python3 bench/experiments/occupancy.py [--out DIR] [--kernels a,b] [--size 8192]
    python3 bench/experiments/occupancy.py --dry-run   # CPU interpreter, toy sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

KERNELS = (
    "gemm_swiglu,gemm_residual_partial_rmsnorm,gemm_partial_cross_entropy,"
    "gemm_rmsnorm_partial_cross_entropy,gemm_residual_partial_rmsnorm_bwd,gemm_partial_swiglu_bwd"
)
# (name, positional fields, keyword fields) of the product's tuning-space ``Candidate``s:
# block_m, block_n, block_k, num_warps, num_stages, epilogue_subtiles, then by keyword.
CONFIGS = [
    ("256w_sub2", (128, 256, 64, 8, 3, 2), {}),
    ("256w_sub4", (128, 256, 64, 8, 3, 4), {}),
    ("128_4w_s3", (128, 128, 64, 4, 3, 2), {}),
    ("128_4w_s3_x2", (128, 128, 64, 4, 3, 2), {"programs_per_sm": 2}),
    ("128_4w_s2_x2", (128, 128, 64, 4, 2, 2), {"programs_per_sm": 2}),
    ("128_4w_k32s4_x2", (128, 128, 32, 4, 4, 2), {"programs_per_sm": 2}),
    ("128_4w_s3_x2_flat", (128, 128, 64, 4, 3, 2), {"flatten": True, "programs_per_sm": 2}),
    ("128_8w_s3_x2_r128", (128, 128, 64, 8, 3, 2), {"programs_per_sm": 2, "maxnreg": 128}),
    ("64x256_4w_s3_x2", (64, 256, 64, 4, 3, 2), {"programs_per_sm": 2}),
    # second round (after the first showed two resident programs pay where nothing spills):
    # narrower epilogue slices for the spilling epilogues, shallower pipelines for shared memory
    ("128_4w_s3_x2_sub4", (128, 128, 64, 4, 3, 4), {"programs_per_sm": 2}),
    ("128_4w_k32s4_x2_sub4", (128, 128, 32, 4, 4, 4), {"programs_per_sm": 2}),
    ("128_4w_k32s3_x2", (128, 128, 32, 4, 3, 2), {"programs_per_sm": 2}),
    ("128_4w_k32s3_x2_sub4", (128, 128, 32, 4, 3, 4), {"programs_per_sm": 2}),
    ("128_8w_s3_x2_r128_sub4", (128, 128, 64, 8, 3, 4), {"programs_per_sm": 2, "maxnreg": 128}),
    (
        "128_8w_k32s4_x2_r128_sub4",
        (128, 128, 32, 8, 4, 4),
        {"programs_per_sm": 2, "maxnreg": 128},
    ),
]
# Hopper: 64K 32-bit registers and 228 KB of shared memory per SM (1 KB of it reserved per block).
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
DEVICE = "cuda"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument("--kernels", default=KERNELS, help="comma-separated paper kernel blocks")
    p.add_argument("--configs", default="", help="comma-separated config names (default: all)")
    p.add_argument("--size", type=int, default=8192, help="M = N = K")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: checks the script")
    return p.parse_args(argv)


def mainloop_config(fields: tuple, extra: dict[str, Any]) -> Any:
    from coda.primitives.codegen.tuning import Candidate
    from coda.primitives.ir import MainloopConfig

    return MainloopConfig(**Candidate(*fields, **extra)._asdict())


def resident_programs(stats: dict[str, int], num_warps: int) -> int | None:
    """Programs one SM can hold by registers and shared memory (None without the numbers)."""
    if "registers" not in stats or "shared_bytes" not in stats:
        return None
    by_registers = REGISTERS_PER_SM // max(1, stats["registers"] * 32 * num_warps)
    by_shared = SHARED_PER_SM // (stats["shared_bytes"] + 1024)
    return min(by_registers, by_shared)


def block_sizes(block: Any, size: int) -> dict[str, int]:
    """The benchmark shape set of ``block`` with M = N = K = ``size``."""
    for sizes in block.shapes.bench:
        if sizes["M"] == sizes["N"] == sizes["K"] == size:
            return sizes
    raise SystemExit(f"{block.name} has no benchmark shape set with M = N = K = {size}")


def kernel_rows(name: str, size: int, configs: list[tuple], rounds: int) -> list[dict[str, Any]]:
    """Every config of ``configs`` on paper kernel ``name`` at M = N = K = ``size``."""
    import torch

    from coda.blocks import get_block
    from coda.blocks.ops import Linear, Matmul
    from coda.planner import lower
    from coda.primitives import analyze, compile_program
    from coda.primitives.codegen.tuning import wrong_steps

    block = get_block(name)
    # the paper-kernel benchmark's shape set (with N2 = 2·N, D where the block has them)
    sizes = block.shapes.cpu[1] if DEVICE == "cpu" else block_sizes(block, size)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    inputs = block.make_inputs(sizes, dtype, seed=0, device=DEVICE)
    program = lower(block)
    (gemm,) = [op for op in block.graph if isinstance(op, Linear | Matmul)]
    rows, runs = [], {"cublas": lambda: gemm.call(inputs)}
    for label, fields, extra in configs:
        cfg = mainloop_config(fields, extra)
        compiled = compile_program(program, analyze(program, sizes))
        prepared = compiled.prepare(inputs)
        (step,) = compiled.kernels
        compiled.configs[step] = cfg
        row: dict[str, Any] = {"kernel": name, "size": size, "config": label, **cfg.model_dump()}
        try:
            row["wrong"] = wrong_steps(compiled, prepared)
        except Exception as e:  # noqa: BLE001  (a config that does not compile is a result)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            continue
        stats = dict(compiled.kernel_stats[step])
        row.update(stats, mainloop=compiled.mainloops_used[step])
        row["resident"] = resident_programs(stats, cfg.num_warps)
        rows.append(row)
        runs[label] = lambda c=compiled, p=prepared: c.run(p)
    times = timed(runs, rounds)
    for row in rows:
        if row["config"] in times:
            row["ms"] = times[row["config"]]
            row["over_cublas"] = times[row["config"]] / times["cublas"]
    rows.append({"kernel": name, "size": size, "config": "cublas", "ms": times["cublas"]})
    return rows


def timed(runs: dict[str, Any], rounds: int) -> dict[str, float]:
    """Interleaved ``do_bench`` medians; a dry run's wall time of one call (not a measurement)."""
    if DEVICE == "cpu":
        import time

        def wall(fn: Any) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return {name: wall(fn) for name, fn in runs.items()}
    from coda.primitives.timing import interleaved_ms

    return interleaved_ms(runs, rounds=rounds)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| kernel | config | ms | / cuBLAS | regs / spills | shared KB | resident | right |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["config"] == "cublas":
            lines.append(f"| {r['kernel']} | cuBLAS GEMM | {r['ms']:.3f} | 1.00× | | | | |")
            continue
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['config']} | — | {r['error'][:60]} | | | | |")
            continue
        shared = r.get("shared_bytes")
        lines.append(
            f"| {r['kernel']} | {r['config']} | {r['ms']:.3f} | {r['over_cublas']:.3f}× "
            f"| {r.get('registers', '—')} / {r.get('spills', '—')} "
            f"| {'—' if shared is None else round(shared / 1024)} | {r['resident'] or '—'} "
            f"| {'yes' if not r['wrong'] else 'NO: ' + str(r['wrong'])[:80]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    global DEVICE
    if args.dry_run:
        DEVICE = "cpu"  # coda's kernels run in Triton's interpreter there
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench/experiments/occupancy.py needs a CUDA GPU (see docs/gpu.md)", file=sys.stderr)
        return 2
    wanted = [c for c in args.configs.split(",") if c]
    configs = [c for c in CONFIGS if not wanted or c[0] in wanted]
    if args.dry_run:  # the interpreter: 32×32 tiles in two sub-tiles, one round
        configs = [(n, (32, 32, 32, 4, 1, 2), extra) for n, _, extra in configs]
        args.size, args.rounds = 64, 1
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.kernels.split(","):
        rows += kernel_rows(name, args.size, configs, args.rounds)
        (out / "occupancy.json").write_text(json.dumps(rows, indent=2))
        (out / "occupancy.md").write_text(table(rows) + "\n")
        print(table([r for r in rows if r["kernel"] == name]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
