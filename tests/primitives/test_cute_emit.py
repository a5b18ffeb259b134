"""The CuTe backend's code generation (``coda.primitives.cute.emit``), without the DSL or a GPU:
which steps it covers and why the others stay on Triton, what each generated module binds, that
the modules are Python a reader can follow, and that the expression printer computes what the
reference executor computes."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest
import torch

from coda.blocks.registry import get_block
from coda.planner import lower
from coda.primitives import analyze
from coda.primitives import expr as expr_lang
from coda.primitives.cute.emit import CuteUnsupported, generate
from coda.primitives.cute.launch import CuteConfig, CuteStep, choose_config
from coda.primitives.ir import GemmEpilogue, Program

from .cute_emulator import EmulatedF

PROGRAMS = Path(__file__).parents[2] / "export" / "programs"


def _fused(program: Program, sizes: dict[str, int]):
    info = analyze(program, sizes)
    names = program.step_names()
    for step, name in zip(program.steps, names, strict=True):
        if isinstance(step, GemmEpilogue) and not info.gemms[name].vendor:
            yield step, info.gemms[name], info


def _dtypes(info, act=torch.bfloat16) -> dict[str, torch.dtype]:
    return {
        n: torch.float32 if t.dtype == "float32" else act
        for n, t in info.tensors.items()
        if t.dtype in ("float32", "act")
    }


def _block_step(name: str):
    block = get_block(name)
    program = lower(block)
    ((step, gemm, info),) = list(_fused(program, dict(block.shapes.gpu[0])))
    return step, gemm, info


def _shipped(name: str) -> Program:
    return Program.model_validate(json.loads((PROGRAMS / f"{name}.json").read_text())["program"])


def test_swiglu_backward_binds_its_pair_tile_partials_and_outputs() -> None:
    step, gemm, info = _block_step("gemm_partial_swiglu_bwd")
    source = generate(step, gemm, _dtypes(info))
    kinds = {(b.kind, b.tensor, b.pairs) for b in source.bindings}
    # z moves as 32-bit words of [g, u] pairs; dz is the GEMM's own output, in pairs too
    assert kinds == {
        ("tile", "z", True),
        ("row_partials", "zdz_partials", False),
        ("store", "o", False),
    }
    assert (source.output, source.output_pairs) == ("dz", True)
    assert source.uses_coords  # the partial sums must not count elements past the edges
    ast.parse(source.text)


def test_rmsnorm_backward_binds_vectors_of_both_axes_and_column_partials() -> None:
    step, gemm, info = _block_step("gemm_residual_partial_rmsnorm_bwd")
    source = generate(step, gemm, _dtypes(info))
    kinds = {(b.kind, b.tensor) for b in source.bindings}
    assert kinds == {
        ("tile", "x"), ("tile", "o"), ("row", "rstd"), ("row", "c"), ("col", "gamma"),
        ("col_partials", "dgamma_partials"), ("store", "c_out"),
    }  # fmt: skip
    assert source.output == "o_out" and not source.output_pairs
    text = source.text
    assert 'ColVecLoad("wr_rstd")' in text and 'RowVecLoad("wc_gamma")' in text
    assert 'RowVecReduce("r_dgamma_partials")' in text
    ast.parse(text)


def test_partial_sums_are_masked_only_in_tiles_that_cross_the_edge() -> None:
    step, gemm, info = _block_step("gemm_partial_swiglu_bwd")
    text = generate(step, gemm, _dtypes(info)).text
    # a row's partial sums its columns: only the column edge is masked, and only in the loop
    # taken by a tile crossing it
    assert "if F.tile_inside_n(coords, n_bound):" in text and "inside_m" not in text
    terms = "p0_zdz_terms + p1_zdz_terms"  # both members of each [g, u] pair
    masked = f"r_zdz_partials[i] = r_zdz_partials[i] + F.where(inside_n, {terms}, 0.0)"
    assert text.count(masked) == 1
    assert text.count(f"r_zdz_partials[i] = r_zdz_partials[i] + {terms}\n") == 1
    assert text.count("for i in cutlass.range(") == 2
    step, gemm, info = _block_step("gemm_residual_partial_rmsnorm_bwd")
    text = generate(step, gemm, _dtypes(info)).text  # column partials sum rows: the row edge
    assert "if F.tile_inside_m(coords, m_bound):" in text and "inside_n" not in text
    ast.parse(text)


def test_a_gate_up_step_loops_over_the_accumulator_pairs() -> None:
    # γ folded into the weight (the planner's default; the shipped MLP reads normalised rows):
    # the epilogue scales each pair by its row's rstd
    program = lower(get_block("llama_mlp_train"))
    steps = {
        gemm.name: generate(step, gemm, _dtypes(info))
        for step, gemm, info in _fused(program, {"M": 96, "d": 64, "f": 160})
    }
    gate_up = steps["gate_up"]
    # g, u and silu(g)·u are [M, f], half the accumulator's [M, 2f]: three half-wide stores
    # and no output D
    assert gate_up.output is None and not any(b.pairs for b in gate_up.bindings)
    assert {(b.kind, b.tensor, b.half) for b in gate_up.bindings} == {
        ("row", "rstd_h", False), ("store", "g", True), ("store", "u", True),
        ("store", "a", True),
    }  # fmt: skip
    text = gate_up.text
    assert 'TypedTileStore("s_a", epi_tile_fn=HALF_WIDTH)' in text
    assert "for i in cutlass.range(cute.size(tRS_rD) // 2, unroll_full=True):" in text
    assert "p0_acc, p1_acc = tRS_rD[2 * i], tRS_rD[2 * i + 1]" in text
    assert "p0_gu = (p0_acc * wr_rstd_h[2 * i])" in text  # a row's value at the pair's first
    assert "o_a[i] = v_a" in text
    ast.parse(text)


def test_next_to_a_pair_contraction_the_accumulator_is_written_member_by_member() -> None:
    step, gemm, info = _block_step("gemm_swiglu")  # stores acc as D and silu(g)·u half-wide
    source = generate(step, gemm, _dtypes(info))
    assert source.output == "d" and not source.output_pairs
    assert "tRS_rD[2 * i] = p0_acc" in source.text
    assert "tRS_rD[2 * i + 1] = p1_acc" in source.text
    assert {(b.kind, b.tensor, b.half) for b in source.bindings} == {("store", "o", True)}


def _gate_up_with(*ops: dict, inputs: dict | None = None):
    """``gemm_swiglu``'s step (D = acc, o = silu(g)·u) with ``ops`` before its last store and
    ``inputs`` added to the Program."""
    data = lower(get_block("gemm_swiglu")).model_dump(exclude_none=True)
    data["inputs"] |= inputs or {}
    (step,) = data["steps"]
    step["epilogue"][-1:-1] = list(ops)
    program = Program.model_validate(data)
    ((step, gemm, info),) = list(_fused(program, {"M": 100, "N": 128, "K": 40}))
    return step, gemm, info


@pytest.mark.parametrize(
    ("ops", "inputs", "reason"),
    [
        (
            [{"op": "load_col_vector", "vector": "gamma", "out": "g"},
             {"op": "map", "expr": "acc * g", "out": "ag"},
             {"op": "store", "src": "ag", "to": "ag"}],
            {"gamma": {"shape": ["N"], "dtype": "act"}},
            "column vector 'gamma' next to a contraction",
        ),
        (
            [{"op": "partial_reduce", "src": "o", "kind": "sum", "axis": "col", "to": "s"}],
            {},
            "a column reduction next to a contraction",
        ),
    ],
)  # fmt: skip
def test_what_a_pair_loop_cannot_take_is_refused(ops, inputs, reason: str) -> None:  # noqa: ANN001
    step, gemm, info = _gate_up_with(*ops, inputs=inputs)
    with pytest.raises(CuteUnsupported, match=reason):
        generate(step, gemm, _dtypes(info))


def test_a_row_sum_of_half_wide_values_indexes_the_pairs_first_member() -> None:
    op = {"op": "partial_reduce", "src": "o", "kind": "sumsq", "axis": "row", "to": "s"}
    step, gemm, info = _gate_up_with(op)
    text = generate(step, gemm, _dtypes(info)).text
    assert "r_s[2 * i] = r_s[2 * i] + v_o * v_o\n" in text
    assert "inside_n = F.inside_n(coords, 2 * i, n_bound)" in text


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        ("gemm_rope", "rope has no CuTe emitter"),
        ("gemm_partial_cross_entropy", "select_column has no CuTe emitter"),
    ],
)
def test_steps_outside_the_backend_say_why(block: str, reason: str) -> None:
    step, gemm, info = _block_step(block)
    with pytest.raises(CuteUnsupported, match=reason):
        generate(step, gemm, _dtypes(info))


def test_an_lse_reduction_and_an_accumulating_store_stay_on_triton() -> None:
    (step, gemm, info), *_ = _fused(_shipped("llama_lm_head_ce"), {"M": 64, "d": 64, "V": 128})
    with pytest.raises(CuteUnsupported, match="kind 'lse'"):
        generate(step, gemm, _dtypes(info))
    step, gemm, info = _block_step("gemm_rmsnorm")
    store = step.epilogue[-1].model_copy(update={"mode": "accumulate"})
    gemm.accumulates.add(store.to)
    with pytest.raises(CuteUnsupported, match="accumulates"):
        generate(step.model_copy(update={"epilogue": [*step.epilogue[:-1], store]}), gemm, {})


def test_float32_pairs_are_refused() -> None:
    step, gemm, info = _block_step("gemm_partial_swiglu_bwd")
    with pytest.raises(CuteUnsupported, match="pairs move as 16-bit"):
        generate(step, gemm, _dtypes(info, act=torch.float32))


def test_the_training_backward_steps_generate() -> None:
    program = _shipped("llama_mlp_bwd_saved")
    steps = {
        gemm.name: generate(step, gemm, _dtypes(info))
        for step, gemm, info in _fused(program, {"M": 96, "d": 64, "f": 160})
    }
    assert set(steps) == {"down_bwd", "gate_up_bwd"}
    down = steps["down_bwd"]
    assert (down.output, down.output_pairs) == ("dz", True)  # [dg, du] joined into pairs
    assert {(b.kind, b.tensor) for b in down.bindings} >= {("tile", "g"), ("tile", "u")}
    up = steps["gate_up_bwd"]
    assert up.output == "dx"
    assert {(b.kind, b.tensor) for b in up.bindings} >= {("store", "y"), ("col", "gamma")}


def test_generated_modules_depend_only_on_the_program_and_dtypes() -> None:
    step, gemm, info = _block_step("gemm_partial_swiglu_bwd")
    a = generate(step, gemm, _dtypes(info))
    assert generate(step, gemm, _dtypes(info)).key == a.key
    b = generate(step, gemm, _dtypes(info, act=torch.float16))
    assert b.key != a.key and "Float16" in b.text


def test_partials_follow_the_cute_tile() -> None:
    step, gemm, info = _block_step("gemm_partial_swiglu_bwd")
    tile = choose_config(gemm).tile
    shape, dtype = CuteStep._allocation(info.tensors["zdz_partials"], gemm, tile, torch.bfloat16)
    assert shape == (gemm.M, -(-gemm.N // tile[1])) and dtype == torch.float32
    step, gemm, info = _block_step("gemm_residual_partial_rmsnorm_bwd")
    tile = choose_config(gemm).tile
    shape, _ = CuteStep._allocation(info.tensors["dgamma_partials"], gemm, tile, None)
    assert shape == (gemm.N, -(-gemm.M // tile[0]))


def test_config_by_product_size() -> None:
    class G:
        M, N, K = 8192, 8192, 8192

    # the wide tile keeps QuACK's epilogue loop, the 128 x 128 tile takes the overlapped one
    assert choose_config(G) == CuteConfig(128, 192, 2, 1, True, epi_overlap=0)
    assert str(choose_config(G)) == "128x192 cluster 2x1 pingpong, QuACK's epilogue loop"
    G.K = 2048
    assert choose_config(G).tile == (128, 128)
    assert str(choose_config(G)) == "128x128 cluster 2x1 pingpong"
    assert choose_config(G).epi_overlap == 2


@pytest.mark.parametrize(
    "source",
    [
        "acc * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))",
        "r * (acc * gamma - r * x * c)",
        "exp(-abs(g)) + log(1 + u * u) - tanh(acc) / 3",
        "where(g > u, min(g, acc), max(u, -acc)) ** 2",
        "rsqrt(u * u + 1e-06) * erf(g) + sqrt(abs(acc)) - g ** -2",
        "silu(g) * u - -acc",
    ],
)
def test_the_cute_printer_computes_what_the_reference_computes(source: str) -> None:
    parsed = expr_lang.parse(source)
    rng = random.Random(source)
    for _ in range(20):
        values = {n: rng.uniform(-3, 3) or 0.5 for n in parsed.variables()}
        code = parsed.to_cute(lambda n: f"V[{n!r}]")
        got = eval(code, {"F": EmulatedF, "V": values})  # noqa: S307 - printed from a parsed tree
        as_tensor = {n: torch.tensor(v, dtype=torch.float64) for n, v in values.items()}
        want = parsed.evaluate(as_tensor.__getitem__, torch.float64)
        assert got == pytest.approx(float(want), rel=1e-9, abs=1e-12)
