"""The FA2 forward kernel (the seed's compute_attn_1rowblock) and its torch-side launcher.

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

Reverse order means only the first block processed can run past seqlen_k. Blocks that a
diagonal or window edge crosses are masked; the rest run a mask-free step.

The KV-cache entry (`call_kvcache`, Flash-Decoding) runs the same loop over one split's share
of the key blocks, reading keys from a cache row or through a block table (`KVTiles`), and
issues K[n-1] after S and V[n-1] after P V, so both travel together: decode is memory-bound.
Each split writes fp32 partials (O, LSE); the split CTA of a tile that finishes last merges
them (`merge_splits`, with `combine.SplitCombine.combine_tile`), so a split call is one launch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch

from cute_flash.compile_cache import get_or_compile
from cute_flash.kernels.block_info import BlockInfo, clamp
from cute_flash.kernels.combine import SplitCombine
from cute_flash.kernels.fake import compile_tvm_ffi, fake_stream, fake_tensor, ffi_function
from cute_flash.kernels.kv_tiles import KVTiles
from cute_flash.kernels.gemm import gemm_rs, gemm_ss
from cute_flash.kernels.mask import Mask, apply_alibi
from cute_flash.kernels.softmax import OnlineSoftmax
from cute_flash.kernels.tile_copy import column_predicate, copy_tile
from layouts import copy as lcopy
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.traits import FwdTraits, choose_decode_traits, choose_fwd_traits, element_type, num_splits_heuristic

LOG2E = math.log2(math.e)


@cute.jit
def fold_heads(t: cute.Tensor, g):
    """(batch, 1, heads, d) as (batch, g, heads / g, d): head kh * g + j at (j, kh)."""
    return cute.make_tensor(t.iterator, cute.make_layout(
        (t.shape[0], g, t.shape[2] // g, t.shape[3]), stride=(t.stride[0], t.stride[2], t.stride[2] * g, 1)))


class FlashFwd(SplitCombine):
    """Compile-time configuration: traits, the mask/modifier flags, and the input form (dense;
    varlen; kvcache, with paged / split / has_leftpad / has_batch_idx / pack_gqa). Each
    combination is one compiled kernel; everything else (lengths, strides, window sizes,
    scales, the split count) is a run-time argument."""

    def __init__(self, traits: FwdTraits, has_left: bool = False, has_right: bool = False,
                 has_alibi: bool = False, has_softcap: bool = False, even_k: bool = True,
                 varlen: bool = False, has_seqused_k: bool = False, paged: bool = False,
                 kvcache: bool = False, split: bool = False, has_leftpad: bool = False,
                 has_batch_idx: bool = False, pack_gqa: bool = False, any_page_size: bool = False):
        if kvcache and varlen:
            raise ValueError("kvcache and varlen are two different entry points")
        if (split or has_leftpad or has_batch_idx) and not kvcache:
            raise ValueError("split, has_leftpad and has_batch_idx belong to the kvcache entry")
        if paged and not (varlen or kvcache):
            raise ValueError("paged KV needs the varlen or kvcache entry")
        if paged and (has_leftpad or has_batch_idx):
            raise ValueError("a paged cache has neither leftpad nor cache_batch_idx (as in flash-attn)")
        if any_page_size and not paged:
            raise ValueError("any_page_size is a form of paged KV")
        if pack_gqa and not (kvcache and not (has_left or has_right or has_alibi)):
            raise ValueError("pack_gqa folds single-row decode queries: kvcache, no window, no ALiBi")
        self.t = traits
        self.varlen = varlen
        self.kvcache = kvcache
        self.has_seqused_k = has_seqused_k or kvcache
        self.paged = paged
        self.split = split
        self.has_leftpad = has_leftpad
        self.has_batch_idx = has_batch_idx
        self.pack_gqa = pack_gqa
        # KV-cache kernels are memory-bound with few key blocks per split: keep K[n-1] and
        # V[n-1] in flight together (one memory latency per block instead of two), at the
        # price of two more barriers per block.
        self.overlap_kv = kvcache
        # Pages of a multiple of 16 rows: paged prefill gathers K/V in runs of rows that share a
        # page, KV-cache kernels share page ids across a warp. Other page sizes: each row looks
        # its page up (kv_tiles.py).
        self.any_page_size = any_page_size
        self.paged_runs = paged and not kvcache and not any_page_size
        self.has_left = has_left
        self.has_right = has_right
        self.has_alibi = has_alibi
        self.has_softcap = has_softcap
        self.even_k = even_k
        self.dtype = element_type(traits)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mAlibi: cute.Tensor,
                 scale_log2: cutlass.Float32, score_premul: cutlass.Float32, alibi_div: cutlass.Float32,
                 window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """mQ/mO (batch, seqlen_q, heads, d), mK/mV (batch, seqlen_k, heads_k, d) with strides the
        compiler may take as multiples of 8 (one 128-bit copy per 8 elements); mLSE (batch, heads,
        seqlen_q) fp32; mAlibi (batch, heads) fp32 slopes (any tensor when has_alibi is off)."""
        self.launch(mQ, mK, mV, mO, mLSE, None, mAlibi, None, None, None, None, None, None, 0, 1,
                    (cute.ceil_div(mQ.shape[1], self.t.block_m), mQ.shape[0], mQ.shape[2]),
                    scale_log2, score_premul, alibi_div, window_left, window_right, stream)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                    mLSE: cute.Tensor, mAlibi: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                    mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor, mBlockTable: cute.Tensor,
                    max_seqlen_q: cutlass.Int32,
                    scale_log2: cutlass.Float32, score_premul: cutlass.Float32, alibi_div: cutlass.Float32,
                    window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """Packed batches: mQ/mO (total_q, heads, d), mK/mV (total_k, heads_k, d) or, paged,
        (num_blocks, page_size, heads_k, d) with mBlockTable (batch, max_blocks) int32; mLSE
        (heads, total_q), int32 prefix sums mCuSeqlens* (batch + 1,) and mSeqUsedK (batch,)
        (ignored unless has_seqused_k). The grid covers max_seqlen_q; CTAs past a sequence's end exit."""
        self.launch(mQ, mK, mV, mO, mLSE, None, mAlibi, mCuSeqlensQ, mCuSeqlensK,
                    mSeqUsedK if cutlass.const_expr(self.has_seqused_k) else None, None, None,
                    mBlockTable if cutlass.const_expr(self.paged) else None, 0, 1,
                    (cute.ceil_div(max_seqlen_q, self.t.block_m), mCuSeqlensQ.shape[0] - 1, mQ.shape[1]),
                    scale_log2, score_premul, alibi_div, window_left, window_right, stream)

    @cute.jit
    def call_kvcache(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                     mLSE: cute.Tensor, mOaccum: cute.Tensor, mLSEaccum: cute.Tensor,
                     mCounters: cute.Tensor, mAlibi: cute.Tensor, mCacheSeqlens: cute.Tensor,
                     mLeftpadK: cute.Tensor, mBatchIdx: cute.Tensor, mBlockTable: cute.Tensor,
                     k_extra: cutlass.Int32, num_splits: cutlass.Int32,
                     scale_log2: cutlass.Float32, score_premul: cutlass.Float32, alibi_div: cutlass.Float32,
                     window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """Attention over a KV cache: mQ (batch, seqlen_q, heads, d); mK/mV (batch_cache,
        seqlen_cache, heads_k, d) or paged (num_blocks, page_size, heads_k, d); sequence b uses
        keys [leftpad[b], cache_seqlens[b] + k_extra) of cache row batch_idx[b] (or b). mO like
        mQ, mLSE (batch, heads, seqlen_q).
        Split (Flash-Decoding): the grid's z holds num_splits x heads; each split writes its
        normalised partial O to mOaccum (num_splits, batch, heads, seqlen_q, kHeadDim) fp32 and
        its LSE (-inf when it saw no key) to mLSEaccum (num_splits, batch, heads, seqlen_q), and
        counts itself in mCounters (m_blocks * batch * heads,) int32, which must be zero at launch
        and is zero again at exit. Unsplit kernels ignore the three.
        pack_gqa (seqlen_q 1, the seed's seqlenq_ngroups_swapped): the g = heads / heads_k query
        heads of a kv head become g query rows, so one CTA reads each K/V tile once for the
        group; mQ/mO are taken as (batch, g, heads_k, d), mLSE as (batch, heads_k, g), and the
        split partials and counters are sized by those."""
        if cutlass.const_expr(self.pack_gqa):
            g = mQ.shape[2] // mK.shape[2]
            mQ, mO = fold_heads(mQ, g), fold_heads(mO, g)
            mLSE = cute.make_tensor(mLSE.iterator, cute.make_layout(
                (mLSE.shape[0], mLSE.shape[1] // g, g), stride=(mLSE.stride[0], mLSE.stride[1] * g, mLSE.stride[1])))
        split_ws = None
        if cutlass.const_expr(self.split):
            split_ws = (mOaccum, mLSEaccum, mCounters)
        self.launch(mQ, mK, mV, mO, mLSE, split_ws, mAlibi, None, None, mCacheSeqlens,
                    mLeftpadK if cutlass.const_expr(self.has_leftpad) else None,
                    mBatchIdx if cutlass.const_expr(self.has_batch_idx) else None,
                    mBlockTable if cutlass.const_expr(self.paged) else None, k_extra, num_splits,
                    (cute.ceil_div(mQ.shape[1], self.t.block_m), mQ.shape[0], mQ.shape[2] * num_splits),
                    scale_log2, score_premul, alibi_div, window_left, window_right, stream)

    @cute.jit
    def launch(self, mQ, mK, mV, mO, mLSE, split_ws, mAlibi, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mLeftpadK,
               mBatchIdx, mBlockTable, k_extra, num_splits, grid,
               scale_log2, score_premul, alibi_div, window_left, window_right, stream):
        t = self.t
        sQ_layout = lsmem.smem_layout_q(t)
        sKV_layout = lsmem.smem_layout_kv(t)
        gmem_tiled_copy_QKV = lcopy.gmem_tiled_copy_qkv(t)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        self.kernel(
            mQ, mK, mV, mO, mLSE, split_ws, mAlibi, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mLeftpadK, mBatchIdx,
            mBlockTable, k_extra, num_splits, sQ_layout, sKV_layout,
            gmem_tiled_copy_QKV,
            lcopy.gmem_tiled_copy_kv_paged(t) if cutlass.const_expr(self.paged_runs) else gmem_tiled_copy_QKV,
            lcopy.gmem_tiled_copy_o(t), lmma.tiled_mma(t),
            scale_log2, score_premul, alibi_div, window_left, window_right, SharedStorage,
        ).launch(grid=grid, block=[t.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, split_ws, mAlibi: cute.Tensor, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mLeftpadK,
               mBatchIdx, mBlockTable, k_extra, num_splits,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               gmem_tiled_copy_QKV: cute.TiledCopy, gmem_tiled_copy_KV: cute.TiledCopy,
               gmem_tiled_copy_O: cute.TiledCopy,
               tiled_mma: cute.TiledMma, scale_log2: cutlass.Float32, score_premul: cutlass.Float32,
               alibi_div: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32,
               SharedStorage: cutlass.Constexpr):
        m_block, bidb, bidz = cute.arch.block_idx()
        head_axis = 1 if cutlass.const_expr(self.varlen) else 2
        nheads = mQ.shape[head_axis]
        kv_head_axis = 2 if cutlass.const_expr(self.paged or not self.varlen) else 1
        split_idx = 0
        bidh = bidz
        if cutlass.const_expr(self.split):
            split_idx = bidz // nheads
            bidh = bidz - split_idx * nheads
        bidh_kv = bidh // (nheads // mK.shape[kv_head_axis])
        # Key rows the K/V tensors hold for one sequence: the packed total, the cache length, or
        # what the block table addresses; BlockInfo clamps every length read from metadata to it.
        kv_rows = mK.shape[0] if cutlass.const_expr(self.varlen) else mK.shape[1]
        if cutlass.const_expr(self.paged):
            kv_rows = mBlockTable.shape[1] * mK.shape[1]
        # (seqlen, d) views of this sequence and head; LSE (seqlen,)
        if cutlass.const_expr(self.varlen):
            binfo = BlockInfo(bidb, mQ.shape[0], kv_rows, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, paged=self.paged)
            mQ_s = cute.domain_offset((binfo.sum_s_q, 0), mQ[None, bidh, None])
            mO_s = cute.domain_offset((binfo.sum_s_q, 0), mO[None, bidh, None])
            mLSE_s = cute.domain_offset((binfo.sum_s_q,), mLSE[bidh, None])
        else:
            binfo = BlockInfo(bidb, mQ.shape[1], kv_rows, None, None, mSeqUsedK, mLeftpadK, k_extra)
            mQ_s = mQ[bidb, None, bidh, None]
            mO_s = mO[bidb, None, bidh, None]
            mLSE_s = mLSE[bidb, bidh, None]
        mTable = None
        if cutlass.const_expr(self.paged):
            # (num_blocks, page_size, d) pages of this kv head and the sequence's page list
            mK_s = mK[None, None, bidh_kv, None]
            mV_s = mV[None, None, bidh_kv, None]
            mTable = mBlockTable[bidb, None]
        elif cutlass.const_expr(self.varlen):
            mK_s = cute.domain_offset((binfo.sum_s_k, 0), mK[None, bidh_kv, None])
            mV_s = cute.domain_offset((binfo.sum_s_k, 0), mV[None, bidh_kv, None])
        else:
            bidb_kv = bidb
            if cutlass.const_expr(self.has_batch_idx):  # a bad index reads some cache row, never past them
                bidb_kv = clamp(mBatchIdx[bidb], 0, mK.shape[0] - 1)
            mK_s = cute.domain_offset((binfo.leftpad_k, 0), mK[bidb_kv, None, bidh_kv, None])
            mV_s = cute.domain_offset((binfo.leftpad_k, 0), mV[bidb_kv, None, bidh_kv, None])
        split_out = None
        if cutlass.const_expr(self.split):
            # this split's partials, every split's partials of this (batch, head), and the
            # tile's arrival counter
            mOaccum, mLSEaccum, mCounters = split_ws
            num_m_blocks, _, _ = cute.arch.grid_dim()
            split_out = (mOaccum[split_idx, bidb, bidh, None, None], mLSEaccum[split_idx, bidb, bidh, None],
                         mOaccum[None, bidb, bidh, None, None], mLSEaccum[None, bidb, bidh, None],
                         mCounters.iterator + (bidb * nheads + bidh) * num_m_blocks + m_block)
        if m_block * self.t.block_m < binfo.seqlen_q:
            self.attend(mQ_s, mK_s, mV_s, mTable, mO_s, mLSE_s, split_out, mAlibi, binfo, m_block, bidb, bidh,
                        split_idx, num_splits, mQ.shape[head_axis + 1], sQ_layout, sKV_layout,
                        gmem_tiled_copy_QKV, gmem_tiled_copy_KV, gmem_tiled_copy_O, tiled_mma, scale_log2, score_premul,
                        alibi_div, window_left, window_right, SharedStorage)

    @cute.jit
    def attend(self, mQ_s: cute.Tensor, mK_s: cute.Tensor, mV_s: cute.Tensor, mTable, mO_s: cute.Tensor,
               mLSE_s: cute.Tensor, split_out, mAlibi: cute.Tensor, binfo: BlockInfo, m_block, bidb, bidh,
               split_idx, num_splits, head_dim,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               gmem_tiled_copy_QKV: cute.TiledCopy, gmem_tiled_copy_KV: cute.TiledCopy,
               gmem_tiled_copy_O: cute.TiledCopy,
               tiled_mma: cute.TiledMma, scale_log2: cutlass.Float32, score_premul: cutlass.Float32,
               alibi_div: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32,
               SharedStorage: cutlass.Constexpr):
        """One CTA's work on (seqlen, d) views of its sequence and head (keys: contiguous, or
        pages through mTable): BlockInfo gives the lengths, so dense, packed and cached batches
        share everything from here on. A split takes its share of the visible key blocks."""
        t = self.t
        bm, bn, d = t.block_m, t.block_n, t.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        n_block_min, n_block_max = binfo.n_block_range(
            m_block, bm, bn, window_left, window_right, self.has_left, self.has_right)
        if cutlass.const_expr(self.split):
            per_split = cute.ceil_div(n_block_max - n_block_min, num_splits)
            n_block_min = n_block_min + split_idx * per_split
            n_block_max = cutlass.min(n_block_max, n_block_min + per_split)

        # (bm, d) tiles of this CTA's rows
        gQ = cute.local_tile(mQ_s, (bm, d), (m_block, 0))
        cQ = cute.make_identity_tensor((bm, d))   # tile coordinates (row, col)
        cKV = cute.make_identity_tensor((bn, d))
        rows_q = binfo.seqlen_q - m_block * bm

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sVt = lsmem.transposed_view(sV)  # (d, bn)

        gmem_thr_copy_QKV = gmem_tiled_copy_QKV.get_slice(tidx)
        tQgQ = gmem_thr_copy_QKV.partition_S(gQ)
        tQsQ = gmem_thr_copy_QKV.partition_D(sQ)
        tQcQ = gmem_thr_copy_QKV.partition_S(cQ)
        tQpQ = column_predicate(tQcQ, head_dim)
        gmem_thr_copy_KV = gmem_tiled_copy_KV.get_slice(tidx)
        tKsK = gmem_thr_copy_KV.partition_D(sK)  # (KCPY, KCPY_N, KCPY_K)
        tVsV = gmem_thr_copy_KV.partition_D(sV)
        tKVcKV = gmem_thr_copy_KV.partition_S(cKV)
        kv = KVTiles.make(gmem_tiled_copy_KV, gmem_thr_copy_KV, tKVcKV, column_predicate(tKVcKV, head_dim),
                          mK_s, mV_s, binfo.seqlen_k, bn, d, self.even_k,
                          lcopy.paged_row_group(t) if cutlass.const_expr(self.paged_runs) else None,
                          self.any_page_size, mTable)

        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))     # (MMA, MMA_M, MMA_K)
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))     # (MMA, MMA_N, MMA_K)
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))   # (MMA, MMA_K, MMA_N)
        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, d)), cutlass.Float32)
        acc_o.fill(0.0)
        acc_o_mn = lmma.acc_mn_view(acc_o)
        tOcO_mn = lmma.acc_mn_view(thr_mma.partition_C(cQ))

        smem_thr_copy_Q = lcopy.smem_tiled_copy_q(t, tiled_mma).get_slice(tidx)
        smem_thr_copy_K = lcopy.smem_tiled_copy_k(t, tiled_mma).get_slice(tidx)
        smem_thr_copy_V = lcopy.smem_tiled_copy_vt(t, tiled_mma).get_slice(tidx)
        # (tiled copy, smem partition, register view) per MMA operand
        ops = (
            smem_thr_copy_Q, smem_thr_copy_Q.partition_S(sQ), smem_thr_copy_Q.retile(tSrQ),
            smem_thr_copy_K, smem_thr_copy_K.partition_S(sK), smem_thr_copy_K.retile(tSrK),
            smem_thr_copy_V, smem_thr_copy_V.partition_S(sVt), smem_thr_copy_V.retile(tOrVt),
        )

        softmax = OnlineSoftmax(cute.size(acc_o_mn.shape[0]), scale_log2)
        softmax.init_empty()
        mask = Mask(binfo.seqlen_q, binfo.seqlen_k, window_left, window_right, self.has_left, self.has_right)
        slope = cutlass.Float32(0.0)
        if cutlass.const_expr(self.has_alibi):
            slope = mAlibi[bidb, bidh] * alibi_div

        if n_block_max > n_block_min:
            self.mainloop(
                n_block_min, n_block_max, m_block, rows_q, binfo, window_left, window_right,
                tiled_mma, gmem_tiled_copy_QKV, tQgQ, tQsQ, tQcQ, tQpQ,
                kv, tKsK, tVsV, tSrQ, tSrK, tOrVt, acc_o, acc_o_mn,
                ops, softmax, mask, score_premul, slope)

        # Epilogue (also the early exit: no visible key leaves O = 0 and LSE = +inf, or -inf
        # for a split's partial so that the combine gives it no weight).
        lse = cute.make_rmem_tensor(softmax.row_max.layout, cutlass.Float32)
        softmax.finalize(acc_o_mn, lse, -cutlass.Float32.inf if cutlass.const_expr(self.split)
                         else cutlass.Float32.inf)
        if cutlass.const_expr(self.split):
            mOpart, mLSEpart, mOaccum_bh, mLSEaccum_bh, counter = split_out
            self.store_partial(acc_o_mn, lse, tOcO_mn, mOpart, mLSEpart, m_block, rows_q)
            self.merge_splits(mOaccum_bh, mLSEaccum_bh, mO_s, mLSE_s, counter, sQ, m_block, rows_q,
                              num_splits)
        else:
            self.store(acc_o, lse, tOcO_mn, sQ, sQ_layout, mO_s, mLSE_s, cQ, m_block, rows_q, head_dim,
                       tiled_mma, gmem_tiled_copy_O)

    @cute.jit
    def store_partial(self, acc_o_mn, lse, tOcO_mn, mO_s, mLSE_s, m_block, rows_q):
        """A split's normalised fp32 O and its LSE, straight from the accumulator: decode tiles
        have few rows, so the smem staging of `store` would buy nothing."""
        row0 = m_block * self.t.block_m
        for r in cutlass.range_constexpr(cute.size(acc_o_mn.shape[0])):
            row = tOcO_mn[r, 0][0]
            if row < rows_q:
                for c in cutlass.range_constexpr(cute.size(acc_o_mn.shape[1])):
                    mO_s[row0 + row, tOcO_mn[0, c][1]] = acc_o_mn[r, c]
                if tOcO_mn[0, 0][1] == 0:
                    mLSE_s[row0 + row] = lse[r]

    @cute.jit
    def merge_splits(self, mOaccum_bh, mLSEaccum_bh, mO_s, mLSE_s, counter, sQ, m_block, rows_q, num_splits):
        """The split CTA of this tile that arrives last merges every split's partials into O and
        LSE; the others just leave. Each thread publishes its partials with a device-scope fence
        before one thread counts the CTA's arrival, and the merging CTA fences again before
        reading them. The last arrival also re-arms the counter for the next launch."""
        tidx, _, _ = cute.arch.thread_idx()
        bm = self.t.block_m
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()  # also: every warp is done with sQ, which now holds the arrival rank
        sRank = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=cutlass.Int32), cute.make_layout(1))
        if tidx == 0:
            sRank[0] = cute.arch.atomic_add(counter, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier()
        if sRank[0] == num_splits - 1:
            if tidx == 0:
                cute.make_tensor(counter, cute.make_layout(1))[0] = cutlass.Int32(0)
            cute.arch.fence_acq_rel_gpu()
            row0 = m_block * bm
            self.combine_tile(cute.domain_offset((0, row0, 0), mOaccum_bh),
                              cute.domain_offset((0, row0), mLSEaccum_bh), cute.domain_offset((row0, 0), mO_s),
                              cute.domain_offset((row0,), mLSE_s), cutlass.min(rows_q, bm))

    @cute.jit
    def store(self, acc_o, lse, tOcO_mn, sQ, sQ_layout, mO_s, mLSE_s, cQ, m_block, rows_q, head_dim,
              tiled_mma, gmem_tiled_copy_O):
        """O through smem (reusing sQ) to 128-bit stores; one thread of each quad writes its rows' LSE."""
        t = self.t
        bm, d = t.block_m, t.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        gO = cute.local_tile(mO_s, (bm, d), (m_block, 0))
        rO = cute.make_fragment_like(acc_o, self.dtype)
        rO.store(acc_o.load().to(self.dtype))
        sO = cute.make_tensor(sQ.iterator, sQ_layout)
        # sO reuses sQ. The A and C partitions give each warp the same rows, so no warp can
        # overwrite Q rows another still reads; the barrier keeps that reuse safe without relying on it.
        cute.arch.barrier()
        smem_thr_copy_O = lcopy.smem_tiled_copy_o(t, tiled_mma).get_slice(tidx)
        cute.copy(smem_thr_copy_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))

        if tOcO_mn[0, 0][1] == 0:  # one thread of each quad writes its rows' LSE
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tOcO_mn[r, 0][0]
                if row < rows_q:
                    mLSE_s[m_block * bm + row] = lse[r]

        gmem_thr_copy_O = gmem_tiled_copy_O.get_slice(tidx)
        tOsO = gmem_thr_copy_O.partition_S(sO)
        tOgO = gmem_thr_copy_O.partition_D(gO)
        tOcO = gmem_thr_copy_O.partition_D(cQ)
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.arch.barrier()
        cute.copy(gmem_tiled_copy_O, tOsO, tOrO)
        copy_tile(gmem_tiled_copy_O, tOrO, tOgO, tOcO, column_predicate(tOcO, head_dim), rows_q,
                  True, self.even_k, False)

    @cute.jit
    def mainloop(self, n_block_min, n_block_max, m_block, rows_q, binfo, window_left, window_right,
                 tiled_mma, gmem_tiled_copy_QKV, tQgQ, tQsQ, tQcQ, tQpQ,
                 kv, tKsK, tVsV, tSrQ, tSrK, tOrVt, acc_o, acc_o_mn,
                 ops, softmax, mask, score_premul, slope):
        """Prologue loads, the first (masked) block, then right-masked, mask-free and
        left-masked blocks in decreasing n."""
        t = self.t
        bm, bn = t.block_m, t.block_n
        # Prologue: Q and the last K block, rows past the sequence ends zero-filled.
        n_last = n_block_max - 1
        copy_tile(gmem_tiled_copy_QKV, tQgQ, tQsQ, tQcQ, tQpQ, rows_q, True, self.even_k, True)
        pages = kv.page_ids(n_last) if cutlass.const_expr(self.overlap_kv) else None
        kv.load(False, n_last, pages, tKsK, True)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.overlap_kv):
            kv.load(True, n_last, pages, tVsV, True)
            cute.arch.cp_async_commit_group()

        step_args = (tiled_mma, kv, tKsK, tVsV,
                     tSrQ, tSrK, tOrVt, acc_o, acc_o_mn, ops, softmax, mask,
                     binfo, m_block, n_block_min, score_premul, slope)
        self.step(n_last, *step_args, is_first=True, masked=True)

        unmasked_lo, unmasked_hi = binfo.unmasked_range(
            m_block, bm, bn, window_left, window_right, self.has_left, self.has_right)
        right_end = cutlass.max(cutlass.min(unmasked_hi, n_last), n_block_min)
        left_end = cutlass.max(cutlass.min(unmasked_lo, right_end), n_block_min)
        for i in cutlass.range(n_last - right_end, unroll=1):
            self.step(n_last - 1 - i, *step_args, is_first=False, masked=True)
        for i in cutlass.range(right_end - left_end, unroll=1):
            self.step(right_end - 1 - i, *step_args, is_first=False, masked=False)
        for i in cutlass.range(left_end - n_block_min, unroll=1):
            self.step(left_end - 1 - i, *step_args, is_first=False, masked=True)

    @cute.jit
    def step(self, n_block, tiled_mma, kv, tKsK, tVsV,
             tSrQ, tSrK, tOrVt, acc_o, acc_o_mn, ops, softmax, mask, binfo, m_block,
             n_block_min, score_premul, slope, is_first: cutlass.Constexpr, masked: cutlass.Constexpr):
        """One key block: S = Q K^T, modifiers, online softmax, O += P V, with the next K (and,
        in KV-cache kernels, the next V) in flight. Paged KV-cache kernels read block n-1's page
        ids first thing, so the table load is done by the time its copies are issued; paged
        prefill kernels read one page per run of rows just before the run's copies (kv_tiles.py;
        reading them ahead measured no faster: docs/perf.md)."""
        t = self.t
        copy_Q, tSsQ, tSrQ_view, copy_K, tSsK, tSrK_view, copy_V, tOsVt, tOrVt_view = ops
        acc_s = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_C((t.block_m, t.block_n)),
                                      cutlass.Float32)
        acc_s.fill(0.0)

        if cutlass.const_expr(self.overlap_kv):
            pages_next = kv.page_ids(n_block - 1)  # for the copies of K[n-1] and V[n-1] below
            cute.arch.cp_async_wait_group(1)  # K[n] (V[n] may still be in flight)
            cute.arch.barrier()
        else:
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            # V[n]: only the first block processed can run past seqlen_k.
            kv.load(True, n_block, None, tVsV, is_first)
            cute.arch.cp_async_commit_group()

        gemm_ss(tiled_mma, acc_s, copy_Q, tSsQ, tSrQ_view, tSrQ, copy_K, tSsK, tSrK_view, tSrK)

        if cutlass.const_expr(self.overlap_kv):
            cute.arch.barrier()  # every warp is done with sK
            if n_block > n_block_min:
                kv.load(False, n_block - 1, pages_next, tKsK, False)
            cute.arch.cp_async_commit_group()  # possibly empty: keeps the group count fixed
        else:
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if n_block > n_block_min:
                kv.load(False, n_block - 1, None, tKsK, False)
                cute.arch.cp_async_commit_group()

        acc_s_mn = lmma.acc_mn_view(acc_s)
        if cutlass.const_expr(self.has_softcap):
            for i in cutlass.range(cute.size(acc_s), unroll_full=True):
                acc_s[i] = cute.math.tanh(acc_s[i] * score_premul, fastmath=True)
        row0 = m_block * t.block_m
        col0 = n_block * t.block_n
        # (row, col) of each S element this thread holds; built here, not hoisted out of the
        # loop, so the coordinates are rematerialised instead of occupying registers.
        tScS_mn = None
        if cutlass.const_expr(masked or self.has_alibi):
            tidx, _, _ = cute.arch.thread_idx()
            cS = cute.make_identity_tensor((t.block_m, t.block_n))
            tScS_mn = lmma.acc_mn_view(tiled_mma.get_slice(tidx).partition_C(cS))
        if cutlass.const_expr(self.has_alibi):
            apply_alibi(acc_s_mn, tScS_mn, row0, col0, binfo.seqlen_k - binfo.seqlen_q, slope)
        if cutlass.const_expr(masked):
            mask.apply(acc_s_mn, tScS_mn, row0, col0)
        softmax.step(acc_s_mn, acc_o_mn, is_first, masked)

        rP = cute.make_fragment_like(acc_s, self.dtype)
        rP.store(acc_s.load().to(self.dtype))
        tOrP = lmma.acc_as_a_operand(rP)
        if cutlass.const_expr(self.overlap_kv):
            cute.arch.cp_async_wait_group(1)  # V[n] (K[n-1] may still be in flight)
            cute.arch.barrier()
        gemm_rs(tiled_mma, acc_o, tOrP, copy_V, tOsVt, tOrVt_view, tOrVt)
        if cutlass.const_expr(self.overlap_kv):
            cute.arch.barrier()  # every warp is done with sV
            if n_block > n_block_min:
                kv.load(True, n_block - 1, pages_next, tVsV, False)
            cute.arch.cp_async_commit_group()


