"""The drop-ins' Programs, shipped verified: one ``<block>.json`` here per block the drop-ins run.

Each file holds the built-in planner's Program for one block of a family the drop-ins build on
(``FAMILIES``: the ``llama_mlp`` and ``llama_mlp_branch`` sub-layers, Gemma's ``gemma_mlp``,
``gemma_mlp_branch`` and ``gemma2_mlp_branch`` (sandwich norms), OLMo 2's ``olmo2_mlp_branch``
(post-norm only), the attention inputs (Llama's, Qwen2's, Qwen3's, Gemma 3's, OLMo 2's), the
attention outputs (``o_proj`` + residual: plain, and with Gemma 2/3's or OLMo 2's post-norm), the
LM-head loss (plain, and softcapped as Gemma 2's) — forward and backward,
at Llama's RMSNorm epsilon ``SHIPPED_EPS``, with its family's lowering options), with its content
hash: the first 12 hex digits of the SHA-256 of its canonical JSON, the key the sandbox's Reports
and the regression
store know a Program by. Every file was
verified by the sandbox (the block's shape sets, float32 and float16) when it was written, and
``make test`` verifies each again and checks it is byte for byte what the planner writes now
(``tests/export/test_shipped_programs.py``). After a planner change, rewrite them with
``python -m coda.export.programs --write`` (that test then verifies the new Programs).

``shipped_program(family, key, eps)`` is how a drop-in gets a Program without a sandbox worker:
the planner lowers the block for the model's epsilon (milliseconds), and its Program is used when
it is the shipped one with that epsilon — the same hash as the shipped Program once every ``eps``
there (``SHIPPED_EPS``) is the model's and the block is named as the model's. (The file's Program
must hash to the file's recorded hash too, so an edited file is caught.) The epsilon is a
constant inside ``rsqrt(mean(x²) + eps)``; the generated kernels differ by that literal only, so
the shipped Program's verification carries over, and a Llama with 1e-6 builds as fast as one
with 1e-5. Anything else — a missing or edited file, a planner whose Program differs — raises
``ShippedMismatch``; ``coda.export.resolve`` then verifies the planner's Program in the sandbox
instead (seconds) and warns, so a drop-in never runs a Program the sandbox has not verified.

The one place the export calls the planner: ``lowered``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from coda.blocks.attn_out import attn_out_family
from coda.blocks.block import Block
from coda.blocks.gemma import gemma_mlp_family, lm_head_softcap_ce_family
from coda.blocks.llama import (
    LLAMA_RMS_EPS,
    llama_attn_in_family,
    llama_lm_head_ce_family,
    llama_mlp_family,
)
from coda.blocks.olmo2 import olmo2_mlp_family
from coda.blocks.qwen import (
    gemma3_attn_in_family,
    olmo2_attn_in_family,
    qwen2_attn_in_family,
    qwen3_attn_in_family,
)
from coda.planner import LoweringOptions, lower
from coda.primitives.ir import Program, content_hash

PROGRAMS_DIR = Path(__file__).resolve().parent
SHIPPED_EPS = LLAMA_RMS_EPS  # the epsilon of the shipped blocks (the built-in ones)
REWRITE = "python -m coda.export.programs --write"


@dataclass(frozen=True)
class Family:
    """Blocks for an RMSNorm epsilon (a ``coda.blocks.llama`` or ``coda.blocks.qwen`` family),
    the keys of those the drop-ins run, and the lowering options their Programs are lowered
    with."""

    blocks: Callable[[float], dict[str, Block]]
    keys: tuple[str, ...]
    options: LoweringOptions = LoweringOptions()


_MLP_KEYS = ("forward", "backward", "train", "backward_saved")
# The MLPs' pre-norm in a row pass (``gamma="rows"``): folding γ into the gate/up weight reads and
# writes [2f, d] per call (67 MB at Llama 1B widths), the row pass writes [tokens, d] (8 MB at
# 2048 tokens) — fewer bytes below 4f tokens per call (32768 there). The attention inputs keep
# the fold: their [Nq + 2·Nkv, d] weight is near [tokens, d] at training sizes.
_ROWS = LoweringOptions(gamma="rows")
FAMILIES: dict[str, Family] = {
    # CodaLlamaMLPBlock: saved (train, backward_saved, forward without gradients) or not
    # (forward, backward); with its residual add or without (the branch, under autocast).
    "llama_mlp": Family(llama_mlp_family, _MLP_KEYS, _ROWS),
    "llama_mlp_branch": Family(lambda eps: llama_mlp_family(eps, residual=False), _MLP_KEYS, _ROWS),
    # The same for Gemma's GeGLU MLP under its (1 + γ) norm, and Gemma 2/3's between sandwich
    # norms (a branch only: their layers add the residual).
    "gemma_mlp": Family(lambda eps: gemma_mlp_family("gemma_mlp", eps), _MLP_KEYS, _ROWS),
    "gemma_mlp_branch": Family(
        lambda eps: gemma_mlp_family("gemma_mlp_branch", eps), _MLP_KEYS, _ROWS
    ),
    "gemma2_mlp_branch": Family(
        lambda eps: gemma_mlp_family("gemma2_mlp_branch", eps), _MLP_KEYS, _ROWS
    ),
    # Llama's attention input: the training forward also returns the norm's statistic, which the
    # backward takes with qkv; the plain forward runs without gradients.
    "llama_attn_in": Family(llama_attn_in_family, ("forward", "train", "backward_saved")),
    "llama_lm_head_ce": Family(llama_lm_head_ce_family, ("forward", "train", "backward_saved")),
    # the attention inputs in Hugging Face's order (separate q_rot, k_rot, v): Qwen2's, Qwen3's
    "qwen2_attn_in": Family(qwen2_attn_in_family, ("forward", "backward")),
    "qwen3_attn_in": Family(qwen3_attn_in_family, ("forward", "backward")),
    # Gemma 3's (per-head q/k norms, every norm x̂ · (1 + w)) and OLMo 2's (no input norm, q/k
    # norms over the whole projection)
    "gemma3_attn_in": Family(gemma3_attn_in_family, ("forward", "backward")),
    "olmo2_attn_in": Family(olmo2_attn_in_family, ("forward", "backward")),
    # OLMo 2's MLP branch: no pre-norm, its post_feedforward_layernorm in the kernels
    "olmo2_mlp_branch": Family(olmo2_mlp_family, _MLP_KEYS),
    # Gemma 2's head: the logits capped at 30 before the cross-entropy
    "lm_head_softcap_ce": Family(lm_head_softcap_ce_family, ("forward", "train", "backward_saved")),
    # the attention outputs: o_proj + residual, and with Gemma 2/3's or OLMo 2's post-norm
    **{
        base: Family(lambda eps, base=base: attn_out_family(base, eps), ("forward", "backward"))
        for base in ("attn_out", "gemma2_attn_out", "olmo2_attn_out")
    },
}


class ShippedMismatch(ValueError):
    """The planner's Program for a block is not the shipped verified one (or the file is missing
    or edited); the message names the file and what to do."""


def lowered(block: Block, options: LoweringOptions | None = None) -> Program:
    """The built-in planner's Program for ``block`` (the export's one call into the planner)."""
    return lower(block, options)


class ShippedBlock(NamedTuple):
    """A block a file here holds the Program of (at ``SHIPPED_EPS``), with the lowering options
    of the family that ships it."""

    block: Block
    options: LoweringOptions


def shipped_blocks() -> list[ShippedBlock]:
    """Every shipped block and its family's options, in ``FAMILIES`` order."""
    return [
        ShippedBlock(f.blocks(SHIPPED_EPS)[key], f.options)
        for f in FAMILIES.values()
        for key in f.keys
    ]


