"""The pieces of RoPE in Hugging Face's order with q/k norms, against independent formulas:
``head_rmsnorm`` at head widths that need wider epilogue sub-tiles than the default, aux
``rescale_rows``, prep ``rope_pairs`` of vectors, and the errors that name what to change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coda.primitives import Program, ProgramError, analyze, bind_sizes, compile_program
from coda.sandbox.compare import assert_close
from tests.helpers import DTYPE_TOL, make_inputs, run_both
from tests.primitives.test_ops import _head_rms_formula

DTYPES = [torch.float32, torch.float16]


def _head_norm_program(offset: float, config: Any = "auto") -> Program:
    norm = {"op": "head_rmsnorm", "src": "acc", "weight": "g", "head_dim": "D", "eps": 1e-6}
    return Program.parse(
        {
            "block": "test",
            "inputs": {"a": ["M", "K"], "b": ["N", "K"], "g": ["D"], "q": ["N", "D"]},
            "steps": [
                {
                    "kind": "gemm",
                    "a": "a",
                    "b": "b.T",
                    "epilogue": [
                        {**norm, "offset": offset, "out": "y"},
                        {"op": "store", "src": "y", "to": "y"},
                    ],
                    "config": config,
                }
            ],
            "outputs": {"y": "y"},
        }
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "sizes,offset",
    [
        ({"M": 37, "N": 48, "K": 29, "D": 16}, 0.0),  # three heads, the last tile ragged
        ({"M": 1, "N": 128, "K": 20, "D": 64}, 1.0),  # heads wider than the default sub-tile
    ],
)
def test_head_rmsnorm_normalises_each_head(
    sizes: dict[str, int], offset: float, dtype: torch.dtype
) -> None:
    check_head_rmsnorm(sizes, offset, dtype)


def check_head_rmsnorm(
    sizes: dict[str, int], offset: float, dtype: torch.dtype, device: str = "cpu"
) -> None:
    """``head_rmsnorm`` of a GEMM's output against the per-head formula and the reference."""
    program = _head_norm_program(offset)
    inputs = make_inputs(program, sizes, dtype, device=device)
    got, ref, _ = run_both(program, inputs)
    acc = inputs["a"].double() @ inputs["b"].double().T
    want = _head_rms_formula(acc, inputs["g"].double(), 1e-6, offset)
    atol, rtol = DTYPE_TOL[dtype]
    assert_close(got["y"].double(), want, atol=atol * 4, rtol=rtol * 4, what="y vs its formula")
    assert_close(got["y"].float(), ref["y"].float(), atol=atol, rtol=rtol, what="y vs reference")


def test_auto_config_widens_sub_tiles_to_whole_heads() -> None:
    program = _head_norm_program(0.0)
    sizes = {"M": 4, "N": 128, "K": 16, "D": 64}
    info = analyze(program, sizes)
    compiled = compile_program(program, info)
    (gemm,) = info.gemms.values()
    assert gemm.column_multiple == 64
    assert compiled.config_for(gemm.name, gemm).epilogue_block_n % 64 == 0


def test_explicit_config_too_narrow_for_a_head_is_refused() -> None:
    config = {"block_m": 16, "block_n": 32, "block_k": 16, "group_m": 1, "num_warps": 1}
    program = _head_norm_program(0.0, config)
    with pytest.raises(ProgramError, match="multiple of 64 columns.*block_n=32"):
        analyze(program, {"M": 4, "N": 128, "K": 16, "D": 64})


def test_head_width_that_is_no_power_of_two_is_refused() -> None:
    with pytest.raises(ProgramError, match="head_dim = 24 must be a power of two"):
        analyze(_head_norm_program(0.0), {"M": 4, "N": 48, "K": 16, "D": 24})


