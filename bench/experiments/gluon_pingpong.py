"""Experiment: can ping-pong consumer warpgroups hide the epilogue traffic the three over-target
paper kernels move?

The generated kernels (``primitives/codegen``) run the mainloop and the epilogue of a tile in the
same warps, one after the other: the tensor cores idle while a tile's epilogue loads and stores
whole extra ``[M, N]`` tiles (bench/RESULTS.md, run 2026-12-01a: +2 / +3 / +4 tiles,
no-overlap floors 1.038× / 1.058× / 1.077× the GEMM at 8192). This file writes the other schedule
by hand in Gluon (``triton.experimental.gluon``, Triton 3.6), after CUTLASS's Hopper "ping-pong"
kernel:

* one **producer** warp streams A and B tiles through a ring of ``STAGES`` shared-memory slots
  with TMA, for every output tile the program owns, in order;
* two **consumer** warpgroups take the program's tiles in turn (even / odd). Each runs its
  tile's K loop on ``wgmma`` (128 × 128 fp32 accumulator, 128 registers a thread), then its
  epilogue: epilogue tiles arrive and leave by TMA through the consumer's own shared-memory
  buffers, ``EPI_N`` columns at a time. The consumers take turns through two order barriers, so
  one's K loop runs while the other is in its epilogue — the epilogue's memory traffic and
  latency overlap tensor-core work instead of stalling it.

``PREFETCH=1`` (``--configs prefetch``) gives the epilogue two slots of every buffer: the next
piece's load is in flight while this one computes, the tile's first piece is loaded while its K
loop runs, and two pieces' stores may be outstanding — against the latency-bound one-piece-at-a-
time epilogue measured in run 2026-12-01c (bench/RESULTS.md). Measured in run 2026-12-01e:
correct, and no faster — the SwiGLU backward at the training step's 8192×8192×2048 takes 0.744 ms
(1.79× cuBLAS) against the generated kernel's 0.59–0.62 ms, so the Gluon backend is not worth
building on this schedule.

``CONSUMERS=1`` is the control: one consumer warpgroup and the producer, at one or two programs
per SM (``PER_SM``; two let the warp scheduler overlap one program's epilogue with the other's K
loop, where shared memory allows).

Kernels (``KIND``): ``store`` (plain GEMM, D = A Bᵀ: what the schedule costs with nothing to
hide), ``swiglu_bwd`` (``gemm_partial_swiglu_bwd``: dZ, O and per-tile Σ z·dz from the saved
interleaved Z = [G, U]) and ``residual_rmsnorm`` (``gemm_residual_partial_rmsnorm``: D = A B + C,
O = D ⊙ γ, per-tile Σ d²). Each is checked against the block's fp32 reference semantics and
timed interleaved against the cuBLAS GEMM of the same shape. Not part of the product: a
measurement that decides whether the codegen grows a Gluon ping-pong backend. Found
(bench/RESULTS.md, run 2026-12-01b): ping-pong takes the SwiGLU backward from the generated
kernel's 1.126× to 1.081× of cuBLAS at 8192 and leaves residual + partial RMSNorm at 1.06×; its
own plain GEMM runs at 1.035×, which is now the floor.

    python3 bench/experiments/gluon_pingpong.py [--sizes 4096,8192,8192x8192x2048]
        [--configs pingpong|sweep|deep|prefetch]
    python3 bench/experiments/gluon_pingpong.py --check-grids [--grids 7,16,64]   # faults too
    python3 bench/experiments/gluon_pingpong.py --compile-only   # no GPU needed

``--compile-only`` compiles every config for sm_90 through a stand-in driver (Triton 3.6 or 3.9;
the TMA copy names are looked up for either), printing shared memory and whether the programs
per SM asked for fit — the way these kernels were written on a machine without a GPU.
"""

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from coda.primitives.offline_target import fits, for_target

# Triton 3.6 (the GPU machine's) names the TMA copies async_copy_global_to_shared and
# async_copy_shared_to_global; later releases (this machine's 3.9) async_load and async_store.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

EPILOGUES = ("store", "swiglu_bwd", "residual_rmsnorm")


