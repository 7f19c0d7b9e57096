"""The Hopper forward's consumer warpgroups: per tile, the key-block loop (S = Q K^T, score
modifiers, online softmax, O += P V) with its pipelines and ping-pong turns."""
from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import warpgroup
from cutlass.experimental.primitives import nvvm_wrapper as nvvm

from cute_flash.kernels.common.block_range import BlockRange, Window, visit_key_block
from cute_flash.kernels.common.constants import LOG2E
from cute_flash.kernels.common.gemm import wgmma, wgmma_issue
from cute_flash.kernels.common.gqa_fold import row_sinks
from cute_flash.kernels.common.philox import Dropout, wgmma_groups
from cute_flash.kernels.common.score_mods import Mask, ScoreMods
from cute_flash.kernels.common.softmax import OnlineSoftmax
from cute_flash.kernels.common.user_mods import ModCall
from cute_flash.kernels.sm90.barriers import FwdBarrier
from cute_flash.kernels.sm90.fwd_state import Pipes, Sm90Loop, Sm90Recipe, Sm90Scalars, Sm90Tensors, Tile
from cute_flash.kernels.sm90.pipeline import use_state
from cute_flash.kernels.sm90.scheduler import Schedule
from layouts import hopper
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.traits import ELEMENT_BYTES


