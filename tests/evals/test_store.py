"""The regression store: accept refuses unverified runs and records provenance; regress fails
on a broken kernel and (GPU, same hardware) on a slowdown; and the store in this repository
still verifies — the CI regression check, on every `make test`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coda.agent.synthesize import synthesize
from coda.cli.main import app
from coda.evals.store import STORE_DIR, RecordedTimes, StoredKernel, _judge, regress
from coda.sandbox import SandboxOptions
from coda.sandbox.report import ProfileRow, Report
from tests.agent.scripted import BLOCK, Script, broken_program, finish, good_program, submit
from tests.helpers import captured_residual_file

from .common import FAST_SANDBOX
from .models import never_verifies

runner = CliRunner()
FAST = SandboxOptions(**FAST_SANDBOX)


def test_the_stored_kernels_still_verify() -> None:
    """`coda-agent regress` over evals/regression/, as CI runs it (CPU: the interpreter)."""
    stored = sorted(STORE_DIR.glob("*/*.json"))
    assert stored, "the regression store is empty"
    result = runner.invoke(app, ["regress"])
    assert result.exit_code == 0, result.output
    assert f"all {len(stored)} ok" in result.output
    for path in stored:
        assert f"{path.parent.name}/{path.stem}: verified" in result.output


def _run(tmp_path: Path, provider=None) -> Path:  # noqa: ANN001
    return synthesize(BLOCK, tmp_path / "runs", provider=provider, sandbox=FAST).run.path


def test_accept_refuses_a_run_without_a_verified_candidate(tmp_path: Path) -> None:
    run = _run(tmp_path, never_verifies(BLOCK))
    result = runner.invoke(app, ["accept", str(run), "--store", str(tmp_path / "store")])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "no verified candidate (1 candidate(s); the furthest got: FAILED at semantics" in text
    assert not (tmp_path / "store").exists()
    assert runner.invoke(app, ["accept", str(tmp_path)]).exit_code == 2  # not a run folder


def test_accept_records_provenance_once_and_guards_names(tmp_path: Path) -> None:
    store = tmp_path / "store"
    run = _run(tmp_path)
    args = ["accept", str(run), "--store", str(store), "--name", "planner"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    path = store / "llama_mlp" / "planner.json"
    entry = StoredKernel.model_validate_json(path.read_text())
    prov = entry.provenance
    assert (prov.provider, prov.model, prov.run_id) == ("builtin", "coda-planner", run.name)
    assert prov.hardware == "cpu (Triton interpreter)" and prov.time_ms is None
    assert {(e.output, e.dtype) for e in prov.errors} == {("out", "float32"), ("out", "float16")}
    assert all(e.max_abs_err <= e.allowed for e in prov.errors)
    again = runner.invoke(app, [*args[:-1], "other"])
    assert again.exit_code == 0 and "already stored" in again.output  # same program: not twice
    assert not (store / "llama_mlp" / "other.json").exists()

    renamed = good_program()
    renamed["steps"][1]["name"] = "gate_up_v2"  # another verified program
    other = _run(tmp_path / "b", Script([submit(renamed, "c1"), finish()]))
    taken = runner.invoke(app, ["accept", str(other), "--store", str(store), "--name", "planner"])
    assert taken.exit_code == 2 and "already holds a different program" in taken.output
    forced = runner.invoke(
        app, ["accept", str(other), "--store", str(store), "--name", "planner", "--force"]
    )
    assert forced.exit_code == 0 and "gate_up_v2" in path.read_text()


@pytest.mark.parametrize(
    "name,message",
    [
        ("../../etc/x", "--name '../../etc/x' contains a path separator"),
        ("sub\\x", "contains a path separator"),
        ("my kernel", "--name 'my kernel' is not a plain file name"),
        (".hidden", "--name '.hidden' is not a plain file name"),
    ],
)
def test_accept_refuses_a_name_that_is_not_a_plain_file_name(
    tmp_path: Path, name: str, message: str
) -> None:
    run = tmp_path / "not-even-read"  # the name is checked first
    store = tmp_path / "store"
    result = runner.invoke(app, ["accept", str(run), "--store", str(store), "--name", name])
    assert result.exit_code == 2 and message in " ".join(result.output.split())
    assert not store.exists() and not (tmp_path / "etc").exists()


def test_regress_fails_with_a_table_when_a_stored_kernel_breaks(tmp_path: Path) -> None:
    store = tmp_path / "store"
    run = _run(tmp_path)
    assert (
        runner.invoke(app, ["accept", str(run), "--store", str(store), "--name", "ok"]).exit_code
        == 0
    )
    good = json.loads((store / "llama_mlp" / "ok.json").read_text())
    broken = {**good, "name": "dropped-residual", "program": broken_program()}
    (store / "llama_mlp" / "dropped-residual.json").write_text(json.dumps(broken))
    (store / "llama_mlp" / "torn.json").write_text('{"version": 1, "na')
    (store / "llama_mlp" / "newer.json").write_text(json.dumps({**good, "version": 2}))
    (store / "llama_mlp" / "gone.json").symlink_to(tmp_path / "nowhere.json")
    (store / "llama_mlp" / "folder.json").mkdir()
    rows = {r.name: r for r in regress(store, options=FAST)}
    assert rows["ok"].status == "ok"
    assert rows["dropped-residual"].status == "broken"
    assert rows["dropped-residual"].message.startswith("FAILED at semantics")
    assert rows["torn"].status == "broken" and rows["torn"].message.startswith("unreadable")
    assert rows["newer"].message == "unreadable: version: Input should be 1"
    assert rows["gone"].message.startswith("unreadable: [Errno 2] No such file")
    assert rows["folder"].message.startswith("unreadable: [Errno 21] Is a directory")
    for name in ("newer", "gone"):
        (store / "llama_mlp" / f"{name}.json").unlink()
    (store / "llama_mlp" / "folder.json").rmdir()
    (store / "llama_mlp" / "ok.json").unlink()  # the CLI verifies at full size: keep it quick
    result = runner.invoke(app, ["regress", "--store", str(store), "--block", "llama_mlp"])
    assert result.exit_code == 1 and "2 of 2 FAILED" in result.output
    assert "BROKEN" in result.output and "FAILED at semantics" in result.output
    assert runner.invoke(app, ["regress", "--store", str(tmp_path / "none")]).exit_code == 2


FILE_BLOCK = captured_residual_file("store_file_proj_residual", [{"M": 5, "d": 24}])


def test_regress_imports_a_recorded_block_file_only_when_it_is_named(tmp_path: Path) -> None:
    """A store is data: the block file an entry records is imported (in a subprocess first) only
    when the user names it with --block-file, as `eval --resume` asks of an eval's folder."""
    block_file, marker = tmp_path / "blocks.py", tmp_path / "imported"
    block_file.write_text(f"{FILE_BLOCK}\nopen({str(marker)!r}, 'a').write('x')\n")
    runs, store = tmp_path / "runs", tmp_path / "store"
    made = runner.invoke(
        app, ["synthesize", "--block-file", str(block_file), "--runs-dir", str(runs)]
    )
    assert made.exit_code == 0, made.output
    (run,) = runs.iterdir()
    assert runner.invoke(app, ["accept", str(run), "--store", str(store)]).exit_code == 0
    marker.unlink()
    unnamed = runner.invoke(app, ["regress", "--store", str(store)])
    assert unnamed.exit_code == 1
    assert f"add --block-file {block_file}" in "".join(unnamed.output.split(" \n"))
    assert not marker.exists()  # nothing the store names was imported
    args = ["regress", "--store", str(store), "--block-file", str(block_file), "--json"]
    named = runner.invoke(app, args)
    assert named.exit_code == 0, named.output
    assert [r["status"] for r in json.loads(named.stdout)] == ["ok"]
    block_file.write_text("import os\nos._exit(0)\n")  # ends the process that imports it
    ended = runner.invoke(app, args)
    assert ended.exit_code == 2 and f"--block-file {block_file}" in ended.output


