"""The worker subprocess: compile, verify and profile one candidate, reporting as it goes.

Run as ``python -m coda.sandbox.worker REQUEST.json EVENTS.jsonl``. Each finished stage (and the
start of each stage) is appended to the events file and flushed, so when a candidate hangs, crashes
or faults the GPU, the parent still knows which stage it died in. Nothing here is trusted by the
parent beyond those events.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def main(request_path: str, events_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    with open(events_path, "a", buffering=1) as events:

        def emit(kind: str, data: Any) -> None:
            events.write(json.dumps({"event": kind, "data": _jsonable(data)}) + "\n")
            events.flush()

        emit("started", "setup")
        # Imports happen here, after the parent set TRITON_INTERPRET and the cache directories in
        # our environment.
        from coda.blocks import get_block, load_block_file
        from coda.primitives.analysis import analyze
        from coda.primitives.ir import Program

        from .stages import SandboxOptions, run_worker_stages

        if request.get("block_file"):
            load_block_file(request["block_file"])
        block = get_block(request["block"])
        options = SandboxOptions.model_validate(request["options"])
        program = Program.parse(request["program"])
        info = analyze(program, options.verify_shapes(block)[0])
        emit("ready", None)
        run_worker_stages(program, info, block, options, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
