"""bench/host_work.py: times the patched step's Python with every launch stubbed out, and puts
the real launcher back afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import load_script

script = load_script("host_work")


def test_it_times_both_steps_and_profiles_the_patched_one(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import torch

    argv = ["--layers", "1", "--tokens", "8", "--rounds", "1", "--steps", "2", "--profile", "40"]
    argv.append("--counts")
    threads = torch.get_num_threads()
    assert script.main([*argv, "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # its one intra-op thread is undone
    result = json.loads((tmp_path / "host_work.json").read_text())
    assert result["layers"] == 1 and result["threads"] == 1
    assert set(result["min_ms_per_step"]) == {"hf", "coda", "coda_hf_residual"}
    assert all(ms > 0 for ms in result["min_ms_per_step"].values())
    counts = result["per_step_counts"]
    assert counts["hf"]["op_calls"] == counts["hf"]["triton_launches"] == 0
    # one layer: input norm + attention input, attention output, MLP half — forward and backward
    assert counts["coda"]["op_calls"] == 6 and counts["coda"]["triton_launches"] > 0
    assert counts["coda"]["kernel_ops"] < counts["hf"]["kernel_ops"]
    printed = capsys.readouterr().out
    assert "launches stubbed" in printed and "causal_lm_loss" in printed
    assert "| coda | 6 |" in printed


def test_the_stub_covers_every_importer_and_is_undone() -> None:
    import coda.primitives.aux.rstd as rstd
    import coda.primitives.run_plans as run_plans
    from coda.primitives import launch

    real = launch.launch_kernel
    with script.launches_stubbed():
        assert launch.launch_kernel is not real
        assert rstd.launch_kernel is launch.launch_kernel and run_plans.launch_kernel is not real
        assert launch.launch_kernel(None, (1,), 1, X=2) is None  # launches nothing
    assert launch.launch_kernel is real and rstd.launch_kernel is real
    assert run_plans.launch_kernel is real


def test_denormals_are_flushed_while_it_times_and_kept_after() -> None:
    """The stubbed kernels' outputs hold whatever memory held, denormal floats included, whose
    arithmetic takes the CPU's slow path: the timed steps flush them to zero, and only those."""
    import torch

    tiny = torch.tensor([1e-40])  # a float32 denormal
    with script.denormals_flushed():
        flushed = (tiny * 1).item()
    assert flushed == 0.0 and (tiny * 1).item() != 0.0


def test_step_counts_count_what_would_run_a_kernel_once() -> None:
    import torch

    from coda.primitives import launch

    x, w = torch.randn(4, 8), torch.randn(3, 8)
    real = launch.launch_kernel
    fill = script.step_counts(lambda: torch.zeros(5))  # zeros -> empty + zero_ -> fill_
    assert (fill["kernel_ops"], fill["allocations"]) == (1, 1)
    linear = script.step_counts(lambda: torch.nn.functional.linear(x, w))  # -> t, mm
    assert linear["kernel_ops"] == 1 and linear["views"] >= 1
    view = script.step_counts(lambda: x.view(-1))
    assert (view["kernel_ops"], view["views"]) == (0, 1)
    alloc = script.step_counts(lambda: torch.empty_like(x))  # empty_like -> empty_strided
    assert (alloc["kernel_ops"], alloc["allocations"]) == (0, 1)
    cast = script.step_counts(lambda: x.to(torch.float64))  # _to_copy -> empty_strided, copy_
    assert (cast["kernel_ops"], cast["allocations"]) == (1, 1)
    launched = script.step_counts(lambda: launch.launch_kernel(None, (1,), x))
    assert launched["triton_launches"] == 1 and launched["kernel_ops"] == 0
    assert launch.launch_kernel is real  # the stub it counted with is gone
