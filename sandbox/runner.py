"""``evaluate``: run a candidate Program through every sandbox stage and return a Report.

validate runs here: it parses and type-checks the program and sizes every tensor at every shape
set, allocating nothing (a program that would build a too-large tensor is refused here, in
milliseconds). Everything that allocates or runs the program — semantics (the reference executor),
compile (code generation included), verify and profile — runs in a fresh worker subprocess per
candidate: its own process group (killed whole on timeout, and swept when it exits), Triton and
kernel caches shared by the sandbox's workers only (content-addressed; or private ones:
``SandboxOptions.shared_caches``), a
memory cap, an environment built from an allowlist, and no way to read this
process's ``/proc`` files (``fences``). A hang, crash, exception,
out-of-memory or CUDA fault in a candidate becomes a failed stage in the Report, with its cause and
the worker's last stderr lines — never an exception here.

Several candidates may be evaluated at once, each from its own thread (the agent loop does, one
per worker slot: ``slots.py``): ``gpu`` pins a worker to one GPU, and setting ``cancel`` kills a
worker that is still running.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton

from coda.blocks.block import Block
from coda.primitives import backend
from coda.primitives.ir import Program, content_hash
from coda.primitives.plugins import PluginError, load_plugins
from coda.primitives.settings import current

from .compare import OutputCheck
from .faults import WORKER_ENV, describe_exit, refine_by_stderr, stderr_tail
from .fences import caller_undumpable, worker_environment
from .report import STAGES, Cause, ProfileRow, Report, SemanticsCoverage, Stage, StageResult
from .stages import WORKER_STAGES, SandboxOptions, run_worker_stages, semantics_seed, validate


def program_hash(data: Program | dict | str) -> str:
    """A short key for the candidate; any input hashes (text with lone surrogates included)."""
    if isinstance(data, Program):
        text = data.canonical_json()
    elif isinstance(data, str):
        text = data
    else:
        try:
            text = json.dumps(data, sort_keys=True, default=str)
        except (TypeError, ValueError):  # keys that are not strings, a cycle: not JSON at all
            text = repr(data)
    return content_hash(text)


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


log = logging.getLogger(__name__)
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


class _Collected:
    """What the worker's events said: stage results, checks, timings, kernels, progress."""

    def __init__(self, results: list[StageResult]) -> None:
        self.results = results
        self.checks: list[OutputCheck] = []
        self.profile: list[ProfileRow] = []
        self.kernels: dict[str, str] = {}  # step -> generated source
        self.coverage: SemanticsCoverage | None = None  # what semantics checked beyond shape sets
        self.started: str | None = None
        self.started_at = time.monotonic()
        self.ready = False  # the worker finished starting up (imports, plugins, block, program)
        self.done = False

    def absorb(self, kind: str, data: Any) -> None:
        if kind == "stage":
            self.results.append(
                data if isinstance(data, StageResult) else StageResult.model_validate(data)
            )
            self.started = None
        elif kind == "checks":
            self.checks += [
                c if isinstance(c, OutputCheck) else OutputCheck.model_validate(c) for c in data
            ]
        elif kind == "profile":
            self.profile += [
                r if isinstance(r, ProfileRow) else ProfileRow.model_validate(r) for r in data
            ]
        elif kind == "kernels":
            self.kernels.update(data)
        elif kind == "semantics":
            self.coverage = SemanticsCoverage.model_validate(data)
        elif kind == "started":
            self.started, self.started_at = data, time.monotonic()
        elif kind == "ready":
            self.ready = True
        elif kind == "done":
            self.done = True
        elif kind == "limits" and ("not dropped" in str(data) or "unchanged" in str(data)):
            # capabilities kept, or droppable only until an exec (root regains the bounding set)
            log.warning(
                "worker isolation: %s; the worker may read this process's /proc files", data
            )

    @property
    def failed(self) -> bool:
        return any(r.status == "failed" for r in self.results)

    def current_stage(self) -> Stage:
        """The stage a worker that died now was in (setup counts as its first stage)."""
        if self.started in STAGES:
            return self.started  # type: ignore[return-value]
        last = next((r.stage for r in reversed(self.results) if r.stage in WORKER_STAGES), None)
        if self.started == "setup" or last is None:
            return WORKER_STAGES[0]
        return STAGES[min(STAGES.index(last) + 1, len(STAGES) - 1)]


