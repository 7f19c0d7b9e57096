"""The Hopper forward (sm_90a): a producer warpgroup issues TMA tile loads on mbarrier
pipelines, consumer warpgroups run wgmma and the SM80 kernel's softmax and score modifiers,
overlapping each block's softmax with the tensor cores. Device code only.

A tile is block_m query rows of one (batch, head): warpgroup 0 produces, warpgroups 1..
consume, 64 query rows each (FlashAttention-3's design, written here):

    producer (warp 0, 24 registers):  K[last], Q, V[last], then K[n] and V[n] of the other key
                                      blocks (last first), each into a free stage of its pipeline
    consumers (240 registers):
        S = Q K[first]^T; mask; softmax -> P
        for each further block n (n_prev the one before):
            S = Q K[n]^T          issued, not waited for       } the tensor cores run both
            O += P V[n_prev]      issued, not waited for       } while this warpgroup waits
            wait for S; modifiers; softmax -> new P, rescale factors
            wait for O += ...; rescale O
        O += P V[last]; O /= rowsum; O via shared memory and a TMA store, LSE from registers

A persistent variant runs one CTA per SM: each takes the tile of its block index first, then the
next unclaimed one from a global counter (a dynamic scheduler, so tiles of unequal length under
a causal mask balance themselves; the host may number them longest first, `tile`). Q's tile is
released by a barrier once the consumers' last wgmma is done, O has a tile of its own, so the
next tile's Q and K / V load during this one's last P V and epilogue. Otherwise one CTA per
tile, O staged in Q's tile (in one of its own where it does not lie in Q's, `own_o_tile`).
Either way the producer announces each tile's index and coordinates
to the consumers in shared memory, published by Q's full barrier. With `kv_multicast`
(persistent, no mask) a cluster of two CTAs takes a head's query blocks two at a time in a
static stride, and each CTA loads half of every K / V block into both (TMA multicast); a stage
is free once both CTAs' consumer warps have released it, so each warp arrives on both CTAs'
empty barriers. Half the L2 reads: at the power limit the clock rises and d 128 runs faster
(docs/tuning/hopper-forward.md, Hopper steps 20-21). With two consumer warpgroups (d <= 128) a
pair of named barriers makes them take turns at issuing their GEMMs, so one's softmax runs while
the other's GEMMs occupy the tensor cores (ping-pong). TMA zero-fills what lies past a tensor's
end (rows past seqlen, columns past a padded head dim), so no load needs a predicate; the first
block processed (the last one) and blocks a window edge crosses run the mask.

Packed batches (`call_varlen`: a list of the batch's query blocks, the most key blocks first
(`VarlenTiles`), one CTA per tile or persistent CTAs claiming them in that order; key lengths
from the prefix sums or seqused_k): the TMA boxes of a tile start at its sequence's first row, so loads
past the sequence's end read the next sequence's rows instead of zeros. Q's extra rows are never
stored and K's extra columns are masked, but P = 0 times a NaN in the next sequence's V is NaN,
so the consumers zero the V rows past seqlen_k of the last key block (`clear_v_tail`) before its
P V; O leaves through a row-predicated copy out of shared memory, since a TMA box past the
sequence's end would overwrite the next sequence's rows. Keys may lie in pages of a multiple of
block_n rows through a block table (`paged`), read as the KV-cache entry reads them.

KV caches (`call_kvcache`, one CTA per tile, 64-row tiles): key lengths from cache_seqlens and
the appended rows, V rows past them zeroed as for packed batches (a cache's unused rows may hold
NaN); pages of a multiple of block_n rows through a block table, a TMA box per key block inside
its page (`page_source`); split-KV merged inside a thread-block cluster up to 8 splits
(`store_cluster`), past that with the SM80 kernel's partials and merge (`store_split`). Stream-K
(`stream_k`): a grid of any CTA count shares all tiles' key blocks evenly (`split_kv.StreamSplit`),
each CTA running its shares of one or more tiles in turn as the persistent loop runs its tiles,
each share merged through the workspace. MLA decode's latent tiles (`HopperTileTraits.latent`,
one CTA per tile): V is the first 512 columns of K's stage (no V loads, V's pipeline is K's),
and two consumer warpgroups share one 64-row block, each holding half of O's columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync

from cute_flash.kernels.common.block_sparse import BlockSparse, fake_block_sparse
from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.common.flags import score_letters
from cute_flash.kernels.common.gqa_fold import fold_heads, fold_lse
from cute_flash.kernels.common.split_kv import ClusterMerge, cluster_sync
from cute_flash.kernels.common.user_mods import check_mods
from cute_flash.kernels.common.varlen_tiles import VarlenTiles, fake_tiles
from cute_flash.kernels.sm90.epilogue import Epilogue
from cute_flash.kernels.sm90.fwd_state import (KV_MULTICAST_CTAS, Pipes, Sm90Cache, Sm90Recipe, Sm90Scalars, Sm90Split,
                                               Sm90Tensors, Sm90Varlen)
from cute_flash.kernels.sm90.mainloop import Consumer
from cute_flash.kernels.sm90.pipeline import seq_first
from cute_flash.kernels.sm90.producer import Producer
from cute_flash.kernels.sm90.scheduler import Schedule, TileScheduler
from layouts import hopper
from layouts import smem as lsmem
from layouts.hopper import HopperTileTraits
from layouts.traits import ALIGN, COPY_BYTES, ELEMENT_BYTES, SMEM_LIMIT, element_type

# (producer, consumer) registers per thread by consumer warpgroups: 128 x producer + 128 x
# warpgroups x consumer <= 64K registers per SM, multiples of 8, at most 256.
REGISTERS = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
# Two CTAs an SM (`Sm90FwdConfig.ctas_per_sm`, one consumer warpgroup): half the registers each,
# launched at 128 a thread; ptxas spilled nothing at d 64 / 128 with the consumer at 232.
REGISTERS_TWO_CTAS = (24, 232)
SMEM_PER_SM = 233472   # sm_90: 228 KB an SM, of which each resident CTA reserves 1 KB


@dataclass(frozen=True)
class Sm90FwdConfig:
    """One compiled Hopper forward variant: traits, K/V pipeline depth and the score flags."""
    traits: HopperTileTraits
    stages: int = 2
    persistent: bool = False  # launch/policy.py:prefers_persistent chooses
    has_left: bool = False
    has_right: bool = False
    has_alibi: bool = False
    has_softcap: bool = False
    has_dropout: bool = False  # P's elements dropped by the Philox mask (docs/semantics.md, Dropout)
    varlen: bool = False       # packed batches (call_varlen); one CTA per tile, or persistent
    has_seqused_k: bool = False  # packed batches whose key lengths come from seqused_k
    kvcache: bool = False      # KV caches (call_kvcache): key lengths from cache_seqlens; one CTA per tile
                               # (or stream-K's CTAs, `stream_k`)
    split: bool = False        # KV caches: split-KV, fp32 partials merged by each tile's last split CTA
    paged: bool = False        # KV caches or packed batches: keys in pages of a multiple of block_n rows
    pack_gqa: bool = False     # KV caches, one query row: the GQA group folded into rows (kernels/common/gqa_fold.py)
    query_group: int = 1       # KV caches, several query rows: the host folded each query's g heads into g
                               # consecutive rows of its K / V head (launch/kvcache.py:fold_queries); masks and
                               # key-block ranges read row r as query r // g (`Window.group`)
    ctas_per_sm: int = 1       # KV caches: 2 fits two CTAs an SM (64-key blocks, d <= 128; launch/policy.py)
    cluster_merge: bool = False  # split-KV: a tile's splits are one cluster, merged in shared memory (ClusterMerge)
    stream_k: bool = False     # split-KV: the grid's CTAs share all tiles' key blocks evenly (split_kv.StreamSplit)
    speculative_max: bool = False  # P from the kept row maxima first (OnlineSoftmax.update_speculative)
    speculative_in_place: bool = False  # ... written over S; a failed warpgroup vote issues Q K^T again
    kv_multicast: bool = False  # persistent, no mask: a cluster of two CTAs takes two query blocks of one head
                                # at a time, each loading half of every K / V block into both (TMA multicast;
                                # launch/policy.py:kv_multicast_fits)
    dependent_launch: bool = False  # KV caches: a programmatic dependent launch (PDL), unless one wave leaves
                                    # SMs idle and a CTA's keys are many (launch/policy.py:takes_dependent_launch)
    mods: object = None        # UserMods: Python-written score / mask mods (kernels/common/user_mods.py)
    block_sparse: bool = False  # dense: each query block visits its listed key blocks alone, the mask_mod
                                # evaluated on the partial ones (kernels/common/block_sparse.py)
    learnable_sink: bool = False  # a logit per head joins each row's softmax denominator in the epilogue
                                  # (`OnlineSoftmax.finalize`; cute_flash/sinks.py; KV caches: `cache_sinks`)

    def __post_init__(self):
        if self.kvcache and self.persistent:
            raise ValueError("KV caches take one CTA per tile (or stream-K's CTAs), not the persistent schedule")
        if self.varlen and self.kvcache:
            raise ValueError("an entry is packed (varlen) or a KV cache (kvcache), not both")
        if self.has_seqused_k and not self.varlen:
            raise ValueError("seqused_k belongs to packed batches (varlen)")
        if self.kvcache and self.has_dropout:
            raise ValueError("KV-cache calls have no dropout")
        if self.speculative_in_place and not self.speculative_max:
            raise ValueError("speculative_in_place places speculative_max's P")
        if self.speculative_max and self.has_dropout:
            raise ValueError("speculative maxima hold P beside S: no registers left for dropout's calls")
        if self.cluster_merge and not self.split:
            raise ValueError("the cluster merge is split-KV's (split)")
        if self.stream_k and not (self.split and not self.cluster_merge):
            raise ValueError("stream-K is split-KV's (split), merged through the workspace (not cluster_merge)")
        check_mods(self.mods, self.kvcache, self.has_softcap, self.has_alibi)
        if self.mods is not None and self.mods.score_mod is not None and self.speculative_max:
            raise ValueError("speculative maxima assume a score only moves by the built-in modifiers (a mask_mod "
                             "only hides scores, as a mask does)")
        if self.block_sparse and (self.mods is None or self.mods.mask_mod is None or self.varlen or self.kvcache
                                  or self.kv_multicast):
            raise ValueError("block sparsity lists the blocks a mask_mod cuts, in a dense launch without K / V "
                             "multicast (whose paired tiles load the same blocks)")
        if (self.split or self.pack_gqa or self.query_group > 1) and not self.kvcache:
            raise ValueError("split-KV and the GQA folds belong to KV caches (kvcache)")
        if self.query_group < 1 or (self.query_group > 1 and (self.pack_gqa or self.has_alibi)):
            raise ValueError("query_group folds g >= 2 heads' rows of several queries, not with pack_gqa (one "
                             "query row) or ALiBi (whose slopes are per head)")
        if self.paged and not (self.kvcache or self.varlen):
            raise ValueError("paged keys belong to KV caches (kvcache) or packed batches (varlen)")
        if self.kv_multicast and (self.varlen or not self.persistent or self.has_left or self.has_right):
            raise ValueError("K / V multicast pairs the equal tiles of a dense persistent schedule without a mask")
        if self.dependent_launch and not self.kvcache:
            raise ValueError("the programmatic dependent launch is the KV-cache entry's (kvcache)")
        if self.ctas_per_sm not in (1, 2):
            raise ValueError("ctas_per_sm is 1 or 2")
        if self.ctas_per_sm == 2 and not (self.kvcache and self.traits.warpgroups == 1
                                          and 2 * (self.smem_bytes + 1024) <= SMEM_PER_SM):
            raise ValueError("two CTAs an SM: KV caches, one consumer warpgroup, and half an SM's shared memory")
        if self.traits.head_dim_v is not None and self.kvcache and not self.traits.latent:
            raise ValueError("a V head dim of its own is built for dense and packed forwards, not KV caches "
                             "(whose split-KV partials and merges take one head dim), but for MLA decode's latent "
                             "tiles")
        if self.traits.latent and not (self.kvcache and not self.split and self.ctas_per_sm == 1):
            raise ValueError("latent tiles (MLA decode) are the KV-cache entry's, unsplit, one CTA an SM")
        if self.smem_bytes > SMEM_LIMIT[90]:  # e.g. a tuning override's stages
            raise ValueError(f"{self.stages} K / V stages of {self.traits.name} take {self.smem_bytes} bytes of "
                             f"shared memory; a CTA has at most {SMEM_LIMIT[90]}")

    @property
    def clears_v_tail(self) -> bool:
        """Keys past seqlen_k inside the tensor are not zeros but another sequence's rows (packed
        batches) or a cache's unused rows (KV caches), which may hold NaN: P = 0 times NaN in
        P V is NaN, so their V rows are zeroed in shared memory (`clear_v_tail`)."""
        return self.varlen or self.kvcache

    @property
    def schedule(self) -> Schedule:
        """How the launch's CTAs find their tiles (`scheduler.py`)."""
        if self.stream_k:
            return Schedule.STREAM_K
        if self.kvcache:
            return Schedule.CACHE_TILE
        return Schedule.PERSISTENT if self.persistent else Schedule.SINGLE_TILE

    @property
    def num_threads(self) -> int:
        """The consumer warpgroups and one producer warpgroup."""
        return self.traits.num_threads + 128

    @property
    def pingpong(self) -> bool:
        """Consumer warpgroups take turns at the tensor cores, round robin (d <= 128: above,
        O's registers leave no room for the overlap to pay)."""
        return self.traits.warpgroups >= 2 and max(self.traits.head_dim, self.traits.dv) <= 128

    @property
    def own_o_tile(self) -> bool:
        """O is staged in a tile of its own (`owns_o_tile`); otherwise in Q's, whose warpgroup
        row blocks it then shares exactly."""
        return self.owns_o_tile(self.traits, self.persistent)

    @staticmethod
    def owns_o_tile(traits: HopperTileTraits, persistent: bool) -> bool:
        """O has a tile of its own: persistent, or where it does not lie in Q's tile
        (`hopper.o_fits_q_tile`: it does at one head dim, and at MLA's pairs, the latent tiles'
        once both warpgroups are done with Q)."""
        return persistent or not hopper.o_fits_q_tile(traits)

    @staticmethod
    def fits_persistent(traits: HopperTileTraits, stages: int = 2) -> bool:
        """Persistent: one CTA per SM looping over tiles, O in a tile of its own in shared
        memory (room for it in all but d 256), so the next tile's Q and K / V load while this
        one's last P V and epilogue run. Otherwise one CTA per tile, O staged in Q's tile."""
        return Sm90FwdConfig.smem_for(traits, stages, persistent=True) <= SMEM_LIMIT[90]

    @staticmethod
    def smem_for(traits: HopperTileTraits, stages: int, persistent: bool) -> int:
        """The tiles (O's own where `owns_o_tile`), the mbarriers (8 bytes each: Q's full and empty
        ones, a full and an empty one per stage of K and of V) and the tile slot (4 int32; a
        block-sparse launch's 2 more lie in the padding before the 1024-byte aligned tiles)."""
        o_tile = ELEMENT_BYTES * traits.block_m * traits.dv if Sm90FwdConfig.owns_o_tile(traits, persistent) else 0
        return traits.smem_bytes(stages) + o_tile + 8 * (2 + 4 * stages) + 16

    @property
    def tile_slot_words(self) -> int:
        """The tile slot's int32 words (`Pipes.tile_slot`): index, m_block, bidh, bidb, and a
        block-sparse row's partial and full counts."""
        return 6 if self.block_sparse else 4

    @property
    def smem_bytes(self) -> int:
        return self.smem_for(self.traits, self.stages, self.persistent)

    @property
    def name(self) -> str:
        schedule = ("p" if self.persistent else "") + ("v" if self.varlen else "c" if self.kvcache else "")
        schedule += ("x" if self.split else "") + ("m" if self.cluster_merge else "") + ("w" if self.stream_k else "")
        schedule += "g" if self.paged else ""
        schedule += "f" if self.pack_gqa else ""
        schedule += "2" if self.ctas_per_sm == 2 else ""
        schedule += "s" if self.speculative_max else ""
        schedule += "i" if self.speculative_in_place else ""
        schedule += "k" if self.kv_multicast else ""
        schedule += "d" if self.dependent_launch else ""
        schedule += "b" if self.block_sparse else ""
        mods = "" if self.mods is None else "-M" + "".join(
            m.digest for m in (self.mods.score_mod, self.mods.mask_mod) if m is not None)
        return f"{self.traits.name}_s{self.stages}{schedule}-{score_letters(self)}{mods}" + (
            "-sink" if self.learnable_sink else "") + (f"-q{self.query_group}" if self.query_group > 1 else "")


