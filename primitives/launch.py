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
``PinnedSequence`` pins the launches of code that calls ``launch_kernel`` itself (an aux step
that allocates temporaries or launches on views, which a run plan calls anew): in its ``run``,
the n-th ``launch_kernel`` call goes to the n-th pinned launch when its kernel, grid and
meta-parameters are the recorded ones.

Both hand the compiled kernel's launcher what ``kernel[grid]`` would. Where that launcher is the
one this module knows — Triton 3.6's ``CudaLauncher``, recognised by its attributes and by the code
of its ``__call__`` and of its descriptor wrapper, with no scratch memory to allocate — a relaunch
goes further and calls the C launch function that ``make_launcher`` compiled for the kernel with its
final argument list (``_Direct``). It skips:

- ``launch_metadata`` and the launch hooks: with no hook set the C function calls none and reads no
  launch metadata, so it gets None for all three (Triton 3.6 passes its two empty hook chains,
  which the C function calls to do nothing, and builds the metadata dict they would be given);
- ``CudaLauncher.__call__`` and its scratch allocations (both sizes are 0: nothing to allocate);
- per TMA descriptor, building its ``CUtensorMap`` again: Triton's ``make_tensordesc_arg`` expands
  a descriptor into a ``CUtensorMap`` (made by the C ``fill_tma_descriptor`` from the base's
  address, the shape, strides and padding, and the kernel's fixed swizzle, element type and block)
  followed by the shape and strides. Each descriptor position keeps the expansions Triton's
  function made for it (per ``launch_kernel`` signature, per ``PinnedLaunch``), keyed by all the
  map takes from the descriptor — base address, shape, strides and padding — so a training step
  that gets the same addresses from the allocator step after step builds none (at most
  ``_DESCRIPTOR_LIMIT`` kept per position). The signature already fixes all but the address;
  keying on the rest keeps a ``PinnedLaunch`` whose caller broke its promise exact. A map holds
  an address and a layout, nothing of the tensor: one kept for memory since freed and handed to
  another tensor of that layout describes the new tensor. A descriptor the kernel was not
  compiled to read by TMA is expanded by Triton's function on every launch (that expansion holds
  the base tensor, which is not kept).

