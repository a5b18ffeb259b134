"""`coda-agent eval --compare A B`: per-cell and aggregate changes, regressions flagged (exit 1),
unmeasured speedups compared as "not measured"."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from coda.cli.main import app
from coda.evals.compare import compare, markdown
from coda.evals.results import CellResult, EvalDir

from .common import BUILTIN, make_eval

runner = CliRunner()
GPU = "cuda (NVIDIA H200)"


def result(cell: str, seed: int, verified: bool, speedup: float | None, **kw) -> CellResult:  # noqa: ANN003
    return CellResult(
        cell=cell,
        block="llama_mlp",
        provider="builtin:coda-planner",
        model="coda-planner",
        seed=seed,
        status=kw.pop("status", "done"),
        verified=verified,
        speedup_eager=speedup,
        device=kw.pop("device", GPU),
        turns=kw.pop("turns", 2),
        **kw,
    )


def evals(tmp_path: Path, a: list[CellResult], b: list[CellResult]) -> tuple[EvalDir, EvalDir]:
    dirs = []
    for name, results in (("a", a), ("b", b)):
        edir = make_eval(tmp_path / name, [BUILTIN], seeds=3)
        for r in results:
            edir.append(r)
        dirs.append(edir)
    return dirs[0], dirs[1]


def test_regressions_are_flagged_per_cell_and_per_aggregate(tmp_path: Path) -> None:
    ids = [c.id for c in make_eval(tmp_path / "ids", [BUILTIN], seeds=3).spec().cells()]
    a, b = evals(
        tmp_path,
        [
            result(ids[0], 0, True, 2.0),
            result(ids[1], 1, True, 2.0),
            result(ids[2], 2, False, None),
        ],
        [
            result(ids[0], 0, True, 1.5, turns=4),
            result(ids[1], 1, False, None),
            result(ids[2], 2, True, 2.5),
        ],
    )
    found = compare(a, b, slowdown=1.10)
    by = {d.cell: d for d in found.cells}
    assert by[ids[0]].regressions == ["slower (2.000× → 1.500×)"]
    assert by[ids[1]].regressions == ["no longer verified"]
    assert by[ids[2]].improvements == ["now verified"] and not by[ids[2]].regressions
    assert found.regressions == 2  # pass@1 is 2/3 on both sides: no aggregate regression
    text = markdown(found)
    assert "**2 regression(s)**" in text and "REGRESSION: slower" in text
    assert f"| `{ids[0]}` | verified | verified | +2 | +0.0 | -0.500 |" in text

    cli = runner.invoke(app, ["eval", "--compare", str(a.path), str(b.path)])
    assert cli.exit_code == 1 and "REGRESSION: no longer verified" in cli.output
    same = runner.invoke(app, ["eval", "--compare", str(a.path), str(a.path)])
    assert same.exit_code == 0 and "**no regressions**" in same.output


def test_a_lower_pass_rate_and_errors_are_regressions_and_cpu_speedups_not_measured(
    tmp_path: Path,
) -> None:
    ids = [c.id for c in make_eval(tmp_path / "ids", [BUILTIN], seeds=3).spec().cells()]
    cpu = "cpu (Triton interpreter)"
    a, b = evals(
        tmp_path,
        [result(ids[0], 0, True, None, device=cpu), result(ids[1], 1, True, None, device=cpu)],
        [
            result(ids[0], 0, False, None, device=cpu),
            result(ids[1], 1, False, None, device=cpu, status="error", error="down"),
        ],
    )
    found = compare(a, b)
    assert [g.regressions for g in found.groups] == [["pass@1 1.00 → 0.00"]] * 2
    assert {d.cell: d.regressions for d in found.cells}[ids[1]] == ["errored"]
    text = markdown(found)
    assert "| not measured → not measured |" in text and "| not measured |" in text


def test_cells_verified_in_a_but_not_run_in_b_fail_the_comparison(tmp_path: Path) -> None:
    ids = [c.id for c in make_eval(tmp_path / "ids", [BUILTIN], seeds=3).spec().cells()]
    a, b = evals(
        tmp_path,
        [
            result(ids[0], 0, True, 2.0),
            result(ids[1], 1, True, 2.0),
            result(ids[2], 2, False, None, status="error", error="down"),
        ],
        [result(ids[0], 0, True, 2.0)],  # B was interrupted after its first cell
    )
    found = compare(a, b)
    assert found.regressions == 0 and found.missing == [ids[1]] and found.failed
    text = markdown(found)
    assert "**no regressions**" not in text
    assert (
        "B is incomplete: 1 cell(s) verified in A were not run in B — resume it with "
        f"`coda-agent eval --resume {b.path}`, then compare again"
    ) in text
    assert f"| `{ids[1]}` | verified | - | n/a | n/a | n/a | NOT RUN IN B: verified in A |" in text
    assert f"| `{ids[2]}` | error | - | n/a | n/a | not measured | only in A |" in text

    cli = runner.invoke(app, ["eval", "--compare", str(a.path), str(b.path)])
    assert cli.exit_code == 1 and "B is incomplete: 1 cell(s)" in cli.output
    as_json = runner.invoke(app, ["eval", "--compare", str(a.path), str(b.path), "--json"])
    data = json.loads(as_json.output)
    assert as_json.exit_code == 1 and data["ok"] is False and data["regressions"] == 0
    assert data["missing_in_b"] == [ids[1]] and data["incomplete"].startswith("B is incomplete")
    assert [c["missing_in_b"] for c in data["cells"]] == [False, True, False]

    # cells that only B ran are listed, and change no verdict
    back = runner.invoke(app, ["eval", "--compare", str(b.path), str(a.path), "--json"])
    data = json.loads(back.output)
    assert back.exit_code == 0 and data["ok"] is True and data["missing_in_b"] == []
    assert data["incomplete"] is None
