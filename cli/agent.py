"""The agent's commands of ``coda-agent``: ``synthesize`` (run or ``--resume`` the agent loop),
``verify`` (one Program through the sandbox), ``blocks`` (list), ``show`` (render a run folder,
finished or not). ``register(app)`` adds them to the command line (``coda.cli.main``).

Exit codes: 0 a verified kernel; 1 finished without one (including a provider that failed mid-run
or a refusal, or a run folder that could not be written once the run had started); 2 bad usage or
configuration (unknown block, a missing or unreadable file, a block file that fails to import or
exits, a ``--runs-dir`` that is a file or cannot be written, a block the planner cannot lower, a
missing or rejected API key, a provider whose SDK is not installed, an unenforceable budget, flags
that do not fit together: ``--model`` or ``--base-url`` for a provider without a model, ``--resume``
of a run that already ended or with a ``--block`` other than the run's); 130 interrupted. With
``--json`` stdout holds exactly one JSON object, on errors too: ``{"error": ..., "exit_code":
...}``.

Everything printed here that did not come from this file (Reports, messages of models and servers,
names from programs and block files) is escaped, or printed as ``Text``, so that bracketed text
such as ``[program]`` is shown rather than read as Rich markup; and what came from a model, a
server or a file is first stripped of control characters (``printable``), so that it cannot move
the cursor, clear the screen or retitle the terminal.

The rest of coda (the blocks, the sandbox, the agent loop) is imported inside the commands, when
one runs: listing the commands or their options imports none of it (``coda.cli.common``).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.rule import Rule
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from .common import (
    PROVIDERS,
    block_file_path,
    check_provider,
    complete_provider,
    fail,
    load_blocks,
    note,
    print_json,
    printable,
    resolve_block,
    stderr,
    stdout_width,
)

if TYPE_CHECKING:
    from coda.agent.events import CandidateDone, Event, TurnEnded
    from coda.agent.loop import AgentResult, Budgets
    from coda.agent.summary import RunFacts
    from coda.blocks import Block
    from coda.sandbox.report import Report, StageResult

console = Console(highlight=False, width=stdout_width(piped=110))
MARK = {"passed": "[green]✓[/]", "failed": "[red]✗[/]", "skipped": "[yellow]–[/]"}


def register(app: typer.Typer) -> None:
    """Add ``synthesize``, ``verify``, ``blocks`` and ``show`` to ``app``."""
    app.command("synthesize")(synthesize_cmd)
    app.command("verify")(verify_cmd)
    app.command("blocks")(blocks_cmd)
    app.command("show")(show_cmd)


def check_runs_dir(runs_dir: Path, as_json: bool = False) -> None:
    """Refuse a ``--runs-dir`` that is a file, or that cannot be created or written, before a
    run starts (exit 2)."""
    if runs_dir.exists() and not runs_dir.is_dir():
        raise fail(f"--runs-dir {runs_dir} is a file, not a folder: give a folder", as_json=as_json)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fail(
            f"--runs-dir {runs_dir} cannot be created ({e.strerror}): give a folder you can "
            "write to",
            as_json=as_json,
        ) from None
    if not os.access(runs_dir, os.W_OK | os.X_OK):
        raise fail(
            f"--runs-dir {runs_dir} is not writable: give a folder you can write to",
            as_json=as_json,
        )


def _stage_line(prefix: str, s: StageResult) -> str:
    """A stage as it finishes: its mark, name, seconds and its message's summary line."""
    summary = escape(printable(s.summary()))
    return f"{prefix}{MARK[s.status]} {s.stage:<9} {s.seconds:6.2f}s  [dim]{summary}[/]"


