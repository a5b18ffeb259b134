"""Experiment: the two backward paper kernels on the CuTe DSL's warp-specialized GEMM (QuACK).

The Triton kernels of ``gemm_partial_swiglu_bwd`` and ``gemm_residual_partial_rmsnorm_bwd`` run
their epilogue after the K loop of the same warps, so the two to four extra ``[M, N]`` tiles they
move cannot hide behind tensor-core work (1.13× / 1.11× the cuBLAS GEMM at 8192³). QuACK's Hopper
GEMM (``quack-kernels``, on ``nvidia-cutlass-dsl``) has a producer warp and two consumer
warpgroups in ping-pong: one consumer's epilogue runs while the other's K loop does, and its
epilogue is composed from ops (tile loads and stores through TMA, row/column vector loads and
partial reductions). This script writes both kernels as QuACK epilogues and times them beside the
cuBLAS GEMM of the same shape, QuACK's plain GEMM, and the product's tuned Triton kernels.

Semantics are the blocks' (``coda.blocks.kernels``): with ``D = A Bᵀ``,

- SwiGLU backward: ``z = [G, U]`` interleaved ``[M, 2N]``; ``dZ = [dG, dU]`` interleaved, with
  ``dG = D·U·σ(G)(1 + G(1 − σ(G)))`` and ``dU = D·silu(G)``; ``O = silu(G)·U``; ``zdz`` = Σ over
  the row of ``G·dG + U·dU`` (per-tile partials, summed after).
- residual + partial RMSNorm backward: ``x̂ = r·x``; ``O_out = O + (D·γ − x̂·c)·r``;
  ``C_out = x̂·γ``; ``dγ`` = Σ over rows of ``D·x̂`` (per-tile partials, summed after).

Every timed kernel is first checked against the block's float32 reference on the same inputs.

    python3 bench/experiments/cute_bwd_epilogues.py --compile-only   # any machine: sm_90a
    python3 bench/experiments/cute_bwd_epilogues.py --out results.json  # an H100/H200

Needs ``quack-kernels`` and ``nvidia-cutlass-dsl`` (docs/gpu.md says how to bring them onto a GPU
machine without network access). Not product code.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
import typing
from typing import Any, NamedTuple

# The pairs the kernels are timed at: the paper shapes, then the two training shapes of the
# Llama 3.2 1B MLP backward at 8192 tokens (down_bwd: [M, f] from K = d; gate_up_bwd: [M, d]
# from K = 2f) with the paper kernels' semantics.
SIZES = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 2048), (8192, 2048, 16384)]
CHECK_SIZE = (1000, 1024, 1000)  # ragged M and K

# (tile_m, tile_n, pingpong, cluster_m, cluster_n): QuACK's Hopper candidates worth a try here
CONFIGS = [
    (128, 192, True, 2, 1),
    (128, 128, True, 2, 1),
    (128, 160, True, 2, 1),
    (128, 192, True, 1, 2),
    (256, 128, False, 2, 1),
    (256, 192, False, 2, 1),
]

# The product's tuned Triton configs for the two kernels (bench/paper_kernels.py --tune quick,
# results/2026-12-01a-h200-paper_kernels-three-over.json); other shapes run the Program's "auto".
TRITON_TUNED = {
    ("gemm_partial_swiglu_bwd", 8192): dict(flatten=True),
    ("gemm_partial_swiglu_bwd", 4096): dict(flatten=False),
    ("gemm_residual_partial_rmsnorm_bwd", 8192): dict(flatten=True),
    ("gemm_residual_partial_rmsnorm_bwd", 4096): dict(flatten=True),
}
TRITON_BASE = dict(
    block_m=128,
    block_n=256,
    block_k=64,
    group_m=8,
    num_warps=8,
    num_stages=3,
    epilogue_subtiles=4,
    warp_specialize=False,
    programs_per_sm=1,
    maxnreg=None,
)


try:  # the CuTe DSL is optional: the module imports without it (--help, tests)
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr
    from quack.cute_dsl_utils import mlir_namedtuple
    from quack.epi_ops import (
        ColVecLoad,
        RowVecLoad,
        RowVecReduce,
        TileLoad,
        TileStore,
        colvec_reduce_accumulate,
        rowvec_reduce_accumulate,
    )
    from quack.gemm_act import GemmActMixin
    from quack.gemm_dact import GemmDGatedMixin
    from quack.gemm_sm90 import GemmSm90

    class SwiGLUBwdMixin(GemmDGatedMixin):
        """QuACK's gated-backward epilogue with the CODA row statistic Σ (G·dG + U·dU)."""

        @cute.jit
        def epi_visit_subtile(self, params, epi_loop_tensors, tRS_rD, tRS_rC=None):
            reduce = epi_loop_tensors.get("mColVecReduce")
            xy16 = cute.recast_tensor(tRS_rC, self.implicit_dtype)
            xy = cute.make_rmem_tensor(xy16.layout, Float32)
            xy.store(xy16.load().to(Float32))
            dxy = cute.make_rmem_tensor_like(xy, Float32)
            out = cute.make_rmem_tensor_like(tRS_rD, Float32)
            zdz = cute.make_rmem_tensor_like(tRS_rD, Float32)
            pair = cute.flat_divide(xy, cute.make_layout(2))
            dpair = cute.flat_divide(dxy, cute.make_layout(2))
            x, y, dx, dy = pair[0, ...], pair[1, ...], dpair[0, ...], dpair[1, ...]
            for i in cutlass.range(cute.size(tRS_rD), unroll_full=True):
                dx[i], dy[i], out[i] = params.act_bwd_fn(x[i], y[i], tRS_rD[i])
                zdz[i] = x[i] * dx[i] + y[i] * dy[i]
            if const_expr(reduce is not None):
                colvec_reduce_accumulate(self, reduce, zdz)
            dxy16 = cute.make_rmem_tensor(dxy.layout, self.implicit_dtype)
            dxy16.store(dxy.load().to(self.implicit_dtype))
            tRS_rD.store(cute.recast_tensor(dxy16, Float32).load())
            return (out,)

    class SwiGLUBwdSm90(SwiGLUBwdMixin, GemmSm90):
        pass

    class SwiGLUBwdTileLoadMixin(SwiGLUBwdMixin):
        """The same epilogue with the ``[G, U]`` words loaded as an epilogue tile (QuACK's
        ``TileLoad``, as the product's generated epilogues load tiles) instead of as C."""

        _epi_ops = (*GemmDGatedMixin._epi_ops, TileLoad("mZ"))

        @mlir_namedtuple
        class EpilogueArguments(NamedTuple):
            mAuxOut: cute.Tensor
            mZ: cute.Tensor
            act_bwd_fn: cutlass.Constexpr[typing.Callable] = None
            mColVecBroadcast: cute.Tensor | None = None
            mColVecReduce: cute.Tensor | None = None
            rounding_mode: cutlass.Constexpr[int] = 0
            sr_seed: cutlass.Int32 | cute.Tensor | None = None

        def epi_to_underlying_arguments(self, args, *, loc=None, ip=None):
            self.rounding_mode = args.rounding_mode
            self.aux_out_dtype = args.mAuxOut.element_type
            self.aux_out_layout = cutlass.utils.LayoutEnum.from_tensor(args.mAuxOut)
            self.cta_tile_shape_aux_out_mn = self.cta_tile_shape_mnk[:2]
            d = self._epi_ops_to_params_dict(args)
            d["act_bwd_fn"] = args.act_bwd_fn
            return self.EpilogueParams(**d)

        @cute.jit
        def epi_visit_subtile(self, params, epi_loop_tensors, tRS_rD, tRS_rC=None):
            words = epi_loop_tensors["mZ"]
            return SwiGLUBwdMixin.epi_visit_subtile(self, params, epi_loop_tensors, tRS_rD, words)

    # this module's annotations are strings; the DSL reads a Constexpr field's from the class
    # (the names they use are this block's: Python 3.11 looks only in the module's globals)
    SwiGLUBwdTileLoadMixin.EpilogueArguments.__annotations__ = typing.get_type_hints(
        SwiGLUBwdTileLoadMixin.EpilogueArguments, localns=locals()
    )

    class SwiGLUBwdTileLoadSm90(SwiGLUBwdTileLoadMixin, GemmSm90):
        pass

    class RMSNormBwdMixin(GemmActMixin):
        """D = O + (acc·γ − x̂·c)·r with x̂ = r·x (O is GEMM's C); aux out x̂·γ; dγ partials."""

        _epi_ops = (
            RowVecLoad("mGamma"),
            ColVecLoad("mRstd"),
            ColVecLoad("mStat"),
            TileLoad("mX"),
            TileStore("mAuxOut"),
            RowVecReduce("mDGamma"),
        )

        @mlir_namedtuple
        class EpilogueArguments(NamedTuple):
            mAuxOut: cute.Tensor
            mGamma: cute.Tensor
            mRstd: cute.Tensor
            mStat: cute.Tensor
            mX: cute.Tensor
            mDGamma: cute.Tensor | None = None
            act_fn: cutlass.Constexpr = None

        def epi_to_underlying_arguments(self, args, *, loc=None, ip=None):
            from quack.rounding import RoundingMode

            self.rounding_mode = RoundingMode.RN
            self.aux_out_dtype = args.mAuxOut.element_type
            self.aux_out_layout = cutlass.utils.LayoutEnum.from_tensor(args.mAuxOut)
            self.cta_tile_shape_aux_out_mn = self.cta_tile_shape_mnk[:2]
            d = self._epi_ops_to_params_dict(args)
            d["act_fn"] = None
            return self.EpilogueParams(**d)

        @cute.jit
        def epi_visit_subtile(self, params, epi_loop_tensors, tRS_rD, tRS_rC=None):
            gamma = epi_loop_tensors["mGamma"]
            rstd = epi_loop_tensors["mRstd"]
            stat = epi_loop_tensors["mStat"]
            x = epi_loop_tensors["mX"]
            reduce = epi_loop_tensors.get("mDGamma")
            xhat = cute.make_rmem_tensor(tRS_rD.layout.shape, Float32)
            xhat.store(x.load().to(Float32))
            aux = cute.make_rmem_tensor(tRS_rD.layout.shape, Float32)
            for i in cutlass.range(cute.size(tRS_rD), unroll_full=True):
                xhat[i] = xhat[i] * rstd[i]
            if const_expr(reduce is not None):
                rowvec_reduce_accumulate(self, reduce, tRS_rD, rScale=xhat)
            o = tRS_rC.load().to(Float32)
            tRS_rD.store(
                o + (tRS_rD.load() * gamma.load() - xhat.load() * stat.load()) * rstd.load()
            )
            aux.store(xhat.load() * gamma.load())
            return (aux,)

    class RMSNormBwdSm90(RMSNormBwdMixin, GemmSm90):
        pass


