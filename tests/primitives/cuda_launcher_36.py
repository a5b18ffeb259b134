"""Triton 3.6's CUDA launcher, for tests on a machine without it: ``CudaLauncher.__call__``,
``wrap_handle_tensordesc`` and ``make_tensordesc_arg`` as ``triton/backends/nvidia/driver.py``
(Triton 3.6.0, MIT licence) defines them — the same code, which is what ``primitives/launch.py``
recognises — around a recording stand-in for the C launch function that ``make_launcher``
compiles, and a ``fill_tma_descriptor`` that makes a ``FakeTensorMap`` of its arguments.

``compiled_kernel(signature, tensordesc_meta)`` builds a compiled kernel of that signature
(``src.signature``: one type per parameter, ``"tensordesc<bf16[64, 64]>"`` for a descriptor),
as ``CompiledKernel`` is after its first launch.

The three functions copied from Triton are under its licence:

    Copyright 2018-2020 Philippe Tillet
    Copyright 2020-2022 OpenAI

    Permission is hereby granted, free of charge, to any person obtaining a copy of this software
    and associated documentation files (the "Software"), to deal in the Software without
    restriction, including without limitation the rights to use, copy, modify, merge, publish,
    distribute, sublicense, and/or sell copies of the Software, and to permit persons to whom the
    Software is furnished to do so, subject to the following conditions:

    The above copyright notice and this permission notice shall be included in all copies or
    substantial portions of the Software.

    THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING
    BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
    NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM,
    DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
    OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from triton import knobs


class RecordingLaunch:
    """Stands in for the C launch function: records each call's arguments."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def __call__(self, *args: Any) -> None:
        self.calls.append(list(args))


class FakeTensorMap:
    """A ``CUtensorMap`` stand-in: equal to another made from the same arguments."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeTensorMap) and self.args == other.args

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FakeTensorMap{self.args}"


FILLED: list[FakeTensorMap] = []  # every tensor map made, in order


def fill_tma_descriptor(*args: Any) -> FakeTensorMap:
    """``driver.active.utils.fill_tma_descriptor``'s stand-in."""
    FILLED.append(FakeTensorMap(*args))
    return FILLED[-1]


class _Allocator:
    """``_allocation._allocator``'s stand-in: hands out a marker per scratch allocation."""

    def get(self) -> Any:
        return lambda size, align, stream: ("scratch", size, align, stream)


_allocation = SimpleNamespace(_allocator=_Allocator(), _profile_allocator=_Allocator())

# --- Triton 3.6.0, triton/backends/nvidia/driver.py (fill_tma_descriptor called by its name) ---

_BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
_BASE_ARGS_FORMAT_LEN = len(_BASE_ARGS_FORMAT)

# The TMA dtype enum values are slightly different on host vs device...
TMA_DTYPE_DEVICE_TO_HOST = dict((i, i) for i in range(16))
TMA_DTYPE_DEVICE_TO_HOST[8] = 10
TMA_DTYPE_DEVICE_TO_HOST[9] = 8
TMA_DTYPE_DEVICE_TO_HOST[10] = 9


def make_tensordesc_arg(arg, metadata):  # noqa: ANN001, ANN201
    if metadata is None:
        return [
            arg.base,
            *arg.shape,
            *arg.strides,
            arg.padding == "nan",
            *arg.shape,
            *arg.strides,
        ]

    swizzle = metadata["swizzle"]
    elem_size = metadata["elem_size"]
    elem_type = metadata["elem_type"]
    block_size = metadata["block_size"]
    fp4_padded = metadata["fp4_padded"]

    shape = arg.shape
    strides = arg.strides
    assert strides[-1] == 1
    padding = 1 if arg.padding == "nan" else 0

    if fp4_padded:
        shape = list(shape)
        shape[-1] *= 2

    cu_tensor_map = fill_tma_descriptor(
        arg.base.data_ptr(),
        swizzle,
        elem_size,
        TMA_DTYPE_DEVICE_TO_HOST[elem_type],
        block_size,
        shape,
        strides,
        padding,
    )

    return [cu_tensor_map, *shape, *strides]


