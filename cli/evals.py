"""The eval commands of ``coda-agent``: ``eval``, ``accept``, ``regress``, ``export-trajectories``.
``register(app)`` adds them to the command line (``coda.cli.main``).

Exit codes: ``eval`` 0 when every cell ran to an answer (verified or not), 1 when some cells
errored (``--resume`` retries them), 2 bad usage, 130 interrupted (``--resume`` continues);
``eval --compare`` 0 without regressions, 1 with, or when B has no result for cells verified in A
(B is incomplete: resume it); ``accept`` 0 accepted (or already stored), 1 the run has no verified
candidate, 2 bad usage or a taken name; ``regress`` 0 every stored kernel passed, 1 one broke or
slowed down, 2 no store; ``export-trajectories`` 0, or 2 for a folder that is not an eval or an
``--out`` that cannot be written. With ``--json``, ``eval`` prints one JSON object (its progress
lines go to stderr), ``regress`` its rows as one JSON list; on an error both print the object
``{"error": ..., "exit_code": ...}``.

``accept`` writes to the user's store (``coda.evals.store.user_store``: ``$CODA_STORE``, else
``~/.local/share/coda-agent/store``) unless ``--store`` names another; ``regress`` checks the
built-in entries and that store.

Block files are imported in a subprocess first (``load_block_file(probe=True)``): one that exits
or crashes when imported is a usage error (2), not the end of this process. Text that did not come
from this file (cell errors, store messages) is escaped before Rich prints it. The rest of coda is
imported inside the commands, when one runs (``coda.cli.common``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .common import Failure, fail, import_block_file, print_json, stderr, stdout_width

if TYPE_CHECKING:
    from coda.evals.results import CellResult, EvalDir
    from coda.evals.spec import EvalSpec, ProviderSpec
    from coda.evals.store import RegressRow

console = Console(highlight=False, soft_wrap=True, width=stdout_width(piped=120))


def _csv(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def register(app: typer.Typer) -> None:
    """Add ``eval``, ``accept``, ``regress`` and ``export-trajectories`` to ``app``."""
    app.command("eval")(eval_cmd)
    app.command("accept")(accept_cmd)
    app.command("regress")(regress_cmd)
    app.command("export-trajectories")(export_cmd)


# -- eval ------------------------------------------------------------------------------------------
def eval_cmd(
    suite: str = typer.Option(None, "--suite", "-s", help="a suite in evals/suites/ (smoke, ...)"),
    blocks: str = typer.Option(None, "--blocks", help="instead of --suite: a,b,c"),
    block_files: list[Path] = typer.Option(
        None, "--block-file", help="a Python file defining blocks for --blocks (repeatable)"
    ),
    providers: str = typer.Option(
        "builtin",
        "--providers",
        help="comma-separated: builtin, anthropic:MODEL, openai:MODEL or openai:MODEL@URL "
        "(a compatible server), python:MODULE:FUNCTION",
    ),
    seeds: int = typer.Option(None, "--seeds", min=1, help="samples per block × provider"),
    ks: str = typer.Option("1,5,10", "--k", help="pass@k for these k (those ≤ seeds)"),
    ps: str = typer.Option("1.0,1.5,2.0", "--p", help="fast_p thresholds"),
    out: Path = typer.Option(None, "--out", help="eval folder (default runs/evals/<time>-...)"),
    parallel: int = typer.Option(1, "--parallel", "-j", min=1, help="cells at once"),
    ray: str = typer.Option(None, "--ray", help="run cells as Ray tasks: ADDRESS, or local"),
    retries: int = typer.Option(2, "--retries", min=0, help="reruns of a worker that died"),
    max_turns: int = typer.Option(None, "--max-turns", min=1),
    max_tokens: int = typer.Option(None, "--max-tokens", min=1),
    max_cost: float = typer.Option(None, "--max-cost", min=0, help="USD per cell"),
    timeout: float = typer.Option(None, "--timeout", min=1, help="wall-clock seconds per cell"),
    patience: int = typer.Option(None, "--patience", min=1),
    resume_dir: Path = typer.Option(None, "--resume", help="continue an interrupted eval"),
    compare_flag: bool = typer.Option(False, "--compare", help="diff two eval folders: A B"),
    dirs: list[Path] = typer.Argument(None, help="with --compare: the eval folders A and B"),
    slowdown: float = typer.Option(1.10, "--slowdown", help="--compare: flag slowdowns beyond"),
    as_json: bool = typer.Option(
        False, "--json", help="print one JSON object (progress goes to stderr)"
    ),
) -> None:
    """Run a suite of blocks × providers × seeds and score it (or --resume, or --compare)."""
    budgets = {
        k: v
        for k, v in dict(
            max_turns=max_turns,
            max_tokens=max_tokens,
            max_cost=max_cost,
            timeout_s=timeout,
            patience=patience,
        ).items()
        if v is not None
    }
    try:
        if compare_flag or dirs:
            if not compare_flag or len(dirs or []) != 2:
                raise Failure(
                    "to diff two evals write `coda-agent eval --compare A B` (two folders)"
                )
            _compare(dirs[0], dirs[1], slowdown, as_json)
        _check_workers(parallel, ray)
        if resume_dir is not None:
            if suite or blocks or seeds or out or budgets:
                raise Failure(
                    "--resume takes the eval's own settings: drop the other eval options "
                    "(--block-file excepted)"
                )
            edir = _open(resume_dir)
            shipped = _suite_block_files(edir.spec().suite)
            _check_named_block_files(edir, _load_block_files([*(block_files or []), *shipped]))
            _check_named_providers(edir, providers)
        else:
            _require_blocks(suite, blocks)
            files = _load_block_files([*(block_files or []), *_suite_block_files(suite)])
            spec = _new_spec(suite, blocks, files, providers, seeds, ks, ps, budgets)
            edir = _create(out or _default_out(spec), spec, unique=out is None)
        results = _run(edir, parallel, ray, retries, as_json)
    except Failure as f:
        raise fail(f.message, f.code, as_json) from None
    _summary(edir, results, as_json)


def _require_blocks(suite: str | None, blocks: str | None) -> None:
    """A new eval needs its blocks; without them, name every form ``eval`` takes."""
    if suite is None and blocks is None:
        raise Failure(
            "give --suite NAME or --blocks a,b,c to run an eval, --resume EVAL_DIR to continue "
            "one, or --compare A B to diff two"
        )


def _load_block_files(paths: list[Path]) -> dict[str, str]:
    """Register the blocks of each file (imported in a subprocess first; what a file prints goes
    to stderr); block name -> the file's absolute path, as the cells' workers need it."""
    found: dict[str, str] = {}
    for path in paths:
        absolute = os.path.abspath(path)
        try:
            blocks = import_block_file(absolute)
        except Failure as f:
            raise Failure(f"--block-file {path}: {f.message}") from None
        for block in blocks:
            found[block.name] = str(Path(absolute).resolve())
    return found


def _suite_block_files(suite: str | None) -> list[Path]:
    """The block files a suite ships with (``block_files`` in its TOML): part of the package, so
    they are imported like the built-in blocks, with no ``--block-file``."""
    from coda.evals.suites import SuiteError, load_suite

    if suite is None:
        return []
    try:
        return load_suite(suite).block_files
    except SuiteError as e:
        raise Failure(str(e)) from None


def _check_named_block_files(edir: EvalDir, named: dict[str, str]) -> None:
    """An eval's folder is data: each block file its spec records is imported (by the cells'
    workers) only when the user names the same file again with ``--block-file``."""
    recorded = edir.spec().block_files
    missing = sorted({f for b, f in recorded.items() if named.get(b) != f})
    if missing:
        flags = " ".join(f"--block-file {f}" for f in missing)
        raise Failure(
            f"{edir.path} records blocks defined in {', '.join(missing)}; an eval folder never "
            f"chooses code to run: name the files yourself ({flags})"
        )


def _check_named_providers(edir: EvalDir, providers: str) -> None:
    """Recorded providers that choose code (``python:MODULE:FUNCTION``) or where an API key is
    sent (a ``base_url``) are used on ``--resume`` only when ``--providers`` names them again."""
    from coda.evals.spec import ProviderSpec, SpecError

    try:
        named = {ProviderSpec.parse(p) for p in _csv(providers)}
    except SpecError as e:
        raise Failure(str(e)) from None
    risky = [p for p in edir.spec().providers if p.kind == "python" or p.base_url]
    missing = [p for p in risky if p not in named]
    if missing:
        again = ",".join(_provider_text(p) for p in risky)
        raise Failure(
            f"{edir.path} records providers that run code or send your API key to a server "
            f"({', '.join(_provider_text(p) for p in missing)}); an eval folder never chooses "
            f"either: name them yourself with --providers {again}"
        )


def _provider_text(spec: ProviderSpec) -> str:
    """``spec`` as written in ``--providers``."""
    return spec.label + (f"@{spec.base_url}" if spec.base_url else "")


def _new_spec(
    suite: str | None,
    blocks: str | None,
    block_files: dict[str, str],
    providers: str,
    seeds: int | None,
    ks: str,
    ps: str,
    budgets: dict[str, Any],
) -> EvalSpec:
    from coda.evals.spec import EvalSpec, ProviderSpec, SpecError
    from coda.evals.suites import SuiteError, resolve_blocks

    try:
        selection, loaded = resolve_blocks(suite, _csv(blocks) or None)
        specs = [ProviderSpec.parse(p) for p in _csv(providers)]
        if not specs:
            raise SpecError("--providers is empty: give at least one (e.g. builtin)")
        spec = EvalSpec(
            suite=suite,
            blocks=selection.blocks,
            skipped=selection.skipped,
            block_files={b: f for b, f in block_files.items() if b in selection.blocks},
            providers=specs,
            seeds=seeds or (loaded.seeds if loaded and loaded.seeds else 1),
            budgets=budgets,
            ks=_numbers("--k", ks, int),
            ps=_numbers("--p", ps, float),
            created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        spec.cells()
    except (SuiteError, SpecError, ValueError) as e:
        raise Failure(str(e)) from None
    _preflight(spec)
    return spec


def _numbers(flag: str, text: str, kind: type[int] | type[float]) -> list[Any]:
    """A comma-separated list of numbers given to ``flag``; ``Failure`` naming the flag and the
    entry that is not one."""
    found = []
    for item in _csv(text):
        try:
            found.append(kind(item))
        except ValueError:
            what, example = ("an integer", "1,5,10") if kind is int else ("a number", "1.0,1.5,2.0")
            raise Failure(
                f"{flag}: {item!r} is not {what}: give a comma-separated list such as "
                f"{flag} {example}"
            ) from None
    return found


def _check_workers(parallel: int, ray: str | None) -> None:
    from coda.evals.harness import HarnessError, slot_envs

    if ray is not None and parallel > 1:
        raise Failure("give --parallel N (this machine) or --ray ADDRESS (a cluster), not both")
    if ray is None and parallel > 1:
        try:
            slot_envs(parallel)
        except HarnessError as e:
            raise Failure(str(e)) from None


def _preflight(spec: EvalSpec) -> None:
    """Configuration errors (a missing key or SDK) before any cell runs. A block the built-in
    planner cannot lower is no configuration error: its cell is recorded as refused. Python
    providers are built only inside their cells."""
    from coda.agent.providers import BuiltinProvider, ProviderError
    from coda.agent.synthesize import BudgetError, check_budgets
    from coda.blocks import get_block
    from coda.planner import NoRule

    for p in spec.providers:
        for name in spec.blocks:
            block = get_block(name)
            try:
                if p.kind == "builtin":
                    BuiltinProvider(block)
                elif p.kind in ("anthropic", "openai"):
                    check_budgets(p.build(block), spec.budgets_obj())
                    break
            except NoRule:  # the cell records the refusal; the other cells still run
                continue
            except ProviderError as e:
                raise Failure(f"provider {p.label}: {e.message}") from None
            except BudgetError as e:
                raise Failure(f"provider {p.label}: {e}") from None


def _default_out(spec: EvalSpec) -> Path:
    from coda.evals.spec import slug

    name = spec.suite or "-".join(spec.blocks)
    return Path("runs") / "evals" / f"{time.strftime('%Y%m%d-%H%M%S')}-{slug(name)[:60]}"


def _create(path: Path, spec: EvalSpec, unique: bool) -> EvalDir:
    from coda.evals.results import EvalDir, EvalDirError

    try:
        return EvalDir.create(path, spec, unique=unique)
    except EvalDirError as e:
        raise Failure(str(e)) from None


def _open(path: Path) -> EvalDir:
    """An existing eval folder whose spec, cells and results all read back (``Failure`` naming
    the file otherwise): a folder edited by hand fails here, before any cell runs."""
    from coda.evals.results import EvalDir, EvalDirError
    from coda.evals.spec import SpecError

    try:
        edir = EvalDir.open(path)
        edir.spec().cells()
        edir.results()
    except EvalDirError as e:
        raise Failure(str(e)) from None
    except SpecError as e:
        raise Failure(
            f"{edir.spec_file} is not a valid eval spec ({e}): list each block and each provider "
            "once in it, or start a new eval"
        ) from None
    return edir


def _run(
    edir: EvalDir, parallel: int, ray: str | None, retries: int, as_json: bool
) -> list[CellResult]:
    """Run the eval's pending cells, printing a line per cell (on stderr for ``--json``); every
    cell's result."""
    from coda.evals.distributed import RayUnavailable
    from coda.evals.harness import HarnessError, pending, run_eval
    from coda.evals.results import EvalDirError
    from coda.primitives import backend

    out = stderr() if as_json else console
    spec = edir.spec()
    todo = pending(edir, spec)
    total = len(spec.cells())
    where = f"Ray ({ray})" if ray else f"{parallel} at a time on {backend.describe()}"
    out.print(
        f"[bold]coda-agent eval[/] {len(spec.blocks)} block(s) × {len(spec.providers)} "
        f"provider(s) × {spec.seeds} seed(s) = {total} cells, {total - len(todo)} already done; "
        f"running {len(todo)}, {escape(where)} → {escape(str(edir.path))}"
    )
    if spec.skipped:
        skipped = escape(", ".join(spec.skipped))
        out.print(f"  [yellow]skipped[/] (planned, not registered yet): {skipped}")
    try:
        return run_eval(
            edir,
            parallel=parallel,
            ray_address=ray,
            retries=retries,
            on_cell=lambda r, done, todo: _cell_line(r, done, todo, out),
        )
    except KeyboardInterrupt:
        message = f"finished cells are kept; continue with `coda-agent eval --resume {edir.path}`"
        Console(stderr=True, soft_wrap=True).print(f"[yellow]interrupted[/]: {escape(message)}")
        if as_json:
            print(json.dumps({"error": f"interrupted: {message}", "exit_code": 130}))
        raise typer.Exit(130) from None
    except (HarnessError, RayUnavailable) as e:
        raise Failure(str(e)) from None
    except EvalDirError as e:  # results.jsonl, results.md or a plot could not be written
        raise Failure(str(e), code=1) from None


