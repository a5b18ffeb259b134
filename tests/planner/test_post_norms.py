"""Post-norms: an RMSNorm of a GEMM's output added to the residual stream (Gemma 2/3's
``post_attention_layernorm`` / ``post_feedforward_layernorm``, OLMo 2's norms after ``o_proj`` and
``down_proj``), lowered to partial sums of squares in the GEMM's epilogue, ``rstd`` and the
finishing pass ``norm_rows``, and verified by the sandbox; Gemma 2's sandwich-norm MLP."""

from __future__ import annotations

import pytest

from coda.blocks import GLU, Add, Block, Linear, RMSNorm, ShapeSets, SwiGLU, TensorSpec
from coda.blocks.ops import RowRstd
from coda.planner import LoweringOptions, NoRule, lower
from coda.primitives import Program
from coda.sandbox import SandboxOptions, evaluate
from coda.sandbox.report import StageResult
from coda.sandbox.stages import semantics, validate

OPTIONS = SandboxOptions(profile=False, isolate=False, seeds=[0])  # float32 + float16
# ragged M and d (d not a multiple of 16), and one token
RAGGED = ShapeSets(cpu=[{"M": 33, "d": 40, "f": 56}, {"M": 1, "d": 24, "f": 40}])

GEMMA = {"eps": 1e-6, "offset": 1.0, "cast": "after_weight"}  # GemmaRMSNorm: x̂ · (1 + γ)
OLMO2 = {"eps": 1e-6, "cast": "after_weight"}  # Olmo2RMSNorm: (γ · x̂) in fp32, cast after
LLAMA = {"eps": 1e-5}  # LlamaRMSNorm: x̂ cast before γ
NORMS = {"gemma": GEMMA, "olmo2": OLMO2, "llama": LLAMA}


def _spec(*shape: str, init: str = "activation") -> TensorSpec:
    return TensorSpec(shape=list(shape), init=init)


def post_norm_block(norm: dict, outputs: tuple[str, ...] = ("h",), tail: tuple = ()) -> Block:
    """``h = x + RMSNorm(o_proj(attn))``: OLMo 2's attention output, Gemma's with its norm."""
    return Block(
        name="post_norm_residual",
        description="h = x + rmsnorm(attn @ w_o.T)",
        inputs={
            "x": _spec("M", "d"),
            "attn": _spec("M", "f"),
            "w_o": _spec("d", "f", init="linear_weight"),
            "gamma": _spec("d", init="norm_weight"),
        },
        graph=[
            Linear(x="attn", weight="w_o", out="y"),
            RMSNorm(x="y", weight="gamma", out="n", **norm),
            Add(a="x", b="n", out="h"),
            *tail,
        ],
        outputs=list(outputs),
        shapes=RAGGED,
    )


@pytest.mark.parametrize("family", sorted(NORMS))
def test_a_post_norm_with_its_residual_verifies(family: str) -> None:
    block = post_norm_block(NORMS[family])
    program = lower(block)
    gemm, rstd, finish = program.steps
    assert [op.op for op in gemm.epilogue] == ["store", "partial_reduce"]
    assert rstd.kind == "rstd" and rstd.src == "y_sumsq"
    assert finish.kind == "norm_rows" and (finish.src, finish.residual) == ("y", "x")
    assert finish.offset == NORMS[family].get("offset", 0.0)
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_a_layer_boundary_hands_on_the_next_norms_statistic() -> None:
    """Gemma 2's attention output as ``llama_attn_out`` cuts it: ``x_out = x + post_norm(o_proj(
    attn))`` and the next norm's ``rstd`` of ``x_out``, from the same finishing pass."""
    next_norm = RowRstd(x="h", eps=1e-6, out="rstd_h")
    block = post_norm_block(GEMMA, outputs=("h", "rstd_h"), tail=(next_norm,))
    program = lower(block)
    finish = program.steps[-1]
    assert finish.kind == "norm_rows" and (finish.rstd_out, finish.rstd_eps) == ("rstd_h", 1e-6)
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_a_post_norm_from_one_pass_over_the_stored_output_verifies() -> None:
    block = post_norm_block(GEMMA)
    program = lower(block, LoweringOptions(stats="pass"))
    gemm, rstd, _ = program.steps
    assert [op.op for op in gemm.epilogue] == ["store"] and rstd.src == "y"
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_gamma_as_a_side_output_is_not_stored_for_a_post_norm() -> None:
    """``y ⊙ γ`` serves GEMMs reading the norm; a post-norm's finishing pass scales by γ itself."""
    program = lower(post_norm_block(OLMO2), LoweringOptions(gamma="side_output"))
    assert [op.op for op in program.steps[0].epilogue] == ["store", "partial_reduce"]


