"""The agent loop with a scripted model: Reports as tool results, errors as data, stopping rules,
budgets, retries, transcripts that resume and replay."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from coda.agent.loop import AgentLoop, Budgets
from coda.agent.providers import (
    ProviderError,
    ReplayProvider,
    RetryPromptPart,
    ToolResultPart,
    UserMessage,
)
from coda.agent.providers.base import DeadlineExceeded
from coda.agent.providers.retry import RetryPolicy, complete_with_retries
from coda.agent.runs import RunDir
from coda.agent.synthesize import BudgetError, resume, synthesize
from coda.agent.transcript import read_records

from .scripted import BLOCK, FAST, Script, broken_program, call, finish, good_program, submit, turn

QUICK_RETRY = RetryPolicy(attempts=3, base_delay_s=0.001, max_delay_s=0.01)


def run(script: Script, tmp_path: Path, **budgets):  # noqa: ANN003, ANN201
    return synthesize(
        BLOCK,
        tmp_path,
        provider=script,
        budgets=Budgets(**budgets),
        sandbox=FAST,
        retry=QUICK_RETRY,
    )


def results_in(message: UserMessage) -> list:
    return [p for p in message.parts if isinstance(p, ToolResultPart | RetryPromptPart)]


def test_a_broken_program_is_fixed_after_its_report(tmp_path: Path) -> None:
    script = Script(
        [submit(broken_program(), "c1"), submit(good_program(), "c2"), finish("verified")],
        model="claude-haiku-4-5",
    )
    result = run(script, tmp_path)
    assert result.verified and result.stop.kind == "finished"
    assert (
        result.turns == 3 and result.usage.input_tokens == 300 and result.usage.output_tokens == 60
    )
    assert result.cost_usd == pytest.approx((300 * 1.0 + 60 * 5.0) / 1e6)  # haiku 4.5 list price
    first, second = result.candidates
    assert first.report.failed_stage.stage == "semantics" and second.report.verified
    assert result.best is second
    # the Report went back as the tool result answering the first call
    (answer,) = results_in(script.requests[1][-1])
    assert answer.tool_call_id == "c1" and "FAILED at semantics" in answer.content
    assert "output 'out' does not match" in answer.content
    assert answer.data["report"]["verified"] is False
    # the run folder: best verified program, its kernels, report, summary, transcript
    folder = result.run.path
    assert json.loads((folder / "program.json").read_text())["steps"][2]["epilogue"][0]["op"] == (
        "add_tile"
    )
    assert {p.name for p in (folder / "kernels").iterdir()} == {"gate_up.py", "down.py"}
    assert json.loads((folder / "report.json").read_text())["verified"] is True
    summary = (folder / "summary.md").read_text()
    assert "- turns: 3" in summary and "- cost: $0.0006" in summary
    assert "- best time: not measured" in summary and "| 1 | 1 | failed |" in summary
    events = [r.event for r in read_records(folder / "transcript.jsonl")]
    assert events.count("candidate") == 2 and events[-1] == "end"


def test_malformed_calls_are_answered_with_the_error(tmp_path: Path) -> None:
    script = Script(
        [
            turn(call("submit_program", '{"program": {"block": ', "bad_json")),
            turn(call("submit", {"program": good_program()}, "typo")),
            turn(call("submit_program", {"programme": good_program()}, "no_field")),
            turn(call("describe_primitive", {"name": "scale_row"}, "desc")),
            turn(call("describe_primitive", {"name": "swiglu"}, "desc2")),
            finish("giving up"),
        ]
    )
    result = run(script, tmp_path, max_malformed=5)
    assert result.stop.kind == "finished" and not result.verified and result.tool_errors == 4
    answers = [results_in(r[-1])[0] for r in script.requests[1:]]
    assert "not valid JSON" in answers[0].content and answers[0].tool_call_id == "bad_json"
    assert "there is no tool 'submit': did you mean 'submit_program'?" in answers[1].content
    assert "program: Field required" in answers[2].content
    assert "did you mean 'scale_rows'?" in answers[3].content
    assert all(isinstance(a, RetryPromptPart) for a in answers[:4])
    assert isinstance(answers[4], ToolResultPart) and "adjacent column pairs" in answers[4].content


def test_replies_without_tool_calls_get_reminders_then_stop(tmp_path: Path) -> None:
    script = Script([turn(text="thinking...") for _ in range(3)])
    result = run(script, tmp_path, max_malformed=3)
    assert result.stop.kind == "malformed" and result.turns == 3
    reminder = script.requests[1][-1].parts[0]
    assert isinstance(reminder, RetryPromptPart) and "submit_program" in reminder.content


def test_an_invalid_program_comes_back_as_a_validate_report(tmp_path: Path) -> None:
    bad = {**good_program(), "steps": [{"kind": "gemm", "a": "x"}]}
    result = run(Script([submit(bad, "c1"), finish()]), tmp_path)
    (cand,) = result.candidates
    assert cand.program is None and cand.report.failed_stage.stage == "validate"
    assert not (result.run.path / "program.json").exists()  # only a verified program is written
    assert json.loads((result.run.path / "report.json").read_text())["verified"] is False


@pytest.mark.parametrize(
    "budgets,usage,kind",
    [
        ({"max_turns": 2}, (10, 10), "max_turns"),
        ({"max_tokens": 1000}, (500, 100), "max_tokens"),
        ({"max_cost": 0.0015}, (500, 100), "max_cost"),  # haiku: $0.001 per turn of this size
    ],
)
def test_budgets_stop_the_run(tmp_path: Path, budgets: dict, usage: tuple, kind: str) -> None:
    describe = [
        turn(call("describe_primitive", {"name": "rstd"}, f"d{i}"), usage=usage) for i in range(5)
    ]
    result = run(Script(describe, model="claude-haiku-4-5"), tmp_path, **budgets)
    assert result.stop.kind == kind and result.turns == 2


def test_wall_clock_timeout(tmp_path: Path) -> None:
    def slow_describe(i: int):  # noqa: ANN202
        time.sleep(0.2)
        return turn(call("describe_primitive", {"name": "rstd"}, f"d{i}"))

    script = Script([])
    script.fn = lambda system, messages, tools: slow_describe(len(messages))
    result = run(script, tmp_path, timeout_s=0.1)
    assert result.stop.kind == "timeout" and result.turns == 1


def test_unknown_price_is_unknown_and_max_cost_is_refused(tmp_path: Path) -> None:
    result = run(Script([finish()], model="my-local-model"), tmp_path)
    assert (
        result.cost_usd is None
        and "- cost: unknown" in (result.run.path / "summary.md").read_text()
    )
    with pytest.raises(BudgetError, match="no price is known for model 'my-local-model'"):
        run(Script([finish()], model="my-local-model"), tmp_path, max_cost=1.0)


def test_verified_then_no_improvement_converges(tmp_path: Path) -> None:
    idle = [turn(call("describe_primitive", {"name": "map"}, f"d{i}")) for i in range(5)]
    result = run(Script([submit(good_program(), "c1"), *idle]), tmp_path, patience=2)
    assert result.verified and result.stop.kind == "converged" and result.turns == 3


def test_a_refusal_ends_the_run(tmp_path: Path) -> None:
    result = run(Script([turn(text="I can't help with that.", stop="refusal")]), tmp_path)
    assert result.stop.kind == "refused" and "I can't help with that." in result.stop.message
    assert not result.verified


def test_retryable_errors_are_retried_and_recorded(tmp_path: Path) -> None:
    limited = ProviderError("rate limited (HTTP 429)", kind="rate_limit", retryable=True)
    result = run(Script([limited, limited, finish()]), tmp_path)
    assert result.stop.kind == "finished" and result.retries == 2
    records = read_records(result.run.transcript)
    assert [r.attempt for r in records if r.event == "retry"] == [1, 2]


def test_retries_are_bounded_and_config_errors_are_not_retried(tmp_path: Path) -> None:
    down = ProviderError("the server failed (HTTP 500)", kind="server", retryable=True)
    result = run(Script([down, down, down, finish()]), tmp_path)
    assert (
        result.stop.kind == "provider_error" and "gave up after 3 attempts" in result.stop.message
    )
    assert result.stop.exit_code == 1
    denied = ProviderError("rejected the credentials (HTTP 401)", kind="auth")
    result = run(Script([denied, finish()]), tmp_path)
    assert (
        result.stop.kind == "provider_error" and result.stop.exit_code == 2 and result.retries == 0
    )


def test_a_crashed_run_resumes_from_its_transcript(tmp_path: Path) -> None:
    crash = RuntimeError("the machine went away")
    first = Script([submit(broken_program(), "c1"), submit(good_program(), "c2"), crash])
    with pytest.raises(RuntimeError):
        run(first, tmp_path)
    (folder,) = tmp_path.iterdir()
    state = RunDir.open(folder).state()
    assert state.end is None and state.turns == 2 and state.best.index == 2

    second = Script([finish("resumed and done")])
    result = resume(RunDir.open(folder), BLOCK, second, sandbox=FAST, retry=QUICK_RETRY)
    assert result.verified and result.stop.kind == "finished"
    assert result.turns == 3 and result.usage.input_tokens == 300 and len(result.candidates) == 2
    # the resumed model saw the whole conversation, Reports included
    seen = second.requests[0]
    assert len(seen) == 5 and "FAILED at semantics" in results_in(seen[2])[0].content


def test_resume_answers_calls_a_crash_left_unanswered(tmp_path: Path) -> None:
    result = run(Script([submit(good_program(), "c1"), finish()]), tmp_path)
    transcript = result.run.transcript
    lines = transcript.read_text().splitlines()
    # keep run_start, the task and the first assistant turn; then a torn half-line
    transcript.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])
    state = RunDir.open(result.run.path).state()
    assert state.turns == 1 and not state.candidates and state.pending_calls()[0].id == "c1"

    again = Script([finish("answered on resume")])
    resumed = resume(RunDir.open(result.run.path), BLOCK, again, sandbox=FAST)
    assert resumed.verified and [c.tool_call_id for c in resumed.candidates] == ["c1"]
    assert results_in(again.requests[0][-1])[0].tool_call_id == "c1"


def test_replaying_a_transcript_reproduces_the_run(tmp_path: Path) -> None:
    original = run(
        Script([submit(broken_program(), "c1"), submit(good_program(), "c2"), finish()]),
        tmp_path / "a",
    )
    replay = ReplayProvider(original.run.transcript)
    again = synthesize(BLOCK, tmp_path / "b", provider=replay, sandbox=FAST)
    assert again.verified == original.verified and again.turns == original.turns
    assert again.usage == original.usage and again.stop.kind == "finished"
    assert [c.report.verified for c in again.candidates] == [False, True]
    assert again.best.report.program_hash == original.best.report.program_hash
    assert replay.divergences == []


def test_a_replay_that_runs_out_of_turns_ends_cleanly(tmp_path: Path) -> None:
    describe = [turn(call("describe_primitive", {"name": "rstd"}, f"d{i}")) for i in range(3)]
    short = run(Script(describe), tmp_path / "a", max_turns=2)
    again = synthesize(BLOCK, tmp_path / "b", provider=ReplayProvider(short.run.transcript))
    assert again.stop.kind == "end_of_transcript" and again.turns == 2


def test_loop_sends_the_system_prompt_and_the_tools(tmp_path: Path) -> None:
    seen = {}

    def model(system, messages, tools):  # noqa: ANN001, ANN202
        seen.update(system=system, tools=tools, task=messages[0].parts[0].text)
        return finish()

    script = Script([])
    script.fn = model
    loop = AgentLoop.start(BLOCK, script, tmp_path, sandbox=FAST)
    loop.run()
    assert [t.name for t in seen["tools"]] == ["submit_program", "describe_primitive", "finish"]
    assert "## Primitive catalogue" in seen["system"]
    assert "def llama_mlp(x, gamma, w_gate, w_up, w_down):" in seen["task"]


def test_an_internal_error_in_a_tool_is_answered_not_raised(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    def broken(name: str) -> str:
        raise OSError("disk on fire")

    monkeypatch.setattr("coda.agent.loop.describe_primitive", broken)
    script = Script([turn(call("describe_primitive", {"name": "rstd"}, "d1")), finish()])
    result = run(script, tmp_path)
    (answer,) = results_in(script.requests[1][-1])
    assert answer.is_error and "internal error while running describe_primitive" in answer.content
    assert "OSError: disk on fire" in answer.content and result.stop.kind == "finished"


def test_ctrl_c_records_the_interruption_and_the_run_resumes(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        run(Script([KeyboardInterrupt()]), tmp_path)
    (folder,) = tmp_path.iterdir()
    state = RunDir.open(folder).state()
    assert state.end.reason == "interrupted" and state.turns == 0
    again = Script([finish("back")], model="other-model")
    result = resume(RunDir.open(folder), BLOCK, again, sandbox=FAST)
    assert result.stop.kind == "finished" and result.turns == 1
    state = RunDir.open(folder).state()
    assert state.resumes == 1 and state.model == "other-model" and state.end.reason == "finished"


class _Timed:
    """A provider whose requests fail retryably after ``takes`` seconds of a fake clock; it
    records the timeout each request was given."""

    name, model = "timed", "timed"

    def __init__(self, clock: list[float], takes: float) -> None:
        self.clock, self.takes, self.timeouts = clock, takes, []

    def complete(self, system, messages, tools, *, timeout_s=None):  # noqa: ANN001, ANN201
        self.timeouts.append(timeout_s)
        self.clock[0] += min(self.takes, timeout_s if timeout_s is not None else self.takes)
        raise ProviderError("the server failed (HTTP 503)", kind="server", retryable=True)


def test_each_request_gets_the_remaining_time_and_retries_stop_at_the_deadline() -> None:
    clock = [0.0]
    provider = _Timed(clock, takes=1.0)
    policy = RetryPolicy(attempts=10, base_delay_s=0.5, max_delay_s=0.5)

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    with pytest.raises(DeadlineExceeded, match="no retry: the run's time budget ends in 0 s"):
        complete_with_retries(
            provider, "", [], [], policy, time_left=lambda: 4.2 - clock[0], sleep=sleep
        )
    # requests at t = 0, 1.5 and 3.0, each bounded by what was left of the 4.2 s; the third
    # failed at t = 4.0, too late for a 0.5 s wait
    assert provider.timeouts == pytest.approx([4.2, 2.7, 1.2])
    clock[0] = 0.0
    stalled = _Timed(clock, takes=600.0)  # never answers: cut off at the deadline, not retried
    with pytest.raises(DeadlineExceeded, match="the request was cut off when it ran out"):
        complete_with_retries(stalled, "", [], [], policy, time_left=lambda: 4.0 - clock[0])
    assert stalled.timeouts == [4.0]


def test_a_submitted_program_is_parsed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sandbox's validate stage parses the submission; the loop keeps that Program."""
    from coda.primitives.ir import Program

    script = Script([submit(broken_program(), "c1"), finish("gave up")])
    want = Program.parse(broken_program())
    parse = Program.parse.__func__
    parsed: list[object] = []

    def counting(cls, data):  # noqa: ANN001, ANN202
        program = parse(cls, data)
        if program.block == BLOCK.name:  # not other programs (e.g. the prompt's examples)
            parsed.append(data)
        return program

    monkeypatch.setattr(Program, "parse", classmethod(counting))
    result = run(script, tmp_path)
    assert result.candidates[0].program == want
    assert len(parsed) == 1, parsed


