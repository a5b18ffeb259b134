"""Experiment: what makes the SwiGLU-backward epilogue (`llama_mlp_bwd_saved` `down_bwd`) slow?

Times the generated ``down_bwd`` kernel at M = 16384, d = 2048, f = 8192 (bf16, one fixed config)
against hand-patched copies of its source, each removing or changing one part of the epilogue:

* ``strided_dz``: dg and du stored straight into dz's even/odd columns (two strided stores)
  instead of ``tl.join`` + ``tl.reshape`` into one interleaved tile (a layout conversion);
* ``no_zdz``: without the partial row sums of ``g·dg + u·du`` (timing only);
* ``no_dz``: without the store of dz (timing only);
* ``no_loads``: g and u made from the accumulator instead of loaded (timing only): what the two
  tile loads cost;
* ``acc_only``: the epilogue is one store of the accumulator (what the same mainloop costs as a
  plain GEMM: the floor any epilogue work starts from);
* ``tma_epilogue``: the unpatched module's Hopper kernel, whose epilogue moves g, u and dz as TMA
  tiles (the patches above all run the pointer epilogue behind the same TMA mainloop);

next to the cuBLAS GEMM of the same shape. ``--sweep`` repeats ``original``, ``no_loads``,
``acc_only`` and ``tma_epilogue`` over several configs (``--per-sm 1,2``: also
persistent grids of 2 programs per SM, so one program's epilogue may overlap another's mainloop
where registers and shared memory allow two), with registers and spills. ``strided_dz``
and ``tma_epilogue`` are checked against the original. (The forward now saves
a = silu(g)·u, so the kernel no longer stores it; the 2026-11-30 RESULTS row "without the store
of a" was measured before that change.) Not part of the product: a measurement to decide what to
change in the codegen. (A ``prefetch`` variant — g and u loaded before the K loop — patched the
split-accumulator kernels that codegen v6 no longer generates; its RESULTS rows are reproduced by
this script at commit 8904dc0.)

    python3 bench/experiments/swiglu_bwd_epilogue.py [--out DIR] [--sweep]
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
ZDZ_STORE = re.compile(r"\n\s*tl\.store\(zdz_partials_ptr.*")
LOAD = re.compile(r"\n(\s*)({t}_tile) = tl\.load\((.*)\)\.to\(tl\.float32\)")
EPILOGUE_BODY = re.compile(r"(\n    # --- load_tile\(tensor='g'.*?)\n\n\n@triton\.jit", re.S)


def no_loads(source: str) -> str:
    """g and u from the accumulator (data-dependent, so nothing folds away) instead of loads."""
    out = LOAD.pattern.format(t="g")
    source = re.sub(out, r"\n\1\2 = accumulator * 0.5 + 1.0", source, count=1)
    return re.sub(LOAD.pattern.format(t="u"), r"\n\1\2 = accumulator * 0.25 - 1.0", source, count=1)


def acc_only(source: str) -> str:
    """The epilogue reduced to storing the accumulator into dz's first N columns."""
    store = (
        "\n    dz_ptrs = dz_ptr + offs_cm64[:, None] * stride_dz_m + offs_cn[None, :] * stride_dz_n"
        "\n    tl.store(dz_ptrs, accumulator.to(dz_ptr.dtype.element_ty),"
        " mask=mask_cm[:, None] & mask_cn[None, :])"
    )
    return EPILOGUE_BODY.sub(lambda m: store + "\n\n\n@triton.jit", source, count=1)


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
    out["acc_only"] = acc_only(source)
    for name, text in out.items():
        assert name == "original" or text != source, f"{name}: nothing was patched"
    return out


CONFIGS = {  # name: (block_m, block_n, num_warps, num_stages, epilogue_subtiles)
    "128x128 S2 w8": (128, 128, 8, 4, 2),  # what tuning chose for this step (bench/mlp_steps.py)
    "128x128 S1 w8": (128, 128, 8, 4, 1),
    "128x64 S1 w4": (128, 64, 4, 4, 1),
    "64x128 S1 w4": (64, 128, 4, 4, 1),
    "128x256 S4 w8": (128, 256, 8, 3, 4),
}