def _cell_line(r: CellResult, done: int, todo: int, out: Console | None = None) -> None:
    if r.status == "error":
        first = ((r.error or "").splitlines() or [""])[0]
        verdict = f"[red]ERROR[/] {escape(first)}"
    elif r.stop == "refused":  # the planner's first op it cannot lower (the rest: results.md)
        ops = [t.strip() for t in r.stop_message.splitlines() if "no lowering rule" in t]
        verdict = f"[yellow]refused[/] {escape((ops or [r.stop_message])[0])}"
    else:
        verdict = "[green]verified[/]" if r.verified else "[red]not verified[/]"
        verdict += escape(f" ({r.stop}, {r.turns} turns, {r.seconds:.1f} s)")
    (out or console).print(f"  {escape(f'[{done}/{todo}] {r.cell}:')} {verdict}")


def _summary(edir: EvalDir, results: list[CellResult], as_json: bool) -> None:
    errors = [r for r in results if r.status == "error"]
    verified = sum(r.verified for r in results)
    code = 1 if errors else 0
    if as_json:
        print_json(
            {
                "eval_dir": str(edir.path),
                "results_md": str(edir.path / "results.md"),
                "cells": len(results),
                "verified": verified,
                "errors": [r.cell for r in errors],
                "results": [r.model_dump(mode="json") for r in results],
            }
        )
        raise typer.Exit(code)
    console.print(
        Text(f"{verified} of {len(results)} cells verified; tables in {edir.path / 'results.md'}")
    )
    if errors:
        console.print(
            f"[red]{len(errors)} cell(s) errored[/]: retry them with "
            f"`coda-agent eval --resume {escape(str(edir.path))}`"
        )
    raise typer.Exit(code)


