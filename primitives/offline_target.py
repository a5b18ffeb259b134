"""Compiling Triton kernels for a GPU this machine does not have, and Hopper's shared-memory budget.

``JITFunction.warmup(*args, grid=..., **meta)`` compiles a kernel exactly as a launch on those
arguments would — the same specialization, Triton's whole pipeline down to ``ptxas`` and a cubin —
for the target the active driver reports, and launches nothing. Inside ``for_target(arch)`` the
active driver is a stand-in that reports an NVIDIA GPU of compute capability ``arch`` (90: an
H100/H200), device 0 and stream 0: a CPU machine then compiles what a GPU would, to find what the
interpreter cannot — code Triton's compiler refuses, a kernel over its shared memory — without one
(``tests/export/test_shipped_kernels_for_hopper.py``, ``bench/experiments/gluon_pingpong.py``).

Compile in a process where coda's kernels are Triton's own ``JITFunction``s: once a kernel has run
in the interpreter, ``triton.language`` stays patched in that process (``backend``), and on a
machine without a GPU ``backend.jit`` makes coda's kernels interpreted ones.

``fits(shared_bytes, per_sm)``: whether that many programs of a kernel asking that much shared
memory are resident on one Hopper SM at once (Triton refuses to launch one over
``MAX_PROGRAM_SHARED_BYTES``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import triton
from triton.backends.compiler import GPUTarget

# Hopper: 228 KB of shared memory an SM, at most 227 KB a program, 1 KB reserved per program.
SM_SHARED_BYTES = 228 * 1024
MAX_PROGRAM_SHARED_BYTES = 227 * 1024


def fits(shared_bytes: int, per_sm: int = 1) -> bool:
    """Whether ``per_sm`` programs of ``shared_bytes`` each can be resident on one Hopper SM."""
    per_program = min(MAX_PROGRAM_SHARED_BYTES, SM_SHARED_BYTES // per_sm - 1024)
    return shared_bytes <= per_program


class StandInDriver:
    """What ``JITFunction.warmup`` asks of Triton's driver: the target, the device and its stream
    (nothing is loaded or launched)."""

    def __init__(self, arch: int = 90) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextmanager
def for_target(arch: int = 90) -> Iterator[StandInDriver]:
    """Make Triton's active driver a ``StandInDriver`` for ``arch`` until the block ends (then the
    driver active before, or none chosen yet, as it was)."""
    config = triton.runtime.driver
    previous = config._active  # None until a driver was first asked for
    stand_in = StandInDriver(arch)
    config.set_active(stand_in)
    try:
        yield stand_in
    finally:
        config.set_active(previous)
