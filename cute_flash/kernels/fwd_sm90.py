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
tile, O staged in Q's tile. Either way the producer announces each tile's index and coordinates
to the consumers in shared memory, published by Q's full barrier. With `kv_multicast`
(persistent, no mask) a cluster of two CTAs takes a head's query blocks two at a time in a
static stride, and each CTA loads half of every K / V block into both (TMA multicast); a stage
is free once both CTAs' consumer warps have released it, so each warp arrives on both CTAs'
empty barriers. Half the L2 reads: at the H200's power limit the clock rises and d 128 runs 2-4%
faster. With two consumer warpgroups (d <= 128) a pair of named barriers makes them take turns
at issuing their GEMMs, so one's softmax runs while the other's GEMMs occupy the tensor cores
(ping-pong). TMA zero-fills what lies past a tensor's end (rows past seqlen, columns past a
padded head dim), so no load needs a predicate; the first block processed (the last one) and
blocks a window edge crosses run the mask.

Packed batches (`call_varlen`, one CTA per tile over max_seqlen_q's blocks; key lengths from the
prefix sums or seqused_k): the TMA boxes of a tile start at its sequence's first row, so loads
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
each share merged through the workspace.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.experimental.primitives import nvvm_wrapper as nvvm

from cute_flash.kernels.block_range import BlockRange, Window
from cute_flash.kernels.config import score_letters
from cute_flash.kernels.gemm import wgmma, wgmma_issue
from cute_flash.kernels.gqa_fold import fold_heads, fold_lse
from cute_flash.kernels.philox import Dropout, wgmma_groups
from cute_flash.kernels.score_mods import Mask, ScoreMods
from cute_flash.kernels.seq_info import SeqInfo, clamp, head_rows
from cute_flash.kernels.softmax import OnlineSoftmax
from cute_flash.kernels.split_kv import ClusterMerge, SplitKV, StreamSplit, cluster_sync
from layouts import hopper
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.hopper import HopperTileTraits
from layouts.traits import ELEMENT_BYTES, SMEM_LIMIT, element_type

# (producer, consumer) registers per thread by consumer warpgroups: 128 x producer + 128 x
# warpgroups x consumer <= 64K registers per SM, multiples of 8, at most 256.
REGISTERS = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
# Two CTAs an SM (`Sm90FwdConfig.ctas_per_sm`, one consumer warpgroup): half the registers each,
# launched at 128 a thread; ptxas spilled nothing at d 64 / 128 with the consumer at 232.
REGISTERS_TWO_CTAS = (24, 232)
SMEM_PER_SM = 233472   # sm_90: 228 KB an SM, of which each resident CTA reserves 1 KB
SCHEDULER_BARRIER = 1  # named barriers 1..3: consumer warpgroup 0's..2's turn to issue GEMMs
EPILOGUE_BARRIER = 4   # named barriers 4..6: consumer warpgroup 0's..2's O tile written to smem
CLEAR_V_BARRIER = 7    # packed batches: every consumer warpgroup's V rows past seqlen_k zeroed
SPLIT_BARRIER = 8      # split-KV: the consumer threads' arrival count and merge (SplitKV.sync)
VOTE_BARRIER = 9       # named barriers 9..11: consumer warpgroup 0's..2's vote on speculative P in place
KV_MULTICAST_CTAS = 2  # Sm90FwdConfig.kv_multicast: CTAs of a cluster sharing every K / V block


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
    varlen: bool = False       # packed batches (call_varlen); one CTA per tile
    has_seqused_k: bool = False  # packed batches whose key lengths come from seqused_k
    kvcache: bool = False      # KV caches (call_kvcache): key lengths from cache_seqlens; one CTA per tile
                               # (or stream-K's CTAs, `stream_k`)
    split: bool = False        # KV caches: split-KV, fp32 partials merged by each tile's last split CTA
    paged: bool = False        # KV caches or packed batches: keys in pages of a multiple of block_n rows
    pack_gqa: bool = False     # KV caches, one query row: the GQA group folded into rows (kernels/gqa_fold.py)
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

    def __post_init__(self):
        if (self.varlen or self.kvcache) and self.persistent:
            raise ValueError("packed batches and KV caches take one CTA per tile, not the persistent schedule")
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
        if (self.split or self.pack_gqa) and not self.kvcache:
            raise ValueError("split-KV and the GQA fold belong to KV caches (kvcache)")
        if self.paged and not (self.kvcache or self.varlen):
            raise ValueError("paged keys belong to KV caches (kvcache) or packed batches (varlen)")
        if self.kv_multicast and not (self.persistent and not (self.has_left or self.has_right)):
            raise ValueError("K / V multicast pairs the equal tiles of the persistent schedule without a mask")
        if self.dependent_launch and not self.kvcache:
            raise ValueError("the programmatic dependent launch is the KV-cache entry's (kvcache)")
        if self.ctas_per_sm not in (1, 2):
            raise ValueError("ctas_per_sm is 1 or 2")
        if self.ctas_per_sm == 2 and not (self.kvcache and self.traits.warpgroups == 1
                                          and 2 * (self.smem_bytes + 1024) <= SMEM_PER_SM):
            raise ValueError("two CTAs an SM: KV caches, one consumer warpgroup, and half an SM's shared memory")
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
    def num_threads(self) -> int:
        """The consumer warpgroups and one producer warpgroup."""
        return self.traits.num_threads + 128

    @property
    def pingpong(self) -> bool:
        """Consumer warpgroups take turns at the tensor cores, round robin (d <= 128: above,
        O's registers leave no room for the overlap to pay)."""
        return self.traits.warpgroups >= 2 and self.traits.head_dim <= 128

    @staticmethod
    def fits_persistent(traits: HopperTileTraits, stages: int = 2) -> bool:
        """Persistent: one CTA per SM looping over tiles, O in a tile of its own in shared
        memory (room for it in all but d 256), so the next tile's Q and K / V load while this
        one's last P V and epilogue run. Otherwise one CTA per tile, O staged in Q's tile."""
        return Sm90FwdConfig.smem_for(traits, stages, persistent=True) <= SMEM_LIMIT[90]

    @staticmethod
    def smem_for(traits: HopperTileTraits, stages: int, persistent: bool) -> int:
        """The tiles (O's own when persistent), the mbarriers (8 bytes each: Q's full and empty
        ones, a full and an empty one per stage of K and of V) and the tile slot (4 int32)."""
        o_tile = ELEMENT_BYTES * traits.block_m * traits.head_dim if persistent else 0
        return traits.smem_bytes(stages) + o_tile + 8 * (2 + 4 * stages) + 16

    @property
    def smem_bytes(self) -> int:
        return self.smem_for(self.traits, self.stages, self.persistent)

    @property
    def name(self) -> str:
        schedule = "p" if self.persistent else "v" if self.varlen else "c" if self.kvcache else ""
        schedule += ("x" if self.split else "") + ("m" if self.cluster_merge else "") + ("w" if self.stream_k else "")
        schedule += "g" if self.paged else ""
        schedule += "f" if self.pack_gqa else ""
        schedule += "2" if self.ctas_per_sm == 2 else ""
        schedule += "s" if self.speculative_max else ""
        schedule += "i" if self.speculative_in_place else ""
        schedule += "k" if self.kv_multicast else ""
        schedule += "d" if self.dependent_launch else ""
        return f"{self.traits.name}_s{self.stages}{schedule}-{score_letters(self)}"


