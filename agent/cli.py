"""The ``coda-agent`` command line (the composition root: it may import every layer).

Commands: ``synthesize`` (run or ``--resume`` the agent loop), ``verify`` (one Program through the
sandbox), ``blocks`` (list), ``show`` (render a run folder, finished or not); and, from
``coda.evals.cli``, ``eval``, ``accept``, ``regress`` and ``export-trajectories`` (their exit codes
are documented there).

Exit codes: 0 a verified kernel; 1 finished without one (including a provider that failed mid-run
or a refusal); 2 bad usage or configuration (unknown block, unreadable file, a block the planner
cannot lower, a missing or rejected API key, an unenforceable budget); 130 interrupted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from coda.blocks import Block, BlockNotFound, get_block, list_blocks, load_block_file
from coda.evals.cli import register as register_eval_commands
from coda.primitives import backend  # noqa: F401  (first: selects the interpreter without a GPU)
from coda.sandbox.report import Report, StageResult
from coda.sandbox.runner import evaluate
from coda.sandbox.stages import SandboxOptions

from .events import CandidateDone, Event, Retrying, StageDone, Stopped, ToolAnswered, TurnEnded
from .loop import AgentResult, Budgets
from .planner import NoRule
from .providers import PROVIDERS, ProviderError, make_provider
from .providers.pricing import format_cost
from .runs import RunDir
from .summary import RunFacts, error_rows
from .synthesize import BudgetError, resume, synthesize
from .transcript import TranscriptError, read_records

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Compose GEMM-epilogue Triton kernels for transformer blocks, verified.",
)
# Piped output (CI logs, `| tee`) would otherwise be cut to 80 columns.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 110)
MARK = {"passed": "[green]✓[/]", "failed": "[red]✗[/]", "skipped": "[yellow]–[/]"}


def _fail(message: str, code: int = 2) -> typer.Exit:
    Console(stderr=True, highlight=False).print(f"[red]error:[/] {message}", soft_wrap=True)
    return typer.Exit(code)


def resolve_block(block: str | None, block_file: Path | None) -> Block:
    try:
        if block_file is not None:
            found = load_block_file(block_file)
            if block is None:
                if len(found) > 1:
                    names = ", ".join(b.name for b in found)
                    raise _fail(
                        f"{block_file} defines several blocks ({names}); pick one with --block"
                    )
                return found[0]
        if block is None:
            raise _fail("give --block NAME or --block-file FILE (see `coda-agent blocks`)")
        return get_block(block)
    except (BlockNotFound, FileNotFoundError, ImportError, ValueError) as e:
        raise _fail(str(e)) from None


def _stage_line(prefix: str, s: StageResult) -> str:
    msg = s.message.splitlines()[0] if s.message else ""
    return f"{prefix}{MARK[s.status]} {s.stage:<9} {s.seconds:6.2f}s  [dim]{msg}[/]"


def error_table(report: Report) -> Table:
    table = Table(title="measured error vs the float64 reference (worst over shapes × seeds)")
    for col in ("output", "dtype", "checks", "max|err|", "PyTorch's", "allowed", "rel err", ""):
        table.add_column(
            col, justify="left" if col in ("output", "dtype") else "right", no_wrap=True
        )
    for r in error_rows(report):
        table.add_row(
            r.output,
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
        if isinstance(event, TurnEnded):
            self._turn(event)
        elif isinstance(event, Retrying):
            console.print(
                f"  [yellow]retry {event.attempt}[/] in {event.delay_s:.1f} s: {event.error}"
            )
        elif isinstance(event, StageDone):
            console.print(_stage_line(f"  candidate {event.index}  ", event.stage))
        elif isinstance(event, CandidateDone):
            console.print(f"  {_best_line(event)}")
        elif isinstance(event, ToolAnswered) and not event.ok:
            first = event.summary.splitlines()[0] if event.summary else ""
            console.print(f"  [yellow]{event.name}[/]: answered with an error — {first}")
        elif isinstance(event, Stopped):
            console.print(f"stopped ({event.stop.kind}): {event.stop.message}")

    def _turn(self, e: TurnEnded) -> None:
        calls = ", ".join(c.name for c in e.reply.tool_calls) or "no tool call"
        tokens = f"{e.usage.total:,} tokens, {format_cost(e.cost_usd)}"
        console.print(f"[bold]turn {e.turn}[/] → {calls}  [dim]({tokens} so far)[/]")
        if e.reply.text and [c.name for c in e.reply.tool_calls] != ["finish"]:
            text = e.reply.text.strip().splitlines()[0]
            console.print(f"  [dim]{text[:200]}[/]")


def _best_line(event: CandidateDone) -> str:
    c, best = event.candidate, event.best
    verdict = "[green]verified[/]" if c.report.verified else "[red]not verified[/]"
    tail = ""
    if best is not None and best.report.verified:
        worst = best.report.worst_check()
        err = f"worst error {worst.max_abs_err:.2e} (allowed {worst.allowed:.2e})" if worst else ""
        when = f"{best.time_ms:.4f} ms" if best.time_ms is not None else "not measured"
        tail = f" · best: candidate {best.index}, {err}, time {when}"
    return f"candidate {c.index}: {verdict}{' (new best)' if event.is_best else ''}{tail}"


# -- synthesize ------------------------------------------------------------------------------------
def _budgets(base: dict[str, Any], **given: Any) -> Budgets:
    values = {**base, **{k: v for k, v in given.items() if v is not None}}
    return Budgets(**values)


@app.command("synthesize")
def synthesize_cmd(
    block: str = typer.Option(None, "--block", "-b", help="a registered block (see `blocks`)"),
    block_file: Path = typer.Option(None, "--block-file", help="a Python file defining a Block"),
    provider: str = typer.Option(
        None, "--provider", "-p", help=f"one of {', '.join(PROVIDERS)} (default builtin)"
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
    timeout: float = typer.Option(None, "--timeout", min=1, help="wall-clock seconds"),
    patience: int = typer.Option(
        None, "--patience", min=1, help="stop after N turns without improving (default 3)"
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
    )
    progress = None if as_json else Progress()
    if provider is None and transcript is not None:
        provider = "replay"
    if resume_dir is not None:
        result, prov = _resume(
            resume_dir, block, block_file, provider, model, base_url, given, progress
        )
    else:
        result, prov = _start(
            block, block_file, provider, model, base_url, transcript, runs_dir, given, progress
        )
    _finish(result, as_json, list(getattr(prov, "divergences", [])))


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
) -> tuple[AgentResult, Any]:
    """A new run (a replay takes its block from the transcript unless one is given)."""
    if provider == "replay" and transcript is not None and block is None and not block_file:
        block, block_file = _recorded_block(transcript)
    blk = resolve_block(block, block_file)
    name = provider or "builtin"
    prov = _make_provider(name, blk, model, base_url, transcript)
    if progress is not None:
        console.print(
            f"[bold]coda-agent synthesize[/] {blk.name} — provider {name} ({prov.model}), "
            f"kernels on {backend.describe()}"
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
            )
        )
    except BudgetError as e:
        raise _fail(str(e)) from None
    return result, prov


def _recorded_block(transcript: Path) -> tuple[str, Path | None]:
    try:
        start = read_records(transcript)[0]
    except TranscriptError as e:
        raise _fail(str(e)) from None
    return start.block, Path(start.block_file) if start.block_file else None


def _make_provider(
    name: str,
    blk: Block,
    model: str | None,
    base_url: str | None,
    transcript: Path | None,
    replay_skip: int = 0,
) -> Any:
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
        raise _fail(f"the built-in planner cannot lower block {blk.name!r}: {e}") from None
    except (ProviderError, TranscriptError) as e:
        raise _fail(getattr(e, "message", str(e))) from None


def _interruptible(fn: Any) -> AgentResult:
    try:
        return fn()
    except KeyboardInterrupt:
        Console(stderr=True).print(
            "[yellow]interrupted[/]: the transcript is saved; continue with "
            "`coda-agent synthesize --resume RUN_DIR`"
        )
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
) -> tuple[AgentResult, Any]:
    """Continue a run: its block, provider, model and budgets unless overridden by flags."""
    try:
        run = RunDir.open(run_dir)
        state = run.state()
    except TranscriptError as e:
        raise _fail(str(e)) from None
    start = state.start
    if state.end is not None and state.end.reason in ("finished", "converged"):
        raise _fail(
            f"{run_dir} already ended ({state.end.reason}: {state.end.message}); "
            "start a new run instead",
            code=0 if state.end.verified else 1,
        )
    budgets = _budgets(start.budgets, **given)
    spent = _spent(state, budgets)
    if spent:
        raise _fail(f"{run_dir} has spent its budget ({spent}): give a larger one to continue")
    blk = resolve_block(
        block or start.block,
        block_file or (Path(start.block_file) if start.block_file else None),
    )
    name = provider or state.provider
    same = name == state.provider
    prov = _make_provider(
        name,
        blk,
        model or (state.model if same and name in ("anthropic", "openai") else None),
        base_url or (start.base_url if same else None),
        Path(start.transcript) if start.transcript else None,
        replay_skip=state.turns if same else 0,
    )
    if progress is not None:
        console.print(
            f"[bold]coda-agent synthesize --resume[/] {run.path} — {blk.name}, provider "
            f"{prov.name} ({prov.model}), {state.turns} turns and {len(state.candidates)} "
            "candidates so far"
        )
    try:
        result = _interruptible(lambda: resume(run, blk, prov, budgets=budgets, on_event=progress))
    except BudgetError as e:
        raise _fail(str(e)) from None
    return result, prov


def _spent(state: Any, b: Budgets) -> str | None:
    """Which recorded total already reaches its budget, if any."""
    if b.max_turns is not None and state.turns >= b.max_turns:
        return f"{state.turns} turns, --max-turns {b.max_turns}"
    if b.max_tokens is not None and state.usage.total >= b.max_tokens:
        return f"{state.usage.total} tokens, --max-tokens {b.max_tokens}"
    if b.max_cost is not None and state.cost_usd is not None and state.cost_usd >= b.max_cost:
        return f"${state.cost_usd:.4f}, --max-cost {b.max_cost}"
    return None


def _finish(result: AgentResult, as_json: bool, divergences: list[str]) -> None:
    code = 0 if result.verified else (result.stop.exit_code or 1)
    if as_json:
        print(json.dumps({**result_json(result), "divergences": divergences}))
        raise typer.Exit(code)
    best = result.best
    if best is not None and best.report.verified and best.program is not None:
        console.print(
            Panel(
                Syntax(best.program.to_python(), "python", word_wrap=True),
                title=f"best program (candidate {best.index}, builder form)",
            )
        )
    if best is not None:
        console.print(error_table(best.report))
        prof = best.report.stage("profile")
        if not best.report.profile:
            console.print(f"timings: not measured ({prof.message if prof else 'not profiled'})")
    console.print(facts_table(RunFacts.from_result(result)))
    if result.stop.kind == "provider_error":
        Console(stderr=True, highlight=False).print(
            f"[red]error:[/] {result.stop.message}\nthe run so far is in {result.run.path}; "
            f"continue it with `coda-agent synthesize --resume {result.run.path}`",
            soft_wrap=True,
        )
    for note in divergences:
        console.print(f"[yellow]replay diverged[/]: {note}")
    verdict = "[green]VERIFIED[/]" if result.verified else "[red]NOT VERIFIED[/]"
    console.print(f"{verdict} {result.block} in {result.seconds:.1f} s → {result.run.path}")
    for path in sorted(result.run.kernels_dir.glob("*.py")):
        console.print(f"  kernel: {path}")
    raise typer.Exit(code)


def facts_table(facts: RunFacts) -> Table:
    table = Table(title="run", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for label, value in facts.facts():
        table.add_row(label, value)
    return table


def result_json(result: AgentResult) -> dict[str, Any]:
    best = result.best
    return {
        "block": result.block,
        "provider": result.provider,
        "model": result.model,
        "verified": result.verified,
        "run_dir": str(result.run.path),
        "turns": result.turns,
        "tokens": {
            "input": result.usage.input_tokens,
            "output": result.usage.output_tokens,
            "total": result.usage.total,
        },
        "cost_usd": result.cost_usd,
        "stop": {"reason": result.stop.kind, "message": result.stop.message},
        "seconds": round(result.seconds, 2),
        "tool_errors": result.tool_errors,
        "retries": result.retries,
        "candidates": [
            {
                "index": c.index,
                "turn": c.turn,
                "verified": c.report.verified,
                "headline": c.report.headline(),
                "time_ms": c.time_ms,
            }
            for c in result.candidates
        ],
        "best": best.index if best else None,
        "report": best.report.model_dump(mode="json") if best else None,
    }


# -- verify, blocks, show --------------------------------------------------------------------------
@app.command("verify")
def verify_cmd(
    program_file: Path = typer.Argument(..., help="a Program as JSON"),
    block: str = typer.Option(None, "--block", "-b"),
    block_file: Path = typer.Option(None, "--block-file"),
    as_json: bool = typer.Option(False, "--json"),
    semantics_seed: int = typer.Option(
        None,
        "--semantics-seed",
        help="seed of the semantics stage's drawn shapes and inputs (default: fresh per run; "
        "the Report names it, so a run can be repeated)",
    ),
) -> None:
    """Run one Program through the sandbox and print its Report."""
    blk = resolve_block(block, block_file)
    try:
        text = program_file.read_text()
    except OSError as e:
        raise _fail(f"cannot read {program_file}: {e.strerror}") from None
    report = evaluate(
        text,
        blk,
        SandboxOptions(semantics_seed=semantics_seed),
        block_file=str(block_file) if block_file else None,
        on_stage=None if as_json else (lambda s: console.print(_stage_line("  ", s))),
    )
    if as_json:
        print(report.model_dump_json(indent=2))
    else:
        console.print(report.render_text())
    raise typer.Exit(0 if report.verified else 1)


@app.command("blocks")
def blocks_cmd(block_file: Path = typer.Option(None, "--block-file")) -> None:
    """List the blocks that can be synthesized."""
    if block_file is not None:
        resolve_block(None, block_file)
    table = Table(title="blocks")
    for col in ("name", "inputs", "outputs", "description"):
        table.add_column(col)
    for b in list_blocks():
        ins = ", ".join(f"{n}[{','.join(map(str, s.shape))}]" for n, s in b.inputs.items())
        table.add_row(b.name, ins, ", ".join(b.outputs), b.description)
    console.print(table)


@app.command("show")
def show_cmd(run_dir: Path = typer.Argument(..., help="a runs/<time>-<block> folder")) -> None:
    """Render a run — finished, or interrupted (from its transcript)."""
    try:
        state = RunDir.open(run_dir).state()
    except TranscriptError as e:
        raise _fail(str(e)) from None
    facts = RunFacts.from_state(state)
    start = state.start
    console.print(
        f"[bold]{run_dir}[/]: block {start.block}, provider {start.provider} ({start.model}), "
        f"started {start.started_at}"
    )
    console.print(facts_table(facts))
    if facts.candidates:
        table = Table(title="candidates")
        for col in ("#", "turn", "verdict", "time", "report"):
            table.add_column(col)
        for c in facts.candidates:
            best = " (best)" if facts.best is c else ""
            table.add_row(
                f"{c.index}{best}",
                str(c.turn),
                "[green]verified[/]" if c.report.verified else "[red]failed[/]",
                f"{c.time_ms:.4f} ms" if c.time_ms is not None else "not measured",
                c.report.headline(),
            )
        console.print(table)
    if facts.best is not None:
        console.print(Panel(facts.best.report.render_text(), title="best candidate's report"))
        if facts.best.program is not None and facts.best.report.verified:
            code = facts.best.program.to_python()
            console.print(Panel(Syntax(code, "python"), title="program"))
    if facts.stop is None:
        console.print(
            f"[yellow]unfinished[/]: continue with `coda-agent synthesize --resume {run_dir}`"
        )


register_eval_commands(app)


def main() -> None:
    app(prog_name="coda-agent")


if __name__ == "__main__":
    sys.exit(main())
