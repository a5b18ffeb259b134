"""Experiment: what makes the SwiGLU-backward epilogue (`llama_mlp_bwd_saved` `down_bwd`) slow?

Times the generated ``down_bwd`` kernel at M = 16384, d = 2048, f = 8192 (bf16, one fixed config)
against hand-patched copies of its source, each removing or changing one part of the epilogue:

* ``strided_dz``: dg and du stored straight into dz's even/odd columns (two strided stores)
  instead of ``tl.join`` + ``tl.reshape`` into one interleaved tile (a layout conversion);
* ``no_a``: without the store of ``a = silu(g)·u`` (wrong output: timing only);
* ``no_zdz``: without the partial row sums of ``g·dg + u·du`` (timing only);
* ``no_dz``: without the store of dz (timing only);

next to the cuBLAS GEMM of the same shape. ``strided_dz`` is checked against the original.
Not part of the product: a measurement to decide what to change in the codegen.

    python3 bench/experiments/swiglu_bwd_epilogue.py [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

JOIN = re.compile(r"\n\s*v_dz = tl\.reshape\(tl\.join\(v_dg, v_du\).*")
DZ_STORE = re.compile(r"\n(\s*)dz_ptrs = .*\n\s*tl\.store\(dz_ptrs, .*")
A_STORE = re.compile(r"\n\s*tl\.store\(a_tensor_ptrs, .*")
ZDZ_STORE = re.compile(r"\n\s*if start_n < N:\n\s*tl\.store\(zdz_partials_ptr.*")


def strided(match: re.Match) -> str:
    pad = match.group(1)
    mask = "mask=mask_cm[:, None] & mask_cn[None, :]"
    return (
        f"\n{pad}dz_ptrs = dz_ptr + offs_cm64[:, None] * stride_dz_m"
        f" + (2 * offs_cn)[None, :] * stride_dz_n"
        f"\n{pad}tl.store(dz_ptrs, v_dg.to(dz_ptr.dtype.element_ty), {mask})"
        f"\n{pad}tl.store(dz_ptrs + stride_dz_n, v_du.to(dz_ptr.dtype.element_ty), {mask})"
    )


def variants(source: str) -> dict[str, str]:
    base = JOIN.sub("", source, count=1)
    assert base != source, "the join line was not found"
    out = {"original": source, "strided_dz": DZ_STORE.sub(strided, base, count=1)}
    out["no_a"] = A_STORE.sub("", source, count=1)
    out["no_zdz"] = ZDZ_STORE.sub("", source, count=1)
    out["no_dz"] = DZ_STORE.sub("", base, count=1)
    for name, text in out.items():
        assert name == "original" or text != source, f"{name}: nothing was patched"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    args = p.parse_args(argv)
    import torch

    from coda.agent.planner import lower
    from coda.blocks import get_block
    from coda.primitives import analyze, compile_program
    from coda.primitives.ir import MainloopConfig
    from coda.primitives.timing import interleaved_ms

    sizes = {"M": 16384, "d": 2048, "f": 8192}
    block = get_block("llama_mlp_bwd_saved")
    program = lower(block)
    inputs = block.make_inputs(sizes, torch.bfloat16, seed=0, device="cuda")
    config = MainloopConfig(
        block_m=128,
        block_n=128,
        block_k=64,
        group_m=8,
        num_warps=8,
        num_stages=4,
        epilogue_subtiles=2,
    )  # the config tuning chose for this step (bench/mlp_steps.py)
    runs, outputs = {}, {}
    first = compile_program(program, analyze(program, sizes))
    texts = variants(first.kernels["down_bwd"].source)
    for name, text in texts.items():
        compiled = compile_program(program, analyze(program, sizes))
        compiled.configs["down_bwd"] = config
        compiled.kernels["down_bwd"] = dataclasses.replace(
            compiled.kernels["down_bwd"], source=text
        )
        tensors = compiled.run(compiled.prepare(inputs))
        outputs[name] = tensors["dz"].clone()
        runs[name] = lambda c=compiled, t=tensors: c.run_gemm_step("down_bwd", t)
    a = torch.randn((16384, 2048), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((2048, 8192), device="cuda", dtype=torch.bfloat16)
    runs["cublas"] = lambda: torch.matmul(a, b)
    ms = interleaved_ms(runs, rounds=3, warmup=10, rep=50)
    same = bool(torch.equal(outputs["strided_dz"], outputs["original"]))
    result = {"sizes": sizes, "config": config.model_dump(), "ms": ms, "strided_dz_equal": same}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "swiglu_bwd_epilogue.json").write_text(json.dumps(result, indent=2))
    for name, t in ms.items():
        print(f"{name:12s} {t:.3f} ms  ({t / ms['cublas']:.2f}× cuBLAS)")
    print(f"strided_dz output identical to the original: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