def program_file(block_name: str) -> Path:
    """Where the shipped Program of the block ``block_name`` (at ``SHIPPED_EPS``) lives."""
    return PROGRAMS_DIR / f"{block_name}.json"


def render(shipped: ShippedBlock) -> str:
    """The file for a shipped block: the planner's Program now (with its family's options), its
    hash and those lowering options (indented, sorted JSON)."""
    program = lowered(shipped.block, shipped.options)
    entry = {
        "block": shipped.block.name,
        "options": asdict(shipped.options),
        "program_hash": content_hash(program.canonical_json()),
        "program": program.model_dump(mode="json"),
    }
    return json.dumps(entry, indent=1, sort_keys=True) + "\n"


def shipped_program(family: str, key: str, eps: float) -> Program:
    """The planner's Program for ``FAMILIES[family]``'s ``key`` block at ``eps``, when it is the
    shipped verified Program with that epsilon (see the module docstring); else
    ``ShippedMismatch``."""
    blocks = FAMILIES[family].blocks
    block, shipped = blocks(eps)[key], blocks(SHIPPED_EPS)[key]
    path = program_file(shipped.name)
    want = content_hash(_with_eps(_read(path)["program"], eps, block.name).canonical_json())
    program = lowered(block, FAMILIES[family].options)
    got = content_hash(program.canonical_json())
    if got != want:
        at = "" if eps == SHIPPED_EPS else f" once its epsilon is {eps:g} ({want})"
        raise ShippedMismatch(
            f"the planner's Program for {block.name} (hash {got}) is not the shipped verified "
            f"one in {path} (hash {_read(path)['program_hash']}{at}): the planner changed since "
            f"the file was written — rewrite the files with `{REWRITE}` and verify them "
            "(`make test`)"
        )
    return program


