"""Every kernel the shipped Programs launch compiles for sm_90 with the installed Triton and fits an
H200's shared memory.

The CPU suite runs kernels in Triton's interpreter, which runs code the compiler refuses (a name
given two dtypes in the branches of an ``if`` is one), and the GPU suite runs them on the one
Triton its machine has. Here each family's Programs (``export/programs``) collect the launches of
a call (``CompiledProgram.collect_launches``: prep, every fused GEMM, every aux step) in bf16 at
small sizes with the GPU's widths kept where they shape a kernel (head dims), with each fused
GEMM pinned to the GPU's default config (what runs untuned) under each mainloop variant — the
TMA kernel, the TMA mainloop with pointer epilogue tiles, the pointer kernel — and every
distinct launch is compiled to a cubin as its launch would compile it on an H200
(``helpers.warm_for_hopper``). Not run: the tuner's other configs, and the CuTe backend's kernels
(compiled by the CuTe DSL on the GPU only).
"""

from __future__ import annotations

import pytest
import torch

from coda.export.programs import FAMILIES, SHIPPED_EPS, lowered
from coda.primitives import analyze, compile_program
from coda.primitives.codegen.configs import GPU_DEFAULT, fit_columns
from coda.primitives.compile_ahead import distinct
from coda.primitives.offline_target import fits
from tests.helpers import warm_for_hopper

MAINLOOPS = ("tma", "tma_mainloop", "pointer")


def small_gpu_sizes(sizes: dict[str, int]) -> dict[str, int]:
    """A block's GPU sizes shrunk for collecting on a CPU: 128 tokens, widths of 256 or 512 (all
    multiples of 16, as a TMA descriptor needs), the head dim ``D`` kept with two query heads and
    one key/value head."""
    small = {"M": 128, "d": 256, "f": 512, "V": 512, "Nq": 256}
    out = {name: small[name] for name in sizes if name in small}
    if "D" in sizes:
        out.update(D=sizes["D"], Nq=2 * sizes["D"], Nkv=sizes["D"])
        if "Nqkv" in sizes:
            out["Nqkv"] = out["Nq"] + 2 * out["Nkv"]
    assert out.keys() == sizes.keys(), (
        f"sizes this test does not shrink: {sizes.keys() - out.keys()}"
    )
    return out


def family_launches(family: str) -> list:
    """The distinct launches of ``family``'s shipped Programs under every mainloop variant."""
    spec = FAMILIES[family]
    blocks = spec.blocks(SHIPPED_EPS)
    launches = []
    for key in spec.keys:
        block = blocks[key]
        program = lowered(block, spec.options)
        sizes = small_gpu_sizes(block.shapes.gpu[0])
        info = analyze(program, sizes)
        inputs = block.make_inputs(sizes, torch.bfloat16, seed=0)
        for mainloop in MAINLOOPS:
            compiled = compile_program(program, info)
            compiled.mainloop = mainloop
            for name, gemm in info.gemms.items():
                if not gemm.vendor:
                    compiled.configs[name] = fit_columns(GPU_DEFAULT, gemm.column_multiple)
            launches += compiled.collect_launches(inputs)
    return distinct(launches)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_kernel_compiles_for_sm90_and_fits_its_shared_memory(family: str) -> None:
    launches = family_launches(family)
    assert launches, f"{family}'s Programs launch no kernel"
    rows = warm_for_hopper(launches)
    failed = [r for r in rows if "error" in r]
    assert not failed, "\n\n".join(f"{r['kernel']} {r['meta']}:\n{r['error']}" for r in failed)
    too_big = [r for r in rows if not fits(r["shared"])]
    assert not too_big, [(r["kernel"], r["shared"], r["meta"]) for r in too_big]
    assert all(r["cubin"] for r in rows)