def _compare(dir_a: Path, dir_b: Path, slowdown: float, as_json: bool) -> None:
    """``--compare A B``: the markdown diff (or, with ``--json``, its cells and groups)."""
    from coda.evals.compare import compare, incomplete, markdown

    a, b = _open(dir_a), _open(dir_b)
    result = compare(a, b, slowdown=slowdown)
    if as_json:
        print_json(
            {
                "a": str(a.path),
                "b": str(b.path),
                "ok": not result.failed,
                "regressions": result.regressions,
                "incomplete": incomplete(result) if result.missing else None,
                "missing_in_b": result.missing,
                "cells": [
                    {
                        "cell": d.cell,
                        "regressions": d.regressions,
                        "improvements": d.improvements,
                        "missing_in_b": d.missing,
                    }
                    for d in result.cells
                ],
                "groups": [
                    {"block": g.block, "provider": g.provider, "regressions": g.regressions}
                    for g in result.groups
                ],
            }
        )
    else:
        print(markdown(result), end="")
    raise typer.Exit(1 if result.failed else 0)


# -- accept, regress, export -----------------------------------------------------------------------
def accept_cmd(
    run_dir: Path = typer.Argument(..., help="a run folder (runs/<time>-<block>)"),
    name: str = typer.Option(None, "--name", help="default: <provider>-<program hash>"),
    store: Path = typer.Option(
        None,
        "--store",
        help="the regression store folder (default: $CODA_STORE, else "
        "~/.local/share/coda-agent/store)",
        show_default=False,
    ),
    force: bool = typer.Option(False, "--force", help="replace an entry of the same name"),
) -> None:
    """Add a run's best verified program to a regression store."""
    from coda.agent.transcript import TranscriptError
    from coda.evals.store import STORE_DIR, AcceptError, accept

    try:
        done = accept(run_dir, name=name, store=store, force=force)
    except TranscriptError as e:
        raise fail(str(e)) from None
    except AcceptError as e:
        raise fail(str(e), code=1 if "no verified candidate" in str(e) else 2) from None
    except OSError as e:
        where = f" {e.filename}" if e.filename else ""
        raise fail(
            f"cannot write{where}: {e.strerror or e}; give --store a folder you can write to"
        ) from None
    if done.duplicate:
        where = "the built-in entry" if done.path.is_relative_to(STORE_DIR) else "the entry"
        console.print(
            Text(
                f"already stored: the same program is {where} "
                f"{done.entry.block}/{done.entry.name} ({done.path}); nothing was added"
            )
        )
        raise typer.Exit(0)
    prov = done.entry.provenance
    time_text = f"{prov.time_ms:.4f} ms" if prov.time_ms is not None else "not measured"
    worst = max(prov.errors, key=lambda e: e.max_abs_err / e.allowed, default=None)
    err = f"{worst.max_abs_err:.2e} ({worst.output}, {worst.dtype})" if worst else "n/a"
    console.print(
        Text(
            f"accepted {done.entry.block}/{done.entry.name} → {done.path}\n"
            f"  from run {prov.run_id} ({prov.provider}, {prov.model}), candidate "
            f"{prov.candidate}, on {prov.hardware}; worst error {err}; time {time_text}"
        )
    )


