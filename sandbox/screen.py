"""Input screens: every block input must matter, and a program's outputs must follow each one.

A trivial program — one that ignores an input, or returns something that happens to be close — must
not pass. Two screens, each redrawing one input at a time (a fresh draw from the block's own input
factory, so the perturbation is as large as the input itself; saved forward activations are
re-derived from the redrawn inputs, never redrawn alone):

* **block screen** (semantics stage, in the caller, float64, every CPU shape set, once per block):
  the reference must be a function of its inputs — the same outputs twice, its inputs left as
  they were (``check_reference_is_a_function``) — and must move by at least
  ``MIN_EFFECT × rel[float32]`` (relative) when an input is redrawn. If it does not, no check
  can tell a program that uses the input from one that ignores it: the block (or that shape set)
  is degenerate, and that is reported as the block's fault.
* **program screen** (verify stage, the compiled kernels, float32, the smallest verify shape, after
  every output check passed): for each input and output, the program's change must match the
  reference's change within ``FOLLOW_TOL`` of its size, plus float32 noise (``2 × rel[float32]``
  of the output). It catches kernels whose ordinary errors hide under a loose dtype's tolerance
  (bf16 on a GPU) and names the input that is not honoured.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from coda.blocks.block import Block

from .errors import StageFailure

MIN_EFFECT = 10.0  # × the float32 relative bound: an input must move the reference at least this
FOLLOW_TOL = 0.1  # the program's change may be off by 10 % of the reference's change (+ noise)
ALT_SEED = 7919  # the redraws' seed: independent of the verification seeds

Outputs = dict[str, torch.Tensor]


def where(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.detach().cpu().double()))


def _to64(t: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    t = t.detach().to(device)
    return t.double() if t.is_floating_point() else t


def redraws(
    block: Block, sizes: dict[str, int], dtype: torch.dtype, device: str
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The base inputs (seed 0) and, per independent input, the base inputs with that one input
    redrawn. Saved inputs (forward activations a backward block receives) are not redrawn on
    their own — the block is defined only where they match the inputs they came from — but are
    re-derived whenever an input they depend on is redrawn."""
    base = block.make_inputs(sizes, dtype, seed=0, device=device)
    alt = block.make_inputs(sizes, dtype, seed=ALT_SEED, device=device)
    return base, {
        name: block.with_derived({**base, name: alt[name]}) for name in block.independent_inputs()
    }


def reference64(
    block: Block, inputs: dict[str, torch.Tensor], device: torch.device | str = "cpu"
) -> Outputs:
    """The block's reference in float64, on ``device`` (verify passes the inputs' own: at a GPU
    shape set the float64 products take seconds each on a CPU, milliseconds on the GPU; float64
    is IEEE on both, so only the summation order differs, ~1e-16 relative)."""
    return block.reference({n: _to64(t, device) for n, t in inputs.items()})


# -- the block screen ------------------------------------------------------------------------------
_SCREENED: dict[tuple[str, str], None] = {}


def input_effects(block: Block, sizes: dict[str, int]) -> dict[str, dict[str, float]]:
    """``effects[input][output]``: ‖Δreference‖ / ‖reference‖ with that input redrawn (float64)."""
    base, perturbed = redraws(block, sizes, torch.float64, "cpu")
    ref = reference64(block, base)
    effects: dict[str, dict[str, float]] = {}
    for name, inputs in perturbed.items():
        moved = reference64(block, inputs)
        effects[name] = {
            o: _norm(moved[o] - ref[o]) / max(_norm(ref[o]), 1e-300) for o in block.outputs
        }
    return effects


def screen_block(block: Block, shapes: list[dict[str, int]]) -> None:
    """Raise ``StageFailure(cause="block")`` if some input barely moves the reference."""
    key = (block.model_dump_json(), repr(shapes))
    if key in _SCREENED:
        return
    floor = MIN_EFFECT * block.tolerance.rel.get("float32", 1e-5)
    if shapes:
        check_reference_is_a_function(block, shapes[0])
    for sizes in shapes:
        for name, per_output in input_effects(block, sizes).items():
            effect = max(per_output.values())
            if math.isnan(effect) or effect < floor:
                raise StageFailure(_degenerate(block, name, effect, floor, sizes), cause="block")
    _SCREENED[key] = None


