"""The agent loop: ask the provider for a turn, answer its tool calls, repeat until a stopping rule.

One turn:

1. Check the budgets (``Budgets``): turns, tokens, dollars, wall-clock time.
2. ``provider.complete(system, messages, tools)``, with bounded retries (``providers/retry.py``),
   each request cut off when the run's wall-clock budget ends (a ``timeout`` stop).
3. Cut any reply part past ``clipping.MAX_PART_CHARS``, and a reply past
   ``clipping.MAX_REPLY_CHARS`` in all, before it is recorded (``clipping.clip_reply``; a cut
   tool call is answered with an error, not run). Answer every tool call, in one message, in the
   order the calls came: ``describe_primitive`` returns a primitive's documentation; each
   ``submit_program`` runs the sandbox and returns its Report rendered compactly (the full Report
   rides along as data) — a turn's submissions are evaluated at once, one worker each, as many
   as there are worker slots (``batch.py``, ``Budgets.parallel``); ``finish``, answered after
   them, ends the run. A malformed call (bad JSON, unknown tool, missing field) is answered with
   the error, so the model can fix it; a reply with no tool call gets a reminder.
4. Stop when the model finishes or refuses, when a verified candidate has not been improved on for
   ``patience`` turns, when a budget runs out, after ``max_malformed`` unusable replies in a row,
   or when the provider fails for good. Submissions past ``max_candidates``, or still waiting
   for a worker when the wall-clock budget ends, are answered with an error saying so.

Every message and candidate is appended to the run's transcript as it happens, so a crash loses
nothing, ``resume`` continues from the transcript, and ``--provider replay`` replays it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from coda.blocks.block import Block
from coda.primitives import backend
from coda.primitives.plugins import PluginError, load_plugins
from coda.sandbox.report import Report
from coda.sandbox.runner import evaluate_candidate
from coda.sandbox.slots import worker_slots
from coda.sandbox.stages import SandboxOptions

from .batch import Hooks, Outcome, Post, run_in_slots
from .clipping import Cut, call_note, clip_reply, text_note
from .events import (
    CandidateDone,
    CandidateStarted,
    OnEvent,
    Retrying,
    StageDone,
    Stop,
    Stopped,
    ToolAnswered,
    TurnEnded,
    TurnStarted,
)
from .prompting import UnknownPrimitive, describe_primitive, system_prompt, task_prompt
from .providers.base import (
    AssistantTurn,
    DeadlineExceeded,
    Provider,
    ProviderError,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
    TranscriptExhausted,
    Usage,
    UserMessage,
)
from .providers.pricing import cost_usd, price_for
from .providers.retry import RetryPolicy, complete_with_retries
from .runs import RunDir
from .summary import RunFacts, run_markdown
from .tools import DescribePrimitive, Finish, Request, SubmitProgram, parse_call, tool_specs
from .transcript import (
    Candidate,
    CandidateRecord,
    EndRecord,
    MessageRecord,
    ResumeRecord,
    RetryRecord,
    RunStart,
    RunState,
    better,
)


@dataclass(frozen=True)
class Budgets:
    """When the loop stops on its own, and how many candidates it evaluates at once. ``None``
    means no limit.

    ``patience``: once a candidate is verified, stop after this many turns without a better one.
    ``max_malformed``: stop after this many replies in a row with no usable tool call.
    ``timeout_s`` is wall-clock time of this invocation (a resumed run gets a fresh one); it
    bounds a turn's evaluations too (each worker's timeout is the time left when it starts).
    ``max_candidates``: stop once this many candidates were evaluated; a turn that submits more
    than are left has its first submissions evaluated and the rest answered with an error.
    ``parallel``: how many of a turn's submissions are evaluated at once (``None``: one per GPU,
    or min(CPU cores, 4) under the interpreter; never more than one per GPU: ``sandbox.slots``).
    """

    max_turns: int = 20
    max_tokens: int | None = None
    max_cost: float | None = None
    timeout_s: float | None = None
    patience: int = 3
    max_malformed: int = 3
    max_candidates: int | None = None
    parallel: int | None = None


@dataclass
class _Job:
    """One ``submit_program`` call of a turn: where it stands among the turn's calls, and, once it
    starts, its candidate index and the sandbox options it runs with."""

    position: int
    call: ToolCallPart
    program: Any
    index: int = 0
    options: SandboxOptions | None = None


@dataclass
class AgentResult:
    """How a run went; the same numbers are in ``summary.md`` and the transcript's end record."""

    run: RunDir
    block: str
    provider: str
    model: str
    turns: int
    usage: Usage
    cost_usd: float | None
    candidates: list[Candidate]
    best: Candidate | None
    stop: Stop
    seconds: float
    tool_errors: int = 0
    retries: int = 0

    @property
    def verified(self) -> bool:
        return self.best is not None and self.best.report.verified


