"""The Hopper forward's producer warp: Q and K / V tile loads by TMA into the mbarrier pipelines,
and each tile's announcement to the consumers."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from cute_flash.kernels.common.seq_info import clamp
from cute_flash.kernels.sm90.fwd_state import KV_MULTICAST_CTAS, Pipes, Sm90Recipe, Sm90Scalars, Sm90Tensors, Tile
from cute_flash.kernels.sm90.pipeline import tma_rows, use_state
from cute_flash.kernels.sm90.scheduler import Schedule


class Producer:
    """Warp 0's loads and announcements (a part of `FlashFwdSm90`)."""

    @cute.jit
    def produce(self, args: Sm90Tensors, scalars: Sm90Scalars, recipe: Sm90Recipe, pipes: Pipes, sQ, sK, sV):
        """Warp 0, per tile: K[last], Q (once the consumers are done with the previous tile's),
        V[last], then K[n] and V[n] for n = last - 1 .. first, each into its pipeline's next
        free stage (a TMA copy is issued by the whole warp: it elects one lane itself). Q's
        arrival also announces the tile (`announce`). Persistent: the next tile is claimed from
        the counter as this one starts (the atomic's latency hides behind the loads); past the
        last tile, the index `tiles` tells the consumers to stop, and the CTA that finishes last
        zeroes the counter for the next launch. With kv_multicast the tiles go in a static
        stride instead, which keeps a cluster's two CTAs on one head (the counter untouched)."""
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        heads = args.tma_mQ.shape[2]
        if cutlass.const_expr(self.config.schedule is Schedule.STREAM_K):
            self.for_each_share(args, scalars, lambda tile, tile_idx, q_loads, kv_uses: self.produce_tile(
                args, recipe, pipes, sQ, sK, sV, tile, tile_idx, heads, q_loads, kv_uses))
        elif cutlass.const_expr(self.config.schedule is Schedule.CACHE_TILE):
            self.produce_tile(args, recipe, pipes, sQ, sK, sV, self.cache_tile(args, scalars), bidx, heads, 0, 0)
        elif cutlass.const_expr(self.config.schedule is Schedule.SINGLE_TILE):
            self.produce_tile(args, recipe, pipes, sQ, sK, sV, self.tile(args, scalars, bidx), bidx, heads, 0, 0)
        else:  # Schedule.PERSISTENT
            tiles = self.num_tiles(args)
            q_loads = cutlass.Int32(0)
            kv_uses = cutlass.Int32(0)
            tile_idx = cutlass.Int32(bidx)
            while tile_idx < tiles:
                claimed = cutlass.Int32(0)  # one claim per CTA: lane 0's, shuffled to the warp once needed
                if cutlass.const_expr(not self.config.kv_multicast):
                    if cute.arch.lane_idx() == 0:
                        claimed = cute.arch.atomic_add(args.mTileCounter.iterator, cutlass.Int32(1), sem="relaxed",
                                                       scope="gpu")
                tile = self.tile(args, scalars, tile_idx)
                self.produce_tile(args, recipe, pipes, sQ, sK, sV, tile, tile_idx, heads, q_loads, kv_uses)
                q_loads = q_loads + 1
                kv_uses = kv_uses + tile.count
                if cutlass.const_expr(self.config.kv_multicast):
                    # a static stride keeps the cluster's two CTAs on one head's neighbouring
                    # query blocks (ctas even, tiles of one length: nothing to balance)
                    tile_idx = tile_idx + ctas
                else:
                    tile_idx = ctas + cute.arch.shuffle_sync(claimed, 0)
            self.announce(pipes, tiles, None, 0, q_loads)  # every CTA ran at least one tile: ctas <= tiles
            if cutlass.const_expr(self.config.kv_multicast):
                return
            with cute.arch.elect_one():
                finished = cute.arch.atomic_add(args.mTileCounter.iterator + 1, cutlass.Int32(1), sem="acq_rel",
                                                scope="gpu")
                if finished == ctas - 1:
                    args.mTileCounter[0] = cutlass.Int32(0)
                    args.mTileCounter[1] = cutlass.Int32(0)

    @cute.jit
    def announce(self, pipes: Pipes, tile_idx, tile, q_bytes: cutlass.Constexpr, q_loads):
        """Once the consumers are done with the previous tile's Q, write the tile's index and
        coordinates (tile None: only the index, past the last tile) where the consumers read
        them (KV caches: nowhere, their consumers take the tile from the block index and, under
        stream-K, the tile's index in its loop), and
        arrive on Q's full barrier, expecting q_bytes of Q's TMA (0: no load follows, the
        arrival alone completes the phase)."""
        if q_loads > 0:
            cute.arch.mbarrier_wait(pipes.q_empty, (q_loads - 1) % 2)
        with cute.arch.elect_one():
            if cutlass.const_expr(not self.config.kvcache):
                pipes.tile_slot[0] = tile_idx
                if cutlass.const_expr(tile is not None):
                    pipes.tile_slot[1] = tile.m_block
                    pipes.tile_slot[2] = tile.bidh
                    pipes.tile_slot[3] = tile.bidb
                    if cutlass.const_expr(tile.sparse is not None):  # the consumers' counts, not reloaded
                        pipes.tile_slot[4] = tile.sparse.partial
                        pipes.tile_slot[5] = tile.sparse.full
            if cutlass.const_expr(q_bytes > 0):
                cute.arch.mbarrier_arrive_and_expect_tx(pipes.q_full, q_bytes)
            else:
                cute.arch.mbarrier_arrive(pipes.q_full)

    @cute.jit
    def produce_tile(self, args: Sm90Tensors, recipe: Sm90Recipe, pipes: Pipes, sQ, sK, sV, tile: Tile, tile_idx,
                     heads, q_loads, kv_uses):
        """A tile with no key block (a causal row past every key, a window beyond the keys)
        still loads Q: its announcement travels with it. Paged caches: each key block's source
        lies in its page (`page_source`)."""
        bm, bn, d, stages = self.t.block_m, self.t.block_n, self.t.head_dim, self.config.stages
        bidh_kv = tile.bidh // (heads // args.tma_mK.shape[2])
        kv_bidb = tile.bidb
        if cutlass.const_expr(self.config.paged):
            kv_bidb = 0  # page 0 stands in: only the stages' side of its partition is used
        gQ = cute.local_tile(tma_rows(args.tma_mQ, tile.seq.sum_s_q, tile.bidh, tile.bidb), (bm, d),
                             (tile.m_block, 0))  # (bm, d)
        gK = cute.local_tile(tma_rows(args.tma_mK, tile.seq.sum_s_k, bidh_kv, kv_bidb), (bn, d),
                             (None, 0))  # (bn, d, n_blocks)
        latent = self.t.latent  # V lies in K's stages: no V loads
        one = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(recipe.tma_q, 0, one, cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))  # (TMA,), (TMA,)
        kv_rank, kv_ctas, kv_mask = 0, one, None
        if cutlass.const_expr(self.config.kv_multicast):  # this CTA's half of each block, into both CTAs
            kv_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            kv_ctas = cute.make_layout(KV_MULTICAST_CTAS)
            kv_mask = cutlass.Int16((1 << KV_MULTICAST_CTAS) - 1)  # a DSL integer, as the copy asks
        tKsK, tKgK = cpasync.tma_partition(recipe.tma_k, kv_rank, kv_ctas, cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))  # (TMA, stages), (TMA, n_blocks)
        tVsV, tVgV = None, None
        if cutlass.const_expr(not latent):
            gV = cute.local_tile(tma_rows(args.tma_mV, tile.seq.sum_s_k, bidh_kv, kv_bidb), (bn, self.t.dv),
                                 (None, 0))  # (bn, dv, n_blocks)
            tVsV, tVgV = cpasync.tma_partition(recipe.tma_v, kv_rank, kv_ctas, cute.group_modes(sV, 0, 2),
                                               cute.group_modes(gV, 0, 2))  # (TMA, stages), (TMA, n_blocks)
        if tile.count == 0:
            self.load_q(recipe, pipes, tQgQ, tQsQ, tile, tile_idx, q_loads)
        for i in cutlass.range(tile.count, unroll=1):
            n_block = tile.n_block(i)
            write = use_state(kv_uses + i, stages, producer=True)
            v_src = None
            if cutlass.const_expr(self.config.paged):
                k_src = self.page_source(args, recipe.tma_k, args.tma_mK, sK, bidh_kv, tile.bidb, n_block)  # (TMA,)
                if cutlass.const_expr(not latent):
                    v_src = self.page_source(args, recipe.tma_v, args.tma_mV, sV, bidh_kv, tile.bidb, n_block,
                                             self.t.dv)  # (TMA,)
            else:
                k_src = tKgK[None, n_block]  # (TMA,)
                if cutlass.const_expr(not latent):
                    v_src = tVgV[None, n_block]  # (TMA,)
            pipes.k.producer_acquire(write)
            cute.copy(recipe.tma_k, k_src, tKsK[None, write.index], tma_bar_ptr=pipes.k.producer_get_barrier(write),
                      mcast_mask=kv_mask)
            if i == 0:
                self.load_q(recipe, pipes, tQgQ, tQsQ, tile, tile_idx, q_loads)
            if cutlass.const_expr(not latent):
                pipes.v.producer_acquire(write)
                cute.copy(recipe.tma_v, v_src, tVsV[None, write.index],
                          tma_bar_ptr=pipes.v.producer_get_barrier(write), mcast_mask=kv_mask)

    @cute.jit
    def page_source(self, args: Sm90Tensors, tma_atom, tma_mX: cute.Tensor, sX: cute.Tensor, bidh_kv, bidb,
                    n_block, cols: cutlass.Constexpr = None):
        """Paged keys (a cache's or a packed batch's): key block n_block's TMA source, (TMA,),
        inside its page: table entry n_block * bn // page_size of sequence bidb, clamped into
        the pages (a bad id reads some page, never outside them). page_size is a multiple of bn
        (the host checks), so no block crosses a page. cols: the tile's head dim (V's `dv`;
        default the head dim)."""
        bn, d = self.t.block_n, self.t.head_dim
        if cutlass.const_expr(cols is not None):
            d = cols
        page_size = tma_mX.shape[0]
        row = n_block * bn
        entry = row // page_size  # the block's page in the sequence's table row
        page = clamp(self.block_table(args)[bidb, entry], 0, tma_mX.shape[3] - 1)
        gX = cute.local_tile(tma_mX[None, None, bidh_kv, page], (bn, d), (None, 0))  # (bn, d, page_size / bn)
        _, tXgX = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                        cute.group_modes(gX, 0, 2))  # (TMA, page_size / bn)
        return tXgX[None, (row - entry * page_size) // bn]

    @staticmethod
    def block_table(args: Sm90Tensors) -> cute.Tensor:
        """Paged keys' (batch, max_blocks) int32 block table: the KV cache's or the packed batch's."""
        return args.varlen.mBlockTable if args.cache is None else args.cache.mBlockTable

    @cute.jit
    def load_q(self, recipe: Sm90Recipe, pipes: Pipes, tQgQ, tQsQ, tile: Tile, tile_idx, q_loads):
        self.announce(pipes, tile_idx, tile, cute.size_in_bytes(self.dtype, recipe.sQ_layout), q_loads)
        cute.copy(recipe.tma_q, tQgQ, tQsQ, tma_bar_ptr=pipes.q_full)
