"""Benchmark the CODA paper's ten kernels and ``llama_mlp`` forward+backward on a GPU (bf16).

For each paper kernel (``blocks/kernels.py``) at M = N = K = 4096 and 8192, side by side in one run
and on the same inputs: the planner's fused Program, the cuBLAS GEMM alone (its speed of light),
the block's PyTorch reference eagerly, and the same reference under ``torch.compile`` (cuBLAS GEMM +
a compiled epilogue). For ``llama_mlp`` at M = 16384 tokens, d = 2048 (f = 8192) and d = 4096
(f = 14336): forward and forward+backward of the exported CODA op (``coda.export``, prep included:
weights change every step; forward ``llama_mlp_train`` saving g and u, backward
``llama_mlp_bwd_saved``; and the variant that recomputes the gate/up GEMM instead) against eager
PyTorch, ``torch.compile``, Liger-Kernel when installed, and the six cuBLAS GEMMs alone (gate/up
fused). Every configuration is first checked for correctness in bf16 against a float32 reference
(the sandbox's rule: within 2× PyTorch's own bf16 error plus a floor).

Each row is timed in ``--runs`` (default 3) interleaved comparisons — every function once per round,
three rounds, each timing a ``triton.testing.do_bench`` median (L2 flushed between repetitions) —
and reports the median over the runs; a ratio (CODA / the GEMM, the packed op against
``torch.compile`` and Liger) is formed within each run and shown as its median with the min–max
over the runs (the runs' times are in the JSON, ``*_runs``). A short table is printed last; full
numbers go to ``paper_kernels.json`` and ``paper_kernels.md`` in ``--out`` (default ``$OUT``, else
``bench/out``).

``--subtiles 1,2,4,8`` also times each paper kernel's fused Program with every fused step's epilogue
forced to each of these numbers of column sub-tiles (``MainloopConfig.epilogue_subtiles``; the
tuned tiles otherwise kept), in the same interleaved rounds as the tuned Program, each checked like
it and reported with its registers and spills (the llama_mlp section is not forced:
``bench/mlp_steps.py --subtiles`` times its steps).

    python3 bench/paper_kernels.py [--out DIR] [--only gemm_swiglu,...] [--skip-mlp]
        [--subtiles 1,2,4,8] [--runs 3]
    python3 bench/paper_kernels.py --dry-run   # CPU, toy sizes, interpreter: checks the script only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NEEDS_GPU = (
    "bench/paper_kernels.py needs a CUDA GPU: it times bf16 kernels against cuBLAS and "
    "torch.compile, and no GPU is visible here. Run it on a GPU machine (see docs/gpu.md), or "
    "pass --dry-run to exercise the script on a CPU at toy sizes (numbers are not measurements)."
)
MLP_SIZES = [{"M": 16384, "d": 2048, "f": 8192}, {"M": 16384, "d": 4096, "f": 14336}]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument("--only", default="", help="comma-separated kernel blocks (default: all ten)")
    p.add_argument("--skip-kernels", action="store_true", help="only the llama_mlp section")
    p.add_argument("--skip-mlp", action="store_true", help="only the paper kernels")
    p.add_argument(
        "--skip-recompute",
        action="store_true",
        help="llama_mlp: leave out the variant whose backward recomputes the gate/up GEMM",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=3,
        help="interleaved comparisons per row: each time is their median, each ratio shown with "
        "its min–max over them",
    )
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: checks the script only")
    p.add_argument(
        "--tune",
        choices=["quick", "full", "none"],
        default="quick",
        help="tune each kernel first (quick: tuning.QUICK_SPACE; full: the whole space)",
    )
    p.add_argument(
        "--mlp-widths",
        default=",".join(str(s["d"]) for s in MLP_SIZES),
        help="llama_mlp: the model widths d to run, of "
        + ", ".join(f"{s['d']} (f {s['f']})" for s in MLP_SIZES),
    )
    p.add_argument(
        "--subtiles",
        default="",
        help="also time each kernel with its epilogues forced to these sub-tile counts (1,2,4,8)",
    )
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs takes a positive count, got {args.runs}")
    args.subtiles = [int(s) for s in args.subtiles.split(",") if s]
    if any(s not in (1, 2, 4, 8) for s in args.subtiles):
        p.error(f"--subtiles takes 1, 2, 4 or 8 (comma-separated), got {args.subtiles}")
    known = {str(s["d"]): s for s in MLP_SIZES}
    widths = [w for w in args.mlp_widths.split(",") if w]
    if any(w not in known for w in widths):
        p.error(f"--mlp-widths takes widths among {', '.join(known)}, got {args.mlp_widths}")
    args.mlp_sizes = [known[w] for w in widths]
    return args


class Bench:
    """Timing, device and dtype for this run (GPU: do_bench medians; dry run: wall clock)."""

    def __init__(
        self,
        dry_run: bool,
        tune: str = "none",
        recompute: bool = True,
        subtiles: list[int] | None = None,
        runs: int = 3,
    ) -> None:
        import torch

        self.dry_run = dry_run
        self.runs = runs  # interleaved comparisons per table row: medians and min–max of these
        self.tune = tune
        self.recompute = recompute
        self.subtiles = subtiles or []  # epilogue sub-tile counts each kernel is also timed at
        self.device = "cpu" if dry_run else "cuda"
        # bf16 tl.dot is wrong in the Triton 3.9 interpreter, so a dry run uses float32
        self.dtype = torch.float32 if dry_run else torch.bfloat16
        self.compile_backend = "eager" if dry_run else "inductor"

    def ms(self, fn: Callable[[], Any]) -> float:
        if self.dry_run:
            fn()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        import triton

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def compare(self, fns: dict[str, Callable[[], Any]], rep_ms: int = 100) -> dict[str, float]:
        """Milliseconds of each function, timed in interleaved rounds on a GPU (clocks drift under
        load, so back-to-back timings are not comparable: coda.primitives.timing), each timing the
        median over ``rep_ms`` milliseconds of calls."""
        for fn in fns.values():
            fn()  # warm up: compiles, autotunes and caches outside the timed rounds
        if self.dry_run:
            return {name: self.ms(fn) for name, fn in fns.items()}
        from coda.primitives.timing import interleaved_ms

        return interleaved_ms(fns, rounds=3, warmup=25, rep=rep_ms)

    def compare_runs(self, fns: dict[str, Callable[[], Any]]) -> dict[str, list[float]]:
        """``compare`` repeated ``self.runs`` times: each function's milliseconds in every run
        (a run is one interleaved comparison of them all), for the median and its spread."""
        runs = [self.compare(fns) for _ in range(self.runs)]
        return {name: [run[name] for run in runs] for name in fns}

    def graph_ms(self, fn: Callable[[], Any]) -> float | None:
        """Milliseconds of ``fn`` replayed from a CUDA graph: GPU time with no host launch cost
        (separates a host-bound launch path from slow kernels). None on a dry run or when ``fn``
        cannot be captured."""
        if self.dry_run:
            return None
        import triton

        try:
            return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
        except Exception as e:  # noqa: BLE001 - a diagnostic column, not the measurement
            print(f"    (no CUDA-graph timing: {e!r:.200})", flush=True)
            return None

    def compile(self, fn: Callable) -> Callable:
        import torch

        # One compiled reference per block and size: forget earlier ones, or dynamo's recompile
        # limit would silently fall back to eager for later blocks (they share one lambda).
        torch.compiler.reset()
        return torch.compile(fn, backend=self.compile_backend)

    def synchronize(self) -> None:
        """Wait for the GPU's queued work (nothing to wait for on a dry run)."""
        if not self.dry_run:
            import torch

            torch.cuda.synchronize()

    def free(self) -> None:
        import gc

        import torch

        gc.collect()
        if not self.dry_run:
            torch.cuda.empty_cache()