def regress_cmd(
    store: Path = typer.Option(
        None,
        "--store",
        help="the regression store folder (default: the built-in entries, and the store "
        "`accept` writes to once it exists)",
        show_default=False,
    ),
    block: list[str] = typer.Option(None, "--block", "-b", help="only these blocks"),
    slowdown: float = typer.Option(
        1.10, "--slowdown", help="GPU: fail when slower than this × the recorded time"
    ),
    as_json: bool = typer.Option(False, "--json"),
    times: Path = typer.Option(
        None,
        "--times",
        help="GPU: the file where regress records the times of kernels with none recorded on "
        "this device, and reads them back (default: $CODA_REGRESS_TIMES, else "
        "~/.local/share/coda-agent/regress-times.json)",
        show_default=False,
    ),
    block_files: list[Path] = typer.Option(
        None,
        "--block-file",
        help="a block file whose blocks stored kernels were accepted for (repeatable): an entry "
        "that records one is checked only when it is named",
    ),
) -> None:
    """Re-verify every stored kernel (CPU interpreter here; bf16 and timings on a GPU)."""
    from coda.evals.store import StoreError, default_stores, regress
    from coda.primitives import backend

    stores = [store] if store is not None else default_stores()
    if not as_json:
        where = escape(", ".join(str(s) for s in stores))
        console.print(f"[bold]coda-agent regress[/] {where} on {backend.describe()}")
    try:
        rows = regress(
            stores,
            slowdown=slowdown,
            blocks=block or None,
            on_row=None if as_json else lambda r: console.print(f"  {_row_line(r)}"),
            times=times,
            block_files=block_files or (),
        )
    except StoreError as e:
        raise fail(str(e), as_json=as_json) from None
    bad = [r for r in rows if r.status != "ok"]
    if as_json:
        print(json.dumps([_row_json(r) for r in rows], indent=2))
    else:
        console.print(regress_table(rows))
        verdict = f"[red]{len(bad)} of {len(rows)} FAILED[/]" if bad else f"all {len(rows)} ok"
        console.print(verdict)
    raise typer.Exit(1 if bad else 0)


