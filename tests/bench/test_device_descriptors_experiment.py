"""The device-descriptor experiment's patch applies to the generated Hopper kernels and computes
the product kernel's outputs bit for bit under the interpreter — so its GPU run measures only
where the descriptors are built."""

from __future__ import annotations

import json
from pathlib import Path

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import analyze, compile_program

from . import load_script

experiment = load_script("experiments/device_descriptors")


def test_the_patch_builds_every_descriptor_in_the_kernel() -> None:
    block = get_block("gemm_residual_partial_rmsnorm")
    program = lower(block)
    (kernel,) = compile_program(program, analyze(program, block.shapes.cpu[0])).kernels.values()
    patched = experiment.device_descriptor_kernel(kernel)
    variant = patched.variants["tma"]
    descriptors = [p.name for p in kernel.variants["tma"].params if p.kind == "desc"]
    assert len(descriptors) >= 4  # a, b and the epilogue's tiles
    assert variant.function.endswith("_device_descriptors")
    assert not [p for p in variant.params if p.kind == "desc"]
    text = experiment._function_text(patched.source, variant.function)
    for name in descriptors:
        assert f"{name} = tl.make_tensor_descriptor({name}_base" in text
    assert patched.variants["pointer"] == kernel.variants["pointer"]


def test_dry_run_matches_the_product_kernel(tmp_path: Path) -> None:
    args = ["--dry-run", "--kernels", "gemm_swiglu", "--out", str(tmp_path)]
    assert experiment.main(args) == 0
    (row,) = json.loads((tmp_path / "device_descriptors.json").read_text())
    assert row["identical[32]"] is True
    assert row["mainloop[device]"] == row["mainloop[host]"] == {"d": "tma"}
    assert row["host_us[host]"] > 0 and row["host_us[device]"] > 0
