"""primitives/launch.py: after a signature's first launch through Triton, later launches call the
compiled kernel's launcher with the same arguments Triton would pass; any change Triton
specializes on (dtype, alignment, an integer, the meta-parameters) goes through Triton again.

Where the launcher is Triton 3.6's, a relaunch calls its C launch function with the argument list
Triton's launcher would build (its descriptors' tensor maps kept per base address), unless a
launch hook is set or the kernel needs scratch memory; any other launcher is called as before
(``direct_launch``; its Triton 3.9 call is tested in ``test_direct_launch_39``).

Run with a stand-in kernel (the CPU interpreter compiles nothing: there the module always takes
Triton's path, which every other test of the repository exercises) and, for the direct call, a
copy of Triton 3.6's launcher code around a recording C launch function (``cuda_launcher_36``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton

from coda.primitives import direct_launch
from coda.primitives import launch as launch_module
from coda.primitives.launch import PinnedLaunch, PinnedSequence, launch_kernel, recorded_launches


class FakeCompiled:
    function, packed_metadata = "function", "packed"

    def __init__(self) -> None:
        self.runs: list[tuple] = []

    def launch_metadata(self, grid: Any, stream: int, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        self.runs.append(args)


class FakeKernel:
    """What launch_kernel uses of a JITFunction: ``arg_names`` and ``kernel[grid](...)``."""

    def __init__(self, arg_names: list[str]) -> None:
        self.arg_names = arg_names
        self.triton_launches: list[tuple] = []
        self.compiled = FakeCompiled()

    def __getitem__(self, grid: tuple) -> Any:
        def run(*args: Any, **meta: Any) -> FakeCompiled:
            self.triton_launches.append((grid, args, meta))
            return self.compiled

        return run


@pytest.fixture
def on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_module.backend, "INTERPRET", False)
    monkeypatch.setattr(launch_module, "_device_and_stream", lambda: (0, 1234))
    launch_module.clear()
    yield
    launch_module.clear()


def test_a_signature_launches_through_triton_once_then_directly(on_a_gpu: None) -> None:
    kernel = FakeKernel(["x_ptr", "n", "scale", "BLOCK", "FLAG"])
    x = torch.zeros(64)
    assert launch_kernel(kernel, (4,), x, 64, 0.5, BLOCK=16, FLAG=True) is kernel.compiled
    assert len(kernel.triton_launches) == 1 and not kernel.compiled.runs
    launch_kernel(kernel, (8, 2), x, 64, 0.5, BLOCK=16, FLAG=True)  # another grid
    assert len(kernel.triton_launches) == 1
    (run,) = kernel.compiled.runs
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    assert run == (8, 2, 1, 1234, "function", "packed", None, *hooks, x, 64, 0.5, 16, True)


@pytest.mark.parametrize(
    "change",
    ["dtype", "misaligned", "integer", "float", "meta", "option"],
)
def test_what_triton_specializes_on_goes_through_triton_again(on_a_gpu: None, change: str) -> None:
    kernel = FakeKernel(["x_ptr", "n", "eps", "BLOCK"])
    x = torch.zeros(64)
    args, meta = [x, 64, 1e-5], {"BLOCK": 16, "num_warps": 4}
    launch_kernel(kernel, (1,), *args, **meta)
    if change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "misaligned":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "integer":
        args[1] = 63
    elif change == "float":  # a constexpr float compiles per value
        args[2] = 1e-6
    elif change == "meta":
        meta["BLOCK"] = 32
    else:
        meta["num_warps"] = 8
    launch_kernel(kernel, (1,), *args, **meta)
    assert len(kernel.triton_launches) == 2 and not kernel.compiled.runs
    launch_kernel(kernel, (1,), *args, **meta)  # and that signature is kept in turn
    assert len(kernel.triton_launches) == 2 and len(kernel.compiled.runs) == 1


def test_what_it_cannot_reproduce_always_takes_triton_s_path(on_a_gpu: None) -> None:
    # an argument type it does not know; a parameter Triton filled from its default
    unknown = FakeKernel(["values", "BLOCK"])
    defaulted = FakeKernel(["x_ptr", "BLOCK", "DEFAULTED"])
    for _ in range(3):
        launch_kernel(unknown, (1,), [1, 2], BLOCK=4)
        launch_kernel(defaulted, (1,), torch.zeros(4), BLOCK=4)
    for kernel in (unknown, defaulted):
        assert len(kernel.triton_launches) == 3 and not kernel.compiled.runs


@pytest.mark.parametrize("why", ["interpreter", "CODA_TRITON_LAUNCH=1"])
def test_every_launch_takes_triton_s_path(
    on_a_gpu: None, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    if why == "interpreter":  # it compiles nothing
        monkeypatch.setattr(launch_module.backend, "INTERPRET", True)
    else:
        monkeypatch.setattr(launch_module, "DIRECT", False)
    kernel = FakeKernel(["x_ptr", "BLOCK"])
    for _ in range(2):
        launch_kernel(kernel, (1,), torch.zeros(4), BLOCK=4)
    assert len(kernel.triton_launches) == 2 and not kernel.compiled.runs


def test_a_descriptor_s_block_shape_and_base_are_part_of_the_signature(on_a_gpu: None) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel = FakeKernel(["x_desc", "BLOCK"])
    x = torch.zeros(64, 64)

    def desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    launch_kernel(kernel, (1,), desc(x, [16, 16]), BLOCK=16)
    launch_kernel(kernel, (1,), desc(torch.ones(64, 64), [16, 16]), BLOCK=16)  # same signature
    assert len(kernel.triton_launches) == 1 and len(kernel.compiled.runs) == 1
    launch_kernel(kernel, (1,), desc(x, [32, 16]), BLOCK=16)
    launch_kernel(kernel, (1,), desc(x.half(), [16, 16]), BLOCK=16)
    launch_kernel(kernel, (1,), desc(torch.zeros(32, 64), [16, 16]), BLOCK=16)
    assert len(kernel.triton_launches) == 4
    if hasattr(TensorDescriptor, "round_f32_to_tf32"):  # Triton 3.9's TF32 rounding
        tf32 = desc(x, [16, 16])
        tf32.round_f32_to_tf32 = True
        launch_kernel(kernel, (1,), tf32, BLOCK=16)
        assert len(kernel.triton_launches) == 5


def test_a_meta_parameter_of_another_type_is_another_signature(on_a_gpu: None) -> None:
    # True == 1 in Python; to Triton a constexpr True and a constexpr 1 are different kernels
    kernel = FakeKernel(["x_ptr", "FLAG"])
    launch_kernel(kernel, (1,), torch.zeros(4), FLAG=True)
    launch_kernel(kernel, (1,), torch.zeros(4), FLAG=1)
    assert len(kernel.triton_launches) == 2


def test_a_pinned_launch_relaunches_without_a_signature(
    on_a_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = FakeKernel(["x_ptr", "n", "BLOCK"])
    pinned = PinnedLaunch(kernel, (4,), BLOCK=16)
    x = torch.zeros(64)
    assert pinned(x, 64) is kernel.compiled
    assert len(kernel.triton_launches) == 1
    monkeypatch.setattr(launch_module, "_signature", None)  # a relaunch computes none
    y = torch.ones(64)
    pinned(y, 64)
    (run,) = kernel.compiled.runs
    assert run[:4] == (4, 1, 1, 1234) and run[-3:] == (y, 64, 16)


def test_a_pinned_launch_on_another_device_or_off_the_direct_path_asks_triton(
    on_a_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = FakeKernel(["x_ptr", "BLOCK"])
    pinned = PinnedLaunch(kernel, (1,), BLOCK=4)
    pinned(torch.zeros(4))
    monkeypatch.setattr(launch_module, "_device_and_stream", lambda: (1, 99))
    pinned(torch.zeros(4))  # device 1: launch_kernel, which compiles there through Triton
    assert len(kernel.triton_launches) == 2 and not kernel.compiled.runs
    monkeypatch.setattr(launch_module, "DIRECT", False)
    pinned(torch.zeros(4))
    assert len(kernel.triton_launches) == 3 and not kernel.compiled.runs


def _sequence_of(*calls: tuple) -> PinnedSequence:
    """A sequence recorded from ``launch_kernel`` calls ``(kernel, grid, args, meta)``."""
    with recorded_launches() as recorded:
        for kernel, grid, args, meta in calls:
            launch_kernel(kernel, grid, *args, **meta)
    return PinnedSequence(recorded)


def test_a_pinned_sequence_relaunches_each_recorded_call_without_a_signature(
    on_a_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside ``run``, the n-th ``launch_kernel`` call goes to the n-th pinned launch (no
    signature computed); the launches after the recorded ones, and every launch after ``run``
    returns, take ``launch_kernel``'s own path."""
    norm, scale = FakeKernel(["x_ptr", "n", "BLOCK"]), FakeKernel(["x_ptr", "EVEN"])
    x = torch.zeros(64)
    sequence = _sequence_of(
        (norm, (4,), (x, 64), {"BLOCK": 16}), (scale, (2, 2), (x,), {"EVEN": True})
    )
    y = torch.ones(64)

    def step() -> None:
        launch_kernel(norm, (4,), y, 64, BLOCK=16)
        launch_kernel(scale, (2, 2), y, EVEN=True)

    sequence.run(step)  # each pin's first call: launch_kernel's kept kernels, no Triton
    signatures = []
    real = launch_module._signature
    monkeypatch.setattr(launch_module, "_signature", lambda a: signatures.append(a) or real(a))
    sequence.run(step)
    assert signatures == [] and len(norm.triton_launches) == len(scale.triton_launches) == 1
    assert norm.compiled.runs[-1][-3:] == (y, 64, 16) and scale.compiled.runs[-1][:3] == (2, 2, 1)
    sequence.run(lambda: (step(), launch_kernel(norm, (4,), y, 64, BLOCK=16)))
    assert len(signatures) == 2  # the third launch was not recorded: signature and meta keyed
    step()
    assert len(signatures) == 6