def check_reference_is_a_function(block: Block, sizes: dict[str, int]) -> None:
    """Raise ``StageFailure(cause="block")`` unless the block's reference leaves its inputs as
    they are and gives the same outputs twice on the same inputs (float64, CPU). A reference that
    changes an input in place hands the program other inputs than it was judged on (and makes
    the program look like the one that wrote them); one that draws random numbers makes every
    program look wrong."""
    inputs = block.make_inputs(sizes, torch.float64, seed=0)
    kept = {n: t.clone() for n, t in inputs.items()}
    first = block.reference(inputs)
    head = f"block {block.name!r}: its reference "
    tail = ". This is a fault of the block, not of the program"
    for name, before in kept.items():
        if not torch.equal(before, inputs[name]):
            changed = int((before != inputs[name]).sum())
            raise StageFailure(
                f"{head}modifies its input {name!r} in place ({changed} elements changed at "
                f"{where(sizes)}): a reference must leave its inputs as they are — work on a "
                f"copy (e.g. {name} = {name}.clone() before an in-place op){tail}",
                cause="block",
            )
    second = block.reference({n: t.clone() for n, t in kept.items()})
    for o in block.outputs:
        if not torch.equal(first[o], second[o]):
            moved = _norm(first[o] - second[o]) / max(_norm(first[o]), 1e-300)
            raise StageFailure(
                f"{head}gives different outputs on the same inputs (output {o!r} moved by "
                f"{moved:.2g}, relative, between two calls at {where(sizes)}): it must be a "
                f"function of its inputs — no random draws (torch.randn, dropout in training "
                f"mode){tail}",
                cause="block",
            )


def _degenerate(block: Block, name: str, effect: float, floor: float, sizes: dict) -> str:
    head = f"block {block.name!r} cannot judge programs at {where(sizes)}: "
    if not effect > 0:
        what = f"redrawing input {name!r} leaves every output unchanged"
    else:
        what = (
            f"redrawing input {name!r} moves the outputs by only {effect:.2g} (relative), below "
            f"{floor:.2g} (= {MIN_EFFECT:g} × the float32 bound)"
        )
    return (
        head + what + ", so a program that ignores it could pass. This is a fault of the block, "
        "not of the program: make the input matter (its graph, its init scale) or change the "
        "shape set"
    )


# -- the program screen ----------------------------------------------------------------------------
def screen_program(
    run: Callable[[dict[str, torch.Tensor]], Outputs],
    block: Block,
    sizes: dict[str, int],
    device: str,
) -> str:
    """Redraw each input; each output of ``run`` must move as the reference does. Returns a summary;
    raises ``StageFailure(cause="screen")`` naming the input and output that do not."""
    rel32 = block.tolerance.rel.get("float32", 1e-5)
    base, perturbed = redraws(block, sizes, torch.float32, device)
    out, ref = run(base), reference64(block, base)
    _check_finite(out, sizes)
    for name, inputs in perturbed.items():
        moved_out, moved_ref = run(inputs), reference64(block, inputs)
        for o in block.outputs:
            d_ref = moved_ref[o] - ref[o]
            d_out = _to64(moved_out[o]) - _to64(out[o])
            scale = max(_norm(ref[o]), _norm(moved_ref[o]))
            err, allowed = _norm(d_out - d_ref), FOLLOW_TOL * _norm(d_ref) + 2 * rel32 * scale
            if not err <= allowed:
                raise StageFailure(
                    _not_following(o, name, d_ref, d_out, err, scale, sizes), cause="screen"
                )
    derived = sorted(set(block.inputs) - set(perturbed))
    note = f"; {', '.join(derived)} re-derived with them" if derived else ""
    return (
        f"every output follows each of the {len(perturbed)} inputs{note} (screened at "
        f"{where(sizes)})"
    )


def _check_finite(out: Outputs, sizes: dict[str, int]) -> None:
    for o, t in out.items():
        if not bool(torch.isfinite(t).all()):
            raise StageFailure(
                f"output {o!r} has NaN/Inf values in float32 at {where(sizes)} (the input "
                "screen's run)",
                cause="mismatch",
                hint="outputs are pre-filled with NaN: some elements were never written",
            )


def _not_following(
    output: str,
    name: str,
    d_ref: torch.Tensor,
    d_out: torch.Tensor,
    err: float,
    scale: float,
    sizes: dict[str, int],
) -> str:
    ref_move, out_move = _norm(d_ref) / scale, _norm(d_out) / scale
    at = f"at {where(sizes)} in float32"
    if _norm(d_ref) == 0:
        return (
            f"output {output!r} moves by {out_move:.2g} (relative) when input {name!r} is "
            f"redrawn, but the block's output does not depend on {name!r} ({at}) — a kernel "
            "reads memory it should not: a wrong tensor, stride, or elements past an edge"
        )
    return (
        f"output {output!r} does not follow input {name!r}: redrawing {name!r} moves the block's "
        f"reference by {ref_move:.2g} (relative) but the program's output by {out_move:.2g}; the "
        f"program's change is off by {err / _norm(d_ref):.0%} of it (allowed "
        f"{FOLLOW_TOL:.0%} + float32 noise) {at} — semantics passed, so the program's algebra "
        f"uses {name!r}; the generated kernels do not apply it as the reference executor does: "
        f"check the ops that read {name!r} (directly or through a prep step)"
    )
