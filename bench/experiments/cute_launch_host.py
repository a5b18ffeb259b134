"""Experiment: the host's Python work per CuTe launch, on a CPU.

A replayed CuTe step (``cute.launch.CuteLaunch``) builds QuACK's arguments from the call's
tensors — views in QuACK's ``(rows, cols, L)`` shapes, the epilogue's argument tuple, the bounds
as the DSL's ``Int32`` — and calls the compiled kernel. This script times that Python work with
the kernel call itself replaced by a no-op (the compile is skipped too; the generated module is
still imported): the launches of ``llama_mlp_bwd_saved``'s two steps, the minimum over
``--rounds`` rounds of ``--launches`` launches each. The TVM-FFI call into the kernel is not
included; its cost needs a GPU.

Needs the CuTe DSL and QuACK importable (docs/gpu.md; no GPU: ``CUTE_DSL_ARCH=sm_90a``). Not
product code.

    python3 bench/experiments/cute_launch_host.py [--launches 3000] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"M": 256, "d": 128, "f": 256}


def stub_the_kernels() -> None:
    """The backend made available on a CPU, every compile a no-op kernel (module imported)."""
    from coda.primitives import cute
    from coda.primitives.cute import launch

    cute.unavailable_reason = lambda device=None: None
    launch._compile = lambda source, args, config: (launch._module(source), lambda *a: None)[1]
    launch._scheduler = lambda device_index, cluster_size: None


def launches() -> dict:
    """Each CuTe step of ``llama_mlp_bwd_saved`` as a zero-argument replay of its launch."""
    import torch

    from coda.blocks import get_block
    from coda.primitives import analyze, compile_program
    from coda.primitives.ir import Program

    data = json.loads((ROOT / "export" / "programs" / "llama_mlp_bwd_saved.json").read_text())
    program = Program.model_validate(data["program"])
    block = get_block(program.block)
    inputs = block.make_inputs(SIZES, torch.float16, seed=0, device="cpu")
    compiled = compile_program(program, analyze(program, SIZES))
    compiled.epilogue_backend = "cute"
    tensors = compiled.run(compiled.prepare(inputs))
    steps = [n for n, m in compiled.mainloops_used.items() if m == "cute"]
    return {name: compiled.step_launch(name, tensors) for name in steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    stub_the_kernels()
    result = {}
    for name, launch in launches().items():
        for _ in range(100):
            launch()
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.launches):
                launch()
            best = min(best, (time.perf_counter() - start) / args.launches * 1e6)
        result[name] = best
        print(f"{name}: {best:.1f} µs of Python per launch", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