@pytest.mark.parametrize("change", ["kernel", "grid", "meta"])
def test_a_pinned_sequence_sends_a_call_unlike_the_recorded_one_through_launch_kernel(
    on_a_gpu: None, change: str
) -> None:
    kernel, other = FakeKernel(["x_ptr", "BLOCK"]), FakeKernel(["x_ptr", "BLOCK"])
    x = torch.zeros(8)
    sequence = _sequence_of((kernel, (1,), (x,), {"BLOCK": 4}))
    launched = {"kernel": other, "grid": kernel, "meta": kernel}[change]
    grid = (2,) if change == "grid" else (1,)
    meta = {"BLOCK": 8} if change == "meta" else {"BLOCK": 4}
    sequence.run(lambda: launch_kernel(launched, grid, x, **meta))
    assert len(launched.triton_launches) == (2 if change == "meta" else 1)
    pinned = sequence.pins[0]
    assert pinned is not None and pinned.entry is None  # the pin never ran


def test_pinned_sequences_nest_and_a_callable_grid_is_not_pinned(on_a_gpu: None) -> None:
    kernel = FakeKernel(["x_ptr", "BLOCK"])
    x = torch.zeros(8)
    outer = _sequence_of((kernel, (1,), (x,), {"BLOCK": 4}), (kernel, (3,), (x,), {"BLOCK": 4}))
    inner = PinnedSequence([(kernel, lambda meta: (1,), (x,), {"BLOCK": 4})])
    assert inner.pins == (None,)
    order: list[str] = []

    def body() -> None:
        launch_kernel(kernel, (1,), x, BLOCK=4)
        inner.run(lambda: launch_kernel(kernel, (1,), x, BLOCK=4))  # unpinned: its own path
        order.append("inner done")
        launch_kernel(kernel, (3,), x, BLOCK=4)  # the outer's second pin, after the inner

    outer.run(body)
    assert [p.entry is not None for p in outer.pins] == [True, True]
    assert launch_module._SEQUENCE.pins is None and order == ["inner done"]


