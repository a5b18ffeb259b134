"""Comparison helpers: the verification rule, and mismatch reports a person or an LLM can act on.

Tests use the same helpers (``assert_close``), so a failing test and the agent's feedback read
alike: how many elements are off, the first few with their indices, NaN and Inf counted separately.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

from coda.blocks.block import Tolerance
from coda.primitives.tolerance import allowed_error


class Mismatch(BaseModel):
    model_config = ConfigDict(frozen=True)
    index: list[int]
    got: float
    want: float


class OutputCheck(BaseModel):
    """One output of one run (shape set × dtype × seed) against the float64 reference."""

    model_config = ConfigDict(frozen=True)
    output: str
    dtype: str
    sizes: dict[str, int]
    seed: int
    passed: bool
    mainloop: str = ""  # the kernel variant(s) that ran: "tma", "tma_mainloop", "pointer,tma", ...
    reason: str = ""
    max_abs_err: float | None = None
    torch_max_abs_err: float | None = None  # the block's PyTorch reference in the same dtype
    allowed: float | None = None
    rel_err: float | None = None
    rel_bound: float | None = None
    mismatches: int = 0
    numel: int = 0
    nan: int = 0
    inf: int = 0
    first_bad: list[Mismatch] = []

    def summary(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        variants = self.mainloop.split(",")
        loop = f", mainloop {' and '.join(variants)}" if self.mainloop else ""
        head = f"{self.output} [{self.dtype}, {where}, seed {self.seed}{loop}]"
        if self.max_abs_err is None:
            return f"{head}: {self.reason}"
        nums = (
            f"max|err| {self.max_abs_err:.3g} (allowed {self.allowed:.3g} = "
            f"2×PyTorch's {self.torch_max_abs_err:.3g} + floor), rel {self.rel_err:.3g} "
            f"(bound {self.rel_bound:.3g})"
        )
        return f"{head}: {'ok' if self.passed else 'FAIL — ' + self.reason}; {nums}"


def _first_bad(
    got: torch.Tensor, want: torch.Tensor, bad: torch.Tensor, k: int = 5
) -> list[Mismatch]:
    idx = bad.nonzero()[:k]
    return [
        Mismatch(
            index=[int(i) for i in row], got=float(got[tuple(row)]), want=float(want[tuple(row)])
        )
        for row in idx
    ]


def check_output(
    name: str,
    out: torch.Tensor,
    ref64: torch.Tensor,
    torch_out: torch.Tensor,
    tol: Tolerance,
    *,
    sizes: dict[str, int],
    seed: int,
    run_dtype: torch.dtype | None = None,
) -> OutputCheck:
    """Apply the verification rule (``Tolerance``) to one output.

    The dtype bounds (floor, relative error) are those of the run's activation dtype
    ``run_dtype`` (default: the output's own dtype): an fp32 output computed from fp16 inputs —
    a loss, a row statistic — carries fp16 input rounding, which PyTorch's own reference cannot
    beat either, so it is held to the fp16 bounds, not fp32's.
    """
    dtype = str(run_dtype or torch_out.dtype).removeprefix("torch.")
    base = {"output": name, "dtype": dtype, "sizes": sizes, "seed": seed, "numel": ref64.numel()}
    if tuple(out.shape) != tuple(ref64.shape):
        return OutputCheck(
            **base,
            passed=False,
            reason=f"shape {list(out.shape)} but the reference is {list(ref64.shape)}",
        )
    if out.dtype != torch_out.dtype:
        return OutputCheck(
            **base,
            passed=False,
            reason=f"dtype {out.dtype} but the block returns {torch_out.dtype} "
            "(store with dtype='auto')",
        )
    got, want = out.detach().cpu().double(), ref64.detach().cpu().double()
    err = (got - want).abs()
    torch_err = float((torch_out.detach().cpu().double() - want).abs().max())
    scale = float(want.abs().max())
    allowed = allowed_error(scale, tol.floor.get(dtype, 0.0), baseline=torch_err, ratio=tol.ratio)
    finite = torch.isfinite(got)
    nan, inf = int(torch.isnan(got).sum()), int(torch.isinf(got).sum())
    bad = (err > allowed) | ~finite
    max_err = float(err[finite].max()) if finite.any() else float("inf")
    rel = float(
        torch.linalg.vector_norm(torch.where(finite, got - want, 0))
        / max(float(torch.linalg.vector_norm(want)), 1e-300)
    )
    rel_bound = tol.rel.get(dtype, 1.0)
    metrics = dict(
        max_abs_err=max_err,
        torch_max_abs_err=torch_err,
        allowed=allowed,
        rel_err=rel,
        rel_bound=rel_bound,
        mismatches=int(bad.sum()),
        nan=nan,
        inf=inf,
        first_bad=_first_bad(got, want, bad),
    )
    reason = _reason(got, want, nan, inf, max_err, allowed, rel, rel_bound, int(bad.sum()))
    return OutputCheck(**base, passed=not reason, reason=reason, **metrics)


def _reason(
    got: torch.Tensor,
    want: torch.Tensor,
    nan: int,
    inf: int,
    max_err: float,
    allowed: float,
    rel: float,
    rel_bound: float,
    nbad: int,
) -> str:
    if nan or inf:
        return (
            f"{nan} NaN and {inf} Inf values (outputs are pre-filled with NaN: NaN usually means "
            "elements were never written, e.g. a missing tile at a ragged edge)"
        )
    if want.numel() > 1 and float(want.std()) > 0 and float(got.std()) == 0:
        value = float(got.flatten()[0]) + 0.0  # + 0.0: print -0.0 as 0
        return f"the output is constant ({value:.4g}) but the reference varies"
    if max_err > allowed:
        return f"{nbad} of {want.numel()} elements exceed the allowed error"
    if rel > rel_bound:
        return f"relative error {rel:.3g} exceeds the bound {rel_bound:.3g}"
    return ""


def _finite_max(err: torch.Tensor) -> str:
    finite = err[torch.isfinite(err)]
    return f"{float(finite.max()):.4g}" if finite.numel() else "inf"


def assert_close(
    got: torch.Tensor, want: torch.Tensor, *, atol: float, rtol: float, what: str = "tensor"
) -> None:
    """Test helper: ``|got − want| ≤ atol + rtol·|want|`` elementwise, with a verbose report."""
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)} != {list(want.shape)}"
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    err = (g - w).abs()
    bad = (err > atol + rtol * w.abs()) | ~torch.isfinite(g)
    if bool(bad.any()):
        first = "; ".join(
            f"{m.index}: got {m.got:.6g}, want {m.want:.6g}" for m in _first_bad(g, w, bad)
        )
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {w.numel()} elements off (atol {atol}, rtol {rtol}); "
            f"NaN {int(torch.isnan(g).sum())}, Inf {int(torch.isinf(g).sum())}; "
            f"max|err| {_finite_max(err)}; "
            f"first: {first}"
        )
