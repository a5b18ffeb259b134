"""The worker subprocess: semantics, compile, verify and profile of one validated candidate,
reporting as it goes.

Run as ``python -m coda.sandbox.worker REQUEST.json EVENTS.jsonl``. Each finished stage (and the
start of each stage) is appended to the events file and flushed, so when a candidate hangs, crashes
or faults the GPU, the parent still knows which stage it died in; the last event of a worker that
finished is ``done``. Nothing here is trusted by the parent beyond those events.

One worker serves one candidate and then exits: nothing a candidate did (a CUDA fault, a leak, a
corrupted allocator) can reach the next one. The price is the start-up (Python, torch, Triton and a
CUDA context: about 1–2 s) and Triton's compile cache, which is private to each worker.

First of all the worker gives up ``CAP_SYS_PTRACE`` (``fences.drop_ptrace``: with its caller
non-dumpable meanwhile, it cannot read the caller's ``/proc/<pid>/environ``). Before any candidate
work it caps its own memory (``apply_memory_cap``) and loads the
plugins the caller loaded, so a plugin's primitives parse here exactly as they did there.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .faults import note_memory_cap
from .fences import drop_ptrace


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def apply_memory_cap(megabytes: int | None) -> str:
    """Cap this process's data segment (``RLIMIT_DATA``) at ``megabytes``; say what was done.

    Why ``RLIMIT_DATA`` and not ``RLIMIT_AS``: since Linux 4.7 the data limit counts the heap and
    every private writable mapping — where torch, numpy and the interpreter allocate — but not
    read-only or ``PROT_NONE`` reservations. A CUDA process reserves a huge virtual range for
    unified addressing, and an address-space limit is known to make CUDA initialisation fail; the
    data limit leaves those reservations alone. Whether the CUDA driver's own host allocations
    stay under a given data cap has not been measured here, so ``memory_limit_mb="auto"`` caps
    only interpreted workers (``SandboxOptions.memory_cap_mb``); on a GPU an explicit value
    applies it. Device memory is not capped: running out of it raises ``torch.OutOfMemoryError``,
    which the stages report as ``oom``. Other platforms (macOS does not enforce the data limit,
    Windows has no ``resource``) run without a cap.
    """
    if megabytes is None:
        return "no memory cap"
    if not sys.platform.startswith("linux"):
        return f"no memory cap on {sys.platform}"
    import resource

    limit = megabytes << 20
    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    described = f"{limit >> 20} MiB (RLIMIT_DATA)"
    note_memory_cap(described)
    return f"memory cap {described}"


def main(request_path: str, events_path: str) -> int:
    fence = drop_ptrace()  # first: nothing of the candidate has been read or imported yet
    request = json.loads(Path(request_path).read_text())
    with open(events_path, "a", buffering=1) as events:

        def emit(kind: str, data: Any) -> None:
            events.write(json.dumps({"event": kind, "data": _jsonable(data)}) + "\n")
            events.flush()

        emit("started", "setup")
        emit("limits", fence)
        # Imports happen here, after the fence; the runner put the cache directories in our
        # environment.
        from coda.blocks import get_block, load_block_file
        from coda.primitives.analysis import analyze
        from coda.primitives.ir import Program
        from coda.primitives.plugins import load_plugins

        from .stages import SandboxOptions, run_worker_stages

        options = SandboxOptions.model_validate(request["options"])
        emit("limits", apply_memory_cap(options.memory_cap_mb()))
        load_plugins(options.plugins)
        if request.get("block_file"):
            load_block_file(request["block_file"])
        block = get_block(request["block"])
        program = Program.parse(request["program"])
        info = analyze(program, options.verify_shapes(block)[0])
        emit("ready", os.getpid())
        run_worker_stages(program, info, block, options, emit)
        emit("done", None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
