"""A second backend for fused GEMM steps: QuACK's warp-specialized Hopper GEMM on NVIDIA's CuTe DSL.

The Triton kernels run a tile's epilogue after its K loop on the same warps. QuACK's GEMM gives the
epilogue its own time: two consumer warpgroups take output tiles in turn, so one's epilogue (tile
loads, math, stores, partial sums) overlaps the other's tensor-core work. Epilogues that move
extra ``[M, N]`` tiles — the backward ones — cost less there (bench/RESULTS.md, run 2026-12-02h).

- ``emit`` turns a step's epilogue into a CuTe module (plain text; each op's ``emit_cute``), or
  says why the step stays on Triton (``CuteUnsupported``);
- ``epilogue`` is what the generated modules stand on (imports the DSL), with ``overlap``, the
  epilogue loop of steps that load tiles: each sub-tile's tile loads read during the previous
  one's arithmetic, its stores issued after the next one's (``CuteConfig.epi_overlap``);
- ``launch`` compiles a generated module for a call's tensors and launches it;
- ``tuning`` picks a covered step's tile and cluster per shape by timing them — and, under
  ``auto``, the step's Triton kernel beside them, and for plain products cuBLAS against QuACK's
  GEMM (``codegen.tuning.tune_program`` calls it).

Which backend a step takes is ``CODA_EPILOGUE_BACKEND`` (settings ``epilogue_backend``):
``triton`` (the default, and the only one on a CPU), ``cute`` (every step this backend covers,
on a Hopper GPU with ``nvidia-cutlass-dsl`` and ``quack-kernels`` installed — ``pip install
"coda-agent[cute]"``), ``auto`` (where it can run, each covered step on the backend tuning timed
faster at the call's shapes, CuTe where untuned, and each plain product on QuACK's GEMM where
tuning timed that faster than cuBLAS; else ``triton``). Importing this package imports neither
the DSL nor QuACK.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

__all__ = ["available", "unavailable_reason"]


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the CuTe backend cannot run on ``device`` (default: the current CUDA device); None
    when it can."""
    if device is not None and device.type != "cuda":
        return f"the tensors are on {device.type}; the CuTe kernels run on a CUDA GPU"
    return _machine_reason(0 if device is None or device.index is None else device.index)


@cache
def _machine_reason(device_index: int) -> str | None:
    missing = [m for m in ("cutlass", "quack") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install 'coda-agent[cute]')"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        return f"the GPU is sm_{major}{minor}; the CuTe epilogues are built for Hopper (sm_90)"
    return None


def available(device: torch.device | None = None) -> bool:
    return unavailable_reason(device) is None
