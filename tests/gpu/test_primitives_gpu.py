"""Every primitive in bfloat16 and float16 on a GPU, through both mainloops (skipped without one).

The cases are the CPU suite's (``tests/primitives/test_ops.py``): a primitive added there is covered
here too. bfloat16 is only checked here — ``tl.dot`` on bfloat16 is wrong in Triton's interpreter.
The subject is the Triton kernels — their mainloops, configs and epilogue tiles — so every test
runs them on the Triton backend whatever ``CODA_EPILOGUE_BACKEND`` says (under ``auto`` or
``cute`` a fused step would run on QuACK's GEMM instead, which ``test_cute_gpu.py`` covers).
"""

from __future__ import annotations

import pytest
import torch

from tests.primitives.test_ops import ALL_CASES, CASES, EXTRA_CASES, HALF_SPACE_CASES, _run_case

pytestmark = pytest.mark.usefixtures("triton_backend")


# Ragged everywhere, with K·2 bytes a multiple of 16 (TMA-describable operands; the epilogue's
# N-wide rows are not, so its tiles move by pointer behind the TMA mainloop)...
ALIGNED = {"M": 300, "N": 258, "K": 200}
# ...and K·2 bytes not a multiple of 16: the pointer mainloop is chosen.
UNALIGNED = {"M": 129, "N": 130, "K": 45}
# Ragged M and N whose rows TMA can describe in every column space (N/2, N, 2N in 16 bits): the
# epilogue's tiles move by TMA too — zero-filled loads and clipped stores at the edges.
TMA_TILES = {"M": 300, "N": 272, "K": 200}
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_primitive_gpu(name: str, dtype: torch.dtype) -> None:
    _run_case(CASES[name], ALIGNED, dtype, device="cuda")


MORE_CASES = {**EXTRA_CASES, **{f"half_space[{k}]": v for k, v in HALF_SPACE_CASES.items()}}


@pytest.mark.parametrize("name", sorted(MORE_CASES))
def test_reductions_and_half_space_gpu(name: str) -> None:
    _run_case(MORE_CASES[name], ALIGNED, torch.bfloat16, device="cuda")


@pytest.mark.parametrize("mainloop", ["tma", "pointer"])
@pytest.mark.parametrize("name", ["add_tile", "swiglu", "partial_reduce"])
def test_both_mainloops_gpu(mainloop: str, name: str) -> None:
    _run_case(CASES[name], ALIGNED, torch.bfloat16, device="cuda", mainloop=mainloop)


@pytest.mark.parametrize("name", ["add_tile", "swiglu"])
def test_unaligned_operands_fall_back_to_pointers(name: str) -> None:
    _run_case(CASES[name], UNALIGNED, torch.bfloat16, device="cuda")


@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, True)])
def test_transposed_operands_gpu(a_t: bool, b_t: bool) -> None:
    _run_case(
        CASES["add_tile"],
        {"M": 304, "N": 256, "K": 200},
        torch.bfloat16,
        a_t=a_t,
        b_t=b_t,
        device="cuda",
    )


