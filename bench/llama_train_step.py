"""Benchmark whole training steps of a Hugging Face Llama model on a GPU: ``patch_llama`` (every
norm, attention input and MLP on CODA kernels) against the same model eager, under
``torch.compile``, and with Liger-Kernel's Llama patch when it is installed.

The model is a random ``LlamaForCausalLM`` (no downloads) of ``--layers`` layers at Llama 3.2 1B
widths (hidden 2048, intermediate 8192, 32 heads, 8 KV heads; vocabulary 32000 so the LM head does
not dominate), ``--batch`` × ``--seq`` tokens. One step is what a training loop does: zero the
gradients, forward with labels, backward, ``AdamW.step()`` (fused on a GPU). Two settings:

* ``bf16``: the model cast to bf16 (weights and residual stream);
* ``amp``: fp32 weights under ``torch.autocast(bf16)`` (Hugging Face Trainer's mixed precision).

Variants, each from the same initial weights: ``hf``, ``hf_compile`` (``torch.compile(model)``),
``coda_mlp`` (``patch_llama(attention=False, fuse_gate_up=True)``: the MLP half only), ``coda``
(``patch_llama``: norms, attention input and MLP), ``coda_fused``
(``patch_llama(fuse_gate_up=True)``), ``coda_lm_head`` (that, and the loss from
``causal_lm_loss``: final norm + LM head + cross-entropy fused; every ``coda`` variant adds the
MLP half's residual in its kernels), ``coda_lm_head_hf_residual`` (``coda_lm_head`` with
``fuse_residual=False``: Hugging Face's residual add), ``coda_lm_head_decide`` (the
same deciding every run anew — no run plans: the host's work as of run 2026-12-01c),
``coda_lm_head_ops`` (that, and every call through the registered custom ops and every launch
through Triton's own path: the host's work before run 2026-12-01c; both timed interleaved with
the rest), ``coda_compile`` (``torch.compile(model, fullgraph=True)`` of
``patch_llama(fuse_gate_up=True, fused_loss=True)``: ``coda_lm_head``'s kernels, the rest of the
step compiled around them, no graph break allowed) and ``liger``; and ``hf_graph``,
``coda_lm_head_graph``: those steps — forward, backward, ``AdamW.step()`` — captured once in one
CUDA graph and replayed (the remedy for a host-bound step: one launch per step, whatever Python
runs at capture; not run by default). Liger's step
cannot be captured (its fused linear cross-entropy calls
``.item()``), and a failed capture leaves the process's CUDA context broken, so ``liger_graph``
is not offered. Each variant's first loss and gradient
norm are checked against ``hf``'s (same setting) before timing; step times are medians of
interleaved rounds (``coda.primitives.timing``), also as tokens per second; step memory is what
one forward+backward allocates beyond the model, gradients and optimizer state (peak minus
allocated before, on a step after the first).

    python3 bench/llama_train_step.py [--out DIR] [--layers 4] [--batch 4] [--seq 2048]
        [--settings bf16,amp] [--variants hf,coda,...] [--profile K] [--sync-check]
        [--host] [--cprofile VARIANTS] [--compile-mode default|reduce-overhead]
    python3 bench/llama_train_step.py --dry-run   # CPU interpreter, toy model: checks the script

Writes ``llama_train_step.json`` and ``.md`` into ``--out`` (default ``$OUT``, else ``bench/out``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paper_kernels import NEEDS_GPU, Bench, environment  # noqa: E402  (same folder)
from profile_export import gpu_work  # noqa: E402

VARIANTS = (
    "hf", "hf_compile", "coda_mlp", "coda", "coda_fused", "coda_lm_head",
    "coda_lm_head_hf_residual", "coda_lm_head_decide", "coda_lm_head_ops", "coda_compile", "liger",
    "hf_graph", "coda_lm_head_graph",
)  # fmt: skip
# Variants that run a base variant's step another way: earlier host paths, or a CUDA graph.
STEP_MODES = ("_decide", "_ops", "_graph")


def split_variant(name: str) -> tuple[str, str]:
    """``(base variant, step mode)``: ``"coda_lm_head_graph"`` → ``("coda_lm_head", "graph")``."""
    for suffix in STEP_MODES:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix[1:]
    return name, ""


SETTINGS = ("bf16", "amp")
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
}
TOY = {
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "rms_norm_eps": 1e-5,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument(
        "--variants", default=",".join(v for v in VARIANTS if not v.endswith("_graph")),
        help="comma-separated (default: every variant but the _graph ones)",
    )  # fmt: skip
    p.add_argument("--settings", default=",".join(SETTINGS), help="bf16, amp")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy model: checks the script")
    p.add_argument(
        "--profile", type=int, default=0, metavar="K",
        help="also profile each variant's step (torch.profiler): its K longest GPU kernels",
    )  # fmt: skip
    p.add_argument(
        "--host", action="store_true",
        help="also measure each variant's host time per step: the wall time of step() from a "
        "synchronized GPU until it returns (no sync inside), against its GPU busy time",
    )  # fmt: skip
    p.add_argument(
        "--cprofile", default="", metavar="VARIANTS",
        help="comma-separated variants whose steps also run under cProfile (host hot spots, "
        "top functions into cprofile-<setting>-<variant>.txt)",
    )  # fmt: skip
    p.add_argument(
        "--sync-check", action="store_true",
        help="also run one step per variant under torch.cuda.set_sync_debug_mode('warn') and "
        "list where it synchronizes the host with the GPU",
    )  # fmt: skip
    p.add_argument(
        "--compile-mode", default="default", choices=["default", "reduce-overhead"],
        help="torch.compile's mode for hf_compile and coda_compile (reduce-overhead: CUDA "
        "graphs, the host's share removed; ignored on a dry run)",
    )  # fmt: skip
    p.add_argument(
        "--no-cudnn-attention", action="store_true",
        help="turn PyTorch's cuDNN attention backend off (SDPA then takes flash attention)",
    )  # fmt: skip
    return p.parse_args(argv)


def base_model(args: argparse.Namespace, bench: Bench) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    widths = TOY if bench.dry_run else LLAMA_1B
    config = LlamaConfig(**widths, num_hidden_layers=args.layers)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(bench.device)


def make_variant(
    name: str, base: Any, setting: str, bench: Bench, compile_mode: str = "default"
) -> Any | None:
    """A fresh copy of ``base`` set up as ``name`` (None when it cannot run here);
    ``compile_mode``: ``torch.compile``'s mode for the compiled variants (on a GPU)."""
    from coda.export import patch_llama

    name = split_variant(name)[0]
    model = copy.deepcopy(base)
    if setting == "bf16":
        model = model.to(bench.dtype)
    tune = "off" if bench.dry_run else "quick"
    if name.startswith("coda"):
        fuse = name in ("coda_mlp", "coda_fused", "coda_compile") or name.startswith("coda_lm_head")
        model = patch_llama(
            model, verify=False, tune=tune, fuse_gate_up=fuse, attention=name != "coda_mlp",
            fuse_residual=name != "coda_lm_head_hf_residual", fused_loss=name == "coda_compile",
        )  # fmt: skip
    if name == "liger":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError:
            return None
        from transformers.models.llama import modeling_llama

        apply = apply_liger_kernel_to_llama
        model = contained_module_patches(model, modeling_llama, lambda: apply(model=model))
    if name in ("hf_compile", "coda_compile"):
        import torch

        torch.compiler.reset()
        # coda_compile is the one-liner README documents: no graph break may hide in it
        how: dict[str, Any] = {"fullgraph": name == "coda_compile"}
        if bench.dry_run or compile_mode == "default":
            how["backend"] = bench.compile_backend
        else:
            how["mode"] = compile_mode
        model = torch.compile(model, **how)
    return model


