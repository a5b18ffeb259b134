"""Run a turn's jobs (its ``submit_program`` calls) at once, one thread per job in flight.

``run_in_slots`` starts each job in a thread of its own as soon as a slot is free (a slot is a
worker the machine can run at once: ``coda.sandbox.slots``), in the order the jobs came. The job's
work runs in its thread (``evaluate_candidate`` mostly waits on its worker subprocess); everything
else runs in the calling thread, which alone touches the loop's state: starting a job (its
candidate index, the options it gets), the events a job posts while it runs (stage results), and
finishing it (the transcript record, the best candidate, the answer) — finishing in job order,
whatever order the threads end in, so that a run's records do not depend on which worker was
faster. ``may_start`` is asked before each job starts; once it gives a reason (the run's time is
up), the jobs not started are skipped with it.

If the calling thread is interrupted (Ctrl-C) or one of its callbacks raises, the ``cancel`` event
that every job received is set — a job's worker is killed — and the threads are given a moment to
end before the exception goes on.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

J = TypeVar("J")  # a job
S = TypeVar("S")  # a slot (for a sandbox worker: the GPU it is pinned to, or None)

JOIN_AFTER_CANCEL_S = 5.0  # how long a cancelled job's thread may take to end
POLL_S = 0.2  # how often the calling thread wakes while it waits (so that Ctrl-C is seen)

Post = Callable[[Any], None]
Work = Callable[[J, S, Post, threading.Event], Any]


@dataclass
class Outcome:
    """What a job's work returned, or the exception it raised."""

    value: Any = None
    error: Exception | None = None


@dataclass
class Hooks(Generic[J]):
    """The calling thread's side of a batch (see the module docstring)."""

    may_start: Callable[[], str | None]  # None: go ahead; else why the rest are not started
    on_start: Callable[[J], None]
    on_event: Callable[[Any], None]  # something a running job posted
    on_done: Callable[[J, Outcome], None]  # in job order
    on_skip: Callable[[J, str], None]


def run_in_slots(jobs: list[J], slots: list[S], work: Work, hooks: Hooks[J]) -> None:
    """Run every job, at most ``len(slots)`` at once, each given a free slot; see the module
    docstring for which thread does what."""
    if not slots:
        raise ValueError("run_in_slots needs at least one slot")
    inbox: queue.Queue = queue.Queue()
    cancel = threading.Event()
    free, waiting = deque(slots), deque(enumerate(jobs))
    running: dict[int, threading.Thread] = {}
    ended: dict[int, Outcome] = {}
    next_done = 0

    def post(event: Any) -> None:
        inbox.put(("event", event))

    def thread(position: int, job: J, slot: S) -> None:
        try:
            outcome = Outcome(value=work(job, slot, post, cancel))
        except Exception as e:  # noqa: BLE001 - handed to the calling thread, which answers it
            outcome = Outcome(error=e)
        inbox.put(("done", position, slot, outcome))

    try:
        while waiting or running:
            while waiting and free:
                reason = hooks.may_start()
                if reason is not None:
                    for _, job in waiting:
                        hooks.on_skip(job, reason)
                    waiting.clear()
                    break
                position, job = waiting.popleft()
                slot = free.popleft()
                hooks.on_start(job)
                running[position] = threading.Thread(
                    target=thread,
                    args=(position, job, slot),
                    name=f"coda-job-{position}",
                    daemon=True,
                )
                running[position].start()
            if not running:
                break
            try:
                message = inbox.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if message[0] == "event":
                hooks.on_event(message[1])
                continue
            _, position, slot, outcome = message
            running.pop(position).join()
            free.append(slot)
            ended[position] = outcome
            while next_done in ended:
                hooks.on_done(jobs[next_done], ended.pop(next_done))
                next_done += 1
    finally:
        if running:
            cancel.set()
            for t in running.values():
                t.join(JOIN_AFTER_CANCEL_S)