def error_table(report: Report) -> Table:
    from coda.agent.summary import error_rows

    table = Table(title="measured error vs the float64 reference (worst over shapes × seeds)")
    for col in ("output", "dtype", "checks", "max|err|", "PyTorch's", "allowed", "rel err", ""):
        table.add_column(
            col, justify="left" if col in ("output", "dtype") else "right", no_wrap=True
        )
    for r in error_rows(report):
        table.add_row(
            Text(r.output),
            r.dtype,
            str(r.checks),
            f"{r.max_abs_err:.2e}",
            f"{r.torch_max_abs_err:.2e}",
            f"{r.allowed:.2e}",
            f"{r.rel_err:.1e}",
            "[green]pass[/]" if r.passed else "[red]FAIL[/]",
        )
    return table


# -- live progress ---------------------------------------------------------------------------------
class Progress:
    """Prints the loop's events as they happen: turns, tool calls, sandbox stages, the best so
    far (its worst error and its time, or "not measured")."""

    def __call__(self, event: Event) -> None:
        from coda.agent.events import (
            CandidateDone,
            Retrying,
            StageDone,
            Stopped,
            ToolAnswered,
            TurnEnded,
        )

        if isinstance(event, TurnEnded):
            self._turn(event)
        elif isinstance(event, Retrying):
            console.print(
                f"  [yellow]retry {event.attempt}[/] in {event.delay_s:.1f} s: "
                + escape(printable(event.error))
            )
        elif isinstance(event, StageDone):
            console.print(_stage_line(f"  candidate {event.index}  ", event.stage))
        elif isinstance(event, CandidateDone):
            console.print(f"  {_best_line(event)}")
        elif isinstance(event, ToolAnswered) and not event.ok:
            first = event.summary.splitlines()[0] if event.summary else ""
            name, first = escape(printable(event.name)), escape(printable(first))
            console.print(f"  [yellow]{name}[/]: answered with an error — {first}")
        elif isinstance(event, Stopped):
            console.print(f"stopped ({event.stop.kind}): {escape(printable(event.stop.message))}")

    def _turn(self, e: TurnEnded) -> None:
        from coda.agent.providers.pricing import format_cost

        calls = escape(printable(", ".join(c.name for c in e.reply.tool_calls) or "no tool call"))
        cached = (
            f"{e.usage.cache_read_tokens:,} from the cache, " if e.usage.cache_read_tokens else ""
        )
        tokens = f"{e.usage.total:,} tokens, {cached}{format_cost(e.cost_usd)}"
        console.print(f"[bold]turn {e.turn}[/] → {calls}  [dim]({tokens} so far)[/]")
        if e.reply.text and [c.name for c in e.reply.tool_calls] != ["finish"]:
            text = printable(e.reply.text).strip().splitlines()
            if text:
                console.print(f"  [dim]{escape(text[0][:200])}[/]")


def _best_line(event: CandidateDone) -> str:
    c, best = event.candidate, event.best
    verdict = "[green]verified[/]" if c.report.verified else "[red]not verified[/]"
    tail = ""
    if best is not None and best.report.verified:
        worst = best.report.worst_check()
        err = f"worst error {worst.max_abs_err:.2e} (allowed {worst.allowed:.2e})" if worst else ""
        when = f"{best.time_ms:.4f} ms" if best.time_ms is not None else "not measured"
        tail = f" · best: candidate {best.index}, {err}, time {when}"
    new_best = " (new best)" if event.is_best and c.report.verified else ""
    return f"candidate {c.index}: {verdict}{new_best}{tail}"


# -- synthesize ------------------------------------------------------------------------------------
def _budgets(base: dict[str, Any], **given: Any) -> Budgets:
    from coda.agent.loop import Budgets

    values = {**base, **{k: v for k, v in given.items() if v is not None}}
    return Budgets(**values)


