"""The CuTe DSL side of the second epilogue backend: QuACK's Hopper GEMM with a generated epilogue.

A module that ``cute.emit`` generates defines one class, ``Epilogue(CodaEpilogue, GemmSm90)``:
its ``_epi_ops`` name the QuACK epilogue ops the step needs (tile loads and stores through TMA,
per-row and per-column vectors, per-tile partial sums, the bounds of the output) and its
``epi_visit_subtile`` computes the step's epilogue one register fragment at a time. This module is
what such a class stands on, plus the math the generated expressions call (``F``). It imports the
CuTe DSL and QuACK, so only code that has chosen this backend imports it.

QuACK's GEMM (``quack.gemm_sm90.GemmSm90``) is persistent and warp-specialized: a producer warp
loads A/B tiles by TMA, and two consumer warpgroups take output tiles in turn (ping-pong), so one
consumer's epilogue — its tile loads, math and stores — runs while the other's K loop keeps the
tensor cores busy. That overlap is what the Triton kernels cannot express, and why a traffic-heavy
epilogue costs less here.
"""

from __future__ import annotations

import math
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.utils import LayoutEnum
from quack import copy_utils
from quack.epi_composable import ComposableEpiMixin
from quack.epi_ops import (
    ColVecLoad,
    ColVecReduce,
    RowVecLoad,
    RowVecReduce,
    Scalar,
    TileLoad,
    TileStore,
)
from quack.gemm_sm90 import GemmSm90
from quack.layout_utils import permute_gated_Cregs_b16
from quack.rounding import RoundingMode
from quack.sm90_utils import partition_for_epilogue

from .overlap import OverlappedEpilogue

__all__ = [
    "COORDS",
    "F",
    "HALF_WIDTH",
    "ColVecLoad",
    "ColVecReduce",
    "CodaEpilogue",
    "GemmSm90",
    "RowVecLoad",
    "RowVecReduce",
    "Scalar",
    "TileLoad",
    "TypedTileStore",
]

COORDS = "__coords"  # the key of the fragment's tile coordinates in ``epi_loop_tensors``


