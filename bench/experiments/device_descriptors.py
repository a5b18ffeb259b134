"""Experiment: build the TMA descriptors in the kernel instead of on the host.

One fused-GEMM launch costs 100–170 µs of host time on the H200 (``launch_overhead.py``), a large
share of it Triton turning each host ``TensorDescriptor`` argument (4–7 per launch) into a
``CUtensorMap``. Here the generated Hopper kernel (the ``tma`` variant) is patched to take each
descriptor's base pointer, rows, columns and row stride instead, and to build the descriptor
itself at its start (``tl.make_tensor_descriptor``; scratch memory from ``triton.set_allocator``).
The patched kernel is launched by the product's runtime like any other (its parameters are plain
``ptr``/``shape``/``stride`` ones). Per kernel, product (host descriptors) against patched
(device descriptors):

* host µs per call of the fused GEMM step at M = N = K = 256 (the GPU idles between calls);
* ``do_bench`` and CUDA-graph ms at M = N = K = 4096 (untuned default config);
* outputs of the patched kernel equal to the product kernel's, bit for bit.

Not part of the product: a measurement to decide whether the codegen should move descriptors to
the device.

    python3 bench/experiments/device_descriptors.py [--out DIR] [--kernels a,b]
    python3 bench/experiments/device_descriptors.py --dry-run   # CPU interpreter, toy sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

KERNELS = "gemm_swiglu,gemm_residual_partial_rmsnorm,gemm_partial_cross_entropy"
DEVICE = "cuda"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument("--kernels", default=KERNELS, help="comma-separated paper kernel blocks")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: checks the script")
    return p.parse_args(argv)


# -- the patch -----------------------------------------------------------------------------------
def _function_text(source: str, function: str) -> str:
    """The ``@triton.jit`` function ``function`` of a generated module, decorator to last line."""
    start = source.index(f"@triton.jit\ndef {function}(")
    end = source.find("\n\n\n", start)
    return source[start : None if end < 0 else end]


def device_descriptor_kernel(kernel: Any) -> Any:
    """``kernel`` (a KernelSource) with its ``tma`` variant replaced by a copy whose descriptors
    are built in the kernel from base/rows/cols/stride parameters."""
    from coda.primitives.codegen.context import Param
    from coda.primitives.codegen.kernel import KernelVariant

    variant = kernel.variants["tma"]
    text = _function_text(kernel.source, variant.function)
    function = f"{variant.function}_device_descriptors"
    header, body = text.split("):\n", 1)
    header = header.replace(f"def {variant.function}(", f"def {function}(")
    params: list[Param] = []
    builds = []
    for p in variant.params:
        if p.kind != "desc":
            params.append(p)
            continue
        n, t = p.name, p.tensor
        header = re.sub(rf"\b{n}\b", f"{n}_base, {n}_rows, {n}_cols, {n}_stride", header, count=1)
        params += [
            Param(f"{n}_base", "ptr", tensor=t),
            Param(f"{n}_rows", "shape", tensor=t, dim=0),
            Param(f"{n}_cols", "shape", tensor=t, dim=1),
            Param(f"{n}_stride", "stride", tensor=t, dim=0),
        ]
        block = ", ".join(b.replace("//", " // ").replace("*", " * ") for b in p.block or ())
        builds.append(
            f"    {n} = tl.make_tensor_descriptor({n}_base, shape=[{n}_rows, {n}_cols], "
            f"strides=[{n}_stride, 1], block_shape=[{block}])\n"
        )
    doc_end = body.index('"""', body.index('"""') + 3) + 4  # the one-line docstring and newline
    patched = header + "):\n" + body[:doc_end] + "".join(builds) + body[doc_end:]
    variants = dict(kernel.variants)
    variants["tma"] = KernelVariant(function, tuple(params))
    return dataclasses.replace(kernel, source=kernel.source + "\n\n\n" + patched, variants=variants)


# -- measuring -----------------------------------------------------------------------------------
def kernel_row(name: str, launch_overhead: Any) -> dict[str, Any]:
    import torch

    from coda.blocks import get_block
    from coda.planner import lower

    block = get_block(name)
    program = lower(block)
    row: dict[str, Any] = {"block": name}
    small, sizes_to_time = (256, (256, 4096)) if DEVICE == "cuda" else (32, (32,))
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    for n in sizes_to_time:
        sizes = {k: n if k in ("M", "N", "K") else v for k, v in block.shapes.bench[0].items()}
        inputs = block.make_inputs(sizes, dtype, seed=0, device=DEVICE)
        runs = {kind: _compiled(program, sizes, kind) for kind in ("host", "device")}
        outs = {}
        for kind, compiled in runs.items():
            prepared = compiled.prepare(inputs)
            tensors = compiled.run(prepared)
            outs[kind] = compiled.program.select_outputs(tensors, sizes)
            step = next(iter(compiled.kernels))
            if n == small:
                row[f"host_us[{kind}]"] = launch_overhead.host_us(
                    lambda c=compiled, s=step, t=tensors: c.run_gemm_step(s, t)
                )
            else:
                row[f"do_bench_ms[{kind}]"] = _ms(lambda c=compiled, p=prepared: c.run(p))
                row[f"graph_ms[{kind}]"] = _ms(lambda c=compiled, p=prepared: c.run(p), graph=True)
            row[f"mainloop[{kind}]"] = dict(compiled.mainloops_used)
        row[f"identical[{n}]"] = all(
            torch.equal(outs["host"][o], outs["device"][o]) for o in block.outputs
        )
    return row


def _compiled(program: Any, sizes: dict[str, int], kind: str) -> Any:
    from coda.primitives import analyze, compile_program

    compiled = compile_program(program, analyze(program, sizes))
    compiled.mainloop = "tma"
    if kind == "device":
        compiled.kernels = {n: device_descriptor_kernel(k) for n, k in compiled.kernels.items()}
    return compiled


def _ms(fn: Any, graph: bool = False) -> float:
    import triton

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, return_mode="median"))
    return float(triton.testing.do_bench(fn, return_mode="median"))


def _launch_overhead() -> Any:
    import importlib.util

    path = Path(__file__).with_name("launch_overhead.py")
    spec = importlib.util.spec_from_file_location("launch_overhead", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    global DEVICE
    overhead = _launch_overhead()  # its host timer, and its start: device first, then Triton
    if not overhead.start(args.dry_run, "device_descriptors.py"):
        return 2
    DEVICE = overhead.DEVICE
    import torch
    import triton

    # device-side descriptors live in global scratch memory that Triton asks the caller for
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=DEVICE)
    )
    rows = [kernel_row(k, overhead) for k in args.kernels.split(",")]
    overhead.save(args.out, "device_descriptors.json", json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