def contained_module_patches(model: Any, module: Any, apply: Callable[[], None]) -> Any:
    """Run ``apply()`` (which patches ``model`` and may also reassign ``module``'s globals), undo
    its global reassignments, and have ``model``'s forward see them only while it runs.

    Liger's ``apply_liger_kernel_to_llama(model=m)`` also replaces ``modeling_llama``'s
    ``apply_rotary_pos_emb`` for every Llama in the process: the ``hf`` and ``hf_compile``
    variants, timed interleaved with ``liger``, ran Liger's RoPE kernel (``_triton_rope`` in their
    profiles) until this was contained (bench/RESULTS.md, run 2026-12-01a)."""
    before = dict(vars(module))
    apply()
    patched = {k: v for k, v in vars(module).items() if before.get(k, _MISSING) is not v}
    _assign_globals(module, {k: before.get(k, _MISSING) for k in patched})
    if not patched:
        return model
    forward = model.forward

    def forward_with_patches(*args: Any, **kwargs: Any) -> Any:
        current = {k: vars(module).get(k, _MISSING) for k in patched}
        _assign_globals(module, patched)
        try:
            return forward(*args, **kwargs)
        finally:
            _assign_globals(module, current)

    model.forward = forward_with_patches
    return model


_MISSING = object()


def _assign_globals(module: Any, values: dict[str, Any]) -> None:
    """Set each of ``module``'s globals to its value; ``_MISSING`` deletes it."""
    for k, v in values.items():
        if v is _MISSING:
            delattr(module, k)
        else:
            setattr(module, k, v)


