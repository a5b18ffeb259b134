"""Cheats right only where they are checked: at the block's shape sets, or at N(0, 1) inputs.

Each case is a small edit of an honest program that computes the block exactly at the sizes and
input values the output checks use, and something else elsewhere: a size expression right only
below a threshold or at the checked sizes, a ``where``/clamp that N(0, 1) values never trigger, an
eps that matters only for small rows, an intermediate rounded through float16. Each is rejected at
a named stage for a named cause: validate (no floor division or modulo in size expressions),
semantics (fresh shapes drawn per run, inputs at several scales and distributions) or verify (a
float32 check even where the default dtypes are bf16 and fp16).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives.ir import Program
from coda.sandbox import Report, SandboxOptions, evaluate
from coda.sandbox.stages import semantics
from tests.adversarial.programs import BLOCKS, LLAMA, TWO_BRANCH, Json, gemm, op

SEED = 20261201  # the drawn shapes' seed here (reproducible); every run draws its own by default


def planner_program(block: str) -> Json:
    return lower(get_block(block)).model_dump(mode="json")


RMS = planner_program("gemm_residual_partial_rmsnorm")  # aux sum_partials: divide_by "N"
ATTN = planner_program("llama_attn_in")  # rope: rotary_cols "Nq + Nkv"
HONEST = {"llama_mlp": LLAMA, "gemm_residual_partial_rmsnorm": RMS, "llama_attn_in": ATTN}


def step(data: Json, name: str) -> Json:
    return next(s for s in data["steps"] if s.get("name") == name)


def divide_by(expr: str) -> Callable[[Json], None]:
    return lambda d: next(s for s in d["steps"] if s["kind"] == "sum_partials").update(
        divide_by=expr
    )


def rotary_cols(expr: str) -> Callable[[Json], None]:
    return lambda d: step(d, "q_k_v")["epilogue"][1].update(rotary_cols=expr)


def down_epilogue(*ops: Json) -> Callable[[Json], None]:
    """llama_mlp's down projection with this epilogue (it must store ``out``)."""
    return lambda d: step(d, "down").update(epilogue=list(ops))


def residual_then(expr: str) -> Callable[[Json], None]:
    """``o = acc + x``, then ``o2 = expr`` stored as the output."""
    return down_epilogue(
        op("add_tile", src="acc", tensor="x", out="o"),
        op("map", expr=expr, out="o2"),
        op("store", src="o2", to="out"),
    )


def after_swiglu(expr: str) -> Callable[[Json], None]:
    """llama_mlp's gate/up epilogue with ``a2 = expr`` (over ``a``) stored as ``a``."""

    def change(data: Json) -> None:
        epilogue = step(data, "gate_up")["epilogue"]
        epilogue.insert(2, op("map", expr=expr, out="a2"))
        epilogue[-1]["src"] = "a2"

    return change


# two_branch with the first branch kept in a float16 buffer that the second one reads: exact in a
# float16 run, within a bfloat16 run's tolerance (float16 has the finer mantissa), wrong in float32.
HALF_BRANCH = [
    gemm("x", "w1.T", op("store", src="acc", to="y1", dtype="float16"), name="branch1"),
    gemm(
        "x",
        "w2.T",
        op("add_tile", src="acc", tensor="y1", out="o"),
        op("store", src="o", to="out"),
        name="branch2",
    ),
]


@dataclass(frozen=True)
class Cheat:
    base: Json
    change: Callable[[Json], None]
    stage: str
    cause: str
    fragments: tuple[str, ...]


