"""Run a Program with its generated Triton kernels: prep, then allocate, launch, return.

``compile_program`` generates one module per fused gemm step (plain-store gemms run on
``torch.matmul``, i.e. cuBLAS on a GPU) and returns a ``CompiledProgram``. Calling it binds the
symbolic sizes from the inputs, analyses the program at those sizes (cached), allocates every tensor
the steps write (optionally poisoned with NaN so an unwritten element cannot pass verification;
an aux output may take over an intermediate's storage instead, ``storage_sharing``), and launches
the steps in order.

Its parts live beside it: ``run_plans`` (a run's decisions recorded and replayed),
``descriptors`` (TMA tensor descriptors), ``mainloop_choice`` (which kernel variant a launch
takes) and ``kernel_stats`` (registers, spills and shared memory of a compiled kernel). The names
callers use from them are importable from here as well.
"""

from __future__ import annotations

import functools
import math
import operator
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton
from triton.runtime.errors import OutOfResources

from . import backend
from .analysis import GemmInfo, ProgramInfo, analyze, bind_sizes
from .base import RunEnv
from .codegen.cache import load_kernel, write_source
from .codegen.configs import resolve_config
from .codegen.kernel import OPERAND_DESCRIPTORS, KernelSource, generate_kernel
from .cute.launch import CuteConfig, CuteLaunch
from .descriptors import TMA_MAX_BOX, descriptor_block, tma_available, tma_compatible
from .ir import GemmEpilogue, MainloopConfig, Program
from .kernel_stats import compiled_kernel_stats
from .launch import PinnedSequence, collected_launches, recorded_launches
from .mainloop_choice import Mainloop, choose_mainloop
from .prep.fusion import names_in, run_prep
from .reference import activation_dtype
from .run_plans import (
    RUN_PLAN_LIMIT,
    Action,
    Allocate,
    AuxLaunch,
    LaunchPlan,
    Relaunch,
    RunPlan,
    VendorProduct,
    argument_source,
    fresh_tensors,
    record_aux,
)
from .settings import current
from .storage_sharing import reads_after, shared_storage
from .types import KERNEL_DTYPES, TensorInfo, partials_shape, torch_dtype

# Whether ``CompiledProgram.run`` replays the run plans it recorded (``run_plans``); code and
# benchmarks may switch it for the whole process. CODA_DECIDE_EVERY_RUN=1: no replay.
REPLAY = not current().decide_every_run

# The epilogue backend every program's runs take, whatever each was compiled with (None: each its
# own ``epilogue_backend``); benchmarks switch it for the whole process to time the same programs,
# tuned once, on two backends side by side (bench/train_step.py's ``_triton`` variants).
BACKEND: str | None = None

__all__ = [  # the runtime's own names, and those of its parts that callers import from here
    "BACKEND",
    "REPLAY",
    "TMA_MAX_BOX",
    "CompiledProgram",
    "Mainloop",
    "choose_mainloop",
    "compile_program",
    "compiled_kernel_stats",
    "descriptor_block",
    "tma_available",
    "tma_compatible",
]


_WHOLE, _CUT, _PARTIALS_VIEW = 0, 1, 2  # how a block output is taken (``_output_views``)
_UNPINNED = object()  # a step without a tuned CuTe config (``CompiledProgram.cute_configs``)
_shape = operator.attrgetter("shape")