def loss_of(name: str, bench: Bench) -> Callable[[Any, Any], Any]:
    """The variant's loss of a batch: Hugging Face's (``labels=``) or ``causal_lm_loss``."""
    if not split_variant(name)[0].startswith("coda_lm_head"):
        return lambda model, ids: model(input_ids=ids, labels=ids).loss
    from coda.export import causal_lm_loss

    tune = "off" if bench.dry_run else "quick"
    return lambda model, ids: causal_lm_loss(model, ids, ids, verify=False, tune=tune)


def train_step(
    model: Any, loss_fn: Callable, ids: Any, setting: str, bench: Bench, *, graph: bool = False
) -> Callable[[], Any]:
    """One optimizer step of ``model`` on ``ids``; returns the loss (detached). ``graph``: the
    step captured in a CUDA graph, each call a replay (the plain step on a dry run)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    graph = graph and not bench.dry_run
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=not bench.dry_run, capturable=graph)

    def step() -> Any:
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(model, loss_fn, ids, setting, bench)
        optimizer.step()
        return loss.detach()

    return captured(step, optimizer) if graph else step


def captured(step: Callable[[], Any], optimizer: Any) -> Callable[[], Any]:
    """``step`` captured in a CUDA graph after three warm-up steps on a side stream (tuning and
    run plans happen there, outside the capture); returns a replay that gives the loss. The
    gradients live in the graph's memory and are overwritten by each replay (PyTorch's
    whole-network capture recipe, with a capturable optimizer)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = step()
    return Replay(graph, loss, step, optimizer)


class Replay:
    """A captured step: each call replays ``graph`` and returns ``loss``. It holds ``step`` (and
    through it the model and the data) and ``optimizer``: the graph reads and writes their
    memory by address, so they must live as long as it does. (Before run 2026-12-01e it held
    only the graph: a variant's model was collected once the next variant was built, the
    next capture's ``empty_cache()`` returned its memory to the driver and the first graph's
    next replay faulted — bench/RESULTS.md.)"""

    def __init__(self, graph: Any, loss: Any, step: Callable[[], Any], optimizer: Any) -> None:
        self.graph, self.loss, self.step, self.optimizer = graph, loss, step, optimizer

    def __call__(self) -> Any:
        self.graph.replay()
        return self.loss


def with_host_paths(step: Callable[[], Any], *, ops: bool) -> Callable[[], Any]:
    """``step`` with no run plans (every ``CompiledProgram.run`` decides anew, as
    ``CODA_DECIDE_EVERY_RUN=1`` selects for a whole process) and, with ``ops``, every exported
    call through its registered custom op and every kernel launch through Triton's own path
    (``CODA_DISPATCH_OPS=1 CODA_TRITON_LAUNCH=1``): the earlier host paths, timed
    interleaved with today's in one process."""
    from coda.export import autograd
    from coda.primitives import launch, runtime

    def older_step() -> Any:
        saved = autograd.EAGER_CALLS, launch.DIRECT, runtime.REPLAY
        runtime.REPLAY = False
        if ops:
            autograd.EAGER_CALLS = launch.DIRECT = False
        try:
            return step()
        finally:
            autograd.EAGER_CALLS, launch.DIRECT, runtime.REPLAY = saved

    return older_step


def forward_backward(model: Any, loss_fn: Callable, ids: Any, setting: str, bench: Bench) -> Any:
    """The loss of ``ids`` (under autocast in the ``amp`` setting), backpropagated; returns it."""
    import torch

    dtype = torch.float16 if bench.dry_run else torch.bfloat16  # interpreter: no bf16 dot
    with torch.autocast(bench.device, dtype=dtype, enabled=setting == "amp"):
        loss = loss_fn(model, ids)
    loss.backward()
    return loss


