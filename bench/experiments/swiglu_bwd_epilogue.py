"""Experiment: what makes the SwiGLU-backward epilogue (`llama_mlp_bwd_saved` `down_bwd`) slow?

Times the generated ``down_bwd`` kernel at M = 16384, d = 2048, f = 8192 (bf16, one fixed config)
against hand-patched copies of its source, each removing or changing one part of the epilogue:

* ``strided_dz``: dg and du stored straight into dz's even/odd columns (two strided stores)
  instead of ``tl.join`` + ``tl.reshape`` into one interleaved tile (a layout conversion);
* ``no_zdz``: without the partial row sums of ``g·dg + u·du`` (timing only);
* ``no_dz``: without the store of dz (timing only);
* ``no_loads``: g and u made from the accumulator instead of loaded (timing only): what the two
  tile loads cost;
* ``prefetch``: g and u loaded *before* the K loop (a helper issues the loads, the epilogue gets
  the tiles), so their latency overlaps the tile's mainloop — the candidate fix;

next to the cuBLAS GEMM of the same shape. ``strided_dz`` and ``prefetch`` are checked against
the original. (The forward now saves a = silu(g)·u, so the kernel no longer stores it; the
2026-11-30 RESULTS row "without the store of a" was measured before that change.) Not part of the
product: a
measurement to decide what to change in the codegen; the patches assume one epilogue sub-tile or
two (``EPILOGUE_SUBTILES`` ≤ 2), as the config below has.

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
ZDZ_STORE = re.compile(r"\n\s*if start_n < N:\n\s*tl\.store\(zdz_partials_ptr.*")
LOAD = re.compile(r"\n(\s*)({t}_tile) = tl\.load\((.*)\)\.to\(tl\.float32\)")
K_LOOP = re.compile(r"\n(\s*)for ki in range\(0, k_tiles\):")
EPILOGUE_CALL = re.compile(r"_down_bwd_epilogue\(acc(\d), pid_m, ([^,]+),")
EPILOGUE_DEF = "def _down_bwd_epilogue(\n    accumulator, pid_m, start_n,"
PRELUDE = re.compile(r"(    # This sub-tile:.*?\n)(    # --- load_tile)", re.S)
PREFETCH_ARGS = (
    "g_ptr, u_ptr, M, N, stride_g_m, stride_g_n, stride_u_m, stride_u_n, BLOCK_SIZE_M, EPI_N"
)


def no_loads(source: str) -> str:
    """g and u from the accumulator (data-dependent, so nothing folds away) instead of loads."""
    out = LOAD.pattern.format(t="g")
    source = re.sub(out, r"\n\1\2 = accumulator * 0.5 + 1.0", source, count=1)
    return re.sub(LOAD.pattern.format(t="u"), r"\n\1\2 = accumulator * 0.25 - 1.0", source, count=1)


def prefetch(source: str) -> str:
    """Loads of g and u issued before the K loop by ``_down_bwd_prefetch``, passed in."""
    prelude = PRELUDE.search(source)
    g, u = (re.search(LOAD.pattern.format(t=t), source) for t in ("g", "u"))
    assert prelude and g and u, "the epilogue's layout changed: update the patch"
    helper = (
        "@triton.jit\ndef _down_bwd_prefetch(\n    pid_m, start_n, g_ptr, u_ptr, M, N, stride_g_m,"
        " stride_g_n, stride_u_m, stride_u_n,\n    BLOCK_SIZE_M: tl.constexpr, EPI_N: tl.constexpr,"
        "\n):\n"
        + prelude.group(1)
        + f"    g_raw = tl.load({g.group(3)})\n    u_raw = tl.load({u.group(3)})\n"
        "    return g_raw, u_raw\n\n\n"
    )
    source = source.replace("@triton.jit\n" + EPILOGUE_DEF, helper + "@triton.jit\n" + EPILOGUE_DEF)
    source = source.replace(EPILOGUE_DEF, EPILOGUE_DEF + " g_pre, u_pre,")
    source = re.sub(LOAD.pattern.format(t="g"), r"\n\1\2 = g_pre.to(tl.float32)", source, count=1)
    source = re.sub(LOAD.pattern.format(t="u"), r"\n\1\2 = u_pre.to(tl.float32)", source, count=1)

    def issue(match: re.Match) -> str:
        pad = match.group(1)
        call = "_down_bwd_prefetch(pid_m, {start}, " + PREFETCH_ARGS + ")"
        return (
            f"\n{pad}pre_n = pid_n * BLOCK_SIZE_N"
            f"\n{pad}g_pre0, u_pre0 = "
            + call.format(start="pre_n")
            + f"\n{pad}if EPILOGUE_SUBTILES > 1:"
            f"\n{pad}    g_pre1, u_pre1 = " + call.format(start="pre_n + EPI_N") + match.group(0)
        )

    source = K_LOOP.sub(issue, source)
    return EPILOGUE_CALL.sub(r"_down_bwd_epilogue(acc\1, pid_m, \2, g_pre\1, u_pre\1,", source)


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
    out["no_zdz"] = ZDZ_STORE.sub("", source, count=1)
    out["no_dz"] = DZ_STORE.sub("", base, count=1)
    out["no_loads"] = no_loads(source)
    out["prefetch"] = prefetch(source)
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
    same = {
        name: bool(torch.equal(outputs[name], outputs["original"]))
        for name in ("strided_dz", "prefetch")
    }
    result = {"sizes": sizes, "config": config.model_dump(), "ms": ms, "equal_to_original": same}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "swiglu_bwd_epilogue.json").write_text(json.dumps(result, indent=2))
    for name, t in ms.items():
        print(f"{name:12s} {t:.3f} ms  ({t / ms['cublas']:.2f}× cuBLAS)")
    print(f"outputs identical to the original: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