def _load_plugins(options: SandboxOptions, results: list[StageResult]) -> bool:
    try:
        load_plugins(options.plugins)
    except PluginError as e:
        results.append(
            StageResult(stage="validate", status="failed", message=str(e), cause="plugin")
        )
        return False
    return True


def evaluate(
    data: Program | dict | str,
    block: Block,
    options: SandboxOptions | None = None,
    *,
    block_file: str | None = None,
    kernels_dir: Path | None = None,
    on_stage: OnStage | None = None,
) -> Report:
    """Every stage for one candidate. ``block_file`` lets the worker import a user's block (a
    relative path is taken from the caller's current folder, not the worker's);
    ``kernels_dir`` receives the generated modules; ``on_stage`` is called as each stage finishes.
    """
    report, _program = evaluate_candidate(
        data, block, options, block_file=block_file, kernels_dir=kernels_dir, on_stage=on_stage
    )
    return report


def evaluate_candidate(
    data: Program | dict | str,
    block: Block,
    options: SandboxOptions | None = None,
    *,
    block_file: str | None = None,
    kernels_dir: Path | None = None,
    on_stage: OnStage | None = None,
    gpu: str | None = None,
    cancel: threading.Event | None = None,
) -> tuple[Report, Program | None]:
    """``evaluate``, and the Program the validate stage parsed ``data`` into (``None`` where
    validate failed), so a caller that keeps candidates never parses the submission again.

    ``gpu``: the worker's ``CUDA_VISIBLE_DEVICES`` (the one GPU it may use; ``None`` keeps this
    process's). ``cancel``: once set, a running worker is killed and its stage fails as cancelled.
    Both concern the worker only (``options.isolate``)."""
    options = options or SandboxOptions()
    results: list[StageResult] = _Results(on_stage)
    collected = _Collected(results)
    size_sets = list(options.verify_shapes(block))
    float32_at = options.float32_shape(block)
    if float32_at is not None and float32_at not in size_sets:
        size_sets.append(float32_at)
    if not backend.INTERPRET and options.profile:
        size_sets += options.profile_shapes(block)
    # The seed is drawn here, so the Report names it even if the worker dies before semantics ends.
    options = options.model_copy(update={"semantics_seed": semantics_seed(options)})
    program = None
    if _load_plugins(options, results):
        program, _infos = validate(data, block, size_sets, results, options)
    if program is not None:
        _run_stages(program, block, options, block_file, collected, _Worker(gpu, cancel))
        if kernels_dir is not None:
            _write_kernels(collected.kernels, kernels_dir)
    verified = (
        bool(results)
        and all(s.status != "failed" for s in results)
        and any(s.stage == "verify" and s.status == "passed" for s in results)
    )
    report = Report(
        verified=verified,
        block=block.name,
        program_hash=program_hash(program or data),
        device=backend.describe(),
        stages=results,
        checks=collected.checks,
        profile=collected.profile,
        kernels={name: f"{name}.py" for name in collected.kernels},
        versions=versions(),
        semantics=collected.coverage,
    )
    return report, program


