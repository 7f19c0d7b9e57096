"""The Hopper forward's epilogue: O and LSE out of the accumulators, through shared memory and a
TMA store, a row-predicated copy (packed batches), or the split-KV partials and merge."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from cute_flash.kernels.common.seq_info import head_rows
from cute_flash.kernels.common.split_kv import ClusterMerge, SplitKV
from cute_flash.kernels.sm90.barriers import FwdBarrier
from cute_flash.kernels.sm90.fwd_state import MergeRows, Sm90Recipe, Sm90Tensors, Tile
from cute_flash.kernels.sm90.pipeline import copy_rows
from layouts import hopper
from layouts import mma as lmma


class Epilogue:
    """O and LSE out of a consumer warpgroup (a part of `FlashFwdSm90`)."""

    @cute.jit
    def store(self, acc_o: cute.Tensor, lse: cute.Tensor, sO: cute.Tensor, args: Sm90Tensors, recipe: Sm90Recipe,
              tile: Tile, mma_tidx):
        """O through shared memory: each consumer warpgroup writes its 64 rows into its rows of
        sO, which lie in swizzle atoms of their own (so, in Q's tile, no other warpgroup's last
        Q K^T reads them), once the previous tile's TMA store has read them; one of its warps
        then stores them with TMA, which drops rows past seqlen_q and columns past the tensor's
        head dim (packed batches: `copy_o_rows`). One thread of each quad writes its rows' LSE.
        Latent tiles: the two warpgroups of the 64 rows write their halves of the columns into
        Q's tile, once both are done reading Q."""
        bm, d = self.t.block_m, self.t.dv_wg
        wg = mma_tidx // 128
        wg_row, wg_col = wg % self.t.row_warpgroups, wg // self.t.row_warpgroups  # the PV MMA's warpgroup order
        store_warp = mma_tidx % 128 < 32
        rO = cute.make_rmem_tensor(acc_o.layout, self.dtype)  # (MMA, MMA_M, MMA_N)
        rO.store(acc_o.load().to(self.dtype))
        if store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        if cutlass.const_expr(self.t.latent):
            cute.arch.barrier(barrier_id=FwdBarrier.EPILOGUE, number_of_threads=self.t.num_threads)
        else:
            cute.arch.barrier(barrier_id=FwdBarrier.EPILOGUE + wg, number_of_threads=128)
        tOsO = recipe.mma_pv.get_slice(mma_tidx).partition_C(sO)  # (MMA, MMA_M, MMA_N)
        cute.autovec_copy(rO, tOsO)
        cute.arch.fence_view_async_shared()  # the generic-proxy writes, before TMA (async proxy) reads them
        cute.arch.barrier(barrier_id=FwdBarrier.EPILOGUE + wg, number_of_threads=128)
        if cutlass.const_expr(args.varlen is not None):
            self.copy_o_rows(sO, args.varlen.mO, tile, wg, mma_tidx % 128)
        elif store_warp:
            sO_wg = cute.local_tile(sO, (hopper.WGMMA_M, d), (wg_row, wg_col))  # (64, dv_wg) this warpgroup's
            gO = cute.local_tile(args.tma_mO[None, None, tile.bidh, tile.bidb], (hopper.WGMMA_M, d),
                                 (tile.m_block * self.t.row_warpgroups + wg_row, wg_col))  # (64, dv_wg)
            tOsO_tma, tOgO = cpasync.tma_partition(recipe.tma_o, 0, cute.make_layout(1),
                                                   cute.group_modes(sO_wg, 0, 2),
                                                   cute.group_modes(gO, 0, 2))  # (TMA,), (TMA,)
            cute.copy(recipe.tma_o, tOsO_tma, tOgO)
            cute.arch.cp_async_bulk_commit_group()
        rows_q = tile.seq.seqlen_q - tile.m_block * bm
        tOcO_mn = self.acc_coords(recipe, mma_tidx)  # (rows, cols) coordinates
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = tOcO_mn[r, 0][0]
            if row < rows_q and tOcO_mn[0, 0][1] == 0:
                if cutlass.const_expr(args.varlen is None):
                    args.mLSE[tile.bidb, tile.bidh, tile.m_block * bm + row] = lse[r]
                else:
                    args.mLSE[tile.bidh, tile.seq.sum_s_q + tile.m_block * bm + row] = lse[r]

    @cute.jit
    def store_split(self, acc_o_mn: cute.Tensor, lse: cute.Tensor, tile_slot: cute.Tensor, args: Sm90Tensors,
                    recipe: Sm90Recipe, tile: Tile, mma_tidx):
        """Split-KV: this split's normalised fp32 O and its LSE straight from the accumulators (a
        decode tile has few real rows), then the tile's last split CTA to arrive merges every
        split's partials into O and LSE (`split_kv.SplitKV`, the SM80 kernel's code; its consumer
        threads synchronise on named barrier FwdBarrier.SPLIT, which the producer warps, done after
        their tiles, never reach). tile_slot (4,) int32, which no KV-cache launch announces in,
        holds the arrival rank: a stream-K CTA's next Q may already be loading into sQ."""
        t = self.t
        split = args.cache.split
        m_blocks = cute.ceil_div(self.rows_q(args), t.block_m)
        kv = SplitKV.make(split.mOaccum, split.mLSEaccum, split.mCounters, tile.split_idx, tile.splits,
                          (tile.m_block, tile.bidb, tile.bidh, args.tma_mQ.shape[2]), t, m_blocks, FwdBarrier.SPLIT)
        rows = self.merge_rows(args, recipe, tile, mma_tidx)
        kv.store_partial(acc_o_mn, lse, rows.tOcO_mn, tile.m_block, rows.rows_q)
        kv.merge(rows.mO, rows.mLSE, tile_slot, tile.m_block, rows.rows_q, mma_tidx)

    @cute.jit
    def store_cluster(self, acc_o_mn: cute.Tensor, lse: cute.Tensor, merge: ClusterMerge, args: Sm90Tensors,
                      recipe: Sm90Recipe, tile: Tile, mma_tidx):
        """Split-KV in a cluster: this split's normalised fp32 O and LSE into its own shared
        memory, then cluster rank 0 merges every split's (`split_kv.ClusterMerge`). K's and V's
        stages hold them: every wgmma of the tile has completed, and the producer loads no
        more."""
        rows = self.merge_rows(args, recipe, tile, mma_tidx)
        merge.store_partial(acc_o_mn, lse, rows.tOcO_mn)
        row0 = tile.m_block * self.t.block_m
        merge.merge(cute.domain_offset((row0, 0), rows.mO), cute.domain_offset((row0,), rows.mLSE),
                    cutlass.min(rows.rows_q, self.t.block_m), mma_tidx)

    def acc_coords(self, recipe: Sm90Recipe, mma_tidx) -> cute.Tensor:
        """(rows, cols) tile coordinates of the thread's O accumulators, in their (row, col)
        view (`acc_mn_view`): which rows a thread's LSE, stores and merges are."""
        cO = cute.make_identity_tensor((self.t.block_m, self.t.dv))
        return lmma.acc_mn_view(recipe.mma_pv.get_slice(mma_tidx).partition_C(cO))

    def merge_rows(self, args: Sm90Tensors, recipe: Sm90Recipe, tile: Tile, mma_tidx) -> "MergeRows":
        """What both split-KV merges read: the thread's accumulator coordinates, the tile's
        real query rows, and the head's O and LSE rows."""
        return MergeRows(self.acc_coords(recipe, mma_tidx),
                         tile.seq.seqlen_q - tile.m_block * self.t.block_m,
                         head_rows(args.cache.split.mO, tile.seq, tile.bidb, tile.bidh),
                         head_rows(args.mLSE, tile.seq, tile.bidb, tile.bidh))

    @cute.jit
    def copy_o_rows(self, sO: cute.Tensor, mO: cute.Tensor, tile: Tile, wg, wg_tidx):
        """Packed batches: warpgroup wg's 64 rows of O from sO into mO (total_q, heads, dv), 16
        bytes a copy, leaving out rows past the sequence's end (the next sequence's) and columns
        past mO's head dim (a multiple of 8)."""
        row0 = tile.m_block * self.t.block_m + wg * hopper.WGMMA_M  # this warpgroup's first row
        gO = head_rows(mO, tile.seq, tile.bidb, tile.bidh)  # (seqlen_q, dv) this head
        copy_rows(sO, wg * hopper.WGMMA_M, gO, row0, tile.seq.seqlen_q - row0, mO.shape[2], wg_tidx, self.t.dv)