def test_the_norm_itself_is_materialised_when_it_is_an_output() -> None:
    block = post_norm_block(GEMMA, outputs=("n", "h"))
    program = lower(block)
    finishes = [(s.out, s.residual) for s in program.steps if s.kind == "norm_rows"]
    assert finishes == [("h", "x"), ("n", None)]
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


def test_a_post_norm_without_its_offset_fails_verification() -> None:
    """Llama's ``x̂ · γ`` is not Gemma's ``x̂ · (1 + γ)``: the sandbox rejects the swap."""
    block = post_norm_block(GEMMA)
    data = lower(block).model_dump(mode="json")
    data["steps"][-1]["offset"] = 0.0
    report = evaluate(Program.parse(data), block, OPTIONS)
    assert not report.verified and "FAILED at semantics" in report.render_text()


def test_a_norm_of_a_block_input_read_by_an_add_is_still_refused() -> None:
    """A standalone norm of an input is no post-norm: the refusal names the reader."""
    block = post_norm_block(GEMMA).model_copy(
        update={
            "graph": [
                RMSNorm(x="x", weight="gamma", out="n", **GEMMA),
                Linear(x="attn", weight="w_o", out="y"),
                Add(a="y", b="n", out="h"),
            ]
        }
    )
    with pytest.raises(NoRule, match=r"its output 'n' feeds add \(graph\[2\]\)"):
        lower(block)


GEMMA2_MLP = Block(
    name="gemma2_sandwich_mlp",
    description=(
        "Gemma 2's MLP sub-layer: h = x + post_norm(down(gelu_tanh(gate(n)) * up(n))), "
        "n = pre_norm(x), both GemmaRMSNorm"
    ),
    inputs={
        "x": _spec("M", "d"),
        "gamma_pre": _spec("d", init="norm_weight"),
        "w_gate": _spec("f", "d", init="linear_weight"),
        "w_up": _spec("f", "d", init="linear_weight"),
        "w_down": _spec("d", "f", init="linear_weight"),
        "gamma_post": _spec("d", init="norm_weight"),
    },
    graph=[
        RMSNorm(x="x", weight="gamma_pre", out="n", **GEMMA),
        Linear(x="n", weight="w_gate", out="g"),
        Linear(x="n", weight="w_up", out="u"),
        GLU(gate="g", up="u", act="gelu_tanh", out="a"),
        Linear(x="a", weight="w_down", out="m"),
        RMSNorm(x="m", weight="gamma_post", out="p", **GEMMA),
        Add(a="x", b="p", out="h"),
    ],
    outputs=["h"],
    shapes=RAGGED,
)


def test_gemma2_sandwich_norm_mlp_verifies() -> None:
    program = lower(GEMMA2_MLP)
    assert [(p.kind, getattr(p, "offset", None)) for p in program.prep] == [
        ("interleave_rows", None),
        ("fold_norm_weight", 1.0),
    ]
    kinds = [s.kind for s in program.steps]
    assert kinds == ["rstd", "gemm", "gemm", "rstd", "norm_rows"]
    down = program.steps[2]
    assert [op.op for op in down.epilogue] == ["store", "partial_reduce"]
    report = evaluate(program, GEMMA2_MLP, OPTIONS)
    assert report.verified, report.render_text()


