"""primitives/launch.py: after a signature's first launch through Triton, later launches call the
compiled kernel's launcher with the same arguments Triton would pass; any change Triton
specializes on (dtype, alignment, an integer, the meta-parameters) goes through Triton again.

Run with a stand-in kernel (the CPU interpreter compiles nothing: there the module always takes
Triton's path, which every other test of the repository exercises)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coda.primitives import launch as launch_module
from coda.primitives.launch import PinnedLaunch, launch_kernel


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
