"""Autotuning of mainloop configurations, per fused gemm step and shape.

Candidates come from ``candidate_configs`` (keyed by shape and dtype; invalid ones — too much shared
memory, sub-tiles narrower than 16 columns, tiles far larger than the problem — pruned before any
timing). Each surviving candidate is timed on the real tensors with ``triton.testing.do_bench``
(median, L2 flushed); one that fails to compile is recorded with its error and skipped. The
winner is pinned on the ``CompiledProgram``, cached in memory and in ``$CODA_CACHE_DIR/tuning.json``
under a key of (kernel source digest, device, M, N, K, dtype), and returned so reports show it.

Tuning is done once per kernel and shape, not once per candidate Program: the cache is shared by
the sandbox's workers (``SandboxOptions.shared_caches``), so a kernel an earlier candidate tuned is
not timed again, and a kernel that is new but computes the same step of the same block at the same
sizes and dtype (another decomposition's epilogue around that GEMM) screens only the finalists the
earlier tuning kept (``related_key``), not the whole space.

A winner is used only if its results are right: the tuned program's tensors are compared with the
reference executor's (PyTorch, kernel precision, the same tiles), and a step whose tensors differ
falls back to its next fastest candidate (the default config last). Triton has miscompiled whole
configs — reductions of ``tl.split`` sub-tiles on an H200 — and a fast wrong kernel must never win.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ..compile_ahead import compile_ahead_of
from ..cute.tuning import CuteTuning, tune_cute_steps, tune_plain_steps
from ..ir import MainloopConfig
from ..launch import collected_launches, recorded_launches
from ..offline_target import fits
from ..settings import current
from ..tolerance import allowed_error, tuning_floor
from .configs import GPU_DEFAULT, INTERPRETER_DEFAULT, fit_columns

# A first screen of the tuning space on the mainloop's pipeline buffers alone (``smem_bytes``):
# of the 228 KB of shared memory on a Hopper SM (``offline_target``), 8 KB stay for what the
# count leaves out (barriers, the epilogue's staging). What a compiled kernel asks is checked
# against ``offline_target.fits`` once it is compiled (``not_resident``).
SMEM_LIMIT = 220 * 1024


class Candidate(NamedTuple):
    """One point of a tuning space (``MainloopConfig`` fields, positionally)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    epilogue_subtiles: int
    flatten: bool = False
    warp_specialize: bool = False
    programs_per_sm: int = 1
    maxnreg: int | None = None


# Measured on an H200 (bench/RESULTS.md): 128×256×64 with 3 stages and 2 epilogue sub-tiles led
# every shape tried in the first sweep; the rest cover small problems (wave quantisation), short K
# (pipelining across tiles) and register pressure. The two-programs-per-SM candidates (one
# warpgroup on a 128×128 tile, each program under half the SM's registers and shared memory)
# overlap one program's epilogue with the other's mainloop: measured 1.07× → 1.01× the cuBLAS
# GEMM on residual + partial RMSNorm, 1.15× → 1.08× on RMSNorm + partial cross-entropy (8192³,
# codegen v6, ``bench/experiments/occupancy.py``, run 2026-11-30g; with v7's lighter epilogue the
# cross-entropy kernels' tuner picks one program of 128×256 instead).
#
# Eight sub-tiles of 32 columns: epilogues that move several tiles (SwiGLU backward: load g and u,
# write dz; RMSNorm backward: load x and dout, write dx and y; RoPE) still spill on a 128×256 tile
# in four. Compiled for sm_90 by Triton 3.9 on a CPU (bench/experiments/subtile_registers.py;
# registers / spill stack per thread in 2, 4, 8 sub-tiles; not timed): the training step's SwiGLU
# backward 255 / 312 B, 254 / 0, 232 / 0; its RMSNorm backward 255 / 656 B, 255 / 144 B, 250 / 0;
# the paper's RMSNorm backward 255 / 800 B, 255 / 256 B, 254 / 0; RMSNorm + RoPE 255 / 664 B,
# 255 / 176 B, 232 / 0. Timed on the H200 (Triton 3.6, run 2026-12-01g, `--subtiles 1,2,4,8`):
# no faster than four anywhere — SwiGLU backward at 16384×8192×2048 1.47× cuBLAS in 2 and 4, 1.71×
# in 8; RMSNorm backward 1.07× in 4, 1.15× in 8; the paper's at 8192³ 1.11× tuned (4), 1.16× in 8 —
# the epilogues are bound by their extra tiles' traffic, not by spills. Eight stays in the full
# space only, so a quick tuning does not pay for a candidate that has not won.
_HOPPER_SPACE = [
    Candidate(128, 256, 64, 8, 3, 2),
    Candidate(128, 256, 64, 8, 4, 2),
    Candidate(128, 256, 64, 8, 3, 4),
    Candidate(128, 256, 64, 8, 3, 8),
    Candidate(128, 256, 64, 8, 3, 1),
    Candidate(128, 256, 64, 8, 3, 2, flatten=True),
    Candidate(128, 256, 64, 8, 3, 2, flatten=True, warp_specialize=True),
    Candidate(256, 128, 64, 8, 3, 2),
    Candidate(256, 128, 64, 8, 4, 2),
    Candidate(128, 128, 64, 8, 4, 1),
    Candidate(128, 128, 64, 8, 4, 2, flatten=True),
    Candidate(128, 128, 64, 4, 4, 2),
    Candidate(128, 128, 128, 8, 3, 2),
    Candidate(64, 256, 64, 4, 4, 2),
    # two programs per SM
    Candidate(128, 128, 64, 4, 3, 2, programs_per_sm=2),
    Candidate(128, 128, 64, 4, 3, 4, programs_per_sm=2),
    Candidate(128, 128, 32, 4, 4, 2, programs_per_sm=2),
    Candidate(128, 128, 64, 8, 3, 4, programs_per_sm=2, maxnreg=128),
    # narrow tiles for register-heavy epilogues
    Candidate(128, 64, 64, 4, 4, 1),
    Candidate(64, 128, 64, 4, 4, 1),
]