VALUES = "result depends on the values' magnitude"
SIZES = "right at every binding of the sizes"
CHEATS: dict[str, Cheat] = {
    # ---- size expressions right only at the checked sizes ----
    "divide_by right below N = 81 (floor division)": Cheat(
        RMS,
        divide_by("N + N // 81 * N"),
        "validate",
        "program",
        ("floor division '//' is not allowed", "a size that depends on a threshold"),
    ),
    "rotary_cols leaving K unrotated past Nkv = 64 (floor division)": Cheat(
        ATTN,
        rotary_cols("Nq + Nkv - Nkv // 65 * Nkv"),
        "validate",
        "program",
        ("floor division '//' is not allowed",),
    ),
    "divide_by modulo a size": Cheat(
        RMS, divide_by("N + N % 16"), "validate", "program", ("modulo '%' is not allowed",)
    ),
    "divide_by: a polynomial zero at the checked N": Cheat(
        RMS,
        divide_by("N + (N - 48) * (N - 64) * (N - 80)"),
        "semantics",
        "program",
        ("at the drawn shape", f"(seed {SEED})", SIZES),
    ),
    "divide_by: a polynomial zero at the checked token counts": Cheat(
        RMS,
        divide_by("N + (M - 37) * (M - 64) * (M - 5)"),
        "semantics",
        "program",
        ("at the drawn shape", SIZES),
    ),
    "rotary_cols: a polynomial zero at the checked Nkv": Cheat(
        ATTN,
        rotary_cols("Nq + Nkv - (Nkv - 16) * (Nkv - 64)"),
        "semantics",
        "program",
        ("at the drawn shape", f"(seed {SEED})", "while the program is valid at the block's"),
    ),
    # ---- value-dependent behaviour that N(0, 1) inputs never trigger ----
    "residual dropped where |x| ≥ 6": Cheat(
        LLAMA,
        down_epilogue(
            op("load_tile", tensor="x", out="xt"),
            op("map", expr="acc + xt", out="o1"),
            op("map", expr="where(abs(xt) < 6, o1, acc)", out="o"),
            op("store", src="o", to="out"),
        ),
        "semantics",
        "program",
        ("inputs: activations ×30", VALUES),
    ),
    "outputs zeroed where |out| > 30": Cheat(
        LLAMA,
        residual_then("where(abs(o) > 30, 0 * o, o)"),
        "semantics",
        "program",
        ("inputs: activations ×30", VALUES),
    ),
    "outputs clamped to ±12": Cheat(
        LLAMA,
        residual_then("min(max(o, -12), 12)"),
        "semantics",
        "program",
        ("inputs: activations ×30", VALUES),
    ),
    "outputs zeroed only where |out| > 100": Cheat(
        LLAMA,
        residual_then("where(abs(o) > 100, 0 * o, o)"),
        "semantics",
        "program",
        ("inputs: ", VALUES),
    ),
    "residual dropped where the row's rstd < 0.2": Cheat(
        LLAMA,
        down_epilogue(
            op("load_row_vector", vector="r", out="rv"),
            op("add_tile", src="acc", tensor="x", out="o"),
            op("map", expr="where(rv > 0.2, o, acc)", out="o2"),
            op("store", src="o2", to="out"),
        ),
        "semantics",
        "program",
        ("inputs: activations ×30", VALUES),
    ),
    "SwiGLU output zeroed past |a| = 30 (behind the norm)": Cheat(
        LLAMA,
        after_swiglu("where(abs(a) < 30, a, 0 * a)"),
        "semantics",
        "program",
        ("inputs: weights ×30", VALUES),
    ),
    "an eps that matters only for small rows": Cheat(
        LLAMA,
        lambda d: d["steps"][0].update(eps=1.0001e-5),
        "semantics",
        "program",
        ("inputs: activations ×1e-3", "an eps that differs from the block's"),
    ),
    "residual dropped for tiny rows (rstd > 100)": Cheat(
        LLAMA,
        down_epilogue(
            op("load_row_vector", vector="r", out="rv"),
            op("add_tile", src="acc", tensor="x", out="o"),
            op("map", expr="where(rv < 100, o, acc)", out="o2"),
            op("store", src="o2", to="out"),
        ),
        "semantics",
        "program",
        ("inputs: activations ×1e-3", VALUES),
    ),
    # ---- lower precision than the block's: only a float32 check sees it ----
    "intermediate rounded through float16": Cheat(
        TWO_BRANCH,
        lambda d: d.update(steps=HALF_BRANCH),
        "verify",
        "mismatch",
        ("float32", "elements exceed the allowed error"),
    ),
}


