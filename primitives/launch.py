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
descriptor its base's dtype and alignment, block shape, shape, strides, padding and TF32 rounding;
the meta-parameters (the same way) and the current device. Anything else (an argument type it
does not know) takes Triton's own path every time, as does the CPU interpreter, which compiles
nothing.

``PinnedLaunch(kernel, grid, **meta)`` goes one step further for a caller that knows every later
call has the first one's signature (``CompiledProgram``'s run plans key their launches by the
tensors' dtypes, layouts and alignments): after the first launch it skips the signature too.
``PinnedSequence`` pins the launches of code that calls ``launch_kernel`` itself (an aux step
that allocates temporaries or launches on views, which a run plan calls anew): in its ``run``,
the n-th ``launch_kernel`` call goes to the n-th pinned launch when its kernel, grid and
meta-parameters are the recorded ones.

Both hand the compiled kernel's launcher what ``kernel[grid]`` would. Where that launcher is one
``direct_launch`` recognises (Triton 3.6's or 3.9's ``CudaLauncher``, with no scratch memory), a
relaunch goes further and calls the C launch function with the argument list the launcher would
build — no launch metadata, no hook chains, no ``CudaLauncher.__call__``, and the TMA descriptors'
tensor maps kept per position and base address (see that module). It does not while a launch hook
is set (``knobs.runtime.launch_enter_hook``/``launch_exit_hook``: a profiler's hooks need the
launch metadata): the relaunch then calls the launcher as ``kernel[grid]`` would.

``CODA_TRITON_LAUNCH=1`` in the environment makes every launch take Triton's path (to compare the
two, or to rule this module out when a launch misbehaves).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from triton import knobs
from triton.runtime.driver import driver

from . import backend
from .direct_launch import Direct36, Direct39, direct_call
from .settings import current

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host tensor descriptors
    TensorDescriptor = None

try:
    from triton.knobs import HookChain as _HookChain
except ImportError:  # a Triton whose hooks are plain callables or None
    _HookChain = None


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
                    getattr(arg, "round_f32_to_tf32", False),  # Triton 3.9's TF32 rounding
                )
            )
        else:
            raise _Unknown
    return tuple(key)