def config_of(name: str):  # noqa: ANN201
    from coda.primitives.ir import MainloopConfig

    bm, bn, warps, stages, subtiles = CONFIGS[name]
    return MainloopConfig(
        block_m=bm,
        block_n=bn,
        block_k=64,
        group_m=8,
        num_warps=warps,
        num_stages=stages,
        epilogue_subtiles=subtiles,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    p.add_argument("--sweep", action="store_true", help="every config, not only tuning's choice")
    p.add_argument("--per-sm", default="1", help="persistent programs per SM to try, e.g. 1,2")
    args = p.parse_args(argv)
    import torch

    from coda.blocks import get_block
    from coda.planner import lower
    from coda.primitives import analyze, compile_program, runtime
    from coda.primitives.timing import interleaved_ms

    sizes = {"M": 16384, "d": 2048, "f": 8192}
    block = get_block("llama_mlp_bwd_saved")
    program = lower(block)
    inputs = block.make_inputs(sizes, torch.bfloat16, seed=0, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    texts = variants(compile_program(program, analyze(program, sizes)).kernels["down_bwd"].source)
    texts["tma_epilogue"] = texts["original"]  # launched as the "tma" kernel, the rest are not
    runs, outputs, stats = {}, {}, {}
    per_sm = [int(f) for f in args.per_sm.split(",")]
    plan = [(c, f) for c in (CONFIGS if args.sweep else ["128x128 S2 w8"]) for f in per_sm]
    for config_name, per_sm in plan:
        config = config_of(config_name)
        runtime._num_sms = lambda device, n=sms * per_sm: n  # the persistent grid's size
        for name, text in texts.items():
            if args.sweep and name in ("strided_dz", "no_zdz", "no_dz"):
                continue
            key = f"{config_name} ×{per_sm}/SM {name}"
            compiled = compile_program(program, analyze(program, sizes))
            compiled.configs["down_bwd"] = config
            compiled.mainloop = "tma" if name == "tma_epilogue" else "tma_mainloop"
            compiled.kernels["down_bwd"] = dataclasses.replace(
                compiled.kernels["down_bwd"], source=text
            )
            try:
                tensors = compiled.run(compiled.prepare(inputs))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
                stats[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                continue
            outputs[key] = tensors["dz"].clone()
            stats[key] = dict(compiled.kernel_stats["down_bwd"])
            runs[key] = lambda c=compiled, t=tensors: c.run_gemm_step("down_bwd", t)
            ms = interleaved_ms({key: runs[key]}, rounds=1, warmup=5, rep=30)
            stats[key]["ms_single"] = ms[key]
    a = torch.randn((16384, 2048), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((2048, 8192), device="cuda", dtype=torch.bfloat16)
    runs["cublas"] = lambda: torch.matmul(a, b)
    ms = interleaved_ms(runs, rounds=3, warmup=10, rep=50)
    reference = next(k for k in outputs if k.endswith(" original"))
    same = {
        key: bool(torch.equal(outputs[key], outputs[reference]))
        for key in outputs
        if key.endswith((" strided_dz", " original", " tma_epilogue"))
    }
    result = {"sizes": sizes, "ms": ms, "stats": stats, "equal_to_first_original": same}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "swiglu_bwd_epilogue.json").write_text(json.dumps(result, indent=2))
    for key, st in stats.items():
        if "error" in st:
            print(f"{key:40s} {st['error']}")
            continue
        t = ms[key]
        regs = f"{st.get('registers', '?')} regs, {st.get('spills', '?')} spills"
        print(f"{key:40s} {t:.3f} ms  ({t / ms['cublas']:.2f}× cuBLAS)  {regs}")
    print(f"cublas {ms['cublas']:.3f} ms")
    print(f"outputs identical to {reference}: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