@dataclass
class _Counters:
    turns: int = 0
    usage: Usage = field(default_factory=Usage)
    cost_usd: float | None = 0.0
    best_turn: int = 0
    unusable_streak: int = 0
    tool_errors: int = 0
    retries: int = 0


# Sandbox options a transcript never chooses on resume: which code is imported here and in the
# worker (plugins) and whether candidates leave this process at all. They come from whoever
# resumes (``$CODA_PLUGINS``, the defaults), so a tampered transcript cannot pick them.
CALLER_ONLY_OPTIONS = frozenset({"plugins", "isolate"})


def recorded_sandbox(recorded: dict[str, Any]) -> SandboxOptions:
    """The recorded sandbox options of a run, less ``CALLER_ONLY_OPTIONS``."""
    return SandboxOptions(**{k: v for k, v in recorded.items() if k not in CALLER_ONLY_OPTIONS})


class AgentLoop:
    """Drives one run of ``provider`` on ``block``; ``run()`` returns the ``AgentResult``.

    Build it with ``start`` (a new run folder) or ``resume`` (continue one from its transcript).
    """

    def __init__(
        self,
        block: Block,
        provider: Provider,
        run: RunDir,
        *,
        system: str,
        tools: list[ToolSpec],
        messages: list[UserMessage | AssistantTurn],
        budgets: Budgets,
        sandbox: SandboxOptions,
        block_file: str | None,
        retry: RetryPolicy,
        on_event: OnEvent | None,
    ) -> None:
        self.block, self.provider, self.run_dir = block, provider, run
        self.system, self.tools, self.messages = system, tools, messages
        self.budgets, self.sandbox, self.block_file = budgets, sandbox, block_file
        self.retry = retry
        self.emit: OnEvent = on_event or (lambda event: None)
        self.n = _Counters()
        self.candidates: list[Candidate] = []
        self.best: Candidate | None = None
        self.next_index = 1
        self.started = time.monotonic()
        self.slots = worker_slots(budgets.parallel, isolate=sandbox.isolate)
        self._pending: list[ToolCallPart] = []
        self._finish: str | None = None
        self._cuts: list[Cut] = []  # what was cut from the reply being answered

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        block: Block,
        provider: Provider,
        runs_dir: Any,
        *,
        budgets: Budgets | None = None,
        sandbox: SandboxOptions | None = None,
        block_file: str | None = None,
        base_url: str | None = None,
        transcript: str | None = None,
        retry: RetryPolicy | None = None,
        on_event: OnEvent | None = None,
    ) -> AgentLoop:
        """A new run folder with its ``run_start`` record and the task message (turn 0)."""
        budgets, sandbox = budgets or Budgets(), sandbox or SandboxOptions()
        run = RunDir.create(runs_dir, block.name)
        system, tools = system_prompt(), tool_specs()
        run.append(
            RunStart(
                block=block.name,
                block_file=block_file,
                provider=provider.name,
                model=provider.model,
                base_url=base_url,
                transcript=transcript,
                budgets=budgets.__dict__,
                sandbox=sandbox.model_dump(mode="json"),
                system=system,
                tools=tools,
                started_at=_now(),
            )
        )
        task = UserMessage(parts=[TextPart(text=task_prompt(block, sandbox))])
        run.append(MessageRecord(turn=0, message=task))
        return cls(
            block,
            provider,
            run,
            system=system,
            tools=tools,
            messages=[task],
            budgets=budgets,
            sandbox=sandbox,
            block_file=block_file,
            retry=retry or RetryPolicy(),
            on_event=on_event,
        )

    @classmethod
    def resume(
        cls,
        block: Block,
        provider: Provider,
        run: RunDir,
        *,
        budgets: Budgets | None = None,
        sandbox: SandboxOptions | None = None,
        retry: RetryPolicy | None = None,
        on_event: OnEvent | None = None,
        block_file: str | None = None,
    ) -> AgentLoop:
        """Continue ``run`` from its transcript: same system prompt, tools and history; turns,
        tokens, cost and the best candidate carry on; unanswered tool calls are answered first.
        ``block_file`` is the file the worker imports ``block`` from: a transcript is data and
        never names code to run, so the path it recorded is not used."""
        state = run.state()
        start = state.start
        loop = cls(
            block,
            provider,
            run,
            system=start.system,
            tools=start.tools,
            messages=list(state.messages),
            budgets=budgets or Budgets(**start.budgets),
            sandbox=sandbox or recorded_sandbox(start.sandbox),
            block_file=block_file,
            retry=retry or RetryPolicy(),
            on_event=on_event,
        )
        loop._adopt(state)
        run.append(
            ResumeRecord(
                at=_now(), turns_before=state.turns, provider=provider.name, model=provider.model
            )
        )
        return loop

    def _adopt(self, state: RunState) -> None:
        self.n.turns, self.n.usage, self.n.cost_usd = state.turns, state.usage, state.cost_usd
        self.n.best_turn, self.n.tool_errors = state.best_turn, state.malformed
        self.n.retries = state.retries
        self.candidates, self.best = list(state.candidates), state.best
        self.next_index = state.next_candidate
        self._pending = list(state.pending_calls())

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> AgentResult:
        stop: Stop | None = None
        try:
            if self._pending:
                stop = self._answer(self._pending)
            while stop is None:
                stop = self._over_budget() or self._turn()
        except KeyboardInterrupt:
            stop = Stop("interrupted", "interrupted (Ctrl-C)")
            self._finalize(stop)
            raise
        return self._finalize(stop)

    def _turn(self) -> Stop | None:
        turn_no = self.n.turns + 1
        self.emit(TurnStarted(turn_no))
        began = time.monotonic()
        try:
            reply = complete_with_retries(
                self.provider,
                self.system,
                self.messages,
                self.tools,
                self.retry,
                on_retry=lambda a, d, e: self._on_retry(turn_no, a, d, e),
                time_left=self._time_left,
            )
        except TranscriptExhausted as e:
            return Stop("end_of_transcript", e.message)
        except DeadlineExceeded as e:
            return Stop(
                "timeout",
                f"ran out of wall-clock time (--timeout {self.budgets.timeout_s:g} s) waiting for "
                f"the provider: {e.message}",
            )
        except ProviderError as e:
            return Stop("provider_error", e.message, exit_code=e.exit_code)
        seconds = time.monotonic() - began
        reply, self._cuts = clip_reply(reply)
        cost = self._cost(reply)
        self.n.turns = turn_no
        self.n.usage = self.n.usage + reply.usage
        self.n.cost_usd = (
            None if cost is None or self.n.cost_usd is None else self.n.cost_usd + cost
        )
        self._record(reply, seconds=round(seconds, 3), cost_usd=cost)
        self.emit(TurnEnded(turn_no, reply, seconds, self.n.usage, self.n.cost_usd))
        if reply.stop_reason == "refusal":
            why = reply.text or "no explanation given"
            return Stop("refused", f"the model refused: {why}")
        if not reply.tool_calls:
            return self._remind(reply)
        return self._answer(reply.tool_calls)

    def _remind(self, reply: AssistantTurn) -> Stop | None:
        """A reply without a tool call: say what is expected (bounded)."""
        self.n.unusable_streak += 1
        self.n.tool_errors += 1
        if reply.stop_reason == "max_tokens":
            note = (
                "Your reply was cut off at the output token limit before any tool call. Reply "
                "with one tool call and little prose."
            )
        else:
            note = (
                "Reply with a tool call: `submit_program` to try a Program, `describe_primitive` "
                "for a primitive's schema, or `finish` to end the run."
            )
        note = " ".join([*(text_note(c) for c in self._cuts if c.call is None), note])
        self._record(UserMessage(parts=[RetryPromptPart(content=note)]))
        self.emit(ToolAnswered("(no tool call)", False, note))
        if self.n.unusable_streak >= self.budgets.max_malformed:
            return Stop(
                "malformed", f"{self.n.unusable_streak} replies in a row had no usable tool call"
            )
        return None

    def _answer(self, calls: list[ToolCallPart]) -> Stop | None:
        """Answer every call of a turn in one message, in call order: malformed calls and
        ``describe_primitive`` first, then the submissions (at once), then ``finish``."""
        answers: dict[int, ToolResultPart | RetryPromptPart] = {}
        submissions: list[_Job] = []
        finishes: list[tuple[int, Request]] = []
        usable = False
        cut_calls = {c.call.id: c for c in self._cuts if c.call is not None}
        for position, call in enumerate(calls):
            if call.id in cut_calls:  # its arguments are no longer whole: not run
                self.n.tool_errors += 1
                note = call_note(cut_calls[call.id])
                self.emit(ToolAnswered(call.name, False, note))
                answers[position] = RetryPromptPart(
                    content=note, tool_call_id=call.id, name=call.name
                )
                continue
            request = parse_call(call)
            if isinstance(request, RetryPromptPart):
                self.n.tool_errors += 1
                self.emit(ToolAnswered(call.name, False, request.content))
                answers[position] = request
                continue
            usable = True
            if isinstance(request.args, SubmitProgram):
                submissions.append(_Job(position, call, request.args.program))
            elif isinstance(request.args, Finish):
                finishes.append((position, request))
            else:
                answers[position] = self._guarded(request)
        answers.update(self._evaluate_all(submissions))
        for position, request in finishes:
            answers[position] = self._guarded(request)
        parts: list[Any] = [answers[position] for position in range(len(calls))]
        parts += [RetryPromptPart(content=text_note(c)) for c in self._cuts if c.call is None]
        self._record(UserMessage(parts=parts))
        self.n.unusable_streak = 0 if usable else self.n.unusable_streak + 1
        if self._finish is not None:
            return Stop("finished", self._finish)
        if self.n.unusable_streak >= self.budgets.max_malformed:
            return Stop(
                "malformed",
                f"{self.n.unusable_streak} replies in a row had only malformed tool calls",
            )
        return self._converged()

    def _guarded(self, request: Request) -> ToolResultPart | RetryPromptPart:
        """``describe_primitive`` or ``finish``; an exception is answered, not raised."""
        try:
            return self._run_tool(request)
        except Exception as e:  # noqa: BLE001 - errors are data: the model is told, not killed
            return self._internal_error(request.call, e)

    def _internal_error(self, call: ToolCallPart, error: Exception) -> ToolResultPart:
        self.n.tool_errors += 1
        text = f"internal error while running {call.name}: {type(error).__name__}: {error}"
        self.emit(ToolAnswered(call.name, False, text))
        return ToolResultPart(tool_call_id=call.id, name=call.name, content=text, is_error=True)

    def _run_tool(self, request: Request) -> ToolResultPart | RetryPromptPart:
        call, args = request.call, request.args
        if isinstance(args, Finish):
            self._finish = args.reason
            self.emit(ToolAnswered(call.name, True, args.reason))
            return ToolResultPart(
                tool_call_id=call.id, name=call.name, content="The run ends here."
            )
        assert isinstance(args, DescribePrimitive)
        try:
            text = describe_primitive(args.name)
        except UnknownPrimitive as e:
            self.n.tool_errors += 1
            self.emit(ToolAnswered(call.name, False, str(e)))
            return RetryPromptPart(content=str(e), tool_call_id=call.id, name=call.name)
        self.emit(ToolAnswered(call.name, True, args.name))
        return ToolResultPart(tool_call_id=call.id, name=call.name, content=text)

    # -- candidates ------------------------------------------------------------------------------
    def _evaluate_all(self, jobs: list[_Job]) -> dict[int, ToolResultPart]:
        """Each submission's answer, by its position among the turn's calls: its Report, or why
        it was not evaluated (the candidate budget, the wall-clock budget)."""
        answers: dict[int, ToolResultPart] = {}
        room = self._candidates_left()
        if room is not None and len(jobs) > room:
            for job in jobs[room:]:
                answers[job.position] = self._not_evaluated(job.call, self._over_count(room))
            jobs = jobs[:room]
        if not jobs:
            return answers

        def done(job: _Job, outcome: Outcome) -> None:
            try:
                answers[job.position] = self._commit(job, outcome)
            except Exception as e:  # noqa: BLE001 - errors are data: the model is told, not killed
                answers[job.position] = self._internal_error(job.call, e)

        def skip(job: _Job, reason: str) -> None:
            answers[job.position] = self._not_evaluated(job.call, reason)

        hooks = Hooks(self._may_start, self._start, self.emit, done, skip)
        run_in_slots(jobs, self._slots_for(jobs), self._evaluate, hooks)
        return answers

    def _slots_for(self, jobs: list[_Job]) -> list[str | None]:
        """The worker slots for a batch. The sandbox's plugins are loaded here first, so that no
        two threads import one at once; if one fails to load (each Report then says so), the
        batch runs one candidate at a time."""
        if len(jobs) < 2 or len(self.slots) < 2:
            return self.slots
        try:
            load_plugins(self.sandbox.plugins)
        except PluginError:
            return self.slots[:1]
        return self.slots

    def _start(self, job: _Job) -> None:
        """A submission gets a worker: its candidate index, and the time left as its timeout."""
        job.index, self.next_index = self.next_index, self.next_index + 1
        job.options = self._sandbox_options()
        self.emit(CandidateStarted(job.index, self.n.turns))

    def _evaluate(
        self, job: _Job, gpu: str | None, post: Post, cancel: threading.Event
    ) -> tuple[Report, Any, float]:
        """The sandbox on one submission, in a thread of its own: it only posts its stage
        results; the loop thread records them (``batch.py``)."""
        began = time.monotonic()
        report, program = evaluate_candidate(
            job.program,
            self.block,
            job.options,
            block_file=self.block_file,
            kernels_dir=self.run_dir.candidate_kernels(job.index),
            on_stage=lambda stage: post(StageDone(job.index, stage)),
            gpu=gpu,
            cancel=cancel,
        )
        return report, program, time.monotonic() - began

    def _commit(self, job: _Job, outcome: Outcome) -> ToolResultPart:
        """Record an evaluated submission (in call order): its candidate, whether it is the best,
        and its Report as the answer to its call."""
        call = job.call
        if outcome.error is not None:
            return self._internal_error(call, outcome.error)
        report, program, seconds = outcome.value
        candidate = Candidate(job.index, self.n.turns, call.id, program, report)
        self.candidates.append(candidate)
        is_best = better(candidate, self.best)
        if is_best:
            self.best, self.n.best_turn = candidate, self.n.turns
            self._write_best(candidate)
        self.run_dir.append(
            CandidateRecord(
                turn=self.n.turns,
                index=job.index,
                tool_call_id=call.id,
                program_hash=report.program_hash,
                verified=report.verified,
                headline=report.headline(),
                time_ms=candidate.time_ms,
                best=is_best,
                seconds=round(seconds, 3),
            )
        )
        self.emit(CandidateDone(candidate, is_best, self.best))
        return ToolResultPart(
            tool_call_id=call.id,
            name=call.name,
            content=self._feedback(candidate),
            data={"candidate": job.index, "report": report.model_dump(mode="json")},
        )

    def _not_evaluated(self, call: ToolCallPart, reason: str) -> ToolResultPart:
        self.emit(ToolAnswered(call.name, False, reason))
        return ToolResultPart(tool_call_id=call.id, name=call.name, content=reason, is_error=True)

    def _candidates_left(self) -> int | None:
        limit = self.budgets.max_candidates
        return None if limit is None else max(0, limit - len(self.candidates))

    def _over_count(self, room: int) -> str:
        limit = self.budgets.max_candidates
        if room == 0:
            return (
                f"Not evaluated: the run has evaluated its {limit} candidates "
                f"(--max-candidates {limit})."
            )
        return (
            f"Not evaluated: --max-candidates {limit} left room for {room} more candidate(s), "
            f"taken by this turn's first {room} submission(s)."
        )

    def _may_start(self) -> str | None:
        """Why a submission still waiting for a worker may not start (``None``: it may)."""
        left = self._time_left()
        if left is not None and left <= 0:
            return (
                f"Not evaluated: the run's wall-clock budget (--timeout "
                f"{self.budgets.timeout_s:g} s) ran out before a worker was free for it."
            )
        return None

    def _write_best(self, candidate: Candidate) -> None:
        if candidate.report.verified and candidate.program is not None:
            self.run_dir.write_best(candidate.program, candidate.report, candidate.index)
        else:
            self.run_dir.write_report(candidate.report)

    def _feedback(self, candidate: Candidate) -> str:
        """The Report as the model reads it, plus where the run stands."""
        report, best = candidate.report, self.best
        lines = [f"Candidate {candidate.index}: {report.render_compact()}"]
        if not report.verified:
            lines.append("Fix what the Report names and submit again.")
        elif candidate.time_ms is None:
            lines.append(
                "Timings are not measured on this device, so no later candidate can be shown "
                "faster: call `finish` unless you have a reason to submit another."
            )
        elif best is not None and best.time_ms is not None:
            lines.append(
                f"Best so far: candidate {best.index} at {best.time_ms:.4f} ms "
                "(summed over the profiled shapes)."
            )
        return "\n".join(lines)

    def _sandbox_options(self) -> SandboxOptions:
        """The sandbox options, with the worker's timeout cut to the run's remaining time."""
        left = self._time_left()
        if left is None or not self.sandbox.isolate:
            return self.sandbox
        return self.sandbox.model_copy(
            update={"timeout_s": max(1.0, min(self.sandbox.timeout_s, left))}
        )

    # -- stopping rules --------------------------------------------------------------------------
    def _over_budget(self) -> Stop | None:
        b, n = self.budgets, self.n
        if b.max_turns is not None and n.turns >= b.max_turns:
            return Stop("max_turns", f"reached --max-turns {b.max_turns}")
        if b.max_tokens is not None and n.usage.total >= b.max_tokens:
            return Stop("max_tokens", f"used {n.usage.total} tokens (--max-tokens {b.max_tokens})")
        if b.max_cost is not None and n.cost_usd is not None and n.cost_usd >= b.max_cost:
            return Stop("max_cost", f"spent ${n.cost_usd:.4f} (--max-cost {b.max_cost})")
        if b.max_candidates is not None and len(self.candidates) >= b.max_candidates:
            return Stop("max_candidates", f"reached --max-candidates {b.max_candidates}")
        left = self._time_left()
        if left is not None and left <= 0:
            return Stop("timeout", f"ran out of wall-clock time (--timeout {b.timeout_s:g} s)")
        return None

    def _converged(self) -> Stop | None:
        if self.best is None or not self.best.report.verified:
            return None
        idle = self.n.turns - self.n.best_turn
        if idle >= self.budgets.patience:
            return Stop(
                "converged",
                f"verified, and no better candidate in the {idle} turns since "
                f"candidate {self.best.index} (--patience {self.budgets.patience})",
            )
        return None

    def _time_left(self) -> float | None:
        if self.budgets.timeout_s is None:
            return None
        return self.budgets.timeout_s - (time.monotonic() - self.started)

    # -- records ---------------------------------------------------------------------------------
    def _cost(self, reply: AssistantTurn) -> float | None:
        model = reply.model if price_for(reply.model) is not None else self.provider.model
        return cost_usd(model, reply.usage)

    def _record(self, message: UserMessage | AssistantTurn, **extra: Any) -> None:
        self.messages.append(message)
        self.run_dir.append(MessageRecord(turn=self.n.turns, message=message, **extra))

    def _on_retry(self, turn: int, attempt: int, delay: float, error: ProviderError) -> None:
        self.n.retries += 1
        self.run_dir.append(
            RetryRecord(turn=turn, attempt=attempt, delay_s=round(delay, 3), error=error.message)
        )
        self.emit(Retrying(attempt, delay, error.message))

    def _finalize(self, stop: Stop) -> AgentResult:
        seconds = time.monotonic() - self.started
        result = AgentResult(
            run=self.run_dir,
            block=self.block.name,
            provider=self.provider.name,
            model=self.provider.model,
            turns=self.n.turns,
            usage=self.n.usage,
            cost_usd=self.n.cost_usd,
            candidates=self.candidates,
            best=self.best,
            stop=stop,
            seconds=seconds,
            tool_errors=self.n.tool_errors,
            retries=self.n.retries,
        )
        self.run_dir.append(
            EndRecord(
                reason=stop.kind,
                message=stop.message,
                verified=result.verified,
                turns=result.turns,
                input_tokens=result.usage.input_tokens,
                output_tokens=result.usage.output_tokens,
                cache_write_tokens=result.usage.cache_write_tokens,
                cache_read_tokens=result.usage.cache_read_tokens,
                cost_usd=result.cost_usd,
                seconds=round(seconds, 3),
                best_candidate=self.best.index if self.best else None,
            )
        )
        self.run_dir.write_summary(run_markdown(RunFacts.from_result(result), backend.describe()))
        self.emit(Stopped(stop))
        return result


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


__all__ = ["AgentLoop", "AgentResult", "Budgets", "OnEvent", "Stop"]