except ImportError:  # pragma: no cover - depends on the machine
    SwiGLUBwdSm90 = RMSNormBwdSm90 = SwiGLUBwdTileLoadSm90 = None


def _quack_epilogues():
    """The two epilogue classes; raises where the CuTe DSL or QuACK is not installed."""
    if SwiGLUBwdSm90 is None:
        raise RuntimeError("needs quack-kernels and nvidia-cutlass-dsl (docs/gpu.md)")
    return SwiGLUBwdSm90, RMSNormBwdSm90


class Compiled(NamedTuple):
    fn: Any
    config: tuple
    tile_load: bool = False  # the SwiGLU backward's [G, U] as an epilogue tile load, not C


def _fake_common(c_dtype_is_pair: bool):
    import cutlass
    from quack.gemm_tvm_ffi_utils import make_fake_gemm_tensors

    bf16 = cutlass.BFloat16
    dc = cutlass.Float32 if c_dtype_is_pair else bf16
    return make_fake_gemm_tensors(bf16, bf16, dc, dc, "k", "k", "n", "n")


def compile_swiglu_bwd(config: tuple, arch: tuple = (9, 0), tile_load: bool = False) -> Compiled:
    """The hand-written SwiGLU backward at ``config``: ``[G, U]`` as the GEMM's C operand, or with
    ``tile_load`` as an epilogue tile load (QuACK's ``TileLoad``, as the generated kernels load
    tiles)."""
    import cutlass
    import cutlass.cute as cute
    from quack.activation import dgate_fn_map
    from quack.compile_utils import make_fake_tensor as fake
    from quack.gemm_tvm_ffi_utils import compile_gemm_kernel, make_fake_scheduler_args

    cls, _ = _quack_epilogues()
    tile_m, tile_n, pingpong, cm, cn = config
    mA, mB, mD, mC, m, n, _, batch = _fake_common(True)
    mO = fake(cutlass.BFloat16, (m, n, batch), leading_dim=1, divisibility=8)
    mZdz = fake(cutlass.Float32, (batch, m, cute.sym_int()), leading_dim=2, divisibility=1)
    if tile_load:
        cls, mC = SwiGLUBwdTileLoadSm90, None
        mZ = fake(cutlass.Float32, (m, n, batch), leading_dim=1, divisibility=4)
        epi = cls.EpilogueArguments(mO, mZ, dgate_fn_map["swiglu"], mColVecReduce=mZdz)
    else:
        epi = cls.EpilogueArguments(mO, dgate_fn_map["swiglu"], mColVecReduce=mZdz)

    def implicit(gemm):
        gemm.implicit_dtype = cutlass.BFloat16

    fn = compile_gemm_kernel(
        cls, cutlass.BFloat16, (tile_m, tile_n), (cm, cn, 1), pingpong, True, False, False,
        arch, mA, mB, mD, mC, epi, make_fake_scheduler_args(False, False, batch), None,
        post_init=implicit,
    )  # fmt: skip
    return Compiled(fn, config, tile_load)


