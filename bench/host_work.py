"""The Python side of a patched Llama training step, on the CPU, with every kernel launch
stubbed out: what ``coda.export``'s eager path costs the host apart from the launches themselves.

A training step on a small batch is host-bound (bench/RESULTS.md, runs 2026-12-01c and 2026-12-01d),
and most of what the patched model adds to eager Hugging Face's host work is Python — binding
arguments, planning and replaying runs, preparing weights, allocating, building launch arguments.
That part can be measured and profiled without a GPU: this script runs a random 4-layer
``LlamaForCausalLM`` at ``llama_train_step.py``'s toy widths (``patch_llama(fuse_gate_up=True)``
+ ``causal_lm_loss``, no tuning; ``coda_hf_residual``: also ``fuse_residual=False``) and the same
model unpatched, forward + backward on a few tokens, with ``launch_kernel`` replaced by a no-op
everywhere it is called (``primitives/launch.py`` and every module that imports it) — so the
numbers are the host's Python and PyTorch-on-CPU work, not Triton's launcher and not a GPU's.
Vendor GEMMs and PyTorch ops still run (on tiny CPU tensors). The outputs are garbage, nothing is
checked: it times, it does not verify. Garbage includes denormal floats (what ``torch.empty``
left in a stubbed kernel's output), on which the CPU's arithmetic takes a microcode slow path: a
``[32, 96]ᵀ @ [32, 48]`` product of the attention input's backward took 174 µs instead of 3 µs
(2026-12-01), at random, run to run. The timed steps therefore run with denormals flushed to zero
(``torch.set_flush_denormal``, undone after): numbers measured before that include such products.

    python3 bench/host_work.py [--layers 4] [--tokens 32] [--rounds 5] [--steps 40]
        [--threads 1] [--profile N] [--counts] [--out DIR]

Prints the minimum ms per step of each (minimum of ``--rounds`` rounds of ``--steps`` steps,
alternating), and with ``--profile N`` the patched step's N hottest functions by cumulative and
own time, and with ``--counts`` what one step of each asks of a GPU (``step_counts``: its
op calls, Triton launches, PyTorch ops that would run a kernel, allocations, views);
``host_work.json`` goes to ``--out``. Compare runs on one machine only. PyTorch's CPU ops run
on ``--threads`` intra-op threads (1 by default, restored after): the tensors are tiny, so more
threads only add their hand-offs, and on a CPU other processes share they wait for a core: on a
busy 2-core machine (2026-12-01, six runs) two threads gave Hugging Face's step
22–39 ms and the patched one 45–69 ms, one thread 5.8–8.0 and 5.4–9.7 ms.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import TOY, cprofile_report  # noqa: E402  (same folder)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (min taken)")
    p.add_argument("--steps", type=int, default=40, help="steps per round")
    p.add_argument("--threads", type=int, default=1, help="PyTorch intra-op threads")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile: N functions")
    p.add_argument(
        "--counts", action="store_true",
        help="also count what one step of each asks of a GPU (launches, kernel ops, allocations)",
    )  # fmt: skip
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    return p.parse_args(argv)


@contextmanager
def denormals_flushed() -> Any:
    """Denormal floats read and written as zero while the block runs (where the CPU can; restored
    to PyTorch's default after): arithmetic on the stubbed kernels' garbage outputs then costs
    what it costs on ordinary numbers."""
    import torch

    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


class StubbedLaunches:
    """How many kernel launches the stubs swallowed (``launches_stubbed``)."""

    def __init__(self) -> None:
        self.count = 0


@contextmanager
def launches_stubbed() -> Any:
    """``launch_kernel`` a no-op in ``coda.primitives.launch`` and every ``coda`` module that
    imported it by name, and so is a relaunch of a kernel that already ran (``launch._run``, what
    ``PinnedLaunch`` and ``launch_kernel``'s kept kernels call on a GPU) — restored on exit.
    Yields a ``StubbedLaunches`` counting the launches it swallowed."""
    from coda.primitives import launch

    stubbed = StubbedLaunches()

    def no_launch(kernel: Any, grid: Any, *args: Any, **meta: Any) -> None:
        stubbed.count += 1

    def no_relaunch(entry: Any, grid: Any, stream: int, args: list[Any]) -> Any:
        stubbed.count += 1
        return entry.compiled

    targets = [launch] + [
        m
        for name, m in sys.modules.items()
        if name.startswith("coda.") and getattr(m, "launch_kernel", None) is launch.launch_kernel
    ]
    real, relaunch = launch.launch_kernel, launch._run
    for module in targets:
        module.launch_kernel = no_launch
    launch._run = no_relaunch
    try:
        yield stubbed
    finally:
        for module in targets:
            module.launch_kernel = real
        launch._run = relaunch


def training_steps(layers: int, tokens: int) -> dict[str, Callable[[], None]]:
    """Forward + backward of Hugging Face's model and of its patched copy (same weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from coda.export import causal_lm_loss, patch_llama

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TOY, num_hidden_layers=layers))
    ids = torch.randint(0, TOY["vocab_size"], (1, tokens))

    def step(model: Any, loss: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            loss().backward()

        return run

    def patched(**options: Any) -> Callable[[], None]:
        model = copy.deepcopy(hf)
        patch_llama(model, verify=False, tune="off", fuse_gate_up=True, **options)
        return step(model, lambda: causal_lm_loss(model, ids, ids, verify=False, tune="off"))

    return {
        "hf": step(hf, lambda: hf(input_ids=ids, labels=ids).loss),
        "coda": patched(),
        "coda_hf_residual": patched(fuse_residual=False),
    }


def min_ms(steps: dict[str, Callable[[], None]], rounds: int, per_round: int) -> dict[str, float]:
    """The fastest ms per step of each, over alternating rounds (after two warm-up steps)."""
    for fn in steps.values():
        fn(), fn()
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, fn in steps.items():
            for _ in range(per_round):
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


# ops that only allocate (counted where they call no other aten op: ``empty_like`` counts once,
# as the ``empty_strided`` it calls)
ALLOCATIONS = frozenset(
    {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
     "aten::new_empty_strided", "aten::resize_"}
)  # fmt: skip
# ops whose schema shows no alias of an input that still run no kernel: they make a view or
# read or change only a tensor's metadata (counted with the views)
UNANNOTATED_VIEWS = frozenset(
    {"aten::_unsafe_view", "aten::_reshape_alias", "aten::result_type", "aten::detach_"}
)


def step_counts(step: Callable[[], None]) -> dict[str, int]:
    """What one call of ``step`` asks of a GPU, counted on the CPU with launches stubbed (it
    stubs them itself, to count them): coda-agent's op calls (its ``coda::`` op ranges), Triton
    kernel launches, PyTorch ops that would run a kernel, allocations and views. An ``aten`` op
    that neither only makes a view nor only allocates is a kernel op where no op it calls is one
    (``linear`` counts as the ``mm`` it calls; ``mm`` counts though it calls ``empty``).
    Each would-be kernel costs the host a launch on a GPU; a training step on a small batch is
    bound by them (bench/RESULTS.md)."""
    from torch.profiler import ProfilerActivity, profile

    with launches_stubbed() as stubbed, profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts = dict.fromkeys(("op_calls", "kernel_ops", "allocations", "views"), 0)
    for event in prof.events():
        if event.name.startswith("coda::"):
            counts["op_calls"] += 1
        kind = _kind(event.name)
        if kind == "kernel_ops" and _kernels_below(event):
            continue
        if kind in ("allocations", "views") and _aten_below(event):
            continue
        if kind is not None:
            counts[kind] += 1
    return {**counts, "triton_launches": stubbed.count}


@functools.cache
def _kind(name: str) -> str | None:
    """``"allocations"``, ``"views"`` or ``"kernel_ops"`` for an aten op's event name; None for
    any other event (kept per name: a step's events repeat a few hundred names, and
    ``_kernels_below`` asks again for every ancestor)."""
    if not name.startswith("aten::"):
        return None
    if name in ALLOCATIONS:
        return "allocations"
    return "views" if _is_view(name) else "kernel_ops"


def _kernels_below(event: Any) -> bool:
    """Whether an op ``event`` calls, directly or not, is a kernel op."""
    return any(_kind(c.name) == "kernel_ops" or _kernels_below(c) for c in event.cpu_children)


def _aten_below(event: Any) -> bool:
    return any(c.name.startswith("aten::") for c in event.cpu_children)


def _is_view(name: str) -> bool:
    """Whether aten op ``name`` (``aten::view``) runs no kernel: its schema returns an alias of an
    input that it does not write, or it is one of ``UNANNOTATED_VIEWS``."""
    import torch

    if name in UNANNOTATED_VIEWS:
        return True
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    if packet is None:
        return False
    for overload in packet.overloads():
        returns = getattr(packet, overload)._schema.returns
        if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return True
    return False


def profile(step: Callable[[], None], top: int, iters: int = 10) -> str:
    def steps() -> None:
        for _ in range(iters):
            step()

    return cprofile_report(steps, iters, top)


def counts_table(counts: dict[str, dict[str, int]]) -> str:
    """Markdown: one row per step, what one call of it asks of a GPU."""
    columns = ("op_calls", "triton_launches", "kernel_ops", "allocations", "views")
    head = "| step | " + " | ".join(c.replace("_", " ") for c in columns) + " |"
    rows = [
        f"| {name} | " + " | ".join(str(c[k]) for k in columns) + " |" for name, c in counts.items()
    ]
    return "\n".join([head, "|---|" + "---|" * len(columns), *rows])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    import coda.primitives  # noqa: F401  (its kernels run in the interpreter without a GPU)

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        steps = training_steps(args.layers, args.tokens)
        for fn in steps.values():  # one real step each: the fused loss proves the model's head
            fn()  # on its first call, which needs the kernels' real outputs
        with launches_stubbed(), denormals_flushed():
            ms = min_ms(steps, args.rounds, args.steps)
            report = profile(steps["coda"], args.profile) if args.profile else ""
        with denormals_flushed():
            counts = {name: step_counts(fn) for name, fn in steps.items()} if args.counts else {}
    finally:
        torch.set_num_threads(threads)
    result = {
        "layers": args.layers, "tokens": args.tokens, "threads": args.threads,
        "min_ms_per_step": ms, **({"per_step_counts": counts} if counts else {}),
    }  # fmt: skip
    each = ", ".join(f"{name} {t:.2f} ms" for name, t in ms.items())
    print(f"host work per step (CPU, launches stubbed): {each}")
    if counts:
        print(counts_table(counts))
    if report:
        print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_work.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
