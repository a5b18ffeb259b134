"""Fused prep chains (``prep/fusion.py``): the same bits as running the steps one by one, with
only what the steps and outputs read written; and the row-assembly kernel (``prep/rows.py``)
through the interpreter on odd shapes."""

from __future__ import annotations

import pytest
import torch

from coda.blocks.registry import get_block
from coda.planner import lower
from coda.primitives import backend
from coda.primitives.analysis import analyze, bind_sizes
from coda.primitives.base import PrepStep, RunEnv
from coda.primitives.ir import Program
from coda.primitives.launch import recorded_launches
from coda.primitives.prep.fusion import RowStack, run_prep
from coda.primitives.prep.layout import pair_rows
from coda.primitives.prep.rows import (
    MAX_PARTS,
    Part,
    _assemble_rows_kernel,
    assemble_rows,
    stack_rows,
)
from coda.primitives.runtime import compile_program

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]


def _one_by_one(
    program: Program, inputs: dict[str, torch.Tensor], sizes: dict[str, int]
) -> dict[str, torch.Tensor]:
    env = RunEnv(dict(inputs), {}, sizes=sizes)
    for step in program.prep:
        step.apply(env)
    return env.tensors


def _block_case(
    name: str, dtype: torch.dtype, shapes: str = "cpu"
) -> tuple[Program, dict[str, torch.Tensor]]:
    block = get_block(name)
    sizes = getattr(block.shapes, shapes)[0]
    return lower(block), block.make_inputs(sizes, dtype, seed=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("block", ["llama_attn_in", "llama_attn_in_bwd_saved"])
def test_the_attention_inputs_fused_prep_is_the_steps_bit_for_bit(
    block: str, dtype: torch.dtype
) -> None:
    program, inputs = _block_case(block, dtype)
    kinds = [step.kind for step in program.prep]
    assert kinds[:3] == ["rope_pairs", "rope_pairs", "concat_rows"]  # the chain this fuses
    compiled = compile_program(program, analyze(program, bind_sizes(program, _shapes(inputs))))
    prepared = compiled.prepare(inputs)
    sizes = compiled.info_for(inputs).sizes
    eager = _one_by_one(program, inputs, sizes)
    last = program.prep[-1].out
    assert last in prepared and torch.equal(prepared[last], eager[last])
    assert prepared[last].dtype == dtype
    # the chain's intermediates are never written: only the steps read the last one
    for step in program.prep[:-1]:
        assert step.out not in prepared, step.out
    # and the fused program computes what the one-by-one program does (its GEMMs in bf16 run on
    # a GPU only: the interpreter refuses bf16 products, tests/gpu/test_primitives_gpu.py)
    if dtype == torch.bfloat16 and backend.INTERPRET:
        return
    outs = compiled(inputs)
    for name, value in program.select_outputs(compiled.run(eager), sizes).items():
        assert torch.equal(outs[name], value), name


def _shapes(inputs: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in inputs.items()}


def _weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return {
        "wq": (torch.randn(8, 6, generator=gen) * 3).to(dtype),
        "wk": (torch.randn(4, 6, generator=gen) * 3).to(dtype),
        "wv": (torch.randn(4, 6, generator=gen) * 3).to(dtype),
        "g": (torch.randn(6, generator=gen) * torch.logspace(-2, 2, 6)).to(dtype),
        "g2": torch.randn(6, generator=gen).to(dtype),
    }


def _steps(*nodes: dict) -> list[PrepStep]:
    return [PrepStep.registry[node["kind"]](**node) for node in nodes]


CHAINS = {
    # a step that cannot take a description (interleave_rows) gets the stacks it reads written
    "interleave after rope": [
        {"kind": "rope_pairs", "weight": "wq", "head_dim": "4", "out": "q_p"},
        {"kind": "rope_pairs", "weight": "wk", "head_dim": "4", "out": "k_p"},
        {"kind": "concat_rows", "tensors": ["q_p", "wv"], "out": "qv"},
        {"kind": "interleave_rows", "first": "k_p", "second": "wv", "out": "kv"},
        {"kind": "fold_norm_weight", "weight": "kv", "gamma": "g", "out": "kv_g"},
    ],
    # a fold of a fold scales twice, rounding in between: the second runs on a written tensor
    "fold of a fold": [
        {"kind": "concat_rows", "tensors": ["wq", "wk"], "out": "qk"},
        {"kind": "fold_norm_weight", "weight": "qk", "gamma": "g", "out": "qk_g"},
        {"kind": "fold_norm_weight", "weight": "qk_g", "gamma": "g2", "out": "qk_gg"},
    ],
    # rope_pairs of a stack (rows of a concatenation) runs as itself
    "rope of a concat": [
        {"kind": "concat_rows", "tensors": ["wq", "wk"], "out": "qk"},
        {"kind": "rope_pairs", "weight": "qk", "head_dim": "4", "out": "qk_p"},
        {"kind": "fold_norm_weight", "weight": "qk_p", "gamma": "g", "out": "qk_pg"},
    ],
    # a fold straight on an input, and a concat of inputs only
    "fold then concat": [
        {"kind": "fold_norm_weight", "weight": "wv", "gamma": "g", "out": "v_g"},
        {"kind": "concat_rows", "tensors": ["wq", "v_g", "wk"], "out": "qvk"},
    ],
}


# Per chain: the intermediates only a fused step read (so never written).
ABSORBED = {
    "interleave after rope": {"q_p"},  # k_p is written for interleave_rows
    "fold of a fold": {"qk"},  # qk_g is written for the second fold
    "rope of a concat": set(),  # qk is written for rope_pairs, qk_p is needed
    "fold then concat": set(),  # v_g is written for concat_rows (a scaled stack)
}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("chain", list(CHAINS))
def test_every_chain_is_the_steps_and_writes_what_is_needed(chain: str, dtype: torch.dtype) -> None:
    steps = _steps(*CHAINS[chain])
    inputs = _weights(dtype)
    eager = RunEnv(dict(inputs), {})
    for step in steps:
        step.apply(eager)
    last = steps[-1].out
    # needed: the last result and one intermediate (a GEMM would read it too)
    middle = steps[len(steps) // 2].out
    fused = RunEnv(dict(inputs), {})
    run_prep(steps, fused, needed={last, middle})
    for name in (last, middle):
        assert torch.equal(fused.tensors[name], eager.tensors[name]), name
    # what a fused chain absorbed and nothing else reads is never written; the rest is, and equal
    written = set(fused.tensors) - set(inputs)
    assert written == {s.out for s in steps} - ABSORBED[chain]
    for name in written:
        assert torch.equal(fused.tensors[name], eager.tensors[name]), name


def test_a_stack_of_one_whole_part_is_its_tensor() -> None:
    w = torch.randn(3, 4)
    assert RowStack(((w, 0),)).write(torch.float32) is w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=IDS)
def test_the_row_kernel_pairs_scales_and_places(dtype: torch.dtype) -> None:
    """``assemble_rows`` (Triton; the interpreter here) into a row slice of a larger output, from a
    transposed source, in RoPE-pair order and with a strided γ — or without either: the pair
    order is ``pair_rows``'s (a copy), the fold is fp32-then-round (the interpreter truncates fp32
    to bf16; tests/gpu has bf16 bit for bit)."""
    gen = torch.Generator().manual_seed(4)
    for rows, cols, pairs in [(36, 301, 6), (40, 5, 4), (2, 5, 2), (0, 7, 4)]:
        src = (torch.randn(cols, rows, generator=gen) * 3).to(dtype).T  # not contiguous
        gamma = (torch.randn(2 * cols, generator=gen) * 10).to(dtype)[::2]
        for order in (0, pairs):
            for use_gamma in (False, True):
                out = torch.full((rows + 5, cols), -7.0, dtype=dtype)
                picked = pair_rows(src, order) if order else src
                exact = picked.float() * (gamma.float() if use_gamma else 1.0)
                want = exact.to(dtype)
                assemble_rows(out[2 : 2 + rows], src, order, gamma if use_gamma else None)
                got = out[2 : 2 + rows]
                assert (out[:2] == -7).all() and (out[2 + rows :] == -7).all()
                if use_gamma and dtype == torch.bfloat16 and backend.INTERPRET:
                    truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32)
                    assert torch.equal(got, truncated.to(dtype)) or torch.equal(got, want)
                else:
                    assert torch.equal(got, want)