def synthesize_cmd(
    block: str = typer.Option(None, "--block", "-b", help="a registered block (see `blocks`)"),
    block_file: Path = typer.Option(None, "--block-file", help="a Python file defining a Block"),
    provider: str = typer.Option(
        None,
        "--provider",
        "-p",
        help=f"one of {', '.join(PROVIDERS)} (default builtin)",
        callback=check_provider,
        autocompletion=complete_provider,
    ),
    model: str = typer.Option(None, "--model", help="model name for anthropic/openai"),
    base_url: str = typer.Option(
        None, "--base-url", help="API root (a proxy, or an OpenAI-compatible server)"
    ),
    transcript: Path = typer.Option(
        None, "--transcript", help="for --provider replay: a run's transcript.jsonl"
    ),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="where run folders go"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary instead of tables"),
    max_turns: int = typer.Option(None, "--max-turns", min=1, help="default 20"),
    max_tokens: int = typer.Option(None, "--max-tokens", min=1, help="input + output tokens"),
    max_cost: float = typer.Option(None, "--max-cost", min=0, help="USD, from the price table"),
    timeout: float = typer.Option(
        None,
        "--timeout",
        min=1,
        help="wall-clock seconds; bounds each provider request and sandbox worker too",
    ),
    patience: int = typer.Option(
        None, "--patience", min=1, help="stop after N turns without improving (default 3)"
    ),
    max_candidates: int = typer.Option(
        None, "--max-candidates", min=1, help="stop after N candidates were evaluated"
    ),
    parallel: int = typer.Option(
        None,
        "--parallel",
        "-j",
        min=1,
        help="candidates of one turn evaluated at once (default: one per GPU, at most one per "
        "GPU; min(CPU cores, 4) under the interpreter)",
    ),
    resume_dir: Path = typer.Option(
        None, "--resume", help="continue an interrupted run from its transcript"
    ),
) -> None:
    """Synthesize a verified GEMM-epilogue kernel for a block (offline planner by default)."""
    given = dict(
        max_turns=max_turns,
        max_tokens=max_tokens,
        max_cost=max_cost,
        timeout_s=timeout,
        patience=patience,
        max_candidates=max_candidates,
        parallel=parallel,
    )
    progress = None if as_json else Progress()
    name = provider
    if name is None and transcript is not None:
        name = "replay"
    block_file = block_file_path(block_file, as_json)
    if resume_dir is not None:
        result, prov = _resume(
            resume_dir, block, block_file, name, model, base_url, given, progress, as_json
        )
    else:
        result, prov = _start(
            block,
            block_file,
            name,
            model,
            base_url,
            transcript,
            runs_dir,
            given,
            progress,
            as_json,
        )
    _finish(result, as_json, list(getattr(prov, "divergences", [])), block_file)


def _start(
    block: str | None,
    block_file: Path | None,
    provider: str | None,
    model: str | None,
    base_url: str | None,
    transcript: Path | None,
    runs_dir: Path,
    given: dict[str, Any],
    progress: Progress | None,
    as_json: bool,
) -> tuple[AgentResult, Any]:
    """A new run (a replay takes its block from the transcript unless one is given)."""
    from coda.agent.synthesize import BudgetError, synthesize
    from coda.primitives import backend

    if provider == "replay" and transcript is not None and block is None and not block_file:
        block, recorded = _recorded_block(transcript, as_json)
        _refuse_recorded_block_file(recorded, transcript, as_json)
    name = provider or "builtin"
    _refuse_unused_provider_flags(name, model, base_url, as_json)
    blk = resolve_block(block, block_file, as_json, given.get("timeout_s"))
    prov = _make_provider(name, blk, model, base_url, transcript, as_json=as_json)
    check_runs_dir(runs_dir, as_json)
    if progress is not None:
        console.print(
            f"[bold]coda-agent synthesize[/] {escape(blk.name)} — provider {escape(name)} "
            f"({escape(prov.model)}), kernels on {backend.describe()}"
        )
    try:
        result = _interruptible(
            lambda: synthesize(
                blk,
                runs_dir,
                provider=prov,
                budgets=_budgets({}, **given),
                block_file=str(block_file) if block_file else None,
                base_url=base_url,
                transcript=str(transcript) if transcript else None,
                on_event=progress,
            ),
            as_json,
        )
    except BudgetError as e:
        raise fail(str(e), as_json=as_json) from None
    except OSError as e:
        raise fail(_write_failure(e), code=1, as_json=as_json) from None
    return result, prov