@dataclass(frozen=True)
class Sm90Scalars:
    scale_log2: object
    score_premul: object
    alibi_div: object
    window_left: object
    window_right: object
    section_heads: object  # (batch, head) pairs per scheduling section (FlashFwdSm90.tile)


@dataclass(frozen=True)
class Sm90Recipe:
    """Compile-time layouts and atoms (layouts/hopper.py)."""
    sQ_layout: cute.ComposedLayout   # (bm, d)
    sKV_layout: cute.ComposedLayout  # (bn, d, stages)
    tma_q: cute.CopyAtom
    tma_k: cute.CopyAtom
    tma_v: cute.CopyAtom
    tma_o: cute.CopyAtom             # stores one warpgroup's (64, d) rows of O
    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma


@dataclass(frozen=True)
class Sm90Varlen:
    """A packed batch: where its sequences start, and O as a tensor (it leaves by a predicated
    copy, not TMA)."""
    mCuSeqlensQ: cute.Tensor  # (batch + 1,) int32
    mCuSeqlensK: cute.Tensor  # (batch + 1,) int32
    mSeqUsedK: object         # (batch,) int32 key lengths overriding the prefix sums', or None
    max_seqlen_q: object      # Int32: the grid covers its query blocks
    mO: cute.Tensor           # (total_q, heads, d)
    mBlockTable: object       # (batch, max_blocks) int32: keys in pages (`Sm90FwdConfig.paged`), or None


@dataclass(frozen=True)
class Sm90Split:
    """Split-KV (`split_kv.SplitKV`): every split's fp32 partials, the tiles' arrival counters,
    and O / LSE as tensors for the merge (it writes them with plain stores, not TMA). The
    cluster merge (`Sm90FwdConfig.cluster_merge`, `split_kv.ClusterMerge`) has no partials or
    counters in global memory: the three are None."""
    mOaccum: cute.Tensor    # (num_splits, batch, heads, seqlen_q, d) fp32
    mLSEaccum: cute.Tensor  # (num_splits, batch, heads, seqlen_q) fp32
    mCounters: cute.Tensor  # (m_blocks * batch * heads,) int32, zero at launch and at exit
    num_splits: object      # Int32: CTAs a tile; with `stream_k` the grid's CTAs
    mO: cute.Tensor         # (batch, seqlen_q, heads, d)


@dataclass(frozen=True)
class Sm90Cache:
    """A KV cache: the keys of sequence b are the first cache_seqlens[b] + k_extra rows of its
    cache row, or of its pages in block-table order (k_extra: rows the call appended after
    them)."""
    mSeqlensK: cute.Tensor  # (batch,) int32 cache_seqlens
    mBlockTable: object     # (batch, max_blocks) int32 page indices, or None (one cache row a sequence)
    k_extra: object         # Int32
    split: object           # Sm90Split, or None unsplit


@dataclass(frozen=True)
class Sm90Tensors:
    tma_mQ: cute.Tensor  # (seqlen_q, d, heads, batch) TMA coordinates; packed: (total_q, d, heads)
    tma_mK: cute.Tensor  # (seqlen_k, d, heads_k, batch); packed: (total_k, d, heads_k)
    tma_mV: cute.Tensor
    tma_mO: object       # (seqlen_q, d, heads, batch); None for packed batches
    mLSE: cute.Tensor    # (batch, heads, seqlen_q) fp32; packed: (heads, total_q)
    mAlibi: object       # (batch, heads) fp32 slopes
    mRng: object         # (4,) uint32: dropout's Philox key, offset and keep threshold
    mTileCounter: cute.Tensor  # (2,) int32: tiles claimed past the first wave, CTAs finished
    varlen: object       # Sm90Varlen for packed batches, else None
    cache: object        # Sm90Cache for KV caches, else None


@dataclass(frozen=True)
class Tile:
    """One work tile (a query block of one head) and what follows from it."""
    m_block: object
    bidh: object
    bidb: object
    seq: SeqInfo
    n_block_max: object
    count: object       # key blocks to visit (>= 0): n_block_max - 1 down to n_block_max - count
    split_idx: object   # split-KV: this tile's share of the key blocks (0 unsplit)
    splits: object      # split-KV: the CTAs sharing the tile's key blocks (1 unsplit)


@dataclass(frozen=True)
class MergeRows:
    """A split tile's view for its merge (`FlashFwdSm90.merge_rows`)."""
    tOcO_mn: cute.Tensor  # (rows, cols) (row, col) coordinates of the thread's O accumulators
    rows_q: object        # query rows of the tile inside the sequence (may exceed block_m)
    mO: cute.Tensor       # (seqlen_q, d) this head's O
    mLSE: cute.Tensor     # (seqlen_q,) this head's LSE


