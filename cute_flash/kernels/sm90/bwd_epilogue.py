"""The Hopper backward's epilogue (a part of `FlashBwdSm90`): dK and dV out of the consumer
warpgroups' accumulators, through sK / sV, by TMA stores or (packed batches) row-predicated
copies."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from cute_flash.kernels.common.score_mods import BwdScalars
from cute_flash.kernels.sm90.barriers import BwdBarrier
from cute_flash.kernels.sm90.bwd_state import KeyTile, Sm90BwdRecipe, Sm90BwdSmem, Sm90BwdTensors, Sm90BwdVarlen
from cute_flash.kernels.sm90.pipeline import copy_rows
from layouts import hopper
from layouts import smem as lsmem


class BwdEpilogue:
    """dK and dV out of a consumer warpgroup."""

    @cute.jit
    def store_dkv(self, acc_dk: cute.Tensor, acc_dv: cute.Tensor, scalars: BwdScalars, recipe: Sm90BwdRecipe,
                  args: Sm90BwdTensors, smem: Sm90BwdSmem, tile: KeyTile, mma_tidx):
        """dK (times the softmax scale) and dV into this warpgroup's part of sK and sV (its rows;
        above d 128 its columns, or its 48 rows from dK^T / dV^T on the 96-key tiles) once both
        warpgroups are done reading them, then TMA stores of them (TMA drops rows past seqlen_k
        and columns past the tensors' head dim; packed batches: row-predicated copies)."""
        wg_idx = cute.arch.make_warp_uniform(mma_tidx // 128)
        for j in cutlass.range(cute.size(acc_dk), unroll_full=True):
            acc_dk[j] = acc_dk[j] * scalars.softmax_scale
        cute.arch.barrier(barrier_id=BwdBarrier.KV_DONE, number_of_threads=128 * self.wgs)
        for acc, dst, mma in ((acc_dk, smem.sK, recipe.mma_dkv), (acc_dv, smem.sV, recipe.mma_dv)):
            r = cute.make_rmem_tensor(acc.layout, self.dtype)  # (MMA, MMA_M, MMA_N)
            r.store(acc.load().to(self.dtype))
            if cutlass.const_expr(self.keys_on_n):  # (cols, bn) accumulators: the tile's transposed view
                dst = lsmem.transposed_view(dst)
            cute.autovec_copy(r, mma.get_slice(mma_tidx).partition_C(dst))
        cute.arch.fence_view_async_shared()  # the generic-proxy writes, before TMA (async proxy) reads them
        if cutlass.const_expr(self.split):
            # each warpgroup wrote half of both tiles: warpgroup 0 stores dK, 1 dV
            cute.arch.barrier(barrier_id=BwdBarrier.STORE, number_of_threads=128 * self.wgs)
            self.store_split(recipe, args, smem, tile, wg_idx, mma_tidx % 128)
        else:
            self.store_own_rows(recipe, args, smem, tile, wg_idx, mma_tidx)

    @cute.jit
    def store_own_rows(self, recipe: Sm90BwdRecipe, args: Sm90BwdTensors, smem: Sm90BwdSmem, tile: KeyTile, wg_idx,
                       mma_tidx):
        """Up to d 128: this warpgroup's 64 rows of dK and dV, once its own writes are in, by one
        warp's TMA stores (packed batches: `store_dkv_rows`)."""
        cute.arch.barrier(barrier_id=BwdBarrier.STORE + wg_idx, number_of_threads=128)
        if cutlass.const_expr(args.varlen is not None):
            self.store_dkv_rows(smem, args.varlen, tile, wg_idx, mma_tidx % 128)
        elif mma_tidx % 128 < 32:
            for atom, src, dst in ((recipe.tma_dk, smem.sK, args.tma_mdK), (recipe.tma_dv, smem.sV, args.tma_mdV)):
                s_wg = cute.local_tile(src, (hopper.WGMMA_M, cute.size(src, mode=[1])),
                                       (wg_idx, 0))  # (64, d) or (64, dv): this warpgroup's rows
                self.tma_store(atom, s_wg, dst, tile, tile.n_block * self.wgs + wg_idx)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory outlives the bulk reads

    @cute.jit
    def store_split(self, recipe: Sm90BwdRecipe, args: Sm90BwdTensors, smem: Sm90BwdSmem, tile: KeyTile, wg_idx,
                    wg_tidx):
        """Above d 128 (both warpgroups' halves of the tiles): warpgroup 0 stores the whole dK tile
        from sK, warpgroup 1 dV from sV, by TMA (its first warp) or, packed, by `copy_rows`."""
        if cutlass.const_expr(args.varlen is not None):
            row0 = tile.n_block * self.t.block_n
            for w, (src, mX) in enumerate(((smem.sK, args.varlen.mdK), (smem.sV, args.varlen.mdV))):
                if wg_idx == w:
                    g = cute.domain_offset((tile.seq.sum_s_k, 0), mX[None, tile.bidh, None])  # (seqlen_k, d) this head
                    for start in cutlass.range_constexpr(0, self.t.block_n, hopper.WGMMA_M):  # 64 rows a pass
                        rows = tile.seq.seqlen_k - row0 - start
                        if cutlass.const_expr(self.t.block_n - start < hopper.WGMMA_M):  # a last pass of fewer
                            rows = cutlass.min(rows, self.t.block_n - start)
                        copy_rows(src, start, g, row0 + start, rows, mX.shape[2], wg_tidx, cute.size(src, mode=[1]))
        elif wg_tidx < 32:
            for w, (atom, src, dst) in enumerate(((recipe.tma_dk, smem.sK, args.tma_mdK),
                                                  (recipe.tma_dv, smem.sV, args.tma_mdV))):
                if wg_idx == w:
                    self.tma_store(atom, src, dst, tile, tile.n_block)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory outlives the bulk reads

    @cute.jit
    def tma_store(self, atom, s: cute.Tensor, mX: cute.Tensor, tile: KeyTile, block):
        """One TMA store of the (rows, d) or (rows, dv) shared-memory tile `s` (64 rows, or a
        96-key tile's) into row block `block` of mX's rows of this (head, batch)."""
        g = cute.local_tile(mX[None, None, tile.bidh, tile.bidb], (cute.size(s, mode=[0]), cute.size(s, mode=[1])),
                            (block, 0))  # (rows, d) or (rows, dv)
        tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                           cute.group_modes(g, 0, 2))  # (TMA,), (TMA,)
        cute.copy(atom, tXsX, tXgX)

    @cute.jit
    def store_dkv_rows(self, smem: Sm90BwdSmem, varlen: Sm90BwdVarlen, tile: KeyTile, wg_idx, wg_tidx):
        """Packed batches: warpgroup wg_idx's 64 rows of dK and dV from sK / sV into mdK / mdV
        (total_k, heads, d), 16 bytes a copy, leaving out rows past the sequence's keys (the next
        sequence's) and columns past the tensors' head dim (a multiple of 8)."""
        row0 = tile.n_block * self.t.block_n + wg_idx * hopper.WGMMA_M  # this warpgroup's first key
        for src, mX in ((smem.sK, varlen.mdK), (smem.sV, varlen.mdV)):
            g = cute.domain_offset((tile.seq.sum_s_k, 0), mX[None, tile.bidh, None])  # (seqlen_k, d) this head
            copy_rows(src, wg_idx * hopper.WGMMA_M, g, row0, tile.seq.seqlen_k - row0, mX.shape[2], wg_tidx,
                      cute.size(src, mode=[1]))
