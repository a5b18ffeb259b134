"""Fresh shapes and input distributions beyond a block's shape sets, for the semantics stage.

A program can be right only where it is checked: a size expression equal to the true one at the
shape sets alone, a ``where`` that behaves differently once values leave N(0, 1). So the semantics
stage also runs at shapes drawn per run and at several input distributions.

**Shapes.** Drawn shapes must be valid bindings of the block: heads × head width, pair widths,
``Nqkv = Nq + 2·Nkv``. A block does not list such relations; its shape sets show them, and every
relation that holds at *all* of them (CPU, GPU and benchmark sets) is kept (``SizeRelations``):

* ``derived``: a size that is a small positive combination of one or two others at every set
  (``N2 = 2·N``, ``Nqkv = Nq + 2·Nkv``) is computed, not drawn;
* ``multiple_of``: a size divisible by another at every set (``Nq`` by the head width ``D``) is
  drawn as a multiple of it;
* ``granule``: every drawn size is a multiple of the gcd of its values in the sets (``D`` even);
* ``power_of_two``: the head width of a ``HeadRMSNorm`` (its weight's size) that is a power of
  two at every set is drawn as one, at most ``MAX_HEAD_WIDTH``: a per-head norm is lowered
  inside an epilogue sub-tile holding whole heads, which only such widths fit.

A relation that holds by accident only narrows the draws (they stay valid bindings). The row count
``M`` takes no part in relations and stays small (float64 on the CPU): at most ``MAX_ROWS``, and
in the first draw none of the values the shape sets give it. The other sizes are drawn
log-uniformly up to ``MAX_SIZE`` — in the first draw every size beyond the largest value the CPU
shape sets give it — as long as no input of the block exceeds ``MAX_ELEMENTS``.

**Values** (``SCENARIOS``): the block's own init (``standard``), activations ×1e-3 and ×30, weights
×30 (a threshold behind a norm sees only these), heavy-tailed activations (Student-t with two
degrees of freedom) and activation rows whose norms span 1e-3…1e3. Index inputs are never
changed; saved activations are re-derived from the changed inputs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import reduce
from itertools import combinations, product
from typing import Any

import torch

from .block import Block
from .ops import HeadRMSNorm

ROWS = "M"  # the token dimension: kept small, never related to other sizes
MAX_ROWS = 40
MAX_SIZE = 4096
MAX_ELEMENTS = 1 << 17  # per input tensor: 1 MiB in float64
MAX_COEFF = 4  # derived sizes: c1·a (+ c2·b) with 1 ≤ c ≤ MAX_COEFF
MAX_HEAD_WIDTH = 256  # the widest epilogue sub-tile (block_n ≤ 256)


@dataclass(frozen=True)
class SizeRelations:
    """What every shape set of a block agrees on (see the module docstring)."""

    free: list[str]  # drawn, in an order where every divisor comes first
    derived: dict[str, dict[str, int]]  # size -> {other size: coefficient}
    multiple_of: dict[str, list[str]] = field(default_factory=dict)
    granule: dict[str, int] = field(default_factory=dict)
    power_of_two: frozenset[str] = frozenset()

    def describe(self) -> str:
        parts = [
            f"{s} = " + " + ".join(f"{c}·{o}" if c != 1 else o for o, c in terms.items())
            for s, terms in self.derived.items()
        ]
        parts += [f"{s} a multiple of {', '.join(d)}" for s, d in self.multiple_of.items() if d]
        parts += [f"{s} a multiple of {g}" for s, g in self.granule.items() if g > 1]
        parts += [f"{s} a power of two ≤ {MAX_HEAD_WIDTH}" for s in sorted(self.power_of_two)]
        return "; ".join(parts) or "none"


def size_names(block: Block) -> list[str]:
    """The block's size names, in the order its inputs first use them."""
    names: dict[str, None] = {}
    for spec in block.inputs.values():
        names.update({d: None for d in spec.shape if isinstance(d, str)})
    return list(names)


