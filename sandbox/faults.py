"""Naming what went wrong when a candidate did not merely fail a check.

Two views of a fault: from inside a stage (an exception the stage caught: out of memory, a CUDA
error, anything else) and from the parent (the worker process died: a signal, an exit code, the
wall-clock limit). Both end as a ``Cause`` and a message that says what happened and what follows
from it, with the evidence (the exception's last frames, or the worker's last stderr lines).
"""

from __future__ import annotations

import signal
import traceback

import torch

from coda.primitives.settings import current

from .report import Cause, Stage

WORKER_ENV = "CODA_SANDBOX_WORKER"  # set in the worker's environment: "1"

_OOM_MARKERS = (
    "out of memory",
    "can't allocate memory",
    "cannot allocate memory",
    "std::bad_alloc",
    "memoryerror",
)
_CUDA_MARKERS = (
    "cuda error",
    "illegal memory access",
    "illegal instruction",
    "device-side assert",
    "misaligned address",
    "unspecified launch failure",
    "cublas_status_execution_failed",
    "an illegal address",
)
_SIGNALS = {
    signal.SIGSEGV: "segmentation fault",
    signal.SIGBUS: "bus error",
    signal.SIGABRT: "aborted",
    signal.SIGFPE: "arithmetic fault",
    signal.SIGILL: "illegal instruction",
    signal.SIGKILL: "not by the sandbox: usually the system's out-of-memory killer",
}


def _looks_like(text: str, markers: tuple[str, ...]) -> bool:
    lower = text.lower()
    return any(m in lower for m in markers)


def classify_exception(error: BaseException) -> Cause:
    """``oom``, ``cuda_fault`` or ``exception`` for an exception a stage caught."""
    oom_types = tuple(
        t for t in (getattr(torch, "OutOfMemoryError", None), MemoryError) if t is not None
    )
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, oom_types) or _looks_like(text, _OOM_MARKERS):
        return "oom"
    if _looks_like(text, _CUDA_MARKERS):
        return "cuda_fault"
    return "exception"


# The memory cap this process (a worker) applied to itself, as the worker described it; or None.
_memory_cap: str | None = None


def note_memory_cap(described: str) -> None:
    """Record the memory cap the worker applied, for the messages of out-of-memory failures."""
    global _memory_cap
    _memory_cap = described


def in_worker() -> bool:
    return current().sandbox_worker


def _clip(text: str, limit: int = 1500) -> str:
    return text if len(text) <= limit else text[: limit // 2] + "\n…\n" + text[-limit // 2 :]


def _last_frames(error: BaseException, frames: int = 3) -> str:
    tb = traceback.extract_tb(error.__traceback__)[-frames:]
    return "".join(traceback.format_list(tb)).rstrip()


def describe_exception(stage: Stage, error: BaseException, cause: Cause) -> str:
    """The message of a stage that an exception ended."""
    what = _clip("".join(traceback.format_exception_only(type(error), error)).strip())
    if cause == "oom":
        cap = _memory_cap
        limit = f" (the worker's memory cap is {cap})" if cap else ""
        head = (
            f"out of memory in the {stage} stage{limit}: {what} — the candidate or its shapes "
            "need more memory than allowed; raise SandboxOptions.memory_limit_mb if that is "
            "expected"
        )
    elif cause == "cuda_fault":
        after = (
            "this worker's CUDA context is unusable now: it is discarded and the next candidate "
            "runs in a fresh worker"
            if in_worker()
            else "this process's CUDA context is unusable now (isolate=False): restart it"
        )
        head = (
            f"CUDA fault in the {stage} stage: {what} — a kernel accessed memory it does not own "
            f"or hit a device assert; {after}"
        )
    else:
        head = f"{type(error).__name__} while running the {stage} stage: {what}"
    frames = _last_frames(error)
    return f"{head}\nlast frames:\n{frames}" if frames else head


def describe_exit(returncode: int) -> tuple[Cause, str]:
    """Cause and words for a worker that exited with ``returncode`` (negative: a signal)."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return "crash", f"killed by signal {-returncode}"
        words = _SIGNALS.get(sig, "")
        return "crash", f"killed by {sig.name}" + (f" ({words})" if words else "")
    return "crash", f"exited with code {returncode}"


def refine_by_stderr(cause: Cause, stderr_tail: str) -> Cause:
    """A death whose stderr shows an allocation failure or a CUDA error is named for it."""
    if cause != "crash":
        return cause
    if _looks_like(stderr_tail, _OOM_MARKERS):
        return "oom"
    if _looks_like(stderr_tail, _CUDA_MARKERS):
        return "cuda_fault"
    return cause


def stderr_tail(text: str, lines: int = 30, limit: int = 2500) -> str:
    """The last lines of a worker's stderr (what a person reads first after a crash)."""
    tail = "\n".join(text.strip().splitlines()[-lines:])
    return tail if len(tail) <= limit else "…" + tail[-limit:]