class FlashFwdSm90(TileScheduler, Producer, Consumer, Epilogue):
    """The Hopper forward of one `Sm90FwdConfig`: here its entry points, launch and kernel
    prologue (barriers, pipelines, warp roles); its parts are the tile scheduler, the producer
    warp, the consumer warpgroups' main loop and the epilogue."""

    def __init__(self, config: Sm90FwdConfig):
        self.config = config
        self.t = config.traits
        self.dtype = element_type(config.traits)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mAlibi, mSink, mRng, aux_tensors, block_sparse, mTileCounter: cute.Tensor, scale_log2: cutlass.Float32,
                 score_premul: cutlass.Float32,
                 alibi_div: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32,
                 section_heads: cutlass.Int32, max_ctas: cutlass.Int32, stream):
        """mQ (batch, seqlen_q, heads, d) and mO (.., dv), mK (batch, seqlen_k, heads_k, d) and mV
        (.., dv), mLSE (batch, heads, seqlen_q) fp32, mAlibi (batch, heads) fp32 or None, mSink (heads,) fp32
        learnable sink logits (`Sm90FwdConfig.learnable_sink`) or None, mRng (4,) uint32 (the
        dropout state, `Dropout.load`) or None; aux_tensors the mods' tensors (a list) or None;
        block_sparse the lists of `BlockSparse.of` (`Sm90FwdConfig.block_sparse`) or None;
        mTileCounter (2,) int32, zero before a persistent launch and left zero by it;
        section_heads: see `tile`; max_ctas: the SMs a persistent variant spreads its tiles over."""
        scalars = Sm90Scalars(scale_log2, score_premul, alibi_div, window_left, window_right, section_heads)
        self.launch(mQ, mK, mV, mO, mLSE, mAlibi, mRng, mTileCounter, None, None, scalars, max_ctas, stream,
                    aux_tensors, BlockSparse.of(block_sparse), mSink)

    @cute.jit
    def call_kvcache(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                     mOaccum, mLSEaccum, mCounters, mAlibi, mSink, mSeqlensK: cute.Tensor, mLeftpadK, mBatchIdx,
                     mBlockTable, k_extra: cutlass.Int32, num_splits: cutlass.Int32, scale_log2: cutlass.Float32,
                     score_premul: cutlass.Float32, alibi_div: cutlass.Float32, window_left: cutlass.Int32,
                     window_right: cutlass.Int32, stream):
        """KV caches, decode and chunked prefill, with the SM80 kernel's `call_kvcache`
        parameters (the host launches either the same way): mQ / mO (batch, seqlen_q, heads, d),
        folded here to (batch, group, heads_k, d) with mLSE (batch, heads, 1) to (batch, heads_k,
        group) under `pack_gqa`; mK / mV (batch, capacity, heads_k, d) caches, or pages
        (num_pages, page_size, heads_k, d) with mBlockTable (batch, max_blocks) int32
        (`Sm90FwdConfig.paged`; page_size a multiple of block_n), mLSE (batch, heads, seqlen_q)
        fp32, mSink (heads,) fp32 learnable sink logits (`Sm90FwdConfig.learnable_sink`) or None,
        mSeqlensK (batch,) int32 cache_seqlens, k_extra the rows appended after them; one CTA per
        tile. mLeftpadK and mBatchIdx must be None (such calls stay on the SM80 kernel).
        Split (`Sm90FwdConfig.split`): num_splits CTAs per tile, each writing its partials to
        mOaccum (num_splits, batch, heads, seqlen_q, d) / mLSEaccum (num_splits, batch, heads,
        seqlen_q) fp32 (heads and rows as folded) and counting itself on mCounters (m_blocks *
        batch * heads,) int32, zero at launch and left zero; the last to arrive merges (the
        three are None unsplit, and with `Sm90FwdConfig.cluster_merge`, whose splits merge in
        shared memory). With `Sm90FwdConfig.stream_k`, num_splits CTAs share every tile's key
        blocks (`split_kv.StreamSplit`) and mOaccum's first extent is the most a tile has."""
        if cutlass.const_expr(mLeftpadK is not None or mBatchIdx is not None):
            raise ValueError("cache_leftpad and cache_batch_idx are not built on the Hopper KV-cache entry")
        if cutlass.const_expr(self.config.pack_gqa):
            g = mQ.shape[2] // mK.shape[2]
            mQ, mO, mLSE = fold_heads(mQ, g), fold_heads(mO, g), fold_lse(mLSE, g)
        scalars = Sm90Scalars(scale_log2, score_premul, alibi_div, window_left, window_right, 1)
        split = None
        if cutlass.const_expr(self.config.split):
            split = Sm90Split(mOaccum, mLSEaccum, mCounters, num_splits, mO)
        self.launch(mQ, mK, mV, mO, mLSE, mAlibi, None, None, None, Sm90Cache(mSeqlensK, mBlockTable, k_extra, split),
                    scalars, 0, stream, sink=mSink)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                    mAlibi, mSink, mRng, aux_tensors, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK,
                    mBlockTable,
                    mTiles: cute.Tensor, mTileCounter, max_ctas: cutlass.Int32,
                    scale_log2: cutlass.Float32, score_premul: cutlass.Float32, alibi_div: cutlass.Float32,
                    window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """Packed batches, with the SM80 kernel's `call_varlen` parameters: mQ / mO (total_q,
        heads, d), mK / mV (total_k, heads_k, d), or pages (num_pages, page_size, heads_k, d)
        with mBlockTable (batch, max_blocks) int32 (`Sm90FwdConfig.paged`; page_size a multiple
        of block_n; the prefix sums of the keys then only give lengths), mLSE (heads, total_q)
        fp32, mSink as `__call__`'s, int32 prefix sums mCuSeqlens* (batch + 1,), mSeqUsedK (batch,) int32 key lengths
        or None; mTiles (entries, 2) int32 (sequence, query block) of each tile times the heads,
        in launch order (`VarlenTiles`), entries past a sequence's end storing nothing. A
        persistent variant's CTAs (at most max_ctas) take them in that order, claimed from
        mTileCounter as `__call__`'s (None for one CTA per tile)."""
        scalars = Sm90Scalars(scale_log2, score_premul, alibi_div, window_left, window_right, 1)
        varlen = Sm90Varlen(mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, VarlenTiles(mTiles, mQ.shape[1]), mO, mBlockTable)
        self.launch(mQ, mK, mV, mO, mLSE, mAlibi, mRng, mTileCounter, varlen, None, scalars, max_ctas, stream,
                    aux_tensors, sink=mSink)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mAlibi,
               mRng, mTileCounter, varlen, cache, scalars: Sm90Scalars, max_ctas, stream, aux_tensors=None,
               sparse=None, sink=None):
        t, stages = self.t, self.config.stages
        sQ_layout = hopper.smem_layout(t, t.block_m)
        sKV_layout = hopper.smem_layout_staged(t, t.block_n, stages)
        sV_layout = hopper.smem_layout_staged(t, t.block_n, stages, t.dv)
        sO_layout = hopper.smem_layout(t, t.block_m, t.dv)
        tma_q, tma_mQ = hopper.tma_load_atom(t, seq_first(mQ), sQ_layout, t.block_m)
        kv_ctas = KV_MULTICAST_CTAS if self.config.kv_multicast else 1
        tma_k, tma_mK = hopper.tma_load_atom(t, seq_first(mK), cute.slice_(sKV_layout, (None, None, 0)), t.block_n,
                                             kv_ctas)
        tma_v, tma_mV = None, None  # latent tiles: V is read from K's stages, never loaded
        if cutlass.const_expr(not t.latent):
            tma_v, tma_mV = hopper.tma_load_atom(t, seq_first(mV), cute.slice_(sV_layout, (None, None, 0)),
                                                 t.block_n, kv_ctas, t.dv)
        tma_o, tma_mO = None, None
        if cutlass.const_expr(varlen is None):  # a warpgroup's (64, dv_wg) box
            tma_o, tma_mO = hopper.tma_store_atom(t, seq_first(mO), hopper.smem_layout(t, hopper.WGMMA_M, t.dv_wg),
                                                  hopper.WGMMA_M, t.dv_wg)

        fields = {"q_barriers": (cutlass.Int64, 2, None), "k_barriers": (cutlass.Int64, 2 * stages, None),
                  "v_barriers": (cutlass.Int64, 2 * stages, None),
                  "tile_slot": (cutlass.Int32, self.config.tile_slot_words, None),
                  "sQ": (self.dtype, cute.cosize(sQ_layout), 1024), "sK": (self.dtype, cute.cosize(sKV_layout), 1024)}
        if cutlass.const_expr(not t.latent):
            fields["sV"] = (self.dtype, cute.cosize(sV_layout), 1024)
        if cutlass.const_expr(self.config.own_o_tile):
            fields["sO"] = (self.dtype, cute.cosize(sO_layout), 1024)
        SharedStorage = lsmem.smem_struct(fields)

        recipe = Sm90Recipe(sQ_layout, sKV_layout, sV_layout, sO_layout, tma_q, tma_k, tma_v, tma_o,
                            hopper.tiled_mma_qk(t), hopper.tiled_mma_pv(t))
        args = Sm90Tensors(tma_mQ, tma_mK, tma_mV, tma_mO, mLSE, mAlibi, mRng, mTileCounter, varlen, cache,
                           aux_tensors, sparse, sink)
        tiles = self.num_tiles(args)
        ctas = cutlass.min(tiles, max_ctas) if cutlass.const_expr(self.config.persistent) else tiles
        if cutlass.const_expr(self.config.kv_multicast):  # whole clusters; the host gives an even tile count
            ctas = ctas // KV_MULTICAST_CTAS * KV_MULTICAST_CTAS
        grid = (ctas, 1, 1)
        if cutlass.const_expr(self.config.schedule is Schedule.STREAM_K):  # the CTAs sharing the tiles: `stream_tiles`
            grid = (args.cache.split.num_splits, 1, 1)
        elif cutlass.const_expr(self.config.schedule is Schedule.CACHE_TILE):  # (splits x query blocks, heads, batch)
            heads, batch = args.tma_mQ.shape[2], self.batch(args)
            grid = (tiles // (heads * batch), heads, batch)
        # Two CTAs an SM: the carveout given, the DSL does not ask the device for its shared memory
        # (which a machine without a GPU cannot answer)
        carveout = 100 if self.config.ctas_per_sm == 2 else None
        cluster = None
        if cutlass.const_expr(self.config.cluster_merge):  # a tile's splits: neighbours along x
            cluster = [args.cache.split.num_splits, 1, 1]
        if cutlass.const_expr(self.config.kv_multicast):  # tiles 2c and 2c + 1 (+ k ctas): one head's
            cluster = [KV_MULTICAST_CTAS, 1, 1]
        self.kernel(args, scalars, recipe, SharedStorage).launch(
            grid=grid, block=[self.config.num_threads, 1, 1], cluster=cluster, smem=SharedStorage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=self.config.ctas_per_sm, preferred_smem_carveout=carveout,
            use_pdl=self.config.dependent_launch)

    @cute.kernel
    def kernel(self, args: Sm90Tensors, scalars: Sm90Scalars, recipe: Sm90Recipe, SharedStorage: cutlass.Constexpr):
        cfg, t = self.config, self.t
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        q_full, q_empty = storage.q_barriers.data_ptr(), storage.q_barriers.data_ptr() + 1
        if warp == 0:
            for atom in (recipe.tma_q, recipe.tma_k, recipe.tma_v):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)
        if tidx == 0:
            cute.arch.mbarrier_init(q_full, 1)
            cute.arch.mbarrier_init(q_empty, t.num_threads)
        k_bytes, v_bytes = (cute.size_in_bytes(self.dtype, cute.slice_(layout, (None, None, 0)))
                            for layout in (recipe.sKV_layout, recipe.sV_layout))  # a stage's TMA bytes
        if cutlass.const_expr(cfg.kv_multicast):
            # A stage is free once both CTAs' consumer warps are done with it (either CTA's
            # producer writes it in both): lanes 0 and 1 of each warp arrive at rank 0 and 1.
            multicast = dict(cta_layout_vmnk=cute.make_layout((1, KV_MULTICAST_CTAS, 1, 1)), mcast_mode_mn=(0, 1),
                             enable_multicast_signaling=True)
            consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, t.num_threads)
        else:
            multicast = {}
            consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, t.num_threads // 32)  # lane 0 of each warp
        # latent tiles: V's stage is K's, waited with it and freed after the P V that reads it
        kv_barriers = [(storage.k_barriers.data_ptr(), k_bytes)] + (
            [] if t.latent else [(storage.v_barriers.data_ptr(), v_bytes)])
        kv_pipes = [pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers, num_stages=cfg.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread), consumer_group=consumers,
            tx_count=stage_bytes, defer_sync=True, **multicast) for barriers, stage_bytes in kv_barriers]
        k_pipe, v_pipe = kv_pipes[0], kv_pipes[-1]
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(cfg.kv_multicast):
            cluster_sync()  # the other CTA's barriers are initialised before its copies or arrivals reach them
        else:
            cute.arch.sync_threads()
        if cutlass.const_expr(cfg.dependent_launch):
            # This grid may start while the previous kernel in the stream finishes: nothing global
            # is read or written before it has. The next one may start once these CTAs all run.
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        tile_slot = storage.tile_slot.get_tensor(cute.make_layout(cfg.tile_slot_words))
        pipes = Pipes(q_full, q_empty, k_pipe, v_pipe, tile_slot)
        sQ = storage.sQ.get_tensor(recipe.sQ_layout.outer, swizzle=recipe.sQ_layout.inner)    # (bm, d)
        sK = storage.sK.get_tensor(recipe.sKV_layout.outer, swizzle=recipe.sKV_layout.inner)  # (bn, d, stages)
        if cutlass.const_expr(t.latent):  # K's first dv columns: the layout of a V tile as wide, K's stage stride
            sV = cute.local_tile(sK, (t.block_n, t.dv, cfg.stages), (0, 0, 0))  # (bn, dv, stages)
        else:
            sV = storage.sV.get_tensor(recipe.sV_layout.outer, swizzle=recipe.sV_layout.inner)  # (bn, dv, stages)
        sO = sQ  # (bm, dv) O's staging tile: Q's, unless the variant has one of its own (`own_o_tile`)
        if cutlass.const_expr(cfg.own_o_tile):
            sO = storage.sO.get_tensor(recipe.sO_layout.outer, swizzle=recipe.sO_layout.inner)
        elif cutlass.const_expr(t.head_dim_v is not None):  # Q's tile as a (bm, dv) one
            sO = storage.sQ.get_tensor(recipe.sO_layout.outer, swizzle=recipe.sO_layout.inner)

        merge = None
        if cutlass.const_expr(cfg.cluster_merge):
            merge = ClusterMerge.make(storage.sK.data_ptr(), storage.sV.data_ptr(), args.cache.split.num_splits, t)

        producer_regs, consumer_regs = REGISTERS_TWO_CTAS if cfg.ctas_per_sm == 2 else REGISTERS[t.warpgroups]
        if warp < 4:
            cute.arch.setmaxregister_decrease(producer_regs)
            if warp == 0:
                self.produce(args, scalars, recipe, pipes, sQ, sK, sV)
            if cutlass.const_expr(cfg.cluster_merge):  # the consumers' two cluster barriers (`ClusterMerge.merge`)
                cluster_sync()
                cluster_sync()
        else:
            cute.arch.setmaxregister_increase(consumer_regs)
            self.consume(args, scalars, recipe, pipes, sQ, sK, sV, sO, tidx - 128, merge)
        if cutlass.const_expr(cfg.kv_multicast):
            cluster_sync()  # no CTA leaves while the other may still arrive on its empty barriers

