"""A run's steps as replayable actions: what ``CompiledProgram.run`` decided at one run signature
(allocations, vendor products, aux launches, fused-GEMM launches with where each argument comes
from), replayed on later calls with the same signature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .analysis import GemmInfo, ProgramInfo
from .base import RunEnv
from .codegen.context import Param
from .descriptors import (
    DescriptorTemplate,
    TensorDescriptor,
    descriptor_block,
    unchecked_descriptor,
)
from .ir import GemmEpilogue, MainloopConfig
from .launch import PinnedLaunch, PinnedSequence, launch_kernel, recorded_launches
from .sizes import evaluate as evaluate_size
from .types import torch_dtype

RUN_PLAN_LIMIT = 256  # run signatures kept per compiled program


def empty_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, poison: bool
) -> torch.Tensor:
    if poison and dtype.is_floating_point:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


class Action:
    """One thing a run does, replayable on another call's tensors of the same run signature."""

    def __call__(self, tensors: dict[str, torch.Tensor], env: RunEnv | None) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Allocate(Action):
    """Allocate tensors (name, shape, dtype) a step writes — NaN-filled when ``poison`` — and
    give each ``shared`` output (output, input) the input's tensor instead (``storage_sharing``
    decided it may)."""

    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    device: torch.device
    poison: bool
    shared: tuple[tuple[str, str], ...] = ()

    def __call__(self, tensors: dict[str, torch.Tensor], env: RunEnv | None) -> None:
        if self.poison:
            for name, shape, dtype in self.tensors:
                tensors[name] = empty_tensor(shape, dtype, self.device, True)
        else:  # torch.empty itself: a replay allocates here on every call
            for name, shape, dtype in self.tensors:
                tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
        for out, src in self.shared:
            tensors[out] = tensors[src]


@dataclass(frozen=True)
class VendorProduct(Action):
    """A plain-store gemm step on ``torch.matmul`` (cuBLAS on a GPU)."""

    step: GemmEpilogue
    act: torch.dtype
    operands: tuple = field(init=False, repr=False, compare=False)

    def __call__(self, tensors: dict[str, torch.Tensor], env: RunEnv | None) -> None:
        a_name, a_t, b_name, b_t, out_name, dtype = self.operands
        a, b = tensors[a_name], tensors[b_name]
        a = a.T if a_t else a
        b = b.T if b_t else b
        out = a @ b if dtype == a.dtype else (a.float() @ b.float())
        tensors[out_name] = out if out.dtype == dtype else out.to(dtype)

    def __post_init__(self) -> None:
        # ``a``, whether it is transposed, ``b``, likewise, the output and its dtype: read from
        # the step once (a replay runs this product on every call)
        step = self.step
        (store,) = step.epilogue
        dtype = torch_dtype(store.dtype, self.act)
        operands = (step.a.tensor, step.a.transpose, step.b.tensor, step.b.transpose, store.to)
        object.__setattr__(self, "operands", (*operands, dtype))


class AuxLaunch(Action):
    """An aux step's kernel, into its outputs (allocated by the ``Allocate`` before it): its
    ``launch`` called anew, with the launches the recorded call made pinned in order
    (``launch.PinnedSequence``) — at one run signature the step launches the same kernels,
    grids and meta-parameters on arguments whose signatures the run signature fixes (the
    tensors' layouts, dtypes and alignments; its temporaries are fresh, aligned allocations;
    ``AuxStep``)."""

    def __init__(self, step: Any, calls: tuple = ()) -> None:
        self.step, self.pinned = step, PinnedSequence(calls)

    def __call__(self, tensors: dict[str, torch.Tensor], env: RunEnv | None) -> None:
        self.pinned.run(self.step.launch, env)


class PinnedAuxLaunch(Action):
    """A recorded aux step: its kernel launches pinned (``launch.PinnedLaunch``), each argument a
    constant or a tensor of the call by name (``record_aux``)."""

    def __init__(self, step: Any, launches: tuple[tuple[PinnedLaunch, tuple], ...]) -> None:
        self.step, self.launches = step, launches
        # each launch with its constant arguments in place and where the call's tensors go
        self._filled = tuple((launch, *_template(slots)) for launch, slots in launches)

    def __call__(self, tensors: dict[str, torch.Tensor], env: RunEnv | None) -> None:
        for launch, template, tensor_at in self._filled:
            args = template.copy()
            for i, name in tensor_at:
                args[i] = tensors[name]
            launch(*args)


