"""primitives/launch.py on a GPU: replays that call the C launch function directly, with their TMA
descriptors' tensor maps kept per base address, give the bits of launches through Triton
(skipped without a GPU). The subject is Triton's launches, so the fused steps run on the Triton
backend whatever ``CODA_EPILOGUE_BACKEND`` says (under ``auto`` they would run on QuACK's GEMM).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton

from coda.primitives import launch as launch_module
from coda.primitives.run_plans import Relaunch

pytestmark = pytest.mark.usefixtures("triton_backend")


def test_direct_replays_of_tma_kernels_are_triton_s_bit_for_bit_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One compiled Program replays its fused GEMMs (TMA descriptors) on fresh inputs whose
    addresses move from call to call — a kept tensor map must never stand for another address —
    and on the same inputs twice (kept maps reused); each call's outputs equal a fresh Program's
    launched through Triton (``CODA_TRITON_LAUNCH=1``'s path)."""
    replayed = _replayed_on_moving_addresses("llama_mlp", monkeypatch, calls=6, repeat_last=True)
    assert replayed.mainloops_used["down"] != "pointer"  # its operands went by descriptor

    entries = [
        action.launch.entry
        for plan in replayed._run_plans.values()
        for action in plan.actions
        if isinstance(action, Relaunch)
    ]
    direct = [e.direct for e in entries if e is not None and e.direct is not None]
    kept = [k for d in direct for k in d.kept_maps()]
    if triton.__version__.startswith(("3.6.", "3.9.")):  # the launchers direct_launch recognises
        assert kept and all(0 < len(k) <= 6 for k in kept), [len(k) for k in kept]


@pytest.mark.parametrize("name", ["llama_attn_in", "qwen3_attn_in_bwd"])
def test_pinned_sequences_replay_prep_and_aux_launches_bit_for_bit_gpu(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """What launches for itself replays through pinned sequences: the attention input's prep
    (its stacked QKV weight) and the rotary backward (an aux step with temporaries, called anew).
    On moving addresses each call equals a fresh Program's launched through Triton, and the
    sequences' launches went pinned (each pin holds the compiled kernel it relaunches)."""
    from coda.primitives.run_plans import AuxLaunch

    replayed = _replayed_on_moving_addresses(name, monkeypatch, calls=4)
    sequences = list(replayed._prep_launches.values()) + [
        action.pinned
        for plan in replayed._run_plans.values()
        for action in plan.actions
        if isinstance(action, AuxLaunch)
    ]
    pins = [pin for sequence in sequences for pin in sequence.pins if pin is not None]
    assert pins and all(pin.entry is not None for pin in pins)


def _replayed_on_moving_addresses(
    name: str, monkeypatch: pytest.MonkeyPatch, *, calls: int, repeat_last: bool = False
) -> Any:
    """Block ``name``'s Program compiled once and called ``calls`` times in bf16 on fresh inputs
    whose addresses move from call to call (``repeat_last``: the last call repeats the previous
    one's inputs); each call's outputs must equal a fresh Program's launched through Triton
    (``CODA_TRITON_LAUNCH=1``'s path). Returns the compiled Program."""
    from coda.blocks import get_block
    from coda.planner import lower
    from coda.primitives import analyze, compile_program

    block = get_block(name)
    program = lower(block)
    sizes = block.shapes.gpu[0]
    replayed = compile_program(program, analyze(program, sizes))
    shifts = []  # allocations kept alive so that later inputs and outputs land elsewhere
    for i in range(calls):
        if not (repeat_last and i == calls - 1):
            inputs = block.make_inputs(sizes, torch.bfloat16, seed=i, device="cuda")
        got = replayed(inputs)
        monkeypatch.setattr(launch_module, "DIRECT", False)
        want = compile_program(program, analyze(program, sizes))(inputs)
        monkeypatch.setattr(launch_module, "DIRECT", True)
        for out in want:
            assert torch.equal(got[out], want[out]), (i, out)
        shifts.append(torch.empty((i + 1) * 4096 + 256, dtype=torch.uint8, device="cuda"))
    return replayed
