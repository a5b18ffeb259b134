"""primitives/compile_ahead.py on a GPU: after a Program's launches (and a tuning screen's
configs) are compiled ahead on a pool of threads, the real launches compile nothing more and
compute the bits of a Program whose kernels compiled at their launches (skipped without a GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import analyze, compile_program
from coda.primitives.codegen import tuning
from coda.primitives.codegen.tuning import candidate_configs
from coda.primitives.compile_ahead import compile_ahead_of
from coda.primitives.launch import clear


def _compiled_kernels(kernels: set[Any]) -> int:
    """How many compiled kernels Triton holds for ``kernels`` on the current device."""
    device = torch.cuda.current_device()
    return sum(len(k.device_caches[device][0]) for k in kernels)


def _fresh(name: str, sizes: dict[str, int]) -> Any:
    block = get_block(name)
    program = lower(block)
    return block, compile_program(program, analyze(program, sizes))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_run_compiled_ahead_compiles_nothing_and_matches_gpu(dtype: torch.dtype) -> None:
    clear()
    sizes = {"M": 272, "d": 192, "f": 320}  # a shape no other GPU test compiles
    block, ahead = _fresh("llama_mlp", sizes)
    inputs = block.make_inputs(sizes, dtype, seed=0, device="cuda")
    calls = ahead.collect_launches(inputs)
    kernels = {c[0] for c in calls}
    done = compile_ahead_of(lambda: calls, threads=8)
    assert done.kernels >= len(ahead.kernels) and done.failed == 0, done
    before = _compiled_kernels(kernels)
    got = ahead(inputs)
    torch.cuda.synchronize()
    assert _compiled_kernels(kernels) == before  # every launch found its kernel compiled

    _, at_launch = _fresh("llama_mlp", sizes)
    expected = at_launch(inputs)
    for name in block.outputs:
        assert torch.equal(got[name], expected[name]), name


def test_a_screen_compiled_ahead_compiles_nothing_more_gpu() -> None:
    sizes = {"M": 1040, "d": 256, "f": 512}
    block, compiled = _fresh("llama_mlp", sizes)
    prepared = compiled.prepare(block.make_inputs(sizes, torch.bfloat16, seed=0, device="cuda"))
    tensors = compiled.run(prepared)
    name = next(iter(compiled.kernels))
    gemm = compiled.info_for({n: prepared[n] for n in compiled.program.inputs}).gemms[name]
    configs = candidate_configs(
        gemm.M,
        gemm.N,
        gemm.K,
        itemsize=2,
        interpret=False,
        space=tuning.QUICK_SPACE,
        column_multiple=gemm.column_multiple,
    )
    assert len(configs) > 2
    tuning._compile_configs_ahead(compiled, name, tensors, configs)
    functions = {compiled._kernel(name, variant) for variant in compiled.kernels[name].variants}
    before = _compiled_kernels(functions)
    trials = tuning._screen(compiled, name, tensors, configs, warmup=2, rep=4)
    assert _compiled_kernels(functions) == before
    assert sum(t.ms is not None for t in trials) >= 1
