"""The ``coda-agent`` command line (the composition root: it may import every layer).

Commands: ``synthesize`` (run or ``--resume`` the agent loop), ``verify`` (one Program through the
sandbox), ``blocks`` (list), ``show`` (render a run folder, finished or not); and, from
``coda.evals.cli``, ``eval``, ``accept``, ``regress`` and ``export-trajectories`` (their exit codes
are documented there).

Exit codes: 0 a verified kernel; 1 finished without one (including a provider that failed mid-run
or a refusal, or a run folder that could not be written once the run had started); 2 bad usage or
configuration (unknown block, a missing or unreadable file, a block file that fails to import or
exits, a ``--runs-dir`` that is a file or cannot be written, a block the planner cannot lower, a
missing or rejected API key, an unenforceable budget); 130 interrupted. With ``--json`` stdout
holds exactly one JSON object, on errors too: ``{"error": ..., "exit_code": ...}``.

Everything printed here that did not come from this file (Reports, messages of models and servers,
names from programs and block files) is escaped, or printed as ``Text``, so that bracketed text
such as ``[program]`` is shown rather than read as Rich markup.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from coda.blocks import Block, BlockNotFound, get_block, list_blocks, load_block_file
from coda.evals.cli import register as register_eval_commands
from coda.planner import NoRule
from coda.primitives import backend  # noqa: F401  (first: selects the interpreter without a GPU)
from coda.sandbox.report import Report, StageResult
from coda.sandbox.runner import evaluate
from coda.sandbox.stages import SandboxOptions

from .events import CandidateDone, Event, Retrying, StageDone, Stopped, ToolAnswered, TurnEnded
from .loop import AgentResult, Budgets
from .providers import PROVIDERS, ProviderError, make_provider
from .providers.pricing import format_cost
from .runs import RunDir, RunDirError
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


def _fail(message: str, code: int = 2, as_json: bool = False) -> typer.Exit:
    """Print ``message`` as an error (and, for ``--json``, as the one JSON object on stdout); the
    ``Exit`` to raise."""
    Console(stderr=True, highlight=False).print(f"[red]error:[/] {escape(message)}", soft_wrap=True)
    if as_json:
        print(json.dumps({"error": message, "exit_code": code}))
    return typer.Exit(code)


def _note(message: str) -> None:
    """A warning on stderr (never on stdout, which ``--json`` keeps for its one object)."""
    err = Console(stderr=True, highlight=False)
    err.print(f"[yellow]note:[/] {escape(message)}", soft_wrap=True)


def block_file_path(
    block_file: Path | None, as_json: bool = False, what: str = "--block-file"
) -> Path | None:
    """``--block-file`` (or the block file a transcript recorded: ``what``) as an absolute path,
    checked to be a file.

    A relative path is taken from the current folder here, where the user typed it: the sandbox
    worker that imports the file again runs in a temporary folder of its own."""
    if block_file is None:
        return None
    path = Path(os.path.abspath(block_file))
    if not path.is_file():
        missing = "is a folder, not a Python file" if path.is_dir() else "does not exist"
        relative = not block_file.is_absolute()
        hint = f" (a relative path is taken from {Path.cwd()})" if relative else ""
        raise _fail(f"{what} {block_file}: {path} {missing}{hint}", as_json=as_json)
    return path


def load_blocks(block_file: Path, as_json: bool = False) -> list[Block]:
    """Register the blocks of ``block_file`` (absolute: ``block_file_path``). The file is imported
    in a subprocess first, so one that exits or crashes when imported is a usage error, not the
    end of this process; what it prints goes to stderr."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return load_block_file(block_file, probe=True)
    except (FileNotFoundError, ImportError, ValueError) as e:
        raise _fail(str(e), as_json=as_json) from None


def resolve_block(block: str | None, block_file: Path | None, as_json: bool = False) -> Block:
    """The block to work on: ``--block NAME``, or the one block of ``--block-file``."""
    found = load_blocks(block_file, as_json) if block_file is not None else []
    if block is None and len(found) > 1:
        names = ", ".join(b.name for b in found)
        raise _fail(
            f"{block_file} defines several blocks ({names}); pick one with --block", 2, as_json
        )
    if block is None and found:
        return found[0]
    if block is None:
        raise _fail("give --block NAME or --block-file FILE (see `coda-agent blocks`)", 2, as_json)
    try:
        return get_block(block)
    except (BlockNotFound, ValueError) as e:
        raise _fail(str(e), as_json=as_json) from None


