"""Every epilogue primitive against its PyTorch semantics, through the Triton interpreter.

Each case is one gemm step whose epilogue exercises the primitive; the kernel's outputs are compared
with (1) the reference executor at kernel precision (same roundings: tight) and (2) an independent
formula written here in float64 (the primitive's documented meaning), in fp32 and fp16, at ragged
shapes that are not tile multiples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from coda.primitives import EpilogueOp, analyze, bind_sizes, compile_program
from coda.primitives.reference import execute_reference
from coda.sandbox.compare import assert_close
from tests.helpers import DTYPE_TOL, gemm_program, make_inputs, rope_tables, run_both

SIZES = [
    {"M": 37, "N": 50, "K": 29},  # ragged everywhere (N even for pairs)
    {"M": 64, "N": 64, "K": 32},  # tile multiples
    {"M": 5, "N": 18, "K": 70},  # fewer rows than a tile, several K steps
]
DTYPES = [torch.float32, torch.float16]


@dataclass
class Case:
    epilogue: list[dict[str, Any]]
    expect: Callable[[torch.Tensor, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    extra: dict[str, Any] = field(default_factory=dict)
    steps_before: list[dict[str, Any]] = field(default_factory=list)
    outputs: dict[str, str] | None = None
    rope: bool = False  # inputs cos/sin are Hugging Face-like tables [M, D]


def _store(src: str, to: str | None = None, **kw: Any) -> dict[str, Any]:
    return {"op": "store", "src": src, "to": to or src, **kw}


MAP_EXPR = (
    "silu(acc) + tanh(acc) * 0.5 - rsqrt(abs(acc) + 1) + where(acc > 0, exp(-acc), "
    "log(1 + acc * acc)) + max(acc, 0.1) ** 2 / sqrt(2) - min(sigmoid(acc), 0.7) "
    "+ acc ** -2 * 0 - (-acc)"
)


def _map_expect(acc: torch.Tensor) -> torch.Tensor:
    return (
        F.silu(acc)
        + torch.tanh(acc) * 0.5
        - torch.rsqrt(acc.abs() + 1)
        + torch.where(acc > 0, torch.exp(-acc), torch.log(1 + acc * acc))
        + torch.clamp(acc, min=0.1) ** 2 / 2**0.5
        - torch.clamp(torch.sigmoid(acc), max=0.7)
        + acc
    )


def _partials_case(kind: str, axis: str) -> Case:
    reduce = {
        "sum": lambda x, d: x.sum(d),
        "sumsq": lambda x, d: (x * x).sum(d),
        "max": lambda x, d: x.amax(d),
        "lse": lambda x, d: x.exp().sum(d).log(),
    }[kind]
    combine = {
        "sum": lambda p: p.sum(1),
        "sumsq": lambda p: p.sum(1),
        "max": lambda p: p.amax(1),
        "lse": lambda p: p.exp().sum(1).log(),
    }

    def expect(acc: torch.Tensor, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Partial buffers are checked against the reference executor; their combination (the
        # full-row or full-column reduction) against the formula.
        return {
            "__combined__": reduce(acc, 1 if axis == "row" else 0),
            "__combine__": combine[kind],
        }

    return Case(
        [
            {"op": "partial_reduce", "src": "acc", "kind": kind, "axis": axis, "to": "p"},
            _store("acc", "c"),
        ],
        expect,
        outputs={"c": "c"},
    )


def _rope_formula(
    acc: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotated: int | None = None,
    inverse: bool = False,
) -> torch.Tensor:
    """Hugging Face's rotate-half RoPE, per head, on acc's adjacent pairs read as (x1_p, x2_p)."""
    rows, width = acc.shape
    head = cos.shape[1]
    out = acc.clone()
    for h in range((width if rotated is None else rotated) // head):
        cols = slice(h * head, (h + 1) * head)
        x1, x2 = acc[:, cols][:, 0::2], acc[:, cols][:, 1::2]
        q = torch.cat([x1, x2], dim=1)  # this head in rotate-half order
        rotate_half = torch.cat([-x2, x1], dim=1)
        rot = q * cos + rotate_half * (-sin if inverse else sin)
        out[:, cols] = torch.stack([rot[:, : head // 2], rot[:, head // 2 :]], 2).reshape(
            rows, head
        )
    return out


def _rope_hf_formula(
    acc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int | None = None
) -> torch.Tensor:
    """Hugging Face's rotate-half RoPE of acc's heads read as pairs (x1_p, x2_p), each head
    written in rotate-half order ``[x1 | x2]``; columns from ``rotated`` on are kept."""
    out = acc.clone()
    head = cos.shape[1]
    for h in range((acc.shape[1] if rotated is None else rotated) // head):
        cols = slice(h * head, (h + 1) * head)
        x1, x2 = acc[:, cols][:, 0::2], acc[:, cols][:, 1::2]
        q = torch.cat([x1, x2], dim=1)
        out[:, cols] = q * cos + torch.cat([-x2, x1], dim=1) * sin
    return out


def _head_rms_formula(
    acc: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm of each ``len(weight)``-wide head of acc, head by head."""
    head, out = weight.shape[0], torch.empty_like(acc)
    for h in range(acc.shape[1] // head):
        x = acc[:, h * head : (h + 1) * head]
        out[:, h * head : (h + 1) * head] = (
            x / torch.sqrt((x * x).mean(1, keepdim=True) + eps) * (offset + weight)
        )
    return out


SWIGLU_DG = "acc * x1 * sigmoid(x0) * (1 + x0 * (1 - sigmoid(x0)))"
SWIGLU_DU = "acc * silu(x0)"


def _swiglu_bwd_formula(da: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """d/d(g, u) of silu(g)·u against da, by autograd, interleaved like z."""
    g, u = z[:, 0::2].clone().requires_grad_(), z[:, 1::2].clone().requires_grad_()
    dg, du = torch.autograd.grad(F.silu(g) * u, [g, u], da)
    return torch.stack([dg, du], 2).flatten(1)


def _select_formula(acc: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.tensor(
        [float(acc[i, j]) if 0 <= j < acc.shape[1] else 0.0 for i, j in enumerate(index.tolist())],
        dtype=torch.float64,
    )


def _onehot_formula(acc: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(acc)
    for i, j in enumerate(index.tolist()):
        if 0 <= j < acc.shape[1]:
            out[i, j] = 1.0
    return out


CASES: dict[str, Case] = {
    "scale_rows": Case(
        [{"op": "scale_rows", "src": "acc", "vector": "v", "out": "y"}, _store("y")],
        lambda acc, t: {"y": acc * t["v"][:, None]},
        {"v": ["M"]},
    ),
    "scale_cols": Case(
        [{"op": "scale_cols", "src": "acc", "vector": "v", "out": "y"}, _store("y")],
        lambda acc, t: {"y": acc * t["v"][None, :]},
        {"v": ["N"]},
    ),
    "add_row_vector": Case(
        [{"op": "add_row_vector", "src": "acc", "vector": "v", "out": "y"}, _store("y")],
        lambda acc, t: {"y": acc + t["v"][:, None]},
        {"v": ["M"]},
    ),
    "add_col_vector": Case(
        [{"op": "add_col_vector", "src": "acc", "vector": "v", "out": "y"}, _store("y")],
        lambda acc, t: {"y": acc + t["v"][None, :]},
        {"v": ["N"]},
    ),
    "add_tile": Case(
        [{"op": "add_tile", "src": "acc", "tensor": "r", "out": "y"}, _store("y")],
        lambda acc, t: {"y": acc + t["r"]},
        {"r": ["M", "N"]},
    ),
    "load_tile": Case(
        # a 2N-wide tile (interleaved pairs, as saved for a backward pass), contracted back to N
        [
            {"op": "load_tile", "tensor": "z", "out": "zt"},
            {"op": "swiglu", "src": "zt", "out": "s"},
            {"op": "map", "expr": "acc * s", "out": "y"},
            _store("y"),
        ],
        lambda acc, t: {"y": acc * F.silu(t["z"][:, 0::2]) * t["z"][:, 1::2]},
        {"z": ["M", "N2"]},
    ),
    "map": Case(
        [{"op": "map", "expr": MAP_EXPR, "out": "y"}, _store("y")],
        lambda acc, t: {"y": _map_expect(acc)},
    ),
    "swiglu": Case(
        [{"op": "swiglu", "src": "acc", "out": "y"}, _store("y")],
        lambda acc, t: {"y": F.silu(acc[:, 0::2]) * acc[:, 1::2]},
    ),
    "partial_reduce": _partials_case("sumsq", "row"),
    "store": Case(
        [_store("acc", "first_plus", mode="accumulate"), _store("acc", "c32", dtype="float32")],
        lambda acc, t: {"first_plus": t["__first__"] + acc, "c32": acc},
        steps_before=[
            {
                "kind": "gemm",
                "name": "first",
                "a": "a",
                "b": "b.T",
                "epilogue": [
                    {"op": "map", "expr": "acc * 0.5", "out": "h"},
                    _store("h", "first_plus"),
                ],
            }
        ],
        outputs={"first_plus": "first_plus", "c32": "c32"},
    ),
    "rope": Case(
        [{"op": "rope", "src": "acc", "cos": "cos", "sin": "sin", "out": "y"}, _store("y")],
        lambda acc, t: {"y": _rope_formula(acc, t["cos"], t["sin"])},
        {"cos": ["M", "D"], "sin": ["M", "D"]},
        rope=True,
    ),
    "head_rmsnorm": Case(
        # heads of 2 columns (a width dividing every test N; wider heads: test_rotary_pieces.py)
        [
            {"op": "head_rmsnorm", "src": "acc", "weight": "g", "head_dim": "2", "eps": 1e-5}
            | {"out": "y"},
            _store("y"),
        ],
        lambda acc, t: {"y": _head_rms_formula(acc, t["g"], 1e-5)},
        {"g": [2]},
    ),
    "rope_full": Case(
        # random tables whose halves differ: each member of a pair has its own angle
        [{"op": "rope_full", "src": "acc", "cos": "cos", "sin": "sin", "out": "y"}, _store("y")],
        lambda acc, t: {"y": _rope_formula(acc, t["cos"], t["sin"])},
        {"cos": ["M", "D"], "sin": ["M", "D"]},
    ),
    "store_rotate_half": Case(
        [
            {"op": "rope", "src": "acc", "cos": "cos", "sin": "sin", "out": "r"},
            {"op": "store_rotate_half", "src": "r", "to": "y", "head_dim": "D"},
        ],
        lambda acc, t: {"y": _rope_hf_formula(acc, t["cos"], t["sin"])},
        {"cos": ["M", "D"], "sin": ["M", "D"]},
        outputs={"y": "y"},
        rope=True,
    ),
    "pairwise": Case(
        # SwiGLU backward: z = [g, u] interleaved (2N wide) next to da = acc (N wide).
        [
            {"op": "load_tile", "tensor": "z", "out": "zt"},
            {"op": "pairwise", "src": "zt", "expr0": SWIGLU_DG, "expr1": SWIGLU_DU, "out": "dz"},
            _store("dz"),
        ],
        lambda acc, t: {"dz": _swiglu_bwd_formula(acc, t["z"])},
        {"z": ["M", "N2"]},
    ),
    "split_pairs": Case(
        [
            {"op": "split_pairs", "src": "acc", "first": "g", "second": "u"},
            _store("g"),
            _store("u"),
        ],
        lambda acc, t: {"g": acc[:, 0::2], "u": acc[:, 1::2]},
    ),
    "join_pairs": Case(
        [
            {"op": "split_pairs", "src": "acc", "first": "g", "second": "u"},
            {"op": "map", "expr": "u * 2", "out": "u2"},
            {"op": "join_pairs", "first": "u2", "second": "g", "out": "y"},
            _store("y"),
        ],
        lambda acc, t: {"y": torch.stack([2 * acc[:, 1::2], acc[:, 0::2]], 2).flatten(1)},
    ),
    "select_column": Case(
        [{"op": "select_column", "src": "acc", "index": "t", "to": "picked"}],
        lambda acc, t: {"picked": _select_formula(acc, t["t"])},
        {"t": {"shape": ["M"], "dtype": "int64"}},
        outputs={"picked": "picked"},
    ),
    "onehot": Case(
        [
            {"op": "onehot", "index": "t", "out": "oh"},
            {"op": "map", "expr": "acc - 3 * oh", "out": "y"},
            _store("y"),
        ],
        lambda acc, t: {"y": acc - 3 * _onehot_formula(acc, t["t"])},
        {"t": {"shape": ["M"], "dtype": "int64"}},
    ),
    "load_row_vector": Case(
        [
            {"op": "load_row_vector", "vector": "v", "out": "rv"},
            {"op": "map", "expr": "acc * rv - rv", "out": "y"},
            _store("y"),
        ],
        lambda acc, t: {"y": (acc - 1) * t["v"][:, None]},
        {"v": ["M"]},
    ),
    "load_col_vector": Case(
        [
            {"op": "load_col_vector", "vector": "v", "out": "cv"},
            {"op": "map", "expr": "acc + cv * cv", "out": "y"},
            _store("y"),
        ],
        lambda acc, t: {"y": acc + t["v"][None, :] ** 2},
        {"v": ["N"]},
    ),
}
EXTRA_CASES = {
    f"partial_reduce[{k},{a}]": _partials_case(k, a)
    for k in ("sum", "sumsq", "max", "lse")
    for a in ("row", "col")
}
EXTRA_CASES["rope[inverse,V passes]"] = Case(
    # the last head passes through (a V head of a fused QKV output); rotation by the negative angle
    [
        {
            "op": "rope",
            "src": "acc",
            "cos": "cos",
            "sin": "sin",
            "out": "y",
            "inverse": True,
            "rotary_cols": "N - D",
        },
        _store("y"),
    ],
    lambda acc, t: {
        "y": _rope_formula(
            acc, t["cos"], t["sin"], rotated=acc.shape[1] - t["cos"].shape[1], inverse=True
        )
    },
    {"cos": ["M", "D"], "sin": ["M", "D"]},
    rope=True,
)
EXTRA_CASES["rope_full[V passes]"] = Case(
    [
        {"op": "rope_full", "src": "acc", "cos": "cos", "sin": "sin", "out": "y"}
        | {"rotary_cols": "N - D"},
        _store("y"),
    ],
    lambda acc, t: {
        "y": _rope_formula(acc, t["cos"], t["sin"], rotated=acc.shape[1] - t["cos"].shape[1])
    },
    {"cos": ["M", "D"], "sin": ["M", "D"]},
)
EXTRA_CASES["store_rotate_half[V passes,float32]"] = Case(
    # the last head is stored where it is (a V head of a fused QKV output)
    [
        {"op": "rope", "src": "acc", "cos": "cos", "sin": "sin", "out": "r"}
        | {"rotary_cols": "N - D"},
        {
            "op": "store_rotate_half",
            "src": "r",
            "to": "y",
            "head_dim": "D",
            "rotary_cols": "N - D",
            "dtype": "float32",
        },
    ],
    lambda acc, t: {
        "y": _rope_hf_formula(acc, t["cos"], t["sin"], rotated=acc.shape[1] - t["cos"].shape[1])
    },
    {"cos": ["M", "D"], "sin": ["M", "D"]},
    outputs={"y": "y"},
    rope=True,
)
EXTRA_CASES["pairwise[2to1,row vector]"] = Case(
    [
        {"op": "load_row_vector", "vector": "v", "out": "rv"},
        {"op": "pairwise", "src": "acc", "expr0": "silu(x0) * x1 + rv", "out": "y"},
        _store("y"),
    ],
    lambda acc, t: {"y": F.silu(acc[:, 0::2]) * acc[:, 1::2] + t["v"][:, None]},
    {"v": ["M"]},
)


# Column-space ops after a 2→1 pair contraction: the value is N/2 wide with BLOCK_N/2-wide tiles.
_GLU = {"op": "swiglu", "src": "acc", "out": "s"}


def _glu(acc: torch.Tensor) -> torch.Tensor:
    return F.silu(acc[:, 0::2]) * acc[:, 1::2]


HALF_SPACE_CASES = {
    "scale_cols": Case(
        [_GLU, {"op": "scale_cols", "src": "s", "vector": "v", "out": "y"}, _store("y")],
        lambda acc, t: {"y": _glu(acc) * t["v"][None, :]},
        {"v": ["Nh"]},
    ),
    "add_col_vector": Case(
        [_GLU, {"op": "add_col_vector", "src": "s", "vector": "v", "out": "y"}, _store("y")],
        lambda acc, t: {"y": _glu(acc) + t["v"][None, :]},
        {"v": ["Nh"]},
    ),
    "add_tile": Case(
        [_GLU, {"op": "add_tile", "src": "s", "tensor": "r", "out": "y"}, _store("y")],
        lambda acc, t: {"y": _glu(acc) + t["r"]},
        {"r": ["M", "Nh"]},
    ),
    "partial_reduce": Case(
        [
            _GLU,
            {"op": "partial_reduce", "src": "s", "kind": "sumsq", "axis": "row", "to": "p"},
            _store("s"),
        ],
        lambda acc, t: {"__combined__": (_glu(acc) ** 2).sum(1), "__combine__": lambda p: p.sum(1)},
        outputs={"s": "s"},
    ),
    "load_col_vector": Case(
        [
            _GLU,
            {"op": "load_col_vector", "vector": "v", "out": "cv"},
            {"op": "map", "expr": "s * cv", "out": "y"},
            _store("y"),
        ],
        lambda acc, t: {"y": _glu(acc) * t["v"][None, :]},
        {"v": ["Nh"]},
    ),
    "select_column": Case(
        [_GLU, {"op": "select_column", "src": "s", "index": "t", "to": "picked"}],
        lambda acc, t: {"picked": _select_formula(_glu(acc), t["t"])},
        {"t": {"shape": ["M"], "dtype": "int64"}},
        outputs={"picked": "picked"},
    ),
    "rope": Case(
        # a 2N-wide saved tile rotated next to an N-wide accumulator
        [
            {"op": "load_tile", "tensor": "z", "out": "zt"},
            {"op": "rope", "src": "zt", "cos": "cos", "sin": "sin", "out": "y"},
            _store("y"),
        ],
        lambda acc, t: {"y": _rope_formula(t["z"], t["cos"], t["sin"])},
        {"z": ["M", "N2"], "cos": ["M", "D"], "sin": ["M", "D"]},
        rope=True,
    ),
}


def _head_dim(n: int) -> int:
    """An even head width dividing n (pairs of heads tile the rotated columns exactly)."""
    half = n // 2
    return 2 * max(k for k in range(1, 9) if half % k == 0)


def test_every_registered_primitive_has_a_case() -> None:
    missing = set(EpilogueOp.registry) - set(CASES)
    assert not missing, f"primitives without a test case here: {sorted(missing)}"


def _run_case(
    case: Case,
    sizes: dict[str, int],
    dtype: torch.dtype,
    a_t: bool = False,
    b_t: bool = True,
    config: Any = "auto",
    mainloop: str = "auto",
    device: str = "cpu",
    expect_variants: set[str] | None = None,
) -> None:
    sizes = {**sizes, "N2": 2 * sizes["N"], "Nh": sizes["N"] // 2, "D": _head_dim(sizes["N"])}
    program = gemm_program(
        case.epilogue,
        case.extra,
        a_t=a_t,
        b_t=b_t,
        outputs=case.outputs,
        config=config,
        steps_before=case.steps_before,
    )
    inputs = make_inputs(program, sizes, dtype)
    if case.rope:
        inputs["cos"], inputs["sin"] = rope_tables(sizes["M"], sizes["D"], dtype)
    inputs = {n: t.to(device) for n, t in inputs.items()}
    used: dict[str, str] = {}
    got, ref, exact = run_both(program, inputs, mainloop=mainloop, variants_used=used)
    if expect_variants is not None:
        assert set(used.values()) <= expect_variants, f"kernel variants launched: {used}"
    atol, rtol = DTYPE_TOL[dtype]
    # (1) codegen ≡ reference executor at kernel precision, for every tensor the step writes
    for name in ref:
        if name not in inputs:
            assert_close(
                got[name].float(),
                ref[name].float(),
                atol=atol,
                rtol=rtol,
                what=f"{name} (kernel vs reference executor, {dtype})",
            )
    # (2) the primitive's documented meaning, in float64
    a64, b64 = (inputs["a"].double(), inputs["b"].double())
    acc = (a64.T if a_t else a64) @ (b64.T if b_t else b64)
    t64 = {n: v.double() if v.is_floating_point() else v for n, v in inputs.items()}
    if "first_plus" in got:
        t64["__first__"] = (acc * 0.5).to(dtype).double()
    want = case.expect(acc, t64)
    if "__combined__" in want:
        partials = got["p"].double()
        assert torch.isfinite(partials).all(), "partials were left unwritten (NaN)"
        assert_close(
            want["__combine__"](partials),
            want["__combined__"],
            atol=atol * 10,
            rtol=rtol * 10,
            what="combined partials vs the full reduction",
        )
        assert partials.shape[0] == want["__combined__"].shape[0]
        return
    for name, value in want.items():
        assert_close(
            got[name].double(),
            value,
            atol=atol * 4,
            rtol=rtol * 4,
            what=f"{name} vs its formula ({dtype})",
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "x".join(map(str, s.values())))
@pytest.mark.parametrize("name", sorted(CASES))
def test_primitive(name: str, sizes: dict[str, int], dtype: torch.dtype) -> None:
    _run_case(CASES[name], sizes, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(EXTRA_CASES))
def test_partial_reduce_kinds_and_axes(name: str, dtype: torch.dtype) -> None:
    _run_case(EXTRA_CASES[name], SIZES[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(HALF_SPACE_CASES))
def test_half_width_space(name: str, dtype: torch.dtype) -> None:
    _run_case(HALF_SPACE_CASES[name], SIZES[0], dtype)


ALL_CASES = {**CASES, **EXTRA_CASES, **{f"half_space[{k}]": v for k, v in HALF_SPACE_CASES.items()}}


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_reference_executor_stays_on_the_inputs_device(name: str) -> None:
    """Every tensor a primitive's reference creates lives on its inputs' device: on ``meta``
    inputs a stray CPU ``torch.arange`` raises here, as it does on a GPU (it once did, for
    onehot and rope's pass-through columns, and only the GPU suite noticed)."""
    case = ALL_CASES[name]
    sizes = {"M": 30, "N": 26, "K": 20}
    sizes = {**sizes, "N2": 2 * sizes["N"], "Nh": sizes["N"] // 2, "D": _head_dim(sizes["N"])}
    program = gemm_program(
        case.epilogue, case.extra, outputs=case.outputs, steps_before=case.steps_before
    )
    inputs = make_inputs(program, sizes, torch.float32)
    if case.rope:
        inputs["cos"], inputs["sin"] = rope_tables(sizes["M"], sizes["D"], torch.float32)
    got = execute_reference(program, {n: t.to("meta") for n, t in inputs.items()})
    assert all(t.device.type == "meta" for t in got.values())


@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_transposed_operands(a_t: bool, b_t: bool, dtype: torch.dtype) -> None:
    _run_case(CASES["add_tile"], SIZES[0], dtype, a_t=a_t, b_t=b_t)


@pytest.mark.parametrize(
    "config",
    [
        {"block_m": 16, "block_n": 16, "block_k": 16, "group_m": 1, "num_warps": 1},
        {"block_m": 64, "block_n": 32, "block_k": 16, "group_m": 2, "num_stages": 2},
        {"block_m": 32, "block_n": 64, "block_k": 32, "epilogue_subtiles": 2, "flatten": True},
        {"block_m": 32, "block_n": 64, "block_k": 16, "epilogue_subtiles": 4},
    ],
)
def test_explicit_configs(config: dict[str, int]) -> None:
    _run_case(CASES["swiglu"], SIZES[0], torch.float32, config=config)
    _run_case(HALF_SPACE_CASES["add_tile"], SIZES[0], torch.float16, config=config)
    # reductions across the tile, on the same (possibly flattened) sub-tiled loop
    _run_case(EXTRA_CASES["partial_reduce[sumsq,row]"], SIZES[0], torch.float32, config=config)
    _run_case(EXTRA_CASES["partial_reduce[max,col]"], SIZES[0], torch.float32, config=config)
    _run_case(HALF_SPACE_CASES["partial_reduce"], SIZES[0], torch.float16, config=config)


REDUCING = sorted(n for n in ALL_CASES if "partial_reduce" in n or n == "select_column")


@pytest.mark.parametrize("mainloop", ["tma", "tma_mainloop", "pointer"])
@pytest.mark.parametrize("subtiles", [2, 4, 8])
@pytest.mark.parametrize("name", REDUCING)
def test_reductions_over_epilogue_subtiles(name: str, subtiles: int, mainloop: str) -> None:
    """Epilogues that reduce run on the accumulator's column sub-tiles: partials per sub-tile, a
    target column found in whichever sub-tile holds it, on every kernel variant and ragged edges
    (the last tile's last sub-tiles lie wholly past N: their partial slots are not written)."""
    block_n = 16 * subtiles if subtiles > 4 else 64  # sub-tiles of at least 16 columns
    config = {"block_m": 32, "block_n": block_n, "block_k": 16, "epilogue_subtiles": subtiles}
    sizes = {"M": 37, "N": 148, "K": 32}  # ragged M, N; TMA-describable rows in every space
    _run_case(ALL_CASES[name], sizes, torch.float32, config=config, mainloop=mainloop)


# Both mainloops on shapes whose operands TMA can describe (16-byte aligned rows), including
# transposed layouts and a ragged M and N that the descriptors' zero fill must handle.
TMA_SIZES = {"M": 37, "N": 50, "K": 32}


@pytest.mark.parametrize("mainloop", ["tma", "pointer"])
@pytest.mark.parametrize("a_t,b_t", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_both_mainloops(mainloop: str, a_t: bool, b_t: bool, dtype: torch.dtype) -> None:
    # a stored [K, M] and b stored [K, N] need rows of 16-byte multiples
    sizes = dict(TMA_SIZES, M=40, N=48) if a_t or not b_t else TMA_SIZES
    _run_case(CASES["add_tile"], sizes, dtype, a_t=a_t, b_t=b_t, mainloop=mainloop)
    _run_case(CASES["swiglu"], sizes, dtype, a_t=a_t, b_t=b_t, mainloop=mainloop)


# Ragged M and N whose rows TMA can describe in every column space (N/2, N, 2N; fp32 and fp16).
TMA_RAGGED = {"M": 37, "N": 80, "K": 32}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_tma_epilogue_tiles_on_ragged_edges(name: str, dtype: torch.dtype) -> None:
    """The Hopper kernel moves the epilogue's whole tiles by TMA: zero-filled loads and clipped
    stores at ragged edges, in every column space, agree with the reference."""
    _run_case(ALL_CASES[name], TMA_RAGGED, dtype, expect_variants={"tma"})


@pytest.mark.parametrize("name", ["add_tile", "join_pairs", "half_space[add_tile]"])
def test_epilogue_tiles_tma_cannot_describe_keep_the_tma_mainloop(name: str) -> None:
    # fp32 rows of 50 (or 25) elements are not 16-byte multiples; the operands' are
    sizes = {"M": 37, "N": 50, "K": 32}
    _run_case(ALL_CASES[name], sizes, torch.float32, expect_variants={"tma_mainloop"})


# Sub-tiled epilogues against the unsliced one: one row (M = 1), ragged N and K. N = 150 on
# 128-column tiles leaves the second tile 22 columns: in 8 sub-tiles of 16 its second is ragged and
# the six after it lie wholly past N; K = 29 is no multiple of the K step.
SLICED_SIZES = {"M": 1, "N": 150, "K": 29}
SLICED_TILE = {"block_m": 16, "block_n": 128, "block_k": 16}
_COMBINE = {
    "sum": lambda p: p.sum(dim=1),
    "sumsq": lambda p: p.sum(dim=1),
    "max": lambda p: p.amax(dim=1),
    "lse": lambda p: torch.logsumexp(p, dim=1),
}


def _kernel_tensors(
    case: Case, sizes: dict[str, int], config: dict[str, int], dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], Any]:
    """Every tensor one kernel run of ``case`` writes under ``config`` (fixed inputs;
    allocations poisoned with NaN, so a lane nobody writes shows), and the program's analysis."""
    sizes = {**sizes, "N2": 2 * sizes["N"], "Nh": sizes["N"] // 2, "D": _head_dim(sizes["N"])}
    program = gemm_program(
        case.epilogue,
        case.extra,
        outputs=case.outputs,
        config=config,
        steps_before=case.steps_before,
    )
    inputs = make_inputs(program, sizes, dtype)
    if case.rope:
        inputs["cos"], inputs["sin"] = rope_tables(sizes["M"], sizes["D"], dtype)
    info = analyze(program, bind_sizes(program, {n: t.shape for n, t in inputs.items()}))
    compiled = compile_program(program, info)
    got = compiled.run(compiled.prepare(inputs), poison=True)
    return {n: t for n, t in got.items() if n not in inputs}, info


# fp16 (tiles stored in half precision, pairs of half-space tiles) on a few, fp32 on every one
SLICED_CASES = [(n, torch.float32) for n in sorted(ALL_CASES)] + [
    (n, torch.float16)
    for n in ("swiglu", "half_space[add_tile]", "rope", "store_rotate_half", "partial_reduce")
]


@pytest.mark.parametrize(("name", "dtype"), SLICED_CASES, ids=lambda v: str(v).split(".")[-1])
def test_sliced_epilogue_equals_the_unsliced_one(name: str, dtype: torch.dtype) -> None:
    """Every primitive's epilogue in 2, 4 and 8 column sub-tiles computes what it computes on the
    whole tile: tiles and column partials bit for bit (the same fp32 operations per element),
    row partials — one slot per sub-tile instead of per tile — equal once combined."""
    case = ALL_CASES[name]
    whole, _ = _kernel_tensors(case, SLICED_SIZES, {**SLICED_TILE, "epilogue_subtiles": 1}, dtype)
    for subtiles in (2, 4, 8):
        config = {**SLICED_TILE, "epilogue_subtiles": subtiles}
        sliced, info = _kernel_tensors(case, SLICED_SIZES, config, dtype)
        assert sliced.keys() == whole.keys()
        for tensor, got in sliced.items():
            what = f"{tensor} in {subtiles} sub-tiles vs unsliced"
            assert not got.isnan().any(), f"{what}: lanes left unwritten (NaN)"
            partials = info.tensors[tensor].partials
            if partials is None or partials.axis == "col":
                assert torch.equal(got, whole[tensor]), f"{what}: differs"
                continue
            # one slot per sub-tile (in N, 8 sub-tiles: ⌈150 / 16⌉ = 10 of 16; half as wide in N/2)
            block = SLICED_TILE["block_n"] // subtiles * partials.length // SLICED_SIZES["N"]
            assert got.shape[1] == -(-partials.length // block), f"{what}: {got.shape[1]} slots"
            combine = _COMBINE[partials.kind]
            want = combine(whole[tensor].double())
            assert_close(combine(got.double()), want, atol=1e-5, rtol=1e-5, what=what)
