"""Aux steps (lse_combine, sum_partials, unpair_rows), prep steps (rope_pairs, concat_rows) and
output views, against independent formulas — Hugging Face's own RoPE and PyTorch's cross-entropy."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from coda.primitives import Program, ProgramError, analyze, compile_program
from coda.primitives.aux.partials import _launch
from coda.sandbox.compare import assert_close
from tests.helpers import DTYPE_TOL, compile_for_hopper, make_inputs, rope_tables, run_both

DTYPES = [torch.float32, torch.float16]
SMALL_TILES = {"block_m": 16, "block_n": 16, "block_k": 16, "group_m": 2, "num_warps": 1}


def _program(inputs: dict[str, Any], prep: list, steps: list, outputs: dict[str, Any]) -> Program:
    return Program.parse(
        {"block": "test", "inputs": inputs, "prep": prep, "steps": steps, "outputs": outputs}
    )


def _gemm(epilogue: list, a: str = "a", b: str = "b.T", **kw: Any) -> dict[str, Any]:
    return {"kind": "gemm", "name": kw.pop("name", "k"), "a": a, "b": b, "epilogue": epilogue, **kw}


# -- cross-entropy: partial_reduce(lse) + select_column + lse_combine ------------------------------
CE = _program(
    {"a": ["M", "K"], "b": ["N", "K"], "t": {"shape": ["M"], "dtype": "int64"}},
    [],
    [
        _gemm(
            [
                {"op": "select_column", "src": "acc", "index": "t", "to": "target"},
                {"op": "partial_reduce", "src": "acc", "kind": "lse", "to": "lse_p"},
            ],
            config=SMALL_TILES,
        ),
        {"kind": "lse_combine", "src": "lse_p", "minus": "target", "out": "loss"},
        {"kind": "lse_combine", "src": "lse_p", "out": "lse"},
    ],
    {"loss": "loss", "lse": "lse"},
)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("sizes", [{"M": 37, "N": 83, "K": 29}, {"M": 5, "N": 160, "K": 48}])
def test_cross_entropy_from_partials(sizes: dict[str, int], dtype: torch.dtype) -> None:
    inputs = make_inputs(CE, sizes, dtype)
    inputs["t"] = inputs["t"].clamp(0, sizes["N"] - 1)  # all targets valid here
    got, ref, _ = run_both(CE, inputs)
    logits = inputs["a"].double() @ inputs["b"].double().T
    want = F.cross_entropy(logits, inputs["t"], reduction="none")
    atol, rtol = DTYPE_TOL[dtype]
    assert_close(got["loss"], want, atol=atol * 4, rtol=rtol * 4, what="loss vs F.cross_entropy")
    assert_close(got["lse"], torch.logsumexp(logits, 1), atol=atol * 4, rtol=rtol * 4, what="lse")
    assert_close(got["loss"], ref["loss"], atol=atol, rtol=rtol, what="loss vs reference executor")


# -- gather_dot: the target logit from the operands ----------------------------------------------
GATHER = _program(
    {
        "a": ["M", "K"],
        "w": ["N", "K"],
        "r": {"shape": ["M"], "dtype": "float32"},
        "t": {"shape": ["M"], "dtype": "int64"},
    },
    [],
    [
        _gemm(
            [
                {"op": "scale_rows", "src": "acc", "vector": "r", "out": "z"},
                {"op": "select_column", "src": "z", "index": "t", "to": "in_epilogue"},
                {"op": "partial_reduce", "src": "z", "kind": "lse", "to": "lse_p"},
            ],
            b="w.T",
            config=SMALL_TILES,
        ),
        {"kind": "gather_dot", "a": "a", "w": "w", "index": "t", "scale": "r", "out": "scaled"},
        {"kind": "gather_dot", "a": "a", "w": "w", "index": "t", "out": "plain"},
        {"kind": "lse_combine", "src": "lse_p", "minus": "scaled", "out": "loss"},
    ],
    {"in_epilogue": "in_epilogue", "scaled": "scaled", "plain": "plain", "loss": "loss"},
)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "sizes", [{"M": 37, "N": 83, "K": 29}, {"M": 5, "N": 160, "K": 300}, {"M": 70, "N": 3, "K": 1}]
)
def test_gather_dot_is_the_target_logit(sizes: dict[str, int], dtype: torch.dtype) -> None:
    inputs = make_inputs(GATHER, sizes, dtype)
    t = inputs["t"].clamp(0, sizes["N"] - 1)
    t[::4] = -100  # ignored tokens
    t[1::7] = sizes["N"]  # one past the last class
    inputs["t"] = t
    got, ref, _ = run_both(GATHER, inputs)
    a, w, r = inputs["a"].double(), inputs["w"].double(), inputs["r"].double()
    valid = (t >= 0) & (t < sizes["N"])
    plain = torch.where(valid, (a * w[torch.where(valid, t, 0)]).sum(1), 0.0)
    atol, rtol = DTYPE_TOL[dtype]
    assert got["plain"].dtype == got["scaled"].dtype == torch.float32
    assert_close(got["plain"], plain, atol=atol * 4, rtol=rtol * 4, what="a·w[t] vs formula")
    assert_close(got["scaled"], plain * r, atol=atol * 4, rtol=rtol * 4, what="r·a·w[t]")
    # the same numbers select_column takes from the GEMM's own tiles
    assert_close(got["scaled"], got["in_epilogue"], atol=atol, rtol=rtol, what="vs epilogue")
    assert_close(got["loss"], ref["loss"], atol=atol, rtol=rtol, what="loss vs reference executor")
    z = (a @ w.T) * r[:, None]
    want = F.cross_entropy(z, torch.where(valid, t, 0), reduction="none")
    counted = valid.nonzero().flatten()
    assert_close(got["loss"][counted], want[counted], atol=atol * 4, rtol=rtol * 4, what="CE")


def test_gather_dot_of_an_empty_batch() -> None:
    inputs = make_inputs(GATHER, {"M": 0, "N": 16, "K": 8}, torch.float32)
    got, _, _ = run_both(GATHER, inputs)
    assert got["scaled"].shape == (0,)


def test_lse_combine_kernel_streams_many_partials() -> None:
    # more partials than one chunk (256) and a row of -inf-heavy values: the online rescaling path
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(7, 700, generator=gen) * 30
    p[2, :600] = float("-inf")
    out = torch.empty(7)
    _launch(p, out, lse=True)
    assert_close(out, torch.logsumexp(p.double(), 1), atol=1e-4, rtol=1e-5, what="lse combine")
    total, q = torch.empty(7), torch.randn(7, 700, generator=gen)
    _launch(q, total, lse=False, scale=0.5)
    assert_close(total, q.double().sum(1) * 0.5, atol=1e-4, rtol=1e-5, what="sum of partials")


def test_a_16_bit_sum_of_partials_is_the_fp32_sum_rounded_once() -> None:
    """The kernel stores into a 16-bit ``out`` itself (no fp32 temporary: the step launches on
    the run's tensors only, so a run plan replays it pinned): the fp32 sum rounded once."""
    q = torch.randn(9, 300, generator=torch.Generator().manual_seed(1)) * 100
    total, half = torch.empty(9), torch.empty(9, dtype=torch.float16)
    _launch(q, total, lse=False, scale=0.25)
    _launch(q, half, lse=False, scale=0.25)
    assert torch.equal(half, total.to(torch.float16))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_sum_partials_rows_and_columns(dtype: torch.dtype) -> None:
    program = _program(
        {"a": ["M", "K"], "b": ["N", "K"]},
        [],
        [
            _gemm(
                [
                    {"op": "partial_reduce", "src": "acc", "kind": "sum", "to": "rows_p"},
                    {
                        "op": "partial_reduce",
                        "src": "acc",
                        "kind": "sum",
                        "axis": "col",
                        "to": "cp",
                    },
                ],
                config=SMALL_TILES,
            ),
            {"kind": "sum_partials", "src": "rows_p", "divide_by": "K + 1", "out": "row_mean"},
            {"kind": "sum_partials", "src": "cp", "dtype": "act", "out": "col_sum"},
        ],
        {"row_mean": "row_mean", "col_sum": "col_sum"},
    )
    sizes = {"M": 37, "N": 50, "K": 29}
    inputs = make_inputs(program, sizes, dtype)
    got, _, _ = run_both(program, inputs)
    acc = inputs["a"].double() @ inputs["b"].double().T
    atol, rtol = DTYPE_TOL[dtype]
    assert got["row_mean"].dtype == torch.float32 and got["col_sum"].dtype == dtype
    assert_close(got["row_mean"], acc.sum(1) / 30, atol=atol * 4, rtol=rtol * 4, what="row mean")
    assert_close(got["col_sum"], acc.sum(0), atol=atol * 40, rtol=rtol * 4, what="column sums")
    compiled = compile_program(program, analyze(program, sizes))
    compiled(inputs)
    (plan,) = compiled._run_plans.values()
    kinds = {type(a).__name__ for a in plan.actions if getattr(a, "step", None) is not None}
    assert kinds == {"PinnedAuxLaunch"}  # in either dtype: no temporary, replayed pinned


# -- RoPE: prep rope_pairs + epilogue rope == Hugging Face ----------------------------------------
def _hf_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' own apply_rotary_pos_emb on [M, heads·D] (an independent implementation)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rows, head = q.shape[0], cos.shape[1]
    q4 = q.reshape(1, rows, -1, head).transpose(1, 2)  # [batch, heads, seq, D]
    out, _ = apply_rotary_pos_emb(q4, q4, cos[None], sin[None])
    return out.transpose(1, 2).reshape(rows, -1)


def _to_pairs(x: torch.Tensor, head: int) -> torch.Tensor:
    """Columns of each head from rotate-half to adjacent-pair order."""
    rows = x.shape[0]
    return x.reshape(rows, -1, 2, head // 2).transpose(2, 3).reshape(rows, -1)


ROPE_QKV = _program(
    {
        "x": ["M", "d"],
        "w_q": ["Nq", "d"],
        "w_k": ["Nkv", "d"],
        "w_v": ["Nkv", "d"],
        "cos": ["M", "D"],
        "sin": ["M", "D"],
    },
    [
        {"kind": "rope_pairs", "weight": "w_q", "head_dim": "D", "out": "w_q_p"},
        {"kind": "rope_pairs", "weight": "w_k", "head_dim": "D", "out": "w_k_p"},
        {"kind": "concat_rows", "tensors": ["w_q_p", "w_k_p", "w_v"], "out": "w_qkv"},
    ],
    [
        _gemm(
            [
                {
                    "op": "rope",
                    "src": "acc",
                    "cos": "cos",
                    "sin": "sin",
                    "out": "r",
                    "rotary_cols": "Nq + Nkv",
                },
                {"op": "store", "src": "r", "to": "qkv"},
            ],
            a="x",
            b="w_qkv.T",
        ),
    ],
    {
        "q": {"tensor": "qkv", "dim": 1, "stop": "Nq"},
        "k": {"tensor": "qkv", "dim": 1, "start": "Nq", "stop": "Nq + Nkv"},
        "v": {"tensor": "qkv", "dim": 1, "start": "Nq + Nkv"},
    },
)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_rope_pairs_and_rope_match_hugging_face(dtype: torch.dtype) -> None:
    sizes = {"M": 37, "d": 24, "D": 8, "Nq": 32, "Nkv": 16}  # 4 query heads, 2 KV heads
    inputs = make_inputs(ROPE_QKV, sizes, dtype)
    inputs["cos"], inputs["sin"] = rope_tables(sizes["M"], sizes["D"], dtype)
    info = analyze(ROPE_QKV, sizes)
    got, _, _ = run_both(ROPE_QKV, inputs)
    outs = ROPE_QKV.select_outputs(got, info.sizes)
    x, cos, sin = (inputs[n].double() for n in ("x", "cos", "sin"))
    atol, rtol = DTYPE_TOL[dtype]
    for name in ("q", "k"):
        want = _to_pairs(_hf_rope(x @ inputs[f"w_{name}"].double().T, cos, sin), 8)
        assert_close(outs[name], want, atol=atol * 4, rtol=rtol * 4, what=f"{name} vs HF RoPE")
    assert_close(outs["v"], x @ inputs["w_v"].double().T, atol=atol * 4, rtol=rtol * 4, what="v")
    assert not outs["q"].is_contiguous()  # a view of the fused output: no copy


def test_unpair_rows_inverts_rope_pairs() -> None:
    data = {
        "block": "test",
        "inputs": {"w": ["R", "C"], "cos": ["R", "D"]},  # cos binds the head width D
        "prep": [{"kind": "rope_pairs", "weight": "w", "head_dim": "D", "out": "w_p"}],
        "steps": [{"kind": "unpair_rows", "src": "w_p", "head_dim": "D", "out": "back"}],
        "outputs": {"back": "back"},
    }
    inputs = {"w": torch.randn(24, 5), "cos": torch.zeros(24, 6)}
    got, _, _ = run_both(Program.parse(data), inputs)
    assert torch.equal(got["w_p"], _to_pairs(inputs["w"].T, 6).T)
    assert torch.equal(got["back"], inputs["w"])
    data["steps"][0]["rows"] = "D * 2"  # only the first two heads are permuted back
    got, _, _ = run_both(Program.parse(data), inputs)
    assert torch.equal(got["back"][:12], inputs["w"][:12])
    assert torch.equal(got["back"][12:], got["w_p"][12:])


def _unpair_parts(parts: list[tuple[str, str]], rows: str | None = None) -> dict[str, Any]:
    """``w`` through prep ``rope_pairs`` and back through ``unpair_rows`` into ``parts``."""
    step: dict[str, Any] = {"kind": "unpair_rows", "src": "w_p", "head_dim": "D"}
    step["parts"] = [{"out": out, "rows": n} for out, n in parts]
    if rows is not None:
        step["rows"] = rows
    return {
        "block": "test",
        "inputs": {"w": ["R", "C"], "cos": ["R", "D"]},  # cos binds the head width D
        "prep": [{"kind": "rope_pairs", "weight": "w", "head_dim": "D", "out": "w_p"}],
        "steps": [step],
        "outputs": {out: out for out, _ in parts},
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("permuted", "heads", "width", "parts"),
    [
        # Q (3 heads of 6), K (1 head), V (1 head, not permuted): a fused QKV gradient's rows
        (4, 5, 5, [("q", "D * 3"), ("k", "D"), ("v", "D")]),
        # all rows permuted, a part boundary inside a head, four parts, 300 columns (2 tiles)
        (None, 5, 300, [("a", "7"), ("b", "D * 2 - 1"), ("c", "1"), ("d", "R - D * 2 - 7")]),
        # no row permuted: a plain split of the rows
        (0, 3, 3, [("x", "R - 5"), ("y", "5")]),
    ],
)
def test_unpair_rows_parts_are_the_inverse_split_by_rows(
    permuted: int | None, heads: int, width: int, parts: list, dtype: torch.dtype
) -> None:
    head_dim = 6
    total = head_dim * heads
    w = torch.randn(total, width).to(dtype)
    program = Program.parse(_unpair_parts(parts, None if permuted is None else f"D * {permuted}"))
    got, ref, _ = run_both(program, {"w": w, "cos": torch.zeros(total, head_dim, dtype=dtype)})
    assert torch.equal(got["w_p"], _to_pairs(w.T, head_dim).T)  # rope_pairs of all rows
    back = head_dim * (heads if permuted is None else permuted)
    want = torch.cat([w[:back], got["w_p"][back:]])  # un-permuted rows, then w_p's copied
    start = 0
    for name, _ in parts:
        out = got[name]
        assert out.is_contiguous() and out._base is None, f"{name} is not a tensor of its own"
        assert out.dtype == dtype
        assert torch.equal(out, want[start : start + out.shape[0]]), name  # exact: a gather
        assert torch.equal(out, ref[name]), f"{name}: kernel vs reference"
        start += out.shape[0]
    assert start == total


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"out": "back"}, "sets both of out and parts; set exactly one"),
        ({"parts": None}, "sets neither of out and parts; set exactly one"),
        ({"parts": []}, "has 0 parts; it writes 1 to 4"),
        ({"parts": [{"out": f"p{i}", "rows": "D"} for i in range(5)]}, "has 5 parts"),
        (
            {"parts": [{"out": "q", "rows": "D"}, {"out": "k", "rows": "R - D * 2"}]},
            "parts take 18 rows ('q': 6, 'k': 12), but src 'w_p'",
        ),
        (
            {"parts": [{"out": "q", "rows": "R"}, {"out": "k", "rows": "0"}]},
            "part 'k' takes 0 rows ('0'); each part takes at least one row",
        ),
        ({"parts": [{"out": "q", "rows": "D"}, {"out": "q", "rows": "R - D"}]}, "tensor 'q' is"),
        ({"parts": [{"out": "w", "rows": "R"}]}, "tensor 'w' is a block input"),
    ],
)
def test_unpair_rows_parts_refusals_name_the_fault(edit: dict[str, Any], message: str) -> None:
    data = _unpair_parts([("q", "D"), ("k", "R - D")])
    data["steps"][0].update(edit)
    data["outputs"] = {"paired": "w_p"}
    program = Program.parse(data)
    with pytest.raises(ProgramError, match=re.escape(message)):
        analyze(program, {"R": 24, "C": 5, "D": 6})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_split_rows_copies_each_row_range_into_a_tensor_of_its_own(dtype: torch.dtype) -> None:
    parts = [("q", "R - N * 2"), ("k", "N"), ("v", "N")]
    program = _program(
        {"x": ["R", "C"], "n": ["N"]},  # n binds the K/V width N
        [],
        [{"kind": "split_rows", "src": "x", "parts": [{"out": o, "rows": r} for o, r in parts]}],
        {o: o for o, _ in parts},
    )
    x = torch.randn(29, 263).to(dtype)  # odd sizes: partial row and column tiles
    got, ref, _ = run_both(program, {"x": x, "n": torch.zeros(5, dtype=dtype)})
    for name, want in zip(("q", "k", "v"), x.split([19, 5, 5]), strict=True):
        assert got[name].is_contiguous() and got[name]._base is None, name
        assert torch.equal(got[name], want), name  # exact: a copy
        assert torch.equal(ref[name], want), name
    with pytest.raises(ProgramError, match=re.escape("split_rows parts take 19 rows ('q': 19)")):
        analyze(
            _program(
                {"x": ["R", "C"]},
                [],
                [{"kind": "split_rows", "src": "x", "parts": [{"out": "q", "rows": "19"}]}],
                {"q": "q"},
            ),
            {"R": 29, "C": 4},
        )