def _template(slots: tuple[tuple, ...]) -> tuple[list[Any], tuple[tuple[int, str], ...]]:
    """The argument list of ``slots`` with the constants in place (None where a tensor goes), and
    each tensor's ``(position, name)``: a replay copies the list and fills in the tensors."""
    template = [None if slot[0] != _CONST else slot[1] for slot in slots]
    return template, tuple((i, slot[1]) for i, slot in enumerate(slots) if slot[0] == _PTR)


def record_aux(step: Any, tensors: dict[str, torch.Tensor], env: RunEnv) -> Action:
    """Run aux ``step`` on ``tensors`` (its outputs allocated) and return what replays it at
    this run signature: its launches pinned (``PinnedAuxLaunch``) when the step is
    ``replayable`` and every tensor it launched on is one of ``tensors``, else the step itself
    (``AuxLaunch``: ``launch`` called anew each time — a temporary, a view, a callable grid —
    with the launches it made now pinned in order)."""
    with recorded_launches() as calls:
        step.launch(env)
    if not step.replayable:
        return AuxLaunch(step, tuple(calls))
    names = {id(t): n for n, t in tensors.items()}
    launches = []
    for kernel, grid, args, meta in calls:
        slots = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if id(arg) not in names:
                    return AuxLaunch(step, tuple(calls))
                slots.append((_PTR, names[id(arg)]))
            else:
                slots.append((_CONST, arg))
        if callable(grid):
            return AuxLaunch(step, tuple(calls))
        launches.append((PinnedLaunch(kernel, grid, **meta), tuple(slots)))
    return PinnedAuxLaunch(step, tuple(launches))


@dataclass
class RunPlan:
    """What ``CompiledProgram.run`` did at one run signature, as actions to replay, with the
    mainloop variant and compiled-kernel statistics of each fused gemm step it launched.
    Filled in once the run is recorded (``CompiledProgram._record``): ``needs_env``, whether an
    action reads the ``RunEnv`` (an ``AuxLaunch``; the others take the tensors only, so a
    replay without one builds none); ``fresh_outputs``, the block outputs every run of the plan
    returns as tensors it made itself (``fresh_tensors``)."""

    info: ProgramInfo
    actions: list[Action] = field(default_factory=list)
    mainloops: dict[str, str] = field(default_factory=dict)
    kernel_stats: dict[str, dict[str, int]] = field(default_factory=dict)
    needs_env: bool = True
    fresh_outputs: frozenset[str] = frozenset()


def fresh_tensors(actions: list[Action]) -> frozenset[str]:
    """The Program tensors that every run of ``actions`` makes anew, as whole tensors that
    share memory with nothing the run was given: the outputs of an ``Allocate`` (not those that
    take over another tensor's storage) and of a ``VendorProduct``. An ``AuxLaunch`` (a step
    whose own ``launch`` runs, which may bind its outputs to other tensors) takes back the
    names of the ``Allocate`` just before it."""
    fresh: set[str] = set()
    last: tuple[str, ...] = ()
    for action in actions:
        if isinstance(action, Allocate):
            last = tuple(name for name, _, _ in action.tensors)
            fresh.update(last)
            fresh.difference_update(out for out, _ in action.shared)
        elif isinstance(action, VendorProduct):
            fresh.add(action.operands[4])
        elif isinstance(action, AuxLaunch):
            fresh.difference_update(last)
    return frozenset(fresh)


