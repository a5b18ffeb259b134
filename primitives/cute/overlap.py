"""An epilogue loop for QuACK's Hopper GEMM that hides its shared-memory waits under arithmetic.

QuACK's loop (``GemmBase.epilogue``) takes an output tile's epilogue one sub-tile at a time
(64 × 32 for a 128 × 128 ping-pong tile: eight a tile). Per sub-tile it reads the sub-tile's TMA
tile loads from shared memory, fences and waits for those registers before releasing the
buffer, computes, writes the results to shared memory, fences again and passes a named barrier
before the TMA stores: two waits on shared memory with nothing to do meanwhile, and two named
barriers. Profiled on an H200, the SwiGLU backward of a Llama down projection (K = 2048) spent
39% of its epilogue's stall samples there, and its epilogue set the kernel's pace
(bench/RESULTS.md, run 2026-12-04a).

``OverlappedEpilogue`` is ``CodaEpilogue``'s loop when ``epi_overlap`` is set (``CuteConfig``):

- level 1: sub-tile i + 1's shared-memory reads are issued before sub-tile i's arithmetic, into
  a second set of registers per tile load, and fenced and released after it, so their latency
  passes under the arithmetic (run 2026-12-04b: correct, 0.7–1.2% faster where the epilogue sets
  the pace). The tile loads are issued as soon as their buffer is released, as in QuACK's loop;
  the stores are QuACK's.
- level 2: also sub-tile i's stores trail by one sub-tile. Its results are written to shared
  memory at the end of its iteration, as in QuACK's loop, but fenced, passed through the barrier
  and handed to the TMA after sub-tile i + 1's arithmetic: the writes have landed by then, the
  fence of the next tile-load release covers them, and one named barrier a sub-tile serves both
  "sub-tile i - 1 is written" and "sub-tile i's buffer is free" (the TMA warp keeps one store
  group fewer in flight before it, since i - 1's is not committed yet). Needs two store stages.

Level 2 is ``CuteConfig``'s default; ``launch.WIDE`` (128 × 192 tiles) keeps QuACK's loop, which
ran faster there (run 2026-12-04c). A step with no tile loads, a C operand or a non-TMA epilogue
keeps QuACK's loop whatever the level.
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from quack import copy_utils
from quack.epi_ops import EpiContext


class OverlappedEpilogue:
    """The overlapped epilogue loop, mixed into ``CodaEpilogue`` ahead of QuACK's classes."""

    epi_overlap = 0  # 1: sub-tile i + 1's tile loads read during sub-tile i; 2: and i's stores late

    def begin_second_registers(
        self, params, epi_smem_tensors, tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
        tile_coord_mnkl, varlen_manager, epilogue_barrier, tidx, tRS_rD_layout,
    ):  # fmt: skip
        """Give each tile load in ``tensors`` (what ``epi_begin`` returns) a second state, its
        own registers over the same shared-memory buffers."""
        context = EpiContext(
            self, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tile_coord_mnkl, varlen_manager,
            epilogue_barrier, tidx, tRS_rD_layout,
        )  # fmt: skip
        for op in self._tile_loads():
            smem = epi_smem_tensors.get(op.name)
            tensors[_second(op.name)] = op.begin(self, getattr(params, op.name), smem, context)

    def _tile_loads(self):
        return [op for op in self._epi_ops if op.is_tile_load()]

    def _begin_loop_in(self, params, epi_tensors, epi_coord, buffer: int):
        """``epi_begin_loop`` with each tile load's registers taken from ``buffer`` (0 or 1)."""
        if buffer:
            epi_tensors = dict(epi_tensors)
            for op in self._tile_loads():
                epi_tensors[op.name] = epi_tensors[_second(op.name)]
        return self.epi_begin_loop(params, epi_tensors, epi_coord)

    @cute.jit
    def _tile_load_s2r_into(self, params, epi_tensors, stage_idx, buffer: cutlass.Constexpr[int]):
        """Copy every tile load's stage ``stage_idx`` from shared memory into register buffer
        ``buffer`` (0 or 1)."""
        for op in self._tile_loads():
            state = epi_tensors[op.name if const_expr(buffer == 0) else _second(op.name)]
            op.load_s2r(self, getattr(params, op.name), state, stage_idx)

    def epilogue(self, params, epi_smem_tensors, epi_pipeline, epi_store_pipeline, *rest):
        """QuACK's epilogue loop (``GemmBase.epilogue``), or with ``epi_overlap`` — where the
        step loads tiles by TMA, stores by TMA and has no C operand (a coda step never has one:
        its tiles are ``TileLoad`` ops) — ``_overlapped_epilogue``."""
        args = (params, epi_smem_tensors, epi_pipeline, epi_store_pipeline, *rest)
        tma_both_ways = epi_pipeline is not None and epi_store_pipeline is not None
        no_c = rest[5] is None  # tRS_rC
        if self.epi_overlap and self.epi_c_stage > 0 and tma_both_ways and no_c:
            return self._overlapped_epilogue(*args)
        return super().epilogue(*args)

    @cute.jit
    def _overlapped_epilogue(
        self, params, epi_smem_tensors, epi_pipeline, epi_store_pipeline, epi_read_state,
        epi_producer_state, epi_tile, load_acc_subtile, tRS_rD, tRS_rC, tiled_copy_t2r,
        tiled_copy_r2s, tRS_sD, tiled_copy_s2r, tSR_rC, tSR_sC, copy_D, copy_C, tile_coord_mnkl,
        varlen_manager, epilogue_barrier, tile_scheduler, tidx, is_tma_warp,
    ):  # fmt: skip
        """QuACK's epilogue loop for TMA tile loads and stores, its shared-memory reads moved
        one sub-tile earlier and, at level 2, its fences, barriers and TMA stores one sub-tile
        later (the module docstring says why and how)."""
        late_stores = const_expr(self.epi_overlap >= 2 and self.epi_stage >= 2)
        tRS_sD = tRS_sD if const_expr(copy_D is not None) else None  # noqa: N806
        aux_out_ctxs = self.epi_setup_aux_out(
            params, epi_smem_tensors, tiled_copy_r2s, tiled_copy_t2r, tile_coord_mnkl,
            varlen_manager, tidx,
        )  # fmt: skip
        epi_tile_shape = cute.zipped_divide(
            cute.make_layout(self.cta_tile_shape_mnk[:2]), epi_tile
        ).shape[1]
        order = (0, 1) if const_expr(self.epi_m_major) else (1, 0)
        epi_tile_layout = cute.make_ordered_layout(epi_tile_shape, order=order)
        epi_tile_num = cute.size(epi_tile_shape)
        num_prev_subtiles = tile_scheduler.num_tiles_executed * epi_tile_num
        epi_tensors = self.epi_begin(
            params, epi_smem_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tile_coord_mnkl,
            varlen_manager, epilogue_barrier, tidx, tRS_rD.layout,
        )  # fmt: skip
        stages = self.epi_c_stage
        load = partial(_load_tile, epi_pipeline, copy_C, is_tma_warp)
        for epi_idx in cutlass.range(min(epi_tile_num, stages), unroll=1):
            load(epi_producer_state, epi_tile_layout.get_hier_coord(epi_idx))
            epi_producer_state.advance()
        epilogue_barrier.arrive_and_wait()
        # sub-tile 0's tile loads into the first registers
        epi_pipeline.consumer_wait(epi_read_state)
        self._tile_load_s2r_into(params, epi_tensors, epi_read_state.index, 0)
        cute.arch.fence_view_async_shared()
        epi_pipeline.consumer_release(epi_read_state)
        epi_read_state.advance()
        if const_expr(stages < epi_tile_num):
            load(epi_producer_state, epi_tile_layout.get_hier_coord(stages))
            epi_producer_state.advance()
        for epi_idx in cutlass.range_constexpr(epi_tile_num):
            epi_coord = epi_tile_layout.get_hier_coord(epi_idx)
            load_acc_subtile(tRS_rD, epi_coord)
            epi_loop_tensors = self._begin_loop_in(params, epi_tensors, epi_coord, epi_idx % 2)
            if const_expr(epi_idx + 1 < epi_tile_num):  # the next sub-tile's reads, issued
                epi_pipeline.consumer_wait(epi_read_state)
                self._tile_load_s2r_into(
                    params, epi_tensors, epi_read_state.index, (epi_idx + 1) % 2
                )
            tRS_rAuxOuts = self.epi_visit_subtile(params, epi_loop_tensors, tRS_rD, tRS_rC)
            if const_expr(epi_idx + 1 < epi_tile_num):  # ... landed: release, load the next
                cute.arch.fence_view_async_shared()
                epi_pipeline.consumer_release(epi_read_state)
                epi_read_state.advance()
                if const_expr(epi_idx + 1 + stages < epi_tile_num):
                    load(epi_producer_state, epi_tile_layout.get_hier_coord(epi_idx + 1 + stages))
                    epi_producer_state.advance()
            self.epi_end_loop(
                params, epi_tensors, epi_coord, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
                tile_coord_mnkl, varlen_manager, tidx,
            )  # fmt: skip
            outs = tuple(
                self.epi_convert_aux_out(
                    i, tRS_rAuxOuts[i], None, tidx, tile_coord_mnkl, num_prev_subtiles, epi_idx
                )
                for i in range(len(aux_out_ctxs))
            )
            epi_buffer = (num_prev_subtiles + epi_idx) % self.epi_stage
            if const_expr(late_stores):
                # sub-tile i - 1's fence, barrier and TMA stores, behind sub-tile i's arithmetic
                # (the release's fence above, where there was one, fenced its writes)
                if const_expr(epi_idx > 0):
                    if const_expr(epi_idx + 1 == epi_tile_num):
                        cute.arch.fence_view_async_shared()
                    if is_tma_warp:  # i - 1 is not committed: leave one stage more in flight
                        cute.arch.cp_async_bulk_wait_group(self.epi_stage - 2, read=True)
                elif is_tma_warp:
                    epi_store_pipeline.producer_acquire()
                epilogue_barrier.arrive_and_wait()
                if const_expr(epi_idx > 0):
                    self._store_tiles(
                        epi_store_pipeline, aux_out_ctxs, copy_D, is_tma_warp,
                        (num_prev_subtiles + epi_idx - 1) % self.epi_stage,
                        epi_tile_layout.get_hier_coord(epi_idx - 1),
                    )  # fmt: skip
                self._write_tiles(tiled_copy_r2s, tRS_rD, tRS_sD, aux_out_ctxs, outs, epi_buffer)
            else:
                if is_tma_warp:
                    epi_store_pipeline.producer_acquire()
                epilogue_barrier.arrive_and_wait()
                self._write_tiles(tiled_copy_r2s, tRS_rD, tRS_sD, aux_out_ctxs, outs, epi_buffer)
                cute.arch.fence_view_async_shared()
                epilogue_barrier.arrive_and_wait()
                self._store_tiles(
                    epi_store_pipeline, aux_out_ctxs, copy_D, is_tma_warp, epi_buffer, epi_coord
                )
        if const_expr(late_stores):  # the last sub-tile's stores
            cute.arch.fence_view_async_shared()
            epilogue_barrier.arrive_and_wait()
            self._store_tiles(
                epi_store_pipeline, aux_out_ctxs, copy_D, is_tma_warp,
                (num_prev_subtiles + epi_tile_num - 1) % self.epi_stage,
                epi_tile_layout.get_hier_coord(epi_tile_num - 1),
            )  # fmt: skip
        self.epi_end(
            params, epi_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tile_coord_mnkl,
            varlen_manager, tidx,
        )  # fmt: skip
        return epi_read_state, epi_producer_state

    @cute.jit
    def _write_tiles(self, tiled_copy_r2s, tRS_rD, tRS_sD, aux_out_ctxs, outs, epi_buffer):  # noqa: N803
        """Write a sub-tile's D (``tRS_sD`` None: the step has none) and tile stores to
        shared-memory buffer ``epi_buffer``."""
        if const_expr(tRS_sD is not None):
            copy_utils.cvt_copy(tiled_copy_r2s, tRS_rD, tRS_sD[None, None, None, epi_buffer])
        for i in cutlass.range_constexpr(len(aux_out_ctxs)):
            tiled_copy_out, tRS_sOut, _ = aux_out_ctxs[i]
            cute.copy(
                tiled_copy_out,
                tiled_copy_out.retile(outs[i]).contiguous(),
                tRS_sOut[None, None, None, epi_buffer],
            )

    @cute.jit
    def _store_tiles(
        self,
        epi_store_pipeline,
        aux_out_ctxs,
        copy_D,
        is_tma_warp,
        epi_buffer,
        epi_coord,  # noqa: N803
    ):
        """The TMA warp stores shared-memory buffer ``epi_buffer`` to sub-tile ``epi_coord`` of
        D and of every tile store, as one bulk group (the caller has fenced the writes and
        passed the barrier)."""
        if is_tma_warp:
            if const_expr(copy_D is not None):
                copy_D(src_idx=epi_buffer, dst_idx=epi_coord)
            for i in cutlass.range_constexpr(len(aux_out_ctxs)):
                _, _, copy_out = aux_out_ctxs[i]
                copy_out(src_idx=epi_buffer, dst_idx=epi_coord)
            epi_store_pipeline.producer_commit()


@cute.jit
def _load_tile(epi_pipeline, copy_C, is_tma_warp, producer_state, coord):  # noqa: N803
    """The TMA warp loads the epilogue's tiles of sub-tile ``coord`` into the buffer of
    ``producer_state`` once it is free (the caller advances the state)."""
    if is_tma_warp:
        epi_pipeline.producer_acquire(producer_state)
        copy_C(src_idx=coord, producer_state=producer_state)
        epi_pipeline.producer_commit(producer_state)


def _second(name: str) -> str:
    """The key of tile load ``name``'s second registers in ``epi_tensors``."""
    return f"{name}@1"
