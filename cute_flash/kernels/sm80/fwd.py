"""The FA2 forward kernel (flash-attn 2's compute_attn_1rowblock), device code only: the torch
side (plans, workspaces, caches, launch) is `cute_flash.launch`.

One CTA computes O and LSE for kBlockM query rows of one (batch, head): it streams the key
blocks that the masks leave visible, in reverse order, through a two-stage cp.async pipeline:

    load Q, K[last]                       (rows past the sequence end zero-filled)
    for n = last .. first:
        wait K[n]; barrier; issue V[n]
        S = Q K^T                         (ldmatrix + mma.sync over the head dim)
        wait V[n]; barrier; issue K[n-1]  (overlaps the softmax and P V)
        mask / ALiBi / softcap; online softmax -> P in registers
        O += P V                          (P re-viewed as the A operand, no smem round trip)
    O /= rowsum; O -> sO -> 128-bit stores; LSE

Per-CTA state travels in frozen dataclasses, each from its own module: `SeqInfo` (lengths and
offsets), `BlockRange` (the key blocks, split included), `ScoreMods` (softcap, ALiBi, masks),
`KVTiles` (where key block n comes from), `MmaOperands` (smem operands of both GEMMs),
`SplitKV` (a split's partials and merge); here, `FwdTensors` / `FwdScalars` / `TileRecipe` (a
launch's arguments), `CtaTensors` (this CTA's views) and `LoopState` (what each step reads).

Reverse order means only the first block processed can run past seqlen_k. Blocks that a
diagonal or window edge crosses are masked; the rest run a mask-free step.

The KV-cache entry (`call_kvcache`, Flash-Decoding) runs the same loop over one split's share
of the key blocks, reading keys from a cache row or through a block table (`KVTiles`), and
issues K[n-1] after S and V[n-1] after P V, so both travel together: decode is memory-bound.
Each split writes fp32 partials (O, LSE); the split CTA of a tile that finishes last merges
them (`split_kv.SplitKV.merge`), so a split call is one launch.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import functools

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.block_range import BlockRange, Window
from cute_flash.kernels.common.block_sparse import BlockSparse, SparseRow, fake_block_sparse
from cute_flash.kernels.common.constants import LOG2E
from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.common.flags import FLAG_LETTERS
from cute_flash.kernels.common.gemm import MmaOperands
from cute_flash.kernels.common.gqa_fold import fold_heads, fold_lse, row_sinks
from cute_flash.kernels.common.philox import Dropout, sm80_groups
from cute_flash.kernels.common.score_mods import Mask, ScoreMods
from cute_flash.kernels.common.seq_info import SeqInfo, clamp
from cute_flash.kernels.common.softmax import OnlineSoftmax
from cute_flash.kernels.common.split_kv import SplitKV
from cute_flash.kernels.common.tile_copy import column_predicate, copy_tile
from cute_flash.kernels.common.user_mods import ModCall, check_mods
from cute_flash.kernels.sm80.kv_tiles import KVTiles
from layouts import copy as lcopy
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.traits import ALIGN, COPY_BYTES, FwdTraits, element_type


@dataclass(frozen=True)
class FwdConfig:
    """One compiled forward variant, its compile key (with the target arch): the traits (which
    carry the dtype) and each feature flag by name. Everything else (lengths, strides, scales,
    window sizes, the split count) is a run-time argument."""
    traits: FwdTraits
    # score modifiers
    has_left: bool = False        # a left window edge (local attention)
    has_right: bool = False       # a right window edge (causal is right = 0)
    has_alibi: bool = False
    has_softcap: bool = False
    has_dropout: bool = False     # P's elements dropped by the Philox mask (docs/semantics.md, Dropout)
    even_k: bool = True           # the head dim fills traits.head_dim: no column predicates
    # input form: dense (default), packed varlen, or a KV cache
    varlen: bool = False
    has_seqused_k: bool = False   # varlen: seqused_k caps each sequence's keys
    paged: bool = False           # keys through a block table (varlen or kvcache)
    any_page_size: bool = False   # paged, pages not a multiple of 16 rows: a page lookup per row
    kvcache: bool = False
    split: bool = False           # kvcache: split-KV partials merged in the same launch
    has_leftpad: bool = False     # kvcache: cache_leftpad
    has_batch_idx: bool = False   # kvcache: cache_batch_idx
    pack_gqa: bool = False        # kvcache, one query row: a GQA group's heads become query rows
    mods: object = None           # UserMods: Python-written score / mask mods (kernels/common/user_mods.py)
    block_sparse: bool = False    # dense: each query block visits its listed key blocks alone, the mask_mod
                                  # evaluated on the partial ones (kernels/common/block_sparse.py)
    learnable_sink: bool = False  # a logit per head joins each row's softmax denominator in the epilogue
                                  # (`OnlineSoftmax.finalize`; cute_flash/sinks.py; KV caches: `row_sinks`)

    def __post_init__(self):
        if self.kvcache and self.varlen:
            raise ValueError("kvcache and varlen are two different entry points")
        if (self.split or self.has_leftpad or self.has_batch_idx) and not self.kvcache:
            raise ValueError("split, has_leftpad and has_batch_idx belong to the kvcache entry")
        if self.has_seqused_k and not self.varlen:
            raise ValueError("has_seqused_k belongs to the varlen entry (KV caches always read their lengths)")
        if self.paged and not (self.varlen or self.kvcache):
            raise ValueError("paged KV needs the varlen or kvcache entry")
        if self.paged and (self.has_leftpad or self.has_batch_idx):
            raise ValueError("a paged cache has neither leftpad nor cache_batch_idx (as in flash-attn)")
        if self.any_page_size and not self.paged:
            raise ValueError("any_page_size is a form of paged KV")
        if self.has_dropout and self.kvcache:
            raise ValueError("a KV cache is read without dropout (flash-attn's flash_attn_with_kvcache has none)")
        if self.pack_gqa and not (self.kvcache and not (self.has_left or self.has_right or self.has_alibi)):
            raise ValueError("pack_gqa folds single-row decode queries: kvcache, no window, no ALiBi")
        check_mods(self.mods, self.kvcache, self.has_softcap, self.has_alibi)
        if self.block_sparse and (self.mods is None or self.mods.mask_mod is None or self.varlen or self.kvcache):
            raise ValueError("block sparsity lists the blocks a mask_mod cuts, in a dense launch")

    @property
    def entry(self) -> str:
        """Which entry point of `FlashFwd` the variant compiles: dense, varlen or kvcache."""
        return "varlen" if self.varlen else "kvcache" if self.kvcache else "dense"

    @property
    def q_head_axis(self) -> int:
        """The heads mode of q, o (and unpaged k, v): (total, heads, d) packed, else (batch, seqlen, heads, d)."""
        return 1 if self.varlen else 2

    @property
    def reads_seqused_k(self) -> bool:
        """Per-sequence key counts read from a tensor: varlen's seqused_k, a cache's cache_seqlens."""
        return self.has_seqused_k or self.kvcache

    @property
    def overlap_kv(self) -> bool:
        """KV-cache kernels are memory-bound with few key blocks per split: K[n-1] and V[n-1] stay
        in flight together (one memory latency per block instead of two), at the price of two
        more barriers per block."""
        return self.kvcache

    @property
    def paged_runs(self) -> bool:
        """Paged prefill with pages of a multiple of 16 rows: K/V gathered in runs of rows that
        share a page (KV-cache kernels share page ids across a warp instead; kv_tiles.py)."""
        return self.paged and not self.kvcache and not self.any_page_size

    @property
    def smem_bytes(self) -> int:
        return self.traits.smem_bytes

    def flags(self) -> dict:
        """The feature flags that are on, by name."""
        return {f.name: True for f in fields(self) if f.name != "traits" and getattr(self, f.name)}

    @property
    def letters(self) -> str:
        """One letter per flag field, '.' when off: the variant's name in compile reports."""
        return "".join(FLAG_LETTERS[f.name] if getattr(self, f.name) else "."
                       for f in fields(self) if f.name != "traits")

    @property
    def name(self) -> str:
        return f"{self.traits.name}-{self.letters}"