def first_step(
    model: Any, loss_fn: Callable, ids: Any, setting: str, bench: Bench
) -> dict[str, float]:
    """Loss and global gradient norm of one forward+backward (no update)."""
    import torch

    model.zero_grad(set_to_none=True)
    loss = forward_backward(model, loss_fn, ids, setting, bench)
    grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return {"loss": float(loss.detach()), "grad_norm": float(torch.stack(grads).norm())}


def step_memory_gb(
    model: Any, loss_fn: Callable, ids: Any, setting: str, bench: Bench
) -> float | None:
    """GPU memory one forward+backward needs beyond what is already allocated (activations,
    logits, gradients, workspaces), in GB — measured on a step after the first, so compilation
    and tuning are not counted. None on a dry run."""
    if bench.dry_run:
        return None
    import torch

    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    forward_backward(model, loss_fn, ids, setting, bench)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    model.zero_grad(set_to_none=True)
    return (peak - before) / 1e9


def setting_rows(
    args: argparse.Namespace, setting: str, base: Any, ids: Any, bench: Bench
) -> list[dict[str, Any]]:
    rows, steps = [], {}
    reference: dict[str, float] | None = None
    for name in [v for v in args.variants.split(",") if v]:
        row: dict[str, Any] = {"setting": setting, "variant": name}
        try:
            model = make_variant(name, base, setting, bench, args.compile_mode)
            if model is None:
                rows.append({**row, "skipped": "not installed"})
                continue
            row |= first_step(model, loss_of(name, bench), ids, setting, bench)
            row["step_memory_gb"] = step_memory_gb(model, loss_of(name, bench), ids, setting, bench)
        except Exception as e:  # noqa: BLE001 - one variant failing must not hide the rest
            rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        reference = reference or {"loss": row["loss"], "grad_norm": row["grad_norm"]}
        # bf16 end to end: a different kernel schedule moves the loss in the 3rd digit at most
        tol = 2e-2 if setting == "bf16" and not bench.dry_run else 2e-3
        row["correct"] = all(
            abs(row[k] - reference[k]) <= tol * abs(reference[k]) for k in ("loss", "grad_norm")
        )
        mode = split_variant(name)[1]
        try:
            steps[name] = train_step(
                model, loss_of(name, bench), ids, setting, bench, graph=mode == "graph"
            )
        except Exception as e:  # noqa: BLE001 - e.g. a model that cannot be captured
            rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        if mode in ("ops", "decide"):
            steps[name] = with_host_paths(steps[name], ops=mode == "ops")
        rows.append(row)
    times = bench.compare(steps) if steps else {}
    for row in rows:
        if row["variant"] not in steps:
            continue
        if args.profile:
            kernels = profile_step(steps[row["variant"]], bench)
            row["gpu_busy_ms"] = sum(k["ms"] for k in kernels)  # all of the step's GPU work
            row["families"] = kernel_families(kernels)
            row["kernels"] = kernels[: args.profile]
        if args.host:
            row["host_ms"] = host_ms(steps[row["variant"]], bench)
        if row["variant"] in args.cprofile.split(","):
            name = f"cprofile-{setting}-{row['variant']}.txt"
            (Path(args.out) / name).write_text(host_profile(steps[row["variant"]], bench))
        if args.sync_check:
            row["syncs"] = host_syncs(steps[row["variant"]], bench)
    tokens = ids.numel()
    for row in rows:
        if row["variant"] in times:
            row["step_ms"] = times[row["variant"]]
            row["tokens_per_s"] = tokens / (row["step_ms"] * 1e-3)
    hf = next((r.get("step_ms") for r in rows if r["variant"] == "hf"), None)
    for row in rows:
        if hf and row.get("step_ms"):
            row["speedup_vs_hf"] = hf / row["step_ms"]
    return rows


def host_syncs(step: Callable[[], Any], bench: Bench) -> dict[str, int] | None:
    """Where one training step makes the host wait for the GPU (``.item()``, blocking copies
    such as a pageable host-to-device index, ``nonzero``…): ``"file:line": count`` from
    ``torch.cuda.set_sync_debug_mode("warn")``, after a warm-up step. A step that never
    synchronizes lets the host run ahead and hide its launch costs; None on a dry run."""
    if bench.dry_run:
        return None
    import warnings

    import torch

    step()
    torch.cuda.synchronize()
    counts: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{'/'.join(Path(w.filename).parts[-2:])}:{w.lineno}"  # package/file:line
            counts[where] = counts.get(where, 0) + 1
    return counts


