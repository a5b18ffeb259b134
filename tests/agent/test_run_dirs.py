"""Run and eval folders under real concurrency: 160 creations at once, in threads and in
processes, into one folder — all distinct, none raising."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from coda.agent.runs import RunDir, RunDirError
from coda.evals.results import EvalDir, EvalDirError
from coda.evals.spec import EvalSpec, ProviderSpec

N = 160


def _create_run(runs_dir: str) -> str:
    return str(RunDir.create(runs_dir, "llama_mlp").path)


def _create_after(start: float, runs_dir: str) -> str:
    time.sleep(max(0.0, start - time.time()))  # every process creates at the same moment
    return _create_run(runs_dir)


def _freeze_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """One timestamp for every creation: all of them compete for the same folder name."""
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20260101-000000")


def test_concurrent_run_folders_in_threads_are_all_distinct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _freeze_clock(monkeypatch)
    with ThreadPoolExecutor(max_workers=32) as pool:
        made = list(pool.map(_create_run, [str(tmp_path / "runs")] * N))
    assert len(set(made)) == N
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(
        Path(p).name for p in made
    )


def test_concurrent_run_folders_in_processes_are_all_distinct(tmp_path: Path) -> None:
    start = time.time() + 2.0
    context = multiprocessing.get_context("fork")
    with context.Pool(8) as pool:
        made = pool.starmap(_create_after, [(start, str(tmp_path / "runs"))] * N)
    assert len(set(made)) == N and len(list((tmp_path / "runs").iterdir())) == N
    assert len({Path(p).name.split("-llama_mlp")[0] for p in made}) <= 3  # they did collide


def test_a_runs_dir_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    afile = tmp_path / "runs"
    afile.write_text("")
    with pytest.raises(RunDirError, match="is a file, not a folder"):
        RunDir.create(afile, "llama_mlp")


def _spec() -> EvalSpec:
    return EvalSpec(
        blocks=["llama_mlp"], providers=[ProviderSpec.parse("builtin")], seeds=1, created_at="now"
    )


def test_concurrent_evals_never_share_a_folder(tmp_path: Path) -> None:
    spec, out = _spec(), tmp_path / "ev"

    def claim(_: int) -> str:
        try:
            return str(EvalDir.create(out, spec).path)
        except EvalDirError:
            return "refused"

    with ThreadPoolExecutor(max_workers=16) as pool:
        outcomes = list(pool.map(claim, range(32)))
    assert outcomes.count(str(out)) == 1 and outcomes.count("refused") == 31
    with ThreadPoolExecutor(max_workers=16) as pool:  # a default --out: a suffix each
        made = list(pool.map(lambda _: EvalDir.create(out, spec, unique=True).path, range(32)))
    assert len(set(made)) == 32 and out not in made


def test_an_eval_resumed_after_a_torn_results_line_stays_readable(tmp_path: Path) -> None:
    from coda.evals.results import TORN_FILE, CellResult

    edir = EvalDir.create(tmp_path / "ev", _spec())

    def result(cell: str) -> CellResult:
        return CellResult(
            cell=cell, block="llama_mlp", provider="builtin", model="m", seed=0, status="done"
        )

    edir.append(result("a"))
    whole = edir.results_file.read_bytes()
    edir.results_file.write_bytes(whole + b'{"cell": "b", "blo')  # died mid-write
    assert set(EvalDir.open(edir.path).results()) == {"a"}
    resumed = EvalDir.open(edir.path)
    resumed.append(result("b"))  # the resume: not glued onto the torn bytes
    assert set(EvalDir.open(edir.path).results()) == {"a", "b"}
    assert (edir.path / TORN_FILE).read_bytes() == b'{"cell": "b", "blo\n'
    edir.results_file.write_bytes(whole + b"\xff\xfe\n" + whole)
    with pytest.raises(EvalDirError, match=r"results.jsonl:2: not a cell result"):
        EvalDir.open(edir.path).results()
