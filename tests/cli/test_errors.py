"""The real ``coda-agent`` entry point (``python -m coda.cli`` in a subprocess) on bad input:
every error is a message and an exit code — 2 for usage, 1 for a run that started — never a
traceback, and with ``--json`` stdout holds exactly one JSON object. Also: a relative
``--block-file`` works from the folder it was typed in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "coda.cli"]

SMALL_BLOCK = """
from coda.blocks import Add, Block, Linear, ShapeSets, TensorSpec

proj_residual = Block(
    name="proj_residual",
    description="x + x @ w.T",
    inputs={
        "x": TensorSpec(shape=["M", "d"]),
        "w": TensorSpec(shape=["d", "d"], init="linear_weight"),
    },
    graph=[Linear(x="x", weight="w", out="y"), Add(a="x", b="y", out="out")],
    outputs=["out"],
    shapes=ShapeSets(cpu=[{"M": 13, "d": 24}, {"M": 8, "d": 16}, {"M": 5, "d": 24}]),
)
print("[imported] a line a block file prints")
"""


def coda(*args: str, cwd: Path, code: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI (or ``code`` that ends by calling its ``main``) in a fresh interpreter."""
    cmd = [sys.executable, "-c", code, *args] if code else [*CLI, *args]
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def one_json_error(done: subprocess.CompletedProcess, code: int, fragment: str) -> dict:
    """Exit ``code``, stdout exactly one JSON object whose error holds ``fragment``, the same
    message on stderr, and no traceback anywhere."""
    assert done.returncode == code, (done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stdout + done.stderr
    data = json.loads(done.stdout)  # one JSON document, nothing else
    assert isinstance(data, dict) and data["exit_code"] == code
    assert fragment in data["error"], data["error"]
    assert fragment in " ".join(done.stderr.split())
    return data


def test_a_relative_block_file_verifies_from_the_folder_it_was_typed_in(tmp_path: Path) -> None:
    (tmp_path / "my_block.py").write_text(SMALL_BLOCK)
    done = coda(
        "synthesize", "--block-file", "my_block.py", "--runs-dir", "runs", "--json", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # the block file's print went to stderr, not here
    assert result["verified"] is True and result["block"] == "proj_residual"
    assert "[imported] a line a block file prints" in done.stderr
    start = json.loads((tmp_path / result["run_dir"] / "transcript.jsonl").open().readline())
    assert start["block_file"] == str(tmp_path / "my_block.py")  # recorded absolute: resumable


def test_a_block_name_missing_from_a_block_file_lists_the_file_s_blocks(tmp_path: Path) -> None:
    """``--block`` naming no block, beside ``--block-file``: the file's blocks and the closest
    of them, not the file's blocks hidden among every built-in one (exit 2)."""
    (tmp_path / "my_block.py").write_text(SMALL_BLOCK)
    done = coda(
        "synthesize", "--block-file", "my_block.py", "--block", "proj_residul", "--json",
        cwd=tmp_path,
    )  # fmt: skip
    data = one_json_error(done, 2, "no block named 'proj_residul': did you mean 'proj_residual'?")
    assert "my_block.py defines 'proj_residual'" in data["error"]
    assert "llama_mlp" not in data["error"]


BAD_BLOCK_FILES = {
    "raises": ('raise RuntimeError("no [weights] here")', "raised RuntimeError at"),
    "syntax": ("def broken(:\n    pass", ":1: the block file is not valid Python"),
    "sys-exit": ("import sys\nsys.exit(3)", "called exit(3)"),
    "os-exit-0": ("import os\nos._exit(0)", "ended the Python process before it finished"),
    "os-exit-7": ("import os\nos._exit(7)", "(the process exited with status 7)"),
}


@pytest.mark.parametrize("body,fragment", BAD_BLOCK_FILES.values(), ids=BAD_BLOCK_FILES.keys())
def test_a_block_file_that_fails_or_exits_on_import_is_a_usage_error(
    tmp_path: Path, body: str, fragment: str
) -> None:
    (tmp_path / "bad.py").write_text(body + "\n")
    (tmp_path / "p.json").write_text("{}")
    done = coda("verify", "p.json", "--block-file", "bad.py", "--json", cwd=tmp_path)
    data = one_json_error(done, 2, fragment)
    assert str(tmp_path / "bad.py") in data["error"]
    if "RuntimeError" in fragment:  # bracketed text survives Rich on stderr
        assert "no [weights] here" in data["error"] and "no [weights] here" in done.stderr


def test_missing_and_binary_files_are_usage_errors(tmp_path: Path) -> None:
    (tmp_path / "program.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff")
    done = coda("verify", "program.json", "--block", "llama_mlp", "--json", cwd=tmp_path)
    one_json_error(done, 2, "program.json is not UTF-8 text (byte 0x89 at offset 0)")

    done = coda("verify", "program.json", "--block-file", "nowhere.py", "--json", cwd=tmp_path)
    one_json_error(done, 2, f"--block-file nowhere.py: {tmp_path / 'nowhere.py'} does not exist")

    run = tmp_path / "runs" / "20260101-000000-llama_mlp"
    run.mkdir(parents=True)
    (run / "transcript.jsonl").write_bytes(bytes(range(256)) * 4)
    shown = coda("show", str(run), cwd=tmp_path)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr
    assert "does not start with a run_start record (5 unreadable line(s) skipped)" in " ".join(
        shown.stderr.split()
    )
    replay = ["synthesize", "--provider", "replay", "--transcript", str(run / "transcript.jsonl")]
    one_json_error(coda(*replay, "--json", cwd=tmp_path), 2, "does not start with a run_start")


def test_a_runs_dir_that_is_a_file_and_bad_options_are_usage_errors(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("not a folder")
    done = coda("synthesize", "-b", "llama_mlp", "--runs-dir", "runs", "--json", cwd=tmp_path)
    one_json_error(done, 2, "--runs-dir runs is a file, not a folder")
    done = coda("synthesize", "-b", "llama_mlp", "--max-turns", "0", "--json", cwd=tmp_path)
    one_json_error(done, 2, "Invalid value for '--max-turns'")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_runs_dir_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir(mode=0o555)
    done = coda("synthesize", "-b", "llama_mlp", "--runs-dir", "runs", "--json", cwd=tmp_path)
    one_json_error(done, 2, "--runs-dir runs is not writable")


# The entry point with files limited to 2,000 bytes (and SIGXFSZ ignored, so a write past the
# limit fails with EFBIG the way a full disk fails with ENOSPC): the run starts, and its first
# transcript record — the system prompt and tool specs — cannot be written.
FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
sys.argv = ["coda-agent", *sys.argv[1:]]
from coda.cli.main import main
main()
"""


def test_a_runs_dir_that_fills_up_stops_the_run_with_a_clear_error(tmp_path: Path) -> None:
    args = ["synthesize", "-b", "llama_mlp", "--runs-dir", "runs", "--json"]
    done = coda(*args, cwd=tmp_path, code=FULL_DISK)
    data = one_json_error(done, 1, "cannot append to ")
    assert "File too large" in data["error"] and "--resume" in data["error"]
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "transcript.jsonl").read_bytes() == b""  # the failed append was rolled back


def test_an_eval_folder_that_fills_up_keeps_its_results_and_says_so(tmp_path: Path) -> None:
    """A finished eval resumed where its plots cannot be written: the message names the plot and
    says the results are intact; no truncated plot or temporary file is left."""
    ev = tmp_path / "ev"
    ev.mkdir()
    spec = {
        "blocks": ["llama_mlp"],
        "providers": [{"kind": "builtin", "model": "coda-planner", "base_url": None}],
    }
    (ev / "eval.json").write_text(json.dumps(spec))
    cell = {
        "cell": "llama_mlp--builtin_coda-planner--s0",
        "block": "llama_mlp",
        "provider": "builtin:coda-planner",
        "model": "coda-planner",
        "seed": 0,
        "status": "done",
        "verified": True,
        "device": "cpu (Triton interpreter)",
    }
    (ev / "results.jsonl").write_text(json.dumps(cell) + "\n")
    done = coda("eval", "--resume", "ev", "--json", cwd=tmp_path, code=FULL_DISK)
    data = one_json_error(done, 1, "cannot write ev/speedup.png: File too large")
    assert "the results themselves are intact in ev/results.jsonl" in data["error"]
    assert "`coda-agent eval --resume ev`" in data["error"]
    assert sorted(p.name for p in ev.iterdir()) == ["eval.json", "results.jsonl"]


def test_the_eval_commands_report_bad_files_and_folders(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("import os\nos._exit(0)\n")
    done = coda("eval", "--blocks", "proj_residual", "--block-file", "bad.py", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "ended the Python process before it finished" in " ".join(done.stderr.split())

    (tmp_path / "taken").write_text("a file")
    done = coda("eval", "--blocks", "llama_mlp", "--out", "taken", cwd=tmp_path)
    assert done.returncode == 2 and "taken is a file, not a folder" in done.stderr

    done = coda("regress", "--store", "no-store", "--json", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert json.loads(done.stdout)["exit_code"] == 2


def test_blocks_lists_every_block_of_a_file_that_defines_several(tmp_path: Path) -> None:
    second = SMALL_BLOCK.replace('name="proj_residual"', 'name="proj_residual_2"')
    (tmp_path / "two.py").write_text(SMALL_BLOCK + second.replace("proj_residual =", "other ="))
    done = coda("blocks", "--block-file", "two.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "proj_residual_2" in done.stdout and "proj_residual " in done.stdout
    assert "[imported]" not in done.stdout  # the file's own print went to stderr


def test_an_interrupted_json_run_still_prints_one_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from coda.agent import synthesize
    from coda.cli.main import app

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(synthesize, "synthesize", interrupted)
    args = ["synthesize", "-b", "llama_mlp", "--runs-dir", str(tmp_path), "--json"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 130
    assert json.loads(done.stdout) == {
        "error": "interrupted: the transcript is saved; continue with "
        "`coda-agent synthesize --resume RUN_DIR`",
        "exit_code": 130,
    }


def test_resuming_a_run_whose_block_came_from_a_file_asks_for_the_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from coda.cli.main import app
    from tests.agent.test_transcript_damage import crashed_run

    run = crashed_run(tmp_path)
    lines = run.transcript.read_text().splitlines(keepends=True)
    start = json.loads(lines[0])
    moved = tmp_path / "moved.py"
    start["block_file"] = str(moved)
    run.transcript.write_text(json.dumps(start) + "\n" + "".join(lines[1:]))
    resume = ["synthesize", "--resume", str(run.path), "--json"]
    done = CliRunner().invoke(app, resume)
    assert done.exit_code == 2
    assert json.loads(done.stdout)["error"] == (
        f"{run.path} records its block as coming from the file {moved}; a transcript never "
        f"chooses code to run: name the file yourself with --block-file {moved}"
    )
    done = CliRunner().invoke(app, [*resume, "--block-file", str(moved)])
    assert done.exit_code == 2
    assert json.loads(done.stdout)["error"] == f"--block-file {moved}: {moved} does not exist"