@aggregate
class Mainloop:
    """What the producer and both consumers share: the operand ring and its barriers."""

    a_desc: tma.tensor_descriptor
    b_desc: tma.tensor_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    ready_bars: gl.shared_memory_descriptor
    empty_bars: gl.shared_memory_descriptor
    order_bars: gl.shared_memory_descriptor  # [2, 1]: consumer c has issued its tile's K loop
    M: gl.tensor
    N: gl.tensor
    K: gl.tensor
    NUM_PROGRAMS: gl.constexpr
    GROUP_M: gl.constexpr
    B_NK: gl.constexpr  # B given as [N, K] (an nn.Linear weight: A Bᵀ) rather than [K, N]
    CONSUMERS: gl.constexpr  # 2: ping-pong; 1: one consumer warpgroup
    # derived from the descriptors and the ring: the output tile, the K step, the ring's slots
    BM: gl.constexpr
    BN: gl.constexpr
    BK: gl.constexpr
    STAGES: gl.constexpr

    @triton.constexpr_function
    def __init__(
        self,
        a_desc,
        b_desc,
        a_bufs,
        b_bufs,
        ready_bars,
        empty_bars,
        order_bars,
        M,
        N,
        K,
        NUM_PROGRAMS,
        GROUP_M,
        B_NK,
        CONSUMERS,
    ):
        self.a_desc, self.b_desc = a_desc, b_desc
        self.a_bufs, self.b_bufs = a_bufs, b_bufs
        self.ready_bars, self.empty_bars, self.order_bars = ready_bars, empty_bars, order_bars
        self.M, self.N, self.K = M, N, K
        self.NUM_PROGRAMS = gl.constexpr(NUM_PROGRAMS)
        self.GROUP_M = gl.constexpr(GROUP_M)
        self.B_NK = gl.constexpr(B_NK)
        self.CONSUMERS = gl.constexpr(CONSUMERS)
        self.BM = gl.constexpr(a_desc.block_type.shape[0])
        self.BK = gl.constexpr(a_desc.block_type.shape[1])
        self.BN = gl.constexpr(b_desc.block_type.shape[0 if self.B_NK else 1])
        self.STAGES = gl.constexpr(a_bufs.type.shape[0])


@aggregate
class Epilogue:
    """The epilogue's tensors and each consumer's shared-memory buffers (leading dim: consumer)."""

    in_desc: tma.tensor_descriptor  # tile read: z (swiglu_bwd), c (residual_rmsnorm)
    out_desc: tma.tensor_descriptor  # tile written from out_bufs: dz / d / d (store)
    o_desc: tma.tensor_descriptor  # second tile written: o
    in_bufs: gl.shared_memory_descriptor
    out_bufs: gl.shared_memory_descriptor  # in_bufs itself unless PREFETCH
    o_bufs: gl.shared_memory_descriptor
    in_bars: gl.shared_memory_descriptor
    vec_ptr: gl.tensor  # γ (residual_rmsnorm)
    partials_ptr: gl.tensor  # [M, cdiv(N, BN)] fp32 row partials
    KIND: gl.constexpr
    EPI_N: gl.constexpr
    # 0: one piece at a time (load, wait, compute, store, wait for the store before the buffer
    # is reused). 1: two slots per consumer for every buffer — the next piece's load is in
    # flight while this one computes, the tile's first piece is loaded before its K loop, and
    # two pieces' stores may be outstanding.
    PREFETCH: gl.constexpr

    @triton.constexpr_function
    def __init__(
        self,
        in_desc,
        out_desc,
        o_desc,
        in_bufs,
        out_bufs,
        o_bufs,
        in_bars,
        vec_ptr,
        partials_ptr,
        KIND,
        EPI_N,
        PREFETCH,
    ):
        self.in_desc, self.out_desc, self.o_desc = in_desc, out_desc, o_desc
        self.in_bufs, self.out_bufs, self.o_bufs = in_bufs, out_bufs, o_bufs
        self.in_bars = in_bars
        self.vec_ptr, self.partials_ptr = vec_ptr, partials_ptr
        self.KIND = gl.constexpr(KIND)
        self.EPI_N = gl.constexpr(EPI_N)
        self.PREFETCH = gl.constexpr(PREFETCH)


