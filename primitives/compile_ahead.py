"""Compile the kernels a run will launch before it launches them, several at a time.

Triton compiles a kernel the first time it is launched with a new specialization (dtypes,
alignments, integer classes, meta-parameters), on the launching thread, and a GPU compile of one
of coda's fused GEMMs takes about a second. A sandbox candidate launches many for the first
time: verify runs its Program at three shapes, in bf16, fp16 and float32, under two mainloops;
tuning screens eight mainloop configs per fused GEMM and benchmark shape. One after another those
compiles were most of a cold ``coda-agent synthesize`` (bench/RESULTS.md, run 2026-12-02d: 55
compiles, code generation and ``ptxas`` the largest items).

``compile_ahead_of(collect)`` takes the launches ``collect()`` returns, as
``launch.collected_launches`` collects them (a run made without launching), and compiles each
distinct one with ``JITFunction.warmup`` — the compile a launch does, without the launch — on a
pool of threads, as Triton's own ``AsyncCompileMode`` does. Each compiled kernel lands in its
``JITFunction``'s cache for the device the launch was collected on, so the real launch finds it
and compiles nothing.

Threads overlap what a compile does outside the interpreter lock: above all ``ptxas``, a
subprocess, about 40% of a compile of a fused GEMM for sm_90; the MLIR and LLVM passes in
Triton's bindings hold the lock (twelve compiles on a 2-core machine: 14.4 s on one thread, 9.4 s
on two). Worker processes would overlap all of it, at the price of a process start and a
module import per worker.

Nothing changes what runs: a warmed kernel is the one the launch would have compiled, from the
same arguments and meta-parameters on the same device. A launch that fails to compile here is
only counted; it fails again where it is launched, with its error where that caller expects it.
Under the interpreter nothing compiles; with ``CODA_COMPILE_THREADS=1`` this does nothing and
every kernel compiles at its first launch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from . import backend
from .launch import TensorDescriptor, launch_signature
from .settings import current

Launch = tuple[Any, Any, tuple, dict]  # (kernel, grid, args, meta)

# More threads than this cannot pay: a compile holds the interpreter lock for most of its time.
MAX_THREADS = 16


@dataclass(frozen=True)
class Ahead:
    """What ``compile_ahead_of`` did: ``kernels`` distinct launches compiled (or found compiled),
    ``failed`` of them failing to compile, on ``threads`` threads (one per group of
    ``groups`` at most) in ``seconds``; ``skipped``:
    why nothing was compiled ahead ("" when it was)."""

    kernels: int = 0
    failed: int = 0
    threads: int = 0
    seconds: float = 0.0
    skipped: str = ""


def compile_threads() -> int:
    """Threads for compiling ahead: ``CODA_COMPILE_THREADS``, else one per CPU this process may
    run on, at most ``MAX_THREADS``."""
    chosen = current().compile_threads
    if chosen is not None:
        return chosen
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API on this platform
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def distinct(launches: Iterable[Launch]) -> list[Launch]:
    """One launch per kernel and argument signature (``launch.launch_signature``): launches
    that compile the same kernel once. A launch whose signature is unknown is kept."""
    seen: set[tuple] = set()
    kept = []
    for call in launches:
        kernel, _grid, args, meta = call
        key = launch_signature(kernel, args, meta)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        kept.append(call)
    return kept


def groups(launches: Iterable[Launch]) -> list[list[Launch]]:
    """``launches`` in groups that one thread compiles one after another, the groups side by
    side: launches of one kernel with the same meta-parameters and the same dtypes, alignments
    and descriptor blocks, differing only in integers, floats or descriptor shapes. Triton
    specializes those only by class (an integer on 1, multiples of 16 and its width), so such
    launches often compile one binary: compiled in turn, a later one finds the earlier's in the
    kernel's cache, where side by side both would compile it. A launch with an argument of
    another type is a group of its own."""
    grouped: dict[Any, list[Launch]] = {}
    for call in launches:
        kernel, _grid, args, meta = call
        key = _binary_class(kernel, args, meta)
        grouped.setdefault(object() if key is None else key, []).append(call)
    return list(grouped.values())


def _binary_class(kernel: Any, args: tuple, meta: dict[str, Any]) -> tuple | None:
    """What of a launch always changes the compiled binary (see ``groups``); None: unknown."""
    key: list[Any] = [kernel]
    for name, value in meta.items():
        if not isinstance(value, int | float | bool | str) and value is not None:
            return None
        key.append((name, type(value), value))
    for arg in args:
        if isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif isinstance(arg, bool) or arg is None or isinstance(arg, str):
            key.append((type(arg), arg))
        elif isinstance(arg, int | float):
            key.append(type(arg))
        elif TensorDescriptor is not None and type(arg) is TensorDescriptor:
            base = arg.base
            key.append((base.dtype, base.data_ptr() % 16 == 0, tuple(arg.block_shape)))
        else:
            return None
    return tuple(key)


def compile_ahead_of(
    collect: Callable[[], Iterable[Launch]], *, threads: int | None = None
) -> Ahead:
    """Compile the kernels of the launches ``collect()`` returns (``(kernel, grid, args,
    meta)``, as ``launch.collected_launches`` or ``CompiledProgram.collect_launches`` collect
    them) on ``threads`` threads (default ``compile_threads()``), for the current CUDA device;
    returns what it did. ``collect`` is not called where nothing would compile ahead: under the
    interpreter, or with one thread. Compiling ahead only saves time: where ``collect`` raises,
    nothing is compiled ahead and the error is left to the run itself, which meets it where its
    caller reports it."""
    threads = compile_threads() if threads is None else threads
    if backend.INTERPRET:
        return Ahead(skipped="the interpreter compiles nothing")
    if threads < 2:
        return Ahead(skipped="one compile thread: kernels compile at their first launch")
    try:
        launches = list(collect())
    except Exception as e:  # noqa: BLE001 - the run raises it again, where it is reported
        return Ahead(skipped=f"collecting the launches failed: {type(e).__name__}: {e}")
    return _compile_all(launches, threads)


def _compile_all(launches: Iterable[Launch], threads: int) -> Ahead:
    todo = [c for c in distinct(launches) if hasattr(c[0], "warmup")]
    if not todo:
        return Ahead(skipped="nothing to compile")
    device = torch.cuda.current_device()
    start = time.perf_counter()
    for kernel in {id(call[0]): call[0] for call in todo}.values():
        _caches_for(kernel, device)
    batches = groups(todo)
    workers = min(threads, len(batches))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coda-compile") as pool:
        failed = sum(pool.map(lambda batch: sum(_compile(c, device) for c in batch), batches))
    return Ahead(len(todo), failed, workers, round(time.perf_counter() - start, 3))


def _caches_for(kernel: Any, device: int) -> None:
    """Make ``kernel``'s per-device caches now, on this thread: a ``JITFunction`` creates its
    compiled-kernel cache for a device on first use, and threads that first use it at once would
    each create one — the compiles stored in all but the last would be lost to the launch."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        caches[device]  # a defaultdict: the lookup creates them


def _compile(call: Launch, device: int) -> bool:
    """Compile one launch's kernel on ``device`` without launching it; whether that failed."""
    kernel, grid, args, meta = call
    try:
        with torch.cuda.device(device):
            kernel.warmup(*args, grid=grid, **meta)
    except Exception:  # noqa: BLE001 - left to fail at its launch, with its error there
        return True
    return False