def _write_kernels(kernels: dict[str, str], directory: Path) -> None:
    """The generated modules, as they were compiled, one file per fused step."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, source in kernels.items():
        if name.isidentifier():  # step names are validated identifiers: never a path
            (directory / f"{name}.py").write_text(source)


@dataclass(frozen=True)
class _Worker:
    """Where a worker runs and whether its caller still wants it: its GPU, the cancel event."""

    gpu: str | None
    cancel: threading.Event | None

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


def _run_stages(
    program: Program,
    block: Block,
    options: SandboxOptions,
    block_file: str | None,
    collected: _Collected,
    worker: _Worker,
) -> None:
    if not options.isolate:
        from coda.primitives.analysis import analyze

        info = analyze(program, options.verify_shapes(block)[0])
        run_worker_stages(program, info, block, options, collected.absorb)
        return
    _run_isolated(program, block, options, block_file, collected, worker)


def worker_env(tmp: Path, gpu: str | None = None, *, shared_caches: bool = True) -> dict[str, str]:
    """The worker's environment: the allowed variables of ours (``fences.allowed``), the caches,
    unbuffered output; ``gpu`` replaces ``CUDA_VISIBLE_DEVICES``.

    ``shared_caches`` (``SandboxOptions.shared_caches``): every worker compiles into one Triton
    cache and keeps generated modules and tuned configs in one coda cache, both under
    ``<coda cache>/sandbox`` — keyed by content (kernel text, Triton version, options) and written
    atomically — so a kernel an earlier candidate compiled or tuned is not compiled or tuned again
    (on a GPU each compile of a fused kernel costs seconds, per dtype and mainloop variant). They
    are the sandbox's own: a worker never writes into the caches this process or a drop-in loads
    kernels from. Otherwise both are private folders under ``tmp``, gone with the worker."""
    env = worker_environment(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if shared_caches:
        root = sandbox_cache_dir()
        caches = {"TRITON_CACHE_DIR": str(root / "triton"), "CODA_CACHE_DIR": str(root / "coda")}
    else:
        caches = {"TRITON_CACHE_DIR": str(tmp / "triton"), "CODA_CACHE_DIR": str(tmp / "coda")}
    env.update(caches, PYTHONUNBUFFERED="1", **{WORKER_ENV: "1"})
    return env


def sandbox_cache_dir() -> Path:
    """The caches sandbox workers share (``<coda cache>/sandbox``): apart from the caller's own
    Triton and coda caches, which trusted code loads kernels from."""
    return Path(current().cache_dir) / "sandbox"


def _run_isolated(
    program: Program,
    block: Block,
    options: SandboxOptions,
    block_file: str | None,
    collected: _Collected,
    worker: _Worker,
) -> None:
    with tempfile.TemporaryDirectory(prefix="coda-worker-") as tmpdir:
        tmp = Path(tmpdir)
        request = {
            # Canonical JSON of the parsed Program: the worker parses and validates it again itself
            # (the process boundary is a trust boundary), and the text it parses is the one hashed.
            "program": program.canonical_json(),
            "block": block.name,
            # The worker runs in ``tmp``: a relative path would be looked up there.
            "block_file": os.path.abspath(block_file) if block_file else None,
            "options": options.model_dump(mode="json"),
        }
        (tmp / "request.json").write_text(json.dumps(request))
        events = tmp / "events.jsonl"
        # -X faulthandler: a worker killed by SIGSEGV/SIGABRT/SIGBUS prints its Python stack first.
        cmd = [sys.executable, "-X", "faulthandler", "-m", "coda.sandbox.worker"]
        cmd += [str(tmp / "request.json"), str(events)]
        events.touch()
        with (
            open(tmp / "stdout", "wb") as out,
            open(tmp / "stderr", "wb") as err,
            open(events) as stream,
        ):
            with caller_undumpable():  # the worker cannot read our /proc/<pid>/environ
                proc = subprocess.Popen(
                    cmd,
                    cwd=tmp,
                    env=worker_env(tmp, worker.gpu, shared_caches=options.shared_caches),
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
                deadline = time.monotonic() + options.timeout_s
                timed_out = _watch(proc, stream, collected, deadline, worker)
            _drain(stream, collected.absorb)
        stderr = (tmp / "stderr").read_text(errors="replace")
        if worker.cancelled and not (collected.done or collected.failed):
            collected.results.append(_cancelled(collected))
            return
        if collected.done or collected.failed:
            _attach_stderr(collected.results, stderr)
            return  # the worker reported everything (a fault it caught is already a stage)
        stage, since = collected.current_stage(), collected.started_at
        death = _death(
            stage, proc.returncode, timed_out, options, stderr, since, began=collected.ready
        )
        collected.results.append(death)


def _attach_stderr(results: list[StageResult], stderr: str) -> None:
    """A fault the worker caught (exception, oom, CUDA) also shows the worker's last stderr."""
    tail = stderr_tail(stderr)
    last = results[-1] if results else None
    if not tail or last is None or last.cause not in ("exception", "oom", "cuda_fault"):
        return
    message = f"{last.message}\nlast lines of the worker's stderr:\n{tail}"
    results[-1] = last.model_copy(update={"message": message})


