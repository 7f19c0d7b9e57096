"""Where the backward accumulates dQ in fp32, and its conversion to the input dtype.

dQaccum holds one chunk of kBlockM * kHeadDim floats per (query tile, head, batch), in *warp
order*: each warp of the dQ GEMM owns a contiguous run of the chunk, and within it, with `vec`
floats per atomic add, value i of lane l sits at (i // vec) * 32 * vec + l * vec + i % vec. So
the j-th atomic add of a warp covers 32 * vec consecutive floats: whole 128-byte lines (in
(row, col) order a warp's add touches 8 rows, half of a 32-byte sector each). vec is 4 on sm_90
(`red.global.add.v4.f32`), 1 before (no vector float reductions). A warp's run being contiguous
lets sm_90 replace its atomics by one `cp.reduce.async.bulk` of the run staged in shared
memory (BwdConfig.dq_bulk). Measured on the H200 (bf16 backward alone, `bench --sections bwd`):
(row, col) order gave a geometric mean of 0.72x SDPA FLASH over the grid, thread order with
vec 1 gave 0.98x.

The order means nothing outside the kernels: `DQConvert` reads each chunk back in the same
order (coalesced too), recovers each value's (row, col) from the same MMA partition, sums the
deterministic slices in a fixed order, scales, and writes dQ through shared memory with 128-bit
stores. flash-attn 2's seq-parallel backward pairs its atomics with a permuted copy partition
the same way.

Packed batches: sequence b's tiles start at tile cu_seqlens_q[b] // kBlockM + b, which keeps
every sequence's tiles apart (a tile never holds rows of two sequences); the buffer has
total_q // kBlockM + batch + 1 tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.seq_info import SeqInfo, query_rows
from cute_flash.kernels.tile_copy import column_predicate, copy_tile
from layouts import copy as lcopy
from layouts.dq import chunk_index, run_layout
from layouts import hopper
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.traits import ELEMENT_BYTES, BwdTraits, element_type


def first_tile(seq: SeqInfo, bidb, block_m: cutlass.Constexpr):
    """Index of sequence bidb's first dQaccum tile in a packed batch (0 when dense: the tile
    mode is per sequence there)."""
    if cutlass.const_expr(seq.sum_s_q is None):
        return 0
    return seq.sum_s_q // block_m + bidb


@cute.jit
def stage_run(acc_dq: cute.Tensor, sdQaccum: cute.Tensor, first, vec: cutlass.Constexpr, group: cutlass.Constexpr):
    """A thread's dQ values into their places in its group's run of the fp32 staging tile
    (`vec`-float stores from `first`, its first value's `chunk_index`), fenced so that a bulk
    copy (async proxy) may read them."""
    per_thread = cute.size(acc_dq)
    mine = cute.make_tensor(sdQaccum.iterator + first, run_layout(per_thread, vec, group))  # (vec, adds)
    cute.autovec_copy(cute.make_tensor(acc_dq.iterator, cute.make_layout((vec, per_thread // vec))), mine)
    cute.arch.fence_proxy("async.shared", space="cta")


@cute.jit
def bulk_add_run(chunk: cute.Tensor, sdQaccum: cute.Tensor, start, run: cutlass.Constexpr):
    """One thread's `cp.reduce.async.bulk` of sdQaccum[start : start + run] into the same floats
    of `chunk` (the TMA unit does the adds), committed as a bulk group."""
    src = sdQaccum.iterator + cute.assume(start, divby=run)
    dst = chunk.iterator + cute.assume(start, divby=run)
    cute.arch.inline_ptx("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [{$r0}], [{$r1}], {$r2};",
                         read_only_args=[dst.toint(), src.toint(), cutlass.Int32(run * 4)])
    cute.arch.cp_async_bulk_commit_group()


def tiles_of(mdQaccum: cute.Tensor, slot, bidb, bidh, varlen: cutlass.Constexpr):
    """(tiles, block_m * head_dim) chunks of one slice, batch (dense) and head: mdQaccum is
    (slices, batch, heads, tiles, chunk) dense, (slices, heads, tiles, chunk) packed."""
    if cutlass.const_expr(varlen):
        return mdQaccum[slot, bidh, None, None]
    return mdQaccum[slot, bidb, bidh, None, None]


@dataclass(frozen=True)
class DQConvertConfig:
    """The compile key of a convert variant: the backward traits (tile, warps, dQ grid)."""
    traits: BwdTraits
    even_k: bool = True
    varlen: bool = False
    dq_vec: int = 1  # as the main kernel's BwdConfig.dq_vec
    hopper: bool = False  # written by the Hopper backward: its dQ wgmma's partition, warpgroup runs

    @property
    def entry(self) -> str:
        return "varlen" if self.varlen else "dense"

    @property
    def smem_bytes(self) -> int:
        """The dQ tile in the input dtype, staged for 128-bit stores."""
        return ELEMENT_BYTES * self.traits.block_m * self.traits.head_dim

    @property
    def name(self) -> str:
        t = self.traits
        return (f"dq_convert_d{t.head_dim}_m{t.block_m}_w{t.num_warps}_{t.atom_m_dq}_{t.dtype}"
                f"{'' if self.even_k else '-k'}{'-V' if self.varlen else ''}-v{self.dq_vec}"
                f"{'-sm90' if self.hopper else ''}")


class DQConvert:
    """dQ = scale * (sum of dQaccum's slices), in the input dtype, one CTA per query tile."""

    def __init__(self, config: DQConvertConfig):
        self.config = config
        self.t = config.traits
        self.dtype = element_type(config.traits)

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: cutlass.Float32, stream):
        """mdQaccum (slices, batch, heads, tiles, block_m * kHeadDim) fp32, mdQ (batch, seqlen_q,
        heads, d)."""
        self.launch(mdQaccum, mdQ, None, scale, (cute.ceil_div(mdQ.shape[1], self.t.block_m), mdQ.shape[0],
                                                 mdQ.shape[2]), stream)

    @cute.jit
    def call_varlen(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                    max_seqlen_q: cutlass.Int32, scale: cutlass.Float32, stream):
        """mdQaccum (slices, heads, tiles, block_m * kHeadDim), mdQ (total_q, heads, d)."""
        self.launch(mdQaccum, mdQ, mCuSeqlensQ, scale,
                    (cute.ceil_div(max_seqlen_q, self.t.block_m), mCuSeqlensQ.shape[0] - 1, mdQ.shape[1]), stream)

    @cute.jit
    def launch(self, mdQaccum, mdQ, mCuSeqlensQ, scale, grid, stream):
        t = self.t
        sdQ_layout = lsmem.smem_layout_q(t)

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)], 1024]

        self.kernel(mdQaccum, mdQ, mCuSeqlensQ, scale, sdQ_layout, SharedStorage).launch(
            grid=grid, block=[t.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ, scale: cutlass.Float32,
               sdQ_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        t = self.t
        bm, d = t.block_m, t.head_dim
        varlen = self.config.varlen
        m_block, bidb, bidh = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        seq, mdQ_s, head_dim = query_rows(mdQ, bidb, bidh, mCuSeqlensQ)  # (seqlen_q, d)
        rows_q = seq.seqlen_q - m_block * bm
        if rows_q > 0:
            hopper_layout = self.config.hopper
            mma_dq = hopper.tiled_mma_dq(t) if hopper_layout else lmma.tiled_mma_grid(t, t.atom_m_dq)
            group = 128 if hopper_layout else 32
            acc_dq = cute.make_rmem_tensor(mma_dq.get_slice(tidx).partition_shape_C((bm, d)), cutlass.Float32)
            acc_dq.fill(0.0)
            tile = first_tile(seq, bidb, bm) + m_block
            for s in cutlass.range(mdQaccum.shape[0], unroll=1):  # slices in a fixed order
                chunk = tiles_of(mdQaccum, s, bidb, bidh, varlen)[tile, None]  # (block_m * kHeadDim,)
                for i in cutlass.range(cute.size(acc_dq), unroll_full=True):
                    acc_dq[i] = acc_dq[i] + chunk[chunk_index(i, tidx, cute.size(acc_dq), self.config.dq_vec, group)]
            rdQ = cute.make_fragment_like(acc_dq, self.dtype)  # (MMA, MMA_M, MMA_D)
            rdQ.store((acc_dq.load() * scale).to(self.dtype))
            storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            sdQ = storage.sdQ.get_tensor(sdQ_layout)  # (bm, d)
            if cutlass.const_expr(hopper_layout):
                cute.autovec_copy(rdQ, mma_dq.get_slice(tidx).partition_C(sdQ))
            else:
                smem_copy = lcopy.smem_tiled_copy_c(t, mma_dq).get_slice(tidx)
                cute.copy(smem_copy, smem_copy.retile(rdQ), smem_copy.partition_D(sdQ))
            cute.arch.barrier()
            gmem_tiled_copy = lcopy.gmem_tiled_copy_o(t)
            gmem_thr_copy = gmem_tiled_copy.get_slice(tidx)
            tdQsdQ = gmem_thr_copy.partition_S(sdQ)  # (CPY, CPY_M, CPY_K)
            tdQrdQ = cute.make_fragment_like(tdQsdQ, self.dtype)
            cute.copy(gmem_tiled_copy, tdQsdQ, tdQrdQ)
            tdQcdQ = gmem_thr_copy.partition_D(cute.make_identity_tensor((bm, d)))  # (CPY, CPY_M, CPY_K)
            gdQ = cute.local_tile(mdQ_s, (bm, d), (m_block, 0))  # (bm, d)
            copy_tile(gmem_tiled_copy, tdQrdQ, gmem_thr_copy.partition_D(gdQ), tdQcdQ,
                      column_predicate(tdQcdQ, head_dim), rows_q, True, self.config.even_k, False)
