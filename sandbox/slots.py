"""How many candidates this machine evaluates at once, and which GPU each worker gets.

A *slot* is one candidate in flight. ``worker_slots`` lists them, each as the value of
``CUDA_VISIBLE_DEVICES`` its worker runs with (``evaluate_candidate(gpu=...)``), or ``None`` for a
worker that is not pinned:

* on CUDA GPUs, one slot per GPU this process may use (the entries of its own
  ``CUDA_VISIBLE_DEVICES``, or ``0 … n-1``): a worker owns its GPU, so that a kernel's timing is
  never shared with another candidate's; a larger ``parallel`` is cut to the GPU count;
* under Triton's interpreter, ``parallel`` slots, by default ``min(CPU cores, 4)`` (a worker is
  mostly one busy core);
* in process (``SandboxOptions.isolate=False``), one slot: the stages of two candidates would share
  the process's Triton interpreter patches and random state.
"""

from __future__ import annotations

import os

import torch

from coda.primitives import backend

DEFAULT_CPU_SLOTS = 4  # interpreter workers at once when no ``parallel`` is given


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def visible_gpus() -> list[str]:
    """The GPUs this process may use, each as a worker's ``CUDA_VISIBLE_DEVICES`` value (none when
    kernels run in the interpreter)."""
    if backend.INTERPRET:
        return []
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(count)]
    return [v.strip() for v in visible.split(",") if v.strip()][:count]


def worker_slots(parallel: int | None = None, *, isolate: bool = True) -> list[str | None]:
    """One entry per candidate that may be evaluated at once: the GPU its worker is pinned to, or
    ``None``. ``parallel`` bounds the count (``None``: every GPU, or ``DEFAULT_CPU_SLOTS`` cores
    under the interpreter)."""
    if parallel is not None and parallel < 1:
        raise ValueError(f"parallel must be at least 1 (candidates at once), not {parallel}")
    if not isolate:
        return [None]
    gpus = visible_gpus()
    if gpus:
        return list(gpus[:parallel])
    count = parallel if parallel is not None else min(cpu_cores(), DEFAULT_CPU_SLOTS)
    return [None] * count
