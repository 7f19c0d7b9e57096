"""What travels through the Hopper forward (`fwd.py` and its parts: `scheduler`, `producer`,
`mainloop`, `epilogue`): a launch's tensors and scalars, its compile-time recipe, a work tile,
the pipelines, and what each key-block step of a consumer warpgroup reads."""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.score_mods import ScoreMods
from cute_flash.kernels.common.seq_info import SeqInfo
from cute_flash.kernels.common.softmax import OnlineSoftmax

KV_MULTICAST_CTAS = 2  # Sm90FwdConfig.kv_multicast: CTAs of a cluster sharing every K / V block


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
    sKV_layout: cute.ComposedLayout  # (bn, d, stages) K's stages
    sV_layout: cute.ComposedLayout   # (bn, dv, stages) V's stages (sKV_layout unless dv != d)
    sO_layout: cute.ComposedLayout   # (bm, dv) O's staging tile (sQ_layout unless dv != d)
    tma_q: cute.CopyAtom
    tma_k: cute.CopyAtom
    tma_v: cute.CopyAtom
    tma_o: cute.CopyAtom             # stores one warpgroup's (64, dv) rows of O
    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma


@dataclass(frozen=True)
class Sm90Varlen:
    """A packed batch: where its sequences start, and O as a tensor (it leaves by a predicated
    copy, not TMA)."""
    mCuSeqlensQ: cute.Tensor  # (batch + 1,) int32
    mCuSeqlensK: cute.Tensor  # (batch + 1,) int32
    mSeqUsedK: object         # (batch,) int32 key lengths overriding the prefix sums', or None
    tiles: object             # VarlenTiles: (sequence, query block) of each CTA, the longest first
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
    aux: object = None   # the mods' aux tensors (a list), or None
    sparse: object = None  # block_sparse.BlockSparse of a block-sparse launch, or None
    mSink: object = None   # (heads,) fp32 learnable sink logits (`Sm90FwdConfig.learnable_sink`), or None


@dataclass(frozen=True)
class Tile:
    """One work tile (a query block of one head) and what follows from it."""
    m_block: object
    bidh: object
    bidb: object
    seq: SeqInfo
    n_block_max: object
    count: object       # key blocks to visit (>= 0): n_block_max - 1 down to n_block_max - count (`n_block`)
    split_idx: object   # split-KV: this tile's share of the key blocks (0 unsplit)
    splits: object      # split-KV: the CTAs sharing the tile's key blocks (1 unsplit)
    sparse: object = None  # block_sparse.SparseRow of a block-sparse launch: count and blocks are its

    @cute.jit
    def n_block(self, i):
        """The i-th key block the tile visits (0 <= i < count)."""
        n = self.n_block_max - 1 - i
        if cutlass.const_expr(self.sparse is not None):
            n = self.sparse.block(i)
        return n


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
    tile_slot: cute.Tensor  # (4,) int32 in smem: the tile Q's full barrier announces: index, m_block, bidh, bidb;
                            # (6,) block-sparse: then the row's partial and full counts


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
    dropout: object           # kernels/common/philox.py:Dropout (has_dropout), else None
    mma_tidx: object          # this thread among the consumers
    sV: cute.Tensor           # (bn, d, stages): packed batches zero V rows past seqlen_k in it
    acc_p: object = None      # (MMA, MMA_M, MMA_N) fp32 P beside S (speculative_max, not in place), else
                              # None: P in acc_s