def infer_relations(block: Block) -> SizeRelations:
    """The relations every shape set of ``block`` satisfies (see the module docstring)."""
    sets = [*block.shapes.cpu, *block.shapes.gpu, *block.shapes.bench]
    names = [n for n in size_names(block) if n != ROWS]
    derived: dict[str, dict[str, int]] = {}
    for name in names:
        terms = _combination(name, [n for n in names if n != name and n not in derived], sets)
        if terms is not None:
            derived[name] = terms
    free = [n for n in names if n not in derived]
    multiple_of = {
        s: [
            t
            for t in free
            if t != s and all(v[s] % v[t] == 0 for v in sets) and any(v[s] != v[t] for v in sets)
        ]
        for s in free
    }
    granule = {s: reduce(math.gcd, (v[s] for v in sets)) for s in free}
    order = sorted(free, key=lambda s: _depth(s, multiple_of))
    powers = frozenset(_head_widths(block) & set(free))
    powers = frozenset(s for s in powers if all(v[s] & (v[s] - 1) == 0 for v in sets))
    return SizeRelations(order, derived, multiple_of, granule, powers)


def _head_widths(block: Block) -> set[str]:
    """The size names of the weights of the block's ``HeadRMSNorm`` ops (their head widths)."""
    heads = [op.weight for op in block.graph if isinstance(op, HeadRMSNorm)]
    shapes = [block.inputs[w].shape for w in heads if w in block.inputs]
    return {d for shape in shapes for d in shape if isinstance(d, str)}


def _combination(name: str, others: list[str], sets: list[dict[str, int]]) -> dict[str, int] | None:
    """``{other: c}`` with ``name = Σ c·other`` at every set (one or two terms), or None."""
    coeffs = range(1, MAX_COEFF + 1)
    for (a,), c in product(combinations(others, 1), coeffs):
        if all(v[name] == c * v[a] for v in sets):
            return {a: c}
    for (a, b), (ca, cb) in product(combinations(others, 2), product(coeffs, coeffs)):
        if all(v[name] == ca * v[a] + cb * v[b] for v in sets):
            return {a: ca, b: cb}
    return None


def _depth(name: str, multiple_of: dict[str, list[str]]) -> int:
    """How many divisibility links lie below ``name`` (divisors are drawn first)."""
    below = multiple_of.get(name, [])
    return 1 + max((_depth(d, multiple_of) for d in below), default=0) if below else 0


def draw_shapes(block: Block, count: int, rng: random.Random) -> list[dict[str, int]]:
    """``count`` fresh bindings of the block's sizes, valid under its relations and bounded in
    size: the first with every drawn size beyond the block's CPU shape sets, the others anywhere
    from 2 to ``MAX_SIZE``. Raises ``ValueError`` naming the block if none can be drawn."""
    relations = infer_relations(block)
    beyond: dict[str, Any] = {s: max(v[s] for v in block.shapes.cpu) + 1 for s in relations.free}
    anywhere: dict[str, Any] = dict.fromkeys(relations.free, 2)
    if ROWS in size_names(block):
        beyond[ROWS], anywhere[ROWS] = {v[ROWS] for v in block.shapes.cpu}, set()
    lows = [beyond] + [anywhere] * (count - 1)
    return [_draw_one(block, relations, low, rng) for low in lows[:count]]


