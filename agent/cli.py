"""The ``coda-agent`` command line (the composition root: it may import every layer).

Exit codes: 0 success (a verified kernel), 1 finished without a verified kernel, 2 bad usage
(unknown block, unreadable file, malformed program JSON).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from coda.blocks import Block, BlockNotFound, get_block, list_blocks, load_block_file
from coda.primitives import backend  # noqa: F401  (first: selects the interpreter without a GPU)
from coda.primitives.errors import ProgramError
from coda.sandbox.report import Report, StageResult
from coda.sandbox.runner import evaluate
from coda.sandbox.stages import SandboxOptions

from .planner import NoRule
from .summary import error_rows, markdown
from .synthesize import synthesize

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Compose GEMM-epilogue Triton kernels for transformer blocks, verified.",
)
# Piped output (CI logs, `| tee`) would otherwise be cut to 80 columns.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 110)
MARK = {"passed": "[green]✓[/]", "failed": "[red]✗[/]", "skipped": "[yellow]–[/]"}


def _fail(message: str, code: int = 2) -> typer.Exit:
    Console(stderr=True, highlight=False).print(f"[red]error:[/] {message}")
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


@app.command("synthesize")
def synthesize_cmd(
    block: str = typer.Option(None, "--block", "-b", help="a registered block (see `blocks`)"),
    block_file: Path = typer.Option(None, "--block-file", help="a Python file defining a Block"),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="where run folders go"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary instead of tables"),
) -> None:
    """Synthesize a verified GEMM-epilogue kernel for a block (offline built-in planner)."""
    blk = resolve_block(block, block_file)
    quiet = as_json
    if not quiet:
        console.print(
            f"[bold]coda-agent synthesize[/] {blk.name} — provider builtin, "
            f"kernels on {backend.describe()}"
        )

    def on_stage(index: int, s: StageResult) -> None:
        if not quiet:
            console.print(_stage_line(f"  candidate {index}  ", s))

    try:
        result = synthesize(
            blk, runs_dir, block_file=str(block_file) if block_file else None, on_stage=on_stage
        )
    except NoRule as e:
        raise _fail(f"the built-in planner cannot lower block {blk.name!r}: {e}") from None
    best = result.best
    assert best is not None
    result.run.write_summary(
        markdown(
            best.report,
            title=f"coda-agent run: {blk.name}",
            extra={
                "provider": "builtin",
                "candidates": str(len(result.candidates)),
                "wall time": f"{result.seconds:.1f} s",
            },
        )
    )
    if as_json:
        print(
            json.dumps(
                {
                    "block": blk.name,
                    "verified": result.verified,
                    "run_dir": str(result.run.path),
                    "seconds": round(result.seconds, 2),
                    "report": best.report.model_dump(mode="json"),
                }
            )
        )
    else:
        console.print(
            Panel(
                Syntax(best.program.to_python(), "python", word_wrap=True),
                title="best program (builder form)",
            )
        )
        console.print(error_table(best.report))
        prof = best.report.stage("profile")
        if not best.report.profile:
            console.print(f"timings: not measured ({prof.message if prof else 'not profiled'})")
        verdict = "[green]VERIFIED[/]" if result.verified else "[red]NOT VERIFIED[/]"
        console.print(f"{verdict} {blk.name} in {result.seconds:.1f} s → {result.run.path}")
        for path in sorted(result.run.kernels_dir.glob("*.py")):
            console.print(f"  kernel: {path}")
    raise typer.Exit(0 if result.verified else 1)


@app.command("verify")
def verify_cmd(
    program_file: Path = typer.Argument(..., help="a Program as JSON"),
    block: str = typer.Option(None, "--block", "-b"),
    block_file: Path = typer.Option(None, "--block-file"),
    as_json: bool = typer.Option(False, "--json"),
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
        SandboxOptions(),
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
    """Render a finished (or interrupted) run."""
    report_file = run_dir / "report.json"
    if not report_file.exists():
        raise _fail(f"{run_dir} has no report.json (is it a run folder?)")
    try:
        report = Report.model_validate_json(report_file.read_text())
    except ProgramError as e:  # pragma: no cover - defensive
        raise _fail(str(e)) from None
    console.print(report.render_text())
    if (run_dir / "program.py").exists():
        console.print(
            Panel(Syntax((run_dir / "program.py").read_text(), "python"), title="program")
        )


def main() -> None:
    app(prog_name="coda-agent")


if __name__ == "__main__":
    sys.exit(main())
