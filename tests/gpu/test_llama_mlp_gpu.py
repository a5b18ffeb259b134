"""llama_mlp on a GPU: verified in bf16 and fp16; the profile stage measures it side by side."""

from __future__ import annotations

from coda.blocks import get_block
from coda.planner import lower
from coda.sandbox import SandboxOptions, evaluate

BLOCK = get_block("llama_mlp")


def test_llama_mlp_verifies_in_bf16_and_fp16_on_gpu() -> None:
    report = evaluate(lower(BLOCK), BLOCK, SandboxOptions(profile=False))
    assert report.verified, report.render_text()
    assert {c.dtype for c in report.checks} == {"bfloat16", "float16", "float32"}
    low = {tuple(c.sizes.items()) for c in report.checks if c.dtype != "float32"}
    assert len(low) == len(BLOCK.shapes.gpu)
    float32 = {tuple(c.sizes.items()) for c in report.checks if c.dtype == "float32"}
    assert float32 == {tuple(BLOCK.shapes.cpu[-1].items())}  # one run, the smallest CPU shape


def test_profile_stage_measures_side_by_side() -> None:
    sizes = {"M": 2048, "d": 1024, "f": 2816}
    report = evaluate(lower(BLOCK), BLOCK, SandboxOptions(seeds=[0], bench_shapes=[sizes]))
    assert report.verified, report.render_text()
    (row,) = report.profile
    assert row.program_ms > 0 and row.gemms_ms > 0 and row.eager_ms > 0
    assert row.tflops > 0 and set(row.configs) == {"gate_up", "down"}
    print(report.render_text())