# -- rope_rows: the rotation on a whole tensor, and the inverse with a row dot -------------------
ROPE_ROWS = _program(
    {"a": ["M", "K"], "b": ["N", "K"], "cos": ["M", "D"], "sin": ["M", "D"], "g": ["M", "N"]},
    [],
    [
        _gemm(
            [
                {"op": "rope", "src": "acc", "cos": "cos", "sin": "sin", "out": "r",
                 "rotary_cols": "N - D"},
                {"op": "store", "src": "acc", "to": "z"},
                {"op": "store", "src": "r", "to": "in_epilogue"},
            ],
            config=SMALL_TILES,
        ),
        {"kind": "rope_rows", "src": "z", "cos": "cos", "sin": "sin", "out": "rotated",
         "rotary_cols": "N - D"},
        {"kind": "rope_rows", "src": "g", "cos": "cos", "sin": "sin", "out": "back",
         "inverse": True, "rotary_cols": "N - D", "dot": "in_epilogue", "dot_out": "c",
         "divide_by": "K"},
        {"kind": "rope_rows", "src": "g", "cos": "cos", "sin": "sin", "out": "all"},
    ],
    {"z": "z", "in_epilogue": "in_epilogue", "rotated": "rotated", "back": "back", "c": "c",
     "all": "all"},
)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "sizes",
    [
        {"M": 37, "N": 48, "K": 20, "D": 8},
        {"M": 70, "N": 272, "K": 9, "D": 16},
        {"M": 9, "N": 1040, "K": 5, "D": 16},  # the kernel's 512-column chunks, the last partial
    ],
)
def test_rope_rows_is_the_epilogue_rotation_and_its_inverse(
    sizes: dict[str, int], dtype: torch.dtype
) -> None:
    inputs = make_inputs(ROPE_ROWS, sizes, dtype)
    inputs["cos"], inputs["sin"] = rope_tables(sizes["M"], sizes["D"], dtype)
    got, ref, _ = run_both(ROPE_ROWS, inputs)
    atol, rtol = DTYPE_TOL[dtype]
    # the same rotation as the epilogue op on the GEMM's tile (the last head passes through)
    assert_close(got["rotated"], got["in_epilogue"], atol=atol, rtol=rtol, what="vs epilogue rope")
    # the inverse, against the transpose of each pair's rotation written out
    g, cos, sin = (inputs[n].double() for n in ("g", "cos", "sin"))
    k = torch.arange(sizes["N"] // 2)
    c, s = cos[:, k % (sizes["D"] // 2)], sin[:, k % (sizes["D"] // 2)]
    last = 2 * k >= sizes["N"] - sizes["D"]
    c, s = torch.where(last, 1.0, c), torch.where(last, 0.0, s)
    x, y = g[:, 0::2], g[:, 1::2]
    want = torch.stack((x * c + y * s, y * c - x * s), dim=2).reshape(g.shape)
    assert_close(got["back"], want, atol=atol * 2, rtol=rtol * 2, what="inverse vs formula")
    # rotations keep dot products: Σ g·rope(z) = Σ rope⁻¹(g)·z
    z = got["z"].double()
    assert_close(got["c"], (want * z).sum(1) / sizes["K"], atol=atol * 8, rtol=rtol * 8, what="c")
    assert got["c"].dtype == torch.float32 and got["back"].dtype == dtype
    for name in ("rotated", "back", "c", "all"):
        assert_close(got[name], ref[name], atol=atol, rtol=rtol, what=f"{name} vs reference")


def test_rope_rows_reads_each_tensor_with_its_own_strides() -> None:
    # a transposed gradient, a sin table that is a column slice of a wider one, a strided dot
    sizes = {"M": 21, "N": 48, "K": 20, "D": 8}
    inputs = make_inputs(ROPE_ROWS, sizes, torch.float32)
    cos, sin = rope_tables(sizes["M"], sizes["D"], torch.float32)
    inputs["cos"], inputs["sin"] = cos, torch.cat([sin, sin], dim=1)[:, : sizes["D"]]
    inputs["g"] = inputs["g"].T.contiguous().T
    assert not inputs["g"].is_contiguous() and not inputs["sin"].is_contiguous()
    got, ref, _ = run_both(ROPE_ROWS, inputs)
    for name in ("rotated", "back", "c", "all"):
        assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, what=f"{name} vs reference")


def test_rope_rows_of_an_empty_batch() -> None:
    inputs = make_inputs(ROPE_ROWS, {"M": 0, "N": 16, "K": 8, "D": 8}, torch.float32)
    got, _, _ = run_both(ROPE_ROWS, inputs)
    assert got["back"].shape == (0, 16) and got["c"].shape == (0,)


# -- norm_rows: a post-norm's finishing pass, r ⊙ y ⊙ (offset + γ) [+ residual] ----------------
NORM_ROWS = _program(
    {"a": ["M", "K"], "b": ["N", "K"], "gamma": ["N"], "x": ["M", "N"]},
    [],
    [
        _gemm(
            [
                {"op": "store", "src": "acc", "to": "y"},
                {"op": "partial_reduce", "src": "acc", "kind": "sumsq", "to": "y_sumsq"},
            ],
            config=SMALL_TILES,
        ),
        {"kind": "rstd", "src": "y_sumsq", "eps": 1e-6, "out": "r"},
        {"kind": "norm_rows", "src": "y", "rstd": "r", "weight": "gamma", "offset": 1.0,
         "residual": "x", "out": "h", "rstd_out": "r_h", "rstd_eps": 1e-5},
        {"kind": "norm_rows", "src": "y", "rstd": "r", "weight": "gamma", "out": "n"},
    ],
    {"y": "y", "h": "h", "n": "n", "r_h": "r_h"},
)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "sizes",
    [
        {"M": 37, "N": 45, "K": 20},  # ragged N over several 16-wide tiles
        {"M": 1, "N": 24, "K": 9},  # one token
        {"M": 70, "N": 1100, "K": 5},  # the kernel's 1024-column chunks, the last partial
    ],
)
def test_norm_rows_is_the_post_norm_with_its_residual(
    sizes: dict[str, int], dtype: torch.dtype
) -> None:
    inputs = make_inputs(NORM_ROWS, sizes, dtype)
    got, ref, _ = run_both(NORM_ROWS, inputs)
    atol, rtol = DTYPE_TOL[dtype]
    # Gemma's x + x̂ · (1 + γ) and Llama's x̂ · γ, from the stored y written out
    y, gamma, x = got["y"].double(), inputs["gamma"].double(), inputs["x"].double()
    xhat = y / (y.pow(2).mean(1, keepdim=True) + 1e-6).sqrt()
    assert_close(got["h"], x + xhat * (1 + gamma), atol=atol * 2, rtol=rtol * 2, what="h")
    assert_close(got["n"], xhat * gamma, atol=atol * 2, rtol=rtol * 2, what="n")
    # the next norm's statistic, of h as stored
    r_h = (got["h"].double().pow(2).mean(1) + 1e-5).rsqrt()
    assert_close(got["r_h"], r_h, atol=2e-5, rtol=2e-5, what="r_h")
    assert got["h"].dtype == got["n"].dtype == dtype and got["r_h"].dtype == torch.float32
    for name in ("h", "n", "r_h"):
        assert_close(got[name], ref[name], atol=atol, rtol=rtol, what=f"{name} vs reference")


def test_norm_rows_reads_each_tensor_with_its_own_strides() -> None:
    sizes = {"M": 21, "N": 40, "K": 8}
    inputs = make_inputs(NORM_ROWS, sizes, torch.float32)
    inputs["x"] = inputs["x"].T.contiguous().T
    inputs["gamma"] = torch.stack([inputs["gamma"], -inputs["gamma"]], dim=1)[:, 0]
    assert not inputs["x"].is_contiguous() and not inputs["gamma"].is_contiguous()
    got, ref, _ = run_both(NORM_ROWS, inputs)
    for name in ("h", "n"):
        assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, what=f"{name} vs reference")