@cache
def _read(path: Path) -> dict[str, Any]:
    """The shipped file at ``path``, its Program checked against its recorded hash."""
    try:
        entry = json.loads(path.read_text())
        program = Program.parse(entry["program"])
        recorded = entry["program_hash"]
    except FileNotFoundError:
        raise ShippedMismatch(
            f"no shipped Program {path.name} in {path.parent}: write it with `{REWRITE}`"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ShippedMismatch(
            f"{path} is not a shipped Program file ({e}): rewrite it with `{REWRITE}`"
        ) from None
    actual = content_hash(program.canonical_json())
    if actual != recorded:
        raise ShippedMismatch(
            f"{path} was edited: its Program hashes to {actual}, not the recorded "
            f"{recorded} — rewrite it with `{REWRITE}`"
        )
    return entry


def _with_eps(data: dict[str, Any], eps: float, name: str) -> Program:
    """The shipped Program ``data`` with every ``eps`` field (``SHIPPED_EPS`` there) set to
    ``eps`` and its block named ``name``: what the planner must write for the block at ``eps``."""
    return Program.parse({**_replace_eps(data, eps), "block": name})


def _replace_eps(node: Any, eps: float) -> Any:
    if isinstance(node, dict):
        return {
            k: eps if k == "eps" and v == SHIPPED_EPS else _replace_eps(v, eps)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_replace_eps(v, eps) for v in node]
    return node


def stale_files() -> list[Path]:
    """The shipped files that are not byte for byte what ``render`` writes now (missing ones
    included), and files of blocks no longer shipped."""
    shipped = shipped_blocks()
    paths = [program_file(s.block.name) for s in shipped]
    stale = [
        path
        for entry, path in zip(shipped, paths, strict=True)
        if not path.is_file() or path.read_text() != render(entry)
    ]
    return stale + sorted(set(PROGRAMS_DIR.glob("*.json")) - set(paths))


def write_all() -> list[Path]:
    """Rewrite every shipped file from the planner's Programs now (and remove files of blocks no
    longer shipped); returns the files written. Verify them afterwards (``make test``)."""
    shipped = shipped_blocks()
    paths = [program_file(s.block.name) for s in shipped]
    for stale in set(PROGRAMS_DIR.glob("*.json")) - set(paths):
        stale.unlink()
    for entry, path in zip(shipped, paths, strict=True):
        path.write_text(render(entry))
    _read.cache_clear()
    return paths