def host_ms(step: Callable[[], Any], bench: Bench) -> float:
    """Median host milliseconds of one step: from a synchronized, idle GPU until ``step()``
    returns, without synchronizing inside (the time the host needs to issue the step's work).
    When it reaches the step's time the GPU waits on the host: the step is host-bound."""
    import statistics
    import time

    samples = []
    for _ in range(2 if bench.dry_run else 10):  # the interpreter is slow; a dry run checks code
        bench.synchronize()
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e3)
    bench.synchronize()
    return statistics.median(samples)


def host_profile(step: Callable[[], Any], bench: Bench, top: int = 60) -> str:
    """cProfile of a few steps (after one outside it): the ``top`` functions by cumulative and by
    own time."""
    iters = 1 if bench.dry_run else 5
    step()
    bench.synchronize()

    def steps() -> None:
        for _ in range(iters):
            step()
        bench.synchronize()

    return cprofile_report(steps, iters, top)


def cprofile_report(run: Callable[[], Any], steps: int, top: int = 60) -> str:
    """``run()`` (``steps`` training steps) under cProfile: the ``top`` functions by cumulative
    and by own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return f"profiled steps: {steps}\n" + text.getvalue()


def profile_step(step: Callable[[], Any], bench: Bench, iters: int = 3) -> list[dict[str, Any]]:
    """One training step's GPU work by kernel (ms per step, longest first), from ``iters``
    profiled steps; empty on a dry run (no CUDA events)."""
    if bench.dry_run:
        return []
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return gpu_work(prof.key_averages(), iters)


def sync_lines(rows: list[dict[str, Any]]) -> str:
    """Per variant checked with ``--sync-check``: where its step synchronizes, or that it
    does not."""
    lines = []
    for r in rows:
        if r.get("syncs") is None:
            continue
        where = ", ".join(f"{k} ×{n}" for k, n in sorted(r["syncs"].items())) or "none"
        lines.append(f"{r['setting']} {r['variant']}: host syncs per step: {where}")
    return "\n" + "\n".join(lines) if lines else ""


FAMILIES = (
    "CODA fused GEMMs", "cuBLAS GEMMs", "Liger Triton", "inductor Triton", "attention", "AdamW",
    "copies, cat, gather", "embedding backward", "CODA aux + prep", "other",
)  # fmt: skip
_CODA_FUSED = re.compile(r"^[a-z][a-z0-9_]*_kernel$")  # generated: "<step name>_kernel"


@functools.cache
def coda_small_kernels() -> frozenset[str]:
    """Names of the Triton kernels of CODA's aux and prep steps (rstd, combines, rope_rows, …),
    read from the primitives package so a new one is counted without a change here."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface  # compiled or interpreted kernels alike

    import coda.primitives.aux as aux
    import coda.primitives.prep as prep

    names = set()
    for package in (aux, prep):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            names |= {n for n, v in vars(module).items() if isinstance(v, KernelInterface)}
    return frozenset(names)


def kernel_family(name: str, coda_small: frozenset[str]) -> str:
    """Which family of ``FAMILIES`` a profiled GPU kernel belongs to, by its name."""
    low = name.lower()
    # first: flash and memory-efficient attention kernels are CUTLASS templates too
    if any(k in low for k in ("cudnn", "flash", "fmha", "sdpa", "attention")):
        return "attention"
    if low.startswith("nvjet") or any(k in low for k in ("cutlass", "splitkreduce", "xmma")):
        return "cuBLAS GEMMs"
    if name.startswith("triton_"):
        return "inductor Triton"
    if name in coda_small:
        return "CODA aux + prep"
    if name.startswith("_") or "liger" in low:
        return "Liger Triton"
    if _CODA_FUSED.match(name):
        return "CODA fused GEMMs"
    if "multi_tensor_apply" in low:
        return "AdamW"
    if any(k in low for k in ("scatter", "grad_weight", "radix", "unique", "segment", "scan")):
        return "embedding backward"
    if any(k in low for k in ("cat", "gather", "copy", "memcpy")):
        return "copies, cat, gather"
    return "other"


def kernel_families(kernels: list[dict[str, Any]]) -> dict[str, float]:
    """Milliseconds per step of each kernel family (every kernel of the step, not just the
    longest ones the table lists)."""
    small = coda_small_kernels()
    out = dict.fromkeys(FAMILIES, 0.0)
    for k in kernels:
        out[kernel_family(k["kernel"], small)] += k["ms"]
    return out