# A small space for sweeps over many kernels (bench/paper_kernels.py) and first calls of exported
# ops: the leaders of the first H200 sweep, 64- and 32-column epilogue slices for heavy epilogues
# (the 64-column ones also flattened, which helped reducing epilogues in the split-reduction
# experiment, bench/RESULTS.md, run 2026-11-30e), the two leading two-programs-per-SM candidates,
# and the narrow tiles.
QUICK_SPACE = [
    Candidate(128, 256, 64, 8, 3, 2),
    Candidate(128, 256, 64, 8, 3, 4),
    Candidate(128, 256, 64, 8, 3, 4, flatten=True),
    Candidate(128, 128, 64, 8, 4, 2, flatten=True),
    Candidate(128, 128, 64, 4, 3, 2, programs_per_sm=2),
    Candidate(128, 128, 32, 4, 4, 2, programs_per_sm=2),
    Candidate(128, 64, 64, 4, 4, 1),
    Candidate(64, 128, 64, 4, 4, 1),
]


def smem_bytes(cfg: MainloopConfig, itemsize: int) -> int:
    """Shared memory of the mainloop's pipeline: num_stages copies of an A and a B tile, for
    each program resident on the SM."""
    per_program = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * itemsize
    return cfg.programs_per_sm * per_program


def candidate_configs(
    M: int,
    N: int,
    K: int,
    *,
    itemsize: int,
    interpret: bool,
    space: list[tuple] | None = None,
    column_multiple: int = 1,
) -> list[MainloopConfig]:
    """The configs worth timing for one gemm of these sizes (whose epilogue sub-tiles are a
    multiple of ``column_multiple`` columns wide)."""
    if interpret:
        return [fit_columns(INTERPRETER_DEFAULT, column_multiple)]
    out = []
    for entry in space or _HOPPER_SPACE:
        cfg = MainloopConfig(group_m=8, **Candidate(*entry)._asdict())
        if smem_bytes(cfg, itemsize) > SMEM_LIMIT or cfg.epilogue_block_n % column_multiple:
            continue
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        if bm > 2 * max(M, 64) or bn > 2 * max(N, 64) or bk > max(K, 16):
            continue  # mostly padding
        if cfg not in out:
            out.append(cfg)
    if not out and column_multiple > 1:  # no candidate's sub-tiles hold whole segments
        out.append(fit_columns(GPU_DEFAULT, column_multiple))
    return out


@dataclass
class Trial:
    config: MainloopConfig
    ms: float | None  # the screening time
    error: str = ""
    final_ms: float | None = None  # the interleaved final round, for the finalists

    def as_dict(self) -> dict:
        """JSON-ready: the config's fields that differ from the defaults, and the times."""
        config = self.config.model_dump(exclude_defaults=True)
        return {"config": config, "ms": self.ms, "final_ms": self.final_ms, "error": self.error}