def test_pair_rows_is_the_rope_pair_order_and_its_inverse() -> None:
    """``pair_rows``: within each head of D rows, new row 2p + e is old row e·D/2 + p (the rows
    past ``rows`` kept), and ``inverse`` undoes it — for weights and vectors alike."""
    w = torch.arange(20.0).reshape(10, 2)
    paired = pair_rows(w, 4, rows=8)
    want = [0, 2, 1, 3, 4, 6, 5, 7, 8, 9]  # heads [0..3], [4..7]; rows 8, 9 kept
    assert torch.equal(paired, w[want])
    assert torch.equal(pair_rows(paired, 4, rows=8, inverse=True), w)
    v = torch.arange(12.0)
    assert torch.equal(pair_rows(v, 6), v[[0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]])
    assert torch.equal(pair_rows(pair_rows(v, 6), 6, inverse=True), v)


def test_the_row_kernel_refuses_mismatched_rows() -> None:
    out = torch.empty(4, 3)
    with pytest.raises(ValueError, match="source \\(9, 3\\) for output \\(4, 3\\)"):
        assemble_rows(out, torch.randn(9, 3))
    for pairs in (3, 8, -2):
        with pytest.raises(ValueError, match=f"heads of {pairs} rows, but it has 4 rows"):
            assemble_rows(out, torch.randn(4, 3), pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_gpu_writer_places_every_part_like_the_torch_one(dtype: torch.dtype) -> None:
    """``RowStack``'s in-place writer (what runs on the GPU: one launch of the row kernel for
    every part) through the interpreter, against its PyTorch writer (the CPU's)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(n, 7, generator=gen).to(dtype) for n in (8, 4, 6))
    gamma = torch.randn(7, generator=gen).to(dtype)
    parts = ((q, 4), (k, 0), (v, 2))
    for stack in (RowStack(parts), RowStack(parts, gamma), RowStack(((k, 0), (v, 0)))):
        assert torch.equal(stack._write_in_place(), stack.write(torch.float32))


def _parts(dtype: torch.dtype, counts: tuple[int, ...], cols: int, seed: int) -> list[Part]:
    """One part per row count: odd ones in pair order (heads of 4 rows where 4 divides the
    count, else 2), even ones in order, from a transposed, non-contiguous source."""
    gen = torch.Generator().manual_seed(seed)
    parts: list[Part] = []
    for i, n in enumerate(counts):
        if i % 2:
            src = (torch.randn(n, cols, generator=gen) * 3).to(dtype)
            parts.append((src, 4 if n % 4 == 0 else 2))
        else:
            parts.append(((torch.randn(cols, n, generator=gen) * 3).to(dtype).T, 0))
    return parts


def _per_part(stack: RowStack) -> torch.Tensor:
    """The stack written part by part: one ``assemble_rows`` launch per part, into its rows."""
    first = stack.parts[0][0]
    counts = [src.shape[0] for src, _ in stack.parts]
    out = torch.empty((sum(counts), first.shape[1]), dtype=first.dtype)
    for (src, pairs), part in zip(stack.parts, out.split(counts), strict=True):
        assemble_rows(part, src, pairs, stack.gamma)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_stack_is_written_in_one_launch_like_part_by_part(dtype: torch.dtype) -> None:
    """``RowStack``'s in-place writer (the GPU's; the interpreter here) launches the row kernel
    once for a stack of up to ``MAX_PARTS`` parts of odd row counts — a part wider than a row
    tile among them — and writes what the per-part launches and PyTorch's ``pair_rows`` /
    ``cat`` / ``fold_columns`` write, bit for bit: with and without pair orders and γ (a 16-bit
    one, and an fp32 one as ``offset_gamma`` makes)."""
    cols = 263  # two column tiles
    gen = torch.Generator().manual_seed(8)
    gamma = (torch.randn(cols, generator=gen) * torch.logspace(-2, 2, cols)).to(dtype)
    for counts in [(5, 6, 7), (5, 36, 3, 8), (1,), (4, 0, 6)]:
        parts = _parts(dtype, counts, cols, seed=sum(counts))
        whole = tuple((src, 0) for src, _ in parts)  # every part in order: plain stacking
        for stack in (
            RowStack(tuple(parts)),
            RowStack(tuple(parts), gamma),
            RowStack(tuple(parts), gamma.float() + 1.0),
            RowStack(whole),
        ):
            with recorded_launches() as launches:
                got = stack._write_in_place()
            assert [call[0] for call in launches] == [_assemble_rows_kernel], counts
            assert got.dtype == dtype
            assert torch.equal(got, _per_part(stack)), counts
            assert torch.equal(got, stack.write(torch.float32)), counts  # the CPU's writer


def test_a_stack_of_more_parts_takes_a_launch_per_max_parts() -> None:
    gen = torch.Generator().manual_seed(9)
    counts = (3, 6, 2, 8, 1, 4) + (6,) * (MAX_PARTS - 4)  # more than MAX_PARTS parts
    parts = _parts(torch.float32, counts, cols=9, seed=3)
    stack = RowStack(tuple(parts), torch.randn(9, generator=gen))
    with recorded_launches() as launches:
        got = stack._write_in_place()
    assert len(launches) == -(-len(counts) // MAX_PARTS) == 2
    assert torch.equal(got, stack.write(torch.float32))


def test_a_stack_of_mismatched_parts_is_refused() -> None:
    w = torch.randn(4, 6)
    cases = {
        "part 1 is \\(4, 6\\) torch.float16 on cpu, but part 0 is \\(4, 6\\) torch.float32": (
            (w, 0),
            (w.half(), 0),
        ),
        "part 2 is \\(4, 5\\)": ((w, 0), (w, 0), (torch.randn(4, 5), 0)),
        "part 0 is a \\(6,\\) tensor; stack 2-D weights": ((w[0], 0),),
        "part 1's pair order takes heads of 3 rows, but it has 4 rows": ((w, 0), (w, 3)),
    }
    for message, parts in cases.items():
        with pytest.raises(ValueError, match=message):
            stack_rows(parts)
    with pytest.raises(
        ValueError, match="γ is a \\(5,\\) tensor on cpu; give one value per column"
    ):
        stack_rows(((w, 0),), torch.randn(5))


def test_the_prep_s_launches_replay_pinned_per_layout_of_what_prep_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call at the layouts of an earlier call's prep inputs launches the prep's row kernel
    through the pinned launches that call recorded (no signature); other layouts of those inputs
    (a misaligned, a column-major weight) record sequences of their own. Every call computes
    what a fresh program does. (Stacks are written by the row kernel here, as on a GPU.)"""
    from coda.primitives.launch import PinnedLaunch
    from tests.primitives.test_run_plans import misaligned

    monkeypatch.setattr(RowStack, "write", lambda self, compute: self._write_in_place())
    program, inputs = _block_case("llama_attn_in", torch.float32)
    sizes = bind_sizes(program, _shapes(inputs))
    compiled = compile_program(program, analyze(program, sizes))
    pinned: list[str] = []
    real = PinnedLaunch.__call__

    def pinned_call(self: PinnedLaunch, *args: object) -> object:
        pinned.append(self.kernel.__name__)
        return real(self, *args)

    monkeypatch.setattr(PinnedLaunch, "__call__", pinned_call)
    calls = [
        inputs,
        inputs,
        {**inputs, "w_q": misaligned(inputs["w_q"])},
        {**inputs, "w_k": inputs["w_k"].T.contiguous().T},
        {**inputs, "w_q": inputs["w_q"] * 2},
    ]
    counts = []
    for call in calls:
        pinned.clear()
        got = compiled(call)
        counts.append(pinned.count("_assemble_rows_kernel"))
        want = compile_program(program, analyze(program, sizes))(call)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    assert counts == [0, 1, 0, 0, 1]
    assert len(compiled._prep_launches) == 3