def _entry(time_ms: float | None, hardware: str = "cuda (NVIDIA H200)") -> StoredKernel:
    timings = [{"sizes": {"M": 8}, "dtype": "bfloat16", "program_ms": time_ms}] if time_ms else []
    return StoredKernel.model_validate(
        {
            "name": "k",
            "block": "llama_mlp",
            "program_hash": "h",
            "program": {},
            "provenance": {
                "provider": "builtin",
                "model": "coda-planner",
                "accepted_at": "",
                "run_id": "r",
                "run_started_at": "",
                "candidate": 1,
                "hardware": hardware,
                "machine": "",
                "versions": {},
                "errors": [],
                "time_ms": time_ms,
                "timings": timings,
            },
        }
    )


def _report(ms: float, device: str = "cuda (NVIDIA H200)", verified: bool = True) -> Report:
    row = ProfileRow(sizes={"M": 8}, dtype="bfloat16", program_ms=ms, gemms_ms=ms, tflops=1.0)
    return Report(
        verified=verified,
        block="llama_mlp",
        program_hash="h",
        device=device,
        stages=[],
        profile=[row],
    )


def test_slowdowns_fail_only_against_a_time_recorded_on_the_same_hardware() -> None:
    p = Path("k.json")
    assert _judge(p, _entry(1.0), _report(1.05), 1.10).status == "ok"
    slow = _judge(p, _entry(1.0), _report(1.2), 1.10)
    assert slow.status == "slower" and slow.message == "1.200× its recorded time (> 1.1)"
    other = _judge(p, _entry(1.0, "cuda (NVIDIA A100)"), _report(5.0), 1.10)
    assert other.status == "ok" and other.time_note.startswith("not compared: recorded on")
    assert _judge(p, _entry(None), _report(5.0), 1.10).time_note == "no recorded time to compare"
    assert _judge(p, _entry(1.0), _report(1.0, verified=False), 1.10).status == "broken"