def _watch(
    proc: subprocess.Popen, stream: Any, collected: _Collected, deadline: float, worker: _Worker
) -> bool:
    """Follow the worker's events until it exits, the deadline passes or the caller cancels; True
    if it timed out.

    Either way the whole process group is killed afterwards: whatever the candidate started
    (compiler processes, stray children) does not outlive its worker.
    """
    timed_out = False
    try:
        while proc.poll() is None:
            _drain(stream, collected.absorb)
            if worker.cancelled:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        _kill_group(proc)
    return timed_out


def _cancelled(collected: _Collected) -> StageResult:
    """The failed stage of a worker killed because its caller cancelled the evaluation."""
    stage = collected.current_stage()
    return StageResult(
        stage=stage,
        status="failed",
        message=f"the worker was killed during {stage}: its caller cancelled the evaluation",
        seconds=round(time.monotonic() - collected.started_at, 3),
        cause="cancelled",
    )


# How to give the worker more time, named for the command line first, then for Python.
_MORE_TIME = "allow more time with a larger --timeout (SandboxOptions.timeout_s from Python)"
_SLOW_START = (
    "the worker was still starting up (Python, torch and Triton imports, plugins, the block "
    f"file) and never began {{stage}}: {_MORE_TIME}"
)
_SLOW_KERNEL = (
    "a kernel or step does not finish: look for a loop that never ends, or, for large shapes, "
    f"{_MORE_TIME}"
)
_SLOW_SEMANTICS = (
    "the program's float64 reference run at the block's CPU shapes does not finish: remove work "
    "the outputs do not need (extra steps, tensors built larger than the block's), or, for large "
    f"shapes, {_MORE_TIME}"
)


def _death(
    stage: Stage,
    returncode: int,
    timed_out: bool,
    options: SandboxOptions,
    stderr: str,
    start: float,
    *,
    began: bool = True,
) -> StageResult:
    """The failed stage of a worker that died without reporting a result (``began``: it had
    started ``stage``, not only its own start-up)."""
    tail = stderr_tail(stderr)
    cause: Cause
    if timed_out:
        cause = "timeout"
        if not began:
            why = _SLOW_START.format(stage=stage)
        else:
            why = _SLOW_SEMANTICS if stage == "semantics" else _SLOW_KERNEL
        what = f"timed out after {options.timeout_s:g} s (with its whole process group) — {why}"
    elif returncode == 0:
        cause, what = "crash", "exited (code 0) before it finished: something called exit()"
    else:
        cause, what = describe_exit(returncode)
        cause = refine_by_stderr(cause, tail)
        if cause == "cuda_fault":
            what += (
                " after a CUDA error: the GPU worker was discarded; the next candidate runs in a "
                "fresh one"
            )
        elif cause == "oom":
            what += " after an allocation failed (out of memory)"
    verb = "was killed" if timed_out else "died"
    message = f"the worker {verb} during {stage}: {what}"
    if tail:
        message += f"\nlast lines of the worker's stderr:\n{tail}"
    seconds = round(time.monotonic() - start, 3)
    return StageResult(stage=stage, status="failed", message=message, seconds=seconds, cause=cause)


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
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