HOPPER_CONFIGS = [
    {"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "epilogue_subtiles": 2},
    # eight 32-column sub-tiles (three levels of tl.split), the tuning spaces' backward candidate
    {"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "epilogue_subtiles": 8},
    {
        "block_m": 128,
        "block_n": 128,
        "block_k": 64,
        "num_stages": 4,
        "epilogue_subtiles": 4,
        "flatten": True,
        "warp_specialize": True,
    },
    # flattened without warp specialization (QUICK_SPACE has two such candidates)
    {
        "block_m": 128,
        "block_n": 128,
        "block_k": 64,
        "num_stages": 4,
        "epilogue_subtiles": 2,
        "flatten": True,
    },  # fmt: skip
    {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4},
    # two programs per SM, one with a register cap (the tuning space's occupancy candidates)
    {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2},
    {
        "block_m": 128,
        "block_n": 128,
        "num_stages": 3,
        "epilogue_subtiles": 4,
        "programs_per_sm": 2,
        "maxnreg": 128,
    },
]


@pytest.mark.parametrize("config", HOPPER_CONFIGS)
def test_hopper_configs_gpu(config: dict) -> None:
    _run_case(CASES["swiglu"], ALIGNED, torch.bfloat16, config=config, device="cuda")
    _run_case(HALF_SPACE_CASES["add_tile"], ALIGNED, torch.bfloat16, config=config, device="cuda")
    # the same through TMA epilogue tiles (TMA_TILES below), flattened / warp-specialized too
    for case in (CASES["swiglu"], HALF_SPACE_CASES["add_tile"], CASES["pairwise"]):
        _run_case(case, TMA_TILES, torch.bfloat16, config=config, device="cuda")
    # reductions across the tile on tl.split sub-tiles, flattened / warp-specialized too (on
    # 2026-11-29 Triton 3.6 computed such reductions wrong on an H200: this is where it would show)
    for name in ("partial_reduce[sumsq,row]", "partial_reduce[max,col]", "partial_reduce[lse,row]"):
        _run_case(EXTRA_CASES[name], ALIGNED, torch.bfloat16, config=config, device="cuda")
    _run_case(CASES["select_column"], ALIGNED, torch.bfloat16, config=config, device="cuda")


def test_small_tiles_gpu() -> None:
    # many tiles per row: the partials and the select/onehot edges across tile boundaries
    config = {"block_m": 32, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}
    for name in ("select_column", "rope", "pairwise"):
        _run_case(CASES[name], ALIGNED, torch.bfloat16, config=config, device="cuda")
    _run_case(
        EXTRA_CASES["partial_reduce[lse,row]"],
        ALIGNED,
        torch.bfloat16,
        config=config,
        device="cuda",
    )


# Two sub-tiles keep the staged tiles within shared memory next to a 3-stage pipeline.
TWO_SLICES = {
    "block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 3, "epilogue_subtiles": 2
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_tma_epilogue_tiles_gpu(name: str) -> None:
    case = ALL_CASES[name]
    _run_case(
        case, TMA_TILES, torch.bfloat16, config=TWO_SLICES, device="cuda", expect_variants={"tma"}
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fold_prep_kernel_rounds_like_pytorch_gpu(dtype: torch.dtype) -> None:
    """Prep ``fold_norm_weight`` on the GPU (the Triton kernel): bit for bit the fp32 formula and
    PyTorch's own 16-bit multiply, at the LM head's shape and a ragged one."""
    from coda.primitives.base import RunEnv
    from coda.primitives.prep.fold_norm_weight import FoldNormWeight

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, cols in [(32000, 2048), (301, 37)]:
        w = (torch.randn(rows, cols, device="cuda", generator=gen) * 3).to(dtype)
        scale = torch.logspace(-3, 3, cols, device="cuda")
        gamma = (torch.randn(cols, device="cuda", generator=gen) * scale).to(dtype)
        env = RunEnv({"w": w, "gamma": gamma}, {})
        FoldNormWeight(weight="w", gamma="gamma", out="wg").apply(env)
        got = env.tensors["wg"]
        assert torch.equal(got, (w.float() * gamma.float()[None, :]).to(dtype))
        assert torch.equal(got, w * gamma[None, :])


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_scaling_in_place_by_a_device_factor_is_mul_bit_for_bit_gpu(dtype: torch.dtype) -> None:
    """``scale_unless_one`` on the GPU (the kernel, its factor a 0-dim fp32 tensor there, as
    autograd hands a loss's backward): the product in fp32 rounded once, bit for bit, at the LM
    head's weight gradient's shape and a ragged one; a factor of exactly 1 rewrites nothing.
    (``mul_`` on the GPU rounds such a factor to the tensor's 16-bit dtype first.)"""
    from coda.primitives.scale_in_place import scale_unless_one

    gen = torch.Generator(device="cuda").manual_seed(1)
    for shape in [(32000, 2048), (301, 37)]:
        t = (torch.randn(shape, device="cuda", generator=gen) * 5).to(dtype)
        for value in [1.0, 0.37, -3.0, 0.0]:
            factor = torch.tensor(value, device="cuda")
            want = (t.float() * value).to(dtype)
            scale_unless_one((t,), factor)
            assert torch.equal(t, want), (shape, value)


def test_one_launch_scales_a_loss_s_three_gradients_bit_for_bit_gpu() -> None:
    """``scale_unless_one`` over dx, dγ and dW (bf16, fp32, bf16; the LM head's shapes) in one
    launch: each the fp32 product rounded once, and a factor of exactly 1 rewrites nothing."""
    from coda.primitives.launch import recorded_launches
    from coda.primitives.scale_in_place import scale_unless_one

    gen = torch.Generator(device="cuda").manual_seed(3)
    made = [
        torch.randn(2048, 2048, device="cuda", generator=gen).to(torch.bfloat16),
        torch.randn(2048, device="cuda", generator=gen),
        torch.randn(128256, 2048, device="cuda", generator=gen).to(torch.bfloat16),
    ]
    for value in [1.0, 0.37, -3.0]:
        ts = [t.clone() for t in made]
        with recorded_launches() as launches:
            scale_unless_one(ts, torch.tensor(value, device="cuda"))
        assert len(launches) == 1
        for got, t in zip(ts, made, strict=True):
            assert torch.equal(got, (t.float() * value).to(t.dtype)), (t.shape, value)


def test_next_token_targets_in_one_launch_are_the_ops_bit_for_bit_gpu() -> None:
    """``next_token_targets`` on the GPU (the one-program kernel) against the PyTorch ops of the
    fused loss's targets and weights, bit for bit: a training step's labels (16384 tokens, a
    batch of sequences with padding ignored), a ragged batch, each denominator — the count,
    Hugging Face's ``num_items_in_batch`` as a device tensor and as an int —, and with the
    vocabulary given, labels outside it weighing NaN in both."""
    from coda.primitives.loss_targets import (
        IGNORE_INDEX,
        next_token_targets,
        targets_by_ops,
    )

    gen = torch.Generator(device="cuda").manual_seed(2)
    for shape in [(8, 2048), (3, 1001)]:
        labels = torch.randint(0, 128256, shape, device="cuda", generator=gen)
        labels[:, -17:] = IGNORE_INDEX  # padding
        for num_items in [None, torch.tensor(9000, device="cuda"), 4321]:
            got = next_token_targets(labels, num_items)
            want = targets_by_ops(labels, num_items)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
        outside = labels.clone()
        outside[0, 5], outside[-1, 9] = 128256, -3
        got = next_token_targets(outside, None, 128256)
        want = targets_by_ops(outside, None, 128256)
        assert got[1].isnan().sum() == 2
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("block", ["llama_attn_in", "llama_attn_in_bwd_saved"])
def test_fused_prep_chains_are_the_steps_bit_for_bit_gpu(block: str, dtype: torch.dtype) -> None:
    """The attention input's ``rope_pairs`` → ``concat_rows`` (→ ``fold_norm_weight``) chain run
    fused on the GPU (``prep/fusion.py``: the row kernel gathers, scales and places each part) —
    the same bits as the steps one by one, at the block's GPU shapes, with GQA."""
    from coda.primitives.analysis import analyze, bind_sizes
    from coda.primitives.runtime import compile_program
    from tests.primitives.test_prep_fusion import _block_case, _one_by_one, _shapes

    program, inputs = _block_case(block, dtype, shapes="gpu")
    inputs = {n: t.cuda() for n, t in inputs.items()}
    compiled = compile_program(program, analyze(program, bind_sizes(program, _shapes(inputs))))
    prepared = compiled.prepare(inputs)
    eager = _one_by_one(program, inputs, compiled.info_for(inputs).sizes)
    last = program.prep[-1].out
    assert prepared[last].is_cuda and torch.equal(prepared[last], eager[last])
    assert not any(step.out in prepared for step in program.prep[:-1])


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_a_qkv_stack_is_one_launch_bit_for_bit_gpu(offset: float) -> None:
    """The attention input's QKV weight in bfloat16 — Q and K rows in RoPE-pair order, V whole,
    γ folded (Gemma's fp32 ``1 + γ`` too) — written by the row kernel in one launch, at a GQA
    shape and a ragged one: the bits of ``pair_rows`` / ``cat`` / ``fold_columns``."""
    from coda.primitives.launch import recorded_launches
    from coda.primitives.prep.fold_norm_weight import fold_columns, offset_gamma
    from coda.primitives.prep.fusion import RowStack
    from coda.primitives.prep.layout import pair_rows
    from coda.primitives.prep.rows import _assemble_rows_kernel

    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    # (Q heads, K/V heads, head_dim, hidden): Llama-3-8B-like GQA, and ragged rows and columns
    for heads, kv_heads, head_dim, hidden in [(32, 8, 128, 4096), (5, 3, 6, 301)]:
        q, k, v = (
            (torch.randn(n * head_dim, hidden, device=device, generator=gen) * 3).bfloat16()
            for n in (heads, kv_heads, kv_heads)
        )
        scale = torch.logspace(-3, 3, hidden, device=device)
        gamma = (torch.randn(hidden, device=device, generator=gen) * scale).bfloat16()
        gamma = offset_gamma(gamma, offset, torch.bfloat16)
        stack = RowStack(((q, head_dim), (k, head_dim), (v, 0)), gamma)
        with recorded_launches() as launches:
            got = stack.write(torch.bfloat16)
        assert [call[0] for call in launches] == [_assemble_rows_kernel]
        stacked = torch.cat([pair_rows(q, head_dim), pair_rows(k, head_dim), v])
        want = (stacked.float() * gamma.float()[None, :]).bfloat16()
        assert torch.equal(got, want), (heads, head_dim, hidden)
        assert torch.equal(got, fold_columns(stacked, gamma, torch.float32))


def test_run_plans_replay_on_the_gpu() -> None:
    """CompiledProgram's run plans with the direct launch path (``PinnedLaunch``, unchecked
    descriptors): calls alternating between TMA-describable inputs and a misaligned weight (the
    pointer kernel) and between two dtypes replay their own plans and give a fresh program's
    bits each time."""
    from coda.blocks import get_block
    from coda.planner import lower
    from coda.primitives import analyze, compile_program
    from tests.primitives.test_run_plans import misaligned

    block = get_block("llama_mlp")
    program = lower(block)
    sizes = block.shapes.gpu[0]
    shared = compile_program(program, analyze(program, sizes))

    calls = []
    for i, (dtype, skew) in enumerate(
        [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)] * 2
    ):
        inputs = block.make_inputs(sizes, dtype, seed=i, device="cuda")
        if skew:
            inputs["w_down"] = misaligned(inputs["w_down"])
        fresh = compile_program(program, analyze(program, sizes))
        got, want = shared(inputs), fresh(inputs)
        for name in want:
            assert torch.equal(got[name], want[name]), (i, name)
        assert shared.mainloops_used == fresh.mainloops_used
        calls.append(dict(shared.mainloops_used))
    assert calls[1]["down"] == "pointer" and calls[0]["down"] != "pointer"
    assert calls[:3] == calls[3:]  # the replays chose what their recordings chose
    assert len(shared._run_plans) == 3