# The providers that talk to a model chosen with --model, on a server --base-url may name.
_LLM_PROVIDERS = ("anthropic", "openai")


def _refuse_unused_provider_flags(
    provider: str, model: str | None, base_url: str | None, as_json: bool
) -> None:
    """``--model`` and ``--base-url`` choose an LLM and its server: with a provider that has
    neither (the offline built-in planner, a replay of recorded turns) they would be ignored, so
    they are refused (exit 2), like other flags that do not fit together."""
    if provider in _LLM_PROVIDERS:
        return
    flags = {"--model": model, "--base-url": base_url}
    given = [f"{flag} {value}" for flag, value in flags.items() if value is not None]
    if not given:
        return
    what = (
        "the built-in planner (--provider builtin) runs offline"
        if provider == "builtin"
        else "a replay (--provider replay) answers with the recorded turns"
    )
    raise fail(
        f"{what}, with no model or server to choose: drop {' and '.join(given)}, or choose "
        f"--provider {' or '.join(_LLM_PROVIDERS)}",
        as_json=as_json,
    )


def resume_command(run_dir: Path | str, block_file: str | Path | None) -> str:
    """The command that continues a run, ready to copy: with ``--block-file`` when the run's
    block came from a file, which a resumed run imports only when the user names it again."""
    command = f"coda-agent synthesize --resume {shlex.quote(str(run_dir))}"
    if block_file:
        command += f" --block-file {shlex.quote(str(block_file))}"
    return command


def _write_failure(error: OSError) -> str:
    """The message for a run folder that could not be written after the run started."""
    from coda.agent.runs import RunDirError

    if isinstance(error, RunDirError):
        what = str(error)
    else:
        where = f" {error.filename}" if error.filename else ""
        what = f"cannot write{where}: {error.strerror or error}"
    return (
        f"{what}. The run stopped; what it wrote before is kept — once fixed, continue it with "
        "`coda-agent synthesize --resume RUN_DIR` (the run folder named above)"
    )


def _refuse_recorded_block_file(recorded: Path | None, source: Path, as_json: bool) -> None:
    """A transcript is data: the block file it records is imported only when the user names it.

    Importing a path read from a transcript would let whoever wrote the transcript choose the code
    that runs (in this process and in every sandbox worker); naming it again is the user's consent.
    """
    if recorded is not None:
        raise fail(
            f"{source} records its block as coming from the file {recorded}; a transcript never "
            f"chooses code to run: name the file yourself with --block-file {recorded}",
            as_json=as_json,
        )


def _recorded_block(transcript: Path, as_json: bool) -> tuple[str, Path | None]:
    from coda.agent.transcript import TranscriptError, read_records

    try:
        start = read_records(transcript)[0]
    except TranscriptError as e:
        raise fail(str(e), as_json=as_json) from None
    return start.block, Path(start.block_file) if start.block_file else None


def _make_provider(
    name: str,
    blk: Block,
    model: str | None,
    base_url: str | None,
    transcript: Path | None,
    replay_skip: int = 0,
    as_json: bool = False,
) -> Any:
    """The provider ``name`` for ``blk``; a configuration problem (a missing key or SDK, a
    block the built-in planner cannot lower) is a usage error."""
    from coda.agent.providers import ProviderError, make_provider
    from coda.agent.transcript import TranscriptError
    from coda.planner import NoRule

    try:
        return make_provider(
            name,
            blk,
            model=model,
            base_url=base_url,
            transcript=transcript,
            replay_skip=replay_skip,
        )
    except NoRule as e:
        raise _refused(blk, e, as_json) from None
    except (ProviderError, TranscriptError) as e:
        raise fail(getattr(e, "message", str(e)), as_json=as_json) from None