# ---------------------------------------------------------------------------------------------
# Host side: compile (cached) and launch on torch tensors.

_ALIGN = 8  # elements per 16-byte copy
PAGE_ROWS = 16  # pages of a multiple of this many rows take the page-run / shared-page-id copies
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_ELEMENT = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}


def fake_fwd_args(kernel: FlashFwd):
    """Placeholders for compiling `kernel`'s entry: every extent dynamic, every element-tensor
    stride but the last a multiple of 8 (the launcher guarantees it), int32 vectors and tables
    dense in their last dim, plus a stream taken from the caller (torch's current stream) at
    call time."""

    def elems(rank):
        return fake_tensor(kernel.dtype, rank, _ALIGN, 16)

    def f32(rank):
        return fake_tensor(cutlass.Float32, rank)

    def i32(rank):
        return fake_tensor(cutlass.Int32, rank)

    scalars = [1.0, 1.0, 1.0, -1, -1, fake_stream()]
    kv_rank = 4 if kernel.paged or not kernel.varlen else 3
    if kernel.varlen:
        return ([elems(3), elems(kv_rank), elems(kv_rank), elems(3), f32(2), f32(2)]
                + [i32(1), i32(1), i32(1), i32(2), 1] + scalars)
    if kernel.kvcache:
        accum = fake_tensor(cutlass.Float32, 5, _ALIGN, 16, last_extent=kernel.t.head_dim)
        return ([elems(4), elems(4), elems(4), elems(4), f32(3), accum, f32(4), i32(1), f32(2)]
                + [i32(1), i32(1), i32(1), i32(2), 0, 1] + scalars)
    return [elems(4) for _ in range(4)] + [f32(3), f32(2)] + scalars