@dataclass(frozen=True)
class Pipes:
    """Q's mbarriers (full: the TMA bytes landed; empty: every consumer thread is done with the
    tile) and the K and V stage pipelines (`PipelineTmaAsync`: a full barrier the TMA bytes
    complete, an empty one each consumer warp arrives on)."""
    q_full: object
    q_empty: object
    k: object
    v: object
    tile_slot: cute.Tensor  # (4,) int32 in smem: the tile Q's full barrier announces: index, m_block, bidh, bidb


@dataclass(frozen=True)
class Sm90Loop:
    """What every key-block step of a consumer warpgroup reads and writes."""
    pipes: Pipes
    tSrQ: cute.Tensor         # (MMA, MMA_M, MMA_K) smem descriptors
    tSrK: cute.Tensor         # (MMA, MMA_N, MMA_K, stages)
    tOrV: cute.Tensor         # (MMA, MMA_N, MMA_K, stages): V^T
    acc_s: cute.Tensor        # (MMA, MMA_M, MMA_N) fp32, S then P
    tOrP: cute.Tensor         # ((2, 2, 2), MMA_M, MMA_K): P in the input dtype, P V's A operand
    acc_o: cute.Tensor        # (MMA, MMA_M, MMA_N) fp32
    acc_o_mn: cute.Tensor     # its (row, col) view
    row_scale: cute.Tensor    # (rows,) fp32: O's rescale factors of the latest softmax step
    softmax: OnlineSoftmax
    mods: ScoreMods
    m_block: object
    unmasked_lo: object       # [lo, hi): key blocks no mask edge crosses (BlockRange.unmasked)
    unmasked_hi: object
    consumer_wg: object       # 0, 1, ..: this consumer warpgroup
    kv_uses: object           # K / V stage uses before this tile's (the pipelines' position)
    dropout: object           # kernels/philox.py:Dropout (has_dropout), else None
    mma_tidx: object          # this thread among the consumers
    sV: cute.Tensor           # (bn, d, stages): packed batches zero V rows past seqlen_k in it
    acc_p: object = None      # (MMA, MMA_M, MMA_N) fp32 P beside S (speculative_max, not in place), else
                              # None: P in acc_s