@dataclass(frozen=True)
class LaunchPlan:
    """One fused-GEMM launch at one size binding, config and variant: the kernel, its grid and
    meta-parameters, and where each argument comes from — ``("const", None, value)`` or
    ``(kind, tensor, detail)`` read from the call's tensors (``ptr``; ``stride``/``shape`` along
    dim ``detail``; ``desc``, a TMA descriptor with block shape ``detail``)."""

    kernel: Any
    grid: tuple[int]
    meta: dict[str, Any]
    sources: tuple[tuple[str, str | None, Any], ...]

    def launch(self, tensors: dict[str, torch.Tensor]) -> Any:
        """Launch on ``tensors`` through ``launch_kernel``; returns the compiled kernel (a run's
        replay relaunches through ``Relaunch`` instead)."""
        return launch_kernel(self.kernel, self.grid, *self.arguments(tensors), **self.meta)

    def arguments(self, tensors: dict[str, torch.Tensor], *, checked: bool = True) -> list[Any]:
        """The launch arguments on ``tensors``. ``checked=False`` builds descriptors without
        Triton's validation (a replay: the recording's descriptors passed it, and the run
        signature fixes everything it checks)."""
        describe = TensorDescriptor if checked else unchecked_descriptor
        args: list[Any] = []
        for kind, name, detail in self.sources:
            if kind == "const":
                args.append(detail)
                continue
            t = tensors[name]  # type: ignore[index]
            if kind == "ptr":
                args.append(t)
            elif kind == "desc":
                args.append(describe(t, list(t.shape), list(t.stride()), detail))
            elif kind == "stride":
                args.append(t.stride(detail))
            else:
                args.append(t.shape[detail])
        return args


_CONST, _PTR, _DESC = 0, 1, 2  # how a Relaunch gets each argument (``Relaunch.slots``)


class Relaunch(Action):
    """A recorded fused-gemm launch: its plan's kernel pinned to the argument signature of the
    run signature it was recorded at (``launch.PinnedLaunch``), with every argument that the run
    signature fixes worked out once, from the ``tensors`` it was recorded on.

    A run signature fixes every prepared tensor's shape and strides, and a step allocates its
    outputs contiguous at sizes the signature binds: so a stride or shape argument is a constant
    of the replay, and a TMA descriptor differs between calls only in its base tensor. A replay
    then only looks up the call's tensors (``slots``: a constant, a tensor by name, or a
    descriptor of a tensor by name with its fixed shape, strides and block)."""

    def __init__(self, plan: LaunchPlan, tensors: dict[str, torch.Tensor]) -> None:
        self.plan = plan
        self.launch = PinnedLaunch(plan.kernel, plan.grid, **plan.meta)
        self.slots = tuple(_slot(source, tensors) for source in plan.sources)
        self._template, self._tensor_at = _template(self.slots)
        # each descriptor's position, its tensor's name and its fields but the base
        self._descriptor_at = tuple(
            (i, name, DescriptorTemplate(*layout))  # layout: shape, strides, block
            for i, (kind, name, *layout) in enumerate(self.slots)
            if kind == _DESC
        )

    def arguments(self, tensors: dict[str, torch.Tensor]) -> list[Any]:
        """The launch arguments on ``tensors`` (of the run signature it was recorded at): the
        recorded constants, with the call's tensors and their descriptors (without Triton's
        checks: ``DescriptorTemplate``) filled in."""
        args = self._template.copy()
        for i, name in self._tensor_at:
            args[i] = tensors[name]
        for i, name, descriptor in self._descriptor_at:
            args[i] = descriptor.on(tensors[name])
        return args

    def __call__(self, tensors: dict[str, torch.Tensor], env: RunEnv | None) -> Any:
        return self.launch(*self.arguments(tensors))


def _slot(source: tuple[str, str | None, Any], tensors: dict[str, torch.Tensor]) -> tuple:
    """How a replay gets the argument of ``source`` (see ``LaunchPlan``), its layout read from
    the recording's ``tensors``."""
    kind, name, detail = source
    if kind == "const":
        return (_CONST, detail)
    if kind == "ptr":
        return (_PTR, name)
    t = tensors[name]  # type: ignore[index]
    if kind == "desc":
        return (_DESC, name, tuple(t.shape), tuple(t.stride()), detail)
    return (_CONST, t.stride(detail) if kind == "stride" else t.shape[detail])


def argument_source(
    p: Param, gemm: GemmInfo, cfg: MainloopConfig, sizes: dict[str, int]
) -> tuple[str, str | None, Any]:
    """Where parameter ``p``'s launch value comes from (see ``LaunchPlan``)."""
    if p.kind == "ptr":
        return ("ptr", p.tensor, None)
    if p.kind in ("stride", "shape"):
        return (p.kind, p.tensor, p.dim)
    if p.kind == "desc":
        return ("desc", p.tensor, descriptor_block(p, cfg))
    if p.expr is not None:
        return ("const", None, evaluate_size(p.expr, sizes))
    return ("const", None, {"M": gemm.M, "N": gemm.N, "K": gemm.K}[p.name])