It does not apply — the relaunch calls the launcher as ``kernel[grid]`` would — while a launch hook
is set (``knobs.runtime.launch_enter_hook``/``launch_exit_hook``: a profiler's hooks need the launch
metadata), for a kernel with global or profile scratch memory, and on any Triton whose launcher it
does not recognise (Triton 3.9's, among others).

``CODA_TRITON_LAUNCH=1`` in the environment makes every launch take Triton's path (to compare the
two, or to rule this module out when a launch misbehaves).
"""

from __future__ import annotations

import inspect
import threading
import types
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
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
        self.direct = _direct(compiled)


# The parameters of Triton 3.6's ``CudaLauncher.__call__``, and every global and attribute name it
# reads: a launcher whose ``__call__`` reads another (a sanitizer's state, a default scratch
# allocator) does something this module does not reproduce.
_LAUNCHER_PARAMS = ("self", "gridX", "gridY", "gridZ", "stream", "function")
_LAUNCHER_NAMES = frozenset(
    {
        "_allocation",
        "_allocator",
        "_profile_allocator",
        "global_scratch_align",
        "global_scratch_size",
        "launch",
        "launch_cooperative_grid",
        "launch_pdl",
        "profile_scratch_align",
        "profile_scratch_size",
    }
)
_LAUNCHER_ATTRIBUTES = (
    "launch",
    "global_scratch_size",
    "profile_scratch_size",
    "launch_cooperative_grid",
    "launch_pdl",
)
# Likewise its ``wrap_handle_tensordesc``'s ``inner``, which expands each descriptor argument.
_WRAPPER_FREEVARS = frozenset({"launcher", "tensordesc_indices", "tensordesc_meta"})
_WRAPPER_NAMES = frozenset(
    {"_BASE_ARGS_FORMAT_LEN", "append", "enumerate", "extend", "list", "make_tensordesc_arg"}
)
_BASE_ARGS = 13  # what the C launch function takes before the kernel's arguments
_RAW_LAUNCH_TYPES: tuple[type, ...] = (types.BuiltinFunctionType,)  # a C function
_DESCRIPTOR_LIMIT = 64  # expansions kept per descriptor position (base addresses seen)


class _Direct:
    """How to call a compiled kernel's C launch function as Triton 3.6's ``CudaLauncher`` does
    when no hook is set and no scratch is needed: the function, the kernel's handle, cooperative
    and PDL flags and packed metadata, and per descriptor argument (last first) its position,
    Triton's ``make_tensordesc_arg``, its ``tensordesc_meta`` and its kept expansions (None: a
    descriptor not read by TMA, expanded anew each launch)."""

    __slots__ = ("launch", "function", "cooperative", "pdl", "packed", "descriptors")

    def __init__(
        self,
        launch: Any,
        compiled: Any,
        launcher: Any,
        descriptors: tuple[tuple[int, Any, Any, dict | None], ...],
    ) -> None:
        self.launch, self.function = launch, compiled.function
        self.cooperative, self.pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        self.packed = compiled.packed_metadata
        self.descriptors = descriptors

    def expand(self, args: list[Any]) -> None:
        """Replace each descriptor in ``args`` by Triton's expansion of it, kept per position by
        what the ``CUtensorMap`` depends on besides the kernel's fixed ``tensordesc_meta``."""
        for i, make, meta, kept in self.descriptors:
            desc = args[i]
            if kept is None:
                args[i : i + 1] = make(desc, meta)
                continue
            key = (desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
            expanded = kept.get(key)
            if expanded is None:
                if len(kept) >= _DESCRIPTOR_LIMIT:
                    kept.clear()
                expanded = kept[key] = make(desc, meta)
            args[i : i + 1] = expanded


def _direct(compiled: Any) -> _Direct | None:
    """``compiled``'s C launch call, or None where its launcher is not Triton 3.6's
    ``CudaLauncher`` (by its ``__call__``'s code and attributes) or needs scratch memory."""
    launcher = getattr(compiled, "_run", None)
    call = type(launcher).__dict__.get("__call__")
    if not _code_is(call, _LAUNCHER_PARAMS, _LAUNCHER_NAMES, varargs=True):
        return None
    if not all(hasattr(launcher, name) for name in _LAUNCHER_ATTRIBUTES):
        return None
    if launcher.global_scratch_size or launcher.profile_scratch_size:
        return None
    launch, descriptors = launcher.launch, ()
    if not isinstance(launch, _RAW_LAUNCH_TYPES):
        unwrapped = _unwrap(launch)
        if unwrapped is None:
            return None
        launch, descriptors = unwrapped
    return _Direct(launch, compiled, launcher, descriptors)


def _unwrap(inner: Any) -> tuple[Any, tuple] | None:
    """The C launch function inside Triton 3.6's descriptor wrapper ``inner`` and its descriptor
    positions (see ``_Direct``), or None where ``inner`` is not that wrapper around one."""
    if not _code_is(inner, (), _WRAPPER_NAMES, varargs=True):
        return None
    code = inner.__code__
    if frozenset(code.co_freevars) != _WRAPPER_FREEVARS:
        return None
    contents = (cell.cell_contents for cell in inner.__closure__)
    cells = dict(zip(code.co_freevars, contents, strict=True))
    launch, metas = cells["launcher"], cells["tensordesc_meta"]
    positions = sorted(cells["tensordesc_indices"])
    make = inner.__globals__.get("make_tensordesc_arg")
    if (
        not isinstance(launch, _RAW_LAUNCH_TYPES)
        or inner.__globals__.get("_BASE_ARGS_FORMAT_LEN") != _BASE_ARGS
        or not _code_is(make, ("arg", "metadata"), None, varargs=False)
        or len(metas) != len(positions)
    ):
        return None
    # ``inner`` gives the n-th descriptor (by position) the n-th meta; ``expand`` goes last first
    pairs = reversed(list(zip(positions, metas, strict=True)))
    descriptors = tuple((i, make, meta, None if meta is None else {}) for i, meta in pairs)
    return launch, descriptors


def _code_is(
    fn: Any, params: tuple[str, ...], names: frozenset[str] | None, *, varargs: bool
) -> bool:
    """Whether Python function ``fn`` takes exactly ``params`` (then ``*args`` when ``varargs``)
    and reads no global or attribute outside ``names`` (None: any)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    return (
        code.co_varnames[: code.co_argcount] == params
        and bool(code.co_flags & inspect.CO_VARARGS) == varargs
        and not code.co_kwonlyargcount
        and (names is None or frozenset(code.co_names) <= names)
    )


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
        if direct.descriptors:
            direct.expand(args)
        # as CudaLauncher.__call__ passes them: no scratch, and no metadata or hooks (none set)
        direct.launch(
            g0, g1, g2, stream, direct.function, direct.cooperative, direct.pdl,
            None, None, direct.packed, None, None, None, *args,
        )  # fmt: skip
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