@dataclass
class CompiledProgram:
    """A Program with its generated kernels; call it like a function of the block's inputs."""

    program: Program
    kernels: dict[str, KernelSource]
    configs: dict[str, MainloopConfig] = field(default_factory=dict)  # pinned per step (tuning)
    # force a Triton kernel variant (tests, benchmarks): choose_mainloop; a forced variant runs
    # on Triton whatever the epilogue backend (the CuTe backend has one mainloop, QuACK's)
    mainloop: Mainloop = "auto"
    use_vendor: bool = True  # plain-store gemms on torch.matmul; False runs them on our mainloop
    mainloops_used: dict[str, str] = field(default_factory=dict)  # step -> mainloop last launched
    kernel_stats: dict[str, dict[str, int]] = field(default_factory=dict)  # step -> regs, spills
    _infos: dict[tuple, ProgramInfo] = field(default_factory=dict)  # by bound sizes
    _infos_by_shapes: dict[tuple, ProgramInfo] = field(default_factory=dict)
    _gemm_steps: dict[str, GemmEpilogue] = field(default_factory=dict)  # by step name
    _loaded: dict[str, Callable] = field(default_factory=dict)
    # (step, config, activation dtype) whose TMA-epilogue kernel needs more shared memory than the
    # GPU has (the staged tiles' bytes depend on the dtypes)
    _tma_epilogue_too_big: set[tuple[str, MainloopConfig, torch.dtype]] = field(default_factory=set)
    # Host work a launch would otherwise redo on every call (training steps, small shapes):
    # launch plans by (GemmInfo, variant, config, precision, device), epilogue tiles by (step,
    # config), default configs by (step, M, N, K). GemmInfo objects live as long as ``_infos``
    # holds them, so their ids stay theirs.
    _plans: dict[tuple, LaunchPlan] = field(default_factory=dict)
    _tiles: dict[tuple, list[tuple[str, list[int]]]] = field(default_factory=dict)
    _default_configs: dict[tuple, MainloopConfig] = field(default_factory=dict)
    _run_plans: dict[tuple, RunPlan] = field(default_factory=dict)  # by run signature (``run``)
    # the prep's kernel launches pinned in order, by the layouts of the inputs prep reads
    _prep_launches: dict[tuple, PinnedSequence] = field(default_factory=dict)
    _views: dict[int, list[tuple[str, str, int, Any]]] = field(default_factory=dict)  # by id(info)
    # Keep the last call's prep results and reuse them while the tensors prep reads are the same
    # memory, unchanged (``_prepare``): for weights that do not change between calls (inference,
    # generation, gradient accumulation), at the price of keeping one prepared copy.
    keep_prepared: bool = False
    _kept: tuple[tuple, dict[str, torch.Tensor], list[torch.Tensor]] | None = None
    # Which kernels run fused steps: "triton", "cute" or "auto" (``coda.primitives.cute``); a
    # step the CuTe backend does not cover runs on Triton, and why is kept in ``cute_refusals``.
    epilogue_backend: str = field(default_factory=lambda: current().epilogue_backend)
    # Pinned per step by tuning (``cute.tuning``): the CuTe config a step runs at, or None where
    # Triton ran it faster; a step not here runs at ``cute.launch.choose_config``'s config.
    cute_configs: dict[str, CuteConfig | None] = field(default_factory=dict)
    cute_refusals: dict[str, str] = field(default_factory=dict)  # step -> why it ran on Triton
    _cute_steps: dict[str, Any] = field(default_factory=dict)  # step -> cute.launch.CuteStep

    @property
    def backend(self) -> str:
        """The epilogue backend a run takes: the process's ``BACKEND`` where one is set, else the
        program's ``epilogue_backend``."""
        return BACKEND or self.epilogue_backend

    # -- analysis at the call's sizes ------------------------------------------------------------
    def info_for(self, inputs: dict[str, torch.Tensor]) -> ProgramInfo:
        # Looked up several times per call (host time on every training step): by the inputs'
        # shapes first, binding sizes only for shapes not seen before.
        shapes = tuple(zip(inputs, map(_shape, inputs.values()), strict=True))  # Size: a tuple
        if shapes not in self._infos_by_shapes:
            sizes = bind_sizes(self.program, {n: tuple(shape) for n, shape in shapes})
            key = tuple(sorted(sizes.items()))
            if key not in self._infos:
                self._infos[key] = analyze(self.program, sizes)
            self._infos_by_shapes[shapes] = self._infos[key]
        return self._infos_by_shapes[shapes]

    def config_for(self, name: str, gemm: GemmInfo) -> MainloopConfig:
        if name in self.configs:
            return self.configs[name]
        key = (name, gemm.M, gemm.N, gemm.K, gemm.column_multiple)
        if key not in self._default_configs:
            step = self._step(name)
            self._default_configs[key] = resolve_config(step.config, gemm)
        return self._default_configs[key]

    def configs_for(self, info: ProgramInfo) -> dict[str, MainloopConfig]:
        return {name: self.config_for(name, g) for name, g in info.gemms.items()}

    def _step(self, name: str) -> GemmEpilogue:
        if not self._gemm_steps:
            named = zip(self.program.step_names(), self.program.steps, strict=True)
            self._gemm_steps.update((n, s) for n, s in named if isinstance(s, GemmEpilogue))
        return self._gemm_steps[name]

    # -- running ---------------------------------------------------------------------------------
    def prepare(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inputs plus the prep results (weight layouts) the steps and outputs read — chains of
        prep steps fused (``prep/fusion.py``), so an intermediate only a chain reads is not kept.
        Every call prepares anew: in training the weights change between calls."""
        return self._prepare(inputs, self.info_for(inputs))

    def _prepare(
        self, inputs: dict[str, torch.Tensor], info: ProgramInfo
    ) -> dict[str, torch.Tensor]:
        """``prepare``; with ``keep_prepared``, the last call's prep results when every input prep
        reads is the same memory with the same layout and has not been written since: a
        parameter changed in place (an optimizer step, ``copy_``, ``load_state_dict``) bumps its
        version counter, and one replaced (a new tensor, ``param.data = …``) has another address
        — the kept inputs are held, so their memory cannot be another tensor's meanwhile. A write
        through ``.data`` (``p.data.mul_(…)``) bypasses the version counter and is not seen."""
        if not self.program.prep:
            return dict(inputs)
        if not self.keep_prepared:
            return self._run_prep(inputs, info)
        key = _unchanged_key([inputs[n] for n in self.prep_reads])
        if key is not None and self._kept is not None and self._kept[0] == key:
            return {**inputs, **self._kept[1]}
        self.release_prepared()  # before preparing anew
        tensors = self._run_prep(inputs, info)
        if key is not None:
            made = {n: t for n, t in tensors.items() if n not in inputs}
            self._kept = (key, made, [inputs[n] for n in self.prep_reads])
        return tensors

    def release_prepared(self) -> None:
        """Drop the prep results ``keep_prepared`` holds (the next call prepares anew)."""
        self._kept = None

    def _run_prep(
        self, inputs: dict[str, torch.Tensor], info: ProgramInfo
    ) -> dict[str, torch.Tensor]:
        """The prep steps on ``inputs``, their kernel launches pinned in the order the first call
        at the same layouts of the inputs prep reads made them (``launch.PinnedSequence``): those
        layouts — shapes, strides, dtypes, alignments — fix every prep launch's arguments, the
        rest being fresh (contiguous, aligned) prep results and sizes they bind."""
        env = RunEnv(dict(inputs), info.tensors, sizes=info.sizes)
        key = tuple(
            [
                (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)
                for t in map(inputs.__getitem__, self.prep_reads)
            ]
        )
        launches = self._prep_launches.get(key) if REPLAY else None
        if launches is not None:
            launches.run(run_prep, self.program.prep, env, self.read_by_steps)
            return env.tensors
        with recorded_launches() as calls:
            run_prep(self.program.prep, env, self.read_by_steps)
        if REPLAY:
            if len(self._prep_launches) >= RUN_PLAN_LIMIT:
                self._prep_launches.clear()
            self._prep_launches[key] = PinnedSequence(calls)
        return env.tensors

    @functools.cached_property
    def prep_reads(self) -> tuple[str, ...]:
        """The Program inputs its prep steps read (every input named in their dumps)."""
        named = names_in([step.model_dump() for step in self.program.prep])
        return tuple(n for n in self.program.inputs if n in named)

    @functools.cached_property
    def reads_after(self) -> list[frozenset[str]]:
        """Per step, the names the later steps and the outputs may read (a superset:
        ``storage_sharing.reads_after``)."""
        return reads_after(self.program)

    @functools.cached_property
    def read_by_steps(self) -> frozenset[str]:
        """Names the steps and outputs may read (every string in their dumps: a superset)."""
        names = names_in([step.model_dump() for step in self.program.steps])
        for value in self.program.outputs.values():
            names.add(value if isinstance(value, str) else value.tensor)
        return frozenset(names)

    def run(
        self, prepared: dict[str, torch.Tensor], *, poison: bool = False
    ) -> dict[str, torch.Tensor]:
        """Launch every step on prepared tensors; return all program tensors.

        The first call at a new *run signature* — the prepared tensors' shapes, strides, dtypes
        and 16-byte alignment, the device, the pinned configs, ``mainloop``, ``use_vendor`` and
        ``poison`` — decides everything step by step (sizes, allocations, the mainloop variant,
        kernel arguments) and records it as a ``RunPlan``; later calls with that signature
        replay the plan: allocate, build arguments, launch. Every decision depends only on what
        the signature holds (tensors a step allocates are contiguous and aligned), so a replay
        does what deciding anew would do, with a fraction of the host's work (bench/RESULTS.md,
        run 2026-12-01d). ``CODA_DECIDE_EVERY_RUN=1`` in the environment (module flag
        ``REPLAY``) decides every call anew."""
        return self._run(prepared, poison)[0]

    def _run(
        self, prepared: dict[str, torch.Tensor], poison: bool
    ) -> tuple[dict[str, torch.Tensor], RunPlan]:
        """``run``, with the plan it recorded or replayed."""
        if not REPLAY:
            self._refuse_dtype(prepared)
            return self._record(prepared, poison)
        key = self._run_key(prepared, poison)
        plan = self._run_plans.get(key)
        if plan is None:
            self._refuse_dtype(prepared)
            tensors, plan = self._record(prepared, poison)
            if len(self._run_plans) >= RUN_PLAN_LIMIT:
                self._run_plans.clear()
            self._run_plans[key] = plan
            return tensors, plan
        tensors = dict(prepared)
        env = RunEnv(tensors, plan.info.tensors, sizes=plan.info.sizes) if plan.needs_env else None
        for action in plan.actions:
            action(tensors, env)
        if plan.mainloops:  # only fused gemm steps launched by generated kernels record these
            self.mainloops_used.update(plan.mainloops)
            self.kernel_stats.update(plan.kernel_stats)
        return tensors, plan

    def _run_key(self, prepared: dict[str, torch.Tensor], poison: bool) -> tuple:
        """The run signature of ``prepared`` (see ``run``). Strides and alignment are read only
        for the tensors the steps and outputs may read (``read_by_steps``): a Program input only
        its prep steps read (e.g. ``w_gate`` beside the interleaved ``w_gu`` the GEMM reads)
        reaches no decision but through its shape (the size binding) and dtype, while the prep
        results made from it carry their own layouts."""
        read = self.read_by_steps
        layouts = tuple(
            [
                (n, t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)
                if n in read
                else (n, t.shape, t.dtype)
                for n, t in prepared.items()
            ]
        )
        device = next(iter(prepared.values())).device
        configs = tuple(self.configs.items())
        backend = (self.backend, tuple(self.cute_configs.items()))
        return (layouts, device, configs, self.mainloop, self.use_vendor, poison, backend)

    def _record(
        self, prepared: dict[str, torch.Tensor], poison: bool
    ) -> tuple[dict[str, torch.Tensor], RunPlan]:
        """Run every step deciding as it goes; return the tensors and the decisions as a plan."""
        info = self.info_for({n: prepared[n] for n in self.program.inputs})
        act = activation_dtype(self.program, prepared)
        device = next(iter(prepared.values())).device
        tensors = dict(prepared)
        env = RunEnv(tensors, info.tensors, sizes=info.sizes)
        plan = RunPlan(info)
        named = enumerate(zip(self.program.steps, self.program.step_names(), strict=True))
        for index, (step, name) in named:
            if isinstance(step, GemmEpilogue):
                gemm = info.gemms[name]
                actions = self._run_gemm(step, gemm, tensors, act, device, poison, info.sizes)
                if any(isinstance(a, Relaunch | CuteLaunch) for a in actions):  # generated, ran
                    plan.mainloops[name] = self.mainloops_used[name]
                    plan.kernel_stats[name] = self.kernel_stats.get(name, {})
            else:
                outputs = tuple(
                    (n, t.shape, torch_dtype(t.dtype, act))
                    for n, t in info.tensors.items()
                    if t.producer == name and t.partials is None
                )
                shared = () if poison else self._shared(index, step, outputs, tensors, info)
                fresh = tuple(o for o in outputs if o[0] not in dict(shared))
                allocate = Allocate(fresh, device, poison, shared)
                allocate(tensors, env)
                actions = [allocate]
                if any(math.prod(shape) for _, shape, _ in outputs):
                    # run now; replayed pinned where it can be (an empty batch: nothing to run)
                    actions.append(record_aux(step, tensors, env))
            plan.actions.extend(actions)
        plan.needs_env = any(isinstance(a, AuxLaunch) for a in plan.actions)
        plan.fresh_outputs = self._fresh_outputs(info, fresh_tensors(plan.actions))
        return tensors, plan

    def _fresh_outputs(self, info: ProgramInfo, fresh: frozenset[str]) -> frozenset[str]:
        """The block outputs that are a whole Program tensor in ``fresh`` (made anew by every run
        of a plan: ``run_plans.fresh_tensors``), each tensor counted for its first output only:
        such an output is no view and shares memory with no input and no other output."""
        outputs, seen = set(), set()
        for name, tensor, kind, _ in self._output_views(info):
            if kind == _WHOLE and tensor in fresh and tensor not in seen:
                outputs.add(name)
            seen.add(tensor)
        return frozenset(outputs)

    def _shared(
        self,
        index: int,
        step: Any,
        outputs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...],
        tensors: dict[str, torch.Tensor],
        info: ProgramInfo,
    ) -> tuple[tuple[str, str], ...]:
        """The outputs of aux step ``index`` that take over an input's storage, as (output,
        input) pairs (``storage_sharing``; never in poisoned runs)."""
        if not step.shares_storage:
            return ()
        steps = frozenset(self.program.step_names())
        later = self.reads_after[index]
        return shared_storage(step, outputs, later, tensors, info.tensors, steps)

    def collect_launches(
        self, inputs: dict[str, torch.Tensor], *, poison: bool = False, prepared: bool = False
    ) -> list[tuple[Any, Any, tuple, dict]]:
        """The kernel launches a call on ``inputs`` would make — ``run`` on them with
        ``prepared`` (the prep results are among them) — as ``(kernel, grid, args, meta)``,
        collected without launching (``launch.collected_launches``): what
        ``compile_ahead.compile_ahead_of`` compiles before the call. Prep and every step are
        decided anew at the current ``mainloop`` and configs (no plan replayed, none kept);
        allocations happen, kernels neither compile nor run. Sizes, layouts and dtypes decide
        every launch, so the unwritten tensors change none."""
        with collected_launches() as calls:
            if not prepared:
                info = self.info_for({n: inputs[n] for n in self.program.inputs})
                inputs = self._run_prep(inputs, info)
            self._record(inputs, poison)
        return calls

    def run_gemm_step(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Launch one fused gemm step on tensors a previous ``run`` produced (for tuning)."""
        self._gemm_step_actions(name, tensors)

    def step_launch(self, name: str, tensors: dict[str, torch.Tensor]) -> Callable[[], None]:
        """Launch one fused gemm step on tensors a previous ``run`` produced, deciding its kernel
        and config as a run would, and return what launches that kernel again on them — the
        launch a run plan replays, without the step's allocations (for timing). It launches into
        the tensors this call allocated, whatever later calls put in ``tensors``."""
        launch, own = self._gemm_step_actions(name, tensors)[-1], dict(tensors)
        return lambda: launch(own, None)

    def _gemm_step_actions(self, name: str, tensors: dict[str, torch.Tensor]) -> list[Action]:
        """Run fused gemm step ``name`` on ``tensors`` (a previous ``run``'s), deciding as a run
        would; its actions."""
        info = self.info_for({n: tensors[n] for n in self.program.inputs})
        act = activation_dtype(self.program, tensors)
        device = tensors[next(iter(self.program.inputs))].device
        step, gemm = self._step(name), info.gemms[name]
        return self._run_gemm(step, gemm, tensors, act, device, poison=False, sizes=info.sizes)

    def __call__(
        self, inputs: dict[str, torch.Tensor], *, poison: bool = False
    ) -> dict[str, torch.Tensor]:
        return self.run_outputs(inputs, poison=poison)[0]

    def run_outputs(
        self, inputs: dict[str, torch.Tensor], *, poison: bool = False
    ) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        """The block outputs of a call (what calling it returns), and which of them the call
        made anew as whole tensors (``RunPlan.fresh_outputs``): no view, no memory shared with an
        input or another output — a caller that must not return aliases need not check those."""
        info = self.info_for(inputs)
        tensors, plan = self._run(self._prepare(inputs, info), poison)
        outputs = {}
        for name, tensor, kind, view in self._output_views(info):
            t = tensors[tensor]
            if kind == _CUT:
                dim, start, length, index = view
                t = t.narrow(dim, start, length)[index]
            elif kind == _PARTIALS_VIEW:  # of a partials tensor: its own extent
                t = view.apply(t, info.sizes)
            outputs[name] = t
        return outputs, plan.fresh_outputs

    def _output_views(self, info: ProgramInfo) -> list[tuple[str, str, int, Any]]:
        """Each block output: its program tensor, how it is taken (``_WHOLE``, ``_CUT`` or
        ``_PARTIALS_VIEW``) and, for an ``OutputView``, the (dim, start, length, step index) that
        cut it at ``info``'s sizes — ``Program.select_outputs``'s views, their size expressions
        evaluated once per binding (a view of a partials tensor, whose allocated extent is not
        its declared one, stays an ``OutputView``)."""
        key = id(info)  # infos live as long as _infos holds them
        if key not in self._views:
            views: list[tuple[str, str, int, Any]] = []
            for name, value in self.program.outputs.items():
                if isinstance(value, str):
                    views.append((name, value, _WHOLE, None))
                    continue
                t = info.tensors[value.tensor]
                if t.partials is not None:
                    views.append((name, value.tensor, _PARTIALS_VIEW, value))
                    continue
                cut = value.cut(info.sizes, t.shape[value.dim])
                views.append((name, value.tensor, _CUT, cut))
            self._views[key] = views
        return self._views[key]

    def _refuse_dtype(self, prepared: dict[str, torch.Tensor]) -> None:
        """``TypeError`` for a run whose activations the kernels do not compute in: a dtype other
        than float32, float16 and bfloat16 (``KERNEL_DTYPES``; float64 operands would be read as
        another width's bits, and the outputs would be garbage), or bfloat16 where Triton's
        interpreter runs the generated kernels — its ``tl.dot`` on bf16 operands computes wrong
        products, so on a machine without a GPU the kernels run in float32 or float16 only (the
        vendor's products are PyTorch's). Collecting launches (``collect_launches``: nothing
        runs) is not refused."""
        act = activation_dtype(self.program, prepared)
        if act not in KERNEL_DTYPES:
            raise TypeError(
                f"{self.program.block}: activations in {act} — the kernels compute in float32, "
                "float16 or bfloat16; cast the inputs (or the model: e.g. model.float()) to one "
                "of those"
            )
        if not backend.INTERPRET or act != torch.bfloat16:
            return
        info = self.info_for({n: prepared[n] for n in self.program.inputs})
        fused = [n for n, g in info.gemms.items() if not (g.vendor and self.use_vendor)]
        if fused:
            raise TypeError(
                f"{self.program.block}: bfloat16 on the CPU — Triton's interpreter, which runs "
                f"the kernels of steps {fused} where there is no GPU, computes wrong bfloat16 "
                "matrix products. Run bfloat16 on a GPU; on the CPU use float32 or float16 "
                "(e.g. model.float(), or torch.autocast('cpu', dtype=torch.float16))"
            )

    def _run_gemm(
        self,
        step: GemmEpilogue,
        gemm: GemmInfo,
        tensors: dict[str, torch.Tensor],
        act: torch.dtype,
        device: torch.device,
        poison: bool,
        sizes: dict[str, int],
    ) -> list[Action]:
        """Run one gemm step, deciding its allocations and kernel; returns what it did as
        actions that redo it on other tensors of the same run signature."""
        if gemm.vendor and self.use_vendor:
            if self._plain_on_cute(gemm):
                actions = self._run_cute(step, gemm, tensors, act, device, poison)
                if actions is not None:
                    return actions
            self.mainloops_used.pop(gemm.name, None)  # cuBLAS (an earlier run's pin may differ)
            vendor = VendorProduct(step, act)
            vendor(tensors, None)
            return [vendor]
        if self.backend != "triton" and self.mainloop == "auto" and gemm.M and gemm.N:
            actions = self._run_cute(step, gemm, tensors, act, device, poison)
            if actions is not None:
                return actions
        cfg = self.config_for(gemm.name, gemm)
        allocate = Allocate(
            tuple((n, *_allocation(t, gemm, cfg, act)) for n, t in gemm.writes.items()),
            device,
            poison,
        )
        allocate(tensors, None)
        if gemm.M == 0 or gemm.N == 0:
            return [allocate]  # an empty batch: every tensor the epilogue writes is empty
        tiles = [(tensors[name], block) for name, block in self._epilogue_tiles(gemm.name, cfg)]
        variant = choose_mainloop(self.mainloop, step, tensors, device, epilogue_tiles=tiles)
        too_big = (gemm.name, cfg, act)
        if variant == "tma" and tiles and too_big in self._tma_epilogue_too_big:
            variant = "tma_mainloop"
        try:
            plan = self._launch(step, gemm, tensors, cfg, sizes, device, variant)
        except OutOfResources:
            # The epilogue's TMA tiles are staged in shared memory next to the mainloop's
            # pipeline; where both do not fit, the same mainloop with pointer tiles does. The
            # launch failed before running, so nothing was written.
            if variant != "tma" or not tiles:
                raise
            self._tma_epilogue_too_big.add(too_big)
            plan = self._launch(step, gemm, tensors, cfg, sizes, device, "tma_mainloop")
        return [allocate, Relaunch(plan, tensors)]

    def _plain_on_cute(self, gemm: GemmInfo) -> bool:
        """Whether plain-store step ``gemm`` runs on QuACK's GEMM rather than cuBLAS: only where
        tuning under ``auto`` pinned a CuTe config for it (``cute.tuning.tune_plain_steps``:
        cheaper than cuBLAS at these sizes)."""
        return (
            self.backend == "auto"
            and self.cute_configs.get(gemm.name) is not None
            and bool(gemm.M and gemm.N)
        )

    def _run_cute(
        self,
        step: GemmEpilogue,
        gemm: GemmInfo,
        tensors: dict[str, torch.Tensor],
        act: torch.dtype,
        device: torch.device,
        poison: bool,
    ) -> list[Action] | None:
        """Run step ``gemm`` on the CuTe backend and return its actions; None where it cannot
        (the reason kept in ``cute_refusals``) or tuning pinned Triton for it, and the step runs
        on Triton (a plain product: on cuBLAS)."""
        from . import cute

        config = self.cute_configs.get(gemm.name, _UNPINNED)
        if config is None:
            return None
        reason = cute.unavailable_reason(device)
        if reason is not None:
            if self.backend == "cute":
                raise RuntimeError(
                    f"CODA_EPILOGUE_BACKEND=cute, but the backend cannot run: {reason}"
                )
            self.cute_refusals[gemm.name] = reason
            return None
        from .cute.emit import CuteUnsupported
        from .cute.launch import CuteStep

        runner = self._cute_steps.get(gemm.name)
        if runner is None:
            runner = self._cute_steps[gemm.name] = CuteStep(step)
        try:
            pinned = None if config is _UNPINNED else config
            actions = runner.actions(gemm, tensors, act, device, poison, pinned)
        except CuteUnsupported as e:
            if self.backend == "cute" and gemm.name not in self.cute_refusals:
                warnings.warn(
                    f"{self.program.block}: step {gemm.name!r} runs on Triton: {e}", stacklevel=3
                )
            self.cute_refusals[gemm.name] = str(e)
            return None
        self.mainloops_used[gemm.name] = "cute"
        self.cute_refusals.pop(gemm.name, None)
        return actions

    def _epilogue_tiles(self, name: str, cfg: MainloopConfig) -> list[tuple[str, list[int]]]:
        """The tensors step ``name``'s epilogue moves as TMA tiles, with their block shapes."""
        key = (name, cfg)
        if key not in self._tiles:
            self._tiles[key] = [
                (p.tensor, descriptor_block(p, cfg))
                for p in self.kernels[name].variants["tma"].params
                if p.kind == "desc" and p.name not in OPERAND_DESCRIPTORS
            ]
        return self._tiles[key]

    def _launch(
        self,
        step: GemmEpilogue,
        gemm: GemmInfo,
        tensors: dict[str, torch.Tensor],
        cfg: MainloopConfig,
        sizes: dict[str, int],
        device: torch.device,
        variant: str,
    ) -> LaunchPlan:
        """Launch step ``gemm`` as ``variant``; returns its launch plan (which relaunches it)."""
        # fp32 operands: full-precision products (not tf32), to match PyTorch's fp32 matmul.
        precision = "ieee" if tensors[step.a.tensor].dtype == torch.float32 else "tf32"
        key = (id(gemm), variant, cfg, precision, device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(gemm, cfg, sizes, device, variant, precision)
        launched = plan.launch(tensors)
        self.mainloops_used[gemm.name] = variant
        self.kernel_stats[gemm.name] = compiled_kernel_stats(launched)
        return plan

    def _plan(
        self,
        gemm: GemmInfo,
        cfg: MainloopConfig,
        sizes: dict[str, int],
        device: torch.device,
        variant: str,
        precision: str,
    ) -> LaunchPlan:
        params = self.kernels[gemm.name].variants[variant].params
        num_tiles = triton.cdiv(gemm.M, cfg.block_m) * triton.cdiv(gemm.N, cfg.block_n)
        grid = (min(num_tiles, cfg.programs_per_sm * _num_sms(device)),)
        meta = {
            "BLOCK_SIZE_M": cfg.block_m,
            "BLOCK_SIZE_N": cfg.block_n,
            "BLOCK_SIZE_K": cfg.block_k,
            "GROUP_SIZE_M": cfg.group_m,
            "NUM_PROGRAMS": grid[0],
            "INPUT_PRECISION": precision,
            "EPILOGUE_SUBTILES": cfg.epilogue_subtiles,
            "EPI_N": cfg.epilogue_block_n,
            "FLATTEN": cfg.flatten,
            "WARP_SPECIALIZE": cfg.warp_specialize,
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
        }
        if cfg.maxnreg is not None:
            meta["maxnreg"] = cfg.maxnreg
        sources = tuple(argument_source(p, gemm, cfg, sizes) for p in params)
        return LaunchPlan(self._kernel(gemm.name, variant), grid, meta, sources)

    def _kernel(self, name: str, variant: str = "tma") -> Callable:
        key = f"{name}:{variant}"
        if key not in self._loaded:
            source = self.kernels[name]
            self._loaded[key] = load_kernel(source, source.variants[variant].function)
        return self._loaded[key]

    def cute_sources(self) -> dict[str, str]:
        """The CuTe module of each step that ran on the CuTe backend (its first, by dtypes)."""
        return {
            name: runner.sources()[0].text
            for name, runner in self._cute_steps.items()
            if runner.sources() and self.mainloops_used.get(name) == "cute"
        }

    def load_all(self) -> None:
        """Import every generated kernel (both mainloops): surfaces generation errors early."""
        for name, source in self.kernels.items():
            for variant in source.variants:
                self._kernel(name, variant)

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
        for name, runner in self._cute_steps.items():  # the CuTe modules the steps ran
            for k, source in enumerate(runner.sources()):
                dst = directory / f"{name}.cute{'' if k == 0 else k}.py"
                dst.write_text(source.text)
                paths.append(dst)
        return paths


def compile_program(
    program: Program, info: ProgramInfo, *, use_vendor: bool = True
) -> CompiledProgram:
    """Generate the kernels of ``program`` (types from ``info``, valid at every binding).

    ``use_vendor=False`` generates kernels for plain-store gemms too (to measure our mainloop
    against cuBLAS on the same problem).
    """
    kernels = {}
    for step, name in zip(program.steps, program.step_names(), strict=True):
        if isinstance(step, GemmEpilogue) and not (info.gemms[name].vendor and use_vendor):
            kernels[name] = generate_kernel(step, info.gemms[name], info.tensors, program.block)
    return CompiledProgram(program, kernels, use_vendor=use_vendor)


def _unchanged_key(tensors: list[torch.Tensor]) -> tuple | None:
    """What identifies ``tensors``' memory, layout and contents version (None where a tensor has
    no version counter, e.g. one made under ``torch.inference_mode``: nothing is kept then)."""
    key = []
    for t in tensors:
        if t.is_inference():
            return None
        key.append((t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device))
    return tuple(key)


def _allocation(
    t: TensorInfo, gemm: GemmInfo, cfg: MainloopConfig, act: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of tensor ``t`` that step ``gemm`` writes under ``cfg`` (partial sums:
    one column per tile along the reduced axis, fp32)."""
    if t.partials is not None:
        p = t.partials
        block = cfg.epilogue_block_n * p.length // gemm.N if p.axis == "row" else cfg.block_m
        return partials_shape(t.shape[0], p.length, block), torch.float32
    return t.shape, torch_dtype(t.dtype, act)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1 << 30  # interpreter: one program per tile
