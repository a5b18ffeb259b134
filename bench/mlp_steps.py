"""Where the time of ``llama_mlp`` forward+backward goes: every step of the two exported Programs.

For ``llama_mlp_train`` (forward, saving g, u and a) and ``llama_mlp_bwd_saved`` (backward) at
M = 16384 tokens, d = 2048 / 4096, after tuning (``--tune quick|full|none``): the prep (weight
layouts), each aux step, and each gemm step timed alone on the tensors of a full run; each gemm
step next to the cuBLAS GEMM of its shape (interleaved rounds), with its config, mainloop and the
compiled kernel's registers and spills. The rows add up to the Program's time less launch gaps.

``--subtiles 1,2,4,8`` also times every fused gemm step with its epilogue forced to each of these
numbers of column sub-tiles (``MainloopConfig.epilogue_subtiles``; the tuned tile, stages and warps
kept), in the same interleaved rounds as the tuned config and cuBLAS, each with its registers and
spills and checked against the reference executor. A slicing the tile cannot take (slices under
16 columns, or not whole heads) is listed with the reason.

    python3 bench/mlp_steps.py [--out DIR] [--sizes 2048,4096] [--tune quick] [--subtiles 1,2,4,8]
    python3 bench/mlp_steps.py --dry-run   # CPU, toy sizes, interpreter: checks the script only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIZES = {2048: {"M": 16384, "d": 2048, "f": 8192}, 4096: {"M": 16384, "d": 4096, "f": 14336}}
PROGRAMS = ["llama_mlp_train", "llama_mlp_bwd_saved"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument("--sizes", default="2048,4096", help="hidden sizes d (f follows Llama)")
    p.add_argument("--tune", choices=["quick", "full", "none"], default="quick")
    p.add_argument(
        "--subtiles",
        default="",
        help="also time each fused gemm step at these epilogue sub-tile counts, e.g. 1,2,4,8",
    )
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: checks the script only")
    args = p.parse_args(argv)
    args.subtiles = [int(s) for s in args.subtiles.split(",") if s]
    if any(s not in (1, 2, 4, 8) for s in args.subtiles):
        p.error(f"--subtiles takes 1, 2, 4 or 8 (comma-separated), got {args.subtiles}")
    return args


def _timer(dry_run: bool) -> Callable[[dict[str, Callable[[], Any]]], dict[str, float]]:
    if dry_run:
        import time

        def wall(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
            out = {}
            for name, fn in fns.items():
                fn()
                start = time.perf_counter()
                fn()
                out[name] = (time.perf_counter() - start) * 1e3
            return out

        return wall
    from coda.primitives.timing import interleaved_ms

    return lambda fns: interleaved_ms(fns, rounds=2, warmup=10, rep=50)


def step_rows(block_name: str, sizes: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from coda.blocks import get_block
    from coda.planner import lower
    from coda.primitives import analyze, compile_program
    from coda.primitives.base import RunEnv
    from coda.primitives.ir import GemmEpilogue

    device, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    block = get_block(block_name)
    program = lower(block)
    inputs = block.make_inputs(sizes, dtype, seed=0, device=device)
    compiled = compile_program(program, analyze(program, sizes))
    prepared = compiled.prepare(inputs)
    tuning = {}
    if args.tune != "none":
        from coda.primitives.codegen.tuning import QUICK_SPACE, tune_program

        space = QUICK_SPACE if args.tune == "quick" else None
        tuning = tune_program(compiled, prepared, space=space)
    tensors = compiled.run(prepared)
    info = compiled.info_for(inputs)
    time = _timer(args.dry_run)
    rows: list[dict[str, Any]] = []
    whole = time({"program": lambda: compiled(inputs), "prep": lambda: compiled.prepare(inputs)})
    rows.append({"step": "(prep)", "kind": "prep", "ms": whole["prep"]})
    env = RunEnv(tensors, info.tensors, sizes=info.sizes)
    for step, name in zip(program.steps, program.step_names(), strict=True):
        if not isinstance(step, GemmEpilogue):
            ms = time({"aux": lambda step=step: step.launch(env)})["aux"]
            rows.append({"step": name, "kind": step.kind, "ms": ms})
            continue
        g = info.gemms[name]
        a = torch.randn((g.M, g.K), device=device, dtype=dtype)
        b = torch.randn((g.K, g.N), device=device, dtype=dtype)
        cfg = compiled.config_for(name, g)
        forced = {}
        if not g.vendor:
            forced = forced_subtiles(compiled, (name, cfg, g), prepared, tensors, args.subtiles)
        ms = time(
            {
                "step": run_at(compiled, name, cfg, tensors),
                "cublas": lambda a=a, b=b: torch.matmul(a, b),
                **{
                    f"e{s}": run_at(compiled, name, c, tensors)
                    for s, (c, f) in forced.items()
                    if f.get("correct")  # a wrong kernel's time means nothing
                },
            }
        )
        run_at(compiled, name, cfg, tensors)()  # the tuned config's stats and tensors, last
        rows.append(
            {
                "step": name,
                "kind": "vendor gemm" if g.vendor else "fused gemm",
                "M": g.M,
                "N": g.N,
                "K": g.K,
                "ms": ms["step"],
                "cublas_ms": ms["cublas"],
                "over_cublas": ms["step"] / ms["cublas"],
                "config": None if g.vendor else cfg.model_dump(),
                "mainloop": compiled.mainloops_used.get(name),
                "kernel_stats": compiled.kernel_stats.get(name),
                # every candidate the tuner timed (screening and final-round ms), any it rejected
                "tuning": tuning[name].as_dict() if name in tuning else None,
                "subtiles": [
                    {**f, "ms": ms.get(f"e{s}"), "over_cublas": _ratio(ms.get(f"e{s}"), ms)}
                    for s, (_, f) in forced.items()
                ],
            }
        )
    return {"program": block_name, "sizes": sizes, "program_ms": whole["program"], "steps": rows}


def run_at(compiled: Any, name: str, cfg: Any, tensors: dict[str, Any]) -> Callable[[], None]:
    """Launch step ``name`` under config ``cfg`` (pinned anew on every call: the configs of one
    step are timed interleaved)."""

    def run() -> None:
        compiled.configs[name] = cfg
        compiled.run_gemm_step(name, tensors)

    return run


def forced_subtiles(
    compiled: Any,
    step: tuple[str, Any, Any],
    prepared: dict[str, Any],
    tensors: dict[str, Any],
    subtiles: list[int],
) -> dict[int, tuple[Any, dict[str, Any]]]:
    """For each value of ``subtiles``: the tuned config of ``step`` (its name, config and
    ``GemmInfo``) with that many epilogue sub-tiles, and what to report of it — its compiled
    kernel's registers and spills, its mainloop, whether the Program computes the reference
    executor's tensors under it — or (``None``, why the tile cannot be sliced so)."""
    from coda.primitives.codegen.configs import with_subtiles
    from coda.primitives.codegen.tuning import wrong_steps

    name, cfg, gemm = step
    out: dict[int, tuple[Any, dict[str, Any]]] = {}
    for s in subtiles:
        try:
            forced = with_subtiles(cfg, s, gemm.column_multiple)
        except ValueError as e:
            out[s] = (None, {"subtiles": s, "skipped": str(e)})
            continue
        compiled.configs[name] = forced
        wrong = wrong_steps(compiled, prepared).get(name, "")
        compiled.run_gemm_step(name, tensors)  # launched anew: its own registers and spills
        report = {
            "subtiles": s,
            "config": forced.model_dump(),
            "mainloop": compiled.mainloops_used.get(name),
            "kernel_stats": compiled.kernel_stats.get(name),
            "correct": not wrong,
            "wrong": wrong,
        }
        out[s] = (forced, report)
    compiled.configs[name] = cfg
    return out