def compile_fwd(kernel: FlashFwd, arch: int | None = None, extra_options: str = ""):
    """Build the cubin for `kernel`, callable through TVM-FFI with torch tensors. arch=None
    targets the current GPU; an explicit arch (80, 90) needs no GPU (nothing is launched)."""
    entry = kernel.call_varlen if kernel.varlen else kernel.call_kvcache if kernel.kvcache else kernel
    return compile_tvm_ffi(entry, fake_fwd_args(kernel), arch, extra_options)


def fwd_kernel_key(traits: FwdTraits, **flags):
    """flags: FlashFwd's constructor flags by name (those left out are off)."""
    return ("fwd", traits) + tuple(sorted((name, bool(on)) for name, on in flags.items() if on))


def _is_aligned(x) -> bool:
    """Do x's rows suit 128-bit copies: unit last stride, every other stride and the base
    address 16-byte aligned, head dim a multiple of 8. Checked without generators: this runs on
    every call."""
    shape, stride = x.shape, x.stride()
    low_bits = 0
    for s in stride[:-1]:
        low_bits |= s
    return shape[-1] % _ALIGN == 0 and stride[-1] == 1 and low_bits % _ALIGN == 0 and x.data_ptr() % 16 == 0


def _aligned(x):
    """x itself when `_is_aligned`, else a view or copy that is: zero-padded to a multiple of 8
    in the head dim, as flash-attn pads, or a fresh contiguous copy. A size-1 dim whose stride is
    not a multiple of 8 gets stride 0 (never stepped, and trivially aligned), without a copy."""
    if _is_aligned(x):
        return x
    shape, stride = x.shape, x.stride()
    if shape[-1] % _ALIGN:
        x = torch.nn.functional.pad(x, (0, _ALIGN - shape[-1] % _ALIGN))
    elif stride[-1] != 1 or x.data_ptr() % 16 or any(
            s % _ALIGN for n, s in zip(shape[:-1], stride[:-1]) if n > 1):
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation
    if any(s % _ALIGN for s in x.stride()[:-1]):  # only size-1 dims can be left here
        x = x.as_strided(x.shape, [s if s % _ALIGN == 0 else 0 for s in x.stride()[:-1]] + [1])
    return x


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