def test_the_device_and_stream_come_from_the_active_driver_s_queries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton's GPU driver queries the device through ``torch.cuda.current_device``: a relaunch
    asks PyTorch's raw query instead (same answer, no wrapper); another driver's own queries
    are called as they are, and a change of active driver is followed."""
    from types import SimpleNamespace

    streams: list[int] = []

    def stream_of(device: int) -> int:
        streams.append(device)
        return 100 + device

    gpu = SimpleNamespace(
        get_current_device=torch.cuda.current_device, get_current_stream=stream_of
    )
    other = SimpleNamespace(get_current_device=lambda: 5, get_current_stream=stream_of)
    config = SimpleNamespace(active=gpu)
    monkeypatch.setattr(launch_module, "driver", config)
    monkeypatch.setattr(launch_module, "_QUERIES", (None, None, None))
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 2, raising=False)
    assert launch_module._device_and_stream() == (2, 102)
    config.active = other
    assert launch_module._device_and_stream() == (5, 105)
    assert streams == [2, 5]


# --- the direct call of the C launch function, under Triton 3.6's launcher (cuda_launcher_36.py)

BF16_DESC = "tensordesc<bf16[64, 64]>"


class CompiledKernelOf:
    """A FakeKernel whose ``kernel[grid]`` returns a given compiled kernel."""

    def __init__(self, arg_names: list[str], compiled: Any) -> None:
        self.arg_names, self.compiled = arg_names, compiled
        self.triton_launches = 0

    def __getitem__(self, grid: tuple) -> Any:
        def run(*args: Any, **meta: Any) -> Any:
            self.triton_launches += 1
            return self.compiled

        return run


@pytest.fixture
def c_functions(on_a_gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recording stand-in counts as a C launch function."""
    from tests.primitives import cuda_launcher_36 as t36

    monkeypatch.setattr(direct_launch, "RAW_LAUNCH_TYPES", (t36.RecordingLaunch,))
    t36.FILLED.clear()