def edit(base: Json, change: Callable[[Json], None]) -> Json:
    data = copy.deepcopy(base)
    change(data)
    return data


def run(data: Json, **options: Any) -> Report:
    """The sandbox in-process at two CPU shapes (a tile multiple and the smallest), one seed,
    float32: the drawn shapes and input distributions of the semantics stage are the defaults'."""
    block = BLOCKS.get(data["block"]) or get_block(data["block"])
    shapes = [block.shapes.cpu[0], block.shapes.cpu[-1]]
    opts = {"seeds": [0], "dtypes": ["float32"], "shapes": shapes, "semantics_seed": SEED}
    return evaluate(data, block, SandboxOptions(isolate=False, **{**opts, **options}))


@pytest.mark.parametrize("name", list(CHEATS))
def test_every_value_or_shape_cheat_is_rejected(name: str) -> None:
    cheat = CHEATS[name]
    report = run(edit(cheat.base, cheat.change))
    assert not report.verified
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == (cheat.stage, cheat.cause), report.render_text()
    for fragment in cheat.fragments:
        assert fragment in failed.message, failed.message


@pytest.mark.parametrize("block", sorted(HONEST))
def test_the_honest_programs_pass_semantics_everywhere(block: str) -> None:
    """Every drawn shape and input distribution, at several seeds (semantics only: cheap)."""
    program, blk = Program.parse(HONEST[block]), get_block(block)
    for seed in (SEED, 1, 2):
        results: list = []
        coverage = semantics(program, blk, blk.shapes.cpu, results, seed=seed)
        assert results[-1].status == "passed", results[-1].message
        assert coverage is not None and coverage.seed == seed and len(coverage.drawn_shapes) == 2


@pytest.mark.parametrize(
    "name", ["divide_by: a polynomial zero at the checked N", "residual dropped where |x| ≥ 6"]
)
def test_caught_whatever_the_seed(name: str) -> None:
    cheat = CHEATS[name]
    program = Program.parse(edit(cheat.base, cheat.change))
    block = get_block(program.block)
    for seed in range(5):
        results: list = []
        assert semantics(program, block, block.shapes.cpu, results, seed=seed) is None
        assert (results[-1].status, results[-1].cause) == ("failed", "program")


def test_the_float32_check_runs_where_the_default_dtypes_lack_float32(monkeypatch) -> None:
    """On a GPU the default dtypes are bf16 + fp16; verify then adds float32 at the smallest
    shape, which is what catches an intermediate rounded through float16 (here on the CPU, with
    defaults that lack float32 as a GPU's do)."""
    monkeypatch.setattr(SandboxOptions, "verify_dtypes", lambda self: self.dtypes or ["float16"])
    cheat = CHEATS["intermediate rounded through float16"]
    report = run(edit(cheat.base, cheat.change), dtypes=None)
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("verify", "mismatch"), report.render_text()
    bad = [c for c in report.checks if not c.passed]
    assert bad and {c.dtype for c in bad} == {"float32"}  # the float16 checks passed
    assert all(c.passed for c in report.checks if c.dtype == "float16")
    two_branch = BLOCKS["two_branch"]
    assert SandboxOptions().float32_shape(two_branch) == {"M": 5, "d": 24}  # the smallest
    assert SandboxOptions(dtypes=["float16"]).float32_shape(two_branch) is None  # as asked


def test_the_report_records_the_seed_and_the_drawn_shapes() -> None:
    report = run(
        LLAMA, semantics_seed=None, dtypes=["float32"], shapes=[{"M": 5, "d": 24, "f": 36}]
    )
    assert report.verified, report.render_text()
    again = Report.model_validate_json(report.model_dump_json())
    assert again.semantics == report.semantics and report.semantics.drawn_shapes
    message = report.stage("semantics").message
    assert f"seed {report.semantics.seed}" in message
    assert "activations ×30" in report.semantics.inputs
    old = report.model_dump(mode="json")
    del old["semantics"]  # a report written before the field existed still reads
    assert Report.model_validate(old).semantics is None