@dataclass(frozen=True)
class SplitWorkspace:
    """Split-KV kernels: every split's partials and the tiles' arrival counters (split_kv.py)."""
    mOaccum: cute.Tensor    # (num_splits, batch, heads, seqlen_q, kHeadDim) fp32
    mLSEaccum: cute.Tensor  # (num_splits, batch, heads, seqlen_q) fp32
    mCounters: cute.Tensor  # (m_blocks * batch * heads,) int32, zero at launch and at exit


@dataclass(frozen=True)
class FwdTensors:
    """A launch's global tensors; those the config does not read are None, and the kernel is
    specialised on their absence."""
    mQ: cute.Tensor    # (batch, seqlen_q, heads, d), or (total_q, heads, d) packed
    mK: cute.Tensor    # (batch, seqlen_k, heads_k, d), (total_k, heads_k, d) packed, or pages
                       # (num_blocks, page_size, heads_k, d)
    mV: cute.Tensor
    mO: cute.Tensor    # like mQ
    mLSE: cute.Tensor  # (batch, heads, seqlen_q), or (heads, total_q) packed; fp32
    split: object      # SplitWorkspace
    mAlibi: object     # (batch, heads) fp32 slopes
    mCuSeqlensQ: object  # (batch + 1,) int32 prefix sums
    mCuSeqlensK: object
    mSeqUsedK: object  # (batch,) int32: seqused_k, or a cache's cache_seqlens
    mLeftpadK: object  # (batch,) int32
    mBatchIdx: object  # (batch,) int32: cache row of each sequence
    mBlockTable: object  # (batch, max_blocks) int32
    mRng: object = None  # (4,) uint32: dropout's Philox key, offset and keep threshold
    aux: object = None   # the mods' aux tensors (a list)
    sparse: object = None  # block_sparse.BlockSparse of a block-sparse launch
    mSink: object = None   # (heads,) fp32 learnable sink logits (`FwdConfig.learnable_sink`)


@dataclass(frozen=True)
class FwdScalars:
    """A launch's run-time scalars."""
    k_extra: object      # rows appended after cache_seqlens (kvcache)
    num_splits: object
    scale_log2: object   # softmax scale * log2(e) (times softcap with softcap)
    score_premul: object  # scale / softcap (softcap only)
    alibi_div: object    # ALiBi slopes are divided by the softmax multiplier
    window_left: object
    window_right: object


@dataclass(frozen=True)
class TileRecipe:
    """The compile-time layouts of one traits: smem layouts, tiled copies, tiled MMA (layouts/)."""
    sQ_layout: cute.ComposedLayout
    sKV_layout: cute.ComposedLayout
    gmem_tiled_copy_QKV: cute.TiledCopy
    gmem_tiled_copy_KV: cute.TiledCopy   # the paged-run copy in paged prefill kernels
    gmem_tiled_copy_O: cute.TiledCopy
    tiled_mma: cute.TiledMma