def _descriptor(t: torch.Tensor, block: list[int] | None = None) -> Any:
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block or [64, 64])


def _triton_s_call(compiled: Any, c_launch: Any, grid: tuple, args: list[Any]) -> list[Any]:
    """What Triton 3.6's own path (``launch_metadata``, ``CudaLauncher.__call__`` and its
    descriptor wrapper) hands the C launch function for ``args``."""
    from triton import knobs

    metadata = compiled.launch_metadata(grid, 1234, *args)
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    compiled.run(*grid, 1234, compiled.function, compiled.packed_metadata, metadata, *hooks, *args)
    return c_launch.calls.pop()


def test_the_direct_call_hands_the_c_function_triton_s_arguments(c_functions: None) -> None:
    from tests.primitives import cuda_launcher_36 as t36

    # a pointer, a TMA descriptor, an integer, a descriptor read by pointer, another TMA one
    signature = ["*bf16", BF16_DESC, "i32", BF16_DESC, BF16_DESC, "constexpr"]
    metas = [t36.tma_meta([64, 64]), None, t36.tma_meta([32, 64])]
    compiled, c_launch = t36.compiled_kernel(signature, metas)
    kernel = CompiledKernelOf(["x_ptr", "a_desc", "n", "b_desc", "c_desc", "BLOCK"], compiled)

    def args() -> list[Any]:
        x, a, b = torch.zeros(256, 64), torch.zeros(128, 64), torch.zeros(64, 64)
        return [x, _descriptor(a), 7, _descriptor(b), _descriptor(x[:128], [32, 64])]

    launch_kernel(kernel, (3, 2), *args(), BLOCK=64)  # the first launch: through Triton
    given = args()
    launch_kernel(kernel, (3, 2), *given, BLOCK=64)
    assert kernel.triton_launches == 1
    (direct,) = c_launch.calls
    c_launch.calls.clear()
    triton_s = _triton_s_call(compiled, c_launch, (3, 2, 1), [*given, 64])
    # Triton hands over launch metadata and its two empty hook chains, which the C function
    # calls to do nothing; the direct call hands None for all three, which it calls not at all
    assert direct[10:13] == [None, None, None]
    assert not any(hook.calls for hook in triton_s[11:13])
    assert direct[:10] + direct[13:] == triton_s[:10] + triton_s[13:]
    assert direct[:10] == [3, 2, 1, 1234, 0xF00, False, True, None, None, (4, 1, 1024)]
    assert compiled.metadata_built == 1  # Triton's path built it; the direct call did not


def test_a_descriptor_s_expansion_is_kept_per_base_address(c_functions: None) -> None:
    from tests.primitives import cuda_launcher_36 as t36

    compiled, c_launch = t36.compiled_kernel([BF16_DESC, "constexpr"], [t36.tma_meta([64, 64])])
    pinned = PinnedLaunch(CompiledKernelOf(["a_desc", "BLOCK"], compiled), (1,), BLOCK=64)
    x, y = torch.zeros(128, 64), torch.zeros(128, 64)
    pinned(_descriptor(x))  # through Triton (the stand-in kernel fills nothing)
    for t in (x, x, y, x, y):  # a new descriptor object every call, as a replay builds them
        pinned(_descriptor(t))
    maps = [call[13] for call in c_launch.calls]
    assert len(t36.FILLED) == 2  # one tensor map per base address
    assert maps[0] is maps[1] is maps[3] and maps[2] is maps[4] and maps[0] is not maps[2]
    assert maps[0].args[0] == x.data_ptr() and maps[2].args[0] == y.data_ptr()
    assert c_launch.calls[2][13:] == [maps[2], 128, 64, 64, 1, 64]
    # the same address under another shape is another tensor map (what Triton would build)
    pinned(_descriptor(x[:64]))
    assert len(t36.FILLED) == 3 and c_launch.calls[-1][13:] == [t36.FILLED[-1], 64, 64, 64, 1, 64]
    assert t36.FILLED[-1] == t36.make_tensordesc_arg(_descriptor(x[:64]), t36.tma_meta([64, 64]))[0]


