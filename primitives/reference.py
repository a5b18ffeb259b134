"""The PyTorch reference executor: runs a Program's semantics directly, on whole tensors.

Two modes:

* ``exact=True`` — everything in float64, stores not rounded: checks the *algebra* of a program
  against the block's reference (the sandbox's ``semantics`` stage), fast, on the CPU.
* ``exact=False`` — mirrors the kernels' precision: GEMMs accumulate in fp32 from the stored dtype,
  epilogue math in fp32, one rounding at each store. Codegen ≡ this executor up to fp32 rounding.

Partial reductions use the same tile widths as the kernels (``resolve_config``), so partial buffers
match element for element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .analysis import GemmInfo, ProgramInfo, analyze, bind_sizes
from .base import RunEnv
from .codegen.configs import resolve_config
from .ir import GemmEpilogue, MainloopConfig, Program
from .types import torch_dtype


@dataclass
class RefEnv:
    """What an epilogue op's ``reference`` sees: whole-tensor values of one GEMM's epilogue."""

    tensors: dict[str, torch.Tensor]
    locals: dict[str, torch.Tensor]  # tiles [M, W], row vectors [M, 1], column vectors [1, W]
    compute: torch.dtype
    act: torch.dtype
    exact: bool
    N: int
    block_m: int
    epilogue_block_n: int  # columns per epilogue sub-tile (the partials' block width along rows)
    sizes: dict[str, int]  # the binding of the program's symbolic sizes

    def load(self, name: str) -> torch.Tensor:
        return self.tensors[name].to(self.compute)

    def row(self, name: str) -> torch.Tensor:
        return self.load(name)[:, None]

    def col(self, name: str) -> torch.Tensor:
        return self.load(name)[None, :]

    @property
    def partials_dtype(self) -> torch.dtype:
        return self.compute if self.exact else torch.float32

    def store_dtype(self, spec: str) -> torch.dtype:
        """Exact mode keeps float64 (no rounding); otherwise the store's declared dtype."""
        return self.compute if self.exact else torch_dtype(spec, self.act)


def activation_dtype(program: Program, inputs: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype shared by all ``act`` inputs (the run's activation dtype)."""
    dtypes = {inputs[n].dtype for n, d in program.inputs.items() if d.dtype == "act"}
    if len(dtypes) > 1:
        raise ValueError(f"activation inputs have mixed dtypes: {sorted(map(str, dtypes))}")
    return dtypes.pop() if dtypes else torch.float32


def _run_gemm(
    step: GemmEpilogue,
    gemm: GemmInfo,
    env: RunEnv,
    act: torch.dtype,
    exact: bool,
    cfg: MainloopConfig,
) -> None:
    a = env.tensors[step.a.tensor].to(env.compute)
    b = env.tensors[step.b.tensor].to(env.compute)
    a = a.T if step.a.transpose else a
    b = b.T if step.b.transpose else b
    ref = RefEnv(
        env.tensors,
        {"acc": a @ b},
        env.compute,
        act,
        exact,
        gemm.N,
        cfg.block_m,
        cfg.epilogue_block_n,
        env.sizes,
    )
    for op in step.epilogue:
        op.reference(ref)


def execute_reference(
    program: Program,
    inputs: dict[str, torch.Tensor],
    *,
    exact: bool = False,
    info: ProgramInfo | None = None,
    configs: dict[str, MainloopConfig] | None = None,
) -> dict[str, torch.Tensor]:
    """Run ``program`` on ``inputs``; return every program tensor (inputs, prep, step results).

    ``configs`` gives the tile sizes each gemm step ran with (they fix partial-buffer widths);
    by default each step's config resolved for this machine's backend, as the compiled program does.
    """
    if info is None:
        info = analyze(program, bind_sizes(program, {n: t.shape for n, t in inputs.items()}))
    compute = torch.float64 if exact else torch.float32
    tensors = {
        n: t.to(torch.float64) if exact and t.is_floating_point() else t for n, t in inputs.items()
    }
    act = activation_dtype(program, tensors)
    env = RunEnv(tensors, info.tensors, compute, info.sizes)
    for prep in program.prep:
        prep.apply(env)
    for step, name in zip(program.steps, program.step_names(), strict=True):
        if isinstance(step, GemmEpilogue):
            g = info.gemms[name]
            cfg = (configs or {}).get(name) or resolve_config(step.config, g)
            _run_gemm(step, g, env, act, exact, cfg)
        else:
            step.reference(env)
    return tensors


def outputs_of(program: Program, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block outputs among all program tensors (output views applied)."""
    sizes = bind_sizes(program, {n: tuple(tensors[n].shape) for n in program.inputs})
    return program.select_outputs(tensors, sizes)