def _rescale_program() -> Program:
    return Program.parse(
        {
            "block": "test",
            "inputs": {"x": ["M", "N"], "a": ["M", "K"]},
            "steps": [
                {"kind": "rstd", "src": "a", "eps": 1e-5, "out": "r"},
                {"kind": "rescale_rows", "src": "x", "vector": "r", "out": "y"},
            ],
            "outputs": {"y": "y"},
        }
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("sizes", [{"M": 37, "N": 300, "K": 7}, {"M": 1, "N": 6, "K": 3}])
def test_rescale_rows_scales_each_row(sizes: dict[str, int], dtype: torch.dtype) -> None:
    check_rescale_rows(sizes, dtype)


def check_rescale_rows(sizes: dict[str, int], dtype: torch.dtype, device: str = "cpu") -> None:
    """``rescale_rows`` by an ``rstd`` against ``x · rsqrt(mean a² + eps)``."""
    program = _rescale_program()
    inputs = make_inputs(program, sizes, dtype, device=device)
    got, _, _ = run_both(program, inputs)
    a = inputs["a"].double()
    want = inputs["x"].double() * torch.rsqrt((a * a).mean(1, keepdim=True) + 1e-5)
    atol, rtol = DTYPE_TOL[dtype]
    assert got["y"].dtype == dtype
    assert_close(got["y"].double(), want, atol=atol * 4, rtol=rtol * 4, what="y vs x · r")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_rescale_rows_without_a_vector_copies(dtype: torch.dtype) -> None:
    """No vector: ``out = src``, a new tensor (a block output equal to a block input)."""
    program = Program.parse(
        {
            "block": "test",
            "inputs": {"x": ["M", "N"]},
            "steps": [{"kind": "rescale_rows", "src": "x", "out": "y"}],
            "outputs": {"y": "y"},
        }
    )
    inputs = make_inputs(program, {"M": 37, "N": 300}, dtype)
    got, _, _ = run_both(program, inputs)
    assert got["y"].dtype == dtype and torch.equal(got["y"], inputs["x"])
    assert got["y"].data_ptr() != inputs["x"].data_ptr()


def test_rescale_rows_needs_one_value_per_row() -> None:
    program = Program.parse(
        {
            "block": "test",
            "inputs": {"x": ["M", "N"], "v": {"shape": ["N"], "dtype": "float32"}},
            "steps": [{"kind": "rescale_rows", "src": "x", "vector": "v", "out": "y"}],
            "outputs": {"y": "y"},
        }
    )
    with pytest.raises(ProgramError, match="vector 'v' must be a vector of length 5"):
        analyze(program, bind_sizes(program, {"x": (5, 8), "v": (8,)}))


def test_rope_pairs_permutes_a_bias_like_the_weight_rows() -> None:
    program = Program.parse(
        {
            "block": "test",
            "inputs": {"w": ["N", "K"], "bias": ["N"], "cos": ["M", "D"]},
            "prep": [
                {"kind": "rope_pairs", "weight": "w", "head_dim": "D", "out": "w_p"},
                {"kind": "rope_pairs", "weight": "bias", "head_dim": "D", "out": "bias_p"},
            ],
            "steps": [{"kind": "rstd", "src": "cos", "out": "r"}],  # (a Program has a step)
            "outputs": {"w_p": "w_p", "bias_p": "bias_p", "r": "r"},
        }
    )
    sizes = {"M": 2, "N": 12, "K": 3, "D": 6}
    inputs = make_inputs(program, sizes, torch.float32)
    inputs["w"] = inputs["bias"][:, None] * torch.tensor([1.0, 2.0, 3.0])
    got, ref, _ = run_both(program, inputs)
    assert torch.equal(ref["bias_p"], got["bias_p"])
    assert torch.equal(got["w_p"][:, 0], got["bias_p"])
    order = [0, 3, 1, 4, 2, 5]
    assert torch.equal(got["bias_p"][:6], inputs["bias"][order])


def test_tuning_times_only_configs_whose_sub_tiles_hold_whole_heads() -> None:
    from coda.primitives.codegen.tuning import candidate_configs

    configs = candidate_configs(4096, 4096, 4096, itemsize=2, interpret=False, column_multiple=256)
    assert configs and all(c.epilogue_block_n % 256 == 0 for c in configs)
    narrow = [(128, 128, 64, 8, 3, 2)]  # 64-wide sub-tiles only: the default, widened, instead
    (only,) = candidate_configs(
        4096, 4096, 4096, itemsize=2, interpret=False, space=narrow, column_multiple=256
    )
    assert only.block_n == 256 and only.epilogue_subtiles == 1
