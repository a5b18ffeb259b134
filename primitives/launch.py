"""Launch a compiled Triton kernel without Triton's per-call Python work.

``kernel[grid](*args, **meta)`` runs ``JITFunction.run`` on every call: it binds the arguments
to the signature, specializes each one (dtype, 16-byte alignment, integers equal to 1 or
divisible by 16), builds the cache key, looks the compiled kernel up, builds launch metadata and
only then launches — tens of microseconds of host time per launch on the H200's host, paid by
every fused GEMM and every small aux kernel of a training step (bench/RESULTS.md, run 2026-12-01c).

``launch_kernel(kernel, grid, *args, **meta)`` does the same first launch for each *argument
signature* and keeps the compiled kernel Triton returned; later launches with the same signature
call its launcher directly. The signature is at least as fine as Triton's specialization, so the
kernel it finds is the one Triton would have: per tensor its dtype and whether its address is
16-byte aligned; per integer, float, bool or string its value and type (a constexpr parameter
compiles per value; Triton specializes other integers only on 1 and multiples of 16); per tensor
descriptor its base's dtype and alignment, block shape, shape and strides; the meta-parameters
(the same way) and the current device.
Anything else (an argument type it does not know) takes Triton's own path every time, as does the
CPU interpreter, which compiles nothing.

``PinnedLaunch(kernel, grid, **meta)`` goes one step further for a caller that knows every later
call has the first one's signature (``CompiledProgram``'s run plans key their launches by the
tensors' dtypes, layouts and alignments): after the first launch it skips the signature too.

``CODA_TRITON_LAUNCH=1`` in the environment makes every launch take Triton's path (to compare the
two, or to rule this module out when a launch misbehaves).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from triton import knobs
from triton.runtime.driver import driver

from . import backend
from .settings import current

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host tensor descriptors
    TensorDescriptor = None


class _Unknown(Exception):
    """An argument whose specialization this module does not reproduce."""


def _signature(args: tuple[Any, ...]) -> tuple:
    """The key of positional arguments, or of ``(name, value)`` meta-parameters (one loop: it
    runs on every launch)."""
    key: list[Any] = []
    for arg in args:
        if type(arg) is tuple:  # a (name, value) meta-parameter
            key.append(arg[0])
            arg = arg[1]
        kind = type(arg)
        if kind is int or kind is bool or kind is float or arg is None or kind is str:
            key.append(arg)  # by value: a constexpr parameter compiles per value
            key.append(kind)  # True, 1 and 1.0 are different specializations
        elif isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif TensorDescriptor is not None and kind is TensorDescriptor:
            base = arg.base
            key.append(
                (
                    base.dtype,
                    base.data_ptr() % 16 == 0,
                    tuple(arg.block_shape),
                    tuple(arg.shape),
                    tuple(arg.strides),
                    getattr(arg, "padding", None),
                )
            )
        else:
            raise _Unknown
    return tuple(key)


def _device_and_stream() -> tuple[int, int]:
    """The current CUDA device and stream, as Triton's launch takes them."""
    device = driver.active.get_current_device()
    return device, driver.active.get_current_stream(device)


class _Entry:
    """A compiled kernel and the names of the parameters passed as keywords, in order."""

    __slots__ = ("compiled", "tail")

    def __init__(self, compiled: Any, tail: Sequence[str]) -> None:
        self.compiled, self.tail = compiled, tuple(tail)


# (kernel, its meta-parameters, device, argument signature) -> _Entry (None: always Triton's path)
_CACHE: dict[tuple, _Entry | None] = {}
_CACHE_LIMIT = 4096  # signatures kept (integers are keyed by value: every new size adds one)
DIRECT = not current().triton_launch  # CODA_TRITON_LAUNCH=1: every launch through Triton


class _Recording(threading.local):
    """The launches ``recorded_launches`` collects in this thread (None: not recording)."""

    calls: list[tuple[Any, Any, tuple, dict]] | None = None


_RECORDING = _Recording()


