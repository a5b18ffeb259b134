"""Several ``submit_program`` calls in one turn: each answered against its call id, in call order,
evaluated at once (one worker slot each, a GPU apiece), bounded by the candidate and wall-clock
budgets, and answered again on resume. Most tests stand a recording sandbox in for
``evaluate_candidate`` (programs are ``{"name", "sleep", "verified"}``); one runs real workers."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from coda.agent.events import CandidateDone, CandidateStarted, StageDone, ToolAnswered
from coda.agent.loop import Budgets
from coda.agent.providers import RetryPromptPart, ToolResultPart, UserMessage
from coda.agent.runs import RunDir
from coda.agent.synthesize import resume, synthesize
from coda.agent.transcript import read_records
from coda.blocks import load_block_file
from coda.sandbox import SandboxOptions
from coda.sandbox.report import Report, StageResult
from tests.helpers import residual_program

from .scripted import BLOCK, FAST, Script, broken_program, call, finish, good_program, turn

ISOLATED = SandboxOptions(seeds=[0])  # the recording sandbox reads nothing else


@dataclass
class Ran:
    name: str
    gpu: str | None
    timeout_s: float
    began: float
    ended: float


class RecordingSandbox:
    """Stands in for ``evaluate_candidate``: sleeps ``program["sleep"]`` seconds (less if the
    batch is cancelled), posts one stage, and records where and when each program ran, how many
    ran at once, and any GPU that two ran on at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ran: list[Ran] = []
        self.busy: list[str | None] = []
        self.most_at_once = 0
        self.shared_gpus: list[str] = []

    def __call__(self, program: dict, block: Any, options: SandboxOptions, **kw: Any) -> tuple:
        gpu, began = kw["gpu"], time.monotonic()
        with self.lock:
            if gpu is not None and gpu in self.busy:
                self.shared_gpus.append(gpu)
            self.busy.append(gpu)
            self.most_at_once = max(self.most_at_once, len(self.busy))
        kw["on_stage"](StageResult(stage="validate", status="passed", message=program["name"]))
        kw["cancel"].wait(program["sleep"])
        with self.lock:
            self.busy.remove(gpu)
            self.ran.append(Ran(program["name"], gpu, options.timeout_s, began, time.monotonic()))
        return _report(program), None


def _report(program: dict) -> Report:
    verified = program.get("verified", True)
    stages = [StageResult(stage="validate", status="passed", message="ok")]
    stages.append(
        StageResult(stage="verify", status="passed", message="ok")
        if verified
        else StageResult(stage="verify", status="failed", message="mismatch", cause="mismatch")
    )
    return Report(
        verified=verified,
        block=BLOCK.name,
        program_hash=program["name"],
        device="cpu",
        stages=stages,
    )


def program(name: str, sleep: float = 0.0, verified: bool = True) -> dict:
    return {"name": name, "sleep": sleep, "verified": verified}


def submit_call(prog: Any, call_id: str) -> Any:
    return call("submit_program", {"program": prog}, call_id)


@pytest.fixture
def sandbox(monkeypatch: pytest.MonkeyPatch) -> RecordingSandbox:
    fake = RecordingSandbox()
    monkeypatch.setattr("coda.agent.loop.evaluate_candidate", fake)
    return fake


def answers(message: UserMessage) -> list[ToolResultPart | RetryPromptPart]:
    return [p for p in message.parts if isinstance(p, ToolResultPart | RetryPromptPart)]


def run(script: Script, tmp_path: Path, sandbox: SandboxOptions = ISOLATED, **budgets: Any):  # noqa: ANN201
    """The run, and every event with the thread it was delivered in."""
    events: list[tuple[Any, threading.Thread]] = []
    result = synthesize(
        BLOCK,
        tmp_path,
        provider=script,
        budgets=Budgets(**budgets),
        sandbox=sandbox,
        on_event=lambda e: events.append((e, threading.current_thread())),
    )
    return result, events


