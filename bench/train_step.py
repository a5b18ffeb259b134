"""Benchmark whole training steps of a Hugging Face causal LM of any supported family on a GPU:
the model patched onto CODA kernels (``patch_llama`` for Llama, ``patch_model`` for the others)
against the same model eager, under ``torch.compile``, and with Liger-Kernel's patch for the
family when it is installed.

``--family`` (comma-separated, or ``all``) picks the families: ``llama``, ``mistral``, ``qwen2``,
``qwen3``, ``gemma``, ``gemma2``, ``gemma3``, ``phi3``, ``olmo2``. Each model is its family's
``*ForCausalLM`` built from a random config (no downloads) of ``--layers`` decoder layers (default
4; 2 for Mistral) at the widths of a real small model of the family, from that model's
``config.json`` on the Hugging Face Hub (RoPE bases and context lengths left at the library's
defaults: they do not change a step's work):

* ``llama``: Llama 3.2 1B (``meta-llama/Llama-3.2-1B``): hidden 2048, intermediate 8192, 32
  heads, 8 KV heads; vocabulary 32000 instead of 128256, so that the LM head does not dominate and
  the numbers stay comparable with the earlier runs in bench/RESULTS.md;
* ``mistral``: Mistral 7B v0.3 (``mistralai/Mistral-7B-v0.3``): hidden 4096, intermediate 14336,
  32 heads, 8 KV heads, vocabulary 32768, no sliding window;
* ``qwen2``: Qwen2.5 1.5B (``Qwen/Qwen2.5-1.5B``): hidden 1536, intermediate 8960, 12 heads,
  2 KV heads, vocabulary 151936, tied embeddings, Q/K/V biases;
* ``qwen3``: Qwen3 1.7B (``Qwen/Qwen3-1.7B``): hidden 2048, intermediate 6144, 16 heads, 8 KV
  heads, head_dim 128, vocabulary 151936, tied embeddings, per-head q/k norms;
* ``gemma``: Gemma 2B (``google/gemma-2b``): hidden 2048, intermediate 16384, 8 heads, 1 KV
  head, head_dim 256, vocabulary 256000, GeGLU, tied embeddings;
* ``gemma2``: Gemma 2 2B (``google/gemma-2-2b``): hidden 2304, intermediate 9216, 8 heads, 4 KV
  heads, head_dim 256, vocabulary 256000, query_pre_attn_scalar 256, attention logits capped at
  50 and final logits at 30, sliding window 4096 on every other layer;
* ``gemma3``: Gemma 3 1B (``google/gemma-3-1b-pt``, ``Gemma3ForCausalLM``): hidden 1152,
  intermediate 6912, 4 heads, 1 KV head, head_dim 256, vocabulary 262144, query_pre_attn_scalar
  256, sliding window 512 (five sliding layers to one global: at 4 layers all slide), q/k norms;
* ``phi3``: Phi-3 mini 4k (``microsoft/Phi-3-mini-4k-instruct``): hidden 3072, intermediate
  8192, 32 heads, 32 KV heads, vocabulary 32064, fused ``qkv_proj`` and ``gate_up_proj``, sliding
  window 2047;
* ``olmo2``: OLMo 2 1B (``allenai/OLMo-2-0425-1B``): hidden 2048, intermediate 8192, 16 heads,
  16 KV heads, vocabulary 100352, post-norms and q/k norms.

``--vocab`` overrides the vocabulary. ``--batch`` × ``--seq`` tokens. One step is what a training
loop does: zero the gradients, forward with labels, backward, ``AdamW.step()`` (fused on a GPU).
Two settings:

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
the rest), ``coda_lm_head_triton`` (``coda_lm_head`` tuned, checked and timed with every
program's fused steps on the Triton backend — ``coda.primitives.runtime.BACKEND`` switched around
its calls —: under ``CODA_EPILOGUE_BACKEND=auto``, the two backends timed interleaved in one
process, where two processes met hosts that moved between them; not run by default),
``coda_compile`` (``torch.compile(model, fullgraph=True)`` of
``patch_llama(fuse_gate_up=True, fused_loss=True)``: ``coda_lm_head``'s kernels, the rest of the
step compiled around them, no graph break allowed) and ``liger``; and ``hf_graph``,
``coda_graph``, ``coda_lm_head_graph``: the ``hf``, ``coda`` and ``coda_lm_head`` steps captured
in one CUDA graph by ``coda.export.capture_train_step`` and replayed — the package's one-line
remedy for a host-bound step, measured as a user runs it: ``AdamW(lr=torch.tensor(1e-5,
device="cuda"), fused=True, capturable=True)``, the batch ``{"input_ids": ids, "labels":
ids}``, the helper's default loss ``model(**batch).loss`` where the variant's loss is Hugging
Face's in bf16 (else the variant's loss, under autocast in ``amp``), its three warm-up steps
and the capture done before timing, so each timed call is a replay with the helper's per-call
checks. Every family has them (not run by default). On a dry run the helper refuses the CPU
model, so those rows time the plain step and say so (``graph``: what was captured, or why
not). Liger's step cannot be captured (its fused linear cross-entropy calls ``.item()``), and a
failed capture leaves the process's CUDA context broken, so ``liger_graph`` is not offered.

For the other families the ``coda`` variants are the same with ``patch_model`` (same options;
``coda_lm_head`` and ``coda_compile`` with ``fused_loss=True``, which makes the model's own
``forward(labels=...)`` compute the fused loss), and ``liger`` is the family's
``apply_liger_kernel_to_<family>`` (``gemma3``: ``…_gemma3_text``) on the model instance with
RoPE, RMSNorm, SwiGLU or GeGLU and the fused linear cross-entropy on. A variant that means
nothing for a family is skipped with the reason: ``patch_model``'s report keeps what it
distinguishes (``coda_mlp`` with the MLP half kept; ``coda_lm_head*`` and ``coda_compile`` with
the LM-head loss kept; ``coda``/``coda_fused`` with neither the attention input nor the MLP half
patched), ``coda_lm_head_hf_residual`` where the layer class already adds the residual as Hugging
Face does, ``liger`` without Liger-Kernel or on a dry run (its kernels need a GPU). Each row
carries ``patch_model``'s report (``patched``: per module kind, patched or kept and why).
``--variants default`` runs every variant but the captured ones for Llama, and ``hf``,
``hf_compile``, ``coda``, ``coda_lm_head``, ``coda_compile``, ``liger`` for the others: every
variant holds its model, gradients and AdamW state through the interleaved timing, 14 GB each
for Gemma 2's 256k vocabulary in fp32 weights (``amp``).

Each variant's first loss and gradient norm are checked against ``hf``'s (same setting) before
timing; step times are medians of interleaved rounds (``coda.primitives.timing``), each round
timing a variant over ``STEP_REP_MS`` of back-to-back steps (a host-bound step varies with the
host's scheduling: a 100 ms window holds five steps at 2048 tokens), the comparison repeated
``--runs`` times in the process: a row's step time is the median over runs, with the spread
(min–max) and every run's time in the JSON, also as tokens per second; step memory is what one
forward+backward allocates beyond the model, gradients and optimizer state (peak minus allocated
before, on a step after the first). ``--gaps N`` profiles one step per
variant with CPU and CUDA activities and says where the GPU waits: the step's wall time, GPU busy
and idle time, the idle time that follows a host synchronization, and the N largest idle gaps,
each with the CPU op running when it happened (``--gaps-stacks``: and the Python function, at
the cost of a slower host; ``--trace``: also a gzip'd Chrome trace per variant).
``--memory-peak N`` records the CUDA caching allocator's history over one forward+backward per
variant and lists the N largest groups of memory live at the step's peak, by the code that
allocated them (the innermost frames in coda, transformers, Liger-Kernel or this script).
``--host`` times the host's part of a step, from an idle GPU (``host_ms``) and back to back
(``host_ms_back_to_back``: each step issued while the GPU runs the one before, as in the timing
loop; longer than from idle where the host waits for the GPU); ``--host-split`` also times each
``coda`` variant's host with every Triton launch a no-op, which separates the launch path's share
from the rest of the patched step's Python and PyTorch work.

    python3 bench/train_step.py [--family llama|qwen3,gemma2|all] [--out DIR] [--layers N]
        [--vocab V] [--batch 4] [--seq 2048] [--settings bf16,amp] [--variants hf,coda,…|default]
        [--runs 3] [--gaps [N]] [--gaps-stacks] [--trace] [--profile K] [--sync-check] [--host]
        [--host-split] [--memory-peak [N]]
        [--cprofile VARIANTS] [--compile-mode default|reduce-overhead]
    python3 bench/train_step.py --dry-run --family all  # CPU interpreter, toy models

``bench/llama_train_step.py`` is the same script (``--family llama``, its default). Writes
``<family>_train_step.json`` and ``.md`` into ``--out`` (default ``$OUT``, else ``bench/out``),
and with more than one family ``train_step_families.md``: every family's step times side by side.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gzip
import inspect
import json
import os
import re
import shutil
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paper_kernels import NEEDS_GPU, Bench, environment  # noqa: E402  (same folder)
from profile_export import gpu_work  # noqa: E402

VARIANTS = (
    "hf", "hf_compile", "coda_mlp", "coda", "coda_fused", "coda_lm_head",
    "coda_lm_head_hf_residual", "coda_lm_head_decide", "coda_lm_head_ops", "coda_lm_head_triton",
    "coda_compile", "liger", "hf_graph", "coda_graph", "coda_lm_head_graph",
)  # fmt: skip
# Variants that run a base variant's step another way: earlier host paths, one epilogue backend,
# or a CUDA graph.
STEP_MODES = ("_decide", "_ops", "_triton", "_graph")


# The default variants: Llama's are every variant but the captured and one-backend ones (its
# earlier runs in bench/RESULTS.md compare them); the other families' leave out the host-path
# and residual variants, whose history is Llama's, and coda_mlp and coda_fused: each variant
# holds a model, gradients and AdamW state through the interleaved timing, and at a 256k
# vocabulary in fp32 (amp) that is 14 GB each.
LLAMA_VARIANTS = tuple(v for v in VARIANTS if not v.endswith(("_graph", "_triton")))
OTHER_FAMILIES_VARIANTS = ("hf", "hf_compile", "coda", "coda_lm_head", "coda_compile", "liger")


def family_variants(variants: str, family: str) -> list[str]:
    """``--variants`` for ``family``: its names, or with ``default`` the family's defaults."""
    if variants == "default":
        return list(LLAMA_VARIANTS if family == "llama" else OTHER_FAMILIES_VARIANTS)
    return [v for v in variants.split(",") if v]


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
# A dry run's extras per family: small heads where the real ones set head_dim, a sliding window
# shorter than the dry run's 9 tokens, token ids inside the toy vocabulary.
_TOY_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_TOY_HEADS = {"head_dim": 16}
_TOY_GEMMA2 = {**_TOY_HEADS, "query_pre_attn_scalar": 16, "sliding_window": 4}


