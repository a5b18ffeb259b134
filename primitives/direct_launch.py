"""Call a compiled Triton kernel's C launch function directly, as its own launcher would.

A relaunch through the compiled kernel (``compiled.launch_metadata(...)`` then
``compiled.run(...)``, what ``launch.py`` does for a signature that launched before) still runs
Triton's Python launcher on every launch: it builds launch metadata for the launch hooks, calls
``CudaLauncher.__call__`` (which allocates nothing for a kernel without scratch memory), and per
TMA descriptor argument builds its ``CUtensorMap`` again (``make_tensordesc_arg``:
``fill_tma_descriptor`` from the base's address, the shape, strides and padding, and the kernel's
fixed swizzle, element type and block). ``direct_call(compiled)`` recognises the launchers whose
code it knows and returns a callable that hands the C function the argument list that launcher
would, skipping:

- the launch metadata and the hooks: with no hook set (``launch.py`` checks on every launch) the C
  function calls none and reads no metadata, so it gets None for all three — where Triton passes
  its two empty hook chains, which the C function calls to do nothing, and builds the metadata
  they would be given;
- ``CudaLauncher.__call__`` and its scratch allocations (both sizes must be 0);
- per TMA descriptor, building its ``CUtensorMap`` again: each descriptor position keeps the
  expansions Triton's ``make_tensordesc_arg`` made for it, keyed by all the map takes from the
  descriptor (base address, shape, strides, padding, and on Triton 3.9 the TF32 rounding flag) —
  so a training step that gets the same addresses from the allocator step after step builds none
  (at most ``DESCRIPTOR_LIMIT`` kept per position). The argument signature already fixes all but
  the address; keying on the rest keeps a caller that broke its promise of a fixed signature
  exact. A map holds an address and a layout, nothing of the tensor: one kept for memory since
  freed and handed to another tensor of that layout describes the new tensor. A descriptor the
  kernel was not compiled to read by TMA (and, on Triton 3.9, an im2col one) is expanded by
  Triton's function on every launch (that expansion holds the base tensor, which is not kept).

Two launchers are recognised, each by its ``__call__``'s parameters and every global and
attribute name it reads, by the attributes it uses and by the code of its descriptor wrapper:

- Triton 3.6's: the C function takes the launch's 13 leading arguments then the kernel's
  arguments one by one; its descriptor wrapper (``wrap_handle_tensordesc``'s ``inner``) expands
  each descriptor position in Python (``Direct36``).
- Triton 3.9's: the C function takes 15 leading arguments (the 13, then the launcher's argument
  annotations and packed kernel signature) and the kernel's arguments as one sequence; the
  wrapper flattens descriptors with libtriton's ``make_tensordesc_args``, which calls
  ``make_tensordesc_arg`` per descriptor. The direct call runs that same C++ function with a
  ``make_tensordesc_arg`` that keeps expansions (``Direct39``); the launcher must not have its
  sanitizer (``gsan``) enabled.

Anything else — another Triton's launcher, a ``__call__`` that reads a name these do not, a
wrapper of another shape, scratch memory — gets None, and ``launch.py`` calls the launcher as
``kernel[grid]`` would.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

# What a C launch function is (tests put a recording stand-in here).
RAW_LAUNCH_TYPES: tuple[type, ...] = (types.BuiltinFunctionType,)
DESCRIPTOR_LIMIT = 64  # expansions kept per descriptor position (base addresses seen)

# --- Triton 3.6 ---------------------------------------------------------------------------------

_PARAMS_36 = ("self", "gridX", "gridY", "gridZ", "stream", "function")
_NAMES_36 = frozenset(
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
_ATTRIBUTES_36 = (
    "launch",
    "global_scratch_size",
    "profile_scratch_size",
    "launch_cooperative_grid",
    "launch_pdl",
)
# its ``wrap_handle_tensordesc``'s ``inner``, which expands each descriptor argument
_WRAPPER_FREEVARS_36 = frozenset({"launcher", "tensordesc_indices", "tensordesc_meta"})
_WRAPPER_NAMES_36 = frozenset(
    {"_BASE_ARGS_FORMAT_LEN", "append", "enumerate", "extend", "list", "make_tensordesc_arg"}
)
_BASE_ARGS_36 = 13  # what the C launch function takes before the kernel's arguments


class Direct36:
    """Triton 3.6's C launch call: the function, the kernel's handle, cooperative and PDL flags
    and packed metadata, and per descriptor argument (last first) its position, Triton's
    ``make_tensordesc_arg``, its ``tensordesc_meta`` and its kept expansions (None: a descriptor
    not read by TMA, expanded anew each launch)."""

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

    def __call__(self, g0: int, g1: int, g2: int, stream: int, args: list[Any]) -> None:
        """Launch on ``args`` (the caller's own list: descriptors are expanded in place)."""
        if self.descriptors:
            self.expand(args)
        # as CudaLauncher.__call__ passes them: no scratch, and no metadata or hooks (none set)
        self.launch(
            g0, g1, g2, stream, self.function, self.cooperative, self.pdl,
            None, None, self.packed, None, None, None, *args,
        )  # fmt: skip

    def expand(self, args: list[Any]) -> None:
        """Replace each descriptor in ``args`` by Triton's expansion of it, kept per position by
        what the ``CUtensorMap`` depends on besides the kernel's fixed ``tensordesc_meta``."""
        for i, make, meta, kept in self.descriptors:
            desc = args[i]
            if kept is None:
                args[i : i + 1] = make(desc, meta)
                continue
            key = (desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
            args[i : i + 1] = _kept(kept, key, make, desc, meta)

    def kept_maps(self) -> list[dict]:
        """The kept expansions of each descriptor position read by TMA."""
        return [kept for *_, kept in self.descriptors if kept is not None]


def _direct_36(compiled: Any, launcher: Any, call: Any) -> Direct36 | None:
    if not _code_is(call, _PARAMS_36, _NAMES_36, varargs=True):
        return None
    if not _usable(launcher, _ATTRIBUTES_36):
        return None
    launch, descriptors = launcher.launch, ()
    if not isinstance(launch, RAW_LAUNCH_TYPES):
        unwrapped = _unwrap_36(launch)
        if unwrapped is None:
            return None
        launch, descriptors = unwrapped
    return Direct36(launch, compiled, launcher, descriptors)


def _unwrap_36(inner: Any) -> tuple[Any, tuple] | None:
    """The C launch function inside Triton 3.6's descriptor wrapper ``inner`` and its descriptor
    positions (see ``Direct36``), or None where ``inner`` is not that wrapper around one."""
    cells = _closure(inner, _WRAPPER_NAMES_36, _WRAPPER_FREEVARS_36)
    if cells is None:
        return None
    launch, metas = cells["launcher"], cells["tensordesc_meta"]
    positions = sorted(cells["tensordesc_indices"])
    make = inner.__globals__.get("make_tensordesc_arg")
    if (
        not isinstance(launch, RAW_LAUNCH_TYPES)
        or inner.__globals__.get("_BASE_ARGS_FORMAT_LEN") != _BASE_ARGS_36
        or not _code_is(make, ("arg", "metadata"), None, varargs=False)
        or len(metas) != len(positions)
    ):
        return None
    # ``inner`` gives the n-th descriptor (by position) the n-th meta; ``expand`` goes last first
    pairs = reversed(list(zip(positions, metas, strict=True)))
    descriptors = tuple((i, make, meta, None if meta is None else {}) for i, meta in pairs)
    return launch, descriptors


# --- Triton 3.9 ---------------------------------------------------------------------------------

_PARAMS_39 = (
    *_PARAMS_36,
    "kernel_metadata",
    "launch_metadata",
    "launch_enter_hook",
    "launch_exit_hook",
)
# its ``__call__`` reads these (the sanitizer's names only when ``gsan_enabled``, required False)
_NAMES_39 = frozenset(
    {
        "GSAN_PER_DEVICE_STATE_STRIDE",
        "RuntimeError",
        "_allocation",
        "_allocator",
        "_profile_allocator",
        "_stream_sync",
        "active",
        "arg_annotations",
        "driver",
        "experimental",
        "get_current_device",
        "get_device_rank",
        "get_global_state_pointer",
        "get_launch_state",
        "global_scratch_align",
        "global_scratch_size",
        "gsan",
        "gsan_enabled",
        "has_profile_allocator",
        "is_stream_capturing",
        "kernel_signature",
        "launch",
        "launch_cooperative_grid",
        "launch_pdl",
        "profile_scratch_align",
        "profile_scratch_size",
        "runtime",
        "triton",
        "triton.experimental.gsan._allocator",
        "triton.experimental.gsan._stream_sync",
        "utils",
    }
)
_ATTRIBUTES_39 = (*_ATTRIBUTES_36, "arg_annotations", "kernel_signature", "gsan_enabled")
# ``wrap_handle_tensordesc_impl``'s ``inner`` (triton/backends/driver.py)
_WRAPPER_FREEVARS_39 = frozenset(
    {"launcher", "make_tensordesc_arg", "relevant_paths", "signature", "tensordesc_meta"}
)
_WRAPPER_NAMES_39 = frozenset({"make_tensordesc_args"})


class Direct39:
    """Triton 3.9's C launch call: the function, the launch's leading arguments after the grid
    and stream (the kernel's handle, cooperative and PDL flags, packed metadata, None for the
    metadata, hooks and scratch, the argument annotations and packed signature), and for a
    kernel with descriptor arguments how its wrapper flattens them (``_Expansion``)."""

    __slots__ = ("launch", "head", "expansion")

    def __init__(
        self, launch: Any, compiled: Any, launcher: Any, expansion: _Expansion | None
    ) -> None:
        self.launch, self.expansion = launch, expansion
        self.head = (
            compiled.function,
            launcher.launch_cooperative_grid,
            launcher.launch_pdl,
            compiled.packed_metadata,
            None,  # launch metadata
            None,  # enter hook
            None,  # exit hook
            None,  # global scratch
            None,  # profile scratch
            launcher.arg_annotations,
            launcher.kernel_signature,
        )

    def __call__(self, g0: int, g1: int, g2: int, stream: int, args: list[Any]) -> None:
        """Launch on ``args`` (all the kernel's arguments, in order)."""
        base = (g0, g1, g2, stream, *self.head)
        expansion = self.expansion
        if expansion is not None:
            args = expansion.flatten(
                args, expansion.signature, expansion.paths, expansion.metas, base, expansion.make
            )
        self.launch(*base, args)

    def kept_maps(self) -> list[dict]:
        """The kept expansions of each descriptor position read by TMA."""
        return [] if self.expansion is None else list(self.expansion.kept.values())


class _Expansion:
    """What Triton 3.9's descriptor wrapper closes over — the C++ ``make_tensordesc_args`` that
    flattens the arguments, the kernel's signature, the descriptors' paths in it, their
    ``tensordesc_meta`` — and ``make``, which it calls per descriptor: Triton's
    ``make_tensordesc_arg`` with each tiled TMA position's expansions kept (by the identity of
    the position's meta, which the wrapper hands it)."""

    __slots__ = ("flatten", "signature", "paths", "metas", "triton_make", "kept", "make")

    def __init__(self, flatten: Any, cells: dict[str, Any]) -> None:
        self.flatten = flatten
        self.signature, self.paths = cells["signature"], cells["relevant_paths"]
        self.metas, self.triton_make = cells["tensordesc_meta"], cells["make_tensordesc_arg"]
        metas = self.metas or ()
        self.kept: dict[int, dict] = {
            id(meta): {} for meta in metas if meta is not None and not meta.get("is_im2col")
        }
        self.make: Callable[[Any, Any, Any], Any] = self._make

    def _make(self, desc: Any, meta: Any, base: Any) -> Any:
        kept = self.kept.get(id(meta)) if meta is not None else None
        if kept is None:
            return self.triton_make(desc, meta, base)
        key = (
            desc.base.data_ptr(),
            *desc.shape,
            *desc.strides,
            desc.padding,
            desc.round_f32_to_tf32,
        )
        return _kept(kept, key, self.triton_make, desc, meta, base)


def _direct_39(compiled: Any, launcher: Any, call: Any) -> Direct39 | None:
    if not _code_is(call, _PARAMS_39, _NAMES_39, varargs=True):
        return None
    if not _usable(launcher, _ATTRIBUTES_39) or launcher.gsan_enabled:
        return None
    launch, expansion = launcher.launch, None
    if not isinstance(launch, RAW_LAUNCH_TYPES):
        inner = launch
        cells = _closure(inner, _WRAPPER_NAMES_39, _WRAPPER_FREEVARS_39)
        if cells is None:
            return None
        launch, make = cells["launcher"], cells["make_tensordesc_arg"]
        flatten = inner.__globals__.get("make_tensordesc_args")
        if (
            not isinstance(launch, RAW_LAUNCH_TYPES)
            or not isinstance(flatten, types.BuiltinFunctionType)
            or not _code_is(make, ("arg", "metadata", "_"), None, varargs=False)
        ):
            return None
        expansion = _Expansion(flatten, cells)
    return Direct39(launch, compiled, launcher, expansion)


# --- both ---------------------------------------------------------------------------------------

_RECOGNISED = (_direct_36, _direct_39)


def direct_call(compiled: Any) -> Direct36 | Direct39 | None:
    """How to call ``compiled``'s C launch function directly — ``call(g0, g1, g2, stream,
    args)`` with no hook set — or None where its launcher is not one this module recognises or
    needs scratch memory (see the module's docstring)."""
    launcher = getattr(compiled, "_run", None)
    call = type(launcher).__dict__.get("__call__")
    for recognise in _RECOGNISED:
        direct = recognise(compiled, launcher, call)
        if direct is not None:
            return direct
    return None


def _kept(kept: dict, key: tuple, make: Callable[..., Any], *args: Any) -> Any:
    """The expansion ``kept`` holds for ``key``, else ``make(*args)``, kept (``kept`` emptied
    first once it holds ``DESCRIPTOR_LIMIT``)."""
    expanded = kept.get(key)
    if expanded is None:
        if len(kept) >= DESCRIPTOR_LIMIT:
            kept.clear()
        expanded = kept[key] = make(*args)
    return expanded


def _usable(launcher: Any, attributes: tuple[str, ...]) -> bool:
    """Whether ``launcher`` has every attribute the direct call reads and needs no scratch."""
    if not all(hasattr(launcher, name) for name in attributes):
        return False
    return not (launcher.global_scratch_size or launcher.profile_scratch_size)


def _closure(inner: Any, names: frozenset[str], freevars: frozenset[str]) -> dict | None:
    """The closure cells of ``inner(*args)`` by name, where it reads no global or attribute
    outside ``names`` and closes over exactly ``freevars``; else None."""
    if not _code_is(inner, (), names, varargs=True):
        return None
    code = inner.__code__
    if frozenset(code.co_freevars) != freevars:
        return None
    contents = (cell.cell_contents for cell in inner.__closure__)
    return dict(zip(code.co_freevars, contents, strict=True))


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
