"""``Chunk`` (``planner/rules/chunk.py``): one Linear split by ``chunk(2)`` into a GLU's gate and
up — Phi-3's ``gate_up_proj`` — is one GEMM over the weight's row halves interleaved, in either
part order, with any activation and a bias; its backward writes ``dW_gate_up`` back in
``[gate; up]`` order; any other Chunk is refused with the condition it misses."""

from __future__ import annotations

import pytest

from coda.blocks import (
    GLU,
    Add,
    Block,
    Chunk,
    Linear,
    RMSNorm,
    ShapeSets,
    SwiGLU,
    TensorSpec,
    register,
)
from coda.blocks.autodiff import backward_block
from coda.planner import NoRules, lower, lower_partial
from coda.sandbox import SandboxOptions, evaluate
from coda.sandbox.report import StageResult
from coda.sandbox.stages import semantics, validate

SHAPES = ShapeSets(cpu=[{"M": 13, "d": 24, "f": 20, "f2": 40}, {"M": 1, "d": 40, "f": 8, "f2": 16}])


def _spec(*shape: str, init: str = "activation") -> TensorSpec:
    return TensorSpec(shape=list(shape), init=init)


def _mlp(
    name: str = "chunked_mlp",
    glu: str = "swiglu",
    gate_index: int = 0,
    bias: bool = False,
    chunks: int = 2,
    extra: list | None = None,
) -> Block:
    """x + down(glu(chunk(linear(rmsnorm(x), w_gu[, b_gu])))), the gate as part ``gate_index``."""
    inputs = {
        "x": _spec("M", "d"),
        "gamma": _spec("d", init="norm_weight"),
        "w_gu": _spec("f2", "d", init="linear_weight"),
        "w_down": _spec("d", "f", init="linear_weight"),
    }
    if bias:
        inputs["b_gu"] = _spec("f2")
    contract = (
        SwiGLU(gate="g", up="u", out="a")
        if glu == "swiglu"
        else GLU(gate="g", up="u", act=glu, out="a")
    )
    parts = {"g": gate_index, "u": 1 - gate_index}
    graph = [
        RMSNorm(x="x", weight="gamma", eps=1e-5, out="h"),
        Linear(x="h", weight="w_gu", bias="b_gu" if bias else None, out="z"),
        *(Chunk(x="z", chunks=chunks, index=i, out=v) for v, i in parts.items()),
        *(extra or []),
        contract,
        Linear(x="a", weight="w_down", out="y"),
        Add(a="x", b="y", out="out"),
    ]
    return Block(
        name=name,
        description="a Phi-3 style MLP: one gate/up projection split by chunk(2)",
        inputs=inputs,
        graph=graph,
        outputs=["out"],
        shapes=SHAPES,
    )


def _algebra_holds(block: Block) -> None:
    """validate + semantics (float64 reference executor) only: milliseconds, no kernel run."""
    results: list[StageResult] = []
    program, _ = validate(lower(block), block, block.shapes.cpu, results)
    assert program is not None, results[-1].message
    semantics(program, block, block.shapes.cpu, results, seed=0, drawn=1)
    assert results[-1].status == "passed", results[-1].message


def test_the_chunked_swiglu_is_one_gemm_over_the_paired_halves() -> None:
    program = lower(_mlp())
    pair, fold = program.prep
    assert (pair.kind, pair.weight, pair.head_dim) == ("rope_pairs", "w_gu", "f2")
    assert (fold.kind, fold.weight) == ("fold_norm_weight", pair.out)
    rstd, gate_up, down = program.steps
    assert rstd.kind == "rstd"
    assert [op.op for op in gate_up.epilogue] == ["scale_rows", "swiglu", "store"]
    assert [op.op for op in down.epilogue] == ["add_tile", "store"]
    _algebra_holds(_mlp())


@pytest.mark.parametrize(
    "variant",
    [
        {"gate_index": 1},  # up, gate = z.chunk(2)
        {"glu": "gelu_tanh"},  # a GeGLU over chunks
        {"bias": True},
        {"glu": "gelu", "gate_index": 1, "bias": True},
    ],
)
def test_part_order_activation_and_bias_keep_the_algebra(variant: dict) -> None:
    block = _mlp(**variant)
    (gate_up,) = [s for s in lower(block).steps if s.kind == "gemm" and s.name == "gu"]
    ops = [op.op for op in gate_up.epilogue]
    plain = variant.get("glu", "swiglu") == "swiglu" and not variant.get("gate_index")
    assert ops[-2] == ("swiglu" if plain else "pairwise")
    assert ("add_col_vector" in ops) == variant.get("bias", False)
    _algebra_holds(block)


@pytest.mark.parametrize("gate_index", [0, 1])
def test_halves_saved_for_a_backward_are_split_out_of_the_same_gemm(gate_index: int) -> None:
    block = _mlp(name="chunked_mlp_train", gate_index=gate_index)
    block = block.model_copy(update={"outputs": ["out", "g", "u"]})
    program = lower(block)
    (gate_up,) = [s for s in program.steps if s.kind == "gemm" and s.name == "gu"]
    (split,) = [op for op in gate_up.epilogue if op.op == "split_pairs"]
    # part 0 of the chunk is the even column of each pair, whichever of gate and up it is
    assert (split.first, split.second) == (("g", "u") if gate_index == 0 else ("u", "g"))
    _algebra_holds(block)


def _refusal(block: Block, index: int) -> str:
    result = lower_partial(block)
    assert result.program is None
    (own,) = [u for u in result.unlowered if u.index == index and u.after is None]
    return own.reason


def test_a_chunk_in_three_is_refused_naming_the_count() -> None:
    # chunk(3) parts 0 and 1 feed the GLU; the refusal says the split is not in two
    reason = _refusal(_mlp(chunks=3), 2)
    assert "split into [3] parts, not 2" in reason and "Phi-3's gate_up_proj" in reason


def test_a_half_read_by_another_op_is_refused() -> None:
    block = _mlp(extra=[Add(a="g", b="g", out="gg")])
    block = block.model_copy(update={"outputs": ["out", "gg"]})
    reason = _refusal(block, 2)
    assert "not read by exactly one op" in reason


def test_a_chunk_of_a_block_input_is_refused() -> None:
    block = Block(
        name="chunk_input",
        description="a chunk of an input",
        inputs={"x": _spec("M", "d2")},
        graph=[Chunk(x="x", chunks=2, index=0, out="out")],
        outputs=["out"],
        shapes=ShapeSets(cpu=[{"M": 3, "d2": 8}]),
    )
    with pytest.raises(NoRules, match="it splits 'x', which is a block input, not a Linear's"):
        lower(block)


def test_the_backward_writes_dw_gate_up_in_gate_up_order_and_verifies() -> None:
    forward = _mlp(name="chunked_mlp_fwd")
    register(forward)
    backward = backward_block(
        forward,
        name="chunked_mlp_fwd_bwd",
        cotangents={"out": _spec("M", "d")},
        wrt=["x", "gamma", "w_gu", "w_down"],
        shapes=ShapeSets(
            cpu=[{"M": 13, "d": 24, "f": 20, "f2": 40}, {"M": 6, "d": 40, "f": 8, "f2": 16}]
        ),
    )
    program = lower(backward)
    assert program.outputs["dw_gu"] == "dw_gate_up"
    (unpair,) = [s for s in program.steps if s.kind == "unpair_rows"]
    assert unpair.head_dim == "f2"
    report = evaluate(program, backward, SandboxOptions(profile=False, isolate=False, seeds=[0]))
    assert report.verified, report.render_text()