def compile_rmsnorm_bwd(config: tuple, arch: tuple = (9, 0)) -> Compiled:
    import cutlass
    import cutlass.cute as cute
    from quack.compile_utils import make_fake_tensor as fake
    from quack.gemm_tvm_ffi_utils import compile_gemm_kernel, make_fake_scheduler_args

    _, cls = _quack_epilogues()
    tile_m, tile_n, pingpong, cm, cn = config
    mA, mB, mD, mC, m, n, _, batch = _fake_common(False)
    bf16 = cutlass.BFloat16
    epi = cls.EpilogueArguments(
        mAuxOut=fake(bf16, (m, n, batch), leading_dim=1, divisibility=8),
        mGamma=fake(bf16, (batch, n), leading_dim=1, divisibility=8),
        mRstd=fake(cutlass.Float32, (batch, m), leading_dim=1, divisibility=4),
        mStat=fake(cutlass.Float32, (batch, m), leading_dim=1, divisibility=4),
        mX=fake(bf16, (m, n, batch), leading_dim=1, divisibility=8),
        mDGamma=fake(cutlass.Float32, (batch, cute.sym_int(), n), leading_dim=2, divisibility=1),
    )
    fn = compile_gemm_kernel(
        cls, bf16, (tile_m, tile_n), (cm, cn, 1), pingpong, True, False, False,
        arch, mA, mB, mD, mC, epi, make_fake_scheduler_args(False, False, batch), None,
    )  # fmt: skip
    return Compiled(fn, config)


