"""Which outputs of an aux step take over an input's storage instead of being allocated.

An aux step whose kernel reads each element of an input once and writes an output's element at
the same index after reading it, in the same program, declares so (``AuxStep.shares_storage``,
output field → input field): ``ce_grad_rows`` may write ``dz`` over the logits it reads, so the
chunked LM-head loss holds one ``[rows, V]`` buffer per chunk where it held two. Whether a run
shares is the runtime's decision (``CompiledProgram._record`` asks ``shared_storage``; the pairs
go into the step's ``Allocate`` in the run plan, so every replay shares the same), never a
Program's: nothing in the IR asks for it. The input's storage is taken over only when it is

* an intermediate a previous step produced — never a Program input, a prep result, or anything
  else the caller holds;
* read by nothing after the step: no later step names it (every string in their dumps, a
  superset of what they read), no Program output is it, and the step itself names it only in the
  declared field;
* the output's shape and dtype, contiguous, the whole of its storage, and no other tensor of the
  run shares that storage (a view under another name).

Otherwise the output is allocated as usual. Poisoned runs (``poison=True``, how the sandbox
verifies) never share: a shared output starts out holding the input's finite values instead of
NaN, so an element the kernel failed to write would pass as a stale input value. Poisoned runs
thus check that the kernel writes every element; sharing only changes where the same values
land, which the runtime's tests check bit for bit against unshared runs.
"""

from __future__ import annotations

import torch

from .base import AuxStep
from .ir import Program
from .prep.fusion import names_in
from .types import TensorInfo


def reads_after(program: Program) -> list[frozenset[str]]:
    """For each step index, the names the later steps and the outputs may read (a superset)."""
    reads = {v if isinstance(v, str) else v.tensor for v in program.outputs.values()}
    after = []
    for step in reversed(program.steps):
        after.append(frozenset(reads))
        reads |= names_in(step.model_dump())
    return after[::-1]


def shared_storage(
    step: AuxStep,
    allocations: tuple[tuple[str, tuple[int, ...], torch.dtype], ...],
    later_reads: frozenset[str],
    tensors: dict[str, torch.Tensor],
    infos: dict[str, TensorInfo],
    step_names: frozenset[str],
) -> tuple[tuple[str, str], ...]:
    """The (output, input) pairs of ``step`` whose output may be the input's tensor (module
    docstring): ``allocations`` are the step's outputs (name, shape, dtype) as it would allocate
    them, ``later_reads`` what may be read after it (``reads_after``), ``tensors`` the run's
    tensors so far, ``infos`` their analysed types, ``step_names`` the Program's step names."""
    pairs = []
    for out_field, in_field in step.shares_storage.items():
        out, src = getattr(step, out_field), getattr(step, in_field)
        allocation = next((a for a in allocations if a[0] == out), None)
        if allocation is None or src in later_reads or _named_elsewhere(step, in_field, src):
            continue
        info = infos.get(src)
        if info is None or info.partials is not None or info.producer not in step_names:
            continue  # a Program input, a prep result, or partial sums
        if _owns_storage(tensors, src, allocation[1], allocation[2]):
            pairs.append((out, src))
    return tuple(pairs)


def _named_elsewhere(step: AuxStep, field: str, name: str) -> bool:
    """Whether ``step`` names ``name`` in a field other than ``field`` (it reads it again)."""
    others = {k: v for k, v in step.model_dump().items() if k != field}
    return name in names_in(others)


def _owns_storage(
    tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> bool:
    """Whether ``tensors[name]`` has ``shape`` and ``dtype``, is contiguous, spans its whole
    storage and shares it with no other tensor of the run."""
    t = tensors[name]
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        return False
    storage = t.untyped_storage()
    if t.numel() == 0 or t.storage_offset() or storage.nbytes() != t.numel() * t.element_size():
        return False
    return not any(
        other.untyped_storage().data_ptr() == storage.data_ptr()
        for n, other in tensors.items()
        if n != name
    )