class Family(NamedTuple):
    """A model family the benchmark builds: its transformers config and model classes, its
    modeling module (where Liger's patch reassigns globals), Liger's function for it and whether
    its MLP is gated by GELU (Liger's ``geglu``) or SiLU (``swiglu``), its real widths, the
    toy widths of a dry run, and its default number of decoder layers."""

    config: str
    model: str
    modeling: str
    liger: str
    widths: dict[str, Any]
    toy: dict[str, Any] = {}  # noqa: RUF012  (a NamedTuple's default: never mutated)
    layers: int = 4
    geglu: bool = False


MODELS = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", "llama", "llama", LLAMA_1B),
    "mistral": Family(
        "MistralConfig", "MistralForCausalLM", "mistral", "mistral",
        {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
         "num_key_value_heads": 8, "vocab_size": 32768, "rms_norm_eps": 1e-5,
         "sliding_window": None},
        layers=2,
    ),
    "qwen2": Family(
        "Qwen2Config", "Qwen2ForCausalLM", "qwen2", "qwen2",
        {"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
         "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": True},
    ),
    "qwen3": Family(
        "Qwen3Config", "Qwen3ForCausalLM", "qwen3", "qwen3",
        {"hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": True},
        _TOY_HEADS,
    ),
    "gemma": Family(
        "GemmaConfig", "GemmaForCausalLM", "gemma", "gemma",
        {"hidden_size": 2048, "intermediate_size": 16384, "num_attention_heads": 8,
         "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 256000, "rms_norm_eps": 1e-6},
        _TOY_HEADS, geglu=True,
    ),
    "gemma2": Family(
        "Gemma2Config", "Gemma2ForCausalLM", "gemma2", "gemma2",
        {"hidden_size": 2304, "intermediate_size": 9216, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000, "rms_norm_eps": 1e-6,
         "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
         "final_logit_softcapping": 30.0, "sliding_window": 4096},
        _TOY_GEMMA2, geglu=True,
    ),
    "gemma3": Family(
        "Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3", "gemma3_text",
        {"hidden_size": 1152, "intermediate_size": 6912, "num_attention_heads": 4,
         "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "rms_norm_eps": 1e-6,
         "query_pre_attn_scalar": 256, "sliding_window": 512},
        _TOY_GEMMA2, geglu=True,
    ),
    "phi3": Family(
        "Phi3Config", "Phi3ForCausalLM", "phi3", "phi3",
        {"hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
         "num_key_value_heads": 32, "vocab_size": 32064, "rms_norm_eps": 1e-5,
         "sliding_window": 2047},
    ),
    "olmo2": Family(
        "Olmo2Config", "Olmo2ForCausalLM", "olmo2", "olmo2",
        {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
         "num_key_value_heads": 16, "vocab_size": 100352, "rms_norm_eps": 1e-6},
    ),
}  # fmt: skip