def wrap_handle_tensordesc(launcher, signature, tensordesc_meta):  # noqa: ANN001, ANN201
    has_tensor_desc_arg = any(
        isinstance(sig, str) and sig.startswith("tensordesc") for sig in signature.values()
    )
    if not has_tensor_desc_arg:
        return launcher

    tensordesc_indices = set(
        [
            i
            for i, sig in enumerate(signature.values())
            if isinstance(sig, str) and sig.startswith("tensordesc")
        ]
    )
    assert not tensordesc_meta or len(tensordesc_meta) == len(tensordesc_indices)
    if not tensordesc_meta:
        tensordesc_meta = [None] * len(tensordesc_indices)

    def inner(*args):  # noqa: ANN002, ANN202
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        tensordesc_idx = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)

    return inner


class CudaLauncher:
    def __init__(self, signature, tensordesc_meta, metadata, mod_launch):  # noqa: ANN001
        # Triton's compiles the C launcher (``mod``) from the signature; the rest is its own
        self.num_ctas = getattr(metadata, "num_ctas", 1)
        self.launch = wrap_handle_tensordesc(mod_launch, signature, tensordesc_meta)
        self.global_scratch_size = metadata.global_scratch_size
        self.global_scratch_align = metadata.global_scratch_align
        self.profile_scratch_size = metadata.profile_scratch_size
        self.profile_scratch_align = metadata.profile_scratch_align
        self.launch_cooperative_grid = metadata.launch_cooperative_grid
        self.launch_pdl = metadata.launch_pdl

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # noqa: ANN001, ANN002, ANN204, N803
        def allocate_scratch(size, align, allocator):  # noqa: ANN001, ANN202
            if size > 0:
                grid_size = gridX * gridY * gridZ
                alloc_size = grid_size * self.num_ctas * size
                alloc_fn = allocator.get()
                return alloc_fn(alloc_size, align, stream)
            return None

        global_scratch = allocate_scratch(
            self.global_scratch_size, self.global_scratch_align, _allocation._allocator
        )
        profile_scratch = allocate_scratch(
            self.profile_scratch_size, self.profile_scratch_align, _allocation._profile_allocator
        )
        self.launch(
            gridX,
            gridY,
            gridZ,
            stream,
            function,
            self.launch_cooperative_grid,
            self.launch_pdl,
            global_scratch,
            profile_scratch,
            *args,
        )


# --- end of Triton's code ---


class CompiledKernel:
    """What ``launch.py`` reads of Triton 3.6's ``CompiledKernel`` after its first launch:
    ``_run`` (its ``CudaLauncher``), ``run``, ``function``, ``packed_metadata`` and
    ``launch_metadata`` (which builds metadata whenever the enter hook is not None — in
    Triton 3.6 an empty ``HookChain`` is not None; recorded in ``metadata_built``)."""

    def __init__(self, launcher: CudaLauncher, metadata: Any) -> None:
        self._run = launcher
        self.function = 0xF00
        self.packed_metadata = (metadata.num_warps, metadata.num_ctas, metadata.shared)
        self.metadata_built = 0

    @property
    def run(self) -> CudaLauncher:
        return self._run

    def launch_metadata(self, grid: Any, stream: int, *args: Any) -> Any:
        if knobs.runtime.launch_enter_hook is None:
            return None
        self.metadata_built += 1
        return {"name": "kernel", "function": self.function, "stream": stream}


def compiled_kernel(
    signature: list[str],
    tensordesc_meta: list[dict | None] | None,
    *,
    global_scratch: int = 0,
    profile_scratch: int = 0,
) -> tuple[CompiledKernel, RecordingLaunch]:
    """A compiled kernel of ``signature`` whose launcher is Triton 3.6's, and its C launch
    function's stand-in."""
    metadata = SimpleNamespace(
        num_warps=4,
        num_ctas=1,
        shared=1024,
        global_scratch_size=global_scratch,
        global_scratch_align=16,
        profile_scratch_size=profile_scratch,
        profile_scratch_align=16,
        launch_cooperative_grid=False,
        launch_pdl=True,
    )
    c_launch = RecordingLaunch()
    launcher = CudaLauncher(dict(enumerate(signature)), tensordesc_meta, metadata, c_launch)
    return CompiledKernel(launcher, metadata), c_launch


def tma_meta(block: list[int], elem_type: int = 10) -> dict[str, Any]:
    """A ``tensordesc_meta`` entry of a descriptor the kernel reads by TMA (bf16 by default)."""
    return {
        "swizzle": 3,
        "elem_size": 2,
        "elem_type": elem_type,
        "block_size": block,
        "fp4_padded": False,
    }