def test_a_post_norm_alone_with_its_statistic_holds_in_float64() -> None:
    """OLMo 2's norm as a block output with the next norm's ``rstd`` of it: one ``norm_rows``."""
    tail = (RowRstd(x="n", eps=1e-6, out="r_n"),)
    block = post_norm_block(OLMO2, outputs=("n", "r_n"), tail=tail)
    inputs = {n: spec for n, spec in block.inputs.items() if n != "x"}  # no residual here
    block = block.model_copy(update={"graph": [*block.graph[:2], *tail], "inputs": inputs})
    program = lower(block)
    finish = program.steps[-1]
    assert (finish.kind, finish.out, finish.residual, finish.rstd_out) == (
        "norm_rows", "n", None, "r_n",
    )  # fmt: skip
    results: list[StageResult] = []
    checked, _ = validate(program, block, block.shapes.cpu, results)
    assert checked is not None, results[-1].message
    semantics(checked, block, block.shapes.cpu, results, seed=0, drawn=1)
    assert results[-1].status == "passed", results[-1].message


def test_olmo2_mlp_with_only_a_post_norm_verifies() -> None:
    """OLMo 2 reorders the norms: ``h = x + post_feedforward_layernorm(mlp(x))``, no pre-norm."""
    graph = [
        Linear(x="x", weight="w_gate", out="g"),
        Linear(x="x", weight="w_up", out="u"),
        SwiGLU(gate="g", up="u", out="a"),
        Linear(x="a", weight="w_down", out="m"),
        RMSNorm(x="m", weight="gamma_post", out="p", **OLMO2),
        Add(a="x", b="p", out="h"),
    ]
    inputs = {n: s for n, s in GEMMA2_MLP.inputs.items() if n != "gamma_pre"}
    update = {"name": "olmo2_mlp", "description": "h = x + rmsnorm(mlp(x))", "graph": graph}
    block = GEMMA2_MLP.model_copy(update={**update, "inputs": inputs})
    program = lower(block)
    assert [s.kind for s in program.steps] == ["gemm", "gemm", "rstd", "norm_rows"]
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()


@pytest.mark.parametrize("gamma", ["fold", "rows"])
def test_a_gemm_reads_a_post_norm_written_for_another_reader_as_is(gamma: str) -> None:
    """``n = rmsnorm(o_proj(attn))`` is a block output and ``z = n @ w_2ᵀ`` reads it: the GEMM
    reads the ``n`` the finishing pass wrote, with its weight as is — no second ``norm_rows`` to
    ``n`` (the row pass), no γ folded into ``w_2`` and no row scale (the fold)."""
    block = Block(
        name="post_norm_then_linear",
        description="n = rmsnorm(attn @ w_o.T); z = n @ w_2.T",
        inputs={
            "attn": _spec("M", "f"),
            "w_o": _spec("d", "f", init="linear_weight"),
            "gamma": _spec("d", init="norm_weight"),
            "w_2": _spec("f", "d", init="linear_weight"),
        },
        graph=[
            Linear(x="attn", weight="w_o", out="y"),
            RMSNorm(x="y", weight="gamma", out="n", **GEMMA),
            Linear(x="n", weight="w_2", out="z"),
        ],
        outputs=["n", "z"],
        shapes=RAGGED,
    )
    program = lower(block, LoweringOptions(gamma=gamma))
    assert [s.out for s in program.steps if s.kind == "norm_rows"] == ["n"]
    assert not program.prep
    second = [s for s in program.steps if s.kind == "gemm"][1]
    assert second.a.tensor == "n" and second.b.tensor == "w_2"
    assert [op.op for op in second.epilogue] == ["store"]
    report = evaluate(program, block, OPTIONS)
    assert report.verified, report.render_text()
