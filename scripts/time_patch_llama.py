"""Wall time of one ``patch_llama`` call on a 2-layer random ``LlamaForCausalLM`` (no downloads),
each in a fresh process (nothing cached: Programs, registered ops, imports), median of ``--runs``.

    python scripts/time_patch_llama.py [--runs 3] [--verify]

``--verify``: ``patch_llama(model, verify=True)`` (every Program verified in sandbox workers);
otherwise the default (the shipped verified Programs, hash-checked against the planner's)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

ONE_RUN = """
import time
from coda.export import patch_llama  # first: coda picks Triton's interpreter on a CPU
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
model = LlamaForCausalLM(cfg)
start = time.perf_counter()
patch_llama(model{options})
print(time.perf_counter() - start)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--verify", action="store_true")
    args = parser.parse_args()
    code = ONE_RUN.format(options=", verify=True" if args.verify else "")
    times = []
    for i in range(args.runs):
        out = subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True
        ).stdout
        times.append(float(out.strip().splitlines()[-1]))
        print(f"run {i + 1}: {times[-1]:.2f} s", flush=True)
    print(f"patch_llama: median {statistics.median(times):.2f} s of {args.runs} runs")


if __name__ == "__main__":
    main()