def _row_line(r: RegressRow) -> str:
    mark = "[green]ok[/]" if r.status == "ok" else f"[red]{r.status.upper()}[/]"
    return f"{mark} {escape(f'{r.block}/{r.name}: {r.message}')}"


def regress_table(rows: list[RegressRow]) -> Table:
    table = Table(title="regression store")
    columns = ("block", "kernel", "status", "err/allowed", "recorded", "ms", "recorded ms")
    for col in (*columns, "× recorded", "note"):
        table.add_column(col, no_wrap=col in ("block", "kernel", "status"))
    for r in rows:
        table.add_row(
            Text(r.block),
            Text(r.name),
            "[green]ok[/]" if r.status == "ok" else f"[red]{r.status.upper()}[/]",
            _num(r.error_now, "{:.2f}"),
            _num(r.error_recorded, "{:.2f}"),
            _num(r.time_now_ms, "{:.4f}"),
            _num(r.time_recorded_ms, "{:.4f}"),
            _num(r.slowdown, "{:.3f}×", "-"),
            Text(r.message if r.status != "ok" else r.time_note),
        )
    return table


def _num(value: float | None, pattern: str, missing: str = "-") -> str:
    return missing if value is None else pattern.format(value)


def _row_json(r: RegressRow) -> dict[str, Any]:
    return {
        "path": str(r.path),
        "block": r.block,
        "name": r.name,
        "status": r.status,
        "message": r.message,
        "error_now": r.error_now,
        "error_recorded": r.error_recorded,
        "time_now_ms": r.time_now_ms,
        "time_recorded_ms": r.time_recorded_ms,
        "slowdown": r.slowdown,
        "time_note": r.time_note,
    }


