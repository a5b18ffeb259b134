"""Aux ``ce_grad_rows`` against PyTorch's autograd of ``cross_entropy`` (softcapped or not), on
odd shapes through the interpreter: the gradient with respect to stored logits and ``Σ z·dz``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coda.primitives import Program, ProgramError, analyze
from coda.primitives.analysis import bind_sizes
from coda.sandbox.compare import assert_close
from tests.helpers import DTYPE_TOL, run_both


def _program(cap: float | None) -> Program:
    return Program.parse(
        {
            "block": "test",
            "inputs": {
                "z": ["M", "V"],
                "lse": {"shape": ["M"], "dtype": "float32"},
                "t": {"shape": ["M"], "dtype": "int64"},
                "dl": {"shape": ["M"], "dtype": "float32"},
            },
            "steps": [
                {
                    "kind": "ce_grad_rows",
                    "logits": "z",
                    "lse": "lse",
                    "index": "t",
                    "scale": "dl",
                    "cap": cap,
                    "divide_by": "V",
                    "out": "dz",
                    "zdz": "c",
                }
            ],
            "outputs": {"dz": "dz", "c": "c"},
        }
    )


def _inputs(m: int, v: int, dtype: torch.dtype, cap: float | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(m * 1000 + v)
    z = (torch.randn(m, v, generator=gen) * 4).to(dtype)
    s = z.double() if cap is None else cap * torch.tanh(z.double() / cap)
    t = torch.randint(0, v, (m,), generator=gen)
    t[::5] = -100  # ignored: no onehot term (its dloss is 0 in a loss, but here it is not)
    return {
        "z": z,
        "lse": torch.logsumexp(s, dim=1).float(),
        "t": t,
        "dl": torch.rand(m, generator=gen),
    }


def _autograd(inputs: dict[str, torch.Tensor], cap: float | None) -> tuple[torch.Tensor, ...]:
    z = inputs["z"].double().requires_grad_(True)
    s = z if cap is None else cap * torch.tanh(z / cap)
    t = inputs["t"]
    loss = F.cross_entropy(s, t.clamp(min=0), reduction="none")
    # an ignored row (id outside [0, V)) keeps the softmax term only: d lse = softmax
    loss = torch.where(t >= 0, loss, torch.logsumexp(s, dim=1))
    (dz,) = torch.autograd.grad((loss * inputs["dl"].double()).sum(), z)
    return dz, (z.detach() * dz).sum(dim=1) / z.shape[1]


@pytest.mark.parametrize("cap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m, v", [(37, 333), (5, 2500), (1, 3)])
def test_ce_grad_rows_is_the_cross_entropy_gradient(
    m: int, v: int, dtype: torch.dtype, cap: float | None
) -> None:
    program = _program(cap)
    inputs = _inputs(m, v, dtype, cap)
    got, ref, _ = run_both(program, inputs)
    want_dz, want_c = _autograd(inputs, cap)
    atol, rtol = DTYPE_TOL[dtype]
    assert got["dz"].dtype == dtype and got["c"].dtype == torch.float32
    assert_close(got["dz"], want_dz, atol=atol, rtol=rtol, what="dz vs autograd")
    assert_close(got["c"], want_c, atol=atol * 4, rtol=rtol * 4, what="Σ z·dz / V vs autograd")
    assert_close(got["dz"], ref["dz"], atol=atol, rtol=rtol, what="dz vs reference executor")


def test_ce_grad_rows_rejects_a_float_index() -> None:
    bad = _program(None).model_dump(mode="json")
    bad["inputs"]["t"]["dtype"] = "float32"
    program = Program.parse(bad)
    sizes = {"z": (4, 9), "lse": (4,), "t": (4,), "dl": (4,)}
    with pytest.raises(ProgramError, match="index 't' must be an int64 tensor of class ids"):
        analyze(program, bind_sizes(program, sizes))
