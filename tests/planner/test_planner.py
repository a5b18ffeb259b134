"""The built-in planner: CODA's rewrite rules on llama_mlp and on a block defined only here."""

from __future__ import annotations

import pytest

from coda.agent.synthesize import synthesize
from coda.blocks import Add, Block, Linear, RMSNorm, ShapeSets, SwiGLU, TensorSpec, get_block
from coda.planner import LoweringOptions, NoRule, lower
from coda.sandbox import SandboxOptions, evaluate

FAST = SandboxOptions(isolate=False, seeds=[0])


def test_llama_mlp_lowering_uses_the_coda_rules() -> None:
    program = lower(get_block("llama_mlp"))
    assert [p.kind for p in program.prep] == ["interleave_rows", "fold_norm_weight"]
    rstd, gate_up, down = program.steps
    assert rstd.kind == "rstd" and rstd.src == "x"  # x is a block input: a standalone reduction
    assert [op.op for op in gate_up.epilogue] == ["scale_rows", "swiglu", "store"]
    assert gate_up.a.tensor == "x" and gate_up.b.transpose
    assert [op.op for op in down.epilogue] == ["add_tile", "store"]
    report = evaluate(program, get_block("llama_mlp"), FAST)
    assert report.verified, report.render_text()


def _spec(*shape: str, init: str = "activation") -> TensorSpec:
    return TensorSpec(shape=list(shape), init=init)


# attention output + residual + next norm + a SwiGLU MLP: statistics must come from the producer.
DECODER_TAIL = Block(
    name="decoder_tail",
    description="x1 = x0 + o @ Wo.T; out = x1 + mlp(rmsnorm(x1))",
    inputs={
        "x0": _spec("M", "d"),
        "o": _spec("M", "d"),
        "w_o": _spec("d", "d", init="linear_weight"),
        "gamma": _spec("d", init="norm_weight"),
        "w_gate": _spec("f", "d", init="linear_weight"),
        "w_up": _spec("f", "d", init="linear_weight"),
        "w_down": _spec("d", "f", init="linear_weight"),
    },
    graph=[
        Linear(x="o", weight="w_o", out="y"),
        Add(a="x0", b="y", out="x1"),
        RMSNorm(x="x1", weight="gamma", eps=1e-6, out="h"),
        Linear(x="h", weight="w_gate", out="g"),
        Linear(x="h", weight="w_up", out="u"),
        SwiGLU(gate="g", up="u", out="a"),
        Linear(x="a", weight="w_down", out="m"),
        Add(a="x1", b="m", out="out"),
    ],
    outputs=["out"],
    shapes=ShapeSets(
        cpu=[{"M": 33, "d": 40, "f": 56}, {"M": 64, "d": 64, "f": 64}, {"M": 7, "d": 24, "f": 40}]
    ),
)


def test_statistics_come_from_the_producing_epilogue() -> None:
    program = lower(DECODER_TAIL)
    o_proj = program.steps[0]
    assert [op.op for op in o_proj.epilogue] == ["add_tile", "store", "partial_reduce"]
    rstd = program.steps[1]
    assert rstd.kind == "rstd" and rstd.src == "x1_sumsq"
    report = evaluate(program, DECODER_TAIL, FAST)
    assert report.verified, report.render_text()


@pytest.mark.parametrize(
    "graph,outputs,fragment",
    [
        ([Add(a="x", b="w", out="y")], ["y"], "graph[0] add(out='y'): no lowering rule"),
        (
            [RMSNorm(x="x", weight="g", out="h"), Linear(x="h", weight="w", out="y")],
            ["h", "y"],
            "its output 'h' feeds a block output",
        ),
    ],
)
def test_unsupported_graphs_name_the_op(graph, outputs, fragment: str) -> None:  # noqa: ANN001
    block = Block(
        name="odd",
        description="",
        graph=graph,
        outputs=outputs,
        inputs={
            "x": _spec("M", "d"),
            "w": _spec("M", "d")
            if outputs == ["y"] and isinstance(graph[0], Add)
            else _spec("d", "d"),
            "g": _spec("d"),
        }
        if not isinstance(graph[0], Add)
        else {"x": _spec("M", "d"), "w": _spec("M", "d")},
        shapes=ShapeSets(cpu=[{"M": 4, "d": 8}]),
    )
    with pytest.raises(NoRule) as err:
        lower(block)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "options",
    [
        LoweringOptions(gamma="side_output"),
        LoweringOptions(gamma="rows"),
        LoweringOptions(stats="pass"),
    ],
    ids=["gamma-side-output", "gamma-rows", "stats-pass"],
)
def test_decomposition_variants_verify(options: LoweringOptions) -> None:
    program = lower(DECODER_TAIL, options)
    ops = [op.op for op in program.steps[0].epilogue]
    if options.gamma == "side_output":
        # the o-proj epilogue also stores x1 ⊙ γ; the gate/up GEMM reads it, weight unfolded
        assert ops == ["add_tile", "store", "partial_reduce", "scale_cols", "store"]
        assert [p.kind for p in program.prep] == ["interleave_rows"]
        assert program.steps[2].a.tensor == "x1_gamma"
    elif options.gamma == "rows":
        # rstd from the o-proj's partials, then one pass writes h = r ⊙ x1 ⊙ γ, which the
        # gate/up GEMM reads with its weight unfolded and no row scale
        assert ops == ["add_tile", "store", "partial_reduce"]
        assert [p.kind for p in program.prep] == ["interleave_rows"]
        rstd, rows, gate_up = program.steps[1:4]
        assert (rstd.kind, rstd.src) == ("rstd", "x1_sumsq")
        assert (rows.kind, rows.src, rows.rstd, rows.weight) == (
            "norm_rows",
            "x1",
            rstd.out,
            "gamma",
        )
        assert gate_up.a.tensor == rows.out and gate_up.b.tensor == "w_g_u"
        assert all(op.op != "scale_rows" for op in gate_up.epilogue)
    else:
        assert ops == ["add_tile", "store"] and program.steps[1].src == "x1"
    report = evaluate(program, DECODER_TAIL, FAST)
    assert report.verified, report.render_text()


def test_the_builtin_provider_synthesizes_a_block_defined_only_here(tmp_path) -> None:  # noqa: ANN001
    result = synthesize(DECODER_TAIL, tmp_path, sandbox=FAST)
    assert result.verified and result.stop.kind == "finished" and result.turns == 2
    assert result.provider == "builtin" and result.usage.total == 0 and result.cost_usd == 0
    assert result.best.program == lower(DECODER_TAIL)
    assert "Timings are not measured" in result.stop.message