# -- correctness -------------------------------------------------------------------------------
def check(
    name: str, got: Any, ref32: Any, torch_out: Any, block: Any, sizes: dict, bench: Bench
) -> dict[str, Any]:
    """The sandbox's rule, with the float32 reference of this run as ground truth."""
    from coda.sandbox.compare import check_output

    c = check_output(
        name, got, ref32, torch_out, block.tolerance, sizes=sizes, seed=0, run_dtype=bench.dtype
    )
    return {
        "output": name,
        "passed": c.passed,
        "max_abs_err": c.max_abs_err,
        "torch_max_abs_err": c.torch_max_abs_err,
        "allowed": c.allowed,
        "rel_err": c.rel_err,
        "reason": c.reason,
    }


def _upcast(inputs: dict[str, Any]) -> dict[str, Any]:
    return {n: t.float() if t.is_floating_point() else t for n, t in inputs.items()}


# -- the ten kernels ---------------------------------------------------------------------------
def kernel_row(block: Any, sizes: dict[str, int], bench: Bench) -> dict[str, Any]:
    from coda.blocks.ops import Linear, Matmul
    from coda.planner import lower
    from coda.primitives import analyze, compile_program

    inputs = block.make_inputs(sizes, bench.dtype, seed=0, device=bench.device)
    program = lower(block)
    info = analyze(program, sizes)
    compiled = compile_program(program, info)
    prepared = compiled.prepare(inputs)
    tuning = {}
    if bench.tune != "none":
        from coda.primitives.codegen.tuning import QUICK_SPACE, tune_program

        space = QUICK_SPACE if bench.tune == "quick" else None
        tuning = tune_program(compiled, prepared, space=space)
    outs = program.select_outputs(compiled.run(prepared), info.sizes)
    ref32 = block.reference(_upcast(inputs))
    torch_out = block.reference(inputs)
    checks = [check(o, outs[o], ref32[o], torch_out[o], block, sizes, bench) for o in block.outputs]
    tuned = compiled.configs_for(info)
    forced = {}
    for s in bench.subtiles:
        forced[s] = forced_row(compiled, info, tuned, s, prepared)
        if "configs" in forced[s]:
            got = program.select_outputs(compiled.run(prepared), info.sizes)
            forced[s]["checks"] = [
                check(o, got[o], ref32[o], torch_out[o], block, sizes, bench) for o in block.outputs
            ]
            forced[s]["correct"] = all(c["passed"] for c in forced[s]["checks"])
    compiled.configs.update(tuned)
    (gemm,) = [op for op in block.graph if isinstance(op, Linear | Matmul)]
    reference = bench.compile(lambda **kw: block.reference(kw))
    runs = bench.compare_runs(
        {
            "coda": run_at(compiled, tuned, prepared),
            "gemm": lambda: gemm.call(inputs),
            "eager": lambda: block.reference(inputs),
            "compile": lambda: reference(**inputs),
            **{
                f"coda_e{s}": run_at(compiled, f["pinned"], prepared)
                for s, f in forced.items()
                if f.get("correct")  # a wrong kernel's time means nothing
            },
        }
    )
    times = {name: statistics.median(ms) for name, ms in runs.items()}
    compiled.configs.update(tuned)
    compiled.run(prepared)  # the tuned Program's kernel stats, last
    # The same two from CUDA graphs (no L2 flush): kernel time without the host's launch path
    graphs = {
        "coda_graph_ms": bench.graph_ms(lambda: compiled.run(prepared)),
        "gemm_graph_ms": bench.graph_ms(lambda: gemm.call(inputs)),
    }
    row = {
        "block": block.name,
        "sizes": sizes,
        "correct": all(c["passed"] for c in checks),
        "checks": checks,
        **{f"{name}_ms": ms for name, ms in times.items()},
        **{f"{name}_ms_runs": ms for name, ms in runs.items()},
        **graphs,
        "configs": {n: c.model_dump() for n, c in compiled.configs_for(info).items()},
        "mainloops": dict(compiled.mainloops_used),
        "kernel_stats": dict(compiled.kernel_stats),
        # every candidate the tuner timed (screening and final-round ms), and any it rejected
        "tuning": {step: r.as_dict() for step, r in tuning.items()},
        # the same Program with its epilogues forced to --subtiles sub-tiles
        "subtiles": [
            {
                **{k: v for k, v in f.items() if k != "pinned"},
                "ms": times.get(f"coda_e{s}"),
                "over_gemm": _over(times.get(f"coda_e{s}"), times["gemm"]),
            }
            for s, f in forced.items()
        ],
    }
    row["coda_over_gemm"] = row["coda_ms"] / row["gemm_ms"]
    row["coda_over_gemm_runs"] = per_run_ratios(runs["coda"], runs["gemm"])
    row["compile_over_gemm"] = row["compile_ms"] / row["gemm_ms"]
    row["speedup_vs_compile"] = row["compile_ms"] / row["coda_ms"]
    m, n, k = block.matmuls(sizes)[0]
    row["coda_tflops"] = 2 * m * n * k / (row["coda_ms"] * 1e-3) / 1e12
    return row


