"""primitives/direct_launch.py on Triton 3.9's launcher: a relaunch through ``launch_kernel`` hands
the C launch function what Triton's own ``CompiledKernel.launch_metadata`` + ``CudaLauncher``
would, less the metadata and the empty hook chains, with each TMA descriptor's tensor map kept per
position and base address.

Run against the installed Triton's code (skipped on any other Triton): its ``CudaLauncher`` built
by its own ``__init__``, its descriptor wrapper, its ``make_tensordesc_arg`` and libtriton's C++
``make_tensordesc_args`` — with a stand-in active driver whose C launch function records its
arguments and whose ``fill_tma_descriptor_tiled`` makes a ``FakeTensorMap`` (this machine has no
CUDA driver to compile Triton's C launcher or encode a map)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import triton

from coda.primitives import direct_launch
from coda.primitives import launch as launch_module
from coda.primitives.launch import PinnedLaunch, launch_kernel
from tests.primitives.cuda_launcher_36 import FakeTensorMap, RecordingLaunch, tma_meta
from tests.primitives.test_launch import CompiledKernelOf as KernelOf
from tests.primitives.test_launch import _descriptor

pytestmark = pytest.mark.skipif(
    not triton.__version__.startswith("3.9."), reason="Triton 3.9's launcher code is not installed"
)

BF16_DESC = "tensordesc<bf16[64, 64]>"


class Triton39:
    """The stand-in driver's recording C launch function and the tensor maps it filled."""

    def __init__(self) -> None:
        self.c_launch = RecordingLaunch()
        self.filled: list[FakeTensorMap] = []

    def fill(self, *args: Any) -> FakeTensorMap:
        self.filled.append(FakeTensorMap(*args))
        return self.filled[-1]


@pytest.fixture
def triton_39(monkeypatch: pytest.MonkeyPatch) -> Triton39:
    """Triton 3.9's nvidia driver module over a stand-in active driver; launches as on a GPU."""
    from triton.backends.nvidia import driver as nvidia
    from triton.runtime.driver import driver as config

    state = Triton39()
    utils = SimpleNamespace(
        launch=state.c_launch,
        build_signature_metadata=lambda types: ("packed signature", tuple(types)),
        fill_tma_descriptor_tiled=state.fill,
    )
    monkeypatch.setattr(config, "_active", SimpleNamespace(utils=utils))
    # what CudaUtils sets from the compiled C module, as plain values
    monkeypatch.setattr(nvidia, "PyKernelArg", lambda nested_tuple, type: (type, nested_tuple))
    for name in ("ARG_CONSTEXPR", "ARG_KERNEL", "ARG_TUPLE"):
        monkeypatch.setattr(nvidia, name, name)
    monkeypatch.setattr(direct_launch, "RAW_LAUNCH_TYPES", (RecordingLaunch,))
    monkeypatch.setattr(launch_module.backend, "INTERPRET", False)
    monkeypatch.setattr(launch_module, "_device_and_stream", lambda: (0, 1234))
    launch_module.clear()
    yield state
    launch_module.clear()


def compiled_39(
    signature: list[str],
    metas: list[dict | None] | None,
    *,
    global_scratch: int = 0,
    instrumentation: str = "",
) -> Any:
    """Triton 3.9's ``CompiledKernel`` of ``signature`` after its first launch (its handles set,
    its ``CudaLauncher`` made by that class's ``__init__``)."""
    from triton.backends.nvidia import driver as nvidia
    from triton.compiler.compiler import CompiledKernel

    metadata = SimpleNamespace(
        name="kernel",
        tensordesc_meta=metas,
        num_ctas=1,
        global_scratch_size=global_scratch,
        global_scratch_align=16,
        profile_scratch_size=0,
        profile_scratch_align=16,
        launch_cooperative_grid=False,
        launch_pdl=True,
        instrumentation_mode=instrumentation,
    )
    src = SimpleNamespace(constants={}, signature=dict(enumerate(signature)))
    compiled = object.__new__(CompiledKernel)
    compiled.module, compiled._module_pid = "loaded", None  # handles set; nothing to unload
    compiled.metadata, compiled.src, compiled.name = metadata, src, "kernel"
    compiled.function, compiled.packed_metadata = 0xF00, (4, 1, 1024)
    compiled._run = nvidia.CudaLauncher(src, metadata)
    return compiled


def _triton_s_call(compiled: Any, c_launch: RecordingLaunch, grid: tuple, args: list) -> list:
    """What Triton 3.9's own relaunch (``CompiledKernel.__getitem__``'s runner: launch
    metadata, then ``CudaLauncher.__call__`` and its descriptor wrapper) hands the C function."""
    compiled[grid](*args, stream=1234)
    return c_launch.calls.pop()


def test_the_installed_launcher_is_recognised(triton_39: Triton39) -> None:
    with_descriptors = compiled_39(["*bf16", BF16_DESC, "i32"], [tma_meta([64, 64])])
    plain = compiled_39(["*fp32", "i32", "constexpr"], None)
    assert isinstance(direct_launch.direct_call(with_descriptors), direct_launch.Direct39)
    assert isinstance(direct_launch.direct_call(plain), direct_launch.Direct39)


