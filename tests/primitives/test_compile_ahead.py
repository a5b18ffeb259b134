"""Compiling ahead: ``launch.collected_launches`` collects launches without launching,
``CompiledProgram.collect_launches`` collects a whole call's (prep, fused GEMMs, aux steps) and
leaves the program's later runs as they were, and ``compile_ahead_of`` compiles each distinct
launch once, on a pool of threads, on the device the launches were collected on. The sandbox
compiles verify's runs ahead (one per sizes, dtype and mainloop) and tuning its configs.

On the CPU the interpreter compiles nothing, so the pool runs with stand-in kernels whose
``warmup`` records its calls; ``tests/gpu/test_compile_ahead_gpu.py`` checks that a run after
compiling ahead compiles nothing and computes the same bits."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from coda.primitives import analyze, compile_ahead, compile_program
from coda.primitives import launch as launch_module
from coda.primitives.backend import CodaInterpretedFunction
from coda.primitives.codegen import tuning
from coda.primitives.compile_ahead import Ahead, compile_ahead_of, compile_threads, distinct
from coda.primitives.ir import MainloopConfig
from coda.primitives.launch import (
    PinnedLaunch,
    collected_launches,
    launch_kernel,
    recorded_launches,
)
from coda.primitives.settings import Settings, override
from coda.sandbox import stages


class WarmKernel:
    """What ``compile_ahead`` uses of a JITFunction: ``warmup(*args, grid=, **meta)``."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.warmed: list[tuple] = []
        self.threads: set[str] = set()
        self.devices: list[int] = []
        self.lock = threading.Lock()

    def warmup(self, *args: Any, grid: Any, **meta: Any) -> None:
        with self.lock:
            self.warmed.append((grid, args, meta))
            self.threads.add(threading.current_thread().name)
            self.devices.append(_DEVICE.current)
        if self.fail:
            raise RuntimeError("out of shared memory")

    def __getitem__(self, grid: Any) -> Any:
        raise AssertionError("a collected launch must not launch")


class _Device(threading.local):
    current = -1


_DEVICE = _Device()


class _DeviceGuard:
    def __init__(self, device: int) -> None:
        self.device = device

    def __enter__(self) -> None:
        self.previous, _DEVICE.current = _DEVICE.current, self.device

    def __exit__(self, *exc: object) -> None:
        _DEVICE.current = self.previous