def check_runs_dir(runs_dir: Path, as_json: bool = False) -> None:
    """Refuse a ``--runs-dir`` that is a file, or that cannot be created or written, before a
    run starts (exit 2)."""
    if runs_dir.exists() and not runs_dir.is_dir():
        raise _fail(
            f"--runs-dir {runs_dir} is a file, not a folder: give a folder", as_json=as_json
        )
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _fail(
            f"--runs-dir {runs_dir} cannot be created ({e.strerror}): give a folder you can "
            "write to",
            as_json=as_json,
        ) from None
    if not os.access(runs_dir, os.W_OK | os.X_OK):
        raise _fail(
            f"--runs-dir {runs_dir} is not writable: give a folder you can write to",
            as_json=as_json,
        )


def _stage_line(prefix: str, s: StageResult) -> str:
    msg = escape(s.message.splitlines()[0]) if s.message else ""
    return f"{prefix}{MARK[s.status]} {s.stage:<9} {s.seconds:6.2f}s  [dim]{msg}[/]"


def error_table(report: Report) -> Table:
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
        if isinstance(event, TurnEnded):
            self._turn(event)
        elif isinstance(event, Retrying):
            console.print(
                f"  [yellow]retry {event.attempt}[/] in {event.delay_s:.1f} s: "
                + escape(event.error)
            )
        elif isinstance(event, StageDone):
            console.print(_stage_line(f"  candidate {event.index}  ", event.stage))
        elif isinstance(event, CandidateDone):
            console.print(f"  {_best_line(event)}")
        elif isinstance(event, ToolAnswered) and not event.ok:
            first = event.summary.splitlines()[0] if event.summary else ""
            console.print(
                f"  [yellow]{escape(event.name)}[/]: answered with an error — {escape(first)}"
            )
        elif isinstance(event, Stopped):
            console.print(f"stopped ({event.stop.kind}): {escape(event.stop.message)}")

    def _turn(self, e: TurnEnded) -> None:
        calls = escape(", ".join(c.name for c in e.reply.tool_calls) or "no tool call")
        tokens = f"{e.usage.total:,} tokens, {format_cost(e.cost_usd)}"
        console.print(f"[bold]turn {e.turn}[/] → {calls}  [dim]({tokens} so far)[/]")
        if e.reply.text and [c.name for c in e.reply.tool_calls] != ["finish"]:
            text = e.reply.text.strip().splitlines()[0]
            console.print(f"  [dim]{escape(text[:200])}[/]")


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
    timeout: float = typer.Option(
        None,
        "--timeout",
        min=1,
        help="wall-clock seconds; bounds each provider request and sandbox worker too",
    ),
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
    block_file = block_file_path(block_file, as_json)
    if resume_dir is not None:
        result, prov = _resume(
            resume_dir, block, block_file, provider, model, base_url, given, progress, as_json
        )
    else:
        result, prov = _start(
            block,
            block_file,
            provider,
            model,
            base_url,
            transcript,
            runs_dir,
            given,
            progress,
            as_json,
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
    as_json: bool,
) -> tuple[AgentResult, Any]:
    """A new run (a replay takes its block from the transcript unless one is given)."""
    if provider == "replay" and transcript is not None and block is None and not block_file:
        block, recorded = _recorded_block(transcript, as_json)
        _refuse_recorded_block_file(recorded, transcript, as_json)
    blk = resolve_block(block, block_file, as_json)
    name = provider or "builtin"
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
        raise _fail(str(e), as_json=as_json) from None
    except OSError as e:
        raise _fail(_write_failure(e), code=1, as_json=as_json) from None
    return result, prov


def _write_failure(error: OSError) -> str:
    """The message for a run folder that could not be written after the run started."""
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
        raise _fail(
            f"{source} records its block as coming from the file {recorded}; a transcript never "
            f"chooses code to run: name the file yourself with --block-file {recorded}",
            as_json=as_json,
        )


