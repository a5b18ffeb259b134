"""GPU timings for the profile stage: the program side by side with its baselines, in one run.

Baselines at the same shapes and dtype: the block's matrix products alone on cuBLAS (the speed of
light of a GEMM-epilogue program), the block's PyTorch reference run eagerly, and the same reference
under ``torch.compile``. The program's mainloop configs are tuned first (``tune_program``). Times
are medians of ``triton.testing.do_bench`` (L2 flushed between runs) in interleaved rounds (clocks
drift under load: ``coda.primitives.timing``); when a shape's inputs fit in L2 several input sets
are rotated. Prep (weight layouts) is done once before timing, as in use.
Correctness is re-checked in the same run, at the benchmark shape, against an fp32 reference.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Literal

import torch

from coda.blocks.block import Block
from coda.primitives.codegen.tuning import QUICK_SPACE, tune_program
from coda.primitives.runtime import CompiledProgram
from coda.primitives.timing import sustained_ms

from .report import ProfileRow


def rotation_count(nbytes: int, device: torch.device, cap: int = 8) -> int:
    """How many input sets keep a timed loop from reading its inputs out of L2."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(cap, math.ceil(4 * l2 / max(nbytes, 1))))


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    cycle = itertools.cycle(fns)
    return lambda: next(cycle)()


def gemms_alone(block: Block, sizes: dict[str, int], dtype: torch.dtype) -> Callable[[], None]:
    """A closure running each matrix product of the block as one cuBLAS matmul on random data."""
    pairs = []
    for m, n, k in block.matmuls(sizes):
        a = torch.randn((m, k), device="cuda", dtype=dtype)
        b = torch.randn((n, k), device="cuda", dtype=dtype)
        pairs.append((a, b))

    def run() -> None:
        for a, b in pairs:
            torch.matmul(a, b.T)

    return run


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.float() - want.float()).norm()
    return float(diff / want.float().norm().clamp_min(1e-30))


def profile_shape(
    compiled: CompiledProgram,
    block: Block,
    sizes: dict[str, int],
    dtype: torch.dtype,
    *,
    tune: bool = True,
    space: Literal["quick", "full"] = "quick",
    extra: dict[str, Callable[[dict[str, torch.Tensor]], object]] | None = None,
) -> ProfileRow:
    """Time the program and its baselines (plus ``extra`` ones, e.g. Liger), interleaved.
    ``space``: the configs tuning times for a kernel new to the tuning cache (``QUICK_SPACE`` or
    the whole Hopper space)."""
    inputs = block.make_inputs(sizes, dtype, seed=0, device="cuda")
    prepared = compiled.prepare(inputs)
    rejected: dict[str, list[str]] = {}
    if tune:
        configs = QUICK_SPACE if space == "quick" else None
        for name, result in tune_program(compiled, prepared, space=configs).items():
            if result.rejected:
                rejected[name] = [f"{_config_text(c)}: {why}" for c, why in result.rejected]
    errors = _check_at_shape(compiled, block, inputs, prepared)
    n = rotation_count(_nbytes(inputs), torch.device("cuda"))
    sets = [inputs] + [block.make_inputs(sizes, dtype, seed=s, device="cuda") for s in range(1, n)]
    preps = [prepared] + [compiled.prepare(s) for s in sets[1:]]
    fns = {
        "program": rotating([lambda p=p: compiled.run(p) for p in preps]),
        "gemms": gemms_alone(block, sizes, dtype),
        "eager": rotating([lambda s=s: block.reference(s) for s in sets]),
    }
    compiled_ref = _compiled_baseline(block, sets)
    if compiled_ref is not None:
        fns["compile"] = compiled_ref
    for name, fn in (extra or {}).items():
        fns[name] = rotating([lambda s=s, f=fn: f(s) for s in sets])
    times = sustained_ms(fns)
    program_ms = times["program"]
    info = compiled.info_for(inputs)
    return ProfileRow(
        sizes=sizes,
        dtype=str(dtype).removeprefix("torch."),
        program_ms=program_ms,
        gemms_ms=times["gemms"],
        eager_ms=times["eager"],
        compile_ms=times.get("compile"),
        baselines_ms={k: v for k, v in times.items() if k in (extra or {})},
        tflops=block.flops(sizes) / (program_ms * 1e-3) / 1e12,
        configs={n: c.model_dump() for n, c in compiled.configs_for(info).items()},
        mainloops=dict(compiled.mainloops_used),
        kernel_stats=dict(compiled.kernel_stats),
        input_sets=n,
        tuning_rejected=rejected,
        tuned=tune,
        **errors,
    )


def _check_at_shape(
    compiled: CompiledProgram,
    block: Block,
    inputs: dict[str, torch.Tensor],
    prepared: dict[str, torch.Tensor],
) -> dict[str, float]:
    """Relative errors of the program and of eager PyTorch (same dtype) vs an fp32 reference."""
    ref32 = block.reference(
        {n: t.float() if t.is_floating_point() else t for n, t in inputs.items()}
    )
    tensors = compiled.run(prepared)
    eager = block.reference(inputs)
    got = {o: tensors[t] for o, t in compiled.program.outputs.items()}
    return {
        "rel_err": max(relative_error(got[o], ref32[o]) for o in block.outputs),
        "eager_rel_err": max(relative_error(eager[o], ref32[o]) for o in block.outputs),
    }


def _compiled_baseline(block: Block, sets: list[dict[str, torch.Tensor]]):  # noqa: ANN202
    """The block's reference under ``torch.compile``, warmed up; None if it does not compile."""
    try:
        fn = torch.compile(block.reference)
        for s in sets:
            fn(s)
        return rotating([lambda s=s: fn(s) for s in sets])
    except Exception:  # noqa: BLE001 - a baseline that does not compile is reported as missing
        return None


def _config_text(config: object) -> str:
    """A tuned config as a report names it: a Triton ``MainloopConfig``'s fields, a CuTe
    ``CuteConfig`` as its tile, cluster and schedule."""
    dump = getattr(config, "model_dump", None)
    return str(dump()) if dump is not None else str(config)