def parse_families(text: str) -> list[str]:
    """``--family``'s names in order (``all``: every family of ``MODELS``); ``ValueError``
    naming an unknown one."""
    names = list(MODELS) if text == "all" else [f for f in text.split(",") if f]
    unknown = [f for f in names if f not in MODELS]
    if unknown or not names:
        raise ValueError(
            f"--family {text!r}: unknown {', '.join(unknown) or 'empty list'}; give "
            f"comma-separated names of {', '.join(MODELS)}, or all"
        )
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out", help="results folder")
    p.add_argument(
        "--family", default="llama",
        help=f"comma-separated model families ({', '.join(MODELS)}) or all; default llama",
    )  # fmt: skip
    p.add_argument(
        "--layers", type=int, default=None,
        help="decoder layers (default: 4, Mistral 2)",
    )  # fmt: skip
    p.add_argument(
        "--vocab", type=int, default=None, help="vocabulary size (default: the family's)"
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument(
        "--variants", default="default",
        help="comma-separated, or default: for Llama every variant but the _graph ones; for "
        f"the other families {','.join(OTHER_FAMILIES_VARIANTS)}",
    )  # fmt: skip
    p.add_argument("--settings", default=",".join(SETTINGS), help="bf16, amp")
    p.add_argument(
        "--runs", type=int, default=None,
        help="repeat the interleaved comparison this many times in the process: step times are "
        "medians over runs, with their spread (default 3; a dry run: 1, at most 2)",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="CPU, toy model: checks the script")
    p.add_argument(
        "--profile", type=int, default=0, metavar="K",
        help="also profile each variant's step (torch.profiler): its K longest GPU kernels",
    )  # fmt: skip
    p.add_argument(
        "--gaps", type=int, nargs="?", const=10, default=0, metavar="N",
        help="also profile one step per variant with CPU and CUDA activities: GPU busy and idle "
        "time in the step, and its N (default 10) largest idle gaps with the CPU op running then",
    )  # fmt: skip
    p.add_argument(
        "--gaps-stacks", action="store_true",
        help="with --gaps: also record Python function calls, so each gap names the innermost "
        "Python function too (the tracing slows the host: its gaps grow)",
    )  # fmt: skip
    p.add_argument(
        "--trace", action="store_true",
        help="with --gaps: also write each profiled step's Chrome trace "
        "(trace-<family>-<setting>-<variant>.json.gz)",
    )  # fmt: skip
    p.add_argument(
        "--memory-peak", type=int, nargs="?", const=12, default=0, metavar="N",
        help="also record the CUDA caching allocator's history over one forward+backward per "
        "variant and list the N (default 12) largest groups of memory live at the step's peak, "
        "by the code that allocated them",
    )  # fmt: skip
    p.add_argument(
        "--host", action="store_true",
        help="also measure each variant's host time per step: the wall time of step() from a "
        "synchronized GPU until it returns (no sync inside), against its GPU busy time",
    )  # fmt: skip
    p.add_argument(
        "--host-split", action="store_true",
        help="with --host: each coda variant's host time again with every Triton launch a no-op "
        "(bench/host_work.py's launches_stubbed): the difference is the launch path's share. "
        "Measured last: the stubbed steps leave that variant's weights garbage",
    )  # fmt: skip
    p.add_argument(
        "--cprofile", default="", metavar="VARIANTS",
        help="comma-separated variants whose steps also run under cProfile (host hot spots, "
        "top functions into cprofile-<setting>-<variant>.txt; other families than llama: "
        "cprofile-<family>-<setting>-<variant>.txt)",
    )  # fmt: skip
    p.add_argument(
        "--sync-check", action="store_true",
        help="also run one step per variant under torch.cuda.set_sync_debug_mode('warn') "
        "(coda.export.train_step.watching_syncs) and list where it synchronizes the host with "
        "the GPU",
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
    args = p.parse_args(argv)
    try:
        parse_families(args.family)
    except ValueError as e:
        p.error(str(e))
    unknown = [v for v in args.variants.split(",") if v and v not in (*VARIANTS, "default")]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if args.runs is not None and args.runs < 1:
        p.error(f"--runs {args.runs}: at least 1")
    return args


def base_model(args: argparse.Namespace, bench: Bench, family: str = "llama") -> Any:
    """A random ``family`` model (``MODELS``) on the run's device: the family's real widths, or
    its toy widths on a dry run; ``args.layers`` layers (None: the family's default) and
    ``args.vocab`` (if given) as its vocabulary."""
    import torch
    import transformers

    spec = MODELS[family]
    widths = {**TOY, **_TOY_IDS, **spec.toy} if bench.dry_run else dict(spec.widths)
    if getattr(args, "vocab", None):
        widths["vocab_size"] = args.vocab
    layers = args.layers or spec.layers
    if bench.dry_run:
        layers = min(layers, 2)
    config = getattr(transformers, spec.config)(**widths, num_hidden_layers=layers)
    torch.manual_seed(0)
    return getattr(transformers, spec.model)(config).to(bench.device)


class Skipped(Exception):
    """A variant that does not apply to the family (or cannot run here): the reason."""


def make_variant(
    name: str,
    base: Any,
    setting: str,
    bench: Bench,
    compile_mode: str = "default",
    family: str = "llama",
    notes: dict[str, Any] | None = None,
) -> Any:
    """A fresh copy of ``base`` set up as ``name``; ``Skipped`` (with the reason) when the
    variant does not apply to ``family`` or cannot run here. ``compile_mode``:
    ``torch.compile``'s mode for the compiled variants (on a GPU). ``notes`` receives
    ``patch_model``'s report of a ``coda`` variant (``"patched"``: kind → line)."""
    name = split_variant(name)[0]
    model = copy.deepcopy(base)
    if setting == "bf16":
        model = model.to(bench.dtype)
    tune = "off" if bench.dry_run else "quick"
    if name.startswith("coda"):
        fuse = name in ("coda_mlp", "coda_fused", "coda_compile") or name.startswith("coda_lm_head")
        options = {
            "verify": False, "tune": tune, "fuse_gate_up": fuse, "attention": name != "coda_mlp",
            "fuse_residual": name != "coda_lm_head_hf_residual",
        }  # fmt: skip
        if family == "llama":
            from coda.export import patch_llama

            model = patch_llama(model, **options, fused_loss=name == "coda_compile")
        else:
            model = patched_model(name, model, options, notes)
    if name == "liger":
        model = liger_model(model, family, bench)
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


def patched_model(
    name: str, model: Any, options: dict[str, Any], notes: dict[str, Any] | None
) -> Any:
    """``model`` (not a Llama) patched by ``patch_model`` as the ``coda`` variant ``name`` asks
    (``coda_lm_head*``, ``coda_compile``: with the fused loss in its forward); ``Skipped``
    when the report keeps what the variant is about."""
    from coda.export import patch_model
    from coda.export.families import decoder_layers

    if name == "coda_lm_head_hf_residual":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        kinds = sorted({type(layer).__name__ for layer in decoder_layers(model)})
        if not any(type(layer) is LlamaDecoderLayer for layer in decoder_layers(model)):
            raise Skipped(
                f"{'/'.join(kinds)} adds the MLP half's residual as Hugging Face's in every coda "
                "variant (patch_model fuses it into the kernels of LlamaDecoderLayer only): "
                "nothing to compare with coda_lm_head"
            )
    fused_loss = name.startswith("coda_lm_head") or name == "coda_compile"
    report = patch_model(model, **options, fused_loss=fused_loss)
    if notes is not None:
        notes["patched"] = dict(report.lines)
    reason = coda_skip_reason(name, report.lines)
    if reason:
        raise Skipped(reason)
    return model


def coda_skip_reason(name: str, lines: dict[str, str]) -> str | None:
    """Why the ``coda`` variant ``name`` measures nothing of its own on a model whose
    ``patch_model`` report has these ``lines`` (None: it does)."""
    from coda.export.families import ATTENTION_INPUT, LM_HEAD_LOSS, MLP_HALF

    def kept(kind: str) -> str | None:
        line = lines.get(kind, "")
        return None if line.startswith("patched") else f"{kind} {line}"

    if name == "coda_mlp":
        return kept(MLP_HALF)
    if name.startswith("coda_lm_head") or name == "coda_compile":
        return kept(LM_HEAD_LOSS)
    reasons = [r for r in (kept(ATTENTION_INPUT), kept(MLP_HALF)) if r]
    return "; ".join(reasons) if len(reasons) == 2 else None  # neither patched: plain hf


def liger_model(model: Any, family: str, bench: Bench) -> Any:
    """``model`` with Liger-Kernel's patch for ``family`` (RoPE, RMSNorm, SwiGLU or GeGLU, fused
    linear cross-entropy), its module-global replacements contained to this model's forward;
    ``Skipped`` without Liger-Kernel, without the family's function, or on a dry run."""
    if bench.dry_run:
        raise Skipped("Liger-Kernel's Triton kernels need a GPU (dry run)")
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        raise Skipped("liger_kernel is not installed") from None
    import importlib

    spec = MODELS[family]
    apply = getattr(liger, f"apply_liger_kernel_to_{spec.liger}", None)
    if apply is None:
        raise Skipped(f"liger_kernel has no apply_liger_kernel_to_{spec.liger}")
    wanted = {
        "rope": True, "rms_norm": True, "fused_linear_cross_entropy": True,
        "cross_entropy": False, ("geglu" if spec.geglu else "swiglu"): True,
    }  # fmt: skip
    accepted = inspect.signature(apply).parameters
    missing = sorted(k for k, on in wanted.items() if on and k not in accepted)
    if missing:
        raise Skipped(f"apply_liger_kernel_to_{spec.liger} has no {', '.join(missing)} switch")
    kwargs = {k: v for k, v in wanted.items() if k in accepted}
    module = importlib.import_module(
        f"transformers.models.{spec.modeling}.modeling_{spec.modeling}"
    )
    return contained_module_patches(model, module, lambda: apply(**kwargs, model=model))


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


def loss_of(name: str, bench: Bench, family: str = "llama") -> Callable[[Any, Any], Any]:
    """The variant's loss of a batch: Hugging Face's (``labels=``), or ``causal_lm_loss`` for a
    Llama's ``coda_lm_head`` variants (the other families' patched forward computes the fused
    loss itself)."""
    if family != "llama" or not split_variant(name)[0].startswith("coda_lm_head"):
        return hf_loss
    from coda.export import causal_lm_loss

    tune = "off" if bench.dry_run else "quick"
    return lambda model, ids: causal_lm_loss(model, ids, ids, verify=False, tune=tune)


def hf_loss(model: Any, ids: Any) -> Any:
    """Hugging Face's loss of ``ids`` as their own labels: ``model(input_ids=ids, labels=ids)``."""
    return model(input_ids=ids, labels=ids).loss


def train_step(
    model: Any,
    loss_fn: Callable,
    ids: Any,
    setting: str,
    bench: Bench,
    *,
    graph: bool = False,
    notes: dict[str, Any] | None = None,
) -> Callable[[], Any]:
    """One optimizer step of ``model`` on ``ids`` — gradients to ``None``, forward with labels,
    backward, ``AdamW.step()`` (fused on a GPU) — returning the loss (detached). ``graph``: the
    step captured by ``coda.export.capture_train_step`` (``captured_step``), each call a replay;
    on a dry run the plain step, since the helper refuses a model on the CPU. ``notes``
    receives, for ``graph``, what was captured or why nothing was (``"graph"``)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if graph and bench.dry_run:
        if notes is not None:
            notes["graph"] = GRAPH_ON_CPU
        graph = False
    if graph:  # the documented recipe: a tensor lr on the GPU, fused and capturable
        lr = torch.tensor(1e-5, device=bench.device)
        optimizer = torch.optim.AdamW(params, lr=lr, fused=True, capturable=True)
        step = captured_step(model, optimizer, loss_fn, ids, setting, bench)
        if notes is not None:
            shapes = "; ".join(step.func.captured_shapes)
            notes["graph"] = f"captured by capture_train_step: {shapes}"
        return step
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=not bench.dry_run)

    def step() -> Any:
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(model, loss_fn, ids, setting, bench)
        optimizer.step()
        return loss.detach()

    return step


GRAPH_ON_CPU = (
    "not captured: a dry run times the plain step (capture_train_step refuses a model on the "
    "CPU: CUDA graphs need a CUDA device)"
)


def captured_step(
    model: Any, optimizer: Any, loss_fn: Callable, ids: Any, setting: str, bench: Bench
) -> functools.partial:
    """``model``'s training step through ``coda.export.capture_train_step``, as a user runs it:
    the batch ``{"input_ids": ids, "labels": ids}`` and ``graph_loss``'s loss. Its warm-up steps
    (eager, on a side stream: Triton compiles, the ops tune and record run plans, the optimizer
    creates its state) and its capture run here, so every call of the returned step is a replay
    (with the helper's per-call checks and the copy of the batch into the graph's buffers);
    ``RuntimeError`` if nothing was captured after them. The returned step holds the captured
    one, which holds the model and optimizer whose memory its graph addresses (a benchmark whose
    replay did not hold the model saw it freed under the graph: bench/RESULTS.md, 2026-12-01e)."""
    from coda.export import capture_train_step

    batch = {"input_ids": ids, "labels": ids}
    captured = capture_train_step(model, optimizer, batch, graph_loss(loss_fn, setting, bench))
    for _ in range(captured.warmup + 1):
        captured(batch)
    if not captured.captured_shapes:
        raise RuntimeError(
            f"capture_train_step captured nothing after {captured.warmup + 1} calls on one "
            "batch shape: its warm-up count and the calls here disagree"
        )
    return functools.partial(captured, batch)


def graph_loss(loss_fn: Callable, setting: str, bench: Bench) -> Callable | None:
    """The ``loss_fn`` that ``capture_train_step`` gets for a variant whose loss of ``ids`` is
    ``loss_fn``: None — the helper's default, ``model(**batch).loss`` — for Hugging Face's loss
    in bf16 (the one-liner users copy); otherwise ``loss_fn`` of the batch's ``input_ids`` (its
    labels are the same ids), under autocast in the ``amp`` setting."""
    if loss_fn is hf_loss and setting == "bf16":
        return None
    return lambda model, batch: setting_loss(model, loss_fn, batch["input_ids"], setting, bench)


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


@contextmanager
def programs_on(backend: str) -> Iterator[None]:
    """Every coda program's runs on epilogue backend ``backend`` until the block ends, whatever
    each was compiled with (``coda.primitives.runtime.BACKEND``; restored after)."""
    from coda.primitives import runtime

    saved, runtime.BACKEND = runtime.BACKEND, backend
    try:
        yield
    finally:
        runtime.BACKEND = saved


def on_triton(step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` with every program's fused steps on the Triton backend (``programs_on``)."""

    def triton_step() -> Any:
        with programs_on("triton"):
            return step()

    return triton_step


def forward_backward(model: Any, loss_fn: Callable, ids: Any, setting: str, bench: Bench) -> Any:
    """The loss of ``ids`` (``setting_loss``), backpropagated; returns it."""
    loss = setting_loss(model, loss_fn, ids, setting, bench)
    loss.backward()
    return loss


def setting_loss(model: Any, loss_fn: Callable, ids: Any, setting: str, bench: Bench) -> Any:
    """``loss_fn(model, ids)``, under autocast in the ``amp`` setting."""
    import torch

    dtype = torch.float16 if bench.dry_run else torch.bfloat16  # interpreter: no bf16 dot
    with torch.autocast(bench.device, dtype=dtype, enabled=setting == "amp"):
        return loss_fn(model, ids)


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


# Where an allocation is attributed: the innermost frames in these (not PyTorch's own).
ALLOCATION_SITES = ("/coda", "/export/", "/primitives/", "transformers/", "liger_kernel/", "bench/")


def memory_peak(
    model: Any, loss_fn: Callable, ids: Any, setting: str, bench: Bench, top: int
) -> dict[str, Any] | None:
    """What is live at the peak of one forward+backward (after the first step): the CUDA caching
    allocator's history recorded over the step (``torch.cuda.memory._record_memory_history``),
    replayed by ``live_at_peak``; the ``top`` largest groups by allocation site
    (``allocation_site``). Memory allocated before the step (weights, optimizer state) is not in
    the history and not counted: the peak is the step's own, as ``step_memory_gb``. None on a dry
    run (no CUDA allocator)."""
    if bench.dry_run:
        return None
    import torch

    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    try:
        forward_backward(model, loss_fn, ids, setting, bench)
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    model.zero_grad(set_to_none=True)
    peak, live = live_at_peak(events)
    groups: dict[str, int] = {}
    for size, site in live:
        groups[site] = groups.get(site, 0) + size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    return {"peak_gb": peak / 1e9, "groups": [{"site": s, "gb": b / 1e9} for s, b in ranked]}


def live_at_peak(events: list[dict[str, Any]]) -> tuple[int, list[tuple[int, str]]]:
    """Replay allocator trace ``events`` (``alloc`` / ``free_requested`` with ``addr``,
    ``size``, ``frames``): the largest total of bytes allocated within the trace and live at
    once, and the (size, ``allocation_site``) of each block live then. A free of a block the
    trace did not allocate (it predates the recording) is ignored."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: list[tuple[int, str]] = []
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], allocation_site(event.get("frames") or []))
            total += event["size"]
            if total > best:
                best, best_live = total, list(live.values())
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return best, best_live


def allocation_site(frames: list[dict[str, Any]], depth: int = 3) -> str:
    """``file:line:function`` of the ``depth`` innermost frames in ``ALLOCATION_SITES`` (outside
    PyTorch's own files), innermost first; the innermost frame's function when none is."""
    picked = [
        f"{os.path.basename(f['filename'])}:{f.get('line')}:{f.get('name')}"
        for f in frames
        if any(s in f.get("filename", "") for s in ALLOCATION_SITES)
        and "site-packages/torch/" not in f.get("filename", "")
    ][:depth]
    return " < ".join(picked) or (frames[0].get("name", "?") if frames else "?")


def memory_tables(rows: list[dict[str, Any]]) -> str:
    """Per variant measured with ``--memory-peak``: what was live at its step's peak."""
    parts = []
    for r in rows:
        peak = r.get("memory_peak")
        if not peak:
            continue
        lines = [
            f"\n{r['setting']} {r['variant']}: memory live at the step's peak "
            f"({peak['peak_gb']:.3f} GB allocated in the step), by allocation site",
            "| GB | allocated at (innermost first) |",
            "|---|---|",
        ]
        lines += [f"| {g['gb']:.3f} | {_cell(g['site'])} |" for g in peak["groups"]]
        parts.append("\n".join(lines))
    return "\n" + "\n".join(parts) if parts else ""


STEP_REP_MS = 1000  # milliseconds of steps per variant per interleaved round


def setting_rows(
    args: argparse.Namespace,
    setting: str,
    base: Any,
    ids: Any,
    bench: Bench,
    family: str = "llama",
) -> list[dict[str, Any]]:
    """One row per variant of ``args.variants`` in ``setting``: checked against the first
    variant that ran (``hf`` by default), then timed interleaved ``args.runs`` times, and
    whatever else the arguments ask for."""
    rows, steps = [], {}
    reference: dict[str, float] | None = None
    for name in family_variants(args.variants, family):
        row: dict[str, Any] = {"setting": setting, "variant": name}
        notes: dict[str, Any] = {}
        loss_fn = loss_of(name, bench, family)
        mode = split_variant(name)[1]
        try:
            # a _triton variant is tuned, checked and measured on Triton too
            with programs_on("triton") if mode == "triton" else nullcontext():
                model = make_variant(name, base, setting, bench, args.compile_mode, family, notes)
                row |= notes
                row |= first_step(model, loss_fn, ids, setting, bench)
                row["step_memory_gb"] = step_memory_gb(model, loss_fn, ids, setting, bench)
                if args.memory_peak:
                    row["memory_peak"] = memory_peak(
                        model, loss_fn, ids, setting, bench, args.memory_peak
                    )
        except Skipped as e:
            rows.append({**row, **notes, "skipped": str(e)})
            continue
        except Exception as e:  # noqa: BLE001 - one variant failing must not hide the rest
            rows.append({**row, **notes, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        reference = reference or {"loss": row["loss"], "grad_norm": row["grad_norm"]}
        # bf16 end to end: a different kernel schedule moves the loss in the 3rd digit at most
        tol = 2e-2 if setting == "bf16" and not bench.dry_run else 2e-3
        row["correct"] = all(
            abs(row[k] - reference[k]) <= tol * abs(reference[k]) for k in ("loss", "grad_norm")
        )
        try:
            steps[name] = train_step(
                model, loss_fn, ids, setting, bench, graph=mode == "graph", notes=row
            )
        except Exception as e:  # noqa: BLE001 - e.g. a model that cannot be captured
            rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        if mode in ("ops", "decide"):
            steps[name] = with_host_paths(steps[name], ops=mode == "ops")
        if mode == "triton":
            steps[name] = on_triton(steps[name])
        rows.append(row)
    runs = [bench.compare(steps, rep_ms=STEP_REP_MS) for _ in range(args.runs)] if steps else []
    for row in rows:
        if row["variant"] in steps:
            measure_more(args, row, steps[row["variant"]], bench, family)
    tokens = ids.numel()
    for row in rows:
        if row["variant"] in steps:
            row["step_ms_runs"] = [run[row["variant"]] for run in runs]
            row["step_ms"] = statistics.median(row["step_ms_runs"])
            row["tokens_per_s"] = tokens / (row["step_ms"] * 1e-3)
    hf = next((r.get("step_ms") for r in rows if r["variant"] == "hf"), None)
    for row in rows:
        if hf and row.get("step_ms"):
            row["speedup_vs_hf"] = hf / row["step_ms"]
            row["speedup_vs_hf_runs"] = paired_ratios(runs, "hf", row["variant"])
    return rows


def paired_ratios(runs: list[dict[str, float]], reference: str, name: str) -> list[float]:
    """``reference``'s ms over ``name``'s within each interleaved comparison (how much faster
    ``name`` is, run by run). A host-bound step's time moves with the machine's host between
    comparisons by more than the steps differ (bench/RESULTS.md, 2048 tokens); within one
    comparison both met the same host, so the median of these ratios is steadier than the ratio
    of the two medians."""
    return [run[reference] / run[name] for run in runs if reference in run and name in run]


def measure_more(
    args: argparse.Namespace,
    row: dict[str, Any],
    step: Callable[[], Any],
    bench: Bench,
    family: str,
) -> None:
    """What the arguments ask beyond step times, into ``row``: kernel profile, host time,
    cProfile, host syncs, GPU idle gaps."""
    setting, variant = row["setting"], row["variant"]
    if args.profile:
        kernels = profile_step(step, bench)
        row["gpu_busy_ms"] = sum(k["ms"] for k in kernels)  # all of the step's GPU work
        row["families"] = kernel_families(kernels)
        row["kernels"] = kernels[: args.profile]
    if args.host:
        row["host_ms"] = host_ms(step, bench)
        row["host_ms_back_to_back"] = host_ms(step, bench, back_to_back=True)
    if variant in args.cprofile.split(","):
        where = setting if family == "llama" else f"{family}-{setting}"
        (Path(args.out) / f"cprofile-{where}-{variant}.txt").write_text(host_profile(step, bench))
    if args.sync_check:
        row["syncs"] = host_syncs(step, bench)
    if args.gaps:
        trace = Path(args.out) / f"trace-{family}-{setting}-{variant}.json" if args.trace else None
        row["gaps"] = gap_profile(step, bench, args.gaps, trace, args.gaps_stacks)
        row["gaps"]["python_stacks"] = args.gaps_stacks
    if args.host and args.host_split and variant.startswith("coda"):
        from host_work import launches_stubbed  # (same folder; it imports this module)

        with launches_stubbed():  # last: the steps' gradients, hence the weights, are garbage
            row["host_ms_no_launches"] = host_ms(step, bench)


def host_syncs(step: Callable[[], Any], bench: Bench) -> dict[str, int] | None:
    """Where one training step makes the host wait for the GPU (``.item()``, blocking copies
    such as a pageable host-to-device index, ``nonzero``…), after a warm-up step: watched by
    ``coda.export.train_step.watching_syncs`` (``torch.cuda.set_sync_debug_mode("warn")``), the
    watch under which ``capture_train_step`` refuses a step that syncs, and counted per site by
    ``sync_counts``. A step that never synchronizes lets the host run ahead and hide its launch
    costs; None on a dry run."""
    if bench.dry_run:
        return None
    import torch

    from coda.export.train_step import watching_syncs

    step()
    torch.cuda.synchronize()
    stacks: list = []
    with watching_syncs(stacks):
        step()
    return sync_counts(stacks)


def sync_counts(stacks: list) -> dict[str, int]:
    """``site: count`` for the Python stacks of the syncs one step made, each site named as
    ``capture_train_step``'s refusal names it (``coda.export.train_step.blame``: the line, and
    for a line inside PyTorch also the first caller outside it)."""
    from coda.export.train_step import blame

    counts: dict[str, int] = {}
    for stack in stacks:
        where = blame(stack)
        counts[where] = counts.get(where, 0) + 1
    return counts


def host_ms(
    step: Callable[[], Any], bench: Bench, steps: int | None = None, *, back_to_back: bool = False
) -> float:
    """Median host milliseconds of one step over ``steps``, until ``step()`` returns, without
    synchronizing inside (the time the host needs to issue the step's work).

    From a synchronized, idle GPU (default, 10 steps): when it reaches the step's time the GPU
    waits on the host: the step is host-bound. ``back_to_back`` (20 steps): each step issued
    while the GPU still runs the one before, as the timing loop issues them (after three such
    steps to reach that state). A host that never waits for the GPU issues in about its
    from-idle time; one that waits somewhere — a launch once CUDA's queue is full, any call that
    blocks on the device — takes longer back to back, and a GPU-bound step's host takes the
    GPU's time per step. A dry run times 2 steps either way."""
    import statistics
    import time

    if steps is None:  # the interpreter is slow; a dry run checks code
        steps = 2 if bench.dry_run else 20 if back_to_back else 10
    bench.synchronize()
    if back_to_back:
        for _ in range(3):
            step()
    samples = []
    for _ in range(steps):
        if not back_to_back:
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


STEP_RANGE = "train_step"  # the record_function range around the profiled step
# CUDA runtime and driver calls that block the host until the GPU has caught up
_SYNC_CALL = re.compile(r"Synchronize|^cudaMemcpy$|^cuMemcpyDtoH|^cudaStreamQuery")


class Span(NamedTuple):
    """One profiler event: ``[start, end)`` in µs since the trace began, its name and thread."""

    start: float
    end: float
    name: str
    thread: int = 0


def gap_profile(
    step: Callable[[], Any],
    bench: Bench,
    top: int,
    trace: Path | None = None,
    stacks: bool = False,
) -> dict[str, Any]:
    """One ``step()`` (after one outside the profiler) under ``torch.profiler`` with CPU and
    CUDA activities, summarised by ``idle_gaps``; ``stacks``: also every Python function call
    (names the host's Python, but tracing it slows the host, so the gaps grow); ``trace``: also
    the Chrome trace, gzip'd to ``<trace>.gz``. On a dry run CPU ops only: no GPU event, so the
    whole step is one idle stretch (the code path is what a dry run checks)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    step()
    bench.synchronize()
    activities = [ProfilerActivity.CPU]
    if not bench.dry_run:
        activities.append(ProfilerActivity.CUDA)
    # under the interpreter Python stacks would trace every kernel's emulation (millions of
    # events): a dry run records ops only
    with profile(activities=activities, with_stack=stacks and not bench.dry_run) as prof:
        with record_function(STEP_RANGE):
            step()
        bench.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
    gpu, cpu, window = [], [], None
    for e in prof.events():
        span = Span(e.time_range.start, e.time_range.end, e.name, e.thread)
        if e.device_type == DeviceType.CUDA:
            if is_gpu_work(e) and e.name != STEP_RANGE:
                gpu.append(span)
        elif e.name == STEP_RANGE and window is None:
            window = span
        else:
            cpu.append(span)
    if window is None:
        raise RuntimeError(f"the profile has no {STEP_RANGE!r} range around the step")
    return idle_gaps(gpu, cpu, window, top)


def is_gpu_work(event: Any) -> bool:
    """Whether a ``torch.profiler`` event is work on the GPU (a kernel, copy or memset). A
    ``record_function`` range shows on the GPU's timeline too (``gpu_user_annotation``): a span
    of host intent, not GPU work."""
    from torch.autograd import DeviceType

    return event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def busy_intervals(gpu: list[Span], start: float, end: float) -> list[tuple[float, float]]:
    """The union of the GPU events' intervals, clipped to ``[start, end]``, in order."""
    merged: list[list[float]] = []
    for s in sorted(gpu, key=lambda e: e.start):
        a, b = max(s.start, start), min(s.end, end)
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def idle_gaps(gpu: list[Span], cpu: list[Span], window: Span, top: int) -> dict[str, Any]:
    """Where the GPU waits during one step. The step runs from its range's start (``window``,
    on the thread that called it) until its range ends or the GPU's last work of it ends,
    whichever is later. Returns (ms): ``step_ms``, ``gpu_busy_ms`` (the union of kernels,
    copies and memsets), ``gpu_idle_ms``, ``idle_after_sync_ms`` (the part in gaps that began
    while the host was blocked in a synchronizing CUDA call — the host resumes only after
    the GPU has drained, so the gap is the sync's cost; the rest is the host not launching
    fast enough), ``gap_count``, and ``gaps``: the ``top`` longest, each with its start
    (``at_ms`` from the step's start), ``ms``, ``cpu_op`` (the innermost CPU event running at
    the gap's middle, on any thread: the one entered last), ``python`` (the innermost Python
    function of that thread, if the profile has Python stacks), ``thread`` (``main``: the
    step's thread, else ``other``: autograd's backward thread), ``after_sync`` (the
    synchronizing call, if any) and ``next_kernel`` (the GPU work that ends the gap); and
    ``every_gap``: every gap in time order (``at_ms``, ``ms``, ``after_sync``)."""
    start = window.start
    end = max([window.end, *(g.end for g in gpu if g.end > start)])
    busy = busy_intervals(gpu, start, end)
    edges = [start, *(x for pair in busy for x in pair), end]
    holes = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b > a]
    syncs = [c for c in cpu if _SYNC_CALL.search(c.name)]
    work = [c for c in cpu if not _runtime_call(c.name)]
    gaps = []
    for a, b in holes:
        sync = next((c.name for c in syncs if c.start <= a <= c.end + _SKEW_US), None)
        gaps.append({"at_ms": (a - start) / 1e3, "ms": (b - a) / 1e3, "after_sync": sync,
                     "start": a, "end": b})  # fmt: skip
    longest = sorted(gaps, key=lambda g: -g["ms"])[:top]
    for g in longest:
        g |= cpu_at((g["start"] + g["end"]) / 2, work, window.thread)
        g["next_kernel"] = next((s.name for s in sorted(gpu, key=lambda e: e.start)
                                 if s.start >= g["end"] - _SKEW_US), None)  # fmt: skip
    every = [{k: g[k] for k in ("at_ms", "ms", "after_sync")} for g in gaps]
    for g in longest:
        del g["start"], g["end"]
    busy_ms = sum(b - a for a, b in busy) / 1e3
    return {
        "step_ms": (end - start) / 1e3,
        "gpu_busy_ms": busy_ms,
        "gpu_idle_ms": (end - start) / 1e3 - busy_ms,
        "idle_after_sync_ms": sum(g["ms"] for g in gaps if g["after_sync"]),
        "gap_count": len(gaps),
        "gaps": longest,
        "every_gap": every,
    }


_SKEW_US = 2.0  # CPU and GPU timestamps of one trace agree to about a microsecond


def _runtime_call(name: str) -> bool:
    """Whether a CPU event is a CUDA runtime or driver call (``cudaLaunchKernel``,
    ``cuLaunchKernelEx``…) rather than an op or a Python function."""
    return name.startswith("cuda") or bool(re.match(r"cu[A-Z]", name))


def cpu_at(t: float, work: list[Span], main: int) -> dict[str, Any]:
    """The CPU side at time ``t``: the innermost event running then on any thread (the one
    entered last), its thread (``main`` or ``other``), and that thread's innermost Python
    function (``file.py(line): name``; built-ins left out). When no event runs then, the host is
    in Python that no op covers: ``cpu_op`` says ``"Python after <the last event that
    ended>"``."""
    live = [w for w in work if w.start <= t < w.end]
    if live:
        inner = max(live, key=lambda w: w.start)
        op = inner.name
    else:
        done = [w for w in work if w.end <= t]
        if not done:
            return {"cpu_op": None, "python": None, "thread": None}
        inner = max(done, key=lambda w: w.end)
        op = f"Python after {inner.name}"
    python = [w for w in live if w.thread == inner.thread and _PY_FRAME.match(w.name)]
    return {
        "cpu_op": op,
        "python": max(python, key=lambda w: w.start).name if python else None,
        "thread": "main" if inner.thread == main else "other",
    }


_PY_FRAME = re.compile(r"^[^<].*\.py\(\d+\): ")  # "torch/nn/modules/module.py(1750): _call_impl"


def graph_lines(rows: list[dict[str, Any]]) -> str:
    """Per ``_graph`` variant: what ``capture_train_step`` captured (the batch shapes), or why
    the row times the plain step (a dry run)."""
    lines = [f"{r['setting']} {r['variant']}: {r['graph']}" for r in rows if r.get("graph")]
    return "\n\n" + "\n".join(lines) if lines else ""


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
    """One line per row: correctness, step time (median over runs) and speed — against eager
    Hugging Face, the ratio of the medians and, over several runs, the median and spread of the
    ratios within each run (``paired_ratios``) —, step memory (the peak a step adds), host time,
    and the step time's spread over runs with every run's."""
    lines = [
        "| setting | variant | correct | loss | grad norm | step ms | tokens/s | vs hf eager "
        "| step memory GB | host ms: from idle / back to back "
        "| step ms over runs: min–max (each run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = r.get("error") or f"skipped: {r['skipped']}"
            lines.append(f"| {r['setting']} | {r['variant']} | {_cell(why)} |||||||||")
            continue
        ms, speed, mem = r.get("step_ms"), r.get("speedup_vs_hf"), r.get("step_memory_gb")
        versus = "—" if speed is None else f"{speed:.3f}×"  # no hf row: nothing to compare
        paired = r.get("speedup_vs_hf_runs") or []
        if speed is not None and len(paired) > 1 and r["variant"] != "hf":
            versus += f" (paired {ratio_spread(paired)})"
        timing = f"{ms:.2f} | {r['tokens_per_s']:,.0f} | {versus}" if ms else "— | — | —"
        runs = r.get("step_ms_runs") or []
        every = ", ".join(f"{t:.2f}" for t in runs)
        spread = f"{min(runs):.2f}–{max(runs):.2f} ({every})" if runs else "—"
        lines.append(
            f"| {r['setting']} | {r['variant']} | {r['correct']} | {r['loss']:.4f} | "
            f"{r['grad_norm']:.4f} | {timing} | {'not measured' if mem is None else f'{mem:.2f}'} "
            f"| {_host_cell(r)} | {spread} |"
        )
    return "\n".join(lines)


def ratio_spread(ratios: list[float]) -> str:
    """``median× (min–max)`` of ratios."""
    return f"{statistics.median(ratios):.3f}× ({min(ratios):.3f}–{max(ratios):.3f})"


def _host_cell(row: dict[str, Any]) -> str:
    """The host-ms cell: the step's host time from an idle GPU, then back to back, and without
    Triton's launches (from idle) where measured."""
    host, bare = row.get("host_ms"), row.get("host_ms_no_launches")
    if host is None:
        return "—"
    text = f"{host:.2f}"
    if row.get("host_ms_back_to_back") is not None:
        text += f" / {row['host_ms_back_to_back']:.2f}"
    return text if bare is None else f"{text} ({bare:.2f} without launches)"


def _cell(text: str) -> str:
    """``text`` fit for one markdown table cell: no pipes or line breaks, at most 300
    characters (the JSON keeps it whole)."""
    return text.replace("|", "/").replace("\n", " ")[:300]


def patch_lines(rows: list[dict[str, Any]]) -> str:
    """What ``patch_model`` patched and kept for each distinct report among the rows."""
    seen: dict[tuple[str, ...], list[str]] = {}
    for r in rows:
        if r.get("patched"):
            key = tuple(f"{kind}: {line}" for kind, line in r["patched"].items())
            seen.setdefault(key, []).append(f"{r['setting']} {r['variant']}")
    parts = [
        "\n".join([f"\npatch_model's report ({', '.join(where)}):", *(f"* {k}" for k in key)])
        for key, where in seen.items()
    ]
    return "\n" + "\n".join(parts) if parts else ""


def gap_tables(rows: list[dict[str, Any]]) -> str:
    """``--gaps``: per variant the profiled step's wall time, GPU busy and idle time, and the
    idle time after host syncs; then each variant's longest idle gaps and what the host was
    doing."""
    profiled = [r for r in rows if r.get("gaps")]
    if not profiled:
        return ""
    traced = profiled[0]["gaps"].get("python_stacks")
    how = "Python calls traced, which slows the host" if traced else "ops only, no Python stacks"
    lines = [
        "\n\nWhere the GPU waits (one profiled step each, ms; idle after sync: in gaps that "
        f"began while the host was blocked in a synchronizing call; {how}):\n",
        "| setting | variant | step wall | GPU busy | GPU idle | idle share | idle after sync "
        "| gaps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in profiled:
        g = r["gaps"]
        share = g["gpu_idle_ms"] / g["step_ms"] if g["step_ms"] else 0.0
        lines.append(
            f"| {r['setting']} | {r['variant']} | {g['step_ms']:.2f} | {g['gpu_busy_ms']:.2f} | "
            f"{g['gpu_idle_ms']:.2f} | {share:.0%} | {g['idle_after_sync_ms']:.2f} | "
            f"{g['gap_count']} |"
        )
    for r in profiled:
        lines += [
            f"\n{r['setting']} {r['variant']}: the {len(r['gaps']['gaps'])} longest idle gaps",
            "| at ms | idle µs | CPU op then | Python function | thread | after sync | next on "
            "GPU |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {g['at_ms']:.3f} | {g['ms'] * 1e3:.1f} | {_cell(str(g['cpu_op']))[:80]} | "
            f"{_cell(str(g['python']))[:80]} | {g['thread']} | {g['after_sync'] or '—'} | "
            f"{_cell(str(g['next_kernel']))[:60]} |"
            for g in r["gaps"]["gaps"]
        ]
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
        args.layers, args.batch, args.seq = min(args.layers or 2, 2), 2, 9
    return Bench(args.dry_run)


def family_result(
    args: argparse.Namespace, family: str, bench: Bench, env: dict[str, Any]
) -> list[dict[str, Any]]:
    """Every setting's rows for one family; writes ``<family>_train_step.json`` after each
    setting (a run cut short keeps what it measured) and the ``.md`` at the end."""
    import torch

    name = FAMILY_TITLES[family]
    print(f"{name} training steps on {env['device']}", flush=True)
    base = base_model(args, bench, family)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), device=bench.device)
    out = Path(args.out)
    layers = base.config.num_hidden_layers
    shape = {
        "family": family, "layers": layers, "batch": args.batch, "seq": args.seq,
        "attn_implementation": base.config._attn_implementation, **base.config.to_dict(),
    }  # fmt: skip
    result: dict[str, Any] = {"environment": env, "model": shape, "runs": args.runs, "rows": []}
    for setting in [s for s in args.settings.split(",") if s]:
        print(f"  {setting} ...", flush=True)
        result["rows"] += setting_rows(args, setting, base, ids, bench, family)
        torch.compiler.reset()  # the compiled variants' caches may hold their models
        bench.free()
        (out / f"{family}_train_step.json").write_text(json.dumps(result, indent=2, default=str))
    del base
    bench.free()
    from coda.export import kernels_used

    result["kernels"] = kernels_used()  # which backend ran each exported Program's fused steps
    (out / f"{family}_train_step.json").write_text(json.dumps(result, indent=2, default=str))
    rows = result["rows"]
    text = table(rows) + patch_lines(rows) + family_table(rows) + kernel_tables(rows)
    text += graph_lines(rows) + sync_lines(rows) + memory_tables(rows) + gap_tables(rows)
    note = "\n\nDRY RUN on a CPU: not measurements.\n" if bench.dry_run else "\n"
    what = (
        f"{layers} layers, hidden {shape['hidden_size']}, vocabulary {shape['vocab_size']}, "
        f"{args.batch} × {args.seq} tokens; step times: medians over {args.runs} "
        f"run{'s' if args.runs > 1 else ''}"
    )
    (out / f"{family}_train_step.md").write_text(
        f"# {name} training steps ({env['date']})\n\n{what}\n\n{text}{note}"
    )
    print(text + note, flush=True)
    return rows


# The families' names in titles (as coda.export.families names them in its reports).
FAMILY_TITLES = {
    "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
    "gemma2": "Gemma 2", "gemma3": "Gemma 3", "phi3": "Phi-3", "olmo2": "OLMo 2",
}  # fmt: skip


def safe_family_result(
    args: argparse.Namespace, family: str, bench: Bench, env: dict[str, Any]
) -> list[dict[str, Any]]:
    """``family_result``, or one error row when the family's model cannot even be built or
    run (so that the next family of ``--family all`` still runs)."""
    try:
        return family_result(args, family, bench, env)
    except Exception as e:  # noqa: BLE001 - one family failing must not hide the rest
        error = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  {family}: {error}", flush=True)
        bench.free()
        return [{"setting": "—", "variant": "(the model)", "error": error}]


def families_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Every family's step times side by side: one line per family and setting, one column per
    variant, each cell the median ms and its ratio to ``hf`` (``skipped``, ``error`` or
    ``wrong`` where the variant has no time; the family's own table says why)."""
    variants = list(dict.fromkeys(r["variant"] for rows in results.values() for r in rows))
    lines = [
        "| family | setting | " + " | ".join(variants) + " |",
        "|---|---|" + "---|" * len(variants),
    ]
    for family, rows in results.items():
        for setting in dict.fromkeys(r["setting"] for r in rows):
            mine = {r["variant"]: r for r in rows if r["setting"] == setting}
            cells = [_family_cell(mine.get(v)) for v in variants]
            lines.append(f"| {FAMILY_TITLES[family]} | {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _family_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if "skipped" in row or "error" in row:
        return "skipped" if "skipped" in row else "error"
    if row.get("correct") is False:
        return "wrong"
    speed = row.get("speedup_vs_hf")
    return f"{row['step_ms']:.2f}" + (f" ({speed:.3f}×)" if speed else "")


def main(argv: list[str] | None = None, script: str = "train_step.py") -> int:
    """Run the benchmark for every family of ``--family``; 1 if any variant failed or
    computed another loss or gradient than ``hf``, 2 without a GPU (and no ``--dry-run``).
    ``script``: the name the no-GPU message gives."""
    args = parse_args(argv)
    bench = start(args, script)
    if bench is None:
        return 2
    if bench.dry_run:  # the interpreter is slow; a dry run checks code
        args.runs = min(args.runs or 1, 2)
    args.runs = args.runs or 3
    env = environment(bench, argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = {f: safe_family_result(args, f, bench, env) for f in parse_families(args.family)}
    if len(results) > 1:
        note = "\n\nDRY RUN on a CPU: not measurements.\n" if bench.dry_run else "\n"
        (Path(args.out) / "train_step_families.md").write_text(
            f"# Training steps of {len(results)} families ({env['date']}), ms (vs hf eager)\n\n"
            f"{families_table(results)}{note}"
        )
    rows = [r for family_rows in results.values() for r in family_rows]
    failed = [r for r in rows if "error" in r or r.get("correct") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
