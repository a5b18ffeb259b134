"""Hopper speed, side by side in one run: the generated mainloop against cuBLAS, GEMM +
SwiGLU fused against cuBLAS, and ``llama_mlp`` forward against cuBLAS GEMMs alone, eager PyTorch,
``torch.compile`` and Liger.

Run on the GPU machine (see docs/gpu.md), bf16::

    python bench/llama_mlp.py [--quick] [--out DIR]

Prints tables; writes ``llama_mlp.json`` (every number, every tuning trial) and ``llama_mlp.md``
into ``--out`` (default ``$OUT`` or ``bench/out``). Every timed output is also checked for
correctness in the same run (relative error against an fp32 reference). Fails fast without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import Program, analyze, compile_program
from coda.primitives.codegen.tuning import tune_program
from coda.primitives.timing import interleaved_ms
from coda.sandbox.profiling import profile_shape, relative_error

# (M, N, K): square problems, then the four GEMMs of llama_mlp at the two benchmark shapes
# (gate+up interleaved: N = 2f; down: K = f).
MAINLOOP_SHAPES = [
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 16384, 2048),
    (16384, 2048, 8192),
    (16384, 28672, 4096),
    (16384, 4096, 14336),
]
LLAMA = [{"M": 16384, "d": 2048, "f": 8192}, {"M": 16384, "d": 4096, "f": 14336}]
GLU_SHAPES = [(8192, 8192, 8192), (16384, 16384, 2048)]  # (M, N, K); N counts gate+up columns
QUICK_SPACE = [
    (128, 256, 64, 8, 3, 2, False, False),
    (128, 128, 64, 8, 4, 2, True, True),
    (128, 256, 64, 8, 3, 2, True, True),
    (128, 256, 64, 8, 4, 2, False, False),
]


def gemm_program(epilogue: list[dict], out_cols: str = "N") -> Program:
    """``x [M, K] @ w [N, K]ᵀ`` then ``epilogue``; the output is ``y``."""
    return Program.parse(
        {
            "block": "bench",
            "inputs": {"x": ["M", "K"], "w": ["N", "K"]},
            "steps": [{"kind": "gemm", "name": "gemm", "a": "x", "b": "w.T", "epilogue": epilogue}],
            "outputs": {"y": "y"},
        }
    )


PLAIN = [{"op": "store", "src": "acc", "to": "y"}]
GLU = [{"op": "swiglu", "src": "acc", "out": "a"}, {"op": "store", "src": "a", "to": "y"}]


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def compiled_gemm(epilogue: list[dict], x: torch.Tensor, w: torch.Tensor, space):  # noqa: ANN001
    program = gemm_program(epilogue)
    sizes = {"M": x.shape[0], "N": w.shape[0], "K": x.shape[1]}
    compiled = compile_program(program, analyze(program, sizes), use_vendor=False)
    compiled.epilogue_backend = "triton"  # the Triton mainloop is what this benchmark measures
    prepared = compiled.prepare({"x": x, "w": w})
    tuning = tune_program(compiled, prepared, space=space)
    return compiled, prepared, tuning


ROUNDS = 5  # interleaved rounds per comparison (coda.primitives.timing)


def bench_mainloop(m: int, n: int, k: int, space) -> dict:  # noqa: ANN001
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    compiled, prepared, tuning = compiled_gemm(PLAIN, x, w, space)
    t = interleaved_ms(
        {"ours": lambda: compiled.run(prepared), "cublas": lambda: torch.matmul(x, w.T)},
        rounds=ROUNDS,
    )
    err = relative_error(compiled.run(prepared)["y"], x.float() @ w.float().T)
    return {
        "shape": f"M={m} N={n} K={k}",
        "triton_ms": t["ours"],
        "cublas_ms": t["cublas"],
        "triton_tflops": tflops(m, n, k, t["ours"]),
        "cublas_tflops": tflops(m, n, k, t["cublas"]),
        "ratio": t["ours"] / t["cublas"],
        "rel_err": err,
        "mainloop": compiled.mainloops_used["gemm"],
        "kernel_stats": compiled.kernel_stats.get("gemm", {}),
        "config": tuning["gemm"].best.model_dump(),
        "trials": _trials(tuning["gemm"]),
    }


def bench_glu(m: int, n: int, k: int, space) -> dict:  # noqa: ANN001
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    compiled, prepared, tuning = compiled_gemm(GLU, x, w, space)
    glu = torch.compile(lambda z: torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2])
    glu(torch.matmul(x, w.T))
    t = interleaved_ms(
        {
            "fused": lambda: compiled.run(prepared),
            "gemm": lambda: torch.matmul(x, w.T),
            "gemm_glu": lambda: glu(torch.matmul(x, w.T)),
        },
        rounds=ROUNDS,
    )
    z = x.float() @ w.float().T
    want = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    err = relative_error(compiled.run(prepared)["y"], want)
    return {
        "shape": f"M={m} N={n} K={k}",
        "fused_ms": t["fused"],
        "cublas_gemm_ms": t["gemm"],
        "cublas_plus_compiled_swiglu_ms": t["gemm_glu"],
        "ratio_to_gemm": t["fused"] / t["gemm"],
        "speedup_vs_unfused": t["gemm_glu"] / t["fused"],
        "rel_err": err,
        "kernel_stats": compiled.kernel_stats.get("gemm", {}),
        "config": tuning["gemm"].best.model_dump(),
        "trials": _trials(tuning["gemm"]),
    }


def liger_mlp(eps: float):  # noqa: ANN201
    """Liger's RMSNorm and SiLU·mul kernels around cuBLAS GEMMs (None if the wheel is absent)."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:  # noqa: BLE001 - the wheel is optional
        return None

    def run(t: dict[str, torch.Tensor]) -> torch.Tensor:
        h = LigerRMSNormFunction.apply(t["x"], t["gamma"], eps, 0.0, "llama", False)
        g, u = torch.matmul(h, t["w_gate"].T), torch.matmul(h, t["w_up"].T)
        return t["x"] + torch.matmul(LigerSiLUMulFunction.apply(g, u), t["w_down"].T)

    return run