@functools.lru_cache(maxsize=None)
def _no_alibi(index: int):
    return torch.zeros((1, 1), dtype=torch.float32, device=f"cuda:{index}")


@functools.lru_cache(maxsize=None)
def _kernel_for(d_pad, dtype, device_index, causal, has_left, has_right, has_alibi, has_softcap, traits,
                varlen=False, has_seqused_k=False, paged=False, any_page_size=False):
    """The compiled kernel for one call signature (memoised: a cached call hashes plain values
    once instead of rebuilding the traits and the compile-cache key)."""
    arch = _device_arch(device_index)
    if traits is None:
        traits = choose_fwd_traits(d_pad, _DTYPE_NAMES[dtype], min(arch, 90), causal)
    flags = dict(zip(ALL_FLAG_NAMES, (has_left, has_right, has_alibi, has_softcap, d_pad == traits.head_dim,
                                      varlen, has_seqused_k, paged)))
    if any_page_size:
        flags["any_page_size"] = True
    return get_or_compile(fwd_kernel_key(traits, **flags) + (arch,),
                          lambda: compile_fwd(FlashFwd(traits, **flags)))


def _scales(softmax_scale, softcap):
    """(scale_log2, score_premul, alibi_div): with softcap the kernel applies tanh(s * scale /
    softcap) and exponentiates softcap * log2(e) * tanh; ALiBi slopes are divided by the
    multiplier so the bias lands on the scaled score."""
    if softcap > 0:
        return softcap * LOG2E, softmax_scale / softcap, 1.0 / softcap
    return softmax_scale * LOG2E, 1.0, 1.0 / softmax_scale