def _draw_one(
    block: Block, rel: SizeRelations, low: dict[str, Any], rng: random.Random
) -> dict[str, int]:
    """One binding: each free size log-uniform from ``low[size]`` to ``MAX_SIZE`` (shrunk while
    a tensor is too large), ``M`` avoiding the values in ``low[M]``."""
    top = MAX_SIZE
    for _ in range(64):
        sizes = {}
        if ROWS in low:  # at most MAX_ROWS; in the first draw, none of the shape sets' values
            rows = [m for m in range(1, MAX_ROWS + 1) if m not in low[ROWS]]
            sizes[ROWS] = rng.choice(rows or list(range(1, MAX_ROWS + 1)))
        for name in rel.free:
            step = reduce(_lcm, (sizes[d] for d in rel.multiple_of[name]), rel.granule[name])
            value = _log_uniform(rng, min(low[name], top), top)
            sizes[name] = step * max(1, math.ceil(value / step))
            if name in rel.power_of_two:  # the granule of powers of two is one too
                sizes[name] = max(step, min(MAX_HEAD_WIDTH, 1 << round(math.log2(value))))
        for name, terms in rel.derived.items():
            sizes[name] = sum(c * sizes[o] for o, c in terms.items())
        if _fits(block, sizes):
            return sizes
        top = max(8, top * 3 // 4)  # too large a tensor: draw smaller
    raise ValueError(
        f"block {block.name!r}: no shape within {MAX_ELEMENTS} elements per tensor could be drawn "
        f"under the relations its shape sets show ({rel.describe()})"
    )


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def _fits(block: Block, sizes: dict[str, int]) -> bool:
    """Every input of the block at ``sizes`` is within ``MAX_ELEMENTS``. (Its graph's other
    values are ``[M, size]`` wide at most, or shaped like an input, as a weight's gradient is.)"""
    return all(math.prod(block.shape_of(n, sizes)) <= MAX_ELEMENTS for n in block.inputs)


# -- input distributions ---------------------------------------------------------------------------
Inputs = dict[str, torch.Tensor]
Transform = Callable[[Block, Inputs, dict[str, int], torch.Generator], Inputs]

WEIGHTS = ("linear_weight", "norm_weight")


def _kind(block: Block, name: str, kinds: tuple[str, ...]) -> bool:
    spec = block.inputs[name]
    return spec.init in kinds and spec.dtype != "int64"


def _scaled(kinds: tuple[str, ...], factor: float) -> Transform:
    def apply(block: Block, inputs: Inputs, sizes: dict[str, int], gen: torch.Generator) -> Inputs:
        return {n: t * factor if _kind(block, n, kinds) else t for n, t in inputs.items()}

    return apply


def _heavy_tailed(block: Block, inputs: Inputs, sizes: dict[str, int], gen: torch.Generator):
    """Activations from Student-t with 2 degrees of freedom: N(0,1) / sqrt(χ²₂ / 2)."""
    out = dict(inputs)
    for n, t in inputs.items():
        if _kind(block, n, ("activation",)):
            chi2 = torch.randn((2, *t.shape), generator=gen, dtype=torch.float64).pow(2).mean(0)
            out[n] = t / chi2.sqrt().to(t.dtype)
    return out


def _row_norms(block: Block, inputs: Inputs, sizes: dict[str, int], gen: torch.Generator):
    """Each token row of every activation scaled by 10^u, u ~ U(-3, 3) (one factor per row,
    shared by all activations, as a token's hidden state is one vector)."""
    if ROWS not in sizes:
        return inputs
    factors = 10.0 ** (6 * torch.rand(sizes[ROWS], generator=gen, dtype=torch.float64) - 3)
    out = dict(inputs)
    for n, t in inputs.items():
        spec = block.inputs[n]
        if _kind(block, n, ("activation",)) and spec.shape and spec.shape[0] == ROWS:
            out[n] = t * factors.to(t.dtype).reshape(-1, *[1] * (t.dim() - 1))
    return out


def _standard(block: Block, inputs: Inputs, sizes: dict[str, int], gen: torch.Generator):
    return inputs


SCENARIOS: dict[str, Transform] = {
    "standard": _standard,
    "activations ×1e-3": _scaled(("activation",), 1e-3),
    "activations ×30": _scaled(("activation",), 30.0),
    "weights ×30": _scaled(WEIGHTS, 30.0),
    "Student-t(2) activations": _heavy_tailed,
    "activation rows of norms 1e-3…1e3": _row_norms,
}


def scenario_inputs(
    block: Block,
    sizes: dict[str, int],
    scenario: str,
    seed: int,
    dtype: torch.dtype,
    base: Inputs | None = None,
) -> Inputs:
    """The block's seeded inputs at ``sizes`` (or ``base``, already drawn so) under ``scenario``
    (a key of ``SCENARIOS``); saved inputs are re-derived from the changed ones."""
    inputs = base if base is not None else block.make_inputs(sizes, dtype, seed=seed)
    if scenario == "standard":
        return inputs
    gen = torch.Generator().manual_seed(seed + 1)
    changed = SCENARIOS[scenario](block, inputs, sizes, gen)
    return block.with_derived(changed)
