"""Worker isolation: every way a candidate can take its worker down becomes a failed stage that
names the stage, the cause and the evidence — and the next candidate runs in a fresh worker.

The faults are provoked from a user block file (``faulty_block.py``) that the worker imports: its
residual add misbehaves only inside a worker and only below float64, so the float64 semantics stage
passes and the fault hits the worker's verify stage. What is real here: SIGSEGV, SIGABRT, exit(),
Python exceptions, a hang with a child process (the whole process group is killed), and an
allocation over the worker's memory cap. What is simulated: a CUDA fault (no GPU) — the tests raise
CUDA's error text, or abort after printing it, and check that the sandbox names it, discards the
worker and starts a fresh one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from coda.blocks import load_block_file
from coda.sandbox import Report, SandboxOptions, evaluate
from coda.sandbox.faults import classify_exception, describe_exit, refine_by_stderr
from tests.helpers import residual_program

BLOCK_FILE = str(Path(__file__).with_name("faulty_block.py"))
(BLOCK,) = load_block_file(BLOCK_FILE)
PROGRAM = residual_program(BLOCK)
QUICK = {"seeds": [0], "dtypes": ["float32"]}


def run(monkeypatch: pytest.MonkeyPatch, fault: str, **options: object) -> Report:
    monkeypatch.setenv("CODA_TEST_FAULT", fault)
    return evaluate(PROGRAM, BLOCK, SandboxOptions(**{**QUICK, **options}), block_file=BLOCK_FILE)


def failed_in_verify(report: Report, cause: str) -> str:
    assert not report.verified
    assert report.stage("semantics").status == "passed"  # the same block, in float64, was fine
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("verify", cause), failed
    assert report.stages[-1] is failed  # nothing after the first failure
    return failed.message


@pytest.mark.parametrize(
    "fault,cause,fragments",
    [
        (
            "segv",
            "crash",
            [
                "the worker died during verify: killed by SIGSEGV (segmentation fault)",
                "last lines of the worker's stderr",
                "Fatal Python error: Segmentation fault",
                'faulty_block.py", line',  # faulthandler's stack of the worker
            ],
        ),
        (
            "raise",
            "exception",
            [
                "ValueError while running the verify stage",
                "the block's helper failed on purpose",
                "last frames:",
                "in _fault",
            ],
        ),
        (
            "exit0",
            "crash",
            ["the worker died during verify: exited (code 0) before it finished"],
        ),
        (
            "cuda_abort",
            "cuda_fault",
            [
                "the worker died during verify: killed by SIGABRT (aborted) after a CUDA error",
                "the GPU worker was discarded; the next candidate runs in a fresh one",
                "CUDA error: an illegal memory access was encountered",
            ],
        ),
    ],
)
def test_a_fault_becomes_a_failed_stage(
    monkeypatch: pytest.MonkeyPatch, fault: str, cause: str, fragments: list[str]
) -> None:
    message = failed_in_verify(run(monkeypatch, fault), cause)
    for fragment in fragments:
        assert fragment in message, message


def test_out_of_memory_under_the_workers_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same 2 GiB (untouched) allocation succeeds in this uncapped process ...
    assert torch.empty(2 << 30, dtype=torch.uint8).numel() == 2 << 30
    # ... and fails in a worker capped at 1 GiB.
    message = failed_in_verify(run(monkeypatch, "oom", memory_limit_mb=1024), "oom")
    assert "out of memory in the verify stage (the worker's memory cap is 1024 MiB" in message
    assert "can't allocate memory" in message
    assert "raise SandboxOptions.memory_limit_mb" in message


def test_a_cuda_fault_discards_the_worker_and_the_next_candidate_gets_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("CODA_TEST_PID_FILE", str(pids))
    message = failed_in_verify(run(monkeypatch, "cuda"), "cuda_fault")
    assert "CUDA fault in the verify stage: RuntimeError: CUDA error: an illegal memory" in message
    assert "it is discarded and the next candidate runs in a fresh worker" in message
    after = run(monkeypatch, "none")
    assert after.verified, after.render_text()
    seen = [int(line) for line in pids.read_text().split()]  # one line per reference run
    first, second = seen[0], seen[-1]
    assert set(seen) == {first, second} and first != second
    assert not _alive(first)  # the faulted worker is gone, not parked for reuse


def test_a_hang_is_killed_with_its_whole_process_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    child_file = tmp_path / "child"
    monkeypatch.setenv("CODA_TEST_CHILD_PID_FILE", str(child_file))
    start = time.monotonic()
    message = failed_in_verify(run(monkeypatch, "hang", timeout_s=8), "timeout")
    assert time.monotonic() - start < 30
    assert "the worker was killed during verify: timed out after 8 s" in message
    assert "with its whole process group" in message
    child = int(child_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the worker's child process outlived the worker"


def _alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


# -- naming causes (no worker needed) --------------------------------------------------------------
@pytest.mark.parametrize(
    "error,cause",
    [
        (MemoryError(), "oom"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"), "oom"),
        (RuntimeError("CUDA error: device-side assert triggered"), "cuda_fault"),
        (RuntimeError("CUDA error: misaligned address"), "cuda_fault"),
        (RuntimeError("shape mismatch"), "exception"),
        (RecursionError("maximum recursion depth exceeded"), "exception"),
    ],
)
def test_exceptions_are_classified(error: BaseException, cause: str) -> None:
    assert classify_exception(error) == cause


def test_deaths_are_named() -> None:
    assert describe_exit(-signal.SIGKILL) == (
        "crash",
        "killed by SIGKILL (not by the sandbox: usually the system's out-of-memory killer)",
    )
    assert describe_exit(-signal.SIGBUS)[1] == "killed by SIGBUS (bus error)"
    assert describe_exit(3) == ("crash", "exited with code 3")
    assert refine_by_stderr("crash", "terminate called after 'std::bad_alloc'") == "oom"
    assert refine_by_stderr("crash", "RuntimeError: CUDA error: an illegal address") == "cuda_fault"
    assert refine_by_stderr("crash", "Segmentation fault") == "crash"