def HALF_WIDTH(gemm, epi_tile):  # noqa: N802 - named like the constant it is used as
    """The epilogue tile of a store half the accumulator's width (``epi_tile_fn`` of QuACK's
    tile ops): the same rows, half the columns."""
    if isinstance(epi_tile[1], cute.Layout):
        return (epi_tile[0], cute.recast_layout(2, 1, epi_tile[1]))
    return (epi_tile[0], epi_tile[1] // 2)


class TypedTileStore(TileStore):
    """QuACK's TMA tile store with its own element type (QuACK sizes every store's buffer by one
    aux dtype; a coda epilogue may store bfloat16 values next to packed pairs). With
    ``epi_tile_fn=HALF_WIDTH`` it stores a tensor half the accumulator's width, one value per
    accumulator column pair, as QuACK's gated GEMM stores its activation."""

    @property
    def half(self) -> bool:
        return self.epi_tile_fn is not None

    def _dtype_attr(self) -> str:
        return f"_store_dtype_{self.name}"

    def _layout_attr(self) -> str:
        return f"_store_layout_{self.name}"

    def to_params(self, gemm, args):
        tensor = getattr(args, self.name)
        setattr(gemm, self._dtype_attr(), tensor.element_type)
        setattr(gemm, self._layout_attr(), LayoutEnum.from_tensor(tensor))
        return super().to_params(gemm, args)

    def smem_struct_field(self, gemm, params):
        layout = getattr(params, self._smem_layout_key())
        dtype = getattr(gemm, self._dtype_attr())
        return (
            f"s_{self.name}",
            cute.struct.Align[
                cute.struct.MemRange[dtype, cute.cosize(layout)], gemm.buffer_align_bytes
            ],
        )

    def dtype(self, gemm):
        return getattr(gemm, self._dtype_attr())

    def layout(self, gemm):
        return getattr(gemm, self._layout_attr())


class CodaEpilogue(OverlappedEpilogue, ComposableEpiMixin):
    """Epilogue plumbing shared by every generated class: any number of tile stores (returned by
    ``epi_visit_subtile`` in ``_epi_ops`` order), the coordinates of each fragment element in
    its output tile when ``uses_coords`` (reductions must not count elements past the edges),
    the shapes of the epilogue's pipelines and sub-tiles, and with ``epi_overlap`` the loop of
    ``overlap.OverlappedEpilogue``."""

    uses_coords = False
    epi_stages = 0  # 0: QuACK's stage split; n: n tile-store and n tile-load stages (below)
    epi_loads = 0  # 0: as epi_stages says; n: n tile-load stages, the tile stores QuACK's two
    epi_n = 0  # 0: QuACK's epilogue sub-tile; n: sub-tiles n columns wide (below)

    @classmethod
    def _compute_tile_shape_or_override(
        cls, cta_tile_shape_mnk, atom_layout_mnk, element_type=None, epi_tile_override=None
    ):
        """QuACK's epilogue sub-tile (64 × 32 for a 128 × 128 ping-pong tile: eight sub-tiles,
        each paying a shared-memory fence and two named barriers before its TMA stores), or with
        ``epi_n`` sub-tiles of its rows and ``epi_n`` columns — fewer, larger sub-tiles, each
        stage of the epilogue's pipelines that much larger."""
        tile = super()._compute_tile_shape_or_override(
            cta_tile_shape_mnk, atom_layout_mnk, element_type, epi_tile_override
        )
        if not cls.epi_n or epi_tile_override is not None:
            return tile
        return (tile[0], math.gcd(cls.epi_n, cute.size(cta_tile_shape_mnk, mode=[1])))

    @classmethod
    def _compute_stages(
        cls, cta_tile_shape_mnk, epi_tile, a_dtype, b_dtype, d_dtype, c_dtype, epilogue_args,
        smem_capacity, occupancy, warp_shape_mnk=None,
    ):  # fmt: skip
        """QuACK's split of shared memory between the A/B pipeline and the epilogue, unless
        ``epi_stages`` or ``epi_loads`` ask for other epilogue pipelines. QuACK gives the A/B
        pipeline every stage that fits after two epilogue stages and the leftovers to the tile
        stores: the SwiGLU backward of a Llama down projection (dz as D, a as a second store, g
        and u loaded) gets five A/B stages, four of tile stores and two of tile loads — the
        split of the hand-written QuACK kernel it was measured against. With ``epi_stages`` = n,
        the tile stores and tile loads get n stages each (the stores also what is left over) and
        the A/B pipeline what remains; with ``epi_loads`` = n the tile loads get n stages and
        the stores QuACK's base of two (and what is left over) — for that step, four tile loads
        leave the A/B pipeline its five stages where ``epi_stages`` = 4 takes one. Either way,
        QuACK's split where fewer than three A/B stages would remain; tuning times the
        candidates. For that step ``epi_stages`` = 4 was slower (0.534 against 0.503 ms at
        8192 × 8192 × 2048, bench/RESULTS.md run 2026-12-03h)."""
        default = super()._compute_stages(
            cta_tile_shape_mnk, epi_tile, a_dtype, b_dtype, d_dtype, c_dtype, epilogue_args,
            smem_capacity, occupancy, warp_shape_mnk,
        )  # fmt: skip
        if not cls.epi_stages and not cls.epi_loads:
            return default
        smem = cls.epi_smem_bytes(epilogue_args, cta_tile_shape_mnk, epi_tile, warp_shape_mnk)
        elems = cute.size(cute.shape(epi_tile))
        store_bytes = (elems * d_dtype.width // 8 if d_dtype is not None else 0) + smem.d_stage
        load_bytes = (elems * c_dtype.width // 8 if c_dtype is not None else 0) + smem.c_stage
        base = 4 if epi_tile[1] <= 16 else 2  # QuACK's store stages before the leftovers
        stores = cls.epi_stages or base
        loads = (cls.epi_loads or cls.epi_stages) if load_bytes else 0
        epi_bytes = smem.unstaged + store_bytes * stores + load_bytes * loads
        tile_m, tile_n, tile_k = cta_tile_shape_mnk
        ab_bytes = (tile_m * a_dtype.width + tile_n * b_dtype.width) * tile_k // 8
        remaining = smem_capacity // occupancy - 1024 - epi_bytes  # 1 KB: QuACK's barriers
        ab_stage = remaining // ab_bytes
        if ab_stage < 3:
            return default
        extra = (remaining - ab_stage * ab_bytes) // store_bytes if store_bytes else 0
        return ab_stage, stores + extra, loads

    def epi_to_underlying_arguments(self, args, *, loc=None, ip=None):
        self.rounding_mode = RoundingMode.RN
        return self.EpilogueParams(**self._epi_ops_to_params_dict(args))

    def _stores(self):
        return [op for op in self._epi_ops if isinstance(op, TypedTileStore)]

    def epi_setup_aux_out(
        self, params, epi_smem_tensors, tiled_copy_r2s, tiled_copy_t2r, tile_coord_mnkl,
        varlen_manager, tidx,
    ):  # fmt: skip
        contexts = []
        for op in self._stores():
            smem = epi_smem_tensors[op.name]
            epi_tile = getattr(params, op._epi_tile_key())
            atom = copy_utils.get_smem_store_atom(
                op.dtype(self),
                transpose=op.layout(self) != LayoutEnum.ROW_MAJOR,
                major_mode_size=cute.size(epi_tile, mode=[1]) // self.atom_layout_mnk[1],
            )
            tiled_copy = cute.make_tiled_copy_S(atom, tiled_copy_r2s)
            partitioned = tiled_copy.get_slice(tidx).partition_D(smem)
            tile_m, tile_n = self.cta_tile_shape_mnk[:2]
            copy_out, _, _ = self.epilog_gmem_copy_and_partition(
                getattr(params, op._tma_atom_key()),
                varlen_manager.offset_batch_epi(getattr(params, op.name), tile_coord_mnkl[3]),
                (tile_m, tile_n // 2) if op.half else (tile_m, tile_n),
                epi_tile,
                smem,
                tile_coord_mnkl,
            )
            contexts.append((tiled_copy, partitioned, copy_out))
        return tuple(contexts)

    @cute.jit
    def epi_convert_aux_out(
        self, output_idx: cutlass.Constexpr[int], tRS_rAuxOut, sr_seed, tidx, tile_coord_mnkl,
        num_prev_subtiles, epi_idx,
    ):  # fmt: skip
        op = self._stores()[output_idx]
        out = tRS_rAuxOut.to(op.dtype(self))
        if const_expr(op.half):
            # pairs' results sit in alternate registers of a quad's lanes; the 16-bit shared
            # memory store (stmatrix) wants them adjacent (QuACK's gated GEMM does the same)
            permute_gated_Cregs_b16(out)
        return out

    @cute.jit
    def epi_begin(
        self, params, epi_smem_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
        tile_coord_mnkl, varlen_manager, epilogue_barrier, tidx, tRS_rD_layout=None,
    ):  # fmt: skip
        tensors = ComposableEpiMixin.epi_begin(
            self, params, epi_smem_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
            tile_coord_mnkl, varlen_manager, epilogue_barrier, tidx, tRS_rD_layout,
        )  # fmt: skip
        if const_expr(self.uses_coords):
            partition = partial(
                partition_for_epilogue,
                epi_tile=epi_tile,
                tiled_copy=tiled_copy_t2r if tiled_copy_t2r is not None else tiled_copy_r2s,
                tidx=tidx,
                reference_src=tiled_copy_t2r is None,
            )
            tile_m, tile_n = self.cta_tile_shape_mnk[:2]
            coords = partition(cute.make_identity_tensor((tile_m, tile_n)))
            origin = (tile_coord_mnkl[0] * tile_m, tile_coord_mnkl[1] * tile_n)
            tensors[COORDS] = (coords, origin, (tile_m, tile_n))
        if const_expr(self.epi_overlap):
            self.begin_second_registers(
                params, epi_smem_tensors, tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
                tile_coord_mnkl, varlen_manager, epilogue_barrier, tidx, tRS_rD_layout,
            )  # fmt: skip
        return tensors

    def epi_begin_loop(self, params, epi_tensors, epi_coord):
        loop = ComposableEpiMixin.epi_begin_loop(self, params, epi_tensors, epi_coord)
        if const_expr(self.uses_coords):
            coords, origin, tile = epi_tensors[COORDS]
            loop[COORDS] = (coords[None, None, None, epi_coord[0], epi_coord[1]], origin, tile)
        return loop


def _fast(fn):
    """``fn`` with the DSL's fast-math flag, as a static method of ``F``."""
    return staticmethod(lambda x: fn(x, fastmath=True))


class F:
    """The expression language's functions on fp32 scalars, as generated code calls them."""

    exp = _fast(cute.math.exp)
    log = _fast(cute.math.log)
    tanh = _fast(cute.math.tanh)
    sqrt = _fast(cute.math.sqrt)
    rsqrt = _fast(cute.math.rsqrt)
    erf = staticmethod(cute.math.erf)
    abs = staticmethod(cute.math.absf)

    @staticmethod
    def sigmoid(x):
        """1 / (1 + 2^(−x·log2 e)) with the hardware's approximate reciprocal (``rcp.approx``,
        as QuACK's activations and Triton's fast division; ``1.0 / y`` would compile to the
        correctly rounded ``rcp.rn``, several instructions more per element — in the SwiGLU
        backward, whose epilogue must fit beside a K = 2048 mainloop, that showed)."""
        return cute.arch.rcp_approx(1.0 + cute.math.exp2(x * (-math.log2(math.e)), fastmath=True))

    @staticmethod
    def silu(x):
        return x * F.sigmoid(x)

    @staticmethod
    def min(a, b):
        return cute.arch.fmin(Float32(a), Float32(b))

    @staticmethod
    def max(a, b):
        return cute.arch.fmax(Float32(a), Float32(b))

    @staticmethod
    def where(cond, a, b):
        return Float32(cutlass.select_(cond, Float32(a), Float32(b)))

    @staticmethod
    def inside_m(coords, i, m_bound):
        """Whether fragment element ``i`` lies in one of the output's ``m_bound`` rows."""
        local, origin, _ = coords
        return origin[0] + local[i][0] < m_bound

    @staticmethod
    def inside_n(coords, i, n_bound):
        """Whether fragment element ``i`` lies in one of the output's ``n_bound`` columns."""
        local, origin, _ = coords
        return origin[1] + local[i][1] < n_bound

    @staticmethod
    def tile_inside_m(coords, m_bound):
        """Whether every row of this output tile is one of the output's ``m_bound`` rows."""
        _, origin, tile = coords
        return origin[0] + tile[0] <= m_bound

    @staticmethod
    def tile_inside_n(coords, n_bound):
        """Whether every column of this output tile is one of the output's ``n_bound``."""
        _, origin, tile = coords
        return origin[1] + tile[1] <= n_bound