def family_table(rows: list[dict[str, Any]]) -> str:
    """Where each profiled step's GPU time goes, by kernel family."""
    profiled = [r for r in rows if r.get("families")]
    if not profiled:
        return ""
    used = [f for f in FAMILIES if any(r["families"][f] for r in profiled)]
    lines = [
        "\n\nGPU time per step by kernel family (ms):\n",
        "| setting | variant | step | GPU busy | " + " | ".join(used) + " |",
        "|---|---|---|---|" + "---|" * len(used),
    ]
    for r in profiled:
        cells = [f"{r['families'][f]:.2f}" if r["families"][f] else "–" for f in used]
        step = f"{r['step_ms']:.2f}" if r.get("step_ms") else "—"
        lines.append(
            f"| {r['setting']} | {r['variant']} | {step} | {r['gpu_busy_ms']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def kernel_tables(rows: list[dict[str, Any]]) -> str:
    """Per profiled variant: its step's longest kernels and their share of the step."""
    parts = []
    for r in rows:
        if not r.get("kernels"):
            continue
        busy, step_ms = sum(k["ms"] for k in r["kernels"]), r.get("step_ms", float("nan"))
        lines = [
            f"\n{r['setting']} {r['variant']}: the {len(r['kernels'])} longest kernels "
            f"({busy:.2f} ms of GPU time in these, {r['gpu_busy_ms']:.2f} ms in all; the step "
            f"takes {step_ms:.2f} ms)",
            "| kernel | calls | ms |",
            "|---|---|---|",
        ]
        lines += [f"| {k['kernel'][:100]} | {k['calls']} | {k['ms']:.3f} |" for k in r["kernels"]]
        parts.append("\n".join(lines))
    return "\n".join(parts)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | variant | correct | loss | grad norm | step ms | tokens/s | vs hf eager "
        "| step memory GB | host ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = r.get("error") or r["skipped"]
            lines.append(f"| {r['setting']} | {r['variant']} | {why[:90]} ||||||||")
            continue
        ms, speed, mem = r.get("step_ms"), r.get("speedup_vs_hf"), r.get("step_memory_gb")
        versus = "—" if speed is None else f"{speed:.3f}×"  # no hf row: nothing to compare
        timing = f"{ms:.2f} | {r['tokens_per_s']:,.0f} | {versus}" if ms else "— | — | —"
        lines.append(
            f"| {r['setting']} | {r['variant']} | {r['correct']} | {r['loss']:.4f} | "
            f"{r['grad_norm']:.4f} | {timing} | {'not measured' if mem is None else f'{mem:.2f}'} "
            f"| {f'{host:.2f}' if (host := r.get('host_ms')) is not None else '—'} |"
        )
    return "\n".join(lines)


def start(args: argparse.Namespace, script: str) -> Bench | None:
    """The run's ``Bench``, or None after saying why (no GPU and no ``--dry-run``); applies
    ``--no-cudnn-attention`` and shrinks a dry run's model (``args.layers``, ``batch``, ``seq``)."""
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(NEEDS_GPU.replace("paper_kernels.py", script), file=sys.stderr)
        return None
    import coda.primitives  # noqa: F401  (its kernels run in the interpreter without a GPU)

    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.dry_run:
        args.layers, args.batch, args.seq = min(args.layers, 2), 2, 9
    return Bench(args.dry_run)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = start(args, "llama_train_step.py")
    if bench is None:
        return 2
    import torch

    env = environment(bench, argv)
    print(f"Llama training steps on {env['device']}", flush=True)
    base = base_model(args, bench)
    vocab = base.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=bench.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = {"layers": args.layers, "batch": args.batch, "seq": args.seq, **base.config.to_dict()}
    result: dict[str, Any] = {"environment": env, "model": shape, "rows": []}
    for setting in [s for s in args.settings.split(",") if s]:
        print(f"  {setting} ...", flush=True)
        result["rows"] += setting_rows(args, setting, base, ids, bench)
        bench.free()
        (out / "llama_train_step.json").write_text(json.dumps(result, indent=2, default=str))
    rows = result["rows"]
    text = table(rows) + family_table(rows) + kernel_tables(rows) + sync_lines(rows)
    note = "\n\nDRY RUN on a CPU: not measurements.\n" if bench.dry_run else "\n"
    (out / "llama_train_step.md").write_text(
        f"# Llama training steps ({env['date']})\n\n{text}{note}"
    )
    print(text + note, flush=True)
    failed = [r for r in result["rows"] if "error" in r or r.get("correct") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