@dataclass(frozen=True)
class CtaTensors:
    """This CTA's (seqlen, d) views of its sequence and head, LSE (seqlen,), and what it reads
    per sequence beside them."""
    mQ_s: cute.Tensor
    mK_s: cute.Tensor  # (seqlen_k, d), or (num_blocks, page_size, d) pages when paged
    mV_s: cute.Tensor
    mO_s: cute.Tensor
    mLSE_s: cute.Tensor
    mTable: object     # (max_blocks,) this sequence's pages (paged)
    mAlibi: object
    head_dim: object   # the run-time head dim d <= kHeadDim
    aux: object = None  # the mods' aux tensors
    mSink: object = None  # (heads,) fp32 learnable sink logits


@dataclass(frozen=True)
class CtaTile:
    """Which tile this CTA computes."""
    m_block: object
    bidb: object
    bidh: object
    split_idx: object
    sparse: object = None  # block_sparse.SparseRow: the key blocks of a block-sparse launch's tile


@dataclass(frozen=True)
class LoopState:
    """What every main-loop step reads: operands, tiles, accumulators, softmax, modifiers."""
    mma: MmaOperands
    kv: KVTiles
    tKsK: cute.Tensor     # (KCPY, KCPY_N, KCPY_K) smem destinations of the K / V copies
    tVsV: cute.Tensor
    acc_o: cute.Tensor    # (MMA, MMA_M, MMA_K) fp32
    acc_o_mn: cute.Tensor  # its (row, col) view
    softmax: OnlineSoftmax
    mods: ScoreMods
    m_block: object
    n_block_min: object
    dropout: object = None  # kernels/common/philox.py:Dropout (has_dropout)


