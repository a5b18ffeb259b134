"""The eval harness with scripted models: every cell scored, outputs written, resumed evals skip
finished cells and continue unfinished ones, errored cells are retried, worker processes that die
are rerun."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from coda.agent.transcript import ResumeRecord, read_records
from coda.evals.harness import _collect, _Job, run_eval
from coda.evals.metrics import aggregates
from coda.evals.report import ReportError
from coda.evals.results import CellResult, EvalDir, EvalDirError

from .common import BUILTIN, make_eval, model

PNG = b"\x89PNG\r\n\x1a\n"


def lines(edir: EvalDir) -> list[dict]:
    return [json.loads(x) for x in edir.results_file.read_text().splitlines()]


def run_dirs(edir: EvalDir, cell: str) -> list[Path]:
    return [p for p in edir.cell_dir(cell).iterdir() if p.is_dir()]


def test_an_eval_scores_every_cell_and_writes_its_outputs(tmp_path: Path) -> None:
    providers = [BUILTIN, model("broken_then_fixed"), model("never_verifies")]
    edir = make_eval(tmp_path / "ev", providers, seeds=2, ks=[1, 2])
    seen: list[tuple[str, int, int]] = []
    results = run_eval(edir, on_cell=lambda r, done, todo: seen.append((r.cell, done, todo)))
    assert [s[1:] for s in seen] == [(i, 6) for i in range(1, 7)]
    assert [r.status for r in results] == ["done"] * 6
    by = {(r.provider.split(":")[-1], r.seed): r for r in results}
    builtin = by[("coda-planner", 0)]
    assert builtin.verified and builtin.turns == 2 and builtin.cost_usd == 0.0
    assert builtin.candidates == 1 and builtin.failures == {}
    fixed = by[("broken_then_fixed", 1)]
    assert fixed.verified and fixed.turns == 3 and fixed.model == "claude-haiku-4-5"
    assert (fixed.input_tokens, fixed.output_tokens) == (300, 60)
    assert fixed.cost_usd == pytest.approx(0.0006)
    assert fixed.failures == {"semantics": 1} and fixed.verified_candidates == 1
    assert 0 < fixed.worst_error_ratio <= 1
    never = by[("never_verifies", 0)]
    assert not never.verified and never.stop == "finished" and never.worst_error_ratio is None
    # no GPU: every timing is "not measured", never a number
    assert all(r.speedup_eager is None and r.time_ms is None for r in results)
    assert all(r.device == "cpu (Triton interpreter)" for r in results)
    # each cell keeps its run folder, named in its result
    for r in results:
        assert (edir.path / r.run_dir / "transcript.jsonl").is_file()

    rows = {
        (a.block, a.provider.split(":")[-1]): a
        for a in aggregates([r.numbers() for r in results], [1, 2], [1.0])
    }
    assert rows[("llama_mlp", "never_verifies")].pass_at == {1: 0.0, 2: 0.0}
    assert rows[("llama_mlp", "broken_then_fixed")].cost_per_verified == pytest.approx(0.0006)
    assert rows[("all", "coda-planner")].fast["eager"][1.0] is None  # not measured

    md = (edir.path / "results.md").read_text()
    assert "- cells: 6 of 6 done, 0 errors, 0 not run yet" in md
    assert "timings: not measured (no GPU" in md and "speedup.png" in md
    assert "no verified kernel" in md  # never_verifies' dollars per verified kernel
    assert (
        "| llama_mlp | python:tests.evals.models:broken_then_fixed | 2 | 0 | 2 | 1.00 | 1.00 |"
        in md
    )
    for png in ("speedup.png", "errors.png"):
        assert (edir.path / png).read_bytes().startswith(PNG)


def test_an_interrupted_eval_resumes_where_it_stopped(tmp_path: Path) -> None:
    edir = make_eval(tmp_path / "ev", [BUILTIN, model("interrupted_once")])
    builtin_cell, interrupted_cell = (c.id for c in edir.spec().cells())
    with pytest.raises(KeyboardInterrupt):
        run_eval(edir)
    assert [x["cell"] for x in lines(edir)] == [builtin_cell]  # the finished cell is recorded
    assert "1 of 2 done, 0 errors, 1 not run yet" in (edir.path / "results.md").read_text()
    (cut,) = run_dirs(edir, interrupted_cell)
    assert read_records(cut / "transcript.jsonl")[-1].reason == "interrupted"

    results = run_eval(edir)
    assert [x["cell"] for x in lines(edir)] == [builtin_cell, interrupted_cell]  # not rerun
    assert len(run_dirs(edir, builtin_cell)) == 1
    (resumed,) = run_dirs(edir, interrupted_cell)  # the same run, continued
    assert resumed == cut
    assert any(isinstance(r, ResumeRecord) for r in read_records(resumed / "transcript.jsonl"))
    last = results[-1]
    assert last.verified and last.stop == "finished" and last.turns == 2 and last.candidates == 1
    assert run_eval(edir) == results and len(lines(edir)) == 2  # nothing left to run


def test_an_errored_cell_is_reported_then_retried_on_resume(tmp_path: Path) -> None:
    edir = make_eval(tmp_path / "ev", [model("server_down_once")])
    (first,) = run_eval(edir)
    assert first.status == "error" and first.error == "the server is down"
    md = (edir.path / "results.md").read_text()
    assert "## Errors" in md and "the server is down" in md
    assert "| all | python:tests.evals.models:server_down_once | 0 | 1 | 0 |" in md
    (second,) = run_eval(edir)
    assert second.status == "done" and second.verified and second.error is None
    assert [x["status"] for x in lines(edir)] == ["error", "done"]
    assert EvalDir.open(edir.path).results()[second.cell] == second


def test_worker_processes_rerun_a_worker_that_died(tmp_path: Path) -> None:
    edir = make_eval(tmp_path / "ev", [model("crash_once")])
    (recovered,) = run_eval(edir, parallel=2, retries=1)
    assert recovered.status == "done" and recovered.verified and recovered.attempts == 2
    log = (edir.cell_dir(recovered.cell) / "log.txt").read_text()
    assert "--- attempt 1 ---" in log and "--- attempt 2 ---" in log


def test_a_worker_that_keeps_dying_is_an_error_once_its_retries_are_spent(tmp_path: Path) -> None:
    edir = make_eval(tmp_path / "ev", [model("crash_always")])
    (cell,) = edir.spec().cells()
    edir.cell_dir(cell.id).mkdir(parents=True)
    died = SimpleNamespace(returncode=17)  # a worker process that exited without a result
    assert _collect(edir, _Job(cell, 1, died, 0), retries=1) is None  # rerun it
    lost = _collect(edir, _Job(cell, 2, died, 0), retries=1)
    assert lost.status == "error" and lost.attempts == 2
    assert "the worker process exited with code 17 without a result, 2 time(s)" in lost.error
    killed = _collect(edir, _Job(cell, 1, SimpleNamespace(returncode=-9), 0), retries=0)
    assert "the worker process was killed by SIGKILL" in killed.error


def test_results_skip_a_torn_last_line_and_keep_the_latest_per_cell(tmp_path: Path) -> None:
    edir = make_eval(tmp_path / "ev", [BUILTIN], seeds=2)
    a, b = edir.spec().cells()
    base = dict(block="llama_mlp", provider="builtin:coda-planner", model="coda-planner")
    edir.append(CellResult(cell=a.id, seed=0, status="error", error="boom", **base))
    edir.append(CellResult(cell=a.id, seed=0, status="done", verified=True, **base))
    with open(edir.results_file, "a") as f:
        f.write('{"cell": "' + b.id + '", "blo')  # a crash while writing
    results = edir.results()
    assert list(results) == [a.id] and results[a.id].verified
    from coda.evals.harness import pending

    assert pending(edir, edir.spec()) == [b]


def test_a_plot_that_cannot_be_written_is_named_and_leaves_no_partial_file(tmp_path: Path) -> None:
    edir = make_eval(tmp_path / "ev", [BUILTIN])
    plot = edir.path / "speedup.png"
    plot.mkdir()  # the plot's place is taken: the write fails the way a read-only folder fails
    with pytest.raises(ReportError) as caught:
        run_eval(edir)
    message = str(caught.value)
    assert message.startswith(f"cannot write {plot}: ")
    assert f"the results themselves are intact in {edir.results_file}" in message
    assert f"`coda-agent eval --resume {edir.path}`" in message
    assert [x["status"] for x in lines(edir)] == ["done"]  # the cell's result is recorded
    # no temporary file is left behind, and nothing was drawn over the folder
    assert sorted(p.name for p in edir.path.iterdir()) == [
        "cells",
        "eval.json",
        "results.jsonl",
        "speedup.png",
    ]
    assert plot.is_dir() and not list(plot.iterdir())


def test_a_failed_append_is_reported_even_when_the_report_cannot_be_written(
    tmp_path: Path,
) -> None:
    edir = make_eval(tmp_path / "ev", [BUILTIN])
    edir.results_file.mkdir()  # results.jsonl cannot be appended to (as on a full disk)
    (edir.path / "speedup.png").mkdir()  # and the report cannot be written either
    with pytest.raises(EvalDirError) as caught:
        run_eval(edir)
    assert not isinstance(caught.value, ReportError)
    assert str(caught.value).startswith(f"cannot append to {edir.results_file}: ")
    assert "then continue with `coda-agent eval --resume`" in str(caught.value)
