"""Workers for candidates evaluated at once: how many slots a machine has (one per GPU, or CPU
cores under the interpreter), a worker pinned to its GPU, and a worker its caller cancels."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from coda.blocks import load_block_file
from coda.sandbox import SandboxOptions
from coda.sandbox import slots as slots_module
from coda.sandbox.runner import evaluate_candidate, worker_env
from coda.sandbox.slots import visible_gpus, worker_slots
from tests.helpers import residual_program

from .test_isolation import _alive

BLOCK_FILE = str(Path(__file__).with_name("faulty_block.py"))
(BLOCK,) = load_block_file(BLOCK_FILE)


def test_interpreter_slots_default_to_cores_up_to_four(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots_module, "visible_gpus", lambda: [])
    monkeypatch.setattr(slots_module, "cpu_cores", lambda: 16)
    assert worker_slots() == [None] * 4
    assert worker_slots(6) == [None] * 6  # an explicit count is the caller's choice
    monkeypatch.setattr(slots_module, "cpu_cores", lambda: 2)
    assert worker_slots() == [None] * 2
    assert worker_slots(3, isolate=False) == [None]  # in process: one at a time
    with pytest.raises(ValueError, match="parallel must be at least 1"):
        worker_slots(0)


def test_gpu_slots_are_one_per_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots_module.backend, "INTERPRET", False)
    monkeypatch.setattr(slots_module.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    assert visible_gpus() == ["4", "6"]  # this process's own GPUs, as a worker names them
    assert worker_slots() == ["4", "6"]
    assert worker_slots(1) == ["4"]
    assert worker_slots(8) == ["4", "6"]  # never two workers on one GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert worker_slots() == ["0", "1"]


def test_a_pinned_worker_sees_only_its_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert worker_env(tmp_path, "2")["CUDA_VISIBLE_DEVICES"] == "2"
    assert worker_env(tmp_path)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_a_cancelled_worker_is_killed_with_its_process_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A worker that hangs in verify, pinned to GPU "7": its process tree carries that GPU, and
    setting ``cancel`` ends the evaluation at once (not at its 60 s timeout), killing the tree."""
    child_file = tmp_path / "child"
    monkeypatch.setenv("CODA_TEST_FAULT", "hang")
    monkeypatch.setenv("CODA_TEST_CHILD_PID_FILE", str(child_file))
    cancel, found = threading.Event(), []
    options = SandboxOptions(seeds=[0], dtypes=["float32"], timeout_s=60)

    def evaluate() -> None:
        found.append(
            evaluate_candidate(
                residual_program(BLOCK),
                BLOCK,
                options,
                block_file=BLOCK_FILE,
                gpu="7",
                cancel=cancel,
            )
        )

    thread = threading.Thread(target=evaluate, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not (child_file.exists() and child_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(child_file.read_text())
    environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=7" in environ
    cancelled_at = time.monotonic()
    cancel.set()
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - cancelled_at < 10
    (report, _program) = found[0]
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("verify", "cancelled"), failed
    assert (
        failed.message == "the worker was killed during verify: its caller cancelled the evaluation"
    )
    assert report.stages[-1] is failed
    while _alive(child) and time.monotonic() < cancelled_at + 10:
        time.sleep(0.1)
    assert not _alive(child), "the cancelled worker's child process outlived it"
