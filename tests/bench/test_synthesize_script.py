"""bench/synthesize.py runs ``coda-agent synthesize`` from empty caches in fresh processes on the
CPU (the interpreter's run), alternates its settings round by round, and tabulates the medians."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from . import load_script

script = load_script("synthesize")


def test_one_run_per_setting_from_empty_caches(tmp_path: Path) -> None:
    argv = ["--runs", "1", "--threads", "2", "--no-warmup", "--out", str(tmp_path)]
    assert script.main(argv) == 0
    (run,) = json.loads((tmp_path / "synthesize.json").read_text())["runs"]
    assert run["setting"] == "2" and run["verified"] and run["device"].startswith("cpu")
    assert run["process_s"] >= run["run_s"] > 0 and run["stages"]["verify"] > 0
    assert run["stages"]["profile"] == 0.0  # skipped on a CPU
    table = (tmp_path / "synthesize.md").read_text()
    assert "| 2 | 1 of 1 |" in table


def test_rounds_alternate_the_order_of_the_settings() -> None:
    assert script.order(["1", "default"], 3) == ["1", "default", "default", "1", "1", "default"]


def test_a_run_that_did_not_verify_or_print_a_summary_is_counted_out() -> None:
    failed = subprocess.CompletedProcess([], 2, stdout="", stderr="Traceback\nValueError: boom\n")
    row = script.parse_summary(failed)
    assert row == {"verified": False, "error": "exit 2: Traceback | ValueError: boom"}
    runs = [
        {"setting": "1", "verified": True, "run_s": 10.0, "process_s": 12.0,
         "stages": {"compile": 1.0, "verify": 4.0, "profile": 5.0}},
        {"setting": "1", "verified": True, "run_s": 14.0, "process_s": 16.0,
         "stages": {"compile": 1.0, "verify": 6.0, "profile": 7.0}},
        {"setting": "1", "verified": False, "error": "exit 2"},
    ]  # fmt: skip
    assert script.table(runs, ["1"])[-1] == (
        "| 1 | 2 of 3 | 12.0 (10.0–14.0) | 14.0 (12.0–16.0) | 1.0 (1.0–1.0) | 5.0 (4.0–6.0) "
        "| 6.0 (5.0–7.0) |"
    )


@pytest.mark.parametrize("threads", ["0", "two", ""])
def test_bad_settings_are_refused(threads: str) -> None:
    with pytest.raises(SystemExit):
        script.parse_args(["--threads", threads])
