"""Experiment: one LM-head loss chunk against several, in a whole training step.

``coda.export.lm_head_chunks.chunk_rows`` makes a batch whose logits are small (at most
``ONE_CHUNK_LOGITS`` elements: 2048 tokens of a 32000 vocabulary) one chunk, where it was
chunks of ``MIN_CHUNK_ROWS`` (1024) rows. Each chunk costs the host a Program call, a weight-
gradient product and a copy of its ``dx`` rows, and the GPU a pass over the ``[V, d]`` weight
gradient; one chunk holds the whole batch's logits (131 MB at 2048 × 32000 in bf16). At 2048
tokens the step is bound by the host's time to issue it (bench/RESULTS.md), so this compares, in
one process on one machine, a Llama training step (``train_step.py``'s ``coda_lm_head`` variant:
4 layers at Llama 3.2 1B widths, bf16, fused AdamW) with its loss in ``chunk_rows``'s chunks
(``default``) against the same step in chunks of ``--rows`` rows (``rows<N>``), beside eager
Hugging Face's step (``hf``) — each on its own copy of one random model:

* step ms: ``--runs`` interleaved comparisons (each the median of three rounds of 1 s of
  back-to-back steps per variant, ``train_step.py``'s timing), median and min–max, and the
  ratios within each comparison (to eager, and of the chunked step to the default), median and
  min–max: the host-bound step's time moves with the host between comparisons by more than the
  variants differ;
* host ms to issue one step, from an idle GPU and back to back (``train_step.host_ms``);
* the step's peak memory beyond weights and optimizer state (``train_step.step_memory_gb``);
* the first step's loss and gradient norm of each (a check that the variants compute the same).

Not part of the product: a measurement behind ``chunk_rows``'s rule.

    python3 bench/experiments/loss_chunks.py [--batch 1] [--rows 1024] [--runs 3] [--out DIR]
    python3 bench/experiments/loss_chunks.py --dry-run   # CPU, toy model: checks the script

Prints a Markdown table and writes ``loss_chunks-b<batch>.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train_step as ts  # noqa: E402  (bench/)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=1, help="sequences of --seq tokens")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4)")
    p.add_argument("--rows", type=int, default=1024, help="rows per chunk of the other variant")
    p.add_argument("--runs", type=int, default=3, help="interleaved comparisons")
    p.add_argument("--no-cudnn-attention", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy model: checks the script")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out")
    args = p.parse_args(argv)
    if args.rows < 1:
        p.error(f"--rows must be a positive number of rows, not {args.rows}")
    return args


def chunked_variants(rows: int) -> dict[str, int | None]:
    """The compared variants: eager Hugging Face (no chunk rows), the patched step with
    ``chunk_rows``'s chunks (None) and with chunks of ``rows`` rows."""
    return {"hf": None, "default": None, f"rows{rows}": rows}


def with_chunk_rows(model: Any, rows: int | None) -> None:
    """Build ``model``'s fused loss (as its first ``causal_lm_loss`` call would) and make it run
    ``rows`` rows per chunk (None: ``chunk_rows``)."""
    from coda.export.lm_head import _loss_module

    _loss_module(model, verify=False, tune="off").chunk_rows = rows


def summary(runs: list[dict[str, float]], name: str) -> dict[str, float]:
    """Median and min–max of ``name``'s ms over the interleaved runs."""
    values = [run[name] for run in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def table(rows: dict[str, dict[str, Any]], runs: list[dict[str, float]]) -> str:
    """Markdown: one row per variant — step ms (median, min–max), vs eager (the medians' ratio,
    then the median and spread of the ratios within each comparison: ``train_step.
    paired_ratios``), host ms from idle / back to back, chunks, peak step memory, first-step
    loss and gradient norm — and a last line: the chunked step's time over the default's within
    each comparison."""
    head = (
        "| variant | rows per chunk | step ms | vs eager: medians (paired) | host ms, from idle / "
        "back to back | step memory GB | loss | grad norm |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    hf = rows["hf"]["step_ms"]["median"]
    for name, r in rows.items():
        s = r["step_ms"]
        memory = "—" if r["memory_gb"] is None else f"{r['memory_gb']:.2f}"
        versus = f"{hf / s['median']:.3f}×"
        if name != "hf":
            versus += f" ({ts.ratio_spread(ts.paired_ratios(runs, 'hf', name))})"
        lines.append(
            f"| {name} | {r['chunk_rows'] or '—'} | {s['median']:.2f} ({s['min']:.2f}–"
            f"{s['max']:.2f}) | {versus} | {r['host_ms']:.2f} / "
            f"{r['host_ms_back_to_back']:.2f} | {memory} | {r['loss']:.5f} | {r['grad_norm']:.4f} |"
        )
    chunked = list(rows)[-1]
    lines.append(
        f"\n{chunked} / default within each comparison: "
        f"{ts.ratio_spread(ts.paired_ratios(runs, chunked, 'default'))}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = ts.start(args, "experiments/loss_chunks.py")
    if bench is None:
        return 2
    import torch

    from coda.export.lm_head_chunks import chunk_rows

    base = ts.base_model(args, bench)
    vocab, width = base.config.vocab_size, base.config.hidden_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=bench.device)
    tokens = ids.numel()
    steps, rows = {}, {}
    for name, chunk in chunked_variants(args.rows).items():
        variant = "hf" if name == "hf" else "coda_lm_head"
        model = ts.make_variant(variant, base, "bf16", bench)
        loss_fn = ts.loss_of(variant, bench)
        if variant != "hf":
            with_chunk_rows(model, chunk)
        first = ts.first_step(model, loss_fn, ids, "bf16", bench)
        memory = ts.step_memory_gb(model, loss_fn, ids, "bf16", bench)
        steps[name] = ts.train_step(model, loss_fn, ids, "bf16", bench)
        used = None if variant == "hf" else chunk or chunk_rows(tokens, vocab, width)
        rows[name] = {"chunk_rows": used, "memory_gb": memory, **first}
        print(f"{name}: rows per chunk {used}, {first}, step memory {memory} GB", flush=True)
    runs = [bench.compare(steps, rep_ms=ts.STEP_REP_MS) for _ in range(args.runs)]
    for name, step in steps.items():
        rows[name]["step_ms"] = summary(runs, name)
        rows[name]["host_ms"] = ts.host_ms(step, bench)
        rows[name]["host_ms_back_to_back"] = ts.host_ms(step, bench, back_to_back=True)
    text = table(rows, runs)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"loss_chunks-b{args.batch}")
    result = {"tokens": tokens, "vocab": vocab, "width": width, "runs": runs, "variants": rows}
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
