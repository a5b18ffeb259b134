"""Run a Program with its generated Triton kernels: prep once, then allocate, launch, return.

``compile_program`` generates one module per fused gemm step (plain-store gemms run on
``torch.matmul``, i.e. cuBLAS on a GPU) and returns a ``CompiledProgram``. Calling it binds the
symbolic sizes from the inputs, analyses the program at those sizes (cached), allocates every tensor
the steps write (optionally poisoned with NaN so an unwritten element cannot pass verification),
and launches the steps in order.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from . import backend
from .analysis import GemmInfo, ProgramInfo, analyze, bind_sizes
from .base import RunEnv
from .codegen.cache import load_kernel, write_source
from .codegen.configs import resolve_config
from .codegen.kernel import KernelSource, generate_kernel
from .ir import GemmEpilogue, MainloopConfig, Program
from .reference import activation_dtype
from .sizes import evaluate as evaluate_size
from .types import TensorInfo, partials_shape, torch_dtype


@dataclass
class CompiledProgram:
    """A Program with its generated kernels; call it like a function of the block's inputs."""

    program: Program
    kernels: dict[str, KernelSource]
    configs: dict[str, MainloopConfig] = field(default_factory=dict)  # pinned per step (tuning)
    _infos: dict[tuple, ProgramInfo] = field(default_factory=dict)
    _loaded: dict[str, Callable] = field(default_factory=dict)

    # -- analysis at the call's sizes ------------------------------------------------------------
    def info_for(self, inputs: dict[str, torch.Tensor]) -> ProgramInfo:
        sizes = bind_sizes(self.program, {n: tuple(t.shape) for n, t in inputs.items()})
        key = tuple(sorted(sizes.items()))
        if key not in self._infos:
            self._infos[key] = analyze(self.program, sizes)
        return self._infos[key]

    def config_for(self, name: str, gemm: GemmInfo) -> MainloopConfig:
        if name in self.configs:
            return self.configs[name]
        step = self._step(name)
        return resolve_config(step.config, gemm.M, gemm.N, gemm.K, interpret=backend.INTERPRET)

    def configs_for(self, info: ProgramInfo) -> dict[str, MainloopConfig]:
        return {name: self.config_for(name, g) for name, g in info.gemms.items()}

    def _step(self, name: str) -> GemmEpilogue:
        step = self.program.steps[self.program.step_names().index(name)]
        assert isinstance(step, GemmEpilogue)
        return step

    # -- running ---------------------------------------------------------------------------------
    def prepare(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inputs plus prep results (weight layouts), computed once per set of weights."""
        info = self.info_for(inputs)
        env = RunEnv(dict(inputs), info.tensors, sizes=info.sizes)
        for prep in self.program.prep:
            prep.apply(env)
        return env.tensors

    def run(
        self, prepared: dict[str, torch.Tensor], *, poison: bool = False
    ) -> dict[str, torch.Tensor]:
        """Launch every step on prepared tensors; return all program tensors."""
        info = self.info_for({n: prepared[n] for n in self.program.inputs})
        act = activation_dtype(self.program, prepared)
        device = next(iter(prepared.values())).device
        tensors = dict(prepared)
        env = RunEnv(tensors, info.tensors, sizes=info.sizes)
        for step, name in zip(self.program.steps, self.program.step_names(), strict=True):
            if isinstance(step, GemmEpilogue):
                self._run_gemm(step, info.gemms[name], tensors, act, device, poison, info.sizes)
            else:
                self._allocate_new(info, name, tensors, act, device, poison)
                step.launch(env)
        return tensors

    def __call__(
        self, inputs: dict[str, torch.Tensor], *, poison: bool = False
    ) -> dict[str, torch.Tensor]:
        tensors = self.run(self.prepare(inputs), poison=poison)
        return self.program.select_outputs(tensors, self.info_for(inputs).sizes)

    def _allocate_new(
        self,
        info: ProgramInfo,
        producer: str,
        tensors: dict[str, torch.Tensor],
        act: torch.dtype,
        device: torch.device,
        poison: bool,
    ) -> None:
        for name, t in info.tensors.items():
            if t.producer == producer and t.partials is None:
                tensors[name] = _empty(t.shape, torch_dtype(t.dtype, act), device, poison)

    def _run_gemm(
        self,
        step: GemmEpilogue,
        gemm: GemmInfo,
        tensors: dict[str, torch.Tensor],
        act: torch.dtype,
        device: torch.device,
        poison: bool,
        sizes: dict[str, int],
    ) -> None:
        if gemm.vendor:
            self._run_vendor(step, gemm, tensors, act)
            return
        cfg = self.config_for(gemm.name, gemm)
        for name, t in gemm.writes.items():
            tensors[name] = _allocate(t, gemm, cfg, act, device, poison)
        kernel = self._kernel(gemm.name)
        source = self.kernels[gemm.name]
        args = [_param_value(p, tensors, gemm, sizes) for p in source.params]
        num_tiles = triton.cdiv(gemm.M, cfg.block_m) * triton.cdiv(gemm.N, cfg.block_n)
        grid = (min(num_tiles, _num_sms(device)),)
        precision = "ieee" if tensors[step.a.tensor].dtype == torch.float32 else "tf32"
        kernel[grid](
            *args,
            BLOCK_SIZE_M=cfg.block_m,
            BLOCK_SIZE_N=cfg.block_n,
            BLOCK_SIZE_K=cfg.block_k,
            GROUP_SIZE_M=cfg.group_m,
            NUM_SMS=grid[0],
            INPUT_PRECISION=precision,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )

    def _run_vendor(
        self, step: GemmEpilogue, gemm: GemmInfo, tensors: dict[str, torch.Tensor], act: torch.dtype
    ) -> None:
        (store,) = step.epilogue
        a, b = tensors[step.a.tensor], tensors[step.b.tensor]
        a = a.T if step.a.transpose else a
        b = b.T if step.b.transpose else b
        dtype = torch_dtype(store.dtype, act)
        out = a @ b if dtype == a.dtype else (a.float() @ b.float())
        tensors[store.to] = out.to(dtype)

    def _kernel(self, name: str) -> Callable:
        if name not in self._loaded:
            self._loaded[name] = load_kernel(self.kernels[name])
        return self._loaded[name]

    # -- artifacts -------------------------------------------------------------------------------
    def write_kernels(self, directory: Path) -> list[Path]:
        """Copy the generated modules (as they ran) into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        paths = []
        for kernel in self.kernels.values():
            src = write_source(kernel)
            dst = directory / f"{kernel.step}.py"
            shutil.copyfile(src, dst)
            paths.append(dst)
        return paths


def compile_program(program: Program, info: ProgramInfo) -> CompiledProgram:
    """Generate the kernels of ``program`` (types from ``info``, valid at every binding)."""
    kernels = {}
    for step, name in zip(program.steps, program.step_names(), strict=True):
        if isinstance(step, GemmEpilogue) and not info.gemms[name].vendor:
            kernels[name] = generate_kernel(step, info.gemms[name], info.tensors, program.block)
    return CompiledProgram(program, kernels)


def _empty(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, poison: bool
) -> torch.Tensor:
    if poison and dtype.is_floating_point:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _allocate(
    t: TensorInfo,
    gemm: GemmInfo,
    cfg: MainloopConfig,
    act: torch.dtype,
    device: torch.device,
    poison: bool,
) -> torch.Tensor:
    if t.partials is not None:
        p = t.partials
        block = cfg.block_n * p.length // gemm.N if p.axis == "row" else cfg.block_m
        return _empty(partials_shape(t.shape[0], p.length, block), torch.float32, device, poison)
    return _empty(t.shape, torch_dtype(t.dtype, act), device, poison)


def _param_value(p, tensors: dict[str, torch.Tensor], gemm: GemmInfo, sizes: dict[str, int]):  # noqa: ANN001, ANN202
    if p.kind == "ptr":
        return tensors[p.tensor]
    if p.kind == "stride":
        return tensors[p.tensor].stride(p.dim)
    if p.kind == "shape":
        return tensors[p.tensor].shape[p.dim]
    if p.expr is not None:
        return evaluate_size(p.expr, sizes)
    return {"M": gemm.M, "N": gemm.N, "K": gemm.K}[p.name]


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1 << 30  # interpreter: one program per tile