def test_three_submissions_in_one_turn_get_three_reports_in_call_order(tmp_path: Path) -> None:
    invalid = {**good_program(), "steps": [{"kind": "gemm", "a": "x"}]}
    script = Script(
        [
            turn(
                submit_call(broken_program(), "c_semantics"),
                submit_call(good_program(), "c_good"),
                submit_call(invalid, "c_validate"),
            ),
            finish("verified"),
        ]
    )
    result, _ = run(script, tmp_path, sandbox=FAST)
    assert result.verified and result.stop.kind == "finished" and result.turns == 2
    replies = answers(script.requests[1][-1])
    assert [a.tool_call_id for a in replies] == ["c_semantics", "c_good", "c_validate"]
    assert all(isinstance(a, ToolResultPart) for a in replies)
    assert replies[0].content.startswith("Candidate 1: FAILED at semantics")
    assert replies[1].content.startswith("Candidate 2: VERIFIED")
    assert replies[2].content.startswith("Candidate 3: FAILED at validate")
    assert [c.tool_call_id for c in result.candidates] == ["c_semantics", "c_good", "c_validate"]
    assert result.best is result.candidates[1]
    records = [r for r in read_records(result.run.transcript) if r.event == "candidate"]
    assert [(r.index, r.tool_call_id, r.verified) for r in records] == [
        (1, "c_semantics", False),
        (2, "c_good", True),
        (3, "c_validate", False),
    ]
    assert [r.best for r in records] == [True, True, False]
    # the transcript rebuilds the same candidates and best
    state = RunDir.open(result.run.path).state()
    assert [c.index for c in state.candidates] == [1, 2, 3] and state.best.index == 2