def _refused(blk: Block, error: Exception, as_json: bool) -> typer.Exit:
    """The built-in planner's refusal (exit 2): every op it cannot lower, and the partial Program
    of what it did lower — printed after the error, or, with ``--json``, the object's
    ``unlowered`` and ``partial_program``."""
    from coda.agent.prompting import compact_json
    from coda.planner import NoRules

    message = f"the built-in planner cannot lower block {blk.name!r}: {error}"
    if not isinstance(error, NoRules):
        return fail(message, as_json=as_json)
    exit_ = fail(message, as_json=as_json, details=error.to_json())
    if error.partial is not None and not as_json:
        computes = ", ".join(repr(v) for v in error.partial.computes)
        stderr().print(
            "The planner lowered the other ops into a partial Program computing "
            f"{escape(computes)} (the block outputs it reaches and the values the ops above "
            "read). Start from it: --provider anthropic|openai gives it to the model with the "
            "list above.",
            soft_wrap=True,
        )
        print(compact_json(error.partial.program.model_dump(mode="json")), file=sys.stderr)
    return exit_


def _interruptible(fn: Any, as_json: bool = False) -> AgentResult:
    try:
        return fn()
    except KeyboardInterrupt:
        message = (
            "interrupted: the transcript is saved; continue with "
            "`coda-agent synthesize --resume RUN_DIR`"
        )
        Console(stderr=True).print(f"[yellow]interrupted[/]{message.removeprefix('interrupted')}")
        if as_json:
            print(json.dumps({"error": message, "exit_code": 130}))
        raise typer.Exit(130) from None


def _resume(
    run_dir: Path,
    block: str | None,
    block_file: Path | None,
    provider: str | None,
    model: str | None,
    base_url: str | None,
    given: dict[str, Any],
    progress: Progress | None,
    as_json: bool,
) -> tuple[AgentResult, Any]:
    """Continue a run: its block, provider, model and budgets unless overridden by flags. A torn
    last line (the run died mid-write) is cut off first, and lines that cannot be read are
    skipped; both are reported on stderr."""
    from coda.agent.runs import RunDir, RunDirError
    from coda.agent.synthesize import BudgetError, resume
    from coda.agent.transcript import TranscriptError

    try:
        run = RunDir.open(run_dir)
        state = run.state()
    except TranscriptError as e:
        raise fail(str(e), as_json=as_json) from None
    for line in state.notes:
        note(line)
    start = state.start
    if state.end is not None and state.end.reason in ("finished", "converged"):
        raise fail(
            f"{run_dir} already ended ({state.end.reason}: {state.end.message}); "
            "start a new run instead",
            as_json=as_json,
        )
    _refuse_another_block(block, start.block, run_dir, as_json)
    budgets = _budgets(start.budgets, **given)
    spent = _spent(state, budgets)
    if spent:
        raise fail(
            f"{run_dir} has spent its budget ({spent}): give a larger one to continue",
            as_json=as_json,
        )
    if block_file is None:
        recorded = Path(start.block_file) if start.block_file else None
        _refuse_recorded_block_file(recorded, run_dir, as_json)
    blk = resolve_block(block or start.block, block_file, as_json, given.get("timeout_s"))
    name = provider or state.provider
    _refuse_unused_provider_flags(name, model, base_url, as_json)
    same = name == state.provider
    if same and start.base_url and base_url is None:
        raise fail(
            f"{run_dir} records the server {start.base_url}; a transcript never chooses where "
            f"your API key is sent: name it yourself with --base-url {start.base_url}",
            as_json=as_json,
        )
    prov = _make_provider(
        name,
        blk,
        model or (state.model if same and name in ("anthropic", "openai") else None),
        base_url,
        Path(start.transcript) if start.transcript else None,
        replay_skip=state.turns if same else 0,
        as_json=as_json,
    )
    try:
        repaired = run.repair_tail()
    except RunDirError as e:
        raise fail(str(e), as_json=as_json) from None
    if repaired:
        note(repaired)
    if progress is not None:
        console.print(
            f"[bold]coda-agent synthesize --resume[/] {escape(str(run.path))} — "
            f"{escape(blk.name)}, provider {escape(prov.name)} ({escape(prov.model)}), "
            f"{state.turns} turns and {len(state.candidates)} candidates so far"
        )
    try:
        result = _interruptible(
            lambda: resume(
                run,
                blk,
                prov,
                budgets=budgets,
                on_event=progress,
                block_file=str(block_file) if block_file else None,
            ),
            as_json,
        )
    except BudgetError as e:
        raise fail(str(e), as_json=as_json) from None
    except OSError as e:
        raise fail(_write_failure(e), code=1, as_json=as_json) from None
    return result, prov