def entry(config: Sm90FwdConfig):
    """The jit function `config` compiles: `__call__` (dense), `call_varlen` or `call_kvcache`."""
    kernel = FlashFwdSm90(config)
    return kernel.call_varlen if config.varlen else kernel.call_kvcache if config.kvcache else kernel


def fake_args(config: Sm90FwdConfig) -> list:
    """Placeholders for `config`'s entry, in its parameter order (as the SM80 forward's
    `fake_args`)."""
    dtype = element_type(config.traits)
    aux = config.mods.fake_aux() if config.mods is not None else None
    sink = fake_tensor(cutlass.Float32, 1) if config.learnable_sink else None
    if config.varlen:  # keys packed (total_k, heads_k, d) or in pages (num_pages, page_size, heads_k, d)
        kv_rank = 4 if config.paged else 3
        return [fake_tensor(dtype, r, ALIGN, COPY_BYTES) for r in (3, kv_rank, kv_rank, 3)] + [
            fake_tensor(cutlass.Float32, 2), fake_tensor(cutlass.Float32, 2) if config.has_alibi else None, sink,
            fake_tensor(cutlass.Uint32, 1) if config.has_dropout else None, aux, fake_tensor(cutlass.Int32, 1),
            fake_tensor(cutlass.Int32, 1), fake_tensor(cutlass.Int32, 1) if config.has_seqused_k else None,
            fake_tensor(cutlass.Int32, 2) if config.paged else None, fake_tiles(),
            fake_tensor(cutlass.Int32, 1) if config.persistent else None, 132, 1.0, 1.0, 1.0, -1, -1, fake_stream()]
    if config.kvcache:
        split = [fake_tensor(cutlass.Float32, 5, ALIGN, COPY_BYTES, last_extent=config.traits.head_dim),
                 fake_tensor(cutlass.Float32, 4), fake_tensor(cutlass.Int32, 1)] \
            if config.split and not config.cluster_merge else [None] * 3  # a cluster merges in shared memory
        # the SM80 entry's parameters; cache_leftpad and cache_batch_idx are None here
        alibi = fake_tensor(cutlass.Float32, 2) if config.has_alibi else None
        table = fake_tensor(cutlass.Int32, 2) if config.paged else None
        return ([fake_tensor(dtype, 4, ALIGN, COPY_BYTES) for _ in range(4)] + [fake_tensor(cutlass.Float32, 3)]
                + split + [alibi, sink, fake_tensor(cutlass.Int32, 1), None, None, table, 0, 2]
                + [1.0, 1.0, 1.0, -1, -1, fake_stream()])
    return [fake_tensor(dtype, 4, ALIGN, COPY_BYTES) for _ in range(4)] + [
        fake_tensor(cutlass.Float32, 3), fake_tensor(cutlass.Float32, 2) if config.has_alibi else None, sink,
        fake_tensor(cutlass.Uint32, 1) if config.has_dropout else None, aux,
        fake_block_sparse() if config.block_sparse else None, fake_tensor(cutlass.Int32, 1),
        1.0, 1.0, 1.0, -1, -1, 1, 132, fake_stream()]