def _prepare(q, k, v, causal, window_size):
    """What both launchers do first: 128-bit-ready q/k/v, an output buffer, the window as the
    kernel takes it (causal = right edge 0) and the device index."""
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    left, right = window_size
    if causal:
        right = 0
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return q, k, v, out, left, right, index


def _alibi_2d(alibi_slopes, batch, nheads, index):
    if alibi_slopes is None:
        return _no_alibi(index)
    return alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes.unsqueeze(0).expand(batch, nheads)


def flash_fwd(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, traits: FwdTraits | None = None):
    """Dense forward on CUDA tensors already validated by the interface: returns (out, lse).
    `traits` overrides the heuristic (tile tuning, `python -m cute_flash tune`)."""
    b, sq, h, d = q.shape
    q, k, v, out, left, right, index = _prepare(q, k, v, causal, window_size)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    compiled = _kernel_for(q.shape[-1], q.dtype, index, causal, left >= 0, right >= 0,
                           alibi_slopes is not None, softcap > 0, traits)
    compiled(q, k, v, out, lse, _alibi_2d(alibi_slopes, b, h, index), *_scales(softmax_scale, softcap),
             left, right)
    return (out if out.shape[-1] == d else out[..., :d]), lse


def flash_fwd_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     block_table=None, seqused_k=None):
    """Packed-batch forward on validated CUDA tensors: q (total_q, h, d), k/v (total_k, hk, d);
    returns (out (total_q, h, d), lse (h, total_q))."""
    total_q, h, d = q.shape
    paged = block_table is not None
    q, k, v, out, left, right, index = _prepare(q, k, v, causal, window_size)
    lse = torch.empty((h, total_q), dtype=torch.float32, device=q.device)
    compiled = _kernel_for(q.shape[-1], q.dtype, index, causal, left >= 0, right >= 0, alibi_slopes is not None,
                           softcap > 0, None, True, seqused_k is not None, paged,
                           paged and k.shape[1] % PAGE_ROWS != 0)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused = cu_seqlens_k if seqused_k is None else seqused_k.contiguous()  # read only if given
    compiled(q, k, v, out, lse, _alibi_2d(alibi_slopes, cu_seqlens_q.shape[0] - 1, h, index),
             cu_seqlens_q, cu_seqlens_k, seqused, block_table if paged else _no_table(index),
             max_seqlen_q, *_scales(softmax_scale, softcap), left, right)
    return (out if out.shape[-1] == d else out[..., :d]), lse


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _kvcache_kernel_for(traits, d_pad, device_index, has_left, has_right, has_alibi, has_softcap, paged,
                        split, has_leftpad, has_batch_idx, pack_gqa, any_page_size):
    arch = _device_arch(device_index)
    flags = dict(has_left=has_left, has_right=has_right, has_alibi=has_alibi, has_softcap=has_softcap,
                 even_k=d_pad == traits.head_dim, paged=paged, kvcache=True, split=split,
                 has_leftpad=has_leftpad, has_batch_idx=has_batch_idx, pack_gqa=pack_gqa, any_page_size=any_page_size)
    key = fwd_kernel_key(traits, **flags) + (arch,)
    return get_or_compile(key, lambda: compile_fwd(FlashFwd(traits, **flags)))