def use_state(n, stages: int, producer: bool) -> pipeline.PipelineState:
    """The pipeline state of the n-th stage use (n from 0): stage n % stages, its phase bit
    flipping each round (a producer's starts flipped). Computed from n rather than carried
    through the loop by `advance()`: a state object rebound in a helper is not a loop variable
    the DSL can carry. n >= 0, so a power-of-two depth takes a mask and a shift: the signed %
    and // had cost 8 instructions per warp and key block (d 128: 499 -> 491, SASS)."""
    if stages & (stages - 1) == 0:
        index, phase = n & (stages - 1), (n >> (stages.bit_length() - 1)) & 1
    else:
        index, phase = n % stages, (n // stages) % 2
    return pipeline.PipelineState(stages, n, index, phase ^ (1 if producer else 0))


def seq_first(t: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, d) as (seqlen, d, heads, batch), packed (total, heads, d) as
    (total, d, heads): a TMA box is a (rows, d) tile and the trailing modes are coordinates."""
    modes = [1, 3, 2, 0] if cute.rank(t) == 4 else [0, 2, 1]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


class FlashFwdSm90:
    def __init__(self, config: Sm90FwdConfig):
        self.config = config
        self.t = config.traits
        self.dtype = element_type(config.traits)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mAlibi, mRng, mTileCounter: cute.Tensor, scale_log2: cutlass.Float32, score_premul: cutlass.Float32,
                 alibi_div: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32,
                 section_heads: cutlass.Int32, max_ctas: cutlass.Int32, stream):
        """mQ / mO (batch, seqlen_q, heads, d), mK / mV (batch, seqlen_k, heads_k, d), mLSE
        (batch, heads, seqlen_q) fp32, mAlibi (batch, heads) fp32 or None, mRng (4,) uint32 (the
        dropout state, `Dropout.load`) or None; mTileCounter (2,) int32, zero before a persistent
        launch and left zero by it; section_heads: see `tile`; max_ctas: the SMs a persistent
        variant spreads its tiles over."""
        scalars = Sm90Scalars(scale_log2, score_premul, alibi_div, window_left, window_right, section_heads)
        self.launch(mQ, mK, mV, mO, mLSE, mAlibi, mRng, mTileCounter, None, None, scalars, max_ctas, stream)

    @cute.jit
    def call_kvcache(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                     mOaccum, mLSEaccum, mCounters, mAlibi, mSeqlensK: cute.Tensor, mLeftpadK, mBatchIdx,
                     mBlockTable, k_extra: cutlass.Int32, num_splits: cutlass.Int32, scale_log2: cutlass.Float32,
                     score_premul: cutlass.Float32, alibi_div: cutlass.Float32, window_left: cutlass.Int32,
                     window_right: cutlass.Int32, stream):
        """KV caches, decode and chunked prefill, with the SM80 kernel's `call_kvcache`
        parameters (the host launches either the same way): mQ / mO (batch, seqlen_q, heads, d),
        folded here to (batch, group, heads_k, d) with mLSE (batch, heads, 1) to (batch, heads_k,
        group) under `pack_gqa`; mK / mV (batch, capacity, heads_k, d) caches, or pages
        (num_pages, page_size, heads_k, d) with mBlockTable (batch, max_blocks) int32
        (`Sm90FwdConfig.paged`; page_size a multiple of block_n), mLSE (batch, heads, seqlen_q)
        fp32, mSeqlensK (batch,) int32 cache_seqlens, k_extra the rows appended after them; one
        CTA per tile. mLeftpadK and mBatchIdx must be None (such calls stay on the SM80 kernel).
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
                    scalars, 0, stream)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                    mAlibi, mRng, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK, mBlockTable,
                    max_seqlen_q: cutlass.Int32,
                    scale_log2: cutlass.Float32, score_premul: cutlass.Float32, alibi_div: cutlass.Float32,
                    window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """Packed batches, with the SM80 kernel's `call_varlen` parameters: mQ / mO (total_q,
        heads, d), mK / mV (total_k, heads_k, d), or pages (num_pages, page_size, heads_k, d)
        with mBlockTable (batch, max_blocks) int32 (`Sm90FwdConfig.paged`; page_size a multiple
        of block_n; the prefix sums of the keys then only give lengths), mLSE (heads, total_q)
        fp32, int32 prefix sums mCuSeqlens* (batch + 1,), mSeqUsedK (batch,) int32 key lengths
        or None; one CTA per tile of max_seqlen_q's query blocks, those past a sequence's end
        storing nothing."""
        scalars = Sm90Scalars(scale_log2, score_premul, alibi_div, window_left, window_right, 1)
        varlen = Sm90Varlen(mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, mO, mBlockTable)
        self.launch(mQ, mK, mV, mO, mLSE, mAlibi, mRng, None, varlen, None, scalars, 0, stream)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mAlibi,
               mRng, mTileCounter, varlen, cache, scalars: Sm90Scalars, max_ctas, stream):
        t, stages = self.t, self.config.stages
        sQ_layout = hopper.smem_layout(t, t.block_m)
        sKV_layout = hopper.smem_layout_staged(t, t.block_n, stages)
        sKV_stage = cute.slice_(sKV_layout, (None, None, 0))
        tma_q, tma_mQ = hopper.tma_load_atom(t, seq_first(mQ), sQ_layout, t.block_m)
        kv_ctas = KV_MULTICAST_CTAS if self.config.kv_multicast else 1
        tma_k, tma_mK = hopper.tma_load_atom(t, seq_first(mK), sKV_stage, t.block_n, kv_ctas)
        tma_v, tma_mV = hopper.tma_load_atom(t, seq_first(mV), sKV_stage, t.block_n, kv_ctas)
        tma_o, tma_mO = None, None
        if cutlass.const_expr(varlen is None):
            tma_o, tma_mO = hopper.tma_store_atom(t, seq_first(mO), hopper.smem_layout(t, hopper.WGMMA_M),
                                                  hopper.WGMMA_M)

        kv = (self.dtype, cute.cosize(sKV_layout), 1024)
        fields = {"q_barriers": (cutlass.Int64, 2, None), "k_barriers": (cutlass.Int64, 2 * stages, None),
                  "v_barriers": (cutlass.Int64, 2 * stages, None), "tile_slot": (cutlass.Int32, 4, None),
                  "sQ": (self.dtype, cute.cosize(sQ_layout), 1024), "sK": kv, "sV": kv}
        if cutlass.const_expr(self.config.persistent):
            fields["sO"] = (self.dtype, cute.cosize(sQ_layout), 1024)
        SharedStorage = lsmem.smem_struct(fields)

        recipe = Sm90Recipe(sQ_layout, sKV_layout, tma_q, tma_k, tma_v, tma_o, hopper.tiled_mma_qk(t),
                            hopper.tiled_mma_pv(t))
        args = Sm90Tensors(tma_mQ, tma_mK, tma_mV, tma_mO, mLSE, mAlibi, mRng, mTileCounter, varlen, cache)
        tiles = self.num_tiles(args)
        ctas = cutlass.min(tiles, max_ctas) if cutlass.const_expr(self.config.persistent) else tiles
        if cutlass.const_expr(self.config.kv_multicast):  # whole clusters; the host gives an even tile count
            ctas = ctas // KV_MULTICAST_CTAS * KV_MULTICAST_CTAS
        grid = (ctas, 1, 1)
        if cutlass.const_expr(self.config.stream_k):  # the CTAs that share the tiles: `stream_tiles`
            grid = (args.cache.split.num_splits, 1, 1)
        elif cutlass.const_expr(self.config.kvcache):  # (splits x query blocks, heads, batch): `cache_tile`
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
                cpasync.prefetch_descriptor(atom)
        if tidx == 0:
            cute.arch.mbarrier_init(q_full, 1)
            cute.arch.mbarrier_init(q_empty, t.num_threads)
        stage_bytes = cute.size_in_bytes(self.dtype, cute.slice_(recipe.sKV_layout, (None, None, 0)))
        if cutlass.const_expr(cfg.kv_multicast):
            # A stage is free once both CTAs' consumer warps are done with it (either CTA's
            # producer writes it in both): lanes 0 and 1 of each warp arrive at rank 0 and 1.
            multicast = dict(cta_layout_vmnk=cute.make_layout((1, KV_MULTICAST_CTAS, 1, 1)), mcast_mode_mn=(0, 1),
                             enable_multicast_signaling=True)
            consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, t.num_threads)
        else:
            multicast = {}
            consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, t.num_threads // 32)  # lane 0 of each warp
        k_pipe, v_pipe = (pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers, num_stages=cfg.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread), consumer_group=consumers,
            tx_count=stage_bytes, defer_sync=True, **multicast) for barriers in (storage.k_barriers.data_ptr(),
                                                                                 storage.v_barriers.data_ptr()))
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
        pipes = Pipes(q_full, q_empty, k_pipe, v_pipe, storage.tile_slot.get_tensor(cute.make_layout(4)))
        sQ = storage.sQ.get_tensor(recipe.sQ_layout.outer, swizzle=recipe.sQ_layout.inner)    # (bm, d)
        sK = storage.sK.get_tensor(recipe.sKV_layout.outer, swizzle=recipe.sKV_layout.inner)  # (bn, d, stages)
        sV = storage.sV.get_tensor(recipe.sKV_layout.outer, swizzle=recipe.sKV_layout.inner)  # (bn, d, stages)
        sO = sQ  # (bm, d) O's staging tile: Q's, unless the variant has room for one of its own
        if cutlass.const_expr(cfg.persistent):
            sO = storage.sO.get_tensor(recipe.sQ_layout.outer, swizzle=recipe.sQ_layout.inner)

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

    def num_tiles(self, args: Sm90Tensors):
        """Work tiles: (batch, head, query block) tiles, times the splits of a split launch (a
        stream-K launch counts tiles alone: its CTAs are `Sm90Split.num_splits`)."""
        tiles = cute.ceil_div(self.rows_q(args), self.t.block_m) * args.tma_mQ.shape[2] * self.batch(args)
        if cutlass.const_expr(self.config.split and not self.config.stream_k):
            tiles = tiles * args.cache.split.num_splits
        return tiles

    @staticmethod
    def rows_q(args: Sm90Tensors):
        """Query rows the grid covers per (batch, head): seqlen_q, or packed max_seqlen_q."""
        return args.tma_mQ.shape[0] if args.varlen is None else args.varlen.max_seqlen_q

    @staticmethod
    def batch(args: Sm90Tensors):
        return args.tma_mQ.shape[3] if args.varlen is None else args.varlen.mCuSeqlensQ.shape[0] - 1

    @cute.jit
    def tile(self, args: Sm90Tensors, scalars: Sm90Scalars, tile_idx) -> Tile:
        """Work tile tile_idx. The (batch, head) pairs (heads fastest, so the query heads of
        one K / V head are neighbours) go in sections of `section_heads`; within a section the
        last query block of every pair comes first, then the one before, and so on: tiles in
        decreasing length under a causal mask, while the K / V the CTAs in flight read stay
        those of one section (the host sizes it for L2). section_heads 1: one pair's blocks,
        last first, then the next pair's. (KV caches take theirs from the block index:
        `cache_tile`, or stream-K's `stream_tile`.)"""
        t = self.t
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
                stream_share=None) -> Tile:
        """The tile of query block m_block of (bidb, bidh): its key blocks (none past a packed
        sequence's end; a split's share of them). stream_share: (StreamSplit, cta, tile index,
        CTAs sharing the tile) of a stream-K CTA, else None."""
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
        window = Window(scalars.window_left, scalars.window_right, cfg.has_left, cfg.has_right)
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
        return Tile(m_block, bidh, bidb, seq, n_block_max, count, split_idx, num_splits)

    @cute.jit
    def announced(self, args: Sm90Tensors, scalars: Sm90Scalars, pipes: Pipes) -> Tile:
        """The tile whose coordinates the producer published with Q (`announce`): the integer
        divisions of `tile` are the producer's alone (d 64 causal: 180 instructions before a
        tile's first wgmma, SASS). KV caches (split-KV's only users) take theirs from the block
        index (`cache_tile`, `stream_tile`)."""
        return self.tile_at(args, scalars, pipes.tile_slot[1], pipes.tile_slot[2], pipes.tile_slot[3])

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
        if cutlass.const_expr(self.config.stream_k):
            self.for_each_share(args, scalars, lambda tile, tile_idx, q_loads, kv_uses: self.produce_tile(
                args, recipe, pipes, sQ, sK, sV, tile, tile_idx, heads, q_loads, kv_uses))
        elif cutlass.const_expr(self.config.kvcache):
            self.produce_tile(args, recipe, pipes, sQ, sK, sV, self.cache_tile(args, scalars), bidx, heads, 0, 0)
        elif cutlass.const_expr(not self.config.persistent):
            self.produce_tile(args, recipe, pipes, sQ, sK, sV, self.tile(args, scalars, bidx), bidx, heads, 0, 0)
        else:
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
        gQ = cute.local_tile(self.rows(args.tma_mQ, tile.seq.sum_s_q, tile.bidh, tile.bidb), (bm, d),
                             (tile.m_block, 0))  # (bm, d)
        gK = cute.local_tile(self.rows(args.tma_mK, tile.seq.sum_s_k, bidh_kv, kv_bidb), (bn, d),
                             (None, 0))  # (bn, d, n_blocks)
        gV = cute.local_tile(self.rows(args.tma_mV, tile.seq.sum_s_k, bidh_kv, kv_bidb), (bn, d),
                             (None, 0))  # (bn, d, n_blocks)
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
        tVsV, tVgV = cpasync.tma_partition(recipe.tma_v, kv_rank, kv_ctas, cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))  # (TMA, stages), (TMA, n_blocks)
        if tile.count == 0:
            self.load_q(recipe, pipes, tQgQ, tQsQ, tile, tile_idx, q_loads)
        for i in cutlass.range(tile.count, unroll=1):
            n_block = tile.n_block_max - 1 - i
            write = use_state(kv_uses + i, stages, producer=True)
            if cutlass.const_expr(self.config.paged):
                k_src = self.page_source(args, recipe.tma_k, args.tma_mK, sK, bidh_kv, tile.bidb, n_block)  # (TMA,)
                v_src = self.page_source(args, recipe.tma_v, args.tma_mV, sV, bidh_kv, tile.bidb, n_block)  # (TMA,)
            else:
                k_src, v_src = tKgK[None, n_block], tVgV[None, n_block]  # (TMA,)
            pipes.k.producer_acquire(write)
            cute.copy(recipe.tma_k, k_src, tKsK[None, write.index], tma_bar_ptr=pipes.k.producer_get_barrier(write),
                      mcast_mask=kv_mask)
            if i == 0:
                self.load_q(recipe, pipes, tQgQ, tQsQ, tile, tile_idx, q_loads)
            pipes.v.producer_acquire(write)
            cute.copy(recipe.tma_v, v_src, tVsV[None, write.index], tma_bar_ptr=pipes.v.producer_get_barrier(write),
                      mcast_mask=kv_mask)

    @cute.jit
    def page_source(self, args: Sm90Tensors, tma_atom, tma_mX: cute.Tensor, sX: cute.Tensor, bidh_kv, bidb,
                    n_block):
        """Paged keys (a cache's or a packed batch's): key block n_block's TMA source, (TMA,),
        inside its page: table entry n_block * bn // page_size of sequence bidb, clamped into
        the pages (a bad id reads some page, never outside them). page_size is a multiple of bn
        (the host checks), so no block crosses a page."""
        bn, d = self.t.block_n, self.t.head_dim
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

    @staticmethod
    def rows(tma_mX: cute.Tensor, start, bidh, bidb) -> cute.Tensor:
        """(rows, d) TMA coordinates of one head of one sequence: dense (rows, d, heads, batch)
        indexed, packed (total, d, heads) shifted to the sequence's first row `start`."""
        if start is None:
            return tma_mX[None, None, bidh, bidb]
        return cute.domain_offset((start, 0), tma_mX[None, None, bidh])

    @cute.jit
    def load_q(self, recipe: Sm90Recipe, pipes: Pipes, tQgQ, tQsQ, tile: Tile, tile_idx, q_loads):
        self.announce(pipes, tile_idx, tile, cute.size_in_bytes(self.dtype, recipe.sQ_layout), q_loads)
        cute.copy(recipe.tma_q, tQgQ, tQsQ, tma_bar_ptr=pipes.q_full)

    @cute.jit
    def consume(self, args: Sm90Tensors, scalars: Sm90Scalars, recipe: Sm90Recipe, pipes: Pipes, sQ, sK, sV, sO,
                mma_tidx, merge=None):
        """A consumer warpgroup, per tile: its 64 rows of O and LSE (mma_tidx: the thread's
        index among the consumers)."""
        t = self.t
        bm, bn, d = t.block_m, t.block_n, t.head_dim
        # warp-uniform, so the wgmma descriptors stay in uniform registers (d 128: 16 R2UR a key block less)
        consumer_wg = cute.arch.make_warp_uniform(mma_tidx // 128)
        wg = cute.make_layout(t.warpgroups, stride=128)  # A / B partitions are per warpgroup: its first thread
        wg_qk = recipe.mma_qk.get_slice(wg(consumer_wg))
        wg_pv = recipe.mma_pv.get_slice(wg(consumer_wg))
        tSrQ = recipe.mma_qk.make_fragment_A(wg_qk.partition_A(sQ))  # (MMA, MMA_M, MMA_K) descriptors
        tSrK = recipe.mma_qk.make_fragment_B(wg_qk.partition_B(sK))  # (MMA, MMA_N, MMA_K, stages)
        sVt = lsmem.transposed_view(sV)  # (d, bn, stages)
        tOrV = recipe.mma_pv.make_fragment_B(wg_pv.partition_B(sVt))  # (MMA, MMA_N, MMA_K, stages)
        acc_s = cute.make_rmem_tensor(wg_qk.partition_shape_C((bm, bn)), cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        tOrP = cute.make_rmem_tensor(hopper.acc_as_operand_a(acc_s).layout, self.dtype)  # ((2, 2, 2), MMA_M, MMA_K)
        acc_p = None
        if cutlass.const_expr(self.config.speculative_max and not self.config.speculative_in_place):
            acc_p = cute.make_rmem_tensor(acc_s.layout, cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        acc_o = cute.make_rmem_tensor(wg_pv.partition_shape_C((bm, d)), cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        row_scale = cute.make_rmem_tensor((cute.size(lmma.acc_mn_view(acc_o).shape[0]),), cutlass.Float32)
        if cutlass.const_expr(self.config.pingpong):
            if consumer_wg == 0:  # warpgroup 0 takes the first turn
                cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER, number_of_threads=256)

        consume = functools.partial(self.consume_tile, args, scalars, recipe, pipes, tSrQ, tSrK, tOrV, acc_s, tOrP,
                                    acc_o, row_scale, sO, sV, consumer_wg, merge, acc_p)
        if cutlass.const_expr(self.config.stream_k):

            def consume_share(tile, tile_idx, q_loads, kv_uses):
                cute.arch.mbarrier_wait(pipes.q_full, q_loads % 2)
                consume(tile, mma_tidx, kv_uses)

            self.for_each_share(args, scalars, consume_share)
        elif cutlass.const_expr(self.config.kvcache):
            # The tile from the block index before Q's wait: the length load and the division
            # leave the path from Q's arrival to the first wgmma
            tile = self.cache_tile(args, scalars)
            cute.arch.mbarrier_wait(pipes.q_full, 0)
            consume(tile, mma_tidx, 0)
        elif cutlass.const_expr(not self.config.persistent):
            bidx, _, _ = cute.arch.block_idx()
            ctas, _, _ = cute.arch.grid_dim()
            # One trip (grid = tiles). Written without the loop, ptxas spilled 68 B at d 128 causal.
            for _ in cutlass.range(bidx, self.num_tiles(args), ctas, unroll=1):
                cute.arch.mbarrier_wait(pipes.q_full, 0)
                consume(self.announced(args, scalars, pipes), mma_tidx, 0)
        else:
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
        window = Window(scalars.window_left, scalars.window_right, cfg.has_left, cfg.has_right)
        mods = ScoreMods(Mask(tile.seq.seqlen_q, tile.seq.seqlen_k, window), scalars.score_premul, slope,
                         cfg.has_softcap, cfg.has_alibi, (bm, bn), mma_tidx=mma_tidx)
        lo, hi = BlockRange.unmasked(tile.seq, tile.m_block, bm, bn, window)
        dropout = None
        if cutlass.const_expr(cfg.has_dropout):
            dropout = Dropout.load(args.mRng, tile.bidb, tile.bidh, args.tma_mQ.shape[2], packed=True)
        loop = Sm90Loop(pipes, tSrQ, tSrK, tOrV, acc_s, tOrP, acc_o, acc_o_mn, row_scale, softmax, mods, tile.m_block,
                        lo, hi, consumer_wg, kv_uses, dropout, mma_tidx, sV, acc_p)
        if tile.count > 0:
            self.mainloop(loop, tile.n_block_max, tile.count, recipe)
        if cutlass.const_expr(cfg.persistent):
            if tile.count == 0:
                self.release_q(loop)
        else:
            self.release_q(loop)

        # no key seen: LSE +inf, or -inf in a split's partial so that the merge gives it no weight
        lse = cute.make_rmem_tensor(softmax.row_max.layout, cutlass.Float32)
        softmax.finalize(acc_o_mn, lse, -cutlass.Float32.inf if cutlass.const_expr(cfg.split) else cutlass.Float32.inf)
        if cutlass.const_expr(cfg.has_dropout):  # the kept values' 1 / P(keep), once for all of O
            acc_o.store(acc_o.load() * dropout.scale())
        if cutlass.const_expr(cfg.cluster_merge):
            self.store_cluster(acc_o_mn, lse, merge, args, recipe, tile, mma_tidx)
        elif cutlass.const_expr(cfg.split):
            self.store_split(acc_o_mn, lse, pipes.tile_slot, args, recipe, tile, mma_tidx)
        else:
            self.store(acc_o, lse, sO, args, recipe, tile, mma_tidx)

    @cute.jit
    def mainloop(self, loop: Sm90Loop, n_block_max, count, recipe: Sm90Recipe):
        """Key blocks n_block_max - 1 down to n_block_max - count: the first one's S and softmax,
        then per block its S = Q K^T with the previous block's O += P V in flight, the last P V
        at the end."""
        stages = self.config.stages
        rescores = self.config.speculative_in_place  # a failed vote issues Q K^T again: Q and K stay till after it
        # MMAs of this function's own (recipe's only partition): wgmma sets an MMA's accumulate
        # field, state that must not escape the dynamic branch / loop it was set in.
        mma_qk, mma_pv = hopper.tiled_mma_qk(self.t), hopper.tiled_mma_pv(self.t)
        first = use_state(loop.kv_uses, stages, producer=False)
        loop.pipes.k.consumer_wait(first)
        wgmma(mma_qk, loop.acc_s, loop.tSrQ, loop.tSrK[None, None, None, first.index])
        self.release_qk(loop, first, count == 1)
        self.scores(loop, n_block_max - 1, recipe, True, True)
        if cutlass.const_expr(self.config.clears_v_tail):
            self.clear_v_tail(loop, first, n_block_max - 1)
        for i in cutlass.range(1, count, unroll=1):
            n_block = n_block_max - 1 - i
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
            if loop.unmasked_lo <= n_block and n_block < loop.unmasked_hi:
                self.scores(loop, n_block, recipe, False, False, k_read.index)
            else:
                self.scores(loop, n_block, recipe, False, True, k_read.index)
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
        """The warpgroup is done with this K stage, and with sQ after the tile's last block
        (persistent; otherwise after the tile)."""
        loop.pipes.k.consumer_release(k_read)
        if cutlass.const_expr(self.config.persistent):
            if last:
                self.release_q(loop)

    @cute.jit
    def release_q(self, loop: Sm90Loop):
        """This thread's wgmmas are done with sQ and the tile's index: the producer may load the
        next tile's. Persistent: as soon as the tile's last S has landed, so the next Q loads
        under the last softmax, P V and epilogue (H200: +7-12% at 512 keys, +3-7% at 1k, level
        from 4k; released after the last P V before); otherwise after the tile (sQ then stages O)."""
        cute.arch.mbarrier_arrive(loop.pipes.q_empty)

    @cute.jit
    def clear_v_tail(self, loop: Sm90Loop, state: pipeline.PipelineState, n_block):
        """Packed batches and KV caches (`Sm90FwdConfig.clears_v_tail`): zero the rows of key
        block n_block's V stage past seqlen_k (the next sequence's rows, or a cache's unused
        ones, which P = 0 would turn into NaN if they held one), 16 bytes at a time by every
        consumer thread, before any warpgroup's P V reads the stage. Once a tile: the last key
        block is the only one a sequence's end crosses."""
        t = self.t
        bn, d = t.block_n, t.head_dim
        loop.pipes.v.consumer_wait(state)
        vec = 16 // ELEMENT_BYTES
        chunks = d // vec
        sV = loop.sV[None, None, state.index]  # (bn, d) this stage
        first_row = loop.mods.mask.seqlen_k - n_block * bn  # rows past it are not this sequence's keys
        zeros = cute.make_rmem_tensor((vec,), self.dtype)
        zeros.fill(0.0)
        for c in cutlass.range(loop.mma_tidx, (bn - first_row) * chunks, t.num_threads, unroll=1):
            row = first_row + c // chunks
            chunk = cute.local_tile(sV[row, None], (vec,), (c % chunks,))  # (vec,)
            cute.autovec_copy(zeros, chunk)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, before wgmma (async proxy) reads
        cute.arch.barrier(barrier_id=CLEAR_V_BARRIER, number_of_threads=t.num_threads)

    @cute.jit
    def scores(self, loop: Sm90Loop, n_block, recipe: Sm90Recipe, is_first: cutlass.Constexpr,
               masked: cutlass.Constexpr, k_stage=None):
        """S of key block n_block (in acc_s; K in stage k_stage) -> modifiers -> unnormalised P
        -> dropout (after the row sums: they are taken before dropout); the first block's P is
        converted here, a later one's after O is rescaled. Dropout's Philox calls run here,
        after the softmax: computed while the GEMMs run instead (they depend on the coordinates
        alone) they held 32 more registers and measured 1-9% slower (docs/tuning/dropout.md, Dropout)."""
        acc_s_mn = loop.mods.apply(recipe.mma_qk, loop.acc_s, loop.m_block, n_block, masked)
        cfg = self.config
        # In place, masked blocks take `update`: a causal diagonal spans 2-3 of a 192-row tile's
        # key blocks, whose rows have seen few keys; with them 3.3% of the warpgroup votes failed
        # at 4k keys, 0.7% without them (emulated, d 64). Under a window's left edge they keep
        # speculating: given `update` they spilled 236 + 296 B (104 + 132 B speculating).
        eager = is_first or not cfg.speculative_max or (cfg.speculative_in_place and masked and not cfg.has_left)
        if cutlass.const_expr(eager):
            dst_mn = None if cutlass.const_expr(loop.acc_p is None) else lmma.acc_mn_view(loop.acc_p)
            loop.softmax.update(acc_s_mn, loop.row_scale, is_first, masked, dst_mn=dst_mn)
        elif cutlass.const_expr(cfg.speculative_in_place):
            loop.softmax.update_speculative(
                acc_s_mn, None, loop.row_scale, masked,
                agree=lambda fits: nvvm.barrier_cta_red_aligned(fits, VOTE_BARRIER + loop.consumer_wg, "and",
                                                                thread_count=128),
                rescore=lambda: self.rescore(loop, n_block, recipe, masked, k_stage))
        else:
            loop.softmax.update_speculative(acc_s_mn, lmma.acc_mn_view(loop.acc_p), loop.row_scale, masked)
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
            cute.arch.barrier(barrier_id=SCHEDULER_BARRIER + loop.consumer_wg, number_of_threads=256)

    @cute.jit
    def pass_turn(self, loop: Sm90Loop):
        if cutlass.const_expr(self.config.pingpong):
            nxt = (loop.consumer_wg + 1) % self.t.warpgroups
            cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER + nxt, number_of_threads=256)

    @cute.jit
    def store(self, acc_o: cute.Tensor, lse: cute.Tensor, sO: cute.Tensor, args: Sm90Tensors, recipe: Sm90Recipe,
              tile: Tile, mma_tidx):
        """O through shared memory: each consumer warpgroup writes its 64 rows into its rows of
        sO, which lie in swizzle atoms of their own (so, in Q's tile, no other warpgroup's last
        Q K^T reads them), once the previous tile's TMA store has read them; one of its warps
        then stores them with TMA, which drops rows past seqlen_q and columns past the tensor's
        head dim (packed batches: `copy_o_rows`). One thread of each quad writes its rows' LSE."""
        bm, d = self.t.block_m, self.t.head_dim
        wg = mma_tidx // 128
        store_warp = mma_tidx % 128 < 32
        rO = cute.make_rmem_tensor(acc_o.layout, self.dtype)  # (MMA, MMA_M, MMA_N)
        rO.store(acc_o.load().to(self.dtype))
        if store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + wg, number_of_threads=128)
        tOsO = recipe.mma_pv.get_slice(mma_tidx).partition_C(sO)  # (MMA, MMA_M, MMA_N)
        cute.autovec_copy(rO, tOsO)
        cute.arch.fence_view_async_shared()  # the generic-proxy writes, before TMA (async proxy) reads them
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + wg, number_of_threads=128)
        if cutlass.const_expr(args.varlen is not None):
            self.copy_o_rows(sO, args.varlen.mO, tile, wg, mma_tidx % 128)
        elif store_warp:
            sO_wg = cute.local_tile(sO, (hopper.WGMMA_M, d), (wg, 0))  # (64, d) this warpgroup's rows
            gO = cute.local_tile(args.tma_mO[None, None, tile.bidh, tile.bidb], (hopper.WGMMA_M, d),
                                 (tile.m_block * self.t.warpgroups + wg, 0))  # (64, d)
            tOsO_tma, tOgO = cpasync.tma_partition(recipe.tma_o, 0, cute.make_layout(1),
                                                   cute.group_modes(sO_wg, 0, 2),
                                                   cute.group_modes(gO, 0, 2))  # (TMA,), (TMA,)
            cute.copy(recipe.tma_o, tOsO_tma, tOgO)
            cute.arch.cp_async_bulk_commit_group()
        rows_q = tile.seq.seqlen_q - tile.m_block * bm
        cO = cute.make_identity_tensor((bm, d))
        tOcO_mn = lmma.acc_mn_view(recipe.mma_pv.get_slice(mma_tidx).partition_C(cO))  # (rows, cols) coordinates
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
        threads synchronise on named barrier SPLIT_BARRIER, which the producer warps, done after
        their tiles, never reach). tile_slot (4,) int32, which no KV-cache launch announces in,
        holds the arrival rank: a stream-K CTA's next Q may already be loading into sQ."""
        t = self.t
        split = args.cache.split
        m_blocks = cute.ceil_div(self.rows_q(args), t.block_m)
        kv = SplitKV.make(split.mOaccum, split.mLSEaccum, split.mCounters, tile.split_idx, tile.splits,
                          (tile.m_block, tile.bidb, tile.bidh, args.tma_mQ.shape[2]), t, m_blocks, SPLIT_BARRIER)
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

    def merge_rows(self, args: Sm90Tensors, recipe: Sm90Recipe, tile: Tile, mma_tidx) -> "MergeRows":
        """What both split-KV merges read: the thread's accumulator coordinates, the tile's
        real query rows, and the head's O and LSE rows."""
        cO = cute.make_identity_tensor((self.t.block_m, self.t.head_dim))
        return MergeRows(lmma.acc_mn_view(recipe.mma_pv.get_slice(mma_tidx).partition_C(cO)),
                         tile.seq.seqlen_q - tile.m_block * self.t.block_m,
                         head_rows(args.cache.split.mO, tile.seq, tile.bidb, tile.bidh),
                         head_rows(args.mLSE, tile.seq, tile.bidb, tile.bidh))

    @cute.jit
    def copy_o_rows(self, sO: cute.Tensor, mO: cute.Tensor, tile: Tile, wg, wg_tidx):
        """Packed batches: warpgroup wg's 64 rows of O from sO into mO (total_q, heads, d), 16
        bytes a copy, leaving out rows past the sequence's end (the next sequence's) and columns
        past mO's head dim (a multiple of 8)."""
        d = self.t.head_dim
        vec = 16 // ELEMENT_BYTES
        row0 = tile.m_block * self.t.block_m + wg * hopper.WGMMA_M  # this warpgroup's first row
        rows = tile.seq.seqlen_q - row0
        gO = head_rows(mO, tile.seq, tile.bidb, tile.bidh)  # (seqlen_q, d) this head
        for i in cutlass.range_constexpr(hopper.o_copy_steps(d)):
            row, chunk = hopper.o_copy_coord(wg_tidx, i, d)
            if row < rows and chunk * vec < mO.shape[2]:
                src = cute.local_tile(sO[wg * hopper.WGMMA_M + row, None], (vec,), (chunk,))  # (vec,)
                dst = cute.local_tile(gO[row0 + row, None], (vec,), (chunk,))  # (vec,)
                cute.autovec_copy(src, dst)