@pytest.fixture
def on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_ahead as on a GPU: not interpreting, device 3 current, a per-thread device guard."""
    monkeypatch.setattr(compile_ahead.backend, "INTERPRET", False)
    monkeypatch.setattr(compile_ahead.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(compile_ahead.torch.cuda, "device", _DeviceGuard)


def test_collected_launches_are_not_launched_and_still_recorded() -> None:
    kernel = WarmKernel()
    x = torch.zeros(8)
    with recorded_launches() as recorded, collected_launches() as calls:
        assert launch_kernel(kernel, (2,), x, 8, BLOCK=4) is None
    assert calls == [(kernel, (2,), (x, 8), {"BLOCK": 4})]
    assert recorded == calls
    with collected_launches() as outer:
        with collected_launches() as inner:
            launch_kernel(kernel, (1,), x, 8, BLOCK=4)
        launch_kernel(kernel, (3,), x, 8, BLOCK=4)
    assert [c[1] for c in inner] == [(1,)] and [c[1] for c in outer] == [(3,)]


def test_a_pinned_launch_is_collected_and_keeps_its_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_module.backend, "INTERPRET", False)
    monkeypatch.setattr(launch_module, "_device_and_stream", lambda: (0, 1234))
    kernel = WarmKernel()
    pin = PinnedLaunch(kernel, (2,), BLOCK=4)
    entry = pin.entry = object()  # as after a first launch
    x = torch.zeros(8)
    with collected_launches() as calls:
        assert pin(x, 8) is None
    assert calls == [(kernel, (2,), (x, 8), {"BLOCK": 4})] and pin.entry is entry


def test_distinct_keeps_one_launch_per_kernel_and_signature() -> None:
    a, b = WarmKernel(), WarmKernel()
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.float16)
    unknown = object()  # an argument launch.py does not key: kept every time
    launches = [
        (a, (1,), (x, 16), {"BLOCK": 4}),
        (a, (9,), (torch.ones(8), 16), {"BLOCK": 4}),  # same signature, other grid and tensor
        (a, (1,), (x, 16), {"BLOCK": 8}),  # another meta value
        (a, (1,), (y, 16), {"BLOCK": 4}),  # another dtype
        (a, (1,), (x, 17), {"BLOCK": 4}),  # another integer
        (b, (1,), (x, 16), {"BLOCK": 4}),  # another kernel
        (a, (1,), (unknown,), {}),
        (a, (1,), (unknown,), {}),
    ]
    kept = distinct(launches)
    assert kept == [launches[i] for i in (0, 2, 3, 4, 5, 6, 7)]


def test_launches_that_may_share_a_binary_are_grouped_in_order() -> None:
    a, b = WarmKernel(), WarmKernel()
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.float16)
    odd = torch.zeros(9)[1:]  # 4 bytes past a 16-byte boundary
    unknown = object()
    launches = [
        (a, (1,), (x, 16, 0.5), {"BLOCK": 4}),
        (a, (2,), (x, 17, 0.25), {"BLOCK": 4}),  # other integer and float: maybe one binary
        (a, (1,), (y, 16, 0.5), {"BLOCK": 4}),  # another dtype
        (a, (1,), (odd, 16, 0.5), {"BLOCK": 4}),  # another alignment
        (a, (1,), (x, 16, 0.5), {"BLOCK": 8}),  # another meta value
        (a, (1,), (x, True, 0.5), {"BLOCK": 4}),  # a bool is a value, not an integer class
        (b, (1,), (x, 16, 0.5), {"BLOCK": 4}),  # another kernel
        (a, (3,), (x, 48, 1.5), {"BLOCK": 4}),
        (a, (1,), (unknown,), {}),
        (a, (1,), (unknown,), {}),
    ]
    got = compile_ahead.groups(launches)
    assert got == [[launches[i] for i in g] for g in ([0, 1, 7], [2], [3], [4], [5], [6], [8], [9])]


def test_a_group_compiles_in_turn_on_one_thread(on_a_gpu: None) -> None:
    kernel = WarmKernel()
    x = torch.zeros(8)
    launches = [(kernel, (1,), (x, n), {"BLOCK": 4}) for n in (16, 17, 32, 33)]
    done = compile_ahead_of(lambda: launches, threads=4)
    assert (done.kernels, done.threads) == (4, 1)
    assert [w[1][1] for w in kernel.warmed] == [16, 17, 32, 33] and len(kernel.threads) == 1


def test_every_distinct_launch_compiles_once_on_the_collecting_device(on_a_gpu: None) -> None:
    kernels = [WarmKernel() for _ in range(6)]
    x = torch.zeros(8)
    launches = [(k, (1,), (x, 8), {"BLOCK": 4}) for k in kernels for _ in range(2)]
    done = compile_ahead_of(lambda: launches, threads=4)
    assert (done.kernels, done.failed, done.threads, done.skipped) == (6, 0, 4, "")
    for k in kernels:
        assert k.warmed == [((1,), (x, 8), {"BLOCK": 4})] and k.devices == [3]
        assert all(name.startswith("coda-compile") for name in k.threads)
    assert _DEVICE.current == -1  # the caller's thread is left as it was


def test_a_kernel_s_caches_for_the_device_are_made_before_the_threads_start(
    on_a_gpu: None,
) -> None:
    made: list[tuple[int, str]] = []

    def make(device: int) -> dict:
        made.append((device, threading.current_thread().name))
        return {}

    kernel = WarmKernel()
    kernel.device_caches = _Caches(make)  # type: ignore[attr-defined]
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.float16)
    compile_ahead_of(lambda: [(kernel, (1,), (x,), {}), (kernel, (1,), (y,), {})], threads=2)
    assert made == [(3, threading.current_thread().name)] and len(kernel.warmed) == 2


class _Caches(dict):
    """A ``defaultdict`` whose factory is told the key (as a JITFunction's per-device caches)."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, device: int) -> dict:
        self[device] = value = self.make(device)
        return value


def test_a_launch_that_fails_to_compile_is_counted_not_raised(on_a_gpu: None) -> None:
    good, bad = WarmKernel(), WarmKernel(fail=True)
    x = torch.zeros(8)
    done = compile_ahead_of(lambda: [(good, (1,), (x,), {}), (bad, (1,), (x,), {})], threads=2)
    assert (done.kernels, done.failed) == (2, 1) and good.warmed and bad.warmed


def test_nothing_is_collected_where_nothing_would_compile_ahead(
    on_a_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def collect() -> list:
        raise AssertionError("collected for nothing")

    assert compile_ahead_of(collect, threads=1).skipped.startswith("one compile thread")
    monkeypatch.setattr(compile_ahead.backend, "INTERPRET", True)
    assert compile_ahead_of(collect, threads=8).skipped == "the interpreter compiles nothing"
    monkeypatch.setattr(compile_ahead.backend, "INTERPRET", False)
    assert compile_ahead_of(lambda: [(object(), (1,), (), {})], threads=8) == Ahead(
        skipped="nothing to compile"
    )


def test_a_collection_that_fails_is_left_to_the_run(on_a_gpu: None) -> None:
    def collect() -> list:
        raise IndexError("index 7 is out of bounds")

    done = compile_ahead_of(collect, threads=4)
    assert done.skipped == "collecting the launches failed: IndexError: index 7 is out of bounds"


def test_compile_threads_come_from_the_setting_or_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.from_environ({"CODA_COMPILE_THREADS": "3"}).compile_threads == 3
    assert Settings.from_environ({"CODA_COMPILE_THREADS": ""}).compile_threads is None
    for bad in ("0", "-2", "four", "1.5"):
        with pytest.raises(ValueError, match="CODA_COMPILE_THREADS=.*positive integer"):
            Settings.from_environ({"CODA_COMPILE_THREADS": bad})
    with override(compile_threads=5):
        assert compile_threads() == 5
    with override(compile_threads=None):
        monkeypatch.setattr(compile_ahead.os, "sched_getaffinity", lambda pid: set(range(64)))
        assert compile_threads() == compile_ahead.MAX_THREADS
        monkeypatch.setattr(compile_ahead.os, "sched_getaffinity", lambda pid: {0, 1})
        assert compile_threads() == 2


def _counting_launches(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    ran: list[Any] = []
    run = CodaInterpretedFunction.run

    def counting(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN001
        ran.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(CodaInterpretedFunction, "run", counting)
    return ran


def test_a_program_s_launches_are_collected_without_running_and_leave_its_runs_alone(
    mlp, monkeypatch: pytest.MonkeyPatch
) -> None:
    block, program, sizes = mlp
    inputs = block.make_inputs(sizes, torch.float32, seed=0)
    expected = compile_program(program, analyze(program, sizes))(inputs)
    compiled = compile_program(program, analyze(program, sizes))
    ran = _counting_launches(monkeypatch)
    calls = compiled.collect_launches(inputs)
    assert not ran  # nothing launched
    names = [c[0].fn.__name__ for c in calls]
    for kernel in compiled.kernels.values():  # every fused gemm step's kernel, in one variant
        assert sum(v.function in names for v in kernel.variants.values()) == 1
    assert not compiled._run_plans  # no plan kept from a run that launched nothing
    got = compiled(inputs)
    assert ran  # the real run launches
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


def test_prepared_tensors_collect_the_steps_launches_without_prep(
    mlp, monkeypatch: pytest.MonkeyPatch
) -> None:
    block, program, sizes = mlp
    compiled = compile_program(program, analyze(program, sizes))
    inputs = block.make_inputs(sizes, torch.float32, seed=0)
    whole = [c[0].fn.__name__ for c in compiled.collect_launches(inputs)]
    prepared = compiled.prepare(inputs)

    def no_prep(*args: Any) -> None:
        raise AssertionError("prepared tensors are prepared again")

    monkeypatch.setattr(compiled, "_run_prep", no_prep)
    steps = [c[0].fn.__name__ for c in compiled.collect_launches(prepared, prepared=True)]
    assert steps == whole[len(whole) - len(steps) :]  # the interpreter's prep launches nothing


def test_the_screen_compiles_every_config_ahead(mlp, monkeypatch: pytest.MonkeyPatch) -> None:
    block, program, sizes = mlp
    compiled = compile_program(program, analyze(program, sizes))
    tensors = compiled.run(compiled.prepare(block.make_inputs(sizes, torch.float32, seed=0)))
    name = next(iter(compiled.kernels))
    configs = [
        MainloopConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1),
        MainloopConfig(block_m=32, block_n=16, block_k=16, num_warps=1, num_stages=1),
    ]
    collected: list[list] = []
    monkeypatch.setattr(tuning, "compile_ahead_of", lambda collect: collected.append(collect()))
    ran = _counting_launches(monkeypatch)
    tuning._compile_configs_ahead(compiled, name, tensors, configs)
    assert not ran
    (calls,) = collected
    assert [(c[3]["BLOCK_SIZE_M"], c[3]["BLOCK_SIZE_N"]) for c in calls] == [(16, 16), (32, 16)]


def test_verify_compiles_each_sizes_dtype_and_mainloop_once_ahead(
    mlp, monkeypatch: pytest.MonkeyPatch
) -> None:
    block, program, sizes = mlp
    compiled = compile_program(program, analyze(program, sizes))
    seen: list[tuple] = []
    collect_launches = compiled.collect_launches

    def collecting(inputs: dict, *, poison: bool = False) -> list:
        seen.append((inputs["x"].shape[0], inputs["x"].dtype, compiled.mainloop, poison))
        return collect_launches(inputs, poison=poison)

    monkeypatch.setattr(compiled, "collect_launches", collecting)
    monkeypatch.setattr(stages, "compile_ahead_of", lambda collect: collect())
    other = {**sizes, "M": sizes["M"] + 3}
    checks = stages.verify(compiled, block, [sizes, other], ["float16"], [0, 1, 2], [])
    assert len(checks) == 6 and all(c.passed for c in checks)
    m, n = sizes["M"], other["M"]
    assert seen == [  # runs alternate mainloops: 6 runs, 4 distinct; then the input screen's
        (m, torch.float16, "auto", True),
        (m, torch.float16, "pointer", True),
        (n, torch.float16, "pointer", True),
        (n, torch.float16, "auto", True),
        (m, torch.float32, "auto", True),
    ]
    assert compiled.mainloop == "auto"