@functools.lru_cache(maxsize=None)
def _append_for(dtype, device_index, paged, has_batch_idx, rotary, interleaved, q_per_row):
    from cute_flash.kernels.append import AppendKV, compile_append

    arch = _device_arch(device_index)
    flags = (paged, has_batch_idx, rotary, interleaved, q_per_row)
    return get_or_compile(("append", dtype, arch) + flags,
                          lambda: compile_append(AppendKV(_ELEMENT[dtype], *flags)))


def flash_fwd_kvcache(q, k_cache, v_cache, *, k=None, v=None, rotary_cos=None, rotary_sin=None,
                      cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                      softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0,
                      rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_lse=True,
                      signature=None):
    """`flash_attn_with_kvcache` on validated CUDA tensors: append (rotary) k/v into the caches in
    place, then split-KV attention over them, merged in the same launch. Returns (out, lse (b, h,
    sq)), lse None unless return_lse. `signature`: the interface's summary of every argument's
    metadata and options (`_validate.signature`); calls that share one share their setup."""
    b, sq, h, d = q.shape
    call = _kvcache_calls.get(signature) if signature is not None else None
    if call is None:
        if not (_is_aligned(k_cache) and _is_aligned(v_cache)):
            # Caches whose rows break 128-bit copies (a head dim not a multiple of 8, strides
            # or a base address off 16 bytes): work on aligned copies, zero-padded as flash-attn
            # pads, then copy the caches back if the call appended to them. Only appended rows
            # differ, but a whole-cache copy needs no index built from cache_seqlens (which may
            # be bad metadata); the cost, two more reads and two more writes of each cache, is
            # in docs/perf.md.
            k_al, v_al = _aligned(k_cache), _aligned(v_cache)
            if d % _ALIGN:
                q, k, v = (None if x is None else _aligned(x) for x in (q, k, v))
            out, lse = flash_fwd_kvcache(
                q, k_al, v_al, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap, rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
                num_splits=num_splits, return_lse=return_lse)
            if k is not None:
                k_cache.copy_(k_al[..., :d])
                v_cache.copy_(v_al[..., :d])
            return out[..., :d], lse
        call = _kvcache_call(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, rotary_cos, num_splits)
        if signature is not None:
            if len(_kvcache_calls) >= _CALLS_MAX:
                _kvcache_calls.clear()
            _kvcache_calls[signature] = call
    plan, index = call.plan, call.index
    if call.realign:
        q = _aligned(q)
    seqlens = cache_seqlens if call.seqlens is None else call.seqlens
    if call.append:
        q = _append(q, k, v, k_cache, v_cache, seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
                    rotary_interleaved, call.q_per_row, index)

    out = torch.empty((b, sq, h, d), dtype=q.dtype, device=call.device)
    o_acc, lse_acc, counters, lse = _workspace(plan, call.device)
    if return_lse:
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=call.device)
    no_table = _no_table(index)
    plan.launch(q, k_cache, v_cache, out, lse, o_acc, lse_acc, counters,
                _alibi_2d(alibi_slopes, b, h, index), seqlens,
                seqlens if cache_leftpad is None else cache_leftpad,
                seqlens if cache_batch_idx is None else cache_batch_idx,
                no_table if block_table is None else block_table, *call.scalars)
    return out, (lse if return_lse else None)


