"""Fuzz the sandbox's front stages: validate → semantics → compile (code generation and import).

    .venv/bin/python scripts/fuzz.py                    # 10,000 cases on 2 processes
    .venv/bin/python scripts/fuzz.py --cases 50000 --jobs 4 --seed 7 --plugin my_ops.py

The candidates are the property test's (``tests/fuzz/strategies.py``): edits of honest programs
for llama_mlp and the adversarial blocks, programs built from the node registries (plugins
included, with ``--plugin``), random JSON values and text. Each case runs in-process exactly as
``evaluate`` runs those stages (``tests/fuzz/harness.py``). Prints how many cases ran, how many
crashed (an exception escaped a stage, or a stage failed with a generic message instead of a
specific one: it must be 0; an exception out of the strategies that generate the cases counts
too, as a bug of the fuzzer), and the distribution of rejection reasons by stage. Exit status 1
if anything crashed. No kernel runs, so no GPU is needed and nothing here is timed.

``--verify N`` then runs up to N of the accepted candidates (their algebra equals the block's)
through the whole sandbox, isolated, at two shapes in float32: a failure there is a suspect for a
code-generation bug (or a program that overflows float32), listed for a person to triage.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _job(
    cases: int, seed: int, plugins: list[str], keep: int
) -> tuple[collections.Counter, list[tuple], list[tuple]]:
    """One process: ``cases`` examples from a seeded Hypothesis run; (counts, crashes, the first
    ``keep`` accepted candidates)."""
    sys.path.insert(0, str(ROOT))
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    from coda.primitives import load_plugins
    from tests.adversarial.programs import BLOCKS, HONEST
    from tests.fuzz.harness import run_front
    from tests.fuzz.strategies import cases as case_strategy

    load_plugins(plugins)
    counts: collections.Counter = collections.Counter()
    crashes: list[tuple] = []
    accepted: list[tuple] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case_strategy(BLOCKS, HONEST))
    def fuzz(case: tuple[Any, str]) -> None:
        data, block = case
        outcome = run_front(data, BLOCKS[block])
        counts[(outcome.status, outcome.stage, outcome.reason)] += 1
        if outcome.status == "crash":
            crashes.append((outcome.reason, outcome.message, repr(data)[:2000]))
        elif outcome.status == "accepted" and len(accepted) < keep:
            accepted.append((data, block))

    try:
        fuzz()
    except Exception as e:  # noqa: BLE001 - run_front never raises: this is the strategy's own bug
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        crashes.append((f"the fuzzer's strategy raised {type(e).__name__}", tb, f"seed {seed}"))
    return counts, crashes, accepted


def _verify(data: Any, block: str, plugins: list[str]) -> tuple[bool, str]:
    """The whole sandbox (isolated) for one accepted candidate: (verified, what failed)."""
    sys.path.insert(0, str(ROOT))
    from coda.sandbox import SandboxOptions, evaluate
    from tests.adversarial.programs import BLOCK_FILE, BLOCKS

    shapes = [BLOCKS[block].shapes.cpu[0], BLOCKS[block].shapes.cpu[-1]]
    options = SandboxOptions(seeds=[0], dtypes=["float32"], shapes=shapes, plugins=plugins)
    report = evaluate(data, BLOCKS[block], options, block_file=BLOCK_FILE)
    return report.verified, "" if report.verified else f"{report.render_compact()}\n{data!r}"


def _report(counts: collections.Counter, crashes: list[tuple], seconds: float, top: int) -> None:
    total = sum(counts.values())
    by_status = collections.Counter()
    for (status, _stage, _reason), n in counts.items():
        by_status[status] += n
    print(f"cases: {total}  crashes: {len(crashes)}  time: {seconds:.0f} s")
    print("outcomes: " + ", ".join(f"{s} {n}" for s, n in by_status.most_common()))
    stages = collections.Counter()
    for (status, stage, _reason), n in counts.items():
        if status == "rejected":
            stages[stage] += n
    for stage, n in stages.most_common():
        print(f"\nrejected at {stage}: {n}")
        reasons = [(r, c) for (s, st, r), c in counts.items() if s == "rejected" and st == stage]
        for reason, c in sorted(reasons, key=lambda rc: -rc[1])[:top]:
            print(f"  {c:6d}  {reason}")
        if len(reasons) > top:
            print(f"  {'':6}  … {len(reasons) - top} more reasons")
    seen: set[str] = set()
    for reason, message, data in crashes:
        if reason in seen:
            continue
        seen.add(reason)
        print(f"\nCRASH ({reason}):\n{message}\ninput: {data}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=15, help="reasons listed per stage")
    parser.add_argument("--plugin", action="append", default=[], help="a plugin to load")
    parser.add_argument("--verify", type=int, default=0, help="accepted candidates to verify")
    args = parser.parse_args()
    # Generated kernel modules go to a private, throwaway cache.
    os.environ["CODA_CACHE_DIR"] = tempfile.mkdtemp(prefix="coda-fuzz-cache-")
    shares = [args.cases // args.jobs + (i < args.cases % args.jobs) for i in range(args.jobs)]
    start = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(args.jobs) as pool:
        keep = -(-args.verify // args.jobs)
        jobs = [(n, args.seed * 1000 + i, args.plugin, keep) for i, n in enumerate(shares) if n]
        results = pool.starmap(_job, jobs)
        counts: collections.Counter = collections.Counter()
        crashes: list[tuple] = []
        accepted: list[tuple] = []
        for job_counts, job_crashes, job_accepted in results:
            counts.update(job_counts)
            crashes += job_crashes
            accepted += job_accepted
        _report(counts, crashes, time.perf_counter() - start, args.top)
        if args.verify:
            todo = [(d, b, args.plugin) for d, b in accepted[: args.verify]]
            verdicts = pool.starmap(_verify, todo)
            failed = [why for ok, why in verdicts if not ok]
            print(
                f"\nverified {len(verdicts) - len(failed)} of {len(verdicts)} accepted candidates"
            )
            for why in failed:
                print(f"\nSUSPECT:\n{why[:3000]}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
