"""Tune the CuTe backend per step and shape: time each candidate config — and, with the ``auto``
backend, the step's tuned Triton kernel — on the step's own tensors, and pin the fastest.

``choose_config`` is a rule measured at a few shapes; which tile and cluster win moves with the
shape. At the shapes of a Llama 3.2 1B training step at 8192 tokens (bench/RESULTS.md, run
2026-12-02n; time / the cuBLAS GEMM): the RMSNorm backward of the gate/up projection (N = 2048,
K = 16384) ran 1.07× at the rule's 128 × 128 tile with two CTAs along M and 0.99× with two along
N; the SwiGLU backward of the down projection (K = 2048) took 0.68–1.09 ms on the CuTe configs
against the GEMM's 0.37 ms, and its Triton kernel 0.58 ms (tuned, run 2026-12-02o) — since its
sigmoid takes the approximate reciprocal (``epilogue.F``), 0.50 ms at 128 × 128 with clusters
along M against the GEMM's 0.41 (run 2026-12-03h). So tuning times, per step:

- ``CANDIDATES``: 128 × 128 tiles with clusters of two CTAs along M or along N (the overlapped
  epilogue loop, ``CuteConfig.epi_overlap``), and 128 × 192 (the 8192³ winner, QuACK's loop),
  with two consumer warpgroups in ping-pong; and 128 × 256 with two sharing the tile
  (cooperative), the fastest of seven configs for the RMSNorm backward of the Llama gate/up
  projection at 16384 tokens (K = 16384: 1.058× the cuBLAS GEMM against 1.106× at 128 × 128 at
  d = 2048, 1.014× against 1.034× at d = 4096; run 2026-12-04d);
- for a step whose epilogue loads tiles, the two 128 × 128 ones again with four stages of tile
  loads and four of tile stores (``CuteConfig.epi_stages``; QuACK's own split gives the A/B
  pipeline all it can and the tile loads two stages — for the SwiGLU backward the deeper split
  was slower, 0.534 against 0.503 ms, run 2026-12-03h);
- with the ``auto`` backend, the step's Triton kernel at its tuned config.

Under ``auto`` the plain products (steps whose epilogue only stores the accumulator: cuBLAS in
the runtime) are tuned too (``tune_plain_steps``): ``PLAIN_CANDIDATES`` against cuBLAS, the
same way.

Each candidate is timed as its launch alone (what a run plan replays), in interleaved rounds of
100 ms windows (``timing.sustained_ms``): the candidates draw different power and, at the power
limit, sustain different clocks, which shorter windows do not reach. Timed in 30 ms windows, tuning
pinned 128 × 128 tiles for ``gemm_rmsnorm`` at 8192³, which ran 1.047× the cuBLAS GEMM in the
benchmark (run 2026-12-03f); timed in 100 ms windows it pins 128 × 192, at 0.984× (run 2026-12-03j).

Each candidate's launch is also timed on the host (``timing.host_ms``: the median of 30 calls
issued back to back), and candidates rank by the larger of the two times: a launch the host takes
longer to issue than the device takes to run it costs a host-bound step (a training step on a
few thousand tokens, bench/RESULTS.md) its host time, not its kernel's. The backends' launch paths
differ — a Triton launch is a pinned C call, a CuTe launch builds QuACK's views and the epilogue's
arguments and goes through TVM-FFI, a cuBLAS product is one PyTorch op — so where the kernels take
tens of microseconds the cheaper launch can be the faster step; where they take longer, as at
8192 tokens, the device times decide as before.
The winner is checked against the reference executor (``codegen.tuning.wrong_steps``: every tensor
the step writes, partial sums compared once combined across tiles, since the CuTe tile lays them out
its own way); a wrong one is rejected and the next fastest taken. The choice is pinned on
``CompiledProgram.cute_configs`` (None: Triton) and kept in the tuning cache under the step's
kernels (its Triton digest and generated CuTe modules), the backends compared, the device, the sizes
and the dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..timing import SUSTAINED, host_ms, sustained_ms
from .launch import WIDE, CuteConfig

if TYPE_CHECKING:
    from ..codegen.tuning import TuningCache

# QuACK's cooperative 128 × 256 tile: a fused-step candidate (long K loops with light epilogues)
# and a plain-step one
COOPERATIVE = CuteConfig(128, 256, 2, 1, pingpong=False)
CANDIDATES = (
    CuteConfig(128, 128, 2, 1),
    CuteConfig(128, 128, 1, 2),
    WIDE,  # 128 × 192, QuACK's epilogue loop
    COOPERATIVE,
)
DEEP_EPILOGUE = 4  # the epilogue pipelines' depth of the extra candidates of a step loading tiles


def candidates(loads_tiles: bool) -> tuple[CuteConfig, ...]:
    """The configs timed for a step: ``CANDIDATES``, and for a step whose epilogue loads tiles
    the 128 × 128 ones again with ``DEEP_EPILOGUE`` stages of tile loads and stores."""
    if not loads_tiles:
        return CANDIDATES
    deep = [c._replace(epi_stages=DEEP_EPILOGUE) for c in CANDIDATES if c.tile == (128, 128)]
    return (*CANDIDATES, *deep)


# Plain-store steps (cuBLAS in the product) under ``auto``: QuACK's cooperative tiles. For the
# weight gradients of the Llama MLP at 16384 tokens (bench/RESULTS.md, run 2026-12-03s), 128 × 256
# was the fastest of six configs in three of four — 0.952× cuBLAS for the down projection's at
# d = 4096, 0.986× for the gate/up one's at d = 2048, 1.006× for the down projection's at
# d = 2048 — and 256 × 128 the next; for the gate/up one's at d = 4096 every config was slower
# than cuBLAS (1.02× at best). On a second machine the 0.952× was 1.007× (run 2026-12-03t). So
# each is timed against cuBLAS per machine, step and shape.
PLAIN_CANDIDATES = (
    COOPERATIVE,
    CuteConfig(256, 128, 2, 1, pingpong=False),
)

TRITON = "triton"  # the label of the step's Triton kernel among the timed candidates
CUBLAS = "cublas"  # the label of a plain step's cuBLAS product among the timed candidates
# how the cached choices were timed: the device windows, and the launches' host time beside them
WINDOWS = f"{SUSTAINED['rep']}ms+host"

Timer = Callable[[dict[str, Callable[[], object]]], dict[str, float]]


@dataclass
class CuteTuning:
    """What tuning chose for one step on the CuTe backend: ``best`` None means Triton."""

    step: str
    key: str
    best: CuteConfig | None
    ms: float | None  # the choice's device time
    cached: bool
    times: dict[str, float] = field(default_factory=dict)  # every candidate timed, by label
    host_times: dict[str, float] = field(default_factory=dict)  # ms to issue each launch
    errors: dict[str, str] = field(default_factory=dict)  # candidates that could not launch
    rejected: list[tuple[CuteConfig, str]] = field(default_factory=list)  # fast but wrong
    fallback: str = TRITON  # what runs the step where ``best`` is None: Triton, or cuBLAS

    def as_dict(self) -> dict:
        """JSON-ready: the choice, whether it came from the cache, every time and rejection."""
        return {
            "backend": self.fallback if self.best is None else "cute",
            "best": None if self.best is None else str(self.best),
            "ms": self.ms,
            "cached": self.cached,
            "times": self.times,
            "host_times": self.host_times,
            "errors": self.errors,
            "rejected": [{"config": str(c), "why": why} for c, why in self.rejected],
        }


def cute_key(
    digest: str, modules: str, against: str | None, device: str, gemm: Any, dtype: torch.dtype
) -> str:
    """The tuning-cache key of a step's CuTe choice: its other kernel's digest (its Triton
    kernel's; ``CUBLAS`` for a plain step) and its generated CuTe modules' keys (either kernel
    changed: tuned anew), which other kernel was a candidate (``TRITON``, ``CUBLAS`` or None),
    the device, sizes and dtype, and the timing windows (``WINDOWS``: choices timed in other
    windows are timed anew)."""
    from ..codegen.tuning import tuning_key

    kind = ("cute" if against is None else f"cute+{against}") + f"@{WINDOWS}"
    return f"{kind}|" + tuning_key(f"{digest}+{modules}", device, gemm.M, gemm.N, gemm.K, dtype)


def _from_entry(entry: dict) -> CuteConfig | None:
    config = entry["config"]
    return None if config is None else CuteConfig(*config)


def tune_cute_steps(
    compiled: Any,
    prepared: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    steps: list[str],
    cache: TuningCache,
    *,
    with_triton: bool,
    timer: Timer | None = None,
    host_timer: Timer | None = None,
    check: bool = True,
) -> dict[str, CuteTuning]:
    """Choose and pin the config — or Triton, ``with_triton`` — of each step in ``steps`` (steps
    the CuTe backend ran) at the sizes of ``tensors`` (a full run's). ``timer`` times launches on
    the device by label (default: ``timing.sustained_ms``), ``host_timer`` on the host (default:
    ``timing.host_ms``)."""
    against = TRITON if with_triton else None

    def plan(name: str, gemm: Any, dtype: torch.dtype, device: str) -> _Plan:
        sources = compiled._cute_steps[name].sources()
        modules = "+".join(sorted(src.key for src in sources))
        key = cute_key(compiled.kernels[name].digest, modules, against, device, gemm, dtype)
        loads_tiles = any(b.kind == "tile" for src in sources for b in src.bindings)
        choices: dict[str, CuteConfig | None] = {str(c): c for c in candidates(loads_tiles)}
        if with_triton:
            choices[TRITON] = None
        return _Plan(key, choices, TRITON)

    timers = _timers(timer, host_timer)
    return _tune_steps(compiled, prepared, tensors, steps, cache, plan, timers, check)


def tune_plain_steps(
    compiled: Any,
    prepared: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    steps: list[str],
    cache: TuningCache,
    *,
    timer: Timer | None = None,
    host_timer: Timer | None = None,
    check: bool = True,
) -> dict[str, CuteTuning]:
    """Under ``auto``: choose, for each plain-store step in ``steps`` (a product the runtime
    hands to cuBLAS), between cuBLAS and QuACK's GEMM at ``PLAIN_CANDIDATES``, timed on the
    step's tensors (a full run's) like a fused step's candidates, and pin the choice on
    ``compiled.cute_configs`` (None: cuBLAS). A step whose product the backend does not cover
    (an operand that is not 16-bit, a layout TMA cannot move) is left to cuBLAS untimed."""
    from ..reference import activation_dtype
    from .emit import CuteUnsupported
    from .launch import CuteStep

    act = activation_dtype(compiled.program, tensors)
    floats = {n: t.dtype for n, t in tensors.items() if t.is_floating_point()}

    def plan(name: str, gemm: Any, dtype: torch.dtype, device: str) -> _Plan | None:
        if dtype not in (torch.bfloat16, torch.float16):
            return None
        runner = compiled._cute_steps.setdefault(name, CuteStep(compiled._step(name)))
        try:
            module = runner.plan(gemm, floats, act)[0].key
        except CuteUnsupported:
            return None
        choices: dict[str, CuteConfig | None] = {str(c): c for c in PLAIN_CANDIDATES}
        choices[CUBLAS] = None
        return _Plan(cute_key(CUBLAS, module, CUBLAS, device, gemm, dtype), choices, CUBLAS)

    timers = _timers(timer, host_timer)
    return _tune_steps(compiled, prepared, tensors, steps, cache, plan, timers, check)


class _Timers(NamedTuple):
    """How candidates are timed: on the device and on the host, each by label."""

    device: Timer
    host: Timer


def _timers(timer: Timer | None, host_timer: Timer | None) -> _Timers:
    return _Timers(timer or sustained_ms, host_timer or host_ms)


class _Plan(NamedTuple):
    """How one step is tuned: its cache key, the labelled choices (None: the step's other
    kernel) and the name of that other kernel."""

    key: str
    choices: dict[str, CuteConfig | None]
    fallback: str


def _tune_steps(
    compiled: Any,
    prepared: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    steps: list[str],
    cache: TuningCache,
    plan: Callable[..., _Plan | None],
    timers: _Timers,
    check: bool,
) -> dict[str, CuteTuning]:
    """Each step of ``steps`` that ``plan`` gives a plan: its cached choice, or its choices timed
    and the winner pinned and cached."""
    info = compiled.info_for({n: prepared[n] for n in compiled.program.inputs})
    device = next(iter(prepared.values())).device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    results: dict[str, CuteTuning] = {}
    for name in steps:
        gemm = info.gemms[name]
        dtype = tensors[compiled._step(name).a.tensor].dtype
        step_plan = plan(name, gemm, dtype, device_name)
        if step_plan is None:
            continue
        key, choices, fallback = step_plan
        entry = cache.entry(key)
        if entry is not None:
            compiled.cute_configs[name] = best = _from_entry(entry)
            results[name] = CuteTuning(
                name, key, best, entry.get("ms"), cached=True, fallback=fallback
            )
            continue
        result = _tune_step(
            compiled, prepared, tensors, name, key, choices, fallback, timers, check
        )
        _keep(cache, key, result)
        results[name] = result
    return results


def _keep(cache: TuningCache, key: str, result: CuteTuning) -> None:
    config = None if result.best is None else list(result.best)
    label = result.fallback if result.best is None else str(result.best)
    cache.put_entry(key, {"config": config, "ms": result.ms,
                          "host_ms": result.host_times.get(label)})  # fmt: skip


def _tune_step(
    compiled: Any,
    prepared: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    name: str,
    key: str,
    choices: dict[str, CuteConfig | None],
    fallback: str,
    timers: _Timers,
    check: bool,
) -> CuteTuning:
    """Time ``choices`` (a CuTe config, or None: the step's other kernel ``fallback`` — Triton,
    or cuBLAS for a plain step) on the step's tensors, on the device and on the host, and pin
    the one of least cost — the larger of its two times — that computes the reference's result;
    None where no CuTe config does."""
    launches: dict[str, Callable[[], None]] = {}
    errors: dict[str, str] = {}
    for label, choice in choices.items():
        compiled.cute_configs[name] = choice
        launch = compiled.step_launch(name, tensors)
        if choice is not None and compiled.mainloops_used.get(name) != "cute":
            # the backend refused this config (the runtime ran Triton and kept why)
            errors[label] = compiled.cute_refusals.get(name, "ran on Triton")
            continue
        launches[label] = launch
    times = timers.device(launches) if launches else {}
    host = timers.host(launches) if launches else {}
    cost = {label: max(ms, host.get(label, 0.0)) for label, ms in times.items()}
    rejected: list[tuple[CuteConfig, str]] = []
    for label in sorted(cost, key=cost.__getitem__):
        choice = choices[label]
        compiled.cute_configs[name] = choice
        why = _wrong(compiled, prepared, name) if check and choice is not None else ""
        if not why:
            return CuteTuning(
                name, key, choice, times[label], False, times, host, errors, rejected, fallback
            )
        rejected.append((choice, why))
    compiled.cute_configs[name] = None  # no CuTe config computed it right: the other kernel
    ms = times.get(fallback)
    return CuteTuning(name, key, None, ms, False, times, host, errors, rejected, fallback)


def _wrong(compiled: Any, prepared: dict[str, torch.Tensor], name: str) -> str:
    from ..codegen.tuning import wrong_steps

    return wrong_steps(compiled, prepared).get(name, "")
