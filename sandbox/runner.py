"""``evaluate``: run a candidate Program through every sandbox stage and return a Report.

validate and semantics run here (pure PyTorch, fast, no generated code executes); compile, verify
and profile run in a worker subprocess with a wall-clock timeout, its own Triton and kernel caches,
no provider secrets in its environment, in its own process group (killed whole on timeout). A hang,
crash or fault in a candidate becomes a failed stage in the Report, never an exception here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

from coda.blocks.block import Block
from coda.primitives import backend
from coda.primitives.ir import Program
from coda.primitives.runtime import compile_program

from .compare import OutputCheck
from .report import ProfileRow, Report, StageResult
from .stages import SandboxOptions, run_worker_stages, semantics, validate

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")


def program_hash(data: Program | dict | str) -> str:
    if isinstance(data, Program):
        text = data.canonical_json()
    else:
        text = data if isinstance(data, str) else json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        coda = version("coda-agent")
    except PackageNotFoundError:
        coda = "unknown"
    return {
        "coda-agent": coda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


OnStage = Callable[[StageResult], None]


class _Results(list):
    """Stage results that announce each one as it is appended (live progress)."""

    def __init__(self, on_stage: OnStage | None) -> None:
        super().__init__()
        self.on_stage = on_stage

    def append(self, item: StageResult) -> None:  # type: ignore[override]
        super().append(item)
        if self.on_stage is not None:
            self.on_stage(item)


def evaluate(
    data: Program | dict | str,
    block: Block,
    options: SandboxOptions | None = None,
    *,
    block_file: str | None = None,
    kernels_dir: Path | None = None,
    on_stage: OnStage | None = None,
) -> Report:
    """Every stage for one candidate. ``block_file`` lets the worker import a user's block;
    ``on_stage`` is called as each stage finishes."""
    options = options or SandboxOptions()
    results: list[StageResult] = _Results(on_stage)
    checks: list[OutputCheck] = []
    rows: list[ProfileRow] = []
    kernels: dict[str, str] = {}
    size_sets = list(options.verify_shapes(block))
    if not backend.INTERPRET and options.profile:
        size_sets += options.profile_shapes(block)
    program, infos = validate(data, block, size_sets, results)
    if program is not None:
        semantics(program, block, block.shapes.cpu, results)
    if program is not None and results[-1].status == "passed":
        compiled = compile_program(program, infos[0])
        kernels = {name: f"{name}.py" for name in compiled.kernels}
        if kernels_dir is not None:
            compiled.write_kernels(kernels_dir)
        payload = _run_stages(program, block, options, block_file, results)
        checks, rows = payload["checks"], payload["profile"]
    verified = (
        bool(results)
        and all(s.status != "failed" for s in results)
        and any(s.stage == "verify" and s.status == "passed" for s in results)
    )
    return Report(
        verified=verified,
        block=block.name,
        program_hash=program_hash(program or data),
        device=backend.describe(),
        stages=results,
        checks=checks,
        profile=rows,
        kernels=kernels,
        versions=versions(),
    )


def _run_stages(
    program: Program,
    block: Block,
    options: SandboxOptions,
    block_file: str | None,
    results: list[StageResult],
) -> dict[str, Any]:
    collected: dict[str, Any] = {"stages": results, "checks": [], "profile": [], "started": None}

    def absorb(kind: str, data: Any) -> None:
        if kind == "stage":
            collected["stages"].append(
                data if isinstance(data, StageResult) else StageResult.model_validate(data)
            )
            collected["started"] = None
        elif kind == "checks":
            collected["checks"] += [
                c if isinstance(c, OutputCheck) else OutputCheck.model_validate(c) for c in data
            ]
        elif kind == "profile":
            collected["profile"] += [
                r if isinstance(r, ProfileRow) else ProfileRow.model_validate(r) for r in data
            ]
        elif kind == "started":
            collected["started"] = data

    if not options.isolate:
        from coda.primitives.analysis import analyze

        info = analyze(program, options.verify_shapes(block)[0])
        run_worker_stages(program, info, block, options, absorb)
        return collected
    _run_isolated(program, block, options, block_file, absorb, collected)
    return collected


def worker_env(tmp: Path) -> dict[str, str]:
    """The worker's environment: no secrets, private caches, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not any(m in k.upper() for m in SECRET_MARKERS)}
    env.update(
        TRITON_CACHE_DIR=str(tmp / "triton"), CODA_CACHE_DIR=str(tmp / "coda"), PYTHONUNBUFFERED="1"
    )
    return env


def _run_isolated(
    program: Program,
    block: Block,
    options: SandboxOptions,
    block_file: str | None,
    absorb: Any,
    collected: dict[str, Any],
) -> None:
    with tempfile.TemporaryDirectory(prefix="coda-worker-") as tmpdir:
        tmp = Path(tmpdir)
        request = {
            "program": program.model_dump(mode="json"),
            "block": block.name,
            "block_file": block_file,
            "options": options.model_dump(mode="json"),
        }
        (tmp / "request.json").write_text(json.dumps(request))
        events = tmp / "events.jsonl"
        cmd = [sys.executable, "-m", "coda.sandbox.worker", str(tmp / "request.json"), str(events)]
        events.touch()
        with (
            open(tmp / "stdout", "wb") as out,
            open(tmp / "stderr", "wb") as err,
            open(events) as stream,
        ):
            proc = subprocess.Popen(
                cmd, cwd=tmp, env=worker_env(tmp), stdout=out, stderr=err, start_new_session=True
            )
            deadline = time.monotonic() + options.timeout_s
            cause = None
            while proc.poll() is None:
                _drain(stream, absorb)
                if time.monotonic() > deadline:
                    _kill_group(proc)
                    cause = f"timed out after {options.timeout_s:.0f} s (the worker was killed)"
                    break
                time.sleep(0.05)
            cause = cause or _exit_cause(proc.returncode)
            _drain(stream, absorb)
        if cause is not None:
            stage = collected["started"] or "compile"
            stage = stage if stage in ("compile", "verify", "profile") else "compile"
            tail = (tmp / "stderr").read_text(errors="replace")[-2000:].strip()
            message = f"the worker died during {stage}: {cause}"
            if tail:
                message += f"\nits last output:\n{tail}"
            collected["stages"].append(StageResult(stage=stage, status="failed", message=message))


def _drain(stream: Any, absorb: Callable[[str, Any], None]) -> None:
    """Absorb the complete event lines written since the last call."""
    while True:
        pos = stream.tell()
        line = stream.readline()
        if not line.endswith("\n"):
            stream.seek(pos)  # a partial line: read it once the worker finishes writing it
            return
        if line.strip():
            event = json.loads(line)
            absorb(event["event"], event["data"])


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _exit_cause(code: int) -> str | None:
    if code == 0:
        return None
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