def test_norm_rows_of_an_empty_batch() -> None:
    inputs = make_inputs(NORM_ROWS, {"M": 0, "N": 16, "K": 8}, torch.float32)
    got, _, _ = run_both(NORM_ROWS, inputs)
    assert got["h"].shape == (0, 16)


# -- rms_rows: a pre-norm as rows, its statistic in the same launch --------------------------------
def _rms_rows_pair(offset: float, keep: bool) -> tuple[Program, Program]:
    """The one-launch ``rms_rows`` and the two steps it replaces (``rstd`` over x, then
    ``norm_rows``), the same outputs."""
    inputs = {"x": ["M", "N"], "gamma": ["N"]}
    stat = {"stat_out": "r"} if keep else {}
    outputs = {"h": "h", **({"r": "r"} if keep else {})}
    fused = _program(
        inputs, [],
        [{"kind": "rms_rows", "src": "x", "eps": 1e-5, "weight": "gamma", "offset": offset,
          "out": "h", **stat}],
        outputs,
    )  # fmt: skip
    steps = _program(
        inputs, [],
        [{"kind": "rstd", "src": "x", "eps": 1e-5, "out": "r"},
         {"kind": "norm_rows", "src": "x", "rstd": "r", "weight": "gamma", "offset": offset,
          "out": "h"}],
        outputs,
    )  # fmt: skip
    return fused, steps


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "sizes",
    [{"M": 37, "N": 45}, {"M": 1, "N": 24}, {"M": 70, "N": 1100}],  # 1100: two column chunks
    ids=["ragged", "one-token", "two-chunks"],
)
@pytest.mark.parametrize(("offset", "keep"), [(0.0, True), (1.0, False)], ids=["llama", "gemma"])
def test_rms_rows_is_rstd_then_norm_rows_bit_for_bit(
    sizes: dict[str, int], dtype: torch.dtype, offset: float, keep: bool
) -> None:
    fused, steps = _rms_rows_pair(offset, keep)
    inputs = make_inputs(fused, sizes, dtype)
    got, ref, exact = run_both(fused, inputs)
    want, _, _ = run_both(steps, inputs)
    assert torch.equal(got["h"], want["h"]) and got["h"].dtype == dtype
    if keep:
        assert torch.equal(got["r"], want["r"]) and got["r"].dtype == torch.float32
    atol, rtol = DTYPE_TOL[dtype]
    assert_close(got["h"], exact["h"], atol=atol, rtol=rtol, what="h vs float64")
    assert_close(got["h"], ref["h"], atol=atol, rtol=rtol, what="h vs reference")