def _refuse_another_block(block: str | None, recorded: str, run_dir: Path, as_json: bool) -> None:
    """A resumed run continues its own block: ``--block`` naming another is refused (exit 2)
    rather than mixing two blocks in one transcript."""
    if block is not None and block != recorded:
        raise fail(
            f"{run_dir} is a run of block {recorded!r}, and --resume continues that block: drop "
            f"--block {block}, or start a new run with `coda-agent synthesize --block {block}`",
            as_json=as_json,
        )


def _spent(state: Any, b: Budgets) -> str | None:
    """Which recorded total already reaches its budget, if any."""
    if b.max_turns is not None and state.turns >= b.max_turns:
        return f"{state.turns} turns, --max-turns {b.max_turns}"
    if b.max_tokens is not None and state.usage.total >= b.max_tokens:
        return f"{state.usage.total} tokens, --max-tokens {b.max_tokens}"
    if b.max_cost is not None and state.cost_usd is not None and state.cost_usd >= b.max_cost:
        return f"${state.cost_usd:.4f}, --max-cost {b.max_cost}"
    if b.max_candidates is not None and len(state.candidates) >= b.max_candidates:
        return f"{len(state.candidates)} candidates, --max-candidates {b.max_candidates}"
    return None


def _finish(
    result: AgentResult, as_json: bool, divergences: list[str], block_file: Path | None = None
) -> None:
    """Print the finished run (or, with ``--json``, its one object) and exit with its code;
    ``block_file``: the file the run's block came from, named again in the resume hint."""
    from coda.agent.summary import RunFacts

    code = 0 if result.verified else (result.stop.exit_code or 1)
    if as_json:
        print(json.dumps({**result_json(result), "divergences": divergences}))
        raise typer.Exit(code)
    best = result.best
    if best is not None and best.report.verified and best.program is not None:
        print_program(
            best.program.to_python(), f"best program (candidate {best.index}, builder form)"
        )
    if best is not None:
        errors = error_table(best.report)
        if errors.row_count:
            console.print(errors)
        prof = best.report.stage("profile")
        if not best.report.profile:
            why = prof.message if prof else "not profiled"
            console.print(Text(f"timings: not measured ({why})"))
    console.print(facts_table(RunFacts.from_result(result)))
    if result.stop.kind == "provider_error":
        run = escape(str(result.run.path))
        again = escape(resume_command(result.run.path, block_file))
        Console(stderr=True, highlight=False).print(
            f"[red]error:[/] {escape(printable(result.stop.message))}\nthe run so far is in {run}; "
            f"continue it with `{again}`",
            soft_wrap=True,
        )
    for line in divergences:
        console.print(f"[yellow]replay diverged[/]: {escape(printable(line))}")
    verdict = "[green]VERIFIED[/]" if result.verified else "[red]NOT VERIFIED[/]"
    where = escape(f"{result.block} in {result.seconds:.1f} s → {result.run.path}")
    console.print(f"{verdict} {where}")
    for path in sorted(result.run.kernels_dir.glob("*.py")):
        console.print(Text(f"  kernel: {path}"))
    raise typer.Exit(code)


def print_program(code: str, title: str) -> None:
    """A program's builder code between two rules, the first titled ``title``: unboxed and never
    wrapped nor cut by Rich, so every line can be copied whole (a terminal narrower than a line
    wraps it on screen only)."""
    console.print(Rule(escape(title)))
    syntax = Syntax(code.rstrip("\n"), "python", background_color="default")
    console.print(syntax, soft_wrap=True, crop=False)
    console.print(Rule())