def _p(t):
    """(L=1, rows, cols) → QuACK's (rows, cols, L) view."""
    return t.unsqueeze(0).permute(1, 2, 0)


def _sched(compiled: Compiled):
    from quack.cute_dsl_utils import get_max_active_clusters
    from quack.gemm_tvm_ffi_utils import make_scheduler_args

    _, _, _, cm, cn = compiled.config
    return make_scheduler_args(get_max_active_clusters(cm * cn), 8, None)


def swiglu_bwd_runner(compiled: Compiled, inputs: dict):
    """A zero-argument launch of the SwiGLU-backward kernel on ``inputs``; returns it and the
    outputs dict it fills (``zdz`` summed from its per-tile partials on each call)."""
    import torch

    a, b, z = inputs["a"], inputs["b"], inputs["z"]
    M, N = a.shape[0], b.shape[0]
    tile_n = compiled.config[1]
    dz = torch.empty(M, 2 * N, dtype=z.dtype, device=z.device)
    o = torch.empty(M, N, dtype=z.dtype, device=z.device)
    part = torch.empty(1, M, -(-N // tile_n), dtype=torch.float32, device=z.device)
    words = _p(z.view(torch.float32))
    reduce = dict(mColVecReduce=part, rounding_mode=None, sr_seed=None)
    if compiled.tile_load:
        c = None
        epi = SwiGLUBwdTileLoadSm90.EpilogueArguments(_p(o), words, None, **reduce)
    else:
        cls, _ = _quack_epilogues()
        c = words
        epi = cls.EpilogueArguments(_p(o), None, **reduce)
    args = (_p(a), _p(b), _p(dz.view(torch.float32)), c, epi, _sched(compiled), None)
    out = {"dz": dz, "o": o}

    def run():
        compiled.fn(*args)
        out["zdz"] = part[0].sum(-1)
        return out

    return run, out


def rmsnorm_bwd_runner(compiled: Compiled, inputs: dict):
    import torch

    a, b, x, o = inputs["a"], inputs["b"], inputs["x"], inputs["o"]
    M, N = a.shape[0], b.shape[0]
    tile_m = compiled.config[0]
    o_out = torch.empty_like(o)
    c_out = torch.empty_like(x)
    part = torch.empty(1, -(-M // tile_m), N, dtype=torch.float32, device=x.device)
    _, cls = _quack_epilogues()
    epi = cls.EpilogueArguments(
        mAuxOut=_p(c_out),
        mGamma=inputs["gamma"].unsqueeze(0),
        mRstd=inputs["rstd"].unsqueeze(0),
        mStat=inputs["c"].unsqueeze(0),
        mX=_p(x),
        mDGamma=part,
    )
    sched = _sched(compiled)
    args = (_p(a), _p(b), _p(o_out), _p(o), epi, sched, None)
    out = {"o_out": o_out, "c_out": c_out}

    def run():
        compiled.fn(*args)
        out["dgamma"] = part[0].sum(0).to(x.dtype)
        return out

    return run, out


KERNELS = {
    "gemm_partial_swiglu_bwd": (compile_swiglu_bwd, swiglu_bwd_runner),
    "gemm_residual_partial_rmsnorm_bwd": (compile_rmsnorm_bwd, rmsnorm_bwd_runner),
}
# The SwiGLU backward again with [G, U] as an epilogue tile load (--tile-load): timed beside the
# kernel above, to tell what the C operand's path is worth against a tile load.
TILE_LOAD = (functools.partial(compile_swiglu_bwd, tile_load=True), swiglu_bwd_runner)


def _sizes(block_name: str, m: int, n: int, k: int) -> dict[str, int]:
    sizes = {"M": m, "N": n, "K": k}
    return {**sizes, "N2": 2 * n} if block_name == "gemm_partial_swiglu_bwd" else sizes


def check_outputs(block, got: dict, inputs: dict) -> dict[str, float]:
    """Largest error of each output relative to the largest magnitude of its float32 reference."""
    ref = block.reference({k: v.float() if v.is_floating_point() else v for k, v in inputs.items()})
    return {
        name: float((got[name].float() - ref[name].float()).abs().max() / ref[name].abs().max())
        for name in block.outputs
    }


def triton_runner(block, sizes: dict, inputs: dict):
    """The product's Program for the block, at its tuned config where one is recorded."""
    from coda.planner import lower
    from coda.primitives import analyze, compile_program
    from coda.primitives.ir import MainloopConfig

    program = lower(block)
    info = analyze(program, sizes)
    compiled = compile_program(program, info)
    prepared = compiled.prepare(inputs)
    tuned = TRITON_TUNED.get((block.name, sizes["M"])) if sizes["M"] == sizes["K"] else None
    if tuned is not None:
        (step,) = info.gemms
        compiled.configs[step] = MainloopConfig(**TRITON_BASE, **tuned)

    def run():
        return program.select_outputs(compiled.run(prepared), info.sizes)

    return run


# The product's generated epilogues (``CODA_EPILOGUE_BACKEND=cute``) at tiles and clusters of
# one's choice, with the edge masks as generated or taken out (masked=False), and the epilogue
# pipelines as QuACK splits shared memory (0) or n stages deep (``CuteConfig.epi_stages``):
# (tile_m, tile_n, pingpong, cluster_m, cluster_n, masked, epi_stages).
GENERATED = [
    (128, 128, True, 2, 1, True, 0),
    (128, 128, True, 2, 1, False, 0),
    (128, 192, True, 2, 1, True, 0),
    (128, 192, True, 2, 1, False, 0),
    (128, 128, True, 1, 1, True, 0),
    (256, 128, False, 2, 1, True, 0),
    (128, 192, True, 1, 2, True, 0),
    (128, 128, True, 2, 1, True, 4),
    (128, 128, True, 1, 2, True, 4),
]


def generated_runner(block, sizes: dict, inputs: dict, variant: tuple):
    """The product's Program for the block on the CuTe backend, its generated module compiled at
    ``variant``'s tile and cluster; unmasked, the reductions' edge masks are taken out of the
    module's text (only right where every output dimension is a multiple of the tile)."""
    import re

    from coda.planner import lower
    from coda.primitives import analyze, compile_program
    from coda.primitives.cute import launch

    tile_m, tile_n, pingpong, cm, cn, masked, stages = variant
    config = launch.CuteConfig(tile_m, tile_n, cm, cn, pingpong, stages)
    program = lower(block)
    info = analyze(program, sizes)
    compiled = compile_program(program, info)
    compiled.epilogue_backend = "cute"
    prepared = compiled.prepare(inputs)
    saved = launch.choose_config, launch.generate

    def unmasked(*args, **kwargs):
        source = saved[1](*args, **kwargs)
        text = re.sub(r"F\.where\(inside_\w, (.*), 0\.0\)", r"\1", source.text)
        return dataclasses.replace(source, text=text)

    launch.choose_config = lambda gemm: config
    launch.generate = saved[1] if masked else unmasked
    try:
        compiled.run(prepared)  # plans (and compiles) at this variant; replays keep it
    finally:
        launch.choose_config, launch.generate = saved
    if compiled.cute_refusals:
        raise RuntimeError(f"ran on Triton: {compiled.cute_refusals}")

    def run():
        return program.select_outputs(compiled.run(prepared), info.sizes)

    return run


def compile_all(configs: list[tuple], arch: tuple = (9, 0), kernels=None) -> dict:
    """Compile each kernel (of ``kernels``, default all) at each config; a config that does not
    fit records why."""
    done: dict = {}
    for name, (compile_fn, _) in KERNELS.items():
        if kernels and name not in kernels:
            continue
        for config in configs:
            start = time.perf_counter()
            try:
                done[name, config] = compile_fn(config, arch)
                print(
                    f"compiled {name} {config} in {time.perf_counter() - start:.1f} s", flush=True
                )
            except Exception as e:  # a tile that does not fit shared memory, an unsupported shape
                done[name, config] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(f"skipped {name} {config}: {done[name, config]}", flush=True)
    return done


def bench(args: argparse.Namespace) -> dict:
    import torch

    from coda.blocks.registry import get_block
    from coda.primitives.timing import interleaved_ms

    configs = [c for c in CONFIGS if args.configs is None or CONFIGS.index(c) in args.configs]
    generated = [GENERATED[i] for i in args.generated]
    compiled = compile_all(configs, kernels=args.kernels)
    # (kernel, config) -> the SwiGLU backward loading [G, U] as a tile (--tile-load)
    tile_load = {}
    swiglu = "gemm_partial_swiglu_bwd"
    if args.tile_load and (not args.kernels or swiglu in args.kernels):
        for config in configs:
            try:
                tile_load[swiglu, config] = TILE_LOAD[0](config)
            except Exception as e:  # noqa: BLE001 (an experiment: report and go on)
                print(f"skipped tile-load {config}: {type(e).__name__}: {e}"[:300], flush=True)
    rows: list[dict] = []
    result = {"environment": environment(), "rows": rows, "compile_errors": {}}
    for (name, config), c in compiled.items():
        if isinstance(c, str):
            result["compile_errors"][f"{name} {config}"] = c
    for name, (_, runner) in KERNELS.items():
        if args.kernels and name not in args.kernels:
            continue
        block = get_block(name)
        # correctness first, at a ragged shape, for every config
        sizes = _sizes(name, *CHECK_SIZE)
        inputs = block.make_inputs(sizes, torch.bfloat16, seed=1, device="cuda")
        correct = {}
        for config in configs:
            c = compiled[name, config]
            if isinstance(c, str):
                continue
            run, _ = runner(c, inputs)
            errors = check_outputs(block, run(), inputs)
            correct[config] = max(errors.values()) < args.tolerance
            rows.append({"kernel": name, "config": config, "sizes": sizes, "errors": errors,
                         "correct": correct[config]})  # fmt: skip
            print(f"check {name} {config}: {errors}", flush=True)
            if (name, config) in tile_load:
                run, _ = TILE_LOAD[1](tile_load[name, config], inputs)
                errors = check_outputs(block, run(), inputs)
                print(f"check tile-load {config}: {errors}", flush=True)
        for m, n, k in [SIZES[i] for i in args.sizes] if args.sizes else SIZES:
            sizes = _sizes(name, m, n, k)
            inputs = block.make_inputs(sizes, torch.bfloat16, seed=0, device="cuda")
            a, b = inputs["a"], inputs["b"]
            fns = {"cublas": lambda a=a, b=b: torch.mm(a, b.t())}
            for config in configs:
                c = compiled[name, config]
                if not isinstance(c, str) and correct.get(config):
                    fns[f"quack {config}"] = runner(c, inputs)[0]
                if (name, config) in tile_load:
                    fns[f"quack tile-load {config}"] = TILE_LOAD[1](
                        tile_load[name, config], inputs
                    )[0]
            fns["triton"] = triton_runner(block, sizes, inputs)
            for variant in generated:
                try:
                    fns[f"generated {variant}"] = generated_runner(block, sizes, inputs, variant)
                except Exception as e:  # a config that does not fit, a refusal
                    print(f"generated {variant}: {type(e).__name__}: {e}"[:300], flush=True)
            errors = check_outputs(block, fns["triton"](), inputs)
            for label, fn in list(fns.items()):
                if label.startswith(("quack", "generated")):
                    errors_q = check_outputs(block, fn(), inputs)
                    if max(errors_q.values()) >= args.tolerance:
                        print(f"WRONG at {sizes}: {label} {errors_q}", flush=True)
                        del fns[label]
            times = interleaved_ms(fns, rounds=args.rounds, warmup=25, rep=100)
            row = {"kernel": name, "sizes": sizes, "ms": times, "triton_errors": errors,
                   "over_cublas": {k: v / times["cublas"] for k, v in times.items()}}  # fmt: skip
            rows.append(row)
            ratios = "; ".join(f"{k} {v:.3f}x" for k, v in row["over_cublas"].items())
            print(f"{name} {m}x{n}x{k}: cublas {times['cublas']:.3f} ms; {ratios}", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1, default=str)
    return result


def environment() -> dict[str, Any]:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "quack", "cutlass"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "?")
        except ImportError:
            env[mod] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-only", action="store_true", help="compile for sm_90a and stop")
    p.add_argument("--configs", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="indices into CONFIGS (default: all)")  # fmt: skip
    p.add_argument("--generated", type=lambda s: [int(x) for x in s.split(",")], default=[],
                   help="indices into GENERATED: product kernels to time too")  # fmt: skip
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="indices into SIZES (default: all)")  # fmt: skip
    p.add_argument("--kernels", type=lambda s: s.split(","), default=None,
                   help=f"which of {', '.join(KERNELS)} (default: both)")  # fmt: skip
    p.add_argument(
        "--tile-load",
        action="store_true",
        help="also the SwiGLU backward with [G, U] as an epilogue tile load, not as C",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--out", default=None, help="write every row as JSON here")
    args = p.parse_args(argv)
    if args.compile_only:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        configs = [c for c in CONFIGS if args.configs is None or CONFIGS.index(c) in args.configs]
        done = compile_all(configs)
        return 0 if all(not isinstance(v, str) for v in done.values()) else 1
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