def test_the_direct_call_hands_the_c_function_triton_s_arguments(triton_39: Triton39) -> None:
    # a pointer, a TMA descriptor, an integer, a descriptor read by pointer, another TMA one
    signature = ["*bf16", BF16_DESC, "i32", BF16_DESC, BF16_DESC, "constexpr"]
    metas = [tma_meta([64, 64]), None, tma_meta([32, 64])]
    compiled = compiled_39(signature, metas)
    kernel = KernelOf(["x_ptr", "a_desc", "n", "b_desc", "c_desc", "BLOCK"], compiled)
    x, a, b = torch.zeros(256, 64), torch.zeros(128, 64), torch.zeros(64, 64)

    def args() -> list[Any]:
        return [x, _descriptor(a), 7, _descriptor(b), _descriptor(x[:128], [32, 64])]

    launch_kernel(kernel, (3, 2), *args(), BLOCK=64)  # the first launch: through Triton
    launch_kernel(kernel, (3, 2), *args(), BLOCK=64)
    assert kernel.triton_launches == 1
    (direct,) = triton_39.c_launch.calls
    triton_39.c_launch.calls.clear()
    triton_s = _triton_s_call(compiled, triton_39.c_launch, (3, 2, 1), [*args(), 64])
    # Triton hands over launch metadata and its two empty hook chains, which the C function
    # calls to do nothing; the direct call hands None for all three, which it calls not at all
    assert direct[8:11] == [None, None, None]
    assert triton_s[8] is not None and not any(hook.calls for hook in triton_s[9:11])
    assert direct[:8] + direct[11:15] == triton_s[:8] + triton_s[11:15]
    assert direct[:8] == [3, 2, 1, 1234, 0xF00, False, True, (4, 1, 1024)]
    assert direct[11:13] == [None, None]  # no scratch
    # the kernel's arguments, flattened as Triton's wrapper flattens them (equal tensor maps)
    assert _same(direct[15], triton_s[15])
    assert isinstance(direct[15][1], FakeTensorMap) and direct[15][1].args[0] == a.data_ptr()


def _same(ours: list, theirs: list) -> bool:
    """Equal argument lists (tensors by identity, everything else by value)."""
    return len(ours) == len(theirs) and all(
        o is t if isinstance(o, torch.Tensor) else o == t for o, t in zip(ours, theirs, strict=True)
    )


def test_a_descriptor_s_expansion_is_kept_per_base_address(triton_39: Triton39) -> None:
    compiled = compiled_39([BF16_DESC, "constexpr"], [tma_meta([64, 64])])
    pinned = PinnedLaunch(KernelOf(["a_desc", "BLOCK"], compiled), (1,), BLOCK=64)
    x, y = torch.zeros(128, 64), torch.zeros(128, 64)
    pinned(_descriptor(x))  # through Triton (the stand-in kernel fills nothing)
    for t in (x, x, y, x, y):  # a new descriptor object every call, as a replay builds them
        pinned(_descriptor(t))
    maps = [call[15][0] for call in triton_39.c_launch.calls]
    assert len(triton_39.filled) == 2  # one tensor map per base address
    assert maps[0] is maps[1] is maps[3] and maps[2] is maps[4] and maps[0] is not maps[2]
    assert maps[0].args[0] == x.data_ptr() and maps[2].args[0] == y.data_ptr()
    # the flattened arguments: the map, shape and strides, then BLOCK (the C function drops it)
    assert triton_39.c_launch.calls[2][15] == [maps[2], 128, 64, 64, 1, 64]
    # the same address under another shape is another tensor map (what Triton would build)
    pinned(_descriptor(x[:64]))
    assert len(triton_39.filled) == 3
    assert triton_39.c_launch.calls[-1][15] == [triton_39.filled[-1], 64, 64, 64, 1, 64]
    # and so is a descriptor that rounds fp32 to TF32 (Triton 3.9 encodes it in the map)
    tf32 = _descriptor(x)
    tf32.round_f32_to_tf32 = True
    pinned(tf32)
    assert len(triton_39.filled) == 4


def test_kept_expansions_are_bounded(triton_39: Triton39, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_launch, "DESCRIPTOR_LIMIT", 2)
    compiled = compiled_39([BF16_DESC], [tma_meta([64, 64])])
    pinned = PinnedLaunch(KernelOf(["a_desc"], compiled), (1,))
    tensors = [torch.zeros(64, 64) for _ in range(3)]
    pinned(_descriptor(tensors[0]))
    for t in tensors:
        pinned(_descriptor(t))
    (kept,) = pinned.entry.direct.kept_maps()
    assert len(kept) == 1 and len(triton_39.filled) == 3  # cleared at the limit, then one kept


def test_a_launch_hook_sends_relaunches_through_the_launcher(triton_39: Triton39) -> None:
    from triton import knobs

    compiled = compiled_39(["*fp32", "i32"], None)
    pinned = PinnedLaunch(KernelOf(["x_ptr", "n"], compiled), (1,))
    x = torch.zeros(4)
    pinned(x, 4)
    pinned(x, 4)
    assert triton_39.c_launch.calls[-1][8:11] == [None, None, None]
    seen: list[Any] = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        pinned(x, 4)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    call = triton_39.c_launch.calls[-1]
    assert call[9] is knobs.runtime.launch_enter_hook and call[8].get()["stream"] == 1234
    assert _same(call[15], [x, 4])


@pytest.mark.parametrize("why", ["global scratch", "sanitizer", "a wrapper of another shape"])
def test_what_it_does_not_reproduce_keeps_triton_s_launcher(triton_39: Triton39, why: str) -> None:
    signature, metas = ["*fp32", BF16_DESC], [tma_meta([64, 64])]
    if why == "global scratch":
        compiled = compiled_39(signature, metas, global_scratch=128)
    elif why == "sanitizer":
        compiled = compiled_39(signature, metas, instrumentation="gsan")
    else:
        compiled = compiled_39(signature, metas)
        compiled._run.launch = lambda *args: triton_39.c_launch(*args)
    assert direct_launch.direct_call(compiled) is None
