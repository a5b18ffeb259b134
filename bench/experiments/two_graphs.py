"""Experiment: which captured training steps, held together in one process, make a later step
fault?

``llama_train_step.py`` processes that held two captured steps (``hf_graph`` and
``coda_lm_head_graph``) and then ran eager steps failed — an illegal memory access, or cuDNN's
``mha_graph.execute`` — in runs 2026-12-01d and 2026-12-01e (the second with cuDNN
attention off); every process holding one captured step ran clean. This script builds the steps of
``--variants`` (names as ``llama_train_step.py``'s; the same name may repeat, each a fresh copy of
the model), captures the ``_graph`` ones, then calls them in turn for ``--rounds`` rounds,
synchronizing after every call so the first faulting call is named (run it with
``CUDA_LAUNCH_BLOCKING=1`` to have the fault reported at its kernel). Found with it (run
2026-12-01e, bench/RESULTS.md): two captured *plain Hugging Face* steps faulted too — the
benchmark's replay did not keep its model alive, and the next capture's ``empty_cache()`` freed that
memory under the first graph. Fixed then in the benchmark's own replay; its ``_graph`` steps now
capture through ``coda.export.capture_train_step``, whose step holds the model and optimizer its
graph addresses. The script stays as the check.

    python3 bench/experiments/two_graphs.py --variants hf_graph,hf_graph,hf [--batch 1]
        [--no-cudnn-attention] [--rounds 20] [--out DIR]
    python3 bench/experiments/two_graphs.py --dry-run   # CPU, toy model, nothing captured

Prints one line per stage and writes ``two_graphs.json`` (stages done, the failing call and its
error) into ``--out``. Exit status 0 when every call ran, 1 when one failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_step import (  # noqa: E402  (bench/)
    base_model,
    loss_of,
    make_variant,
    split_variant,
    start,
    train_step,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="hf_graph,hf_graph,hf", help="comma-separated, may repeat")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=20, help="calls of every step, in turn")
    p.add_argument("--no-cudnn-attention", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy model: checks the script")
    args = p.parse_args(argv)
    for name in args.variants.split(","):
        if split_variant(name)[1] not in ("", "graph"):
            p.error(f"variant {name!r}: plain or _graph variants only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = start(args, "experiments/two_graphs.py")
    if bench is None:
        return 2
    import torch

    if args.dry_run:
        args.rounds = 2
    base = base_model(args, bench)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), device=bench.device)
    result: dict[str, Any] = {"variants": args.variants, "stages": []}

    def stage(text: str) -> None:
        print(text, flush=True)
        result["stages"].append(text)

    steps: list[tuple[str, Any]] = []
    failed = None
    try:
        for i, name in enumerate(args.variants.split(",")):
            model = make_variant(name, base, "bf16", bench)
            graph = split_variant(name)[1] == "graph"
            step = train_step(model, loss_of(name, bench), ids, "bf16", bench, graph=graph)
            bench.synchronize()
            steps.append((f"{i}:{name}", step))
            stage(f"built {i}:{name}" + (" (captured)" if graph and not args.dry_run else ""))
        for r in range(args.rounds):
            for label, step in steps:
                failed = f"round {r}, {label}"
                loss = float(step())  # synchronizes
                bench.synchronize()
            stage(f"round {r} ran (last loss {loss:.4f})")
        failed = None
    except Exception as e:  # noqa: BLE001 - the point is to report it
        failed = failed or f"building {len(steps)}:{args.variants.split(',')[len(steps)]}"
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
        stage(f"FAILED at {failed}: {result['error'][:300]}")
    result["failed_at"] = failed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "two_graphs.json").write_text(json.dumps(result, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