def run_at(compiled: Any, configs: dict[str, Any], prepared: dict[str, Any]) -> Callable[[], Any]:
    """Run the Program with ``configs`` pinned anew on every call (configs of one Program are
    timed interleaved; each pinning keeps its own run plan)."""

    def run() -> Any:
        compiled.configs.update(configs)
        return compiled.run(prepared)

    return run


def forced_row(
    compiled: Any, info: Any, tuned: dict[str, Any], subtiles: int, prepared: dict[str, Any]
) -> dict[str, Any]:
    """The Program's tuned configs with every fused step's epilogue in ``subtiles`` column
    sub-tiles, pinned on ``compiled`` and run once (the kernels' registers and spills); or why a
    step's tile cannot be sliced so."""
    from coda.primitives.codegen.configs import with_subtiles

    pinned = dict(tuned)
    for name, gemm in info.gemms.items():
        if gemm.vendor and compiled.use_vendor:
            continue
        try:
            pinned[name] = with_subtiles(tuned[name], subtiles, gemm.column_multiple)
        except ValueError as e:
            return {"subtiles": subtiles, "skipped": f"step {name!r}: {e}"}
    compiled.configs.update(pinned)
    compiled.run(prepared)
    return {
        "subtiles": subtiles,
        "pinned": pinned,
        "configs": {n: c.model_dump() for n, c in pinned.items()},
        "kernel_stats": dict(compiled.kernel_stats),
    }