def bench_llama(sizes: dict[str, int], space) -> dict:  # noqa: ANN001
    block = get_block("llama_mlp")
    program = lower(block)
    compiled = compile_program(program, analyze(program, sizes))
    inputs = block.make_inputs(sizes, torch.bfloat16, seed=0, device="cuda")
    if space is not None:  # --quick: tune over the small space before profiling
        tune_program(compiled, compiled.prepare(inputs), space=space)
    liger = liger_mlp(block.graph[0].eps)
    extra = {"liger": liger} if liger is not None else {}
    row = profile_shape(
        compiled, block, sizes, torch.bfloat16, tune=space is None, space="full", extra=extra
    )
    liger_err = None
    if liger is not None:
        ref = block.reference({n: v.float() for n, v in inputs.items()})["out"]
        liger_err = relative_error(liger(inputs), ref)
    return {
        "sizes": sizes,
        **row.model_dump(),
        "ratio_to_gemms": row.ratio_to_gemms,
        "liger_ms": row.baselines_ms.get("liger"),
        "liger_rel_err": liger_err,
    }


def _trials(result) -> list[dict]:  # noqa: ANN001
    return [t.as_dict() for t in result.trials]


def tables(results: dict) -> str:
    lines = [
        "## Triton mainloop vs cuBLAS (bf16, plain GEMM, tuned)",
        "",
        "| shape | Triton TFLOP/s | cuBLAS TFLOP/s | Triton / cuBLAS time | rel err |",
        "|---|---|---|---|---|",
    ]
    for r in results["mainloop"]:
        lines.append(
            f"| {r['shape']} | {r['triton_tflops']:.0f} | {r['cublas_tflops']:.0f} | "
            f"{r['ratio']:.3f} | {r['rel_err']:.1e} |"
        )
    lines += [
        "",
        "## GEMM + SwiGLU fused vs cuBLAS GEMM alone (bf16)",
        "",
        "| shape | fused ms | cuBLAS GEMM ms | cuBLAS + compiled SwiGLU ms | fused / GEMM | "
        "rel err |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["glu"]:
        lines.append(
            f"| {r['shape']} | {r['fused_ms']:.3f} | {r['cublas_gemm_ms']:.3f} | "
            f"{r['cublas_plus_compiled_swiglu_ms']:.3f} | {r['ratio_to_gemm']:.3f} | "
            f"{r['rel_err']:.1e} |"
        )
    lines += [
        "",
        "## llama_mlp forward (bf16, ms, median)",
        "",
        "| M, d, f | GEMMs alone | eager | torch.compile | Liger | coda-agent | coda / GEMMs "
        "| coda TFLOP/s | rel err (coda / eager) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["llama"]:
        s = r["sizes"]
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(
            f"| {s['M']}, {s['d']}, {s['f']} | {r['gemms_ms']:.3f} | {fmt(r['eager_ms'])} "
            f"| {fmt(r['compile_ms'])} | {fmt(r['liger_ms'])} | {r['program_ms']:.3f} | "
            f"{r['ratio_to_gemms']:.3f} | {r['tflops']:.0f} | {r['rel_err']:.1e} / "
            f"{r['eager_rel_err']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 tuning candidates, not 13")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/llama_mlp.py needs a CUDA GPU (see docs/gpu.md)", file=sys.stderr)
        return 2
    space = QUICK_SPACE if args.quick else None
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "env": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": version("triton"),
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python", *sys.argv]),
            "quick": args.quick,
        },
        "mainloop": [],
        "glu": [],
        "llama": [],
    }
    sections = [
        ("mainloop", lambda s: bench_mainloop(*s, space), MAINLOOP_SHAPES),
        ("glu", lambda s: bench_glu(*s, space), GLU_SHAPES),
        ("llama", lambda s: bench_llama(s, space), LLAMA),
    ]
    for section, run, shapes in sections:
        for shape in shapes:
            results[section].append(run(shape))
            # written as it goes: a run cut short by a time limit still leaves its numbers
            (out / "llama_mlp.json").write_text(json.dumps(results, indent=1, default=str))
    results["env"]["seconds"] = round(time.time() - start, 1)
    (out / "llama_mlp.json").write_text(json.dumps(results, indent=1, default=str))
    text = tables(results)
    (out / "llama_mlp.md").write_text(text)
    print(json.dumps(results["env"]))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