@contextmanager
def recorded_launches() -> Iterator[list[tuple[Any, Any, tuple, dict]]]:
    """Collect ``(kernel, grid, args, meta)`` of every ``launch_kernel`` call this thread makes
    until the block ends (the launches still happen): how ``run_plans.record_aux`` learns what
    an aux step launches."""
    previous = _RECORDING.calls
    _RECORDING.calls = calls = []
    try:
        yield calls
    finally:
        _RECORDING.calls = previous


def launch_kernel(kernel: Any, grid: Sequence[int], *args: Any, **meta: Any) -> Any:
    """``kernel[grid](*args, **meta)`` (returns what it returns: the compiled kernel), by the
    compiled kernel's own launcher once this argument signature has launched before."""
    if _RECORDING.calls is not None:
        _RECORDING.calls.append((kernel, grid, args, meta))
    if backend.INTERPRET or not DIRECT:
        return kernel[grid](*args, **meta)
    try:
        device, stream = _device_and_stream()
        key = (kernel, _signature(tuple(meta.items())), device, _signature(args))
    except _Unknown:
        return kernel[grid](*args, **meta)
    entry = _CACHE.get(key, False)
    if entry is False:
        compiled = kernel[grid](*args, **meta)
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = _entry(kernel, compiled, len(args), meta)
        return compiled
    if entry is None:
        return kernel[grid](*args, **meta)
    return _run(entry, grid, stream, [*args, *(meta[name] for name in entry.tail)])


def _entry(kernel: Any, compiled: Any, n_args: int, meta: dict[str, Any]) -> _Entry | None:
    """How to relaunch ``compiled``: every parameter after the positional ones must have come as
    a keyword (a default Triton filled in is not reproduced: such kernels keep Triton's path)."""
    names = getattr(kernel, "arg_names", None)
    if names is None or not hasattr(compiled, "run"):
        return None
    tail = names[n_args:]
    return _Entry(compiled, tail) if all(n in meta for n in tail) else None


def _run(entry: _Entry, grid: Sequence[int], stream: int, args: list[Any]) -> Any:
    compiled = entry.compiled
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    metadata = compiled.launch_metadata(grid, stream, *args)
    compiled.run(
        g0,
        g1,
        g2,
        stream,
        compiled.function,
        compiled.packed_metadata,
        metadata,
        knobs.runtime.launch_enter_hook,
        knobs.runtime.launch_exit_hook,
        *args,
    )
    return compiled


class PinnedLaunch:
    """One launch site of ``kernel`` with a fixed grid and meta-parameters whose arguments always
    have the signature of its first call (the caller guarantees it): the first call goes through
    ``launch_kernel``, later ones straight to the compiled kernel's launcher — no signature, no
    cache lookup. Where ``launch_kernel`` would take Triton's path (the interpreter,
    ``CODA_TRITON_LAUNCH=1``, a kernel it cannot relaunch) every call does, as does a call on
    another current device than the first."""

    __slots__ = ("kernel", "grid", "meta", "entry", "device", "tail")

    def __init__(self, kernel: Any, grid: Sequence[int], **meta: Any) -> None:
        self.kernel, self.grid, self.meta = kernel, tuple(grid), meta
        self.entry: _Entry | None = None
        self.device: int | None = None
        self.tail: tuple[Any, ...] = ()  # the entry's keyword values, in its order

    def __call__(self, *args: Any) -> Any:
        """Launch on ``args``; returns the compiled kernel (see ``launch_kernel``)."""
        if self.entry is None or not DIRECT:
            compiled = launch_kernel(self.kernel, self.grid, *args, **self.meta)
            if DIRECT and not backend.INTERPRET:
                self.device = _device_and_stream()[0]
                entry = self.entry = _entry(self.kernel, compiled, len(args), self.meta)
                self.tail = () if entry is None else tuple(self.meta[n] for n in entry.tail)
            return compiled
        device, stream = _device_and_stream()
        if device != self.device:
            return launch_kernel(self.kernel, self.grid, *args, **self.meta)
        return _run(self.entry, self.grid, stream, [*args, *self.tail])


def clear() -> None:
    """Forget every kept compiled kernel (tests; a process that reloads kernels)."""
    _CACHE.clear()