@gluon.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    # Grouped ordering, as the generated kernels: GROUP_M row-tiles advance together along N.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@gluon.jit
def _producer(m, e, WHICH: gl.constexpr):
    """One warp: TMA loads of every k-step of every tile this program owns, in tile order.
    (``e`` and ``WHICH`` unused: worker partitions take the same arguments as the consumer.)"""
    BM: gl.constexpr = m.BM
    BN: gl.constexpr = m.BN
    BK: gl.constexpr = m.BK
    STAGES: gl.constexpr = m.STAGES
    nbytes: gl.constexpr = m.a_desc.block_type.nbytes + m.b_desc.block_type.nbytes
    num_pid_m = gl.cdiv(m.M, BM)
    num_pid_n = gl.cdiv(m.N, BN)
    k_tiles = gl.cdiv(m.K, BK)
    q = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, m.NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, m.GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        for kk in range(k_tiles):
            slot = q % STAGES
            phase = (q // STAGES) & 1
            # Slots start free: the first pass waits on the phase before the barrier's first.
            mbarrier.wait(m.empty_bars.index(slot), phase ^ 1)
            bar = m.ready_bars.index(slot)
            mbarrier.expect(bar, nbytes)
            _tma_load(m.a_desc, [off_m, kk * BK], bar, m.a_bufs.index(slot))
            if m.B_NK:
                _tma_load(m.b_desc, [off_n, kk * BK], bar, m.b_bufs.index(slot))
            else:
                _tma_load(m.b_desc, [kk * BK, off_n], bar, m.b_bufs.index(slot))
            q += 1


@gluon.jit
def _split_columns(acc, PIECES: gl.constexpr):
    """Split a [BM, BN] register tile into PIECES column blocks (no data movement: each thread of a
    wgmma accumulator holds columns in every block)."""
    pieces = (acc,)
    for _ in gl.static_range(PIECES.bit_length() - 1):
        halves = ()
        for j in gl.static_range(len(pieces)):
            x = pieces[j]
            halves += x.reshape([x.shape[0], 2, x.shape[1] // 2]).permute(0, 2, 1).split()
        pieces = halves
    return pieces


@gluon.jit
def _epilogue_store(acc, e, C: gl.constexpr, off_m, off_n, pid_n, M, N, count):
    """D = acc: each EPI_N-column piece through the consumer's buffer and out by TMA."""
    BN: gl.constexpr = acc.shape[1]
    pieces = _split_columns(acc, BN // e.EPI_N)
    buf = e.in_bufs.index(C)
    for s in gl.static_range(len(pieces)):
        tma.store_wait(0)  # the previous piece's store has read the buffer
        buf.store(pieces[s].to(e.out_desc.dtype))
        fence_async_shared()
        _tma_store(e.out_desc, [off_m, off_n + s * e.EPI_N], buf)
    return count


@gluon.jit
def _in_slot(e, C: gl.constexpr, count):
    """The buffer slot of consumer C's ``count``-th epilogue input piece (and of its outputs)."""
    if e.PREFETCH:
        return C * 2 + count % 2
    else:
        return C


@gluon.jit
def _in_col(e, off_n, s: gl.constexpr):
    """The first column of piece ``s``'s input tile (z is interleaved: twice the output's)."""
    if e.KIND == "swiglu_bwd":
        return 2 * (off_n + s * e.EPI_N)
    else:
        return off_n + s * e.EPI_N


@gluon.jit
def _load_piece(e, C: gl.constexpr, count, off_m, col):
    """Issue the TMA load of consumer C's ``count``-th input piece into its slot."""
    slot = _in_slot(e, C, count)
    bar = e.in_bars.index(slot)
    mbarrier.expect(bar, e.in_desc.block_type.nbytes)
    _tma_load(e.in_desc, [off_m, col], bar, e.in_bufs.index(slot))


@gluon.jit
def _next_piece(e, C: gl.constexpr, count, off_m, off_n, s: gl.constexpr, PIECES: gl.constexpr):
    """Make piece ``s`` (the ``count``-th) ready to read; returns its slot. One at a time: wait
    for the last stores to leave the buffers, load, wait. PREFETCH: issue piece s + 1's load
    (piece 0's was issued before the K loop), wait for piece s's, and for the stores two pieces
    back (the slot this piece's outputs will use; two stores a piece)."""
    slot = _in_slot(e, C, count)
    if e.PREFETCH:
        if s + 1 < PIECES:
            _load_piece(e, C, count + 1, off_m, _in_col(e, off_n, s + 1))
        mbarrier.wait(e.in_bars.index(slot), (count // 2) & 1)
        tma.store_wait(2)
    else:
        tma.store_wait(0)
        _load_piece(e, C, count, off_m, _in_col(e, off_n, s))
        mbarrier.wait(e.in_bars.index(slot), count & 1)
    return slot


@gluon.jit
def _epilogue_swiglu_bwd(acc, e, C: gl.constexpr, off_m, off_n, pid_n, M, N, count):
    """da = acc; from the saved interleaved z = [g, u]: dz = [da·u·σ(g)(1 + g(1 − σ(g))),
    da·silu(g)] interleaved, o = silu(g)·u, and this tile's Σ_k (g dg + u du) per row."""
    BM: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    EPI_N: gl.constexpr = e.EPI_N
    PIECES: gl.constexpr = BN // EPI_N
    pieces = _split_columns(acc, PIECES)
    zdz = gl.sum(gl.zeros_like(pieces[0]), axis=1)
    # z read so that each thread holds the (g, u) pairs of the da columns it holds.
    z_layout: gl.constexpr = gl.join(pieces[0], pieces[0]).reshape([BM, 2 * EPI_N]).type.layout
    for s in gl.static_range(PIECES):
        da = pieces[s]
        col = off_n + s * EPI_N
        slot = _next_piece(e, C, count, off_m, off_n, s, PIECES)
        count += 1
        z = e.in_bufs.index(slot).load(z_layout)
        g, u = z.reshape([BM, EPI_N, 2]).split()
        g = gl.convert_layout(g.to(gl.float32), da.type.layout)
        u = gl.convert_layout(u.to(gl.float32), da.type.layout)
        sig = 1.0 / (1.0 + gl.exp(-g))
        silu = g * sig
        du = da * silu
        dg = da * u * sig * (1.0 + g * (1.0 - sig))
        zdz += gl.sum(g * dg + u * du, axis=1)
        dz = gl.join(dg.to(e.out_desc.dtype), du.to(e.out_desc.dtype))
        out_buf = e.out_bufs.index(slot)
        o_buf = e.o_bufs.index(slot)
        out_buf.store(dz.reshape([BM, 2 * EPI_N]))
        o_buf.store((silu * u).to(e.o_desc.dtype))
        fence_async_shared()
        _tma_store(e.out_desc, [off_m, 2 * col], out_buf)
        _tma_store(e.o_desc, [off_m, col], o_buf)
    _store_row_partials(e, zdz, off_m, pid_n, M, N, BM, BN)
    return count


@gluon.jit
def _epilogue_residual_rmsnorm(acc, e, C: gl.constexpr, off_m, off_n, pid_n, M, N, count):
    """d = acc + c; o = d ⊙ γ; this tile's Σ_k d² per row."""
    BM: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    EPI_N: gl.constexpr = e.EPI_N
    PIECES: gl.constexpr = BN // EPI_N
    pieces = _split_columns(acc, PIECES)
    ss = gl.sum(gl.zeros_like(pieces[0]), axis=1)
    for s in gl.static_range(PIECES):
        ab = pieces[s]
        col = off_n + s * EPI_N
        slot = _next_piece(e, C, count, off_m, off_n, s, PIECES)
        count += 1
        d = ab + e.in_bufs.index(slot).load(ab.type.layout).to(gl.float32)
        cols = col + gl.arange(0, EPI_N, layout=gl.SliceLayout(0, ab.type.layout))
        gamma = gl.load(e.vec_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
        d_out = d.to(e.out_desc.dtype)
        ss += gl.sum(d * d, axis=1)
        out_buf = e.out_bufs.index(slot)
        o_buf = e.o_bufs.index(slot)
        out_buf.store(d_out)
        o_buf.store((d_out.to(gl.float32) * gl.expand_dims(gamma, 0)).to(e.o_desc.dtype))
        fence_async_shared()
        _tma_store(e.out_desc, [off_m, col], out_buf)
        _tma_store(e.o_desc, [off_m, col], o_buf)
    _store_row_partials(e, ss, off_m, pid_n, M, N, BM, BN)
    return count


@gluon.jit
def _store_row_partials(e, values, off_m, pid_n, M, N, BM: gl.constexpr, BN: gl.constexpr):
    rows = off_m + gl.arange(0, BM, layout=values.type.layout)
    gl.store(e.partials_ptr + rows * gl.cdiv(N, BN) + pid_n, values, mask=rows < M)


@gluon.jit
def _consumer(m, e, C: gl.constexpr):
    """One warpgroup: tiles C, C + 2, ... of this program — K loop on wgmma, then epilogue."""
    BM: gl.constexpr = m.BM
    BN: gl.constexpr = m.BN
    BK: gl.constexpr = m.BK
    STAGES: gl.constexpr = m.STAGES
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    num_pid_m = gl.cdiv(m.M, BM)
    num_pid_n = gl.cdiv(m.N, BN)
    k_tiles = gl.cdiv(m.K, BK)
    pid = gl.program_id(0)
    count = 0  # epilogue loads waited on so far (the phase of this consumer's in_bar)
    num_tiles = num_pid_m * num_pid_n
    first = (
        pid + C * m.NUM_PROGRAMS if C < m.CONSUMERS else num_tiles
    )  # CONSUMERS = 1: no ping-pong
    for tile_id in range(first, num_tiles, m.CONSUMERS * m.NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, m.GROUP_M)
        q = ((tile_id - pid) // m.NUM_PROGRAMS) * k_tiles  # this tile's first ring position
        i = (tile_id - first) // (m.CONSUMERS * m.NUM_PROGRAMS)  # this consumer's tiles so far
        if m.CONSUMERS == 2:
            # Take turns: start this tile's K loop once the other consumer has issued the
            # previous tile's. Besides making the K loops alternate (ping-pong), this keeps every
            # ready-barrier wait at most one phase behind: a parity wait cannot tell phase n from
            # n + 2, and without the turn the second consumer, a whole tile ahead in the ring,
            # passed its waits on stale phases and consumed slots before they were loaded.
            if C == 1:
                mbarrier.wait(m.order_bars.index(0), i & 1)
            else:
                mbarrier.wait(m.order_bars.index(1), (i - 1) & 1, pred=i > 0)
        off_m = pid_m * BM
        off_n = pid_n * BN
        if e.PREFETCH and e.KIND != "store":
            # the tile's first epilogue piece arrives while its K loop runs
            _load_piece(e, C, count, off_m, _in_col(e, off_n, 0))
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        prev_slot = 0
        for kk in range(k_tiles):
            slot = q % STAGES
            mbarrier.wait(m.ready_bars.index(slot), (q // STAGES) & 1)
            b = m.b_bufs.index(slot).permute((1, 0)) if m.B_NK else m.b_bufs.index(slot)
            acc = warpgroup_mma(m.a_bufs.index(slot), b, acc, is_async=True)
            # One wgmma in flight: the previous k-step's has finished reading its slot.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(m.empty_bars.index(prev_slot), pred=kk > 0)
            prev_slot = slot
            q += 1
        if m.CONSUMERS == 2:
            mbarrier.arrive(m.order_bars.index(C))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(m.empty_bars.index(prev_slot))
        if e.KIND == "swiglu_bwd":
            count = _epilogue_swiglu_bwd(acc, e, C, off_m, off_n, pid_n, m.M, m.N, count)
        elif e.KIND == "residual_rmsnorm":
            count = _epilogue_residual_rmsnorm(acc, e, C, off_m, off_n, pid_n, m.M, m.N, count)
        else:
            count = _epilogue_store(acc, e, C, off_m, off_n, pid_n, m.M, m.N, count)
    tma.store_wait(0)


@gluon.jit
def pingpong_kernel(
    a_desc,
    b_desc,
    in_desc,
    out_desc,
    o_desc,
    vec_ptr,
    partials_ptr,
    M,
    N,
    K,
    NUM_PROGRAMS: gl.constexpr,
    GROUP_M: gl.constexpr,
    B_NK: gl.constexpr,
    STAGES: gl.constexpr,
    KIND: gl.constexpr,
    EPI_N: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    CONSUMERS: gl.constexpr,
    PREFETCH: gl.constexpr,
):
    a_bufs = gl.allocate_shared_memory(
        a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout
    )
    b_bufs = gl.allocate_shared_memory(
        b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout
    )
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
    order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(order_bars.index(i), count=1)
    # Each consumer's epilogue buffers: in (read, then overwritten with the first output) and o;
    # PREFETCH: two slots of each, and the first output in buffers of its own (out).
    SLOTS: gl.constexpr = CONSUMERS * (2 if PREFETCH else 1)
    in_bufs = gl.allocate_shared_memory(
        in_desc.dtype, [SLOTS] + in_desc.block_type.shape, in_desc.layout
    )
    if KIND == "store":
        o_bufs = in_bufs
        out_bufs = in_bufs
    else:
        o_bufs = gl.allocate_shared_memory(
            o_desc.dtype, [SLOTS] + o_desc.block_type.shape, o_desc.layout
        )
        if PREFETCH:
            out_bufs = gl.allocate_shared_memory(
                out_desc.dtype, [SLOTS] + out_desc.block_type.shape, out_desc.layout
            )
        else:
            out_bufs = in_bufs
    in_bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(in_bars.index(i), count=1)

    m = Mainloop(
        a_desc,
        b_desc,
        a_bufs,
        b_bufs,
        ready_bars,
        empty_bars,
        order_bars,
        M,
        N,
        K,
        NUM_PROGRAMS,
        GROUP_M,
        B_NK,
        CONSUMERS,
    )
    e = Epilogue(
        in_desc,
        out_desc,
        o_desc,
        in_bufs,
        out_bufs,
        o_bufs,
        in_bars,
        vec_ptr,
        partials_ptr,
        KIND,
        EPI_N,
        PREFETCH,
    )
    if CONSUMERS == 2:
        gl.warp_specialize(
            [(_consumer, (m, e, 0)), (_consumer, (m, e, 1)), (_producer, (m, e, 0))],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
    else:
        # One consumer warpgroup (the default partition) and the producer warp: 8 warps, so two
        # programs fit an SM where shared memory allows — the warp scheduler then overlaps one's
        # epilogue with the other's K loop.
        gl.warp_specialize([(_consumer, (m, e, 0)), (_producer, (m, e, 0))], [1], [PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------
# Host side


def _desc(t, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(t.dtype))
    return TensorDescriptor.from_tensor(t, block, layout)


def _gl_dtype(dtype):
    import torch

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[
        dtype
    ]


def launch(
    kind,
    a,
    b,
    *,
    b_nk,
    z=None,
    c=None,
    gamma=None,
    BM=128,
    BN=128,
    BK=64,
    STAGES=4,
    EPI_N=64,
    GROUP_M=8,
    CONSUMERS=2,
    PER_SM=1,
    PREFETCH=0,
    num_programs=None,
    warmup=False,
):
    """Run one ping-pong kernel; returns its outputs as a dict (``partials`` unreduced)."""
    import torch

    M, K = a.shape
    N = b.shape[0] if b_nk else b.shape[1]
    dev = a.device
    num_tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    if num_programs is None:
        num_programs = min(PER_SM * _num_sms(dev), num_tiles)
    partials = torch.empty(M, triton.cdiv(N, BN), device=dev, dtype=torch.float32)
    out = {}
    if kind == "store":
        d = torch.empty(M, N, device=dev, dtype=a.dtype)
        in_desc = out_desc = o_desc = _desc(d, [BM, EPI_N])
        vec = partials
        out["d"] = d
    elif kind == "swiglu_bwd":
        dz = torch.empty(M, 2 * N, device=dev, dtype=a.dtype)
        o = torch.empty(M, N, device=dev, dtype=a.dtype)
        in_desc = _desc(z, [BM, 2 * EPI_N])
        out_desc = _desc(dz, [BM, 2 * EPI_N])
        o_desc = _desc(o, [BM, EPI_N])
        vec = partials
        out.update(dz=dz, o=o, partials=partials)
    elif kind == "residual_rmsnorm":
        d = torch.empty(M, N, device=dev, dtype=a.dtype)
        o = torch.empty(M, N, device=dev, dtype=a.dtype)
        in_desc = _desc(c, [BM, EPI_N])
        out_desc = _desc(d, [BM, EPI_N])
        o_desc = _desc(o, [BM, EPI_N])
        vec = gamma
        out.update(d=d, o=o, partials=partials)
    else:
        raise ValueError(f"unknown epilogue {kind!r}; one of {EPILOGUES}")
    a_desc = _desc(a, [BM, BK])
    b_desc = _desc(b, [BN, BK] if b_nk else [BK, BN])
    args = (a_desc, b_desc, in_desc, out_desc, o_desc, vec, partials, M, N, K)
    meta = dict(
        NUM_PROGRAMS=num_programs,
        GROUP_M=GROUP_M,
        B_NK=b_nk,
        STAGES=STAGES,
        KIND=kind,
        EPI_N=EPI_N,
        # Registers: 12 warps × 168 = consumers 232 each + producer 40 (two consumers); 8 warps ×
        # 128 = consumer 232 + producer 24 (one consumer: half an SM's registers, two programs fit).
        PRODUCER_REGS=40 if CONSUMERS == 2 else 24,
        CONSUMER_REGS=232,
        CONSUMERS=CONSUMERS,
        PREFETCH=PREFETCH,
        num_warps=4,
        maxnreg=168 if CONSUMERS == 2 else 128,
    )
    if warmup:
        return pingpong_kernel.warmup(*args, grid=(num_programs,), **meta)
    pingpong_kernel[(num_programs,)](*args, **meta)
    return out


def _num_sms(device):
    import torch

    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------------------------------------
# References (the blocks' semantics, fp32 from the bf16 inputs)


def reference(kind, a, b, *, b_nk, z=None, c=None, gamma=None):
    ab = a.float() @ (b.float().t() if b_nk else b.float())
    if kind == "store":
        return {"d": ab}
    if kind == "swiglu_bwd":
        g, u = z.float()[:, 0::2], z.float()[:, 1::2]
        sig = g.sigmoid()
        dg = ab * u * sig * (1 + g * (1 - sig))
        du = ab * g * sig
        dz = torch_interleave(dg, du)
        return {"dz": dz, "o": g * sig * u, "zdz": (g * dg + u * du).sum(1)}
    d = ab + c.float()
    return {"d": d, "o": d * gamma.float(), "ss": (d * d).sum(1)}


def torch_interleave(x, y):
    import torch

    return torch.stack([x, y], dim=-1).reshape(x.shape[0], -1)


def finished(kind, out):
    """The kernel's outputs with the row partials summed (what the block's aux step does)."""
    got = {k: v for k, v in out.items() if k != "partials"}
    if kind == "swiglu_bwd":
        got["zdz"] = out["partials"].sum(1)
    elif kind == "residual_rmsnorm":
        got["ss"] = out["partials"].sum(1)
    return got


def inputs(kind, M, N, K, device, seed=0):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(torch.bfloat16)

    a = randn(M, K)
    if kind == "residual_rmsnorm":
        return dict(a=a, b=randn(K, N, scale=K**-0.5), b_nk=False, c=randn(M, N), gamma=randn(N))
    kw = dict(a=a, b=randn(N, K, scale=K**-0.5), b_nk=True)
    if kind == "swiglu_bwd":
        kw["z"] = randn(M, 2 * N)
    return kw


def check(kind, M, N, K, device, **cfg):
    """Largest error of every output, relative to the reference's largest magnitude."""
    kw = inputs(kind, M, N, K, device)
    got = finished(kind, launch(kind, **kw, **cfg))
    want = reference(kind, **kw)
    errors = {}
    for name, ref in want.items():
        scale = ref.abs().max().clamp_min(1e-6)
        errors[name] = float((got[name].float() - ref).abs().max() / scale)
    return errors


# ---------------------------------------------------------------------------------------------
# Timing


def bench(sizes, configs, out_dir):
    import torch

    dev = torch.device("cuda")
    rows = []
    for size in sizes:
        M, N, K = size
        for kind, cfg in configs:
            kw = inputs(kind, M, N, K, dev)
            # Ragged, and 7 programs so each walks several tiles.
            errors = check(kind, 1000, 1024, 1000, dev, num_programs=7, **cfg)
            bt = kw["b"] if kw["b_nk"] else kw["b"].t().contiguous()
            cublas = functools.partial(torch.nn.functional.linear, kw["a"], bt)
            ours = functools.partial(launch, kind, **kw, **cfg)
            t = _interleaved({"cublas": cublas, "pingpong": ours})
            row = dict(
                kind=kind,
                size=size,
                config=cfg,
                errors=errors,
                cublas_ms=t["cublas"],
                pingpong_ms=t["pingpong"],
                ratio=t["pingpong"] / t["cublas"],
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "gluon_pingpong.json").write_text(json.dumps(rows, indent=1))
    return rows


def _interleaved(fns, rounds=5):
    """Median ms of each function, timed in alternation so clock drift hits all alike."""
    from triton.testing import do_bench

    for fn in fns.values():
        fn()
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(do_bench(fn, warmup=25, rep=100))
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}


# ---------------------------------------------------------------------------------------------
# Compiling without a GPU


def compile_only(configs):
    """Compile every config for sm_90 through a stand-in driver; one JSON line each (shared
    memory, and whether the programs per SM it asks for fit)."""
    import torch

    rows = []
    with for_target(90):
        for kind, cfg in configs:
            kw = inputs(kind, 256, 256, 256, torch.device("cpu"))
            kernel = launch(kind, **kw, **cfg, warmup=True)
            shared = kernel.metadata.shared
            row = dict(kind=kind, config=cfg, shared_bytes=shared)
            row["fits"] = fits(shared, cfg.get("PER_SM", 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# Two consumer warpgroups in one program (ping-pong), then one consumer with one or two programs
# per SM.
PINGPONG_CONFIGS = [
    ("store", dict(STAGES=4, EPI_N=64)),
    ("swiglu_bwd", dict(STAGES=4, EPI_N=32)),
    ("residual_rmsnorm", dict(STAGES=4, EPI_N=64)),
]
# Deeper rings and wider epilogue pieces for the two-consumer program (shared memory: ≤ 227 KB).
PINGPONG_SWEEP = [
    ("store", dict(STAGES=5, EPI_N=64)),
    ("swiglu_bwd", dict(STAGES=3, EPI_N=64)),
    ("swiglu_bwd", dict(STAGES=5, EPI_N=32)),
    ("residual_rmsnorm", dict(STAGES=5, EPI_N=32)),
]
# Deeper still: narrower epilogue pieces leave room for a sixth ring slot.
PINGPONG_DEEP = [
    ("store", dict(STAGES=6, EPI_N=32)),
    ("swiglu_bwd", dict(STAGES=5, EPI_N=16)),
    ("swiglu_bwd", dict(STAGES=6, EPI_N=16)),
    ("residual_rmsnorm", dict(STAGES=6, EPI_N=16)),
    ("residual_rmsnorm", dict(STAGES=6, EPI_N=32)),
]
# The epilogue prefetching (two slots of every epilogue buffer: next piece's load in flight,
# first piece loaded during the K loop, two pieces' stores outstanding).
PINGPONG_PREFETCH = [
    ("swiglu_bwd", dict(STAGES=4, EPI_N=16, PREFETCH=1)),
    ("swiglu_bwd", dict(STAGES=3, EPI_N=16, PREFETCH=1)),
    ("residual_rmsnorm", dict(STAGES=4, EPI_N=32, PREFETCH=1)),
    ("residual_rmsnorm", dict(STAGES=4, EPI_N=16, PREFETCH=1)),
]
ONE_CONSUMER = dict(CONSUMERS=1)
DEFAULT_CONFIGS = PINGPONG_CONFIGS + [
    ("store", dict(ONE_CONSUMER, STAGES=4, EPI_N=64)),
    ("store", dict(ONE_CONSUMER, STAGES=2, EPI_N=64, PER_SM=2)),
    ("store", dict(ONE_CONSUMER, BK=32, STAGES=4, EPI_N=64, PER_SM=2)),
    ("swiglu_bwd", dict(ONE_CONSUMER, STAGES=4, EPI_N=32)),
    ("swiglu_bwd", dict(ONE_CONSUMER, STAGES=2, EPI_N=32, PER_SM=2)),
    ("swiglu_bwd", dict(ONE_CONSUMER, BK=32, STAGES=4, EPI_N=32, PER_SM=2)),
    ("swiglu_bwd", dict(ONE_CONSUMER, BK=32, STAGES=5, EPI_N=32, PER_SM=2)),
    ("residual_rmsnorm", dict(ONE_CONSUMER, STAGES=2, EPI_N=64, PER_SM=2)),
    ("residual_rmsnorm", dict(ONE_CONSUMER, BK=32, STAGES=5, EPI_N=32, PER_SM=2)),
]


def check_grids(configs, shape=(1000, 1024, 1000), grids=None):
    """Every config under persistent grids from one tile per program down to many: each case in
    its own process (a kernel fault ends the CUDA context), errors or the failure printed."""
    import subprocess

    M, N, K = shape
    tiles = triton.cdiv(M, 128) * triton.cdiv(N, 128)
    ok = True
    for kind, cfg in configs:
        for programs in grids or sorted({tiles, tiles // 2, tiles // 4, 7, 1}):
            case = json.dumps([kind, cfg, programs, shape])
            try:
                r = subprocess.run(
                    [sys.executable, __file__, "--one", case],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"},
                )
            except subprocess.TimeoutExpired:
                ok = False
                print(f"{kind} {cfg} programs={programs}: TIMEOUT (hang?)", flush=True)
                continue
            tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or ["(no output)"]
            ok &= r.returncode == 0
            print(f"{kind} {cfg} programs={programs}: rc={r.returncode} {tail[0]}", flush=True)
    return ok


def _one(case):
    import torch

    kind, cfg, programs, (M, N, K) = json.loads(case)
    errors = check(kind, M, N, K, torch.device("cuda"), num_programs=programs, **cfg)
    print(json.dumps(errors))


def parse_size(text):
    """``8192`` (M = N = K) or ``MxNxK`` (e.g. ``8192x8192x2048``, a training step's shape)."""
    dims = [int(d) for d in text.lower().split("x")]
    if len(dims) not in (1, 3):
        raise ValueError(f"size {text!r}: one number or MxNxK")
    return tuple(dims * 3 if len(dims) == 1 else dims)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4096,8192", help="comma-separated N or MxNxK")
    parser.add_argument("--out", default=None)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--check-grids", action="store_true")
    parser.add_argument(
        "--grids", default="", help="--check-grids: program counts (default: several)"
    )
    parser.add_argument(
        "--configs",
        choices=["all", "pingpong", "sweep", "deep", "prefetch"],
        default="all",
        help="pingpong: two consumers only; sweep, deep: two consumers, other rings and pieces; "
        "prefetch: two consumers whose epilogues prefetch",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    named = {
        "pingpong": PINGPONG_CONFIGS,
        "sweep": PINGPONG_SWEEP,
        "deep": PINGPONG_DEEP,
        "prefetch": PINGPONG_PREFETCH,
    }
    configs = named.get(args.configs, DEFAULT_CONFIGS)
    if args.compile_only:
        return 0 if all(r["fits"] for r in compile_only(configs)) else 1
    if args.one:
        _one(args.one)
        return 0
    if args.check_grids:
        grids = [int(g) for g in args.grids.split(",") if g]
        return 0 if check_grids(configs, grids=grids or None) else 1
    bench([parse_size(s) for s in args.sizes.split(",")], configs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