def _recorded_block(transcript: Path, as_json: bool) -> tuple[str, Path | None]:
    try:
        start = read_records(transcript)[0]
    except TranscriptError as e:
        raise _fail(str(e), as_json=as_json) from None
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
        raise _fail(
            f"the built-in planner cannot lower block {blk.name!r}: {e}", as_json=as_json
        ) from None
    except (ProviderError, TranscriptError) as e:
        raise _fail(getattr(e, "message", str(e)), as_json=as_json) from None


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
    try:
        run = RunDir.open(run_dir)
        state = run.state()
    except TranscriptError as e:
        raise _fail(str(e), as_json=as_json) from None
    for note in state.notes:
        _note(note)
    start = state.start
    if state.end is not None and state.end.reason in ("finished", "converged"):
        raise _fail(
            f"{run_dir} already ended ({state.end.reason}: {state.end.message}); "
            "start a new run instead",
            code=0 if state.end.verified else 1,
            as_json=as_json,
        )
    budgets = _budgets(start.budgets, **given)
    spent = _spent(state, budgets)
    if spent:
        raise _fail(
            f"{run_dir} has spent its budget ({spent}): give a larger one to continue",
            as_json=as_json,
        )
    if block_file is None:
        recorded = Path(start.block_file) if start.block_file else None
        _refuse_recorded_block_file(recorded, run_dir, as_json)
    blk = resolve_block(block or start.block, block_file, as_json)
    name = provider or state.provider
    same = name == state.provider
    if same and start.base_url and base_url is None:
        raise _fail(
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
        raise _fail(str(e), as_json=as_json) from None
    if repaired:
        _note(repaired)
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
        raise _fail(str(e), as_json=as_json) from None
    except OSError as e:
        raise _fail(_write_failure(e), code=1, as_json=as_json) from None
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
            why = prof.message if prof else "not profiled"
            console.print(Text(f"timings: not measured ({why})"))
    console.print(facts_table(RunFacts.from_result(result)))
    if result.stop.kind == "provider_error":
        run = escape(str(result.run.path))
        Console(stderr=True, highlight=False).print(
            f"[red]error:[/] {escape(result.stop.message)}\nthe run so far is in {run}; "
            f"continue it with `coda-agent synthesize --resume {run}`",
            soft_wrap=True,
        )
    for note in divergences:
        console.print(f"[yellow]replay diverged[/]: {escape(note)}")
    verdict = "[green]VERIFIED[/]" if result.verified else "[red]NOT VERIFIED[/]"
    where = escape(f"{result.block} in {result.seconds:.1f} s → {result.run.path}")
    console.print(f"{verdict} {where}")
    for path in sorted(result.run.kernels_dir.glob("*.py")):
        console.print(Text(f"  kernel: {path}"))
    raise typer.Exit(code)


def facts_table(facts: RunFacts) -> Table:
    table = Table(title="run", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for label, value in facts.facts():
        table.add_row(Text(label), Text(value))
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
    block_file = block_file_path(block_file, as_json)
    blk = resolve_block(block, block_file, as_json)
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
        console.print(Text(report.render_text()))
    raise typer.Exit(0 if report.verified else 1)


def _read_program(path: Path, as_json: bool) -> str:
    """The text of a Program file; a missing, unreadable or non-UTF-8 file is a usage error."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _fail(f"cannot read {path}: {e.strerror}", as_json=as_json) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(
            f"{path} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}): give a "
            "Program as JSON",
            as_json=as_json,
        ) from None


@app.command("blocks")
def blocks_cmd(block_file: Path = typer.Option(None, "--block-file")) -> None:
    """List the blocks that can be synthesized."""
    if block_file is not None:
        load_blocks(block_file_path(block_file))
    table = Table(title="blocks")
    for col in ("name", "inputs", "outputs", "description"):
        table.add_column(col)
    for b in list_blocks():
        ins = ", ".join(f"{n}[{','.join(map(str, s.shape))}]" for n, s in b.inputs.items())
        table.add_row(Text(b.name), Text(ins), Text(", ".join(b.outputs)), Text(b.description))
    console.print(table)


@app.command("show")
def show_cmd(run_dir: Path = typer.Argument(..., help="a runs/<time>-<block> folder")) -> None:
    """Render a run — finished, or interrupted (from its transcript)."""
    try:
        state = RunDir.open(run_dir).state()
    except TranscriptError as e:
        raise _fail(str(e)) from None
    for note in state.notes:
        _note(note)
    facts = RunFacts.from_state(state)
    start = state.start
    console.print(
        f"[bold]{escape(str(run_dir))}[/]: "
        + escape(
            f"block {start.block}, provider {start.provider} ({start.model}), "
            f"started {start.started_at}"
        )
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
                Text(c.report.headline()),
            )
        console.print(table)
    if facts.best is not None:
        report = Text(facts.best.report.render_text())
        console.print(Panel(report, title="best candidate's report"))
        if facts.best.program is not None and facts.best.report.verified:
            code = facts.best.program.to_python()
            console.print(Panel(Syntax(code, "python"), title="program"))
    if facts.stop is None:
        console.print(
            "[yellow]unfinished[/]: continue with "
            f"`coda-agent synthesize --resume {escape(str(run_dir))}`"
        )


register_eval_commands(app)


def main() -> None:
    """The ``coda-agent`` entry point. Usage errors that the option parser finds (an unknown
    option, a value out of range) keep their message on stderr; with ``--json`` they also print
    the one JSON object on stdout."""
    try:
        code = app(prog_name="coda-agent", standalone_mode=False)
    except typer.TyperException as e:  # typer's own click: UsageError, BadParameter, ...
        if not hasattr(e, "show"):
            raise
        e.show()
        status = getattr(e, "exit_code", 2)
        if "--json" in sys.argv[1:]:
            print(json.dumps({"error": e.format_message(), "exit_code": status}))
        sys.exit(status)
    except typer.Abort:
        Console(stderr=True).print("[yellow]interrupted[/]")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