def _over(ms: float | None, base: float) -> float | None:
    return None if ms is None else ms / base


def kernel_section(
    bench: Bench, only: list[str], save: Callable[[], None] = lambda: None, rows: list | None = None
) -> list[dict[str, Any]]:
    from coda.blocks.kernels import KERNELS

    rows = [] if rows is None else rows
    for block in KERNELS:
        if only and block.name not in only:
            continue
        size_sets = block.shapes.cpu[1:2] if bench.dry_run else block.shapes.bench
        for sizes in size_sets:
            print(f"  {block.name} {sizes} ...", flush=True)
            try:
                rows.append(kernel_row(block, sizes, bench))
            except Exception as e:  # noqa: BLE001 - one failing kernel must not hide the rest
                rows.append({"block": block.name, "sizes": sizes, "error": repr(e)[:2000]})
            bench.free()
            save()
    return rows


# -- llama_mlp forward + backward --------------------------------------------------------------
def _mlp_inputs(sizes: dict[str, int], bench: Bench) -> tuple[dict[str, Any], Any]:
    import torch

    from coda.blocks import get_block

    block = get_block("llama_mlp")
    inputs = block.make_inputs(sizes, bench.dtype, seed=0, device=bench.device)
    gen = torch.Generator(device=bench.device).manual_seed(1)
    dout = torch.randn(
        (sizes["M"], sizes["d"]), generator=gen, device=bench.device, dtype=bench.dtype
    )
    return {n: t.requires_grad_() for n, t in inputs.items()}, dout


def _packed_gate_up(inputs: dict[str, Any]) -> dict[str, Any]:
    """The same inputs with gate and up as one interleaved ``[2f, d]`` leaf (``w_gate_up``)."""
    from coda.export.mlp import interleave_gate_up

    fused = interleave_gate_up(inputs["w_gate"].detach(), inputs["w_up"].detach())
    return {
        "x": inputs["x"],
        "gamma": inputs["gamma"],
        "w_gate_up": fused.requires_grad_(),
        "w_down": inputs["w_down"],
    }


def _fwd_bwd(fn: Callable, inputs: dict[str, Any], dout: Any) -> Callable[[], Any]:
    import torch

    leaves = list(inputs.values())

    def step() -> Any:
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, dout))

    return step


