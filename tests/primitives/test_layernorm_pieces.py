"""LayerNorm's Program pieces: the ``mean_rstd`` aux step, against PyTorch's own ``var_mean``."""

from __future__ import annotations

import pytest
import torch

from coda.primitives import Program, ProgramError, analyze
from tests.helpers import run_both

DTYPES = [torch.float32, torch.float16]


def _mean_rstd_program() -> Program:
    return Program.parse(
        {
            "block": "test",
            "inputs": {"x": ["M", "d"]},
            "steps": [{"kind": "mean_rstd", "src": "x", "eps": 1e-5, "mean": "mu", "out": "r"}],
            "outputs": {"mu": "mu", "r": "r"},
        }
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_mean_rstd_matches_var_mean_on_ragged_shapes(dtype: torch.dtype) -> None:
    """Rows of one to several column tiles, an offset mean (variance by the two-pass formula)."""
    gen = torch.Generator().manual_seed(0)
    program = _mean_rstd_program()
    for rows, cols in [(37, 53), (1, 7), (5, 1500)]:
        x = (torch.randn(rows, cols, generator=gen) * 2 + 3).to(dtype)
        var, mean = torch.var_mean(x.double(), dim=1, unbiased=False)
        want_r = (var + 1e-5).rsqrt()
        got, ref, exact = run_both(program, {"x": x})
        for outs in (got, ref):
            assert outs["mu"].dtype == torch.float32
            torch.testing.assert_close(outs["mu"].double(), mean, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(outs["r"].double(), want_r, rtol=1e-5, atol=0)
        torch.testing.assert_close(exact["mu"].double(), mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(exact["r"].double(), want_r, rtol=1e-12, atol=0)


def test_mean_rstd_names_its_outputs_apart() -> None:
    data = _mean_rstd_program().model_dump(mode="json")
    data["steps"][0]["mean"] = "r"
    with pytest.raises(ProgramError, match="same name 'r'"):
        analyze(Program.parse(data), {"M": 4, "d": 8})


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_matvec_is_the_row_sums_and_the_product_with_a_vector(dtype: torch.dtype) -> None:
    """``matvec`` against a float64 loop over the columns, fp32 results, on ragged shapes; the
    exact reference executor in float64."""
    from coda.primitives.base import RunEnv
    from coda.primitives.prep.matvec import MatVec

    gen = torch.Generator().manual_seed(3)
    for rows, cols in [(37, 53), (1, 7), (6, 1)]:
        w = torch.randn(rows, cols, generator=gen).to(dtype)
        beta = torch.randn(cols, generator=gen).to(dtype)
        sums = sum(w[:, j].double() for j in range(cols))
        dots = sum(w[:, j].double() * beta[j].double() for j in range(cols))
        for step, want in [
            (MatVec(weight="w", out="s"), sums),
            (MatVec(weight="w", vector="beta", out="s"), dots),
        ]:
            env = RunEnv({"w": w, "beta": beta}, {})
            step.apply(env)
            assert env.tensors["s"].dtype == torch.float32
            torch.testing.assert_close(env.tensors["s"].double(), want, rtol=1e-5, atol=1e-5)
            exact = RunEnv({"w": w.double(), "beta": beta.double()}, {}, compute=torch.float64)
            step.apply(exact)
            torch.testing.assert_close(exact.tensors["s"], want, rtol=1e-12, atol=1e-12)


def test_layer_norm_reference_is_the_textbook_formula() -> None:
    """``fn.layer_norm`` (the block reference) against ``(x − μ)/sqrt(var + eps)·γ + β``."""
    from coda.blocks import functional as fn

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 40, generator=gen, dtype=torch.float64) * 3 + 1
    gamma, beta = torch.randn(2, 40, generator=gen, dtype=torch.float64)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    xhat = (x - mean) / torch.sqrt(var + 1e-5)
    torch.testing.assert_close(fn.layer_norm(x, gamma, beta, 1e-5), xhat * gamma + beta)
    torch.testing.assert_close(fn.layer_norm(x, gamma, None, 1e-5), xhat * gamma)