@dataclass(frozen=True)
class KVCacheCall:
    """What a KV-cache call decides from its arguments' metadata and options alone, kept per
    signature: a decode loop repeats one, and deciding costs more host time than launching."""
    plan: KVCachePlan
    device: torch.device
    index: int
    realign: bool    # q's rows break 128-bit copies: take `_aligned`'s copy
    seqlens: object  # the (batch,) int32 tensor standing for an int (or absent) cache_seqlens
    append: bool     # k, v (or rotary) given: launch the append kernel first
    q_per_row: bool  # rotary angle of q row i at cache_seqlens + i (causal or local)
    scalars: tuple   # k_extra, num_splits, scales, window edges


_kvcache_calls: dict = {}
_CALLS_MAX = 4096


def _kvcache_call(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                  causal, window_size, softcap, alibi_slopes, rotary_cos, num_splits):
    b, sq, h, d = q.shape
    device = q.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    paged = block_table is not None
    hk = k_cache.shape[2]
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    seqlens = None
    if not isinstance(cache_seqlens, torch.Tensor):  # the (batch,) int32 tensor the kernels read
        seqlens = torch.full((b,), capacity if cache_seqlens is None else cache_seqlens, dtype=torch.int32,
                             device=device)
    left, right = window_size
    if causal:
        right = 0
    # GQA decode: the group of query heads sharing a kv head becomes M (FlashFwd's pack_gqa).
    pack_gqa = sq == 1 and h > hk and left < 0 and right < 0 and alibi_slopes is None
    plan = _kvcache_plan(d, q.dtype, index, b, sq, h, hk, capacity, pack_gqa, num_splits, left >= 0,
                         right >= 0, alibi_slopes is not None, softcap > 0, paged, cache_leftpad is not None,
                         cache_batch_idx is not None, paged and k_cache.shape[1] % PAGE_ROWS != 0)
    append = k is not None and (k.shape[1] > 0 or rotary_cos is not None)  # an empty grid cannot launch
    k_extra = 0 if k is None else k.shape[1]
    return KVCacheCall(plan, device, index, not _is_aligned(q), seqlens, append, causal or left >= 0 or right >= 0,
                       (k_extra, plan.num_splits, *_scales(softmax_scale, softcap), left, right))


def _append(q, k, v, k_cache, v_cache, seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
            interleaved, q_per_row, index):
    """Launch the append kernel (rotary k into the caches; returns q, rotated when rotary)."""
    rotary = rotary_cos is not None
    paged = block_table is not None
    k, v = k.contiguous(), v.contiguous()
    q_new = torch.empty_like(q) if rotary else q
    cos = rotary_cos.contiguous() if rotary else q.new_empty((1, 1))
    sin = rotary_sin.contiguous() if rotary else cos
    append = _append_for(q.dtype, index, paged, cache_batch_idx is not None, rotary, bool(interleaved), q_per_row)
    append(k, v, k_cache, v_cache, seqlens, cache_batch_idx if cache_batch_idx is not None else seqlens,
           block_table if paged else _no_table(index), cos, sin, q, q_new)
    return q_new


@functools.lru_cache(maxsize=None)
def _no_table(index: int):
    """The placeholder for an int32 table or vector the kernel's flags leave unread."""
    return torch.zeros((1, 1), dtype=torch.int32, device=f"cuda:{index}")


@dataclass(frozen=True)
class KVCachePlan:
    """Everything a KV-cache call decides from its shapes and options alone."""
    traits: FwdTraits
    num_splits: int
    launch: object   # the compiled kernel's TVM-FFI function
    batch: int
    nheads: int      # (heads, seqlen_q) as the caller has them
    seqlen_q: int
    rows: int        # (rows, heads) as the kernel tiles them: (g, nheads_k) with pack_gqa
    heads: int
    m_blocks: int