def _liger_mlp(sizes: dict[str, int], inputs: dict[str, Any]) -> Callable | None:
    """Liger-Kernel's fused RMSNorm + SwiGLU MLP on the same weights, if it is installed."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:  # noqa: BLE001 - an optional baseline
        return None
    import torch.nn.functional as F

    def mlp(x: Any, gamma: Any, w_gate: Any, w_up: Any, w_down: Any) -> Any:
        h = LigerRMSNormFunction.apply(x, gamma, 1e-5, 0.0, "llama")
        a = LigerSiLUMulFunction.apply(F.linear(h, w_gate), F.linear(h, w_up))
        return x + F.linear(a, w_down)

    return mlp


def _six_gemms(sizes: dict[str, int], bench: Bench) -> Callable[[], None]:
    """The GEMMs of one fwd+bwd with gate/up fused: 2 forward, 4 backward (cuBLAS)."""
    import torch

    m, d, f = sizes["M"], sizes["d"], sizes["f"]
    shapes = [(m, d, 2 * f), (m, f, d), (m, d, f), (d, m, f), (m, 2 * f, d), (2 * f, m, d)]
    pairs = [
        (
            torch.randn((a, k), device=bench.device, dtype=bench.dtype),
            torch.randn((k, b), device=bench.device, dtype=bench.dtype),
        )
        for a, k, b in shapes
    ]

    def run() -> None:
        for a, b in pairs:
            torch.matmul(a, b)

    return run


def mlp_row(sizes: dict[str, int], bench: Bench) -> dict[str, Any]:
    from coda.blocks import get_block
    from coda.export import llama_mlp_function

    block = get_block("llama_mlp")
    inputs, dout = _mlp_inputs(sizes, bench)
    # checked right here instead of verified first; configs tuned on the first call per shape
    # (inside the warm-up, outside the timed rounds), as a user's first training step would
    tune = "off" if bench.tune == "none" else bench.tune
    exported = llama_mlp_function(1e-5, verify=False, tune=tune)
    recompute = llama_mlp_function(1e-5, verify=False, saved=False, tune=tune)
    # gate/up kept as one interleaved tensor (CodaLlamaMLPBlock(fuse_gate_up=True)): no prep copies
    packed = llama_mlp_function(1e-5, verify=False, tune=tune, packed_gate_up=True)
    packed_inputs = _packed_gate_up(inputs)
    reference = lambda *a: block.reference(dict(zip(block.inputs, a, strict=True)))["out"]  # noqa: E731
    candidates: dict[str, Callable | None] = {
        "coda": exported,
        "coda_recompute": recompute if bench.recompute else None,
        "coda_packed": packed,
        "eager": reference,
        "compile": bench.compile(reference),
        "liger": _liger_mlp(sizes, inputs),
    }
    # correctness of CODA's output and five gradients, against float32 autograd
    ref32 = _fwd_bwd(
        reference, {n: t.detach().float().requires_grad_() for n, t in inputs.items()}, dout.float()
    )()
    torch_bf16 = _fwd_bwd(reference, inputs, dout)()
    coda = _fwd_bwd(exported, inputs, dout)()
    names = ["out", "dx", "dgamma", "dw_gate", "dw_up", "dw_down"]
    checks = [
        check(n, g, r, t, block, sizes, bench)
        for n, g, r, t in zip(names, coda, ref32, torch_bf16, strict=True)
    ]
    out, dx, dgamma, dw_gate_up, dw_down = _fwd_bwd(packed, packed_inputs, dout)()
    packed_grads = [out, dx, dgamma, dw_gate_up[0::2], dw_gate_up[1::2], dw_down]
    checks += [
        check(f"{n} (packed)", g, r, t, block, sizes, bench)
        for n, g, r, t in zip(names, packed_grads, ref32, torch_bf16, strict=True)
    ]
    row: dict[str, Any] = {"sizes": sizes, "correct": all(c["passed"] for c in checks)}
    row["checks"] = checks
    fwd, fwd_bwd = {}, {"gemms_alone": _six_gemms(sizes, bench)}
    for name, fn in candidates.items():
        row[f"{name}_fwd_ms"] = row[f"{name}_fwd_bwd_ms"] = None
        if fn is None:
            continue
        args = packed_inputs if name == "coda_packed" else inputs
        try:
            fwd[name] = lambda fn=fn, leaves=list(args.values()): fn(*leaves)
            fwd_bwd[name] = _fwd_bwd(fn, args, dout)
            fwd[name](), fwd_bwd[name]()  # a baseline that cannot run is reported, not timed
        except Exception as e:  # noqa: BLE001 - a baseline that fails is reported, not fatal
            if name == "coda":
                raise
            fwd.pop(name, None), fwd_bwd.pop(name, None)
            row[f"{name}_error"] = repr(e)[:500]
    for what, fns in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        for name, ms in bench.compare_runs(fns).items():
            row[f"{name}_{what}_ms"] = statistics.median(ms)
            row[f"{name}_{what}_ms_runs"] = ms
    for name in ("eager", "compile", "liger", "coda_recompute"):
        base = row[f"{name}_fwd_bwd_ms"]
        row[f"coda_speedup_vs_{name}"] = None if base is None else base / row["coda_fwd_bwd_ms"]
    row["coda_over_gemms_alone"] = row["coda_fwd_bwd_ms"] / row["gemms_alone_fwd_bwd_ms"]
    if row["coda_packed_fwd_bwd_ms"] is not None:
        ms = row["coda_packed_fwd_bwd_ms"]
        row["coda_packed_speedup_vs_compile"] = row["compile_fwd_bwd_ms"] / ms
        row["coda_packed_over_gemms_alone"] = ms / row["gemms_alone_fwd_bwd_ms"]
        packed = row["coda_packed_fwd_bwd_ms_runs"]
        for name in ("compile", "liger"):  # the baselines the packed op is to beat, per run
            base = row.get(f"{name}_fwd_bwd_ms_runs")
            if base is not None:
                row[f"coda_packed_speedup_vs_{name}_runs"] = per_run_ratios(base, packed)
        liger = row["liger_fwd_bwd_ms"]
        row["coda_packed_speedup_vs_liger"] = None if liger is None else liger / ms
    return row


def per_run_ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """``numerator / denominator`` of each run: two times from one interleaved comparison."""
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def _spread(ratios: list[float] | None) -> str:
    """A ratio's median with its min–max over the runs (``1.012× (1.004–1.020)``)."""
    if not ratios:
        return "n/a"
    return f"{statistics.median(ratios):.3f}× ({min(ratios):.3f}–{max(ratios):.3f})"


