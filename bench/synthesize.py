"""Time ``coda-agent synthesize --block B`` from empty caches, as a user's first run on a machine
pays it: every run is a fresh process with fresh coda and Triton caches (``CODA_CACHE_DIR``,
``TRITON_CACHE_DIR`` in a temporary folder, removed after), under each compile setting asked for
(``CODA_COMPILE_THREADS``: ``1`` compiles each kernel at its first launch, ``default`` leaves the
variable unset: one thread per CPU, at most 16, compiling ahead of the launches).

    python3 bench/synthesize.py [--block llama_mlp] [--runs 3] [--threads 1,default]
        [--no-warmup] [--timeout 600] [--out DIR]

Each round runs every setting once, the order reversed every other round, so that a machine that
drifts over the runs favours no setting. A warm-up run (default setting, not counted) first fills
what a machine keeps between a user's runs anyway — Python's bytecode caches, ``torch.compile``'s
cache for the profile stage's baseline: the first run on a machine whose image ships no bytecode
took 6 s longer, 10 s with the process's imports (bench/RESULTS.md, run 2026-12-02g). On a CPU
the run is the interpreter's (no tuning, no timings): the script works there, its numbers mean
little.

Writes ``synthesize.json`` (every run: setting, the run's wall time as the CLI reports it, the
process's, each stage's seconds, the verdict) and ``synthesize.md`` (per setting the median and
min–max of each) into ``--out`` (default ``$OUT``, else ``bench/out``). Exit 1 when a run did not
verify.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STAGES = ("compile", "verify", "profile")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--block", default="llama_mlp", help="a registered block")
    p.add_argument("--runs", type=int, default=3, help="rounds: runs per setting")
    p.add_argument(
        "--threads", default="1,default",
        help="comma-separated CODA_COMPILE_THREADS settings: positive integers or 'default'",
    )  # fmt: skip
    p.add_argument("--no-warmup", action="store_true", help="count the first run too")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    args = p.parse_args(argv)
    args.settings = [s.strip() for s in args.threads.split(",") if s.strip()]
    bad = [s for s in args.settings if s != "default" and not (s.isdigit() and int(s) >= 1)]
    if bad or not args.settings:
        p.error(f"--threads {args.threads!r}: positive integers or 'default'")
    if args.runs < 1:
        p.error(f"--runs {args.runs}: at least 1")
    return args


def order(settings: list[str], rounds: int) -> list[str]:
    """The settings run by run: every round each once, every other round reversed."""
    return [s for r in range(rounds) for s in (settings if r % 2 == 0 else settings[::-1])]


def one_run(block: str, setting: str, timeout: float) -> dict[str, Any]:
    """One ``synthesize`` in a fresh process with empty caches, under ``setting``."""
    with tempfile.TemporaryDirectory(prefix="coda-synthesize-") as tmp:
        env = {**os.environ, "CODA_CACHE_DIR": f"{tmp}/coda", "TRITON_CACHE_DIR": f"{tmp}/triton"}
        env.pop("CODA_COMPILE_THREADS", None)
        if setting != "default":
            env["CODA_COMPILE_THREADS"] = setting
        command = [sys.executable, "-m", "coda.cli", "synthesize", "--block", block]
        command += ["--runs-dir", f"{tmp}/runs", "--json"]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"setting": setting, "verified": False, "error": f"ran past {timeout:.0f} s"}
        process_s = round(time.perf_counter() - start, 2)
    return {"setting": setting, "process_s": process_s, **parse_summary(done)}


def parse_summary(done: subprocess.CompletedProcess) -> dict[str, Any]:
    """The run's wall time, stage seconds and verdict from the CLI's ``--json`` summary."""
    try:
        summary = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"verified": False, "error": f"exit {done.returncode}: " + " | ".join(tail)}
    report = summary.get("report") or {}
    stages = {s["stage"]: s["seconds"] for s in report.get("stages", [])}
    return {
        "verified": bool(summary.get("verified")),
        "run_s": summary.get("seconds"),
        "stages": {name: stages.get(name) for name in STAGES},
        "device": report.get("device"),
    }


def spread(values: list[float]) -> str:
    """``median (min–max)`` of ``values``, or "—"."""
    if not values:
        return "—"
    median = statistics.median(values)
    return (
        f"{median:.1f} ({min(values):.1f}–{max(values):.1f})"
        if len(values) > 1
        else f"{median:.1f}"
    )


def table(runs: list[dict[str, Any]], settings: list[str]) -> list[str]:
    """Per setting: median (min–max) seconds of the run, the process and each stage."""
    lines = [
        "| CODA_COMPILE_THREADS | runs verified | run s | process s | "
        + " | ".join(f"{s} s" for s in STAGES)
        + " |",
        "|---" * (4 + len(STAGES)) + "|",
    ]
    for setting in settings:
        mine = [r for r in runs if r["setting"] == setting]
        ok = [r for r in mine if r["verified"]]
        cells = [spread([r["run_s"] for r in ok]), spread([r["process_s"] for r in ok])]
        cells += [
            spread([r["stages"][s] for r in ok if r["stages"][s] is not None]) for s in STAGES
        ]
        lines.append(f"| {setting} | {len(ok)} of {len(mine)} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import triton

    environment = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *(sys.argv if argv is None else ["bench", *argv])]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    if not args.no_warmup:
        warm = one_run(args.block, "default", args.timeout)
        print(f"warm-up: {warm}", flush=True)
    runs = []
    for setting in order(args.settings, args.runs):
        runs.append(one_run(args.block, setting, args.timeout))
        print(runs[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment, "block": args.block, "runs": runs}
    (out / "synthesize.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# `coda-agent synthesize --block {args.block}` from empty caches ({environment['date']})",
        "",
        f"{environment['device']}, torch {environment['torch']}, Triton {environment['triton']}; "
        f"{args.runs} run(s) per setting, seconds: median (min–max)",
        "",
        *table(runs, args.settings),
    ]
    (out / "synthesize.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["verified"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
