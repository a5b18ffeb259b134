"""``primitives/offline_target.py``: Hopper's shared-memory budget per program, and the stand-in
driver that lets ``JITFunction.warmup`` compile for sm_90 without a GPU (the compiles themselves
run in ``tests/export/test_shipped_kernels_for_hopper.py``, in a process of their own)."""

from __future__ import annotations

import pytest
import triton

from coda.primitives.offline_target import fits, for_target


def test_fits_counts_the_per_program_reserve() -> None:
    assert fits(227 * 1024, per_sm=1)
    assert not fits(227 * 1024 + 1, per_sm=1)
    assert fits(113 * 1024, per_sm=2)  # (228 KB / 2) − 1 KB
    assert not fits(113 * 1024 + 1, per_sm=2)


def test_the_stand_in_driver_reports_the_target_and_goes_back_after() -> None:
    config = triton.runtime.driver
    before = config._active
    with for_target(90):
        active = config.active
        target = active.get_current_target()
        assert (target.backend, target.arch, target.warp_size) == ("cuda", 90, 32)
        assert active.get_current_device() == 0 and active.get_current_stream(0) == 0
    assert config._active is before
    with pytest.raises(RuntimeError), for_target(90):  # also when the block raises
        raise RuntimeError("a compile failed")
    assert config._active is before