def test_rms_rows_reads_its_input_with_its_own_strides() -> None:
    fused, steps = _rms_rows_pair(0.0, keep=True)
    inputs = make_inputs(fused, {"M": 21, "N": 40}, torch.float32)
    inputs["x"] = inputs["x"].T.contiguous().T
    assert not inputs["x"].is_contiguous()
    got, _, _ = run_both(fused, inputs)
    want, _, _ = run_both(steps, {n: t.contiguous() for n, t in inputs.items()})
    assert torch.equal(got["h"], want["h"]) and torch.equal(got["r"], want["r"])


def test_rms_rows_of_an_empty_batch() -> None:
    fused, _ = _rms_rows_pair(0.0, keep=True)
    got, _, _ = run_both(fused, make_inputs(fused, {"M": 0, "N": 16}, torch.float32))
    assert got["h"].shape == (0, 16) and got["r"].shape == (0,)


def test_the_row_kernel_computing_its_statistic_compiles_for_hopper() -> None:
    """The interpreter runs the kernel's Python; this builds its rms_rows form (the statistic's
    first pass, and its store) for sm_90, as a GPU would."""
    pointers = {"src_ptr": "*bf16", "rstd_ptr": "*fp32", "weight_ptr": "*bf16", "res_ptr": "*bf16",
                "out_ptr": "*bf16", "rstd_out_ptr": "*fp32"}  # fmt: skip
    floats = dict.fromkeys(("offset", "inv_cols", "eps", "stat_eps"), "fp32")
    ints = ("rows", "cols", "stride_sm", "stride_sn", "stride_r", "stride_w", "stride_rm",
            "stride_rn", "stride_om", "stride_on")  # fmt: skip
    constexprs = {"HAS_RESIDUAL": False, "HAS_RSTD_OUT": False, "COMPUTE_RSTD": True,
                  "STORE_RSTD": True, "BLOCK_ROWS": 4, "BLOCK_COLS": 1024}  # fmt: skip
    signature = {**pointers, **floats, **dict.fromkeys(ints, "i32")}
    ptx = compile_for_hopper(
        "coda.primitives.aux.norm_rows:_norm_rows_kernel", signature, constexprs
    )
    assert "rsqrt" in ptx


