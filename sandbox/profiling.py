"""GPU timings for the profile stage: the program side by side with its baselines, in one run.

Baselines at the same shapes and dtype: the block's matrix products alone on cuBLAS (the speed of
light of a GEMM-epilogue program), the block's PyTorch reference run eagerly, and the same reference
under ``torch.compile``. Times are medians of ``triton.testing.do_bench`` (which flushes L2 between
runs); prep (weight layouts) is done once before timing, as it is in use.
"""

from __future__ import annotations

import torch
import triton

from coda.blocks.block import Block
from coda.primitives.runtime import CompiledProgram

from .report import ProfileRow


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:  # noqa: ANN001
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def gemms_alone(block: Block, sizes: dict[str, int], dtype: torch.dtype):  # noqa: ANN201
    """A closure running each matrix product of the block as one cuBLAS matmul on random data."""
    pairs = []
    for m, n, k in block.matmuls(sizes):
        a = torch.randn((m, k), device="cuda", dtype=dtype)
        b = torch.randn((n, k), device="cuda", dtype=dtype)
        pairs.append((a, b))

    def run() -> None:
        for a, b in pairs:
            torch.matmul(a, b.T)

    return run


def profile_shape(
    compiled: CompiledProgram, block: Block, sizes: dict[str, int], dtype: torch.dtype
) -> ProfileRow:
    inputs = block.make_inputs(sizes, dtype, seed=0, device="cuda")
    prepared = compiled.prepare(inputs)
    program_ms = median_ms(lambda: compiled.run(prepared))
    gemms_ms = median_ms(gemms_alone(block, sizes, dtype))
    eager_ms = median_ms(lambda: block.reference(inputs))
    compile_ms = None
    try:
        ref = torch.compile(lambda: block.reference(inputs))
        ref()
        compile_ms = median_ms(ref)
    except Exception:  # noqa: BLE001 - a compile failure is a missing baseline, not a failure
        compile_ms = None
    info = compiled.info_for(inputs)
    configs = {n: c.model_dump() for n, c in compiled.configs_for(info).items()}
    return ProfileRow(
        sizes=sizes,
        dtype=str(dtype).removeprefix("torch."),
        program_ms=program_ms,
        gemms_ms=gemms_ms,
        eager_ms=eager_ms,
        compile_ms=compile_ms,
        tflops=block.flops(sizes) / (program_ms * 1e-3) / 1e12,
        configs=configs,
    )