@dataclass
class TuningResult:
    step: str
    key: str
    best: MainloopConfig
    ms: float | None
    cached: bool
    trials: list[Trial] = field(default_factory=list)
    # configs that were fastest but computed wrong results, with what was wrong
    rejected: list[tuple[MainloopConfig, str]] = field(default_factory=list)
    narrowed: bool = False  # screened an earlier tuning's finalists of this step, not the space

    def as_dict(self) -> dict:
        """JSON-ready: the winner, whether it came from the cache, every trial and every
        rejected config (configs as their non-default fields)."""
        return {
            "best": self.best.model_dump(exclude_defaults=True),
            "ms": self.ms,
            "cached": self.cached,
            "narrowed": self.narrowed,
            "trials": [t.as_dict() for t in self.trials],
            "rejected": [
                {"config": c.model_dump(exclude_defaults=True), "why": why}
                for c, why in self.rejected
            ],
        }


def wrong_steps(compiled, prepared: dict[str, torch.Tensor]) -> dict[str, str]:  # noqa: ANN001
    """Fused gemm steps of ``compiled`` (with its pinned configs), and plain ones pinned to a CuTe
    config, whose tensors differ from the reference executor's, as ``{step: what differs}``.
    The run is poisoned: an element a config leaves unwritten shows, and no aux output takes over
    an intermediate's storage (``storage_sharing``), so every tensor a step wrote is still there
    to compare."""
    from ..reference import activation_dtype, execute_reference

    inputs = {n: prepared[n] for n in compiled.program.inputs}
    act = activation_dtype(compiled.program, inputs)
    info = compiled.info_for(inputs)
    got = compiled.run(prepared, poison=True)
    want = execute_reference(
        compiled.program, inputs, info=info, configs=compiled.configs_for(info)
    )
    # fused steps, and plain steps pinned to a CuTe config (cuBLAS's own are not checked)
    checked = set(compiled.kernels) | {n for n, c in compiled.cute_configs.items() if c}
    wrong: dict[str, str] = {}
    for name, t in info.tensors.items():
        if t.producer in checked and t.producer not in wrong:
            g, w = got[name], want[name]
            if t.partials is not None and g.shape != w.shape:  # another tile (CuTe): combined
                g, w = _combined(g, t.partials.kind), _combined(w, t.partials.kind)
            why = _mismatch(g, w, act)
            if why:
                wrong[t.producer] = f"{name}: {why}"
    return wrong