def _norm_rows_program(**step: Any) -> dict[str, Any]:
    return {
        "block": "test",
        "inputs": {"y": ["M", "N"], "r": {"shape": ["M"], "dtype": "float32"}, "g": ["N"],
                   "x": ["M", "N"], "v": ["N", "M"]},
        "steps": [{"kind": "norm_rows", "src": "y", "rstd": "r", "weight": "g", "out": "h",
                   **step}],
        "outputs": {"h": "h"},
    }  # fmt: skip


# -- errors that name the problem -----------------------------------------------------------------
def _rope_program(**rope: Any) -> dict[str, Any]:
    return {
        "block": "test",
        "inputs": {"a": ["M", "K"], "b": ["N", "K"], "cos": ["M", "D"], "sin": ["M", "D"]},
        "steps": [
            _gemm(
                [
                    {"op": "rope", "src": "acc", "cos": "cos", "sin": "sin", "out": "y", **rope},
                    {"op": "store", "src": "y", "to": "y"},
                ]
            )
        ],
        "outputs": {"y": "y"},
    }


def _rope_rows_program(**step: Any) -> dict[str, Any]:
    return {
        "block": "test",
        "inputs": {"g": ["M", "N"], "cos": ["M", "D"], "sin": ["M", "D"]},
        "steps": [
            {"kind": "rope_rows", "src": "g", "cos": "cos", "sin": "sin", "out": "y", **step}
        ],
        "outputs": {"y": "y"},
    }


