"""Check: the SwiGLU-backward paper kernel on the CuTe backend with each output tile forced
(128 × 192 and 128 × 128), at a ragged shape and at 8192³, against the block's float32 reference
— largest error relative to the largest reference magnitude, and elements never written (outputs
pre-filled with NaN). Needs a Hopper GPU with the CuTe DSL and QuACK. Not product code.

    python3 bench/experiments/cute_tile_check.py
"""

from __future__ import annotations

import torch

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import analyze, compile_program
from coda.primitives.cute import launch

TILES = [(128, 192), (128, 128)]
SHAPES = [(1000, 1024, 1000), (8192, 8192, 8192)]


def check(tile: tuple[int, int], m: int, n: int, k: int) -> str:
    launch.choose_config = lambda gemm: launch.CuteConfig(*tile)  # forced for this check only
    block = get_block("gemm_partial_swiglu_bwd")
    sizes = {"M": m, "N": n, "K": k, "N2": 2 * n}
    program = lower(block)
    compiled = compile_program(program, analyze(program, sizes))
    compiled.epilogue_backend = "cute"
    inputs = block.make_inputs(sizes, torch.bfloat16, seed=1, device="cuda")
    out = program.select_outputs(compiled.run(compiled.prepare(inputs), poison=True), sizes)
    torch.cuda.synchronize()
    ref = block.reference({name: v.float() for name, v in inputs.items()})
    err = {o: float((out[o].float() - ref[o]).abs().max() / ref[o].abs().max()) for o in ref}
    nan = {o: int(out[o].isnan().sum()) for o in block.outputs}
    return f"tile {tile} shape {(m, n, k)} {compiled.mainloops_used} err {err} nan {nan}"


if __name__ == "__main__":
    for tile in TILES:
        for shape in SHAPES:
            print(check(tile, *shape), flush=True)