def test_kept_expansions_are_bounded(c_functions: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.primitives import cuda_launcher_36 as t36

    monkeypatch.setattr(direct_launch, "DESCRIPTOR_LIMIT", 2)
    compiled, _ = t36.compiled_kernel([BF16_DESC], [t36.tma_meta([64, 64])])
    pinned = PinnedLaunch(CompiledKernelOf(["a_desc"], compiled), (1,))
    tensors = [torch.zeros(64, 64) for _ in range(3)]
    pinned(_descriptor(tensors[0]))
    for t in tensors:
        pinned(_descriptor(t))
    ((*_, kept),) = pinned.entry.direct.descriptors
    assert len(kept) == 1 and len(t36.FILLED) == 3  # cleared at the limit, then the third kept


@pytest.mark.parametrize("hook", ["enter added", "exit added", "enter assigned"])
def test_a_launch_hook_sends_relaunches_through_the_launcher(
    c_functions: None, monkeypatch: pytest.MonkeyPatch, hook: str
) -> None:
    from triton import knobs

    from tests.primitives import cuda_launcher_36 as t36

    compiled, c_launch = t36.compiled_kernel(["*fp32", "i32"], None)
    pinned = PinnedLaunch(CompiledKernelOf(["x_ptr", "n"], compiled), (1,))
    x = torch.zeros(4)
    pinned(x, 4)
    pinned(x, 4)
    assert c_launch.calls[-1][10:13] == [None, None, None] and compiled.metadata_built == 0

    seen: list[Any] = []
    chain = knobs.runtime.launch_exit_hook if hook == "exit added" else None
    if hook == "enter assigned":  # a hook set the way older Tritons took it
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", seen.append)
    else:
        chain = chain or knobs.runtime.launch_enter_hook
        chain.add(seen.append)
    try:
        pinned(x, 4)
    finally:
        if chain is not None:
            chain.remove(seen.append)
    # the launcher's call: the hooks as Triton passes them, and the metadata they are given
    hooks = [knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook]
    metadata = {"name": "kernel", "function": 0xF00, "stream": 1234}
    assert c_launch.calls[-1][10:] == [metadata, *hooks, x, 4]
    assert compiled.metadata_built == 1


def _unrecognised(why: str) -> Any:
    """A compiled kernel whose launcher the direct call must not bypass."""
    from triton.backends.nvidia import driver as installed

    from tests.primitives import cuda_launcher_36 as t36

    signature = ["*fp32", BF16_DESC]
    if why in ("global scratch", "profile scratch"):
        key = why.split()[0] + "_scratch"
        return t36.compiled_kernel(signature, [t36.tma_meta([64, 64])], **{key: 128})[0]
    compiled, c_launch = t36.compiled_kernel(signature, [t36.tma_meta([64, 64])])
    launcher = compiled._run
    if why == "3.9's __call__ on 3.6's attributes":  # no argument annotations, no signature
        real = object.__new__(installed.CudaLauncher)
        real.__dict__.update(launcher.__dict__)
        compiled._run = real
    elif why == "a wrapper of another shape":  # a Python function around the C one
        launcher.launch = lambda *args: c_launch(*args)
    elif why == "a __call__ that reads more":

        class Sanitized(t36.CudaLauncher):
            def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # noqa: ANN001, ANN002, ANN204, N803
                if self.gsan_enabled:
                    raise RuntimeError("a sanitizer's launch")
                super().__call__(gridX, gridY, gridZ, stream, function, *args)

        compiled._run = object.__new__(Sanitized)
        compiled._run.__dict__.update(launcher.__dict__)
    return compiled


@pytest.mark.parametrize(
    "why",
    [
        "recognised",
        "global scratch",
        "profile scratch",
        "3.9's __call__ on 3.6's attributes",
        "a wrapper of another shape",
        "a __call__ that reads more",
    ],
)
def test_only_the_launcher_it_recognises_is_bypassed(c_functions: None, why: str) -> None:
    if why.startswith("3.9's") and not triton.__version__.startswith("3.9."):
        pytest.skip("the installed launcher is not Triton 3.9's")
    compiled = _unrecognised(why)
    assert (direct_launch.direct_call(compiled) is not None) == (why == "recognised")