def test_arguments_too_deep_or_with_too_long_a_number_are_answered_and_resume(
    tmp_path: Path,
) -> None:
    deep = '{"program": ' + "[" * 100_000 + "]" * 100_000 + "}"
    long_number = '{"program": ' + "1" * 5000 + "}"
    script = Script(
        [
            turn(call("submit_program", deep, "deep"), call("submit_program", long_number, "n")),
            finish("gave up"),
        ]
    )
    result = run(script, tmp_path)
    assert result.stop.kind == "finished" and result.tool_errors == 2
    deep_answer, number_answer = results_in(script.requests[1][-1])
    assert isinstance(deep_answer, RetryPromptPart) and deep_answer.tool_call_id == "deep"
    assert "the arguments of 'submit_program' are nested too deeply to read" in (
        deep_answer.content
    )
    assert "hold a number too long to read (over 4300 digits)" in number_answer.content
    state = RunDir.open(result.run.path).state()  # what --resume and show read back
    assert state.calls() == {"deep": None, "n": None} and state.turns == 2


def test_a_tool_name_and_call_id_megabytes_long_are_cut_before_they_are_recorded(
    tmp_path: Path,
) -> None:
    huge = "x" * 5_000_000
    script = Script([turn(call(huge, {}, "id" + huge)), finish("gave up")])
    result = run(script, tmp_path)
    assert result.stop.kind == "finished" and result.tool_errors == 1
    assert result.run.transcript.stat().st_size < 100_000
    (recorded,) = script.requests[1][-2].tool_calls
    assert recorded.name == "x" * 64 + f"[… {len(huge) - 64} characters cut]"
    assert recorded.id.startswith("id" + "x" * 62 + "-cut-") and len(recorded.id) < 100
    (answer,) = results_in(script.requests[1][-1])
    assert answer.tool_call_id == recorded.id and "there is no tool 'xxx" in answer.content