class FlashFwd:
    """One compiled variant per `FwdConfig`; everything else (lengths, strides, window sizes,
    scales, the split count) is a run-time argument."""

    def __init__(self, config: FwdConfig):
        self.config = config
        self.t = config.traits
        self.dtype = element_type(config.traits)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mAlibi, mSink, mRng, aux_tensors, block_sparse,
                 scale_log2: cutlass.Float32, score_premul: cutlass.Float32, alibi_div: cutlass.Float32,
                 window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """mQ/mO (batch, seqlen_q, heads, d), mK/mV (batch, seqlen_k, heads_k, d) with strides the
        compiler may take as multiples of 8 (one 128-bit copy per 8 elements); mLSE (batch, heads,
        seqlen_q) fp32; mAlibi (batch, heads) fp32 slopes; mSink (heads,) fp32 learnable sink logits
        (`FwdConfig.learnable_sink`); mRng (4,) uint32 dropout state;
        aux_tensors: the mods' tensors (a list); block_sparse: the lists of `BlockSparse.of`
        (`FwdConfig.block_sparse`). In every entry, a tensor the config does not read is None
        (compiled as absent)."""
        args = FwdTensors(mQ, mK, mV, mO, mLSE, None, mAlibi, None, None, None, None, None, None, mRng, aux_tensors,
                          BlockSparse.of(block_sparse), mSink)
        self.launch(args, FwdScalars(0, 1, scale_log2, score_premul, alibi_div, window_left, window_right),
                    (cute.ceil_div(mQ.shape[1], self.t.block_m), mQ.shape[0], mQ.shape[2]), stream)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                    mLSE: cute.Tensor, mAlibi, mSink, mRng, aux_tensors, mCuSeqlensQ: cute.Tensor,
                    mCuSeqlensK: cute.Tensor,
                    mSeqUsedK, mBlockTable,
                    max_seqlen_q: cutlass.Int32,
                    scale_log2: cutlass.Float32, score_premul: cutlass.Float32, alibi_div: cutlass.Float32,
                    window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """Packed batches: mQ/mO (total_q, heads, d), mK/mV (total_k, heads_k, d) or, paged,
        (num_blocks, page_size, heads_k, d) with mBlockTable (batch, max_blocks) int32; mLSE
        (heads, total_q), int32 prefix sums mCuSeqlens* (batch + 1,) and mSeqUsedK (batch,)
        (has_seqused_k). The grid covers max_seqlen_q; CTAs past a sequence's end exit."""
        args = FwdTensors(mQ, mK, mV, mO, mLSE, None, mAlibi, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, None, None,
                          mBlockTable, mRng, aux_tensors, mSink=mSink)
        self.launch(args, FwdScalars(0, 1, scale_log2, score_premul, alibi_div, window_left, window_right),
                    (cute.ceil_div(max_seqlen_q, self.t.block_m), mCuSeqlensQ.shape[0] - 1, mQ.shape[1]), stream)

    @cute.jit
    def call_kvcache(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                     mLSE: cute.Tensor, mOaccum, mLSEaccum, mCounters, mAlibi, mSink, mCacheSeqlens: cute.Tensor,
                     mLeftpadK, mBatchIdx, mBlockTable,
                     k_extra: cutlass.Int32, num_splits: cutlass.Int32,
                     scale_log2: cutlass.Float32, score_premul: cutlass.Float32, alibi_div: cutlass.Float32,
                     window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """Attention over a KV cache: mQ (batch, seqlen_q, heads, d); mK/mV (batch_cache,
        seqlen_cache, heads_k, d) or paged (num_blocks, page_size, heads_k, d); sequence b uses
        keys [leftpad[b], cache_seqlens[b] + k_extra) of cache row batch_idx[b] (or b). mO like
        mQ, mLSE (batch, heads, seqlen_q), mSink (heads,) fp32 learnable sink logits
        (`FwdConfig.learnable_sink`) or None.
        Split (Flash-Decoding): the grid's z holds num_splits x heads; each split writes its
        normalised partial O to mOaccum (num_splits, batch, heads, seqlen_q, kHeadDim) fp32 and
        its LSE (-inf when it saw no key) to mLSEaccum (num_splits, batch, heads, seqlen_q), and
        counts itself in mCounters (m_blocks * batch * heads,) int32, which must be zero at launch
        and is zero again at exit (the three are None in unsplit kernels).
        pack_gqa (seqlen_q 1, flash-attn 2's seqlenq_ngroups_swapped): the g = heads / heads_k query
        heads of a kv head become g query rows, so one CTA reads each K/V tile once for the
        group; mQ/mO are taken as (batch, g, heads_k, d), mLSE as (batch, heads_k, g), and the
        split partials and counters are sized by those."""
        cfg = self.config
        if cutlass.const_expr(cfg.pack_gqa):
            g = mQ.shape[2] // mK.shape[2]
            mQ, mO, mLSE = fold_heads(mQ, g), fold_heads(mO, g), fold_lse(mLSE, g)
        split = None
        if cutlass.const_expr(cfg.split):
            split = SplitWorkspace(mOaccum, mLSEaccum, mCounters)
        args = FwdTensors(mQ, mK, mV, mO, mLSE, split, mAlibi, None, None, mCacheSeqlens, mLeftpadK, mBatchIdx,
                          mBlockTable, mSink=mSink)
        self.launch(args, FwdScalars(k_extra, num_splits, scale_log2, score_premul, alibi_div, window_left,
                                     window_right),
                    (cute.ceil_div(mQ.shape[1], self.t.block_m), mQ.shape[0], mQ.shape[2] * num_splits), stream)

    @cute.jit
    def launch(self, args: FwdTensors, scalars: FwdScalars, grid, stream):
        t = self.t
        sQ_layout = lsmem.smem_layout_q(t)
        sKV_layout = lsmem.smem_layout_kv(t)
        gmem_tiled_copy_QKV = lcopy.gmem_tiled_copy_qkv(t)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        recipe = TileRecipe(
            sQ_layout, sKV_layout, gmem_tiled_copy_QKV,
            lcopy.gmem_tiled_copy_kv_paged(t) if cutlass.const_expr(self.config.paged_runs) else gmem_tiled_copy_QKV,
            lcopy.gmem_tiled_copy_o(t), lmma.tiled_mma(t))
        self.kernel(args, scalars, recipe, SharedStorage).launch(
            grid=grid, block=[t.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, args: FwdTensors, scalars: FwdScalars, recipe: TileRecipe, SharedStorage: cutlass.Constexpr):
        cfg = self.config
        m_block, bidb, bidz = cute.arch.block_idx()
        nheads = args.mQ.shape[cfg.q_head_axis]
        split_idx = 0
        bidh = bidz
        if cutlass.const_expr(cfg.split):
            split_idx = bidz // nheads
            bidh = bidz - split_idx * nheads
        seq, views = self.sequence(args, scalars.k_extra, bidb, bidh)
        split = None
        if cutlass.const_expr(cfg.split):
            split = SplitKV.make(args.split.mOaccum, args.split.mLSEaccum, args.split.mCounters, split_idx,
                                 scalars.num_splits, (m_block, bidb, bidh, nheads), self.t, cute.arch.grid_dim()[0])
        dropout = None
        if cutlass.const_expr(cfg.has_dropout):
            dropout = Dropout.load(args.mRng, bidb, bidh, nheads)
        sparse = None
        if cutlass.const_expr(args.sparse is not None):
            sparse = args.sparse.row(bidb, bidh, m_block)
        if m_block * self.t.block_m < seq.seqlen_q:
            self.attend(CtaTile(m_block, bidb, bidh, split_idx, sparse), seq, views, scalars, recipe, split, dropout,
                        SharedStorage)

    @cute.jit
    def sequence(self, args: FwdTensors, k_extra, bidb, bidh):
        """(SeqInfo, CtaTensors) of sequence bidb, head bidh."""
        cfg = self.config
        mQ, mK, mV, mO, mLSE = args.mQ, args.mK, args.mV, args.mO, args.mLSE
        head_axis = cfg.q_head_axis
        kv_head_axis = 2 if cutlass.const_expr(cfg.paged or not cfg.varlen) else 1
        bidh_kv = bidh // (mQ.shape[head_axis] // mK.shape[kv_head_axis])
        # Key rows the K/V tensors hold for one sequence: the packed total, the cache length, or
        # what the block table addresses; SeqInfo clamps every length read from metadata to it.
        kv_rows = mK.shape[0] if cutlass.const_expr(cfg.varlen) else mK.shape[1]
        if cutlass.const_expr(cfg.paged):
            kv_rows = args.mBlockTable.shape[1] * mK.shape[1]
        if cutlass.const_expr(cfg.varlen):
            seq = SeqInfo.make(bidb, mQ.shape[0], kv_rows, args.mCuSeqlensQ, args.mCuSeqlensK, args.mSeqUsedK,
                               paged=cfg.paged)
            mQ_s = cute.domain_offset((seq.sum_s_q, 0), mQ[None, bidh, None])  # (seqlen_q, d)
            mO_s = cute.domain_offset((seq.sum_s_q, 0), mO[None, bidh, None])
            mLSE_s = cute.domain_offset((seq.sum_s_q,), mLSE[bidh, None])    # (seqlen_q,)
        else:
            seq = SeqInfo.make(bidb, mQ.shape[1], kv_rows, None, None, args.mSeqUsedK, args.mLeftpadK, k_extra)
            mQ_s = mQ[bidb, None, bidh, None]  # (seqlen_q, d)
            mO_s = mO[bidb, None, bidh, None]
            mLSE_s = mLSE[bidb, bidh, None]    # (seqlen_q,)
        mTable = None
        if cutlass.const_expr(cfg.paged):
            mK_s = mK[None, None, bidh_kv, None]  # (num_blocks, page_size, d) pages of this kv head
            mV_s = mV[None, None, bidh_kv, None]
            mTable = args.mBlockTable[bidb, None]  # (max_blocks,)
        elif cutlass.const_expr(cfg.varlen):
            mK_s = cute.domain_offset((seq.sum_s_k, 0), mK[None, bidh_kv, None])  # (seqlen_k, d)
            mV_s = cute.domain_offset((seq.sum_s_k, 0), mV[None, bidh_kv, None])
        else:
            bidb_kv = bidb
            if cutlass.const_expr(cfg.has_batch_idx):  # a bad index reads some cache row, never past them
                bidb_kv = clamp(args.mBatchIdx[bidb], 0, mK.shape[0] - 1)
            mK_s = cute.domain_offset((seq.leftpad_k, 0), mK[bidb_kv, None, bidh_kv, None])  # (seqlen_k, d)
            mV_s = cute.domain_offset((seq.leftpad_k, 0), mV[bidb_kv, None, bidh_kv, None])
        return seq, CtaTensors(mQ_s, mK_s, mV_s, mO_s, mLSE_s, mTable, args.mAlibi, mQ.shape[head_axis + 1],
                               args.aux, args.mSink)

    @cute.jit
    def attend(self, cta: CtaTile, seq: SeqInfo, views: CtaTensors, scalars: FwdScalars, recipe: TileRecipe,
               split, dropout, SharedStorage: cutlass.Constexpr):
        """One CTA's work on (seqlen, d) views of its sequence and head (keys: contiguous, or
        pages through mTable): SeqInfo gives the lengths, so dense, packed and cached batches
        share everything from here on. A split takes its share of the visible key blocks."""
        cfg, t = self.config, self.t
        bm, bn, d = t.block_m, t.block_n, t.head_dim
        m_block = cta.m_block
        tidx, _, _ = cute.arch.thread_idx()
        window = Window(scalars.window_left, scalars.window_right, cfg.has_left, cfg.has_right)
        blocks = BlockRange.make(seq, m_block, bm, bn, window, cta.split_idx, scalars.num_splits, cfg.split)

        gQ = cute.local_tile(views.mQ_s, (bm, d), (m_block, 0))  # (bm, d) tile of this CTA's rows
        cQ = cute.make_identity_tensor((bm, d))   # (bm, d) tile coordinates (row, col)
        cKV = cute.make_identity_tensor((bn, d))  # (bn, d)
        rows_q = seq.seqlen_q - m_block * bm

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(recipe.sQ_layout)    # (bm, d)
        sK = storage.sK.get_tensor(recipe.sKV_layout)   # (bn, d)
        sV = storage.sV.get_tensor(recipe.sKV_layout)   # (bn, d)
        sVt = lsmem.transposed_view(sV)                 # (d, bn)

        gmem_thr_copy_QKV = recipe.gmem_tiled_copy_QKV.get_slice(tidx)
        tQgQ = gmem_thr_copy_QKV.partition_S(gQ)  # (CPY, CPY_M, CPY_K)
        tQsQ = gmem_thr_copy_QKV.partition_D(sQ)  # (CPY, CPY_M, CPY_K)
        tQcQ = gmem_thr_copy_QKV.partition_S(cQ)  # (CPY, CPY_M, CPY_K) coordinates
        tQpQ = column_predicate(tQcQ, views.head_dim)  # (CPY_K,)
        gmem_thr_copy_KV = recipe.gmem_tiled_copy_KV.get_slice(tidx)
        tKsK = gmem_thr_copy_KV.partition_D(sK)  # (KCPY, KCPY_N, KCPY_K)
        tVsV = gmem_thr_copy_KV.partition_D(sV)  # (KCPY, KCPY_N, KCPY_K)
        tKVcKV = gmem_thr_copy_KV.partition_S(cKV)  # (KCPY, KCPY_N, KCPY_K) coordinates
        kv = KVTiles.make(recipe.gmem_tiled_copy_KV, gmem_thr_copy_KV, tKVcKV, column_predicate(tKVcKV, views.head_dim),
                          views.mK_s, views.mV_s, seq.seqlen_k, bn, d, cfg.even_k,
                          lcopy.paged_row_group(t) if cutlass.const_expr(cfg.paged_runs) else None,
                          cfg.any_page_size, views.mTable)

        tiled_mma = recipe.tiled_mma
        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))     # (MMA, MMA_M, MMA_K)
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))     # (MMA, MMA_N, MMA_K)
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))   # (MMA, MMA_K, MMA_N)
        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, d)), cutlass.Float32)  # (MMA, MMA_M, MMA_K)
        acc_o.fill(0.0)
        acc_o_mn = lmma.acc_mn_view(acc_o)  # (rows, cols) of this thread
        tOcO_mn = lmma.acc_mn_view(thr_mma.partition_C(cQ))  # their (row, col) in the tile

        smem_thr_copy_Q = lcopy.smem_tiled_copy_q(t, tiled_mma).get_slice(tidx)
        smem_thr_copy_K = lcopy.smem_tiled_copy_k(t, tiled_mma).get_slice(tidx)
        smem_thr_copy_V = lcopy.smem_tiled_copy_vt(t, tiled_mma).get_slice(tidx)
        mma = MmaOperands(tiled_mma, tSrQ, tSrK, tOrVt, smem_thr_copy_Q, smem_thr_copy_K, smem_thr_copy_V,
                          smem_thr_copy_Q.partition_S(sQ), smem_thr_copy_K.partition_S(sK),
                          smem_thr_copy_V.partition_S(sVt), smem_thr_copy_Q.retile(tSrQ),
                          smem_thr_copy_K.retile(tSrK), smem_thr_copy_V.retile(tOrVt))

        softmax = OnlineSoftmax(cute.size(acc_o_mn.shape[0]), scalars.scale_log2)
        softmax.init_empty()
        mask = Mask(seq.seqlen_q, seq.seqlen_k, window)
        slope = cutlass.Float32(0.0)
        if cutlass.const_expr(cfg.has_alibi):
            slope = views.mAlibi[cta.bidb, cta.bidh] * scalars.alibi_div
        user = None
        if cutlass.const_expr(cfg.mods is not None):
            user = ModCall.make(cfg.mods, cta.bidb, cta.bidh, seq, views.aux, scalars.score_premul)
        mods = ScoreMods(mask, scalars.score_premul, slope, cfg.has_softcap, cfg.has_alibi, (bm, bn), user=user)

        q_copy = (recipe.gmem_tiled_copy_QKV, tQgQ, tQsQ, tQcQ, tQpQ, rows_q)
        if cutlass.const_expr(cta.sparse is not None):
            if cta.sparse.count() > 0:
                loop = LoopState(mma, kv, tKsK, tVsV, acc_o, acc_o_mn, softmax, mods, m_block, 0, dropout)
                self.sparse_mainloop(loop, cta.sparse, seq, window, q_copy)
        elif blocks.n_block_max > blocks.n_block_min:
            loop = LoopState(mma, kv, tKsK, tVsV, acc_o, acc_o_mn, softmax, mods, m_block, blocks.n_block_min,
                             dropout)
            self.mainloop(loop, blocks, seq, window, q_copy)

        # Epilogue (also the early exit: no visible key leaves O = 0 and LSE = +inf, or -inf
        # for a split's partial so that the combine gives it no weight).
        lse = cute.make_rmem_tensor(softmax.row_max.layout, cutlass.Float32)
        sink_log2 = None  # the sink joins the denominator here (`FwdConfig.learnable_sink`)
        if cutlass.const_expr(cfg.learnable_sink and cfg.kvcache):  # per row: folded heads, the first split's
            group = seq.seqlen_q if cutlass.const_expr(cfg.pack_gqa) else 1  # the GQA fold's g rows of one query
            sink_log2 = row_sinks(views.mSink, tOcO_mn, lse.layout, m_block * bm, cta.bidh, group, cta.split_idx == 0)
        elif cutlass.const_expr(cfg.learnable_sink):
            sink_log2 = views.mSink[cta.bidh] * LOG2E
        softmax.finalize(acc_o_mn, lse, -cutlass.Float32.inf if cutlass.const_expr(cfg.split)
                         else cutlass.Float32.inf, sink_log2)
        if cutlass.const_expr(cfg.has_dropout):  # the kept values' 1 / P(keep), once for all of O
            acc_o.store(acc_o.load() * dropout.scale())
        if cutlass.const_expr(cfg.split):
            split.store_partial(acc_o_mn, lse, tOcO_mn, m_block, rows_q)
            # the arrival rank in sQ's first word: the merge's barrier comes after every read of Q
            sRank = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=cutlass.Int32), cute.make_layout(1))
            split.merge(views.mO_s, views.mLSE_s, sRank, m_block, rows_q, cute.arch.thread_idx()[0])
        else:
            self.store(acc_o, lse, tOcO_mn, sQ, views, (m_block, rows_q, cQ), recipe)

    @cute.jit
    def store(self, acc_o, lse, tOcO_mn, sQ, views: CtaTensors, tile, recipe: TileRecipe):
        """O through smem (reusing sQ) to 128-bit stores; one thread of each quad writes its
        rows' LSE. tile: (m_block, rows_q, cQ)."""
        t = self.t
        bm, d = t.block_m, t.head_dim
        m_block, rows_q, cQ = tile
        tidx, _, _ = cute.arch.thread_idx()
        gO = cute.local_tile(views.mO_s, (bm, d), (m_block, 0))  # (bm, d)
        rO = cute.make_fragment_like(acc_o, self.dtype)  # (MMA, MMA_M, MMA_K)
        rO.store(acc_o.load().to(self.dtype))
        sO = cute.make_tensor(sQ.iterator, recipe.sQ_layout)  # (bm, d)
        # sO reuses sQ. The A and C partitions give each warp the same rows, so no warp can
        # overwrite Q rows another still reads; the barrier keeps that reuse safe without relying on it.
        cute.arch.barrier()
        smem_thr_copy_O = lcopy.smem_tiled_copy_o(t, recipe.tiled_mma).get_slice(tidx)
        cute.copy(smem_thr_copy_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))

        if tOcO_mn[0, 0][1] == 0:  # one thread of each quad writes its rows' LSE
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tOcO_mn[r, 0][0]
                if row < rows_q:
                    views.mLSE_s[m_block * bm + row] = lse[r]

        gmem_thr_copy_O = recipe.gmem_tiled_copy_O.get_slice(tidx)
        tOsO = gmem_thr_copy_O.partition_S(sO)  # (CPY, CPY_M, CPY_K)
        tOgO = gmem_thr_copy_O.partition_D(gO)  # (CPY, CPY_M, CPY_K)
        tOcO = gmem_thr_copy_O.partition_D(cQ)  # (CPY, CPY_M, CPY_K) coordinates
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.arch.barrier()
        cute.copy(recipe.gmem_tiled_copy_O, tOsO, tOrO)
        copy_tile(recipe.gmem_tiled_copy_O, tOrO, tOgO, tOcO, column_predicate(tOcO, views.head_dim), rows_q,
                  True, self.config.even_k, False)

    @cute.jit
    def mainloop(self, loop: LoopState, blocks: BlockRange, seq: SeqInfo, window: Window, q_copy):
        """Prologue loads, the first (masked) block, then right-masked, mask-free and
        left-masked blocks in decreasing n. q_copy: (tiled copy, tQgQ, tQsQ, tQcQ, tQpQ, rows_q)."""
        cfg, t = self.config, self.t
        bm, bn = t.block_m, t.block_n
        kv, n_block_min, m_block = loop.kv, blocks.n_block_min, loop.m_block
        # Prologue: Q and the last K block, rows past the sequence ends zero-filled.
        n_last = blocks.n_block_max - 1
        tiled_copy_Q, tQgQ, tQsQ, tQcQ, tQpQ, rows_q = q_copy
        copy_tile(tiled_copy_Q, tQgQ, tQsQ, tQcQ, tQpQ, rows_q, True, cfg.even_k, True)
        pages = kv.page_ids(n_last) if cutlass.const_expr(cfg.overlap_kv) else None
        kv.load(False, n_last, pages, loop.tKsK, True)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(cfg.overlap_kv):
            kv.load(True, n_last, pages, loop.tVsV, True)
            cute.arch.cp_async_commit_group()

        self.step(n_last, loop, is_first=True, masked=True)

        unmasked_lo, unmasked_hi = BlockRange.unmasked(seq, m_block, bm, bn, window)
        right_end = cutlass.max(cutlass.min(unmasked_hi, n_last), n_block_min)
        left_end = cutlass.max(cutlass.min(unmasked_lo, right_end), n_block_min)
        for i in cutlass.range(n_last - right_end, unroll=1):
            self.step(n_last - 1 - i, loop, is_first=False, masked=True)
        for i in cutlass.range(right_end - left_end, unroll=1):
            self.step(right_end - 1 - i, loop, is_first=False, masked=False)
        for i in cutlass.range(left_end - n_block_min, unroll=1):
            self.step(left_end - 1 - i, loop, is_first=False, masked=True)

    @cute.jit
    def sparse_mainloop(self, loop: LoopState, row: SparseRow, seq: SeqInfo, window: Window, q_copy):
        """A block-sparse tile: its row's blocks in list order, a partial one with every mask, a
        full one without the mask_mod (and without the built-in masks where no edge crosses it).
        Any block may hold the sequence's end, so every K / V load checks its rows."""
        bm, bn = self.t.block_m, self.t.block_n
        count = row.count()
        n_first = row.block(0)
        tiled_copy_Q, tQgQ, tQsQ, tQcQ, tQpQ, rows_q = q_copy
        copy_tile(tiled_copy_Q, tQgQ, tQsQ, tQcQ, tQpQ, rows_q, True, self.config.even_k, True)
        loop.kv.load(False, n_first, None, loop.tKsK, True)
        cute.arch.cp_async_commit_group()
        nxt = (row.block(cutlass.min(1, count - 1)), count > 1)
        edges = self.config.has_left or self.config.has_right  # a full block's masks (`SparseRow.visit`)
        if row.is_partial(0):
            self.step(n_first, loop, is_first=True, masked=True, nxt=nxt)
        else:
            self.step(n_first, loop, is_first=True, masked=edges, nxt=nxt, user_mask=False)
        unmasked_lo, unmasked_hi = BlockRange.unmasked(seq, loop.m_block, bm, bn, window)
        for i in cutlass.range(1, count, unroll=1):
            n_block = row.block(i)
            nxt = (row.block(cutlass.min(i + 1, count - 1)), i + 1 < count)
            row.visit(i, n_block, unmasked_lo, unmasked_hi, functools.partial(self.step, n_block, loop, False, nxt=nxt),
                      edges)

    @cute.jit
    def step(self, n_block, loop: LoopState, is_first: cutlass.Constexpr, masked: cutlass.Constexpr, nxt=None,
             user_mask: cutlass.Constexpr = True):
        """One key block: S = Q K^T, modifiers, online softmax, O += P V, with the next K (and,
        in KV-cache kernels, the next V) in flight. Paged KV-cache kernels read block n-1's page
        ids first thing, so the table load is done by the time its copies are issued; paged
        prefill kernels read one page per run of rows just before the run's copies (kv_tiles.py;
        reading them ahead measured no faster: docs/tuning/varlen-paged.md). nxt: a block-sparse
        tile's (next block, whether there is one), its loads row-checked; None: block n - 1, while
        n > n_block_min. user_mask False: a full block, no mask_mod."""
        cfg, t = self.config, self.t
        kv, mma, n_block_min = loop.kv, loop.mma, loop.n_block_min
        acc_s = cute.make_rmem_tensor(mma.tiled_mma.get_slice(0).partition_shape_C((t.block_m, t.block_n)),
                                      cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        acc_s.fill(0.0)

        if cutlass.const_expr(cfg.overlap_kv):
            pages_next = kv.page_ids(n_block - 1)  # for the copies of K[n-1] and V[n-1] below
            cute.arch.cp_async_wait_group(1)  # K[n] (V[n] may still be in flight)
            cute.arch.barrier()
        else:
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            # V[n]: only the first block processed can run past seqlen_k (any one, block-sparse).
            kv.load(True, n_block, None, loop.tVsV, is_first or nxt is not None)
            cute.arch.cp_async_commit_group()

        mma.qk(acc_s)

        if cutlass.const_expr(cfg.overlap_kv):
            cute.arch.barrier()  # every warp is done with sK
            if n_block > n_block_min:
                kv.load(False, n_block - 1, pages_next, loop.tKsK, False)
            cute.arch.cp_async_commit_group()  # possibly empty: keeps the group count fixed
        else:
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if cutlass.const_expr(nxt is None):
                if n_block > n_block_min:
                    kv.load(False, n_block - 1, None, loop.tKsK, False)
                    cute.arch.cp_async_commit_group()
            elif nxt[1]:  # block-sparse: the row's next block, which may hold the sequence's end
                kv.load(False, nxt[0], None, loop.tKsK, True)
                cute.arch.cp_async_commit_group()

        acc_s_mn = loop.mods.apply(mma.tiled_mma, acc_s, loop.m_block, n_block, masked, user_mask)
        loop.softmax.step(acc_s_mn, loop.acc_o_mn, is_first, masked or loop.mods.user is not None)
        if cutlass.const_expr(cfg.has_dropout):  # after the row sums: they are taken before dropout
            tidx, _, _ = cute.arch.thread_idx()
            loop.dropout.apply(mma.tiled_mma, acc_s, sm80_groups(acc_s.shape), tidx, loop.m_block * t.block_m,
                               n_block * t.block_n, (t.block_m, t.block_n), False)

        rP = cute.make_fragment_like(acc_s, self.dtype)  # (MMA, MMA_M, MMA_N)
        rP.store(acc_s.load().to(self.dtype))
        tOrP = lmma.acc_as_a_operand(rP)  # (MMA, MMA_M, MMA_K): P as the A operand of P V
        if cutlass.const_expr(cfg.overlap_kv):
            cute.arch.cp_async_wait_group(1)  # V[n] (K[n-1] may still be in flight)
            cute.arch.barrier()
        mma.pv(loop.acc_o, tOrP)
        if cutlass.const_expr(cfg.overlap_kv):
            cute.arch.barrier()  # every warp is done with sV
            if n_block > n_block_min:
                kv.load(True, n_block - 1, pages_next, loop.tVsV, False)
            cute.arch.cp_async_commit_group()


def entry(config: FwdConfig):
    """The jit function `config` compiles: `__call__` (dense), `call_varlen` or `call_kvcache`."""
    kernel = FlashFwd(config)
    return {"dense": kernel, "varlen": kernel.call_varlen, "kvcache": kernel.call_kvcache}[config.entry]


def fake_args(config: FwdConfig) -> list:
    """Placeholders for compiling `config`'s entry, in its parameter order: every extent dynamic,
    every element-tensor stride but the last a multiple of 8 (the launcher guarantees it), int32
    vectors and tables dense in their last dim; None for every tensor the config does not read
    (the kernel is specialised on its absence, and the caller passes None there)."""
    dtype = element_type(config.traits)

    def elems(rank):
        return fake_tensor(dtype, rank, ALIGN, COPY_BYTES)

    def f32(rank, on=True):
        return fake_tensor(cutlass.Float32, rank) if on else None

    def i32(rank, on=True):
        return fake_tensor(cutlass.Int32, rank) if on else None

    scalars = [1.0, 1.0, 1.0, -1, -1, fake_stream()]  # scales, window edges, stream
    alibi = f32(2, config.has_alibi)
    rng = fake_tensor(cutlass.Uint32, 1) if config.has_dropout else None
    aux = config.mods.fake_aux() if config.mods is not None else None
    sink = f32(1, config.learnable_sink)
    if config.entry == "varlen":
        kv_rank = 4 if config.paged else 3
        return ([elems(3), elems(kv_rank), elems(kv_rank), elems(3), f32(2), alibi, sink, rng, aux, i32(1), i32(1)]
                + [i32(1, config.has_seqused_k), i32(2, config.paged), 1] + scalars)
    if config.entry == "kvcache":
        split = config.split
        accum = (fake_tensor(cutlass.Float32, 5, ALIGN, COPY_BYTES, last_extent=config.traits.head_dim)
                 if split else None)
        return ([elems(4), elems(4), elems(4), elems(4), f32(3), accum, f32(4, split), i32(1, split), alibi, sink,
                 i32(1)]
                + [i32(1, config.has_leftpad), i32(1, config.has_batch_idx), i32(2, config.paged), 0, 1] + scalars)
    sparse = fake_block_sparse() if config.block_sparse else None
    return [elems(4) for _ in range(4)] + [f32(3), alibi, sink, rng, aux, sparse] + scalars
