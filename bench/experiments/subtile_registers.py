"""Experiment: registers and spills of the generated kernels per number of epilogue sub-tiles,
without a GPU.

Triton compiles for a GPU it is not running on: given a target (``sm_90``, Hopper) it lowers a
``@triton.jit`` function to PTX and runs its own ``ptxas``, and ``cuobjdump -res-usage`` reads the
registers per thread and the spill stack (bytes of local memory per thread) of the cubin. This
compiles each fused gemm step of the chosen blocks (the ten paper kernels and the backward MLP by
default, at their benchmark sizes) with one tile and each number of epilogue sub-tiles, on this
machine's Triton — which may not be the GPU machine's, so the numbers say which slicing spills,
not by how much it will on the GPU, and nothing about time (``bench/mlp_steps.py --subtiles``
and ``bench/paper_kernels.py --subtiles`` time them).

Not part of the product: a measurement to choose the tuning space's sub-tile candidates.

    python3 bench/experiments/subtile_registers.py [--out DIR] [--blocks a,b] [--subtiles 2,4,8]
        [--tile 128x256x64] [--warps 8] [--stages 3] [--variant tma|pointer]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BLOCKS = (
    "gemm_residual_partial_rmsnorm,gemm_rmsnorm,gemm_swiglu,gemm_rmsnorm_swiglu,gemm_rope,"
    "gemm_rmsnorm_rope,gemm_partial_cross_entropy,gemm_rmsnorm_partial_cross_entropy,"
    "gemm_residual_partial_rmsnorm_bwd,gemm_partial_swiglu_bwd,llama_mlp_bwd_saved"
)
# Blocks without benchmark shapes of their own: the training step's MLP at d = 2048.
MLP_SIZES = {"M": 16384, "d": 2048, "f": 8192}
TARGET = ("cuda", 90, 32)  # Hopper (an H100 / H200), 32 threads per warp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument("--blocks", default=BLOCKS, help="comma-separated blocks")
    p.add_argument("--subtiles", default="2,4,8", help="epilogue sub-tile counts to compile")
    p.add_argument("--tile", default="128x256x64", help="block_m x block_n x block_k")
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--variant", choices=["tma", "pointer"], default="tma", help="kernel variant")
    return p.parse_args(argv)


def _sizes(block: Any) -> dict[str, int]:
    shapes = getattr(block, "shapes", None)
    return dict(shapes.bench[0]) if shapes is not None and shapes.bench else dict(MLP_SIZES)


def _signature(variant: Any, info: Any, blocks: dict[str, int]) -> dict[str, str]:
    """Triton's type of every runtime parameter of a kernel variant: fp32 pointers for partials
    and float32 tensors, int64 for indices, bf16 for the rest (the benchmark's dtype); descriptors
    with their blocks."""
    sig = {}
    for p in variant.params:
        t = info.tensors.get(p.tensor) if p.tensor else None
        dtype = "fp32" if t is not None and (t.partials or t.dtype == "float32") else "bf16"
        if p.tensor and t is not None and t.dtype == "int64":
            dtype = "i64"
        if p.kind == "ptr":
            sig[p.name] = f"*{dtype}"
        elif p.kind == "desc":
            rows, cols = (blocks[b] for b in p.block)
            sig[p.name] = f"tensordesc<{dtype}[{rows}, {cols}]>"
        else:
            sig[p.name] = "i32"
    return sig


def _load(source: str, function: str, folder: Path) -> Any:
    """The kernel ``function`` of a generated module as a compilable ``JITFunction`` (Triton reads
    a function's source from its file)."""
    path = folder / f"m{abs(hash(source))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, function)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers per thread and spill stack bytes of a cubin, as ``cuobjdump -res-usage`` says."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {text[:300]!r}")
    return {"registers": int(match[1]), "spill_stack_bytes": int(match[2])}


def compile_step(
    kernel: Any, info: Any, variant: str, config: dict[str, int], folder: Path
) -> dict[str, Any]:
    """Compile one generated kernel variant for ``TARGET`` under ``config``; its registers, spill
    stack and shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget

    v = kernel.variants[variant]
    epi_n = config["block_n"] // config["subtiles"]
    blocks = {
        "BLOCK_SIZE_M": config["block_m"],
        "BLOCK_SIZE_N": config["block_n"],
        "BLOCK_SIZE_K": config["block_k"],
        "EPI_N": epi_n,
        "EPI_N//2": epi_n // 2,
        "EPI_N*2": epi_n * 2,
    }
    sig = _signature(v, info, blocks)
    meta = {
        "BLOCK_SIZE_M": config["block_m"],
        "BLOCK_SIZE_N": config["block_n"],
        "BLOCK_SIZE_K": config["block_k"],
        "GROUP_SIZE_M": 8,
        "NUM_PROGRAMS": 132,
        "INPUT_PRECISION": "tf32",
        "EPILOGUE_SUBTILES": config["subtiles"],
        "EPI_N": epi_n,
        "FLATTEN": False,
        "WARP_SPECIALIZE": False,
    }
    constants = {}
    for name, value in meta.items():
        sig[name] = "constexpr"
        constants[(list(sig).index(name),)] = value
    fn = _load(kernel.source, v.function, folder)
    compiled = triton.compile(
        triton.compiler.ASTSource(fn, sig, constants),
        target=GPUTarget(*TARGET),
        options={"num_warps": config["warps"], "num_stages": config["stages"]},
    )
    return {**resource_usage(compiled.asm["cubin"]), "shared_bytes": compiled.metadata.shared}


def block_rows(name: str, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    from coda.blocks import get_block
    from coda.planner import lower
    from coda.primitives import analyze, compile_program

    block = get_block(name)
    program = lower(block)
    info = analyze(program, _sizes(block))
    compiled = compile_program(program, info)
    bm, bn, bk = (int(v) for v in args.tile.split("x"))
    rows = []
    for step, kernel in compiled.kernels.items():
        for subtiles in (int(s) for s in args.subtiles.split(",")):
            config = {"block_m": bm, "block_n": bn, "block_k": bk, "subtiles": subtiles}
            config |= {"warps": args.warps, "stages": args.stages}
            row: dict[str, Any] = {"block": name, "step": step, **config}
            if bn // subtiles < 16 or (bn // subtiles) % info.gemms[step].column_multiple:
                row["error"] = "sub-tiles too narrow (under 16 columns, or not whole segments)"
            else:
                try:
                    row |= compile_step(kernel, info, args.variant, config, folder)
                except Exception as e:  # noqa: BLE001 - one failing compile must not hide the rest
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"  {name} {step} {subtiles}: {row}", flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| block | step | tile | sub-tiles | registers | spill stack B | shared B |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tile = f"{r['block_m']}×{r['block_n']}×{r['block_k']}, {r['warps']}w {r['stages']}s"
        where = f"| {r['block']} | {r['step']} | {tile} | {r['subtiles']} |"
        if "error" in r:
            lines.append(f"{where} {r['error'][:80]} | | |")
        else:
            stack, shared = r["spill_stack_bytes"], r["shared_bytes"]
            lines.append(f"{where} {r['registers']} | {stack} | {shared} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import triton

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.blocks.split(","):
            rows += block_rows(name, args, Path(folder))
            (out / "subtile_registers.json").write_text(json.dumps(rows, indent=2))
    text = f"Triton {triton.__version__}, sm_{TARGET[1]}, variant {args.variant}\n\n{table(rows)}"
    (out / "subtile_registers.md").write_text(text + "\n")
    print(text)
    return 1 if any("error" in r and "too narrow" not in r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