def mlp_section(
    bench: Bench,
    save: Callable[[], None] = lambda: None,
    rows: list | None = None,
    sizes_list: list[dict[str, int]] = MLP_SIZES,
) -> list[dict[str, Any]]:
    """One row per entry of ``sizes_list`` (toy sizes on a dry run); each row also records what
    ran each exported Program's steps at its sizes (``coda.export.kernels_used``: the backend,
    and the CuTe config or kernel tuning pinned)."""
    from coda.export import kernels_used

    rows = [] if rows is None else rows
    for sizes in [{"M": 64, "d": 32, "f": 48}] if bench.dry_run else sizes_list:
        print(f"  llama_mlp fwd+bwd {sizes} ...", flush=True)
        try:
            rows.append(mlp_row(sizes, bench) | {"kernels": kernels_used()})
        except Exception as e:  # noqa: BLE001 - report it with the other numbers
            rows.append({"sizes": sizes, "error": repr(e)[:2000]})
        bench.free()
        save()
    return rows


# -- output ------------------------------------------------------------------------------------
def _f(v: Any, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def tables(kernels: list[dict[str, Any]], mlp: list[dict[str, Any]]) -> str:
    lines = []
    if kernels:
        lines += [
            "| kernel | M=N=K | ok | CODA ms | cuBLAS GEMM ms | CODA / GEMM | compile ms | "
            "compile / GEMM | eager ms | CODA TFLOP/s | graphs: CODA / GEMM ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in kernels:
            if "error" in r:
                lines.append(f"| {r['block']} | {r['sizes']['M']} | ERROR: {r['error'][:80]} |")
                continue
            lines.append(
                f"| {r['block']} | {r['sizes']['M']} | {'yes' if r['correct'] else 'NO'} | "
                f"{_f(r['coda_ms'])} | {_f(r['gemm_ms'])} | {_spread(r['coda_over_gemm_runs'])} | "
                f"{_f(r['compile_ms'])} | {_f(r['compile_over_gemm'])}× | {_f(r['eager_ms'])} | "
                f"{_f(r['coda_tflops'], '.0f')} | "
                f"{_f(r.get('coda_graph_ms'))} / {_f(r.get('gemm_graph_ms'))} |"
            )
    forced = [(r, f) for r in kernels for f in r.get("subtiles", [])]
    if forced:
        lines += ["", *_forced_table(forced)]
    if mlp:
        lines += [
            "",
            "| llama_mlp | ok | GEMMs alone fwd+bwd | CODA fwd / fwd+bwd | CODA, recompute | "
            "CODA, packed gate/up | eager | compile | Liger | CODA vs compile | "
            "packed vs compile (min–max) | packed vs Liger (min–max) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mlp:
            s = r["sizes"]
            where = f"M={s['M']} d={s['d']} f={s['f']}"
            if "error" in r:
                lines.append(f"| {where} | ERROR: {r['error'][:80]} |")
                continue
            pair = lambda k, r=r: f"{_f(r[k + '_fwd_ms'])} / {_f(r[k + '_fwd_bwd_ms'])}"  # noqa: E731
            lines.append(
                f"| {where} | {'yes' if r['correct'] else 'NO'} | "
                f"{_f(r['gemms_alone_fwd_bwd_ms'])} | {pair('coda')} | {pair('coda_recompute')} | "
                f"{pair('coda_packed')} | {pair('eager')} | {pair('compile')} | {pair('liger')} | "
                f"{_f(r['coda_speedup_vs_compile'])}× | "
                f"{_spread(r.get('coda_packed_speedup_vs_compile_runs'))} | "
                f"{_spread(r.get('coda_packed_speedup_vs_liger_runs'))} |"
            )
    return "\n".join(lines)


def _forced_table(forced: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """The kernels again with their epilogues forced to each ``--subtiles`` count."""
    lines = [
        "| kernel | M=N=K | sub-tiles forced | ok | CODA ms | CODA / GEMM | tuned CODA ms | "
        "regs / spills |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, f in forced:
        where = f"| {r['block']} | {r['sizes']['M']} | {f['subtiles']} |"
        if "skipped" in f:
            lines.append(f"{where} n/a: {f['skipped']} |")
            continue
        stats = [f"{s['registers']} / {s['spills']}" for s in f["kernel_stats"].values() if s]
        lines.append(
            f"{where} {'yes' if f['correct'] else 'NO'} | {_f(f['ms'])} | {_f(f['over_gemm'])}× | "
            f"{_f(r['coda_ms'])} | {', '.join(stats)} |"
        )
    return lines


def environment(bench: Bench, argv: list[str] | None) -> dict[str, Any]:
    import torch
    import triton

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *(sys.argv if argv is None else ["bench", *argv])]),
        "device": "cpu (dry run)" if bench.dry_run else torch.cuda.get_device_name(),
        "dtype": str(bench.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dry_run": bench.dry_run,
        **_cute_versions(),
    }


def _cute_versions() -> dict[str, Any]:
    """The fused steps' backend (``CODA_EPILOGUE_BACKEND``) and, where installed, the CuTe DSL's
    and QuACK's versions."""
    from importlib.metadata import PackageNotFoundError, version

    from coda.primitives.settings import current

    out: dict[str, Any] = {"epilogue_backend": current().epilogue_backend}
    for package in ("nvidia-cutlass-dsl", "quack-kernels"):
        with contextlib.suppress(PackageNotFoundError):
            out[package] = version(package)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(NEEDS_GPU, file=sys.stderr)
        return 2
    import coda.primitives  # noqa: F401  (its kernels run in the interpreter without a GPU)

    bench = Bench(
        args.dry_run,
        args.tune,
        recompute=not args.skip_recompute,
        subtiles=args.subtiles,
        runs=args.runs,
    )
    only = [s for s in args.only.split(",") if s]
    print(f"paper kernels and llama_mlp on {environment(bench, argv)['device']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kernels: list[dict[str, Any]] = []
    mlp: list[dict[str, Any]] = []
    result = {"environment": environment(bench, argv), "kernels": kernels, "llama_mlp": mlp}

    def save() -> None:  # after every row: a run cut short by a time limit keeps its numbers
        (out / "paper_kernels.json").write_text(json.dumps(result, indent=2))

    # llama_mlp first: the headline comparison, then the ten kernels
    if not args.skip_mlp:
        mlp_section(bench, save, mlp, args.mlp_sizes)
    if not args.skip_kernels:
        kernel_section(bench, only, save, kernels)
    text = tables(kernels, mlp)
    save()
    note = "\n\nDRY RUN on a CPU: not measurements.\n" if bench.dry_run else "\n"
    header = f"# paper kernels and llama_mlp ({result['environment']['date']})\n\n"
    (out / "paper_kernels.md").write_text(header + text + note)
    print(text + note, flush=True)
    print(f"full numbers: {out / 'paper_kernels.json'}")
    failed = [r for r in [*kernels, *mlp] if "error" in r or not r.get("correct", False)]
    failed += [f for r in kernels for f in r.get("subtiles", []) if f.get("correct") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