class Consumer:
    """The consumer warpgroups' tiles and key-block loop (a part of `FlashFwdSm90`)."""

    @cute.jit
    def consume(self, args: Sm90Tensors, scalars: Sm90Scalars, recipe: Sm90Recipe, pipes: Pipes, sQ, sK, sV, sO,
                mma_tidx, merge=None):
        """A consumer warpgroup, per tile: its 64 rows of O and LSE (mma_tidx: the thread's
        index among the consumers)."""
        t = self.t
        bm, bn = t.block_m, t.block_n
        # warp-uniform, so the wgmma descriptors stay in uniform registers (d 128: 16 R2UR a key block less)
        consumer_wg = cute.arch.make_warp_uniform(mma_tidx // 128)
        wg = cute.make_layout(t.warpgroups, stride=128)  # A / B partitions are per warpgroup: its first thread
        # S's partition is the row warpgroup's (latent tiles: two warpgroups compute the same S)
        wg_qk = recipe.mma_qk.get_slice(wg(consumer_wg % t.row_warpgroups))
        wg_pv = recipe.mma_pv.get_slice(wg(consumer_wg))
        tSrQ = recipe.mma_qk.make_fragment_A(wg_qk.partition_A(sQ))  # (MMA, MMA_M, MMA_K) descriptors
        tSrK = recipe.mma_qk.make_fragment_B(wg_qk.partition_B(sK))  # (MMA, MMA_N, MMA_K, stages)
        sVt = lsmem.transposed_view(sV)  # (dv, bn, stages)
        tOrV = recipe.mma_pv.make_fragment_B(wg_pv.partition_B(sVt))  # (MMA, MMA_N, MMA_K, stages)
        acc_s = cute.make_rmem_tensor(wg_qk.partition_shape_C((bm, bn)), cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        tOrP = cute.make_rmem_tensor(hopper.acc_as_operand_a(acc_s).layout, self.dtype)  # ((2, 2, 2), MMA_M, MMA_K)
        acc_p = None
        if cutlass.const_expr(self.config.speculative_max and not self.config.speculative_in_place):
            acc_p = cute.make_rmem_tensor(acc_s.layout, cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        acc_o = cute.make_rmem_tensor(wg_pv.partition_shape_C((bm, t.dv)), cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        row_scale = cute.make_rmem_tensor((cute.size(lmma.acc_mn_view(acc_o).shape[0]),), cutlass.Float32)
        if cutlass.const_expr(self.config.pingpong):
            if consumer_wg == 0:  # warpgroup 0 takes the first turn
                cute.arch.barrier_arrive(barrier_id=FwdBarrier.SCHEDULER, number_of_threads=256)

        consume = functools.partial(self.consume_tile, args, scalars, recipe, pipes, tSrQ, tSrK, tOrV, acc_s, tOrP,
                                    acc_o, row_scale, sO, sV, consumer_wg, merge, acc_p)
        if cutlass.const_expr(self.config.schedule is Schedule.STREAM_K):

            def consume_share(tile, tile_idx, q_loads, kv_uses):
                cute.arch.mbarrier_wait(pipes.q_full, q_loads % 2)
                consume(tile, mma_tidx, kv_uses)

            self.for_each_share(args, scalars, consume_share)
        elif cutlass.const_expr(self.config.schedule is Schedule.CACHE_TILE):
            # The tile from the block index before Q's wait: the length load and the division
            # leave the path from Q's arrival to the first wgmma
            tile = self.cache_tile(args, scalars)
            cute.arch.mbarrier_wait(pipes.q_full, 0)
            consume(tile, mma_tidx, 0)
        elif cutlass.const_expr(self.config.schedule is Schedule.SINGLE_TILE):
            bidx, _, _ = cute.arch.block_idx()
            ctas, _, _ = cute.arch.grid_dim()
            # One trip (grid = tiles). Written without the loop, ptxas spilled 68 B at d 128 causal.
            for _ in cutlass.range(bidx, self.num_tiles(args), ctas, unroll=1):
                cute.arch.mbarrier_wait(pipes.q_full, 0)
                consume(self.announced(args, scalars, pipes), mma_tidx, 0)
        else:  # Schedule.PERSISTENT
            cute.arch.mbarrier_wait(pipes.q_full, 0)
            tiles = self.num_tiles(args)
            q_loads = cutlass.Int32(0)
            kv_uses = cutlass.Int32(0)
            tile_idx = pipes.tile_slot[0]
            while tile_idx < tiles:
                tile = self.announced(args, scalars, pipes)
                consume(tile, mma_tidx, kv_uses)
                q_loads = q_loads + 1
                kv_uses = kv_uses + tile.count
                cute.arch.mbarrier_wait(pipes.q_full, q_loads % 2)  # the next tile's index, and its Q
                tile_idx = pipes.tile_slot[0]
        if mma_tidx % 128 < 32:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sO stays until TMA has read it

    @cute.jit
    def consume_tile(self, args: Sm90Tensors, scalars: Sm90Scalars, recipe: Sm90Recipe, pipes: Pipes, tSrQ, tSrK,
                     tOrV, acc_s, tOrP, acc_o, row_scale, sO, sV, consumer_wg, merge, acc_p, tile: Tile, mma_tidx,
                     kv_uses):
        """One tile; the caller has waited for its Q (and coordinates). merge: ClusterMerge of a
        cluster-merged split, else None; acc_p: P's registers beside S (speculative_max), else None."""
        cfg, t = self.config, self.t
        bm, bn = t.block_m, t.block_n
        acc_o.fill(0.0)
        # S is fully written by its first wgmma, but a wgmma's accumulators are also its inputs:
        # without this the previous tile's S stays live around the tile loop, and at d 128 ptxas
        # then serializes every wgmma for want of registers (C7512).
        acc_s.fill(0.0)
        acc_o_mn = lmma.acc_mn_view(acc_o)
        softmax = OnlineSoftmax(cute.size(acc_o_mn.shape[0]), scalars.scale_log2, lazy=True)
        softmax.init_empty()
        slope = cutlass.Float32(0.0)
        if cutlass.const_expr(cfg.has_alibi):
            slope = args.mAlibi[tile.bidb, tile.bidh] * scalars.alibi_div
        window = Window(scalars.window_left, scalars.window_right, cfg.has_left, cfg.has_right, cfg.query_group)
        user = None
        if cutlass.const_expr(cfg.mods is not None):
            user = ModCall.make(cfg.mods, tile.bidb, tile.bidh, tile.seq, args.aux, scalars.score_premul)
        mods = ScoreMods(Mask(tile.seq.seqlen_q, tile.seq.seqlen_k, window), scalars.score_premul, slope,
                         cfg.has_softcap, cfg.has_alibi, (bm, bn), mma_tidx=mma_tidx % (128 * t.row_warpgroups),
                         user=user)
        lo, hi = BlockRange.unmasked(tile.seq, tile.m_block, bm, bn, window)
        dropout = None
        if cutlass.const_expr(cfg.has_dropout):
            dropout = Dropout.load(args.mRng, tile.bidb, tile.bidh, args.tma_mQ.shape[2], packed=True)
        loop = Sm90Loop(pipes, tSrQ, tSrK, tOrV, acc_s, tOrP, acc_o, acc_o_mn, row_scale, softmax, mods, tile.m_block,
                        lo, hi, consumer_wg, kv_uses, dropout, mma_tidx, sV, acc_p)
        if tile.count > 0:
            self.mainloop(loop, tile, recipe)
        if cutlass.const_expr(cfg.persistent):
            if tile.count == 0:
                self.release_q(loop)
        else:
            self.release_q(loop)

        # no key seen: LSE +inf, or -inf in a split's partial so that the merge gives it no weight
        lse = cute.make_rmem_tensor(softmax.row_max.layout, cutlass.Float32)
        sink_log2 = None  # the sink joins the denominator here (`Sm90FwdConfig.learnable_sink`)
        if cutlass.const_expr(cfg.learnable_sink and cfg.kvcache):
            sink_log2 = self.cache_sinks(args, recipe, tile, lse, mma_tidx)
        elif cutlass.const_expr(cfg.learnable_sink):
            sink_log2 = args.mSink[tile.bidh] * LOG2E
        softmax.finalize(acc_o_mn, lse, -cutlass.Float32.inf if cutlass.const_expr(cfg.split) else cutlass.Float32.inf,
                         sink_log2)
        if cutlass.const_expr(cfg.has_dropout):  # the kept values' 1 / P(keep), once for all of O
            acc_o.store(acc_o.load() * dropout.scale())
        if cutlass.const_expr(cfg.cluster_merge):
            self.store_cluster(acc_o_mn, lse, merge, args, recipe, tile, mma_tidx)
        elif cutlass.const_expr(cfg.split):
            self.store_split(acc_o_mn, lse, pipes.tile_slot, args, recipe, tile, mma_tidx)
        else:
            self.store(acc_o, lse, sO, args, recipe, tile, mma_tidx)

    @cute.jit
    def cache_sinks(self, args: Sm90Tensors, recipe: Sm90Recipe, tile: Tile, lse: cute.Tensor, mma_tidx):
        """KV caches: each of the thread's rows' sink (`gqa_fold.row_sinks`), its rows folded by
        the GQA fold's group (`pack_gqa`), the query fold's (`query_group`) or none; carried by
        the tile's first split (split_idx 0, in stream-K too)."""
        cfg = self.config
        group = 1
        if cutlass.const_expr(cfg.pack_gqa):
            group = tile.seq.seqlen_q  # the GQA fold's g rows of one query
        elif cutlass.const_expr(cfg.query_group > 1):
            group = cfg.query_group
        return row_sinks(args.mSink, self.acc_coords(recipe, mma_tidx), lse.layout, tile.m_block * self.t.block_m,
                         tile.bidh, group, tile.split_idx == 0)

    @cute.jit
    def mainloop(self, loop: Sm90Loop, tile: Tile, recipe: Sm90Recipe):
        """The tile's key blocks (`Tile.n_block`): the first one's S and softmax, then per block
        its S = Q K^T with the previous block's O += P V in flight, the last P V at the end."""
        count = tile.count
        stages = self.config.stages
        rescores = self.config.speculative_in_place  # a failed vote issues Q K^T again: Q and K stay till after it
        # MMAs of this function's own (recipe's only partition): wgmma sets an MMA's accumulate
        # field, state that must not escape the dynamic branch / loop it was set in.
        mma_qk, mma_pv = hopper.tiled_mma_qk(self.t), hopper.tiled_mma_pv(self.t)
        first = use_state(loop.kv_uses, stages, producer=False)
        loop.pipes.k.consumer_wait(first)
        wgmma(mma_qk, loop.acc_s, loop.tSrQ, loop.tSrK[None, None, None, first.index])
        self.release_qk(loop, first, count == 1)
        edges = self.config.has_left or self.config.has_right  # a full block's masks (`SparseRow.visit`)
        if cutlass.const_expr(tile.sparse is not None):
            if tile.sparse.is_partial(0):
                self.scores(loop, tile.n_block(0), recipe, True, True)
            else:  # a full block: no mask_mod
                self.scores(loop, tile.n_block(0), recipe, True, edges, user_mask=False)
        else:
            self.scores(loop, tile.n_block(0), recipe, True, True)
        if cutlass.const_expr(self.config.clears_v_tail):
            self.clear_v_tail(loop, first, tile.n_block(0))
        for i in cutlass.range(1, count, unroll=1):
            n_block = tile.n_block(i)
            k_read = use_state(loop.kv_uses + i, stages, producer=False)
            v_read = use_state(loop.kv_uses + i - 1, stages, producer=False)
            loop_qk, loop_pv = hopper.tiled_mma_qk(self.t), hopper.tiled_mma_pv(self.t)
            loop.pipes.k.consumer_wait(k_read)
            self.take_turn(loop)
            wgmma_issue(loop_qk, loop.acc_s, loop.tSrQ, loop.tSrK[None, None, None, k_read.index])
            loop.pipes.v.consumer_wait(v_read)
            wgmma_issue(loop_pv, loop.acc_o, loop.tOrP, loop.tOrV[None, None, None, v_read.index],
                        accumulate=True)
            self.pass_turn(loop)
            warpgroup.wait_group(1)  # S landed; P V may still run
            if cutlass.const_expr(not rescores):
                self.release_qk(loop, k_read, i == count - 1)
            visit_key_block(tile.sparse, i, n_block, loop.unmasked_lo, loop.unmasked_hi,
                            functools.partial(self.scores, loop, n_block, recipe, False, k_stage=k_read.index), edges)
            if cutlass.const_expr(rescores):
                self.release_qk(loop, k_read, i == count - 1)
            warpgroup.wait_group(0)
            loop.pipes.v.consumer_release(v_read)
            loop.softmax.rescale(loop.acc_o_mn, loop.row_scale)
            self.convert_p(loop)
        last = use_state(loop.kv_uses + count - 1, stages, producer=False)
        loop.pipes.v.consumer_wait(last)
        wgmma(mma_pv, loop.acc_o, loop.tOrP, loop.tOrV[None, None, None, last.index], accumulate=True)
        loop.pipes.v.consumer_release(last)

    @cute.jit
    def release_qk(self, loop: Sm90Loop, k_read: pipeline.PipelineState, last):
        """The warpgroup is done with this K stage (latent tiles: not before the P V that reads
        V in it), and with sQ after the tile's last block (persistent; otherwise after the tile)."""
        if cutlass.const_expr(not self.t.latent):
            loop.pipes.k.consumer_release(k_read)
        if cutlass.const_expr(self.config.persistent):
            if last:
                self.release_q(loop)

    @cute.jit
    def release_q(self, loop: Sm90Loop):
        """This thread's wgmmas are done with sQ and the tile's index: the producer may load the
        next tile's. Persistent: as soon as the tile's last S has landed, so the next Q loads
        under the last softmax, P V and epilogue (a gain on short rows, none on long ones, against
        a release after the last P V: docs/tuning/hopper-forward.md, Hopper step 9); otherwise
        after the tile (sQ then stages O)."""
        cute.arch.mbarrier_arrive(loop.pipes.q_empty)

    @cute.jit
    def clear_v_tail(self, loop: Sm90Loop, state: pipeline.PipelineState, n_block):
        """Packed batches and KV caches (`Sm90FwdConfig.clears_v_tail`): zero the rows of key
        block n_block's V stage past seqlen_k (the next sequence's rows, or a cache's unused
        ones, which P = 0 would turn into NaN if they held one), 16 bytes at a time by every
        consumer thread, before any warpgroup's P V reads the stage. Once a tile: the last key
        block is the only one a sequence's end crosses."""
        t = self.t
        bn = t.block_n
        loop.pipes.v.consumer_wait(state)
        if cutlass.const_expr(t.latent):  # V's rows are K's: the other warpgroup's Q K^T may still read them
            cute.arch.barrier(barrier_id=FwdBarrier.CLEAR_V, number_of_threads=t.num_threads)
        vec = 16 // ELEMENT_BYTES
        chunks = t.dv // vec
        sV = loop.sV[None, None, state.index]  # (bn, dv) this stage
        first_row = loop.mods.mask.seqlen_k - n_block * bn  # rows past it are not this sequence's keys
        zeros = cute.make_rmem_tensor((vec,), self.dtype)
        zeros.fill(0.0)
        for c in cutlass.range(loop.mma_tidx, (bn - first_row) * chunks, t.num_threads, unroll=1):
            row = first_row + c // chunks
            chunk = cute.local_tile(sV[row, None], (vec,), (c % chunks,))  # (vec,)
            cute.autovec_copy(zeros, chunk)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, before wgmma (async proxy) reads
        cute.arch.barrier(barrier_id=FwdBarrier.CLEAR_V, number_of_threads=t.num_threads)

    @cute.jit
    def scores(self, loop: Sm90Loop, n_block, recipe: Sm90Recipe, is_first: cutlass.Constexpr,
               masked: cutlass.Constexpr, k_stage=None, user_mask: cutlass.Constexpr = True):
        """S of key block n_block (in acc_s; K in stage k_stage) -> modifiers -> unnormalised P
        -> dropout (after the row sums: they are taken before dropout); the first block's P is
        converted here, a later one's after O is rescaled. Dropout's Philox calls run here,
        after the softmax: computed while the GEMMs run instead (they depend on the coordinates
        alone) they held 32 more registers and ran slower (docs/tuning/dropout.md, Dropout, run 4).
        user_mask False: a block-sparse full block, whose mask_mod keeps every score."""
        acc_s_mn = loop.mods.apply(recipe.mma_qk, loop.acc_s, loop.m_block, n_block, masked, user_mask)
        cfg = self.config
        # In place, masked blocks take `update`: a causal diagonal spans 2-3 of a 192-row tile's
        # key blocks, whose rows have seen few keys, and most failed warpgroup votes were theirs
        # (emulated; docs/tuning/hopper-forward.md, Hopper steps 17-18). Under a window's left
        # edge they keep speculating: given `update` they spilled 236 + 296 B (104 + 132 B
        # speculating).
        eager = is_first or not cfg.speculative_max or (cfg.speculative_in_place and masked and not cfg.has_left)
        if cutlass.const_expr(eager):
            dst_mn = None if cutlass.const_expr(loop.acc_p is None) else lmma.acc_mn_view(loop.acc_p)
            loop.softmax.update(acc_s_mn, loop.row_scale, is_first, masked or cfg.mods is not None, dst_mn=dst_mn)
        elif cutlass.const_expr(cfg.speculative_in_place):
            loop.softmax.update_speculative(
                acc_s_mn, None, loop.row_scale, masked or cfg.mods is not None,
                agree=lambda fits: nvvm.barrier_cta_red_aligned(fits, FwdBarrier.VOTE + loop.consumer_wg, "and",
                                                                thread_count=128),
                rescore=lambda: self.rescore(loop, n_block, recipe, masked, k_stage))
        else:
            loop.softmax.update_speculative(acc_s_mn, lmma.acc_mn_view(loop.acc_p), loop.row_scale,
                                            masked or cfg.mods is not None)
        if cutlass.const_expr(cfg.has_dropout):
            bm, bn = self.t.block_m, self.t.block_n
            loop.dropout.apply(recipe.mma_qk, loop.acc_s, wgmma_groups(loop.acc_s.shape), loop.mma_tidx,
                               loop.m_block * bm, n_block * bn, (bm, bn), True)
        if cutlass.const_expr(is_first):
            self.convert_p(loop)

    @cute.jit
    def rescore(self, loop: Sm90Loop, n_block, recipe: Sm90Recipe, masked: cutlass.Constexpr, k_stage):
        """S of key block n_block again, with its modifiers (speculative_in_place, whose P
        overwrote it): the warpgroup's Q K^T issued once more, waited for with the P V in
        flight."""
        wgmma(hopper.tiled_mma_qk(self.t), loop.acc_s, loop.tSrQ, loop.tSrK[None, None, None, k_stage])
        return loop.mods.apply(recipe.mma_qk, loop.acc_s, loop.m_block, n_block, masked)

    @cute.jit
    def convert_p(self, loop: Sm90Loop):
        acc_p = loop.acc_s if cutlass.const_expr(loop.acc_p is None) else loop.acc_p
        loop.tOrP.store(hopper.acc_as_operand_a(acc_p).load().to(self.dtype))

    @cute.jit
    def take_turn(self, loop: Sm90Loop):
        """Ping-pong: wait until the previous consumer warpgroup (round robin) has issued its
        GEMMs."""
        if cutlass.const_expr(self.config.pingpong):
            cute.arch.barrier(barrier_id=FwdBarrier.SCHEDULER + loop.consumer_wg, number_of_threads=256)

    @cute.jit
    def pass_turn(self, loop: Sm90Loop):
        if cutlass.const_expr(self.config.pingpong):
            nxt = (loop.consumer_wg + 1) % self.t.warpgroups
            cute.arch.barrier_arrive(barrier_id=FwdBarrier.SCHEDULER + nxt, number_of_threads=256)