def export_cmd(
    eval_dir: Path = typer.Argument(..., help="an eval folder"),
    out: Path = typer.Option(None, "--out", help="default: EVAL_DIR/trajectories.jsonl"),
    baseline: str = typer.Option("eager", "--baseline", help="speedup over eager or compile"),
) -> None:
    """Write an eval's trajectories (messages, tool calls, Reports, rewards) as JSONL."""
    from coda.agent.transcript import TranscriptError
    from coda.evals.trajectories import export

    if baseline not in ("eager", "compile"):
        raise fail(f"--baseline must be eager or compile, not {baseline!r}")
    try:
        edir = _open(eval_dir)
    except Failure as f:
        raise fail(f.message, f.code) from None
    target = out or eval_dir / "trajectories.jsonl"
    try:
        written, skipped = export(edir, target, baseline)  # type: ignore[arg-type]
    except TranscriptError as e:
        raise fail(str(e)) from None
    except OSError as e:
        if e.filename is not None and os.fspath(e.filename) != os.fspath(target):
            raise
        raise fail(_unwritable_out(target, e)) from None
    console.print(
        Text(
            f"wrote {written} trajectories to {target}"
            + (f" ({skipped} cell(s) without an answer skipped)" if skipped else "")
        ),
        soft_wrap=True,
    )


def _unwritable_out(target: Path, error: OSError) -> str:
    """Why ``--out`` (``target``) could not be written, and what to give instead."""
    if isinstance(error, IsADirectoryError):
        problem = "is a folder"
    elif isinstance(error, FileNotFoundError):
        problem = f"is in a folder that does not exist ({target.parent})"
    else:
        problem = f"cannot be written ({error.strerror or error})"
    return f"--out {target} {problem}: choose a writable file path with --out FILE"