@functools.lru_cache(maxsize=4096)
def _kvcache_plan(d_pad, dtype, index, b, sq, h, hk, capacity, pack_gqa, num_splits, has_left, has_right,
                  has_alibi, has_softcap, paged, has_leftpad, has_batch_idx, any_page_size):
    """The plan of one call signature (memoised: decode calls repeat one signature)."""
    rows, heads = (h // hk, hk) if pack_gqa else (sq, h)
    traits = choose_decode_traits(d_pad, _DTYPE_NAMES[dtype], min(_device_arch(index), 90))
    n_blocks = -(-capacity // traits.block_n)
    m_blocks = -(-rows // traits.block_m)
    if num_splits == 0:
        num_splits = num_splits_heuristic(b * heads * m_blocks, _num_sms(index), n_blocks)
    num_splits = max(1, min(num_splits, n_blocks, 128))
    compiled = _kvcache_kernel_for(traits, d_pad, index, has_left, has_right, has_alibi, has_softcap, paged,
                                   num_splits > 1, has_leftpad, has_batch_idx, pack_gqa, any_page_size)
    return KVCachePlan(traits, num_splits, ffi_function(compiled), b, h, sq, rows, heads, m_blocks)


def _workspace(plan: KVCachePlan, device: torch.device):
    """(partial O, partial LSE, arrival counters, LSE scratch) for one launch of `plan`: the
    partials and counters of a split launch, placeholders otherwise, and where the final LSE
    goes when the caller does not want it. Kept per (plan, stream): launches on one stream run in
    order, so they can share it, and the kernel leaves the counters at zero. A launch being
    captured into a CUDA graph gets its own, since the graph may replay beside eager calls."""
    if torch.cuda.is_current_stream_capturing():
        return _new_workspace(plan, device)
    return _stream_workspace(plan, device, torch._C._cuda_getCurrentRawStream(device.index))


@functools.lru_cache(maxsize=64)
def _stream_workspace(plan: KVCachePlan, device: torch.device, stream: int):
    return _new_workspace(plan, device)


def _new_workspace(plan: KVCachePlan, device: torch.device):
    dp = plan.traits.head_dim
    split = plan.num_splits > 1
    shape = (plan.num_splits, plan.batch, plan.heads, plan.rows) if split else (1, 1, 1, 1)
    o_acc = torch.empty(shape + (dp,), dtype=torch.float32, device=device)
    lse_acc = torch.empty(shape, dtype=torch.float32, device=device)
    counters = torch.zeros((plan.m_blocks * plan.batch * plan.heads if split else 1,), dtype=torch.int32,
                           device=device)
    lse = torch.empty((plan.batch, plan.nheads, plan.seqlen_q), dtype=torch.float32, device=device)
    return o_acc, lse_acc, counters, lse


FLAG_NAMES = ("has_left", "has_right", "has_alibi", "has_softcap", "even_k")  # dense score flags
ALL_FLAG_NAMES = FLAG_NAMES + ("varlen", "has_seqused_k", "paged", "kvcache", "split", "has_leftpad",
                               "has_batch_idx", "pack_gqa", "any_page_size")


def fwd_variants(arch: int, full: bool = False):
    """(traits, flags) pairs the dispatcher can choose on `arch`.

    full: every forward traits times every dense and varlen flag combination, and every
    KV-cache traits times every cache flag combination (causal or not).
    Otherwise a covering subset for CI (a compile takes 5-20 s on its 2 cores): every head-dim
    bucket of both kernels (forward and KV-cache), fp16 on sm_80 and bf16 on sm_90 (the dtype
    only changes the MMA atom); the varlen, seqused_k and paged variants (pages of a multiple of
    16 rows, and of any size); and on sm_90 each score flag alone and all together, each cache
    flag alone, and the split + paged pair with both page forms.
    """
    import itertools

    from layouts.traits import DTYPES, HEAD_DIM_BUCKETS

    combos = [dict(zip(FLAG_NAMES, bits)) for bits in itertools.product((False, True), repeat=len(FLAG_NAMES))]
    causal = dict(has_left=False, has_right=True, has_alibi=False, has_softcap=False, even_k=True)
    fwd_traits = list(dict.fromkeys(choose_fwd_traits(d, dt, arch, c) for d in HEAD_DIM_BUCKETS
                                    for dt in DTYPES for c in (False, True)))
    decode_traits = list(dict.fromkeys(choose_decode_traits(d, dt, arch) for d in HEAD_DIM_BUCKETS for dt in DTYPES))
    cache_names = ("paged", "split", "has_leftpad", "has_batch_idx", "pack_gqa")
    cache_flags = [dict(zip(cache_names, bits)) for bits in itertools.product((False, True), repeat=5)
                   if not (bits[0] and (bits[2] or bits[3]))]
    cache_flags += [dict(c, any_page_size=True) for c in cache_flags if c["paged"]]
    if full:
        varlen = [dict(f, varlen=True, has_seqused_k=u, paged=p, any_page_size=a) for f in combos
                  for u in (False, True) for p in (False, True) for a in (False, True) if p or not a]
        cache = [dict(has_right=r, kvcache=True, **c) for r in (False, True) for c in cache_flags
                 if not (r and c["pack_gqa"])]
        return [(t, f) for t in fwd_traits for f in combos + varlen] + [(t, f) for t in decode_traits for f in cache]
    dtype = "bf16" if arch >= 90 else "fp16"
    pivot = choose_fwd_traits(128, dtype, arch)
    decode_pivot = choose_decode_traits(128, dtype, arch)
    subset = [(t, causal) for t in fwd_traits if t.dtype == dtype]
    subset += [(t, dict(kvcache=True, split=True, pack_gqa=True)) for t in decode_traits if t.dtype == dtype]
    subset += [(pivot, dict(causal, varlen=True)), (pivot, dict(causal, varlen=True, has_seqused_k=True)),
               (pivot, dict(causal, varlen=True, paged=True)),
               (pivot, dict(causal, varlen=True, paged=True, any_page_size=True))]
    if arch >= 90:
        all_on = dict(has_left=True, has_right=True, has_alibi=True, has_softcap=True, even_k=False)
        plain = dict(causal, has_right=False)
        alone = [dict(plain, **{n: not plain[n]}) for n in FLAG_NAMES if n != "has_right"]
        subset += [(pivot, f) for f in alone + [all_on]]
        subset += [(decode_pivot, dict(causal, kvcache=True, **{n: True})) for n in cache_names if n != "pack_gqa"]
        subset += [(decode_pivot, dict(plain, kvcache=True, pack_gqa=True))]
        subset += [(decode_pivot, dict(causal, kvcache=True, paged=True, split=True, any_page_size=a))
                   for a in (False, True)]
    return subset