BAD: dict[str, tuple[dict[str, Any], dict[str, int], list[str]]] = {
    "rope over a partial head": (
        _rope_program(),
        {"M": 4, "K": 8, "N": 20, "D": 8},
        ["rope rotates 20 columns of 'acc'", "heads of width 8", "rotary_cols"],
    ),
    "rope rotary_cols with an unknown size": (
        _rope_program(rotary_cols="Nq + Nkv"),
        {"M": 4, "K": 8, "N": 16, "D": 8},
        ["uses size 'Nkv', which this program does not bind", "known:"],
    ),
    "rope rotary_cols past the edge": (
        _rope_program(rotary_cols="N + D"),
        {"M": 4, "K": 8, "N": 16, "D": 8},
        ["rotary_cols 'N + D' = 24 is outside src 'acc''s 16 columns"],
    ),
    "select_column with a float index": (
        {
            "block": "test",
            "inputs": {"a": ["M", "K"], "b": ["N", "K"], "t": ["M"]},
            "steps": [_gemm([{"op": "select_column", "src": "acc", "index": "t", "to": "p"}])],
            "outputs": {"p": "p"},
        },
        {"M": 4, "K": 8, "N": 16},
        ["index 't' must be an int64 tensor of column indices, but it is act"],
    ),
    "pairwise clashes with x0": (
        {
            "block": "test",
            "inputs": {"a": ["M", "K"], "b": ["N", "K"]},
            "steps": [
                _gemm(
                    [
                        {"op": "map", "expr": "acc * 2", "out": "x0"},
                        {"op": "pairwise", "src": "acc", "expr0": "x0 * x1", "out": "y"},
                        {"op": "store", "src": "y", "to": "y"},
                    ]
                )
            ],
            "outputs": {"y": "y"},
        },
        {"M": 4, "K": 8, "N": 16},
        ["epilogue value 'x0' clashes with the pair member", "rename that value"],
    ),
    "pairwise with a full-width neighbour": (
        {
            "block": "test",
            "inputs": {"a": ["M", "K"], "b": ["N", "K"]},
            "steps": [
                _gemm(
                    [
                        {"op": "pairwise", "src": "acc", "expr0": "x0 * acc", "out": "y"},
                        {"op": "store", "src": "y", "to": "y"},
                    ]
                )
            ],
            "outputs": {"y": "y"},
        },
        {"M": 4, "K": 8, "N": 16},
        ["reads 'acc' (tile [M, N])", "must be pair-wide (tile [M, N/2])"],
    ),
    "lse_combine of sums of squares": (
        {
            "block": "test",
            "inputs": {"a": ["M", "K"], "b": ["N", "K"]},
            "steps": [
                _gemm([{"op": "partial_reduce", "src": "acc", "kind": "sumsq", "to": "p"}]),
                {"kind": "lse_combine", "src": "p", "out": "l"},
            ],
            "outputs": {"l": "l"},
        },
        {"M": 4, "K": 8, "N": 16},
        ["lse_combine needs partials of kind lse, but 'p' is partials(sumsq, axis=row)"],
    ),
    "gather_dot with another K": (
        {
            "block": "test",
            "inputs": {"a": ["M", "K"], "w": ["N", "N"], "t": {"shape": ["M"], "dtype": "int64"}},
            "steps": [{"kind": "gather_dot", "a": "a", "w": "w", "index": "t", "out": "o"}],
            "outputs": {"o": "o"},
        },
        {"M": 4, "K": 8, "N": 16},
        ["gather_dot needs a [M, K] and w [W, K] with the same K", "given as w.T"],
    ),
    "gather_dot with float indices": (
        {
            "block": "test",
            "inputs": {"a": ["M", "K"], "w": ["N", "K"], "t": ["M"]},
            "steps": [{"kind": "gather_dot", "a": "a", "w": "w", "index": "t", "out": "o"}],
            "outputs": {"o": "o"},
        },
        {"M": 4, "K": 8, "N": 16},
        ["index 't' must be an int64 tensor of row indices"],
    ),
    "gather_dot with a scale of the wrong length": (
        {
            "block": "test",
            "inputs": {
                "a": ["M", "K"],
                "w": ["N", "K"],
                "r": ["N"],
                "t": {"shape": ["M"], "dtype": "int64"},
            },
            "steps": [
                {"kind": "gather_dot", "a": "a", "w": "w", "index": "t", "scale": "r", "out": "o"}
            ],
            "outputs": {"o": "o"},
        },
        {"M": 4, "K": 8, "N": 16},
        ["scale 'r' must be a vector of length 4 (one factor per row of a)"],
    ),  # fmt: skip
    "rope_rows over a partial head": (
        _rope_rows_program(),
        {"M": 4, "N": 20, "D": 8},
        ["rope_rows rotates 20 of 'g''s 20 columns", "heads of width 8", "rotary_cols"],
    ),
    "rope_rows with a table of other rows": (
        {**_rope_rows_program(), "inputs": {"g": ["M", "N"], "cos": ["N", "D"], "sin": ["N", "D"]}},
        {"M": 4, "N": 16, "D": 8},
        ["rope_rows table 'cos' is", "with M = 4 rows (one per row of 'g')"],
    ),
    "rope_rows dot of another shape": (
        _rope_rows_program(dot="cos", dot_out="c"),
        {"M": 4, "N": 16, "D": 8},
        ["rope_rows dot 'cos'", "must have the shape of src 'g'"],
    ),
    "rope_rows dot without a name for its sums": (
        _rope_rows_program(dot="g"),
        {"M": 4, "N": 16, "D": 8},
        ["rope_rows with dot needs dot_out"],
    ),
    "rope_rows divide_by without dot": (
        _rope_rows_program(divide_by="N"),
        {"M": 4, "N": 16, "D": 8},
        ["dot_out and divide_by need dot"],
    ),
    "output view outside the tensor": (
        {
            "block": "test",
            "inputs": {"a": ["M", "K"], "b": ["N", "K"]},
            "steps": [_gemm([{"op": "store", "src": "acc", "to": "c"}])],
            "outputs": {"c": {"tensor": "c", "dim": 1, "start": "N", "stop": "N + 2"}},
        },
        {"M": 4, "K": 8, "N": 16},
        ["outputs.c", "view [16:18] of 'c' along dim 1 is empty or outside its extent 16"],
    ),
    "norm_rows with a residual of another shape": (
        _norm_rows_program(residual="v"),
        {"M": 4, "N": 6},
        ["norm_rows residual 'v' is [6, 4]", "must have the shape of src 'y', [4, 6]"],
    ),
    "norm_rows with a weight per row": (
        {**_norm_rows_program(), "inputs": {"y": ["M", "N"], "r": ["M"], "g": ["M"]}},
        {"M": 4, "N": 6},
        ["weight 'g' must be a vector of length 6 (one scale per column of 'y')"],
    ),
    "norm_rows with rstd_out named like out": (
        _norm_rows_program(rstd_out="h"),
        {"M": 4, "N": 6},
        ["norm_rows writes out and rstd_out to the same name 'h'"],
    ),
    "rms_rows with stat_out named like out": (
        {
            "block": "test",
            "inputs": {"x": ["M", "N"], "g": ["N"]},
            "steps": [{"kind": "rms_rows", "src": "x", "weight": "g", "out": "h", "stat_out": "h"}],
            "outputs": {"h": "h"},
        },
        {"M": 4, "N": 6},
        ["rms_rows writes out and stat_out to the same name 'h'"],
    ),
    "rms_rows with a weight per row": (
        {
            "block": "test",
            "inputs": {"x": ["M", "N"], "g": ["M"]},
            "steps": [{"kind": "rms_rows", "src": "x", "weight": "g", "out": "h"}],
            "outputs": {"h": "h"},
        },
        {"M": 4, "N": 6},
        ["weight 'g' must be a vector of length 6 (one scale per column of 'x')"],
    ),
    "norm_rows with rstd of the wrong length": (
        {**_norm_rows_program(), "inputs": {"y": ["M", "N"], "r": ["N"], "g": ["N"]}},
        {"M": 4, "N": 6},
        ["rstd 'r' must be a vector of length 4 (one reciprocal per row of 'y')"],
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_new_primitive_use_is_rejected_specifically(name: str) -> None:
    data, sizes, fragments = BAD[name]
    with pytest.raises(ProgramError) as err:
        analyze(Program.parse(data), sizes)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


def test_size_expressions_are_whitelisted() -> None:
    with pytest.raises(ProgramError, match="Call is not allowed"):
        Program.parse(_rope_program(rotary_cols="len(N)"))
    with pytest.raises(ProgramError, match="not valid syntax"):
        Program.parse(_rope_program(rotary_cols="N +"))
    # a threshold on a size (right below it, wrong past it) cannot be written
    for expr, what in [("N - N // 81 * 2", "floor division '//'"), ("N - N % 4", "modulo '%'")]:
        with pytest.raises(ProgramError, match=f"{what} is not allowed"):
            Program.parse(_rope_program(rotary_cols=expr))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fold_norm_weight_in_16_bits_is_the_fp32_formula_bit_for_bit(dtype: torch.dtype) -> None:
    """The one-pass 16-bit fold (every training step) rounds exactly like fp32-then-round."""
    from coda.primitives.base import RunEnv
    from coda.primitives.prep.fold_norm_weight import FoldNormWeight

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(67, 131, generator=gen) * 3).to(dtype)
    gamma = (torch.randn(131, generator=gen) * torch.logspace(-3, 3, 131)).to(dtype)
    step = FoldNormWeight(weight="w", gamma="gamma", out="wg")
    env = RunEnv({"w": w, "gamma": gamma}, {})
    step.apply(env)
    want = (w.float() * gamma.float()[None, :]).to(dtype)
    assert env.tensors["wg"].dtype == dtype and torch.equal(env.tensors["wg"], want)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_fold_norm_weight_with_an_offset_scales_by_one_plus_gamma(dtype: torch.dtype) -> None:
    """Gemma's ``x̂ · (1 + γ)``: ``offset=1`` folds ``1 + γ`` (formed wider than γ's dtype), one
    rounding from the exact product on ragged shapes; the fused prep path gives the same bits,
    and the float64 reference executor the exact product."""
    from coda.primitives.base import RunEnv
    from coda.primitives.prep.fold_norm_weight import FoldNormWeight
    from coda.primitives.prep.fusion import run_prep

    gen = torch.Generator().manual_seed(2)
    step = FoldNormWeight(weight="w", gamma="gamma", out="wg", offset=1.0)
    for rows, cols in [(37, 53), (1, 7), (5, 1)]:
        w = torch.randn(rows, cols, generator=gen).to(dtype)
        gamma = (torch.randn(cols, generator=gen) * 0.3).to(dtype)
        exact = w.double() * (1.0 + gamma.double())[None, :]
        env = RunEnv({"w": w, "gamma": gamma}, {})
        step.apply(env)
        got = env.tensors["wg"]
        ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-23
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), exact, rtol=ulp, atol=0)
        fused = RunEnv({"w": w, "gamma": gamma}, {})
        run_prep([step], fused, {"wg"})
        assert torch.equal(fused.tensors["wg"], got)
        ref = RunEnv({"w": w.double(), "gamma": gamma.double()}, {}, compute=torch.float64)
        step.apply(ref)
        assert torch.equal(ref.tensors["wg"], exact)


