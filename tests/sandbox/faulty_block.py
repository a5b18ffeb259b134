"""A block file for fault tests: ``out = x + x @ w.T`` whose Add misbehaves inside a sandbox worker.

What it does there is chosen by ``$CODA_TEST_FAULT`` (the worker inherits the environment; outside
a worker the block is well-behaved). It misbehaves only in the kernel dtypes: the worker's float64
semantics stage passes and the fault hits its verify stage, which also runs the reference in the
dtype under test. ``$CODA_TEST_PID_FILE``, if set, collects the pid of every worker that ran
the reference (one line each); the ``hang`` fault writes its child's pid to
``$CODA_TEST_CHILD_PID_FILE``. The ``sleep`` fault waits ``$CODA_TEST_SLEEP_S`` seconds, once per
worker, then computes correctly: a candidate that verifies, slowly. The ``snoop`` fault is a
candidate after secrets: it records the worker's environment, its capabilities and what reading
its caller's ``/proc/<ppid>/environ`` gave, as JSON in ``$CODA_TEST_SNOOP_FILE``, then computes
correctly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import ClassVar, Literal

import torch

from coda.blocks import Block, Linear, ShapeSets, TensorSpec
from coda.blocks.ops import GraphOp


def faulty_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A residual connection (that misbehaves on purpose inside a sandbox worker, below float64)."""
    if os.environ.get("CODA_SANDBOX_WORKER") == "1" and a.dtype != torch.float64:
        _record_pid()
        _fault(os.environ.get("CODA_TEST_FAULT", "none"))
    return a + b


def _record_pid() -> None:
    path = os.environ.get("CODA_TEST_PID_FILE")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")


def _fault(kind: str) -> None:
    if kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "raise":
        raise ValueError("the block's helper failed on purpose")
    elif kind == "hang":
        child = subprocess.Popen(["sleep", "600"])
        with open(os.environ["CODA_TEST_CHILD_PID_FILE"], "w") as f:
            f.write(str(child.pid))
        time.sleep(600)
    elif kind == "oom":
        torch.empty(2 << 30, dtype=torch.uint8)  # 2 GiB: over the test's 1 GiB cap
    elif kind == "cuda":
        raise RuntimeError(
            "CUDA error: an illegal memory access was encountered\n"
            "CUDA kernel errors might be asynchronously reported at some other API call"
        )
    elif kind == "cuda_abort":
        sys.stderr.write("CUDA error: an illegal memory access was encountered\n")
        sys.stderr.flush()
        os.abort()
    elif kind == "exit0":
        os._exit(0)
    elif kind == "snoop":
        _snoop(os.environ["CODA_TEST_SNOOP_FILE"])
    elif kind == "sleep" and not _SLEPT:
        _SLEPT.append(True)
        time.sleep(float(os.environ["CODA_TEST_SLEEP_S"]))


_SLEPT: list[bool] = []  # the sleep fault has slept in this process


def _snoop(path: str) -> None:
    parent = f"/proc/{os.getppid()}/environ"
    try:
        with open(parent, "rb") as f:
            got = f"read {len(f.read())} bytes"
    except OSError as e:
        got = f"{type(e).__name__}: {e.strerror}"
    with open(f"/proc/{os.getpid()}/status") as f:
        caps = {k: v.strip() for k, _, v in (line.partition(":") for line in f) if "Cap" in k}
    with open(path, "w") as f:
        json.dump({"env": dict(os.environ), "parent_environ": got, "caps": caps}, f)


class FaultyAdd(GraphOp):
    op: Literal["faulty_add"] = "faulty_add"
    helper: ClassVar = staticmethod(faulty_add)
    a: str
    b: str

    def inputs(self) -> list[str]:
        return [self.a, self.b]


faulty = Block(
    name="faulty",
    description="x + x @ w.T",
    inputs={
        "x": TensorSpec(shape=["M", "d"]),
        "w": TensorSpec(shape=["d", "d"], init="linear_weight"),
    },
    graph=[Linear(x="x", weight="w", out="y"), FaultyAdd(a="x", b="y", out="out")],
    outputs=["out"],
    shapes=ShapeSets(cpu=[{"M": 8, "d": 16}]),
)
