"""The error rule every comparison of a kernel's tensor against a reference applies.

``allowed_error`` is the one formula: an error is allowed up to ``ratio · baseline`` (how far a
trusted implementation in the same precision is from the reference, times a ratio) plus
``floor · scale`` (a fraction of the reference's largest magnitude). The sandbox's verification
(``coda.sandbox.compare.check_output``, with a block's ``Tolerance``: ratio 2, PyTorch's own error
as the baseline, per-dtype floors) and the tuner's check of each config's results
(``codegen.tuning``, floors ``TUNING_FLOOR``, no baseline) both use it.
"""

from __future__ import annotations

import torch

# The smallest scale the floor term uses: an all-zero reference still allows a denormal error.
MIN_SCALE = 1e-30

# How far a tuned kernel's tensor may be from the reference executor's at kernel precision, as a
# fraction of the tensor's largest magnitude, by the looser of the tensor's dtype and the run's
# activation dtype: an fp32 tensor of a bf16 run (row partials) inherits the 16-bit roundings of
# the tensors it is computed from (measured on the H200: 1.6e-4 of the largest dgamma partial,
# every config alike). Rounding and summation order stay far below this; a miscompiled config is
# off by the order of the values themselves.
TUNING_FLOOR = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def allowed_error(
    scale: float, floor: float, *, baseline: float = 0.0, ratio: float = 0.0
) -> float:
    """The largest absolute error allowed: ``ratio · baseline + floor · max(scale, MIN_SCALE)``."""
    return ratio * baseline + floor * max(scale, MIN_SCALE)


def tuning_floor(dtype: torch.dtype, activation: torch.dtype) -> float:
    """The tuner's floor for a tensor of ``dtype`` in a run of ``activation`` dtype: the looser of
    the two (unknown dtypes count as float32)."""
    fp32 = TUNING_FLOOR[torch.float32]
    return max(TUNING_FLOOR.get(dtype, fp32), TUNING_FLOOR.get(activation, fp32))