@pytest.mark.parametrize(
    "w_dtype,g_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ],
    ids=["bf16", "fp16", "fp32", "bf16-fp32-gamma"],
)
def test_the_fold_kernel_is_the_fp32_formula_bit_for_bit(
    w_dtype: torch.dtype, g_dtype: torch.dtype
) -> None:
    """The GPU fold (Triton) on odd shapes spanning several tiles, a transposed weight and a
    strided γ: the same bits as fp32-then-round. The interpreter casts fp32 to bf16 by truncation
    (the GPU rounds to nearest even), so there bf16 results may sit one bf16 step toward zero;
    tests/gpu checks bf16 bit for bit."""
    from coda.primitives import backend
    from coda.primitives.prep.fold_norm_weight import scale_columns

    gen = torch.Generator().manual_seed(1)
    for rows, cols in [(37, 301), (1, 5), (0, 7)]:
        w = (torch.randn(cols, rows, generator=gen) * 3).to(w_dtype).T  # not contiguous
        wide = torch.randn(2 * cols, generator=gen) * torch.logspace(-3, 3, 2 * cols)
        gamma = wide.to(g_dtype)[::2]  # stride 2
        got = scale_columns(w, gamma)
        exact = w.float() * gamma.float()[None, :]
        want = exact.to(w_dtype)
        assert got.dtype == w_dtype and got.shape == (rows, cols)
        if w_dtype == torch.bfloat16 and backend.INTERPRET:
            truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(w_dtype)
            assert torch.equal(got, truncated) or torch.equal(got, want)
        else:
            assert torch.equal(got, want)


