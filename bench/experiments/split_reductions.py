"""Experiment: do epilogues that reduce still need split accumulators?

Since 2026-11-29 a step whose epilogue reduces across the tile (partial reductions, column selects)
is generated with *split accumulators* — one accumulator per ``EPI_N`` column slice, B loaded slice
by slice, several narrower ``tl.dot`` per K step — because Triton 3.6 computed wrong reductions of
``tl.split`` sub-tiles on the H200 then. That mainloop cannot be flattened or warp-specialized and
costs ~1.16× cuBLAS by itself at the SwiGLU-backward shape (``swiglu_bwd_epilogue.py``,
``acc_only``); the five paper kernels that reduce are the five that miss ≤ 1.03×.

This generates each reducing step both ways from the same Program — the product (split
accumulators) and the plain tile loop with ``tl.split`` sub-tiles (``GemmInfo.reduces_tile``
forced off) — and for the plain one also flattened and warp-specialized; per variant:

* ``correct``: the whole run against the block's float32 reference (the sandbox's rule);
* ``max_rel_diff``: each step output against the product's, relative to its largest magnitude
  (a miscompile is off by O(1); summation order by ~1e-3 at most in bf16);
* ``ms``: interleaved ``do_bench`` medians of the step, next to a cuBLAS GEMM of its M, N, K;
* registers / spills of the compiled kernel, and the mainloop launched.

Not part of the product: a measurement to decide whether the codegen may drop split accumulators.

    python3 bench/experiments/split_reductions.py [--out DIR] [--blocks a,b] [--size 8192]
    python3 bench/experiments/split_reductions.py --dry-run   # CPU interpreter, toy sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch_overhead  # noqa: E402  (same folder: device selection and saving)

BLOCKS = (
    "gemm_partial_swiglu_bwd,llama_mlp_bwd_saved,gemm_partial_cross_entropy,"
    "gemm_residual_partial_rmsnorm_bwd,gemm_residual_partial_rmsnorm,"
    "gemm_rmsnorm_partial_cross_entropy"
)
# (block_m, block_n, num_warps, num_stages, epilogue_subtiles): the tuned leaders of the reducing
# kernels (bench/RESULTS.md, fourth session); each is tried with every variant.
CONFIGS = ((128, 256, 8, 3, 2), (128, 128, 8, 4, 2))
VARIANTS = ("split_acc", "tl_split", "tl_split_flat", "tl_split_ws")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument("--blocks", default=BLOCKS, help="comma-separated blocks with reducing steps")
    p.add_argument("--size", type=int, default=8192, help="M = N = K of the paper kernels")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: checks the script")
    return p.parse_args(argv)


def config_for(variant: str, shape: tuple[int, ...], dry_run: bool) -> Any:
    from coda.primitives.codegen.configs import INTERPRETER_DEFAULT
    from coda.primitives.ir import MainloopConfig

    if dry_run:
        base = INTERPRETER_DEFAULT.model_copy(update={"epilogue_subtiles": 2})
    else:
        bm, bn, warps, stages, subtiles = shape
        base = MainloopConfig(
            block_m=bm,
            block_n=bn,
            block_k=64,
            num_warps=warps,
            num_stages=stages,
            epilogue_subtiles=subtiles,
        )
    flat = variant in ("tl_split_flat", "tl_split_ws")
    return base.model_copy(update={"flatten": flat, "warp_specialize": variant == "tl_split_ws"})


def sizes_of(block: Any, n: int, dry_run: bool) -> dict[str, int]:
    if dry_run:
        return dict(block.shapes.cpu[1])
    if block.name.startswith("llama_"):
        return dict(block.shapes.bench[0])  # the llama_mlp benchmark's shape, d = 2048
    return dict(next(s for s in block.shapes.bench if s["M"] == n))


def compiled_variant(program: Any, info: Any, variant: str, config: Any) -> Any:
    """The program compiled with its reducing steps as ``variant`` at ``config``."""
    from coda.primitives import compile_program
    from coda.primitives.codegen.kernel import generate_kernel

    compiled = compile_program(program, info)
    for name, gemm in info.gemms.items():
        if not gemm.reduces_tile or name not in compiled.kernels:
            continue
        if variant != "split_acc":
            plain = dataclasses.replace(gemm, reduces_tile=False)
            step = compiled._step(name)
            compiled.kernels[name] = generate_kernel(step, plain, info.tensors, program.block)
        compiled.configs[name] = config
    return compiled


def block_rows(name: str, n: int, dry_run: bool) -> list[dict[str, Any]]:
    import torch

    from coda.agent.planner import lower
    from coda.blocks import get_block
    from coda.primitives import analyze

    device = launch_overhead.DEVICE
    dtype = torch.float32 if dry_run else torch.bfloat16
    block = get_block(name)
    program = lower(block)
    sizes = sizes_of(block, n, dry_run)
    inputs = block.make_inputs(sizes, dtype, seed=0, device=device)
    info = analyze(program, sizes)
    steps = [s for s, g in info.gemms.items() if g.reduces_tile and not g.vendor]
    rows = []
    for shape in CONFIGS[:1] if dry_run else CONFIGS:
        outputs: dict[str, dict[str, torch.Tensor]] = {}
        runs: dict[str, Any] = {}
        for variant in VARIANTS:
            row: dict[str, Any] = {"block": name, "sizes": sizes, "config": shape}
            row["variant"] = variant
            compiled = compiled_variant(program, info, variant, config_for(variant, shape, dry_run))
            try:
                prepared = compiled.prepare(inputs)
                tensors = compiled.run(prepared)
                row["correct"] = launch_overhead._correct(block, compiled, prepared, inputs, sizes)
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                continue
            outputs[variant] = {t: tensors[t].clone() for s in steps for t in info.gemms[s].writes}
            row["kernel_stats"] = {s: compiled.kernel_stats.get(s) for s in steps}
            row["mainloops"] = {s: compiled.mainloops_used.get(s) for s in steps}
            for s in steps:
                runs[f"{variant}:{s}"] = lambda c=compiled, t=tensors, s=s: c.run_gemm_step(s, t)
            first = outputs.get(VARIANTS[0])
            if first is not None:
                row["max_rel_diff"] = {
                    t: _rel_diff(outputs[variant][t], first[t]) for t in outputs[variant]
                }
            rows.append(row)
        for s in steps:
            g = info.gemms[s]
            a = torch.randn((g.M, g.K), device=device, dtype=dtype)
            b = torch.randn((g.K, g.N), device=device, dtype=dtype)
            runs[f"cublas:{s}"] = lambda a=a, b=b: torch.matmul(a, b)
        ms = _time(runs, dry_run)
        for row in rows[-len(VARIANTS) :]:
            if "error" not in row:
                row["ms"] = {s: ms[f"{row['variant']}:{s}"] for s in steps}
                row["cublas_ms"] = {s: ms[f"cublas:{s}"] for s in steps}
    return rows


def _rel_diff(got: Any, want: Any) -> float:
    """Largest difference over the finite elements, relative to ``want``'s largest of them; a
    non-finite element in one tensor and not the other counts as 1."""
    got, want = got.float(), want.float()
    if not torch_equal_nonfinite(got, want):
        return 1.0
    finite = want.isfinite()
    if not finite.any():
        return 0.0
    scale = want[finite].abs().max().item() or 1.0
    return (got - want)[finite].abs().max().item() / scale


def torch_equal_nonfinite(got: Any, want: Any) -> bool:
    """Both tensors are non-finite at the same places, with the same values there."""
    import torch

    bad = ~want.isfinite()
    return bool(torch.equal(bad, ~got.isfinite())) and bool(
        torch.equal(got[bad].nan_to_num(), want[bad].nan_to_num())
    )


def _time(runs: dict[str, Any], dry_run: bool) -> dict[str, float]:
    if dry_run:
        return {k: 0.0 for k in runs}
    from coda.primitives.timing import interleaved_ms

    return interleaved_ms(runs, rounds=3, warmup=10, rep=50)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| block | config | variant | correct | max rel diff | step ms / cuBLAS | regs / spills |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cfg = "{}×{}, {}w, {}st, {} sub".format(*r["config"]) if "config" in r else ""
        if "error" in r:
            variant = r.get("variant", "")
            lines.append(f"| {r['block']} | {cfg} | {variant} | error: {r['error'][:80]} ||||")
            continue
        diff = max(r.get("max_rel_diff", {"": 0.0}).values())
        times = ", ".join(
            f"{s} {ms:.3f} / {r['cublas_ms'][s]:.3f}" for s, ms in r.get("ms", {}).items()
        )
        stats = ", ".join(
            f"{(st or {}).get('registers', '?')} / {(st or {}).get('spills', '?')}"
            for st in r["kernel_stats"].values()
        )
        lines.append(
            f"| {r['block']} | {cfg} | {r['variant']} | {r['correct']} | {diff:.1e} | {times} "
            f"| {stats} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not launch_overhead.start(args.dry_run, "split_reductions.py"):
        return 2
    rows: list[dict[str, Any]] = []
    for name in args.blocks.split(","):
        print(f"{name} ...", flush=True)
        try:
            rows += block_rows(name, args.size, args.dry_run)
        except Exception as e:  # noqa: BLE001 - one failing block must not hide the rest
            rows.append({"block": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        launch_overhead.save(args.out, "split_reductions.json", json.dumps(rows, indent=2))
    launch_overhead.save(args.out, "split_reductions.md", table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