def test_a_reply_is_kept_up_to_its_limit_in_all_and_the_rest_is_dropped(tmp_path: Path) -> None:
    from coda.agent.clipping import MAX_PART_CHARS, MAX_REPLY_CHARS
    from coda.agent.providers import AssistantTurn, TextPart

    texts = [TextPart(text=f"{i:02d}" + "y" * 249_998) for i in range(40)]
    late = call("finish", {"reason": "never run"}, "late")
    many = AssistantTurn(parts=[*texts, late], stop_reason="tool_use", model="test-model")
    script = Script([many, finish("done")])
    result = run(script, tmp_path)
    assert result.stop.kind == "finished" and result.tool_errors == 1
    assert result.run.transcript.stat().st_size < MAX_REPLY_CHARS + 100_000
    kept = script.requests[1][-2].parts
    assert len(kept) == 5 and not script.requests[1][-2].tool_calls  # the finish was dropped
    assert sum(len(p.text) for p in kept) < MAX_REPLY_CHARS + 200
    cut = MAX_REPLY_CHARS - 4 * 250_000
    assert kept[4].text.endswith(
        f"[… {250_000 - cut} characters cut: a whole reply is kept up to {MAX_REPLY_CHARS} "
        "characters]"
    )
    assert MAX_PART_CHARS < MAX_REPLY_CHARS
    (note,) = script.requests[1][-1].parts
    assert f"over what was left ({cut}) of the {MAX_REPLY_CHARS}-character limit" in note.content
    dropped = 35 * 250_000 + len(late.arguments) + len(late.name) + len(late.id)
    assert f"its last 36 part(s) ({dropped} characters) were dropped" in note.content
    assert "no tool call among them was run" in note.content