def test_interleave_rows_of_one_buffers_views_is_that_buffer() -> None:
    """``w[0::2]`` and ``w[1::2]`` interleave back into ``w`` itself (no copy); any other pair
    — separate tensors, swapped, shifted, transposed — gets the copying interleave, same values."""
    from coda.primitives.base import RunEnv
    from coda.primitives.prep.layout import InterleaveRows, interleaved_buffer

    w = torch.randn(10, 7)
    step = InterleaveRows(first="a", second="b", out="ab")
    env = RunEnv({"a": w[0::2], "b": w[1::2]}, {})
    step.apply(env)
    assert env.tensors["ab"].data_ptr() == w.data_ptr() and torch.equal(env.tensors["ab"], w)
    assert env.tensors["ab"].is_contiguous()
    offset = torch.randn(11, 7)[1:]  # same layout, storage offset one row in
    assert interleaved_buffer(offset[0::2], offset[1::2]).data_ptr() == offset.data_ptr()
    # one storage through two base tensors (no common _base): found through the storage
    assert interleaved_buffer(w.detach()[0::2], w[1::2]).data_ptr() == w.data_ptr()
    not_one_buffer = {
        "separate": (w[0::2].clone(), w[1::2].clone()),
        "swapped": (w[1::2], w[0::2]),
        "shifted": (w[0:8:2], w[3::2]),
        "transposed": (w.T[0::2].T, w.T[1::2].T),
        "other dtype": (w[0::2], w[1::2].double()),
    }
    for name, (a, b) in not_one_buffer.items():
        assert interleaved_buffer(a, b) is None, name
    a, b = not_one_buffer["swapped"]
    env = RunEnv({"a": a, "b": b}, {})
    step.apply(env)
    assert env.tensors["ab"].data_ptr() != w.data_ptr()
    assert torch.equal(env.tensors["ab"][0::2], a) and torch.equal(env.tensors["ab"][1::2], b)