def launch_signature(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> tuple | None:
    """What decides which compiled ``kernel`` a launch on ``args`` with ``meta`` uses, on the
    current device (at least as fine as Triton's specialization); None for an argument this
    module does not key."""
    try:
        return (kernel, _signature(tuple(meta.items())), _signature(args))
    except _Unknown:
        return None


def _device_and_stream() -> tuple[int, int]:
    """The current CUDA device and stream, as Triton's launch takes them: its active driver's
    queries, PyTorch's raw device query in place of ``torch.cuda.current_device`` (the one
    Triton's GPU drivers install, whose wrapper only sets CUDA up: a relaunch follows a launch)."""
    global _QUERIES
    active = driver.active
    queries = _QUERIES
    if queries[0] is not active:
        queries = _QUERIES = (active, *_queries(active))
    device = queries[1]()
    return device, queries[2](device)


_QUERIES: tuple[Any, Any, Any] = (None, None, None)  # (driver, device(), stream(device))


def _queries(active: Any) -> tuple[Any, Any]:
    get_device, get_stream = active.get_current_device, active.get_current_stream
    raw_device = getattr(torch._C, "_cuda_getDevice", None)
    if get_device is torch.cuda.current_device and raw_device is not None:
        return raw_device, get_stream
    return get_device, get_stream


class _Entry:
    """A compiled kernel, the names of the parameters passed as keywords, in order, and how to
    call its C launch function directly (None: through its launcher)."""

    __slots__ = ("compiled", "tail", "direct")

    def __init__(self, compiled: Any, tail: Sequence[str]) -> None:
        self.compiled, self.tail = compiled, tuple(tail)
        self.direct: Direct36 | Direct39 | None = direct_call(compiled)


# (kernel, its meta-parameters, device, argument signature) -> _Entry (None: always Triton's path)
_CACHE: dict[tuple, _Entry | None] = {}
_CACHE_LIMIT = 4096  # signatures kept (integers are keyed by value: every new size adds one)
DIRECT = not current().triton_launch  # CODA_TRITON_LAUNCH=1: every launch through Triton


class _Calls(threading.local):
    """The launches a context manager below collects in this thread (None: none active)."""

    calls: list[tuple[Any, Any, tuple, dict]] | None = None


_RECORDING = _Calls()  # recorded_launches: recorded, and launched
_COLLECTING = _Calls()  # collected_launches: collected instead of launched


@contextmanager
def _collecting_into(holder: _Calls) -> Iterator[list[tuple[Any, Any, tuple, dict]]]:
    previous = holder.calls
    holder.calls = calls = []
    try:
        yield calls
    finally:
        holder.calls = previous


def recorded_launches() -> AbstractContextManager[list[tuple[Any, Any, tuple, dict]]]:
    """Collect ``(kernel, grid, args, meta)`` of every ``launch_kernel`` call this thread makes
    until the block ends (the launches still happen): how ``run_plans.record_aux`` learns what
    an aux step launches."""
    return _collecting_into(_RECORDING)


def collecting() -> bool:
    """Whether this thread is inside ``collected_launches`` (code that launches by other means
    than ``launch_kernel`` must then launch nothing)."""
    return _COLLECTING.calls is not None


def collected_launches() -> AbstractContextManager[list[tuple[Any, Any, tuple, dict]]]:
    """Collect ``(kernel, grid, args, meta)`` of every ``launch_kernel`` call this thread makes
    until the block ends, *without launching*: each call returns None and its kernel neither
    compiles nor runs, so whatever the launches would have written keeps its old bytes. Code
    run inside must not use a launch's result or read what a launch writes to decide anything;
    ``compile_ahead`` compiles what was collected. Recording (``recorded_launches``) inside
    the block still records."""
    return _collecting_into(_COLLECTING)


class _Sequence(threading.local):
    """The pinned launches a ``PinnedSequence`` replays in this thread (None: none active) and
    the index of the next ``launch_kernel`` call among them."""

    pins: tuple[PinnedLaunch | None, ...] | None = None
    next: int = 0


_SEQUENCE = _Sequence()


class PinnedSequence:
    """The launches one call of some code makes through ``launch_kernel``, pinned in order, for
    code whose later calls launch the same kernels with the same grids and meta-parameters on
    arguments of the same signatures (the caller guarantees the signatures, as for
    ``PinnedLaunch``): in ``sequence.run(fn, *args)`` the n-th ``launch_kernel`` call goes to
    the n-th ``PinnedLaunch`` when kernel, grid and meta-parameters are the recorded ones, and
    takes ``launch_kernel``'s own path otherwise (as does a launch with a callable grid, which
    is not pinned). ``calls``: what ``recorded_launches`` collected from one call."""

    __slots__ = ("pins",)

    def __init__(self, calls: Sequence[tuple[Any, Any, tuple, dict]]) -> None:
        self.pins = tuple(
            PinnedLaunch(kernel, grid, **meta) if isinstance(grid, tuple | list) else None
            for kernel, grid, _args, meta in calls
        )

    def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with this sequence's launches pinned (in this thread; nests)."""
        outer = _SEQUENCE.pins, _SEQUENCE.next
        _SEQUENCE.pins, _SEQUENCE.next = self.pins, 0
        try:
            return fn(*args)
        finally:
            _SEQUENCE.pins, _SEQUENCE.next = outer


def _pinned(kernel: Any, grid: Sequence[int], meta: dict[str, Any]) -> PinnedLaunch | None:
    """The active sequence's next pinned launch if it is ``kernel`` at ``grid`` with ``meta``."""
    pins, index = _SEQUENCE.pins, _SEQUENCE.next
    _SEQUENCE.next = index + 1
    pin = pins[index] if index < len(pins) else None  # type: ignore[arg-type]
    if pin is None or pin.kernel is not kernel or pin.meta != meta:
        return None
    return pin if pin.grid == (grid if type(grid) is tuple else tuple(grid)) else None


def launch_kernel(kernel: Any, grid: Sequence[int], *args: Any, **meta: Any) -> Any:
    """``kernel[grid](*args, **meta)`` (returns what it returns: the compiled kernel), by the
    compiled kernel's own launcher once this argument signature has launched before (by a
    pinned launch inside a ``PinnedSequence`` that recorded this call). Inside
    ``collected_launches``: collected, not launched, and None."""
    if _RECORDING.calls is not None:
        _RECORDING.calls.append((kernel, grid, args, meta))
    if _COLLECTING.calls is not None:
        _COLLECTING.calls.append((kernel, grid, args, meta))
        return None
    pins = _SEQUENCE.pins
    if pins is not None:
        pin = _pinned(kernel, grid, meta)
        if pin is not None:
            _SEQUENCE.pins = None  # a pinned launch's first call comes back here
            try:
                return pin(*args)
            finally:
                _SEQUENCE.pins = pins
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
    """Launch ``entry``'s kernel on ``args`` (all of them, in order; ``args`` is the caller's
    own list: the direct call expands its descriptors in place)."""
    compiled = entry.compiled
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    direct = entry.direct
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if direct is not None and _unset(enter) and _unset(leave):
        direct(g0, g1, g2, stream, args)
        return compiled
    metadata = compiled.launch_metadata(grid, stream, *args)
    compiled.run(
        g0,
        g1,
        g2,
        stream,
        compiled.function,
        compiled.packed_metadata,
        metadata,
        enter,
        leave,
        *args,
    )
    return compiled


def _unset(hook: Any) -> bool:
    """Whether launch hook ``hook`` calls nothing: None, or a ``HookChain`` with no calls."""
    return hook is None or (type(hook) is _HookChain and not hook.calls)


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
        if _COLLECTING.calls is not None:  # collected, and the entry kept
            return launch_kernel(self.kernel, self.grid, *args, **self.meta)
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