def test_regress_records_times_where_none_are_recorded_and_then_checks_them(
    tmp_path: Path,
) -> None:
    """An entry accepted from a CPU run (as the built-in ones are) has no time to compare on a
    GPU: the first regress there records its measured times, the next ones are judged by them."""
    p, times = Path("k.json"), tmp_path / "times.json"
    cpu_entry = _entry(None, "cpu (Triton interpreter)")
    first = _judge(p, cpu_entry, _report(1.0), 1.10, RecordedTimes(times))
    assert first.status == "ok" and first.slowdown is None
    assert (
        "now recorded for cuda (NVIDIA H200)" in first.time_note and str(times) in first.time_note
    )
    again = _judge(p, cpu_entry, _report(1.05), 1.10, RecordedTimes(times))
    assert again.status == "ok" and again.time_recorded_ms == 1.0 and again.time_note == ""
    assert again.slowdown is not None and abs(again.slowdown - 1.05) < 1e-12
    slow = _judge(p, cpu_entry, _report(1.3), 1.10, RecordedTimes(times))
    assert slow.status == "slower" and slow.message == "1.300× its recorded time (> 1.1)"
    assert RecordedTimes(times).get("h", "cuda (NVIDIA H200)")[0][0].program_ms == 1.0  # kept
    other = _judge(p, cpu_entry, _report(7.0, "cuda (NVIDIA A100)"), 1.10, RecordedTimes(times))
    assert other.status == "ok" and "now recorded for cuda (NVIDIA A100)" in other.time_note
    broken = _judge(p, _entry(None), _report(9.0, "cuda (B200)", False), 1.10, RecordedTimes(times))
    assert broken.status == "broken" and RecordedTimes(times).get("h", "cuda (B200)") == ([], "")
    # a time recorded at accept on this hardware still wins over regress's own
    assert _judge(p, _entry(2.0), _report(1.3), 1.10, RecordedTimes(times)).status == "ok"


def test_regress_records_then_compares_through_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``regress`` (the command's function) with a GPU's Report faked: the second run compares."""
    from coda.evals import store as store_module

    store = tmp_path / "store"
    (store / "llama_mlp").mkdir(parents=True)
    (store / "llama_mlp" / "k.json").write_text(
        _entry(None, "cpu (Triton interpreter)").model_dump_json()
    )
    measured = iter([1.0, 1.5])
    monkeypatch.setattr(store_module, "evaluate", lambda *a, **k: _report(next(measured)))
    times = tmp_path / "times.json"
    (first,) = regress(store, options=FAST, times=times)
    assert first.status == "ok" and "now recorded" in first.time_note and times.exists()
    (second,) = regress(store, options=FAST, times=times)
    assert second.status == "slower" and second.time_recorded_ms == 1.0
