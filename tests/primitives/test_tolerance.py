"""One error rule: the sandbox's verification and the tuner's check of a config's results both
allow ``ratio · baseline + floor · max(scale, MIN_SCALE)`` (``coda.primitives.tolerance``)."""

from __future__ import annotations

import torch

from coda.blocks.block import Tolerance
from coda.primitives.codegen.tuning import _mismatch
from coda.primitives.tolerance import MIN_SCALE, TUNING_FLOOR, allowed_error, tuning_floor
from coda.sandbox.compare import check_output


def test_the_rule() -> None:
    assert allowed_error(8.0, 0.25) == 2.0
    assert allowed_error(8.0, 0.25, baseline=3.0, ratio=2.0) == 8.0
    assert allowed_error(0.0, 0.5) == 0.5 * MIN_SCALE


def test_the_sandbox_allows_what_the_rule_allows() -> None:
    want = torch.tensor([1.0, -4.0, 2.0], dtype=torch.float64)
    torch_out = (want + torch.tensor([0.0, 1e-3, 0.0], dtype=torch.float64)).float()
    tol = Tolerance(rel={"float32": 1.0})  # the max-error rule alone
    allowed = allowed_error(4.0, tol.floor["float32"], baseline=1e-3, ratio=tol.ratio)
    just_in = (want + torch.tensor([0.0, 0.0, allowed * 0.99], dtype=torch.float64)).float()
    check = check_output("o", just_in, want, torch_out, tol, sizes={}, seed=0)
    assert check.allowed == allowed_error(4.0, 1e-6, baseline=check.torch_max_abs_err, ratio=2.0)
    assert check.max_abs_err <= check.allowed and check.passed, check.summary()
    out = want.float().clone()
    out[2] += 2 * check.allowed
    assert not check_output("o", out, want, torch_out, tol, sizes={}, seed=0).passed


def test_the_tuner_allows_what_the_rule_allows() -> None:
    want = torch.tensor([1.0, -8.0, 2.0], dtype=torch.float16)
    floor = tuning_floor(torch.float16, torch.float32)
    assert floor == TUNING_FLOOR[torch.float16]
    allowed = allowed_error(8.0, floor)  # 0.032
    assert (
        _mismatch(want + torch.tensor([0.0, 0.0, 0.03], dtype=torch.float16), want, torch.float32)
        == ""
    )
    why = _mismatch(
        want + torch.tensor([0.0, 0.0, 0.0625], dtype=torch.float16), want, torch.float32
    )
    assert f"allowed {floor:g} of it" in why and allowed < 0.0625
    assert tuning_floor(torch.float32, torch.bfloat16) == TUNING_FLOOR[torch.bfloat16]
