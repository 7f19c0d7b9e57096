"""Where the Hopper forward's CTAs find their work tiles: the schedules (`Schedule`) and the
tile arithmetic each one uses."""
from __future__ import annotations

from enum import Enum

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.block_range import BlockRange, Window
from cute_flash.kernels.common.seq_info import SeqInfo
from cute_flash.kernels.common.split_kv import StreamSplit
from cute_flash.kernels.sm90.fwd_state import Pipes, Sm90Scalars, Sm90Tensors, Tile


class Schedule(Enum):
    """How a launch's CTAs find their tiles (`Sm90FwdConfig.schedule`)."""
    SINGLE_TILE = "single tile"  # a CTA a tile, from its block index through `tile` (dense; packed batches over
                                 # max_seqlen_q's query blocks); the producer announces it with Q (`announced`)
    PERSISTENT = "persistent"    # a CTA an SM looping over tiles claimed from a counter, or in a static stride
                                 # under K / V multicast; announced with each tile's Q
    CACHE_TILE = "cache tile"    # KV caches: tile and split from the 3-D block index (`cache_tile`)
    STREAM_K = "stream-K"        # KV caches: the grid's CTAs share every tile's key blocks (`for_each_share`)


class TileScheduler:
    """The tile arithmetic of every `Schedule` (a part of `FlashFwdSm90`)."""

    def num_tiles(self, args: Sm90Tensors):
        """Work tiles: (batch, head, query block) tiles, times the splits of a split launch (a
        stream-K launch counts tiles alone: its CTAs are `Sm90Split.num_splits`); a packed
        batch's are its list's (`VarlenTiles`)."""
        if cutlass.const_expr(args.varlen is not None):
            return args.varlen.tiles.ctas()
        tiles = cute.ceil_div(self.rows_q(args), self.t.block_m) * args.tma_mQ.shape[2] * self.batch(args)
        if cutlass.const_expr(self.config.split and not self.config.stream_k):
            tiles = tiles * args.cache.split.num_splits
        return tiles

    @staticmethod
    def rows_q(args: Sm90Tensors):
        """Query rows the grid covers per (batch, head): seqlen_q (dense batches and KV caches)."""
        return args.tma_mQ.shape[0]

    @staticmethod
    def batch(args: Sm90Tensors):
        return args.tma_mQ.shape[3]

    @cute.jit
    def tile(self, args: Sm90Tensors, scalars: Sm90Scalars, tile_idx) -> Tile:
        """Work tile tile_idx. The (batch, head) pairs (heads fastest, so the query heads of
        one K / V head are neighbours) go in sections of `section_heads`; within a section the
        last query block of every pair comes first, then the one before, and so on: tiles in
        decreasing length under a causal mask, while the K / V the CTAs in flight read stay
        those of one section (the host sizes it for L2). section_heads 1: one pair's blocks,
        last first, then the next pair's. (KV caches take theirs from the block index:
        `cache_tile`, or stream-K's `stream_tile`; packed batches from their list, `VarlenTiles`.)"""
        t = self.t
        if cutlass.const_expr(args.varlen is not None):
            bidb, m_block, bidh = args.varlen.tiles.at(tile_idx)
            return self.tile_at(args, scalars, m_block, bidh, bidb)
        heads = args.tma_mQ.shape[2]
        pairs = heads * self.batch(args)
        m_blocks = cute.ceil_div(self.rows_q(args), t.block_m)
        section = tile_idx // (scalars.section_heads * m_blocks)
        first_pair = section * scalars.section_heads
        in_section = cutlass.min(scalars.section_heads, pairs - first_pair)
        r = tile_idx - first_pair * m_blocks
        pair = first_pair + r % in_section
        return self.tile_at(args, scalars, m_blocks - 1 - r // in_section, pair % heads, pair // heads)

    @cute.jit
    def cache_tile(self, args: Sm90Tensors, scalars: Sm90Scalars) -> Tile:
        """KV caches: the CTA's tile from its 3-D block index (split fastest, then query block;
        head; batch), one division where `tile` takes six. A tile's splits are neighbours, so
        they run together and the last to finish merges soon after the first."""
        bx, bidh, bidb = cute.arch.block_idx()
        split_idx, m_block = 0, bx
        if cutlass.const_expr(self.config.split):
            m_block = bx // args.cache.split.num_splits
            split_idx = bx - m_block * args.cache.split.num_splits
        return self.tile_at(args, scalars, m_block, bidh, bidb, split_idx)

    def stream_tiles(self, args: Sm90Tensors) -> StreamSplit:
        """Stream-K: the launch's tiles and the CTAs sharing them."""
        return StreamSplit(self.num_tiles(args), args.cache.split.num_splits)

    @cute.jit
    def stream_tile(self, args: Sm90Tensors, scalars: Sm90Scalars, stream: StreamSplit, cta, tile_idx) -> Tile:
        """Stream-K: CTA cta's share of tile tile_idx, the tiles numbered as the arrival counters
        are (query block fastest, then head, then batch; `SplitKV.make`)."""
        m_blocks = cute.ceil_div(self.rows_q(args), self.t.block_m)
        heads = args.tma_mQ.shape[2]
        pair = tile_idx // m_blocks
        first, splits = stream.splits_of(tile_idx)
        return self.tile_at(args, scalars, tile_idx - pair * m_blocks, pair % heads, pair // heads, cta - first,
                            (stream, cta, tile_idx, splits))

    @cute.jit
    def for_each_share(self, args: Sm90Tensors, scalars: Sm90Scalars, run_share):
        """Stream-K: run_share(tile, tile index, Q loads before it, K / V stage uses before it)
        for each of this CTA's shares in order, the producer's and the consumers' loop alike,
        so both count Q's phases and the pipelines' positions the same way."""
        bidx, _, _ = cute.arch.block_idx()
        stream = self.stream_tiles(args)
        first, end = stream.tiles_of(bidx)
        q_loads = cutlass.Int32(0)
        kv_uses = cutlass.Int32(0)
        for tile_idx in cutlass.range(first, end, unroll=1):
            tile = self.stream_tile(args, scalars, stream, bidx, tile_idx)
            run_share(tile, tile_idx, q_loads, kv_uses)
            q_loads = q_loads + 1
            kv_uses = kv_uses + tile.count

    @cute.jit
    def tile_at(self, args: Sm90Tensors, scalars: Sm90Scalars, m_block, bidh, bidb, split_idx=0,
                stream_share=None, sparse_counts=None) -> Tile:
        """The tile of query block m_block of (bidb, bidh): its key blocks (none past a packed
        sequence's end; a split's share of them). stream_share: (StreamSplit, cta, tile index,
        CTAs sharing the tile) of a stream-K CTA, else None. sparse_counts: a block-sparse
        row's (partial, full) counts where known (`announced`), else read from its lists."""
        cfg, t = self.config, self.t
        rows_k = args.tma_mK.shape[0]  # the keys, packed keys or a cache row's capacity
        if cutlass.const_expr(cfg.paged):
            rows_k = self.block_table(args).shape[1] * rows_k  # what the block table addresses
        if cutlass.const_expr(args.cache is not None):
            seq = SeqInfo.make(bidb, args.tma_mQ.shape[0], rows_k, mSeqUsedK=args.cache.mSeqlensK,
                               k_extra=args.cache.k_extra)
        elif cutlass.const_expr(args.varlen is None):
            seq = SeqInfo.make(bidb, args.tma_mQ.shape[0], rows_k)
        else:
            seq = SeqInfo.make(bidb, args.tma_mQ.shape[0], rows_k, args.varlen.mCuSeqlensQ, args.varlen.mCuSeqlensK,
                               args.varlen.mSeqUsedK, paged=cfg.paged)
        window = Window(scalars.window_left, scalars.window_right, cfg.has_left, cfg.has_right, cfg.query_group)
        num_splits = 1
        if cutlass.const_expr(cfg.split and not cfg.stream_k):
            num_splits = args.cache.split.num_splits
        blocks = BlockRange.make(seq, m_block, t.block_m, t.block_n, window, split_idx, num_splits,
                                 cfg.split and not cfg.stream_k)
        n_block_min, n_block_max = blocks.n_block_min, blocks.n_block_max
        if cutlass.const_expr(stream_share is not None):
            stream, cta, tile_idx, num_splits = stream_share
            n_block_min, n_block_max = stream.share(cta, tile_idx, n_block_min, n_block_max)
        # a window can end before it starts (n_block_min > n_block_max): no key block then
        count = cutlass.max(n_block_max - n_block_min, 0)
        if cutlass.const_expr(args.varlen is not None):
            if m_block * t.block_m >= seq.seqlen_q:
                count = cutlass.Int32(0)
        sparse = None
        if cutlass.const_expr(args.sparse is not None):  # the row's listed blocks, every other one skipped
            sparse = args.sparse.row(bidb, bidh, m_block, sparse_counts)
            count = sparse.count()
        return Tile(m_block, bidh, bidb, seq, n_block_max, count, split_idx, num_splits, sparse)

    @cute.jit
    def announced(self, args: Sm90Tensors, scalars: Sm90Scalars, pipes: Pipes) -> Tile:
        """The tile whose coordinates the producer published with Q (`announce`): the integer
        divisions of `tile` are the producer's alone (d 64 causal: 180 instructions before a
        tile's first wgmma, SASS). KV caches (split-KV's only users) take theirs from the block
        index (`cache_tile`, `stream_tile`)."""
        counts = None
        if cutlass.const_expr(args.sparse is not None):  # its block-sparse row's, loaded by the producer
            counts = (pipes.tile_slot[4], pipes.tile_slot[5])
        return self.tile_at(args, scalars, pipes.tile_slot[1], pipes.tile_slot[2], pipes.tile_slot[3],
                            sparse_counts=counts)
