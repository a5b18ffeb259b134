"""profile_export's kernel table counts the GPU's own work once: device events only, not the CPU
ops, autograd nodes and runtime calls the profiler credits with their children's device time
(its first packed run summed 15.4 ms of "kernels" in a 7.9 ms iteration), nor the GPU-side copies
of the op's ``record_function`` ranges (13.6 ms of "kernels" in a 7.3 ms iteration, torch 2.11)."""

from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from . import load_script

script = load_script("profile_export")


def _event(key: str, device: DeviceType, us: float, count: int = 2) -> SimpleNamespace:
    return SimpleNamespace(key=key, device_type=device, device_time_total=us, count=count)


def test_only_device_events_are_gpu_work() -> None:
    events = [
        _event("GeneratedBackwardFor_coda_llama_mlp_fwd_defaultBackward", DeviceType.CPU, 9544),
        _event("coda::llama_mlp_train_fwd", DeviceType.CPU, 4988),
        _event("cudaStreamIsCapturing", DeviceType.CPU, 1089),
        _event("gate_up_kernel", DeviceType.CUDA, 3352),
        _event("nvjet_sm90_tst_128x256", DeviceType.CUDA, 4052, count=4),
        _event("Memset (Device)", DeviceType.CUDA, 3),
        _event("aten::empty", DeviceType.CPU, 0),
        # the op's range again on the GPU's timeline, spanning its kernels (torch 2.11)
        _event("coda::llama_mlp_train_fwd", DeviceType.CUDA, 4764),
    ]
    rows = script.gpu_work(events, iters=2)
    names = [r["kernel"] for r in rows]
    assert names == ["nvjet_sm90_tst_128x256", "gate_up_kernel", "Memset (Device)"]
    assert rows[0] == {"kernel": "nvjet_sm90_tst_128x256", "calls": 2, "ms": 2.026}