def _combined(partials: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-tile partials ``[rows, tiles]`` combined across the tiles, as ``sum_partials`` does."""
    p = partials.float()
    if kind == "max":
        return p.amax(dim=1)
    if kind == "lse":
        return torch.logsumexp(p, dim=1)
    return p.sum(dim=1)  # sum, sumsq


def _mismatch(got: torch.Tensor, want: torch.Tensor, act: torch.dtype) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, the reference's {tuple(want.shape)}"
    tol = tuning_floor(got.dtype, act)
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite):
        return "non-finite values where the reference has finite ones, or the reverse"
    if not finite.any():
        return ""
    scale = float(want[finite].abs().max())
    err = float((got - want)[finite].abs().max())
    if err > allowed_error(scale, tol):
        return f"max |error| {err:.3g} against max |reference| {scale:.3g} (allowed {tol:g} of it)"
    return ""


def _settle(compiled, prepared: dict, results: dict[str, TuningResult], cache) -> None:  # noqa: ANN001
    """Replace each winner whose results are wrong by the next fastest candidate, until every step
    is right; the default config comes last, and a step wrong under every config is an error."""
    from .configs import resolve_config

    # Only the steps tuned here: a step the CuTe backend runs is checked by cute.tuning.
    while wrong := {n: w for n, w in wrong_steps(compiled, prepared).items() if n in results}:
        info = compiled.info_for({n: prepared[n] for n in compiled.program.inputs})
        for name, why in wrong.items():
            r = results[name]
            r.rejected.append((r.best, why))
            bad = [c for c, _ in r.rejected]
            timed = sorted(
                (t for t in r.trials if t.ms is not None and t.config not in bad),
                key=lambda t: t.final_ms if t.final_ms is not None else t.ms,
            )
            g = info.gemms[name]  # the step's own config, as it runs untuned
            default = resolve_config(compiled._step(name).config, g)
            if timed:
                r.best, r.ms = timed[0].config, timed[0].final_ms or timed[0].ms
            elif default not in bad:
                r.best, r.ms = default, None
            else:
                raise RuntimeError(
                    f"step {name!r} computes wrong results under every config tried: "
                    + "; ".join(f"{c.model_dump()}: {w}" for c, w in r.rejected)
                )
            compiled.configs[name] = r.best
            cache.put(r.key, r.best, r.ms)


class TuningCache:
    """Winners by key, in memory and in a JSON file shared by every process that tunes.

    Processes tuning at once (parallel eval workers) each add their own entries: ``put`` holds an
    exclusive lock (``tuning.json.lock``, ``fcntl.flock``) while it reads the file, merges its
    entry into what is there and writes the result to a temporary file that replaces the old one
    atomically. Readers never take the lock: they see the old file or the new one, never a part.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or current().cache_dir / "tuning.json"
        self.entries: dict[str, dict] = self._read()

    def _read(self) -> dict[str, dict]:
        """The file's entries; none if it is missing or unreadable (it is only a cache)."""
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> MainloopConfig | None:
        entry = self.entries.get(key)
        return MainloopConfig.model_validate(entry["config"]) if entry else None

    def entry(self, key: str) -> dict | None:
        """The entry under ``key`` as stored (another tuner's own record, e.g. the CuTe
        backend's choices); None if there is none or it has no ``config``."""
        entry = self.entries.get(key)
        return entry if isinstance(entry, dict) and "config" in entry else None

    def put_entry(self, key: str, entry: dict) -> None:
        """Record ``entry`` (JSON-ready, with a ``config``) here and in the file."""
        self._write(key, entry)

    def finalists(self, key: str) -> list[MainloopConfig]:
        """The configs an earlier tuning under ``related_key`` kept as finalists (fastest
        first); none if there was none, or the entry is unreadable (it is only a cache)."""
        entry = self.entries.get(key)
        try:
            return [MainloopConfig.model_validate(c) for c in entry["finalists"]] if entry else []
        except (KeyError, TypeError, ValueError):
            return []

    def put_finalists(self, key: str, configs: list[MainloopConfig]) -> None:
        """Record a tuning's finalists (fastest first) under ``related_key``."""
        self._write(key, {"finalists": [c.model_dump() for c in configs]})

    def put(self, key: str, config: MainloopConfig, ms: float | None) -> None:
        """Record a winner here and in the file, keeping every other process's entries."""
        self._write(key, {"config": config.model_dump(), "ms": ms})

    def _write(self, key: str, entry: dict) -> None:
        self.entries[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            merged = {**self._read(), key: entry}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(merged, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        self.entries = merged


def _screen(
    compiled, name: str, tensors: dict, configs: list[MainloopConfig], warmup: int, rep: int
) -> list[Trial]:  # noqa: ANN001
    """Quick timings of every candidate: compile all, then a forward and a reverse pass, averaged
    (clock drift during the sweep is roughly linear, so the two passes cancel it). A candidate
    that fails to compile, or whose programs per SM cannot be resident at once
    (``not_resident``), is kept with its error and not timed."""
    import triton

    def time(cfg: MainloopConfig) -> float:
        compiled.configs[name] = cfg
        return float(
            triton.testing.do_bench(
                lambda: compiled.run_gemm_step(name, tensors),
                warmup=warmup,
                rep=rep,
                return_mode="median",
            )
        )

    _compile_configs_ahead(compiled, name, tensors, configs)
    trials, ok = [], []
    for cfg in configs:
        compiled.configs[name] = cfg
        try:
            with recorded_launches() as launches:
                compiled.run_gemm_step(name, tensors)  # compiles if not yet; raises if it cannot
            trials.append(Trial(cfg, None, not_resident(cfg, launches)))
        except Exception as e:  # noqa: BLE001 - a config that cannot compile is pruned
            trials.append(Trial(cfg, None, _describe(e)))
        if not trials[-1].error:
            ok.append(trials[-1])
    forward = [time(t.config) for t in ok]
    backward = [time(t.config) for t in reversed(ok)][::-1]
    for t, a, b in zip(ok, forward, backward, strict=True):
        t.ms = (a + b) / 2
    return trials


def not_resident(cfg: MainloopConfig, launches: list) -> str:
    """Why ``cfg``'s ``programs_per_sm`` programs of a step's kernel cannot be resident on one SM
    at once ("" when they can, and for one program per SM: Triton refuses to launch a kernel over
    a program's limit, and the screen records that error). ``launches``: the step's, as
    ``recorded_launches`` records them, each compiled already (``warmup`` finds it cached).

    ``smem_bytes`` prunes candidates by their pipeline's buffers alone; an epilogue that moves
    tiles through shared memory asks more — with Triton 3.9 for sm_90, the SwiGLU backward's
    ``down_bwd`` on a two-programs 128 × 128 candidate of the quick space 147,480 B, where two
    fit under 115,712 B each. Such a candidate would run as one program per SM with twice the
    programs in two waves: a config other than the one its name says, not worth timing."""
    if cfg.programs_per_sm == 1:
        return ""
    for kernel, grid, args, meta in launches:
        if not hasattr(kernel, "warmup"):  # not a Triton kernel: nothing to ask
            continue
        shared = kernel.warmup(*args, grid=grid, **meta).metadata.shared
        if not fits(shared, cfg.programs_per_sm):
            return (
                f"{cfg.programs_per_sm} programs per SM do not fit: the kernel asks "
                f"{shared:,} B of shared memory each"
            )
    return ""


def _compile_configs_ahead(
    compiled, name: str, tensors: dict, configs: list[MainloopConfig]
) -> None:  # noqa: ANN001
    """Compile step ``name``'s kernel under every config in ``configs`` at once
    (``compile_ahead_of``), so the screen's one-by-one first launches find them compiled. A config
    whose launch cannot even be planned is left to the screen, which records its error. The last
    config stays set: the screen sets each before launching it."""

    def collect() -> list:
        with collected_launches() as calls:
            for cfg in configs:
                compiled.configs[name] = cfg
                try:
                    compiled.run_gemm_step(name, tensors)
                except Exception:  # noqa: BLE001 - the screen launches it again, keeps the error
                    continue
        return calls

    compile_ahead_of(collect)


def _final_round(
    compiled, name: str, tensors: dict, trials: list[Trial], finalists: int, warmup: int, rep: int
) -> tuple[Trial, list[Trial]]:  # noqa: ANN001
    """The fastest of the screen's best ``finalists``, timed against each other, interleaved;
    and those finalists, fastest first."""
    from ..timing import interleaved_ms

    timed = sorted((t for t in trials if t.ms is not None), key=lambda t: t.ms)
    if not timed:
        raise RuntimeError(
            f"no mainloop config compiled for step {name!r}: " + "; ".join(t.error for t in trials)
        )
    top = timed[:finalists]

    def runner(cfg: MainloopConfig):  # noqa: ANN202
        def run() -> None:
            compiled.configs[name] = cfg
            compiled.run_gemm_step(name, tensors)

        return run

    final = interleaved_ms(
        {str(i): runner(t.config) for i, t in enumerate(top)}, warmup=warmup, rep=rep
    )
    for i, t in enumerate(top):
        t.final_ms = final[str(i)]
    top.sort(key=lambda t: t.final_ms)
    return top[0], top


def tuning_key(digest: str, device: str, M: int, N: int, K: int, dtype: torch.dtype) -> str:
    return f"{digest}|{device}|M={M}|N={N}|K={K}|{str(dtype).removeprefix('torch.')}"


def related_key(
    block: str,
    step: str,
    device: str,
    M: int,
    N: int,
    K: int,
    dtype: torch.dtype,
    space: list[tuple] | None = None,
) -> str:
    """The key of a step's finalists whatever its kernel's text: step ``step`` of ``block``'s
    Programs at these sizes and dtype (every candidate of a block names its GEMMs alike), screened
    from candidate space ``space`` (default: the whole Hopper space). Finalists of another space —
    one before a candidate was added — never narrow a screening: the new candidate would never be
    timed."""
    entries = repr([tuple(Candidate(*c)) for c in (space or _HOPPER_SPACE)])
    space_id = hashlib.sha256(entries.encode()).hexdigest()[:8]
    return "finalists|" + tuning_key(f"{block}:{step}:{space_id}", device, M, N, K, dtype)


def _to_screen(
    cache: TuningCache, related: str, space: list[MainloopConfig]
) -> tuple[list[MainloopConfig], bool]:
    """The configs to time for a kernel not tuned before, and whether they are an earlier
    tuning's finalists of the same step (``related_key``) rather than the whole space."""
    earlier = [c for c in cache.finalists(related) if c in space]  # still allowed for this step
    return (earlier, True) if earlier else (space, False)


def _describe(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def tune_program(
    compiled,
    prepared: dict[str, torch.Tensor],
    *,
    cache: TuningCache | None = None,
    space: list[tuple] | None = None,
    warmup: int = 10,
    rep: int = 20,
    finalists: int = 4,
    check: bool = True,
) -> dict[str, TuningResult]:  # noqa: ANN001 - a CompiledProgram
    """Pick a config for every fused gemm step of ``compiled`` at the sizes of ``prepared``.

    Runs the whole program once so every step's inputs exist; then, per step, screens every
    candidate once and times the ``finalists`` fastest against each other in interleaved rounds
    (clocks drift under load: a one-pass sweep favours whatever runs first). Pins the winners on
    ``compiled.configs``. With ``check`` (default), winners whose results differ from the
    reference executor's are replaced (``TuningResult.rejected`` says why).

    Steps the CuTe backend runs are tuned by ``cute.tuning`` after the Triton steps: its configs
    timed against each other and, with the ``auto`` backend, against the step's Triton kernel
    tuned first (``CuteTuning`` in the results; its choice pinned on ``compiled.cute_configs``).
    """
    from .. import backend

    cache = cache or TuningCache()
    compile_ahead_of(lambda: compiled.collect_launches(prepared, prepared=True))
    compiled.cute_configs.clear()  # chosen anew below (or read from the cache)
    tensors = compiled.run(prepared)
    info = compiled.info_for({n: prepared[n] for n in compiled.program.inputs})
    device = next(iter(prepared.values())).device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    on_cute = [n for n in compiled.kernels if compiled.mainloops_used.get(n) == "cute"]
    with_triton = compiled.backend == "auto"
    for name in on_cute if with_triton else ():
        compiled.cute_configs[name] = None  # its Triton kernel is tuned first, then compared
    results: dict[str, TuningResult | CuteTuning] = {}
    for name, source in compiled.kernels.items():
        if name in on_cute and not with_triton:
            continue  # the CuTe backend runs it: cute.tuning below
        gemm = info.gemms[name]
        dtype = tensors[compiled._step(name).a.tensor].dtype
        key = tuning_key(source.digest, device_name, gemm.M, gemm.N, gemm.K, dtype)
        cached = cache.get(key)
        if backend.INTERPRET:  # nothing to time on a CPU: the interpreter's one config
            only = fit_columns(INTERPRETER_DEFAULT, gemm.column_multiple)
            compiled.configs[name] = only
            results[name] = TuningResult(name, key, only, None, cached=False)
            continue
        if cached is not None:
            compiled.configs[name] = cached
            results[name] = TuningResult(name, key, cached, None, cached=True)
            continue
        related = related_key(
            compiled.program.block, name, device_name, gemm.M, gemm.N, gemm.K, dtype, space
        )
        whole = candidate_configs(
            gemm.M,
            gemm.N,
            gemm.K,
            itemsize=dtype.itemsize,
            interpret=False,
            space=space,
            column_multiple=gemm.column_multiple,
        )
        configs, narrowed = _to_screen(cache, related, whole)
        trials = _screen(compiled, name, tensors, configs, warmup, rep)
        if narrowed and all(t.ms is None for t in trials):  # none compiles for this kernel
            rest = [c for c in whole if c not in configs]
            trials += _screen(compiled, name, tensors, rest, warmup, rep)
            narrowed = False
        best, top = _final_round(compiled, name, tensors, trials, finalists, warmup, rep)
        compiled.configs[name] = best.config
        cache.put(key, best.config, best.final_ms)
        if not narrowed:
            cache.put_finalists(related, [t.config for t in top])
        results[name] = TuningResult(
            name, key, best.config, best.final_ms, cached=False, trials=trials, narrowed=narrowed
        )
    if check:
        _settle(compiled, prepared, results, cache)
    if on_cute and not backend.INTERPRET:  # nothing to time on a CPU
        results.update(
            tune_cute_steps(
                compiled, prepared, tensors, on_cute, cache, with_triton=with_triton, check=check
            )
        )
    else:
        compiled.cute_configs.clear()  # untimed: the CuTe steps keep the rule's configs
    plain = _plain_steps_for_cute(compiled, info, device)
    if plain:
        results.update(tune_plain_steps(compiled, prepared, tensors, plain, cache, check=check))
    return results


def _plain_steps_for_cute(compiled, info, device: torch.device) -> list[str]:  # noqa: ANN001
    """The plain-store steps tuning times on QuACK's GEMM against cuBLAS: under ``auto``, where
    the CuTe backend can run and the runtime hands plain products to cuBLAS at all."""
    from .. import backend, cute

    if compiled.backend != "auto" or not compiled.use_vendor or backend.INTERPRET:
        return []
    if cute.unavailable_reason(device) is not None:
        return []
    return [n for n, g in info.gemms.items() if g.vendor and g.M and g.N]