def facts_table(facts: RunFacts) -> Table:
    table = Table(title="run", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for label, value in facts.facts():
        table.add_row(Text(label), Text(printable(value)))
    return table


def facts_json(facts: RunFacts) -> dict[str, Any]:
    """A run's numbers, candidates and best Report as JSON (``synthesize --json``, ``show
    --json``)."""
    best = facts.best
    return {
        "block": facts.block,
        "provider": facts.provider,
        "model": facts.model,
        "verified": facts.verified,
        "turns": facts.turns,
        "tokens": {
            "input": facts.usage.input_tokens,
            "output": facts.usage.output_tokens,
            "cache_write": facts.usage.cache_write_tokens,
            "cache_read": facts.usage.cache_read_tokens,
            "total": facts.usage.total,
        },
        "cost_usd": facts.cost_usd,
        "stop": {"reason": facts.stop[0], "message": facts.stop[1]} if facts.stop else None,
        "seconds": round(facts.seconds, 2) if facts.seconds is not None else None,
        "tool_errors": facts.tool_errors,
        "retries": facts.retries,
        "candidates": [
            {
                "index": c.index,
                "turn": c.turn,
                "verified": c.report.verified,
                "headline": c.report.headline(),
                "time_ms": c.time_ms,
            }
            for c in facts.candidates
        ],
        "best": best.index if best else None,
        "report": best.report.model_dump(mode="json") if best else None,
    }


def result_json(result: AgentResult) -> dict[str, Any]:
    """``synthesize --json``: the finished run's facts and its folder."""
    from coda.agent.summary import RunFacts

    return {**facts_json(RunFacts.from_result(result)), "run_dir": str(result.run.path)}


# -- verify, blocks, show --------------------------------------------------------------------------
def verify_cmd(
    program_file: Path = typer.Argument(..., help="a Program as JSON"),
    block: str = typer.Option(None, "--block", "-b"),
    block_file: Path = typer.Option(None, "--block-file"),
    as_json: bool = typer.Option(False, "--json"),
    timeout: float = typer.Option(
        None,
        "--timeout",
        min=1,
        help="seconds the sandbox worker may run (semantics to profile; default 600)",
    ),
    semantics_seed: int = typer.Option(
        None,
        "--semantics-seed",
        help="seed of the semantics stage's drawn shapes and inputs (default: fresh per run; "
        "the Report names it, so a run can be repeated)",
    ),
) -> None:
    """Run one Program through the sandbox and print its Report."""
    from coda.sandbox.runner import evaluate
    from coda.sandbox.stages import SandboxOptions

    block_file = block_file_path(block_file, as_json)
    blk = resolve_block(block, block_file, as_json, timeout)
    limits = {} if timeout is None else {"timeout_s": timeout}
    options = SandboxOptions(semantics_seed=semantics_seed, **limits)
    text = _read_program(program_file, as_json)
    report = evaluate(
        text,
        blk,
        options,
        block_file=str(block_file) if block_file else None,
        on_stage=None if as_json else (lambda s: console.print(_stage_line("  ", s))),
    )
    if as_json:
        print(report.model_dump_json(indent=2))
    else:
        console.print(Text(printable(report.render_text(stages_printed=True))))
    raise typer.Exit(0 if report.verified else 1)


def _read_program(path: Path, as_json: bool) -> str:
    """The text of a Program file; a missing, unreadable or non-UTF-8 file is a usage error."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise fail(f"cannot read {path}: {e.strerror}", as_json=as_json) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(
            f"{path} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}): give a "
            "Program as JSON",
            as_json=as_json,
        ) from None


def blocks_cmd(
    block_file: Path = typer.Option(None, "--block-file", help="also list this file's blocks"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
) -> None:
    """List the blocks that can be synthesized."""
    from coda.blocks import list_blocks

    if block_file is not None:
        load_blocks(block_file_path(block_file, as_json), as_json)
    blocks = list_blocks()
    if as_json:
        print_json({"blocks": [block_json(b) for b in blocks]})
        return
    console.print(blocks_table(blocks, console.width))


# The shares of the width left beside the names that the other columns of `blocks` may take.
_BLOCK_COLUMN_SHARES = {"inputs": 3, "outputs": 2, "description": 5}


def blocks_table(blocks: list[Block], width: int) -> Table:
    """The ``blocks`` listing for a console ``width`` columns wide. Names are what users copy: the
    name column is as wide as the longest name and never wraps, so no name is cut; the other
    columns share the rest of the width (each at least as wide as its header), wrapping their
    text (and folding a word longer than their share) instead of widening the table."""
    name_width = max((len(b.name) for b in blocks), default=len("name"))
    columns = 1 + len(_BLOCK_COLUMN_SHARES)
    borders_and_padding = (columns + 1) + 2 * columns
    headers = sum(len(col) for col in _BLOCK_COLUMN_SHARES)
    spare = max(width - name_width - borders_and_padding - headers, 0)
    total = sum(_BLOCK_COLUMN_SHARES.values())
    table = Table(title="blocks")
    table.add_column("name", no_wrap=True, min_width=name_width)
    for col, share in _BLOCK_COLUMN_SHARES.items():
        table.add_column(col, overflow="fold", max_width=len(col) + spare * share // total)
    for b in blocks:
        ins = ", ".join(f"{n}[{','.join(map(str, s.shape))}]" for n, s in b.inputs.items())
        table.add_row(Text(b.name), Text(ins), Text(", ".join(b.outputs)), Text(b.description))
    return table


def block_json(block: Block) -> dict[str, Any]:
    """One row of ``blocks --json``: a block's name, inputs (name → shape), outputs and
    description."""
    return {
        "name": block.name,
        "inputs": {n: list(spec.shape) for n, spec in block.inputs.items()},
        "outputs": list(block.outputs),
        "description": block.description,
    }


def show_cmd(
    run_dir: Path = typer.Argument(..., help="a runs/<time>-<block> folder"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of tables"),
) -> None:
    """Render a run — finished, or interrupted (from its transcript)."""
    from coda.agent.runs import RunDir
    from coda.agent.summary import RunFacts
    from coda.agent.transcript import TranscriptError

    try:
        state = RunDir.open(run_dir).state()
    except TranscriptError as e:
        raise fail(str(e), as_json=as_json) from None
    for line in state.notes:
        note(line)
    facts = RunFacts.from_state(state)
    start = state.start
    if as_json:
        print_json(
            {
                **facts_json(facts),
                "run_dir": str(run_dir),
                "started_at": start.started_at,
                "finished": facts.stop is not None,
                "notes": list(state.notes),
            }
        )
        return
    console.print(
        f"[bold]{escape(str(run_dir))}[/]: "
        + escape(
            printable(
                f"block {start.block}, provider {start.provider} ({start.model}), "
                f"started {start.started_at}"
            )
        )
    )
    console.print(facts_table(facts))
    if facts.candidates:
        console.print(candidates_table(facts))
    if facts.best is not None:
        report = Text(printable(facts.best.report.render_text()))
        console.print(Panel(report, title=f"{facts.best_role} candidate's report"))
        if facts.best.program is not None and facts.best.report.verified:
            print_program(facts.best.program.to_python(), "program")
    if facts.stop is None:
        again = resume_command(run_dir, start.block_file)
        # a command to copy: never broken across lines (a narrow terminal wraps it on screen)
        console.print(f"[yellow]unfinished[/]: continue with `{escape(again)}`", soft_wrap=True)


def candidates_table(facts: RunFacts) -> Table:
    table = Table(title="candidates")
    for col in ("#", "turn", "verdict", "time", "report"):
        table.add_column(col)
    for c in facts.candidates:
        best = f" ({facts.best_role})" if facts.best is c else ""
        table.add_row(
            f"{c.index}{best}",
            str(c.turn),
            "[green]verified[/]" if c.report.verified else "[red]failed[/]",
            f"{c.time_ms:.4f} ms" if c.time_ms is not None else "not measured",
            Text(printable(c.report.headline())),
        )
    return table