def _ratio(value: float | None, ms: dict[str, float]) -> float | None:
    return None if value is None else value / ms["cublas"]


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| program | d | step | kind | M×N×K | ms | cuBLAS ms | / cuBLAS | tile, sub-tiles | "
        "regs / spills |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        d = r["sizes"]["d"]
        for s in r["steps"]:
            shape = f"{s['M']}×{s['N']}×{s['K']}" if "M" in s else ""
            cfg, stats = s.get("config"), s.get("kernel_stats")
            tile = f"{cfg['block_m']}×{cfg['block_n']}, {cfg['epilogue_subtiles']}" if cfg else ""
            regs = f"{stats['registers']} / {stats['spills']}" if stats else ""
            cub, ratio = s.get("cublas_ms"), s.get("over_cublas")
            cub_text = "" if cub is None else f"{cub:.3f}"
            ratio_text = "" if ratio is None else f"{ratio:.2f}×"
            lines.append(
                f"| {r['program']} | {d} | {s['step']} | {s['kind']} | {shape} | {s['ms']:.3f} | "
                f"{cub_text} | {ratio_text} | {tile} | {regs} |"
            )
            lines += [_forced_line(r["program"], d, s, f, shape) for f in s.get("subtiles", [])]
        lines.append(f"| {r['program']} | {d} | **whole** | | | {r['program_ms']:.3f} | | | | |")
    return "\n".join(lines)


def _forced_line(program: str, d: int, step: dict, forced: dict, shape: str) -> str:
    """A table row of one step timed at a forced number of epilogue sub-tiles."""
    kind = f"sub-tiles forced to {forced['subtiles']}"
    where = f"| {program} | {d} | {step['step']} | {kind} | {shape} |"
    if "skipped" in forced:
        return f"{where} n/a: {forced['skipped']} | | | | |"
    if not forced["correct"]:
        return f"{where} WRONG: {forced['wrong'][:80]} | | | | |"
    cfg, stats = forced["config"], forced.get("kernel_stats")
    regs = f"{stats['registers']} / {stats['spills']}" if stats else ""
    return (
        f"{where} {forced['ms']:.3f} | {step['cublas_ms']:.3f} | {forced['over_cublas']:.2f}× | "
        f"{cfg['block_m']}×{cfg['block_n']}, {cfg['epilogue_subtiles']} | {regs} |"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench/mlp_steps.py needs a CUDA GPU (or --dry-run on a CPU)", file=sys.stderr)
        return 2
    import coda.primitives  # noqa: F401  (its kernels run in the interpreter without a GPU)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    size_sets = (
        [{"M": 64, "d": 32, "f": 48}]
        if args.dry_run
        else [SIZES[int(d)] for d in args.sizes.split(",")]
    )
    for sizes in size_sets:
        for name in PROGRAMS:
            print(f"  {name} {sizes} ...", flush=True)
            results.append(step_rows(name, sizes, args))
            (out / "mlp_steps.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    (out / "mlp_steps.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