def test_submissions_run_at_once_one_per_gpu(
    tmp_path: Path, sandbox: RecordingSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("coda.sandbox.slots.visible_gpus", lambda: ["4", "6"])
    calls = [submit_call(program(f"p{i}", sleep=0.4), f"c{i}") for i in range(4)]
    script = Script([turn(*calls), finish()])
    result, events = run(script, tmp_path)
    assert [a.tool_call_id for a in answers(script.requests[1][-1])] == ["c0", "c1", "c2", "c3"]
    assert sandbox.most_at_once == 2 and sandbox.shared_gpus == []
    assert sorted(r.gpu for r in sandbox.ran) == ["4", "4", "6", "6"]
    wall = max(r.ended for r in sandbox.ran) - min(r.began for r in sandbox.ran)
    assert wall < sum(r.ended - r.began for r in sandbox.ran) - 0.4  # two waves of two, not four
    # every event was delivered in the loop's thread; each stage before its candidate's end
    assert {t for _, t in events} == {threading.main_thread()}
    kinds = [(type(e).__name__, getattr(e, "index", None)) for e, _ in events]
    for i in range(1, 5):
        started = kinds.index(("CandidateStarted", i))
        assert started < kinds.index(("StageDone", i)) < _done_at(events, i)


def _done_at(events: list, index: int) -> int:
    return next(
        n
        for n, (e, _) in enumerate(events)
        if isinstance(e, CandidateDone) and e.candidate.index == index
    )


def test_candidates_are_recorded_in_call_order_whatever_finishes_first(
    tmp_path: Path, sandbox: RecordingSandbox
) -> None:
    """Two verified candidates without timings: the first one submitted stays the best even when
    the second one's worker ends first."""
    slow, quick = program("slow", sleep=0.5), program("quick", sleep=0.0)
    script = Script([turn(submit_call(slow, "c_slow"), submit_call(quick, "c_quick")), finish()])
    result, events = run(script, tmp_path, parallel=2)
    assert [r.name for r in sandbox.ran] == ["quick", "slow"]  # quick ended first
    done = [e.candidate.tool_call_id for e, _ in events if isinstance(e, CandidateDone)]
    assert done == ["c_slow", "c_quick"]
    assert result.best.tool_call_id == "c_slow" and result.best.index == 1
    records = [r for r in read_records(result.run.transcript) if r.event == "candidate"]
    assert [(r.index, r.tool_call_id, r.best) for r in records] == [
        (1, "c_slow", True),
        (2, "c_quick", False),
    ]
    assert records[0].seconds >= 0.5 > records[1].seconds  # each its own worker's time


def test_submissions_past_max_candidates_are_answered_with_the_reason(
    tmp_path: Path, sandbox: RecordingSandbox
) -> None:
    calls = [submit_call(program(f"p{i}"), f"c{i}") for i in range(3)]
    script = Script([turn(*calls), finish()])
    result, events = run(script, tmp_path, max_candidates=2)
    assert result.stop.kind == "max_candidates" and result.turns == 1
    assert result.stop.message == "reached --max-candidates 2"
    assert [r.name for r in sandbox.ran] == ["p0", "p1"]
    (message,) = [m for m in RunDir.open(result.run.path).state().messages[2:]]
    first, second, third = answers(message)
    assert third.tool_call_id == "c2" and third.is_error and not first.is_error
    assert third.content == (
        "Not evaluated: --max-candidates 2 left room for 2 more candidate(s), taken by this "
        "turn's first 2 submission(s)."
    )
    assert [e.summary for e, _ in events if isinstance(e, ToolAnswered)] == [third.content]


def test_the_wall_clock_budget_bounds_the_whole_batch(
    tmp_path: Path, sandbox: RecordingSandbox
) -> None:
    """One slot: the first submission's worker gets the time left as its timeout; the second,
    still waiting when the time is up, is answered without running."""
    calls = [submit_call(program("p0", sleep=1.2), "c0"), submit_call(program("p1"), "c1")]
    script = Script([turn(*calls), finish()])
    result, _ = run(script, tmp_path, timeout_s=1.0, parallel=1)
    assert result.stop.kind == "timeout" and [r.name for r in sandbox.ran] == ["p0"]
    assert sandbox.ran[0].timeout_s <= 1.0
    message = RunDir.open(result.run.path).state().messages[2]
    evaluated, waiting = answers(message)
    assert evaluated.tool_call_id == "c0" and evaluated.content.startswith("Candidate 1: VERIFIED")
    assert waiting.tool_call_id == "c1" and waiting.is_error
    assert waiting.content == (
        "Not evaluated: the run's wall-clock budget (--timeout 1 s) ran out before a worker was "
        "free for it."
    )
    assert [c.index for c in result.candidates] == [1]


def test_finish_in_a_turn_with_submissions_is_answered_after_them(
    tmp_path: Path, sandbox: RecordingSandbox
) -> None:
    calls = [
        call("finish", {"reason": "done early"}, "fin"),
        submit_call(program("p0", verified=False), "c0"),
        call("describe_primitive", {"name": "rstd"}, "d0"),
        submit_call(program("p1"), "c1"),
    ]
    result, events = run(Script([turn(*calls)]), tmp_path)
    assert result.stop.kind == "finished" and result.stop.message == "done early"
    assert result.verified and result.best.tool_call_id == "c1"
    message = RunDir.open(result.run.path).state().messages[2]
    assert [a.tool_call_id for a in answers(message)] == ["fin", "c0", "d0", "c1"]
    order = [
        e.name if isinstance(e, ToolAnswered) else e.candidate.index
        for e, _ in events
        if isinstance(e, ToolAnswered | CandidateDone)
    ]
    assert order == ["describe_primitive", 1, 2, "finish"]


def test_resume_answers_every_call_of_a_torn_turn_at_once(
    tmp_path: Path, sandbox: RecordingSandbox
) -> None:
    """A crash after the turn's candidate records but before its answers: on resume all three
    calls are evaluated again (at once), under fresh candidate indices."""
    calls = [submit_call(program(f"p{i}", sleep=0.3), f"c{i}") for i in range(3)]
    first, _ = run(Script([turn(*calls), finish()]), tmp_path, parallel=3)
    transcript = first.run.transcript
    lines = transcript.read_text().splitlines()
    events = [line.split('"event": "')[1].split('"')[0] for line in lines]
    assert events[:6] == ["run_start", "message", "message", "candidate", "candidate", "candidate"]
    transcript.write_text("\n".join(lines[:6]) + "\n")
    state = RunDir.open(first.run.path).state()
    assert [c.id for c in state.pending_calls()] == ["c0", "c1", "c2"] and not state.candidates
    sandbox.ran.clear()
    sandbox.most_at_once = 0

    again = Script([finish("answered on resume")])
    resumed = resume(RunDir.open(first.run.path), BLOCK, again, sandbox=ISOLATED)
    assert resumed.stop.kind == "finished" and sandbox.most_at_once == 3
    assert [(c.index, c.tool_call_id) for c in resumed.candidates] == [
        (4, "c0"),
        (5, "c1"),
        (6, "c2"),
    ]
    (message,) = again.requests[0][-1:]
    assert [a.tool_call_id for a in answers(message)] == ["c0", "c1", "c2"]


def test_real_workers_evaluate_a_turns_submissions_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two isolated workers for a block whose residual add sleeps 3 s in each worker: the batch
    takes about as long as one candidate, not as long as both."""
    block_file = str(Path(__file__).parents[1] / "sandbox" / "faulty_block.py")
    (block,) = load_block_file(block_file)
    monkeypatch.setenv("CODA_TEST_FAULT", "sleep")
    monkeypatch.setenv("CODA_TEST_SLEEP_S", "3")
    prog = residual_program(block)
    script = Script([turn(submit_call(prog, "c1"), submit_call(prog, "c2")), finish()])
    stamps: dict[str, float] = {}

    def on_event(event: Any) -> None:
        if isinstance(event, CandidateStarted) and "start" not in stamps:
            stamps["start"] = time.monotonic()
        elif isinstance(event, CandidateDone):
            stamps["end"] = time.monotonic()
        elif isinstance(event, StageDone) and event.stage.status == "failed":
            pytest.fail(event.stage.message)

    result = synthesize(
        block,
        tmp_path,
        provider=script,
        budgets=Budgets(parallel=2),
        sandbox=SandboxOptions(seeds=[0], dtypes=["float32"]),
        block_file=block_file,
        on_event=on_event,
    )
    assert [c.report.verified for c in result.candidates] == [True, True]
    records = [r for r in read_records(result.run.transcript) if r.event == "candidate"]
    each = [r.seconds for r in records]
    assert min(each) >= 3.0
    # run one after the other, the batch would take the sum; at once, at least 3 s less
    assert stamps["end"] - stamps["start"] < sum(each) - 1.5, each


def test_ctrl_c_during_a_batch_cancels_its_workers(
    tmp_path: Path, sandbox: RecordingSandbox
) -> None:
    """Ctrl-C reaches the loop's thread while two workers run: both are cancelled (they would run
    for 30 s), and the run records the interruption."""

    def interrupt(event: Any) -> None:
        if isinstance(event, StageDone) and event.index == 2:
            raise KeyboardInterrupt

    calls = [submit_call(program(f"p{i}", sleep=30), f"c{i}") for i in range(2)]
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        synthesize(
            BLOCK,
            tmp_path,
            provider=Script([turn(*calls)]),
            budgets=Budgets(parallel=2),
            sandbox=ISOLATED,
            on_event=interrupt,
        )
    assert time.monotonic() - began < 10
    assert sorted(r.name for r in sandbox.ran) == ["p0", "p1"]  # both ended, early
    (folder,) = tmp_path.iterdir()
    state = RunDir.open(folder).state()
    assert state.end.reason == "interrupted" and state.pending_calls() and not state.candidates
