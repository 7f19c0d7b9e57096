"""The FA2 backward kernel (flash-attn 2's compute_dq_dk_dv_1colblock), device code only.

One CTA owns kBlockN keys of one (batch, head): it loads K and V once, then walks the query
blocks that see any of its keys, recomputing the probabilities from the forward's LSE:

    load K[n], V[n], Q[last], dO[last]
    for m = last .. first:
        wait Q[m], dO[m]; barrier; issue Q[m-1], dO[m-1] (the other stage)
        S = Q K^T;  dP = dO V^T                    (S / dP warp grid)
        P = exp2(S * scale_log2 - LSE * log2 e)     (masks, ALiBi, softcap as in the forward)
        dS = P * (dP - D)                           (D = rowsum(dO * O), `bwd_preprocess.py`)
        P, dS -> smem; barrier
        dV += P^T dO                                (dK / dV warp grid, ldmatrix.trans operands)
        dQ  = dS K -> added into dQaccum            (dQ warp grid; coalesced: dq_accum.py)
        dK += dS^T Q                                (under the adds' latency)
    dK *= softmax scale; dK, dV -> smem -> 128-bit stores

The scale of dS (the softmax scale, times the tanh derivative with softcap) is applied to dK
here and to dQ by `DQConvert` (dq_accum.py), which turns dQaccum into dQ. With GQA every query head writes its own dK/dV
rows and the host sums a group's heads. `deterministic`: the grid's x holds a fixed number of
CTAs, each walking key blocks x, x + grid_x, ... and adding dQ into its own dQaccum slice; only
that CTA writes the slice, in program order, and the host sums the slices in a fixed order, so
gradients are bitwise repeatable. Otherwise every key block is a CTA and dQaccum has one slice.

dQ's adds: fp32 atomics (`red`, 4 floats wide on sm_90), or with `dq_bulk` (sm_90) each warp
stages its share of the tile in shared memory and issues one `cp.reduce.async.bulk` of it: the
TMA unit does the adds and the warp goes on to the dK GEMM. The staging run of a warp is
rewritten one query block later, after the warp has waited for the bulk read of it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import functools

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.block_range import BlockRange, QueryBlocks, Window, visit_key_block
from cute_flash.kernels.common.block_sparse import BlockSparse, fake_block_sparse
from cute_flash.kernels.common.constants import LOG2E
from cute_flash.kernels.common.dq_accum import bulk_add_run, fake_dq_accum, first_tile, stage_run, tiles_of
from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.common.flags import FLAG_LETTERS
from cute_flash.kernels.common.gemm import SmemGemm
from cute_flash.kernels.common.philox import Dropout
from cute_flash.kernels.common.score_mods import BwdScalars, Mask, ScoreMods, softcap_with_derivative
from cute_flash.kernels.common.seq_info import SeqInfo, head_rows
from cute_flash.kernels.common.tile_copy import column_predicate, copy_tile
from cute_flash.kernels.common.user_mods import ModCall, check_mods
from layouts import copy as lcopy
from layouts.dq import chunk_index
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.traits import ALIGN, COPY_BYTES, BwdTraits, element_type


@dataclass(frozen=True)
class BwdConfig:
    """One compiled backward variant (`kernels/sm80/bwd.py`): traits and the feature flags."""
    traits: BwdTraits
    has_left: bool = False
    has_right: bool = False
    has_alibi: bool = False
    has_softcap: bool = False
    has_dropout: bool = False     # the forward's Philox mask, recomputed (kernels/common/philox.py)
    even_k: bool = True
    varlen: bool = False
    has_seqused_k: bool = False
    deterministic: bool = False   # dQ summed per key-block split in a fixed order, no cross-CTA atomics
    dq_vec: int = 1               # floats per dQ atomic add: 4 on sm_90 (red.global.add.v4.f32), 1 before
    dq_bulk: bool = False         # dQ staged in smem, added by one bulk reduce per warp (sm_90; `dq_reduction`)
    mods: object = None           # UserMods: Python-written score / mask mods (kernels/common/user_mods.py)
    block_sparse: bool = False    # dense: each key block visits its listed query blocks alone, the mask_mod
                                  # evaluated on the partial ones (kernels/common/block_sparse.py)

    def __post_init__(self):
        if self.has_seqused_k and not self.varlen:
            raise ValueError("has_seqused_k belongs to the varlen entry")
        if self.block_sparse and (self.mods is None or self.mods.mask_mod is None or self.varlen):
            raise ValueError("block sparsity lists the blocks a mask_mod cuts, in a dense launch")
        if self.dq_vec not in (1, 4):
            raise ValueError("dq_vec is 1 or 4")
        if self.dq_bulk and (self.dq_vec != 4 or self.deterministic):
            raise ValueError("dq_bulk needs dq_vec 4 (its layout) and no deterministic mode (bulk adds of one "
                             "CTA to one address are not ordered)")
        check_mods(self.mods, False, self.has_softcap, self.has_alibi, backward=True)

    @property
    def smem_bytes(self) -> int:
        """The traits' tiles, plus the fp32 dQ staging tile with dq_bulk."""
        t = self.traits
        return t.smem_bytes + (DQ_STAGE_BYTES * t.block_m * t.head_dim if self.dq_bulk else 0)

    @property
    def entry(self) -> str:
        """Which entry point of `FlashBwd` the variant compiles: dense or varlen."""
        return "varlen" if self.varlen else "dense"

    @property
    def q_head_axis(self) -> int:
        """The heads mode of q, k, v, dO and the gradients: (total, heads, d) packed, else (batch, seqlen, heads, d)."""
        return 1 if self.varlen else 2

    def flags(self) -> dict:
        return {f.name: True for f in fields(self) if f.name not in DQ_FIELDS and getattr(self, f.name)}

    @property
    def letters(self) -> str:
        return "".join(FLAG_LETTERS[f.name] if getattr(self, f.name) else "."
                       for f in fields(self) if f.name not in DQ_FIELDS)

    @property
    def name(self) -> str:
        return f"{self.traits.name}-{self.letters}-v{self.dq_vec}{'b' if self.dq_bulk else ''}"


DQ_FIELDS = ("traits", "dq_vec", "dq_bulk")
DQ_STAGE_BYTES = 4  # fp32


@dataclass(frozen=True)
class BwdTensors:
    """A launch's global tensors (None where the config reads nothing)."""
    mQ: cute.Tensor      # (batch, seqlen_q, heads, d), or (total_q, heads, d) packed
    mK: cute.Tensor      # (batch, seqlen_k, heads_k, d), or (total_k, heads_k, d)
    mV: cute.Tensor
    mdO: cute.Tensor     # like mQ
    mLSE: cute.Tensor    # (batch, heads, seqlen_q), or (heads, total_q); fp32, natural log
    mD: cute.Tensor      # like mLSE: rowsum(dO * O)
    mdQaccum: cute.Tensor  # (slices, batch, heads, tiles, kBlockM * kHeadDim) fp32, or (slices, heads, tiles, ...)
                           # packed: chunks in thread order (dq_accum.py)
    mdK: cute.Tensor     # (batch, seqlen_k, heads, d) or (total_k, heads, d): per query head
    mdV: cute.Tensor
    mAlibi: object       # (batch, heads) fp32 slopes
    mCuSeqlensQ: object  # (batch + 1,) int32
    mCuSeqlensK: object
    mSeqUsedK: object    # (batch,) int32
    mRng: object = None  # (4,) uint32: the forward's dropout state (kernels/common/philox.py:Dropout)
    aux: object = None   # the mods' aux tensors (a list)
    sparse: object = None  # block_sparse.BlockSparse by key block (a block-sparse launch)


@dataclass(frozen=True)
class BwdRecipe:
    """Compile-time layouts: smem tiles, gmem copies, the three TiledMMAs."""
    sQ_layout: cute.ComposedLayout    # (bm, d), also dO's
    sKV_layout: cute.ComposedLayout   # (bn, d)
    sPdS_layout: cute.ComposedLayout  # (bm, bn)
    gmem_tiled_copy_QKV: cute.TiledCopy
    gmem_tiled_copy_O: cute.TiledCopy  # dK / dV stores
    mma_sdp: cute.TiledMma
    mma_dkv: cute.TiledMma
    mma_dq: cute.TiledMma


@dataclass(frozen=True)
class BwdViews:
    """This CTA's (seqlen, d) views of its sequence and head, (seqlen,) for LSE and D."""
    mQ_s: cute.Tensor
    mK_s: cute.Tensor
    mV_s: cute.Tensor
    mdO_s: cute.Tensor
    mLSE_s: cute.Tensor
    mD_s: cute.Tensor
    mdQ_tiles: cute.Tensor  # (tiles, kBlockM * kHeadDim) fp32: this sequence's chunks in this CTA's slice
    mdK_s: cute.Tensor
    mdV_s: cute.Tensor
    head_dim: object


@dataclass(frozen=True)
class BwdSmem:
    """Shared-memory tiles: Q and dO in `q_stages` stages (stage s at offset s * stage_elems)."""
    sQ: cute.Tensor    # (bm, d) stage 0
    sdO: cute.Tensor   # (bm, d) stage 0
    sK: cute.Tensor    # (bn, d)
    sV: cute.Tensor    # (bn, d)
    sP: cute.Tensor    # (bm, bn)
    sdS: cute.Tensor   # (bm, bn)
    sdQaccum: object   # (bm * d,) fp32, a warp's run per warp in dQaccum's order (dq_bulk), else None


@dataclass(frozen=True)
class KeyBlock:
    """What every query-block step of one key block reads."""
    n_block: object
    acc_dk: cute.Tensor  # (MMA, MMA_N, MMA_D) fp32, dK/dV warp grid
    acc_dv: cute.Tensor
    mods: ScoreMods
    dropout: object = None  # kernels/common/philox.py:Dropout (has_dropout)
    sparse: object = None   # block_sparse.SparseRow: the key block's query blocks in a block-sparse launch


class FlashBwd:
    """One compiled variant per `BwdConfig`; lengths, strides, scales and window sizes are
    run-time arguments."""

    def __init__(self, config: BwdConfig):
        self.config = config
        self.t = config.traits
        self.dtype = element_type(config.traits)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mAlibi, mRng,
                 aux_tensors, block_sparse, softmax_scale: cutlass.Float32, scale_log2: cutlass.Float32,
                 score_premul: cutlass.Float32,
                 alibi_div: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32,
                 grid_x: cutlass.Int32, stream):
        """Dense batches: mQ/mdO (batch, seqlen_q, heads, d), mK/mV (batch, seqlen_k, heads_k,
        d), mdK/mdV (batch, seqlen_k, heads, d), mLSE/mD (batch, heads, seqlen_q) fp32, mdQaccum
        (slices, batch, heads, ceil(seqlen_q / kBlockM), kBlockM * kHeadDim) fp32 zeroed;
        block_sparse the lists by key block of `BlockSparse.of` (`BwdConfig.block_sparse`).
        grid_x: the key blocks, or the deterministic split count (= slices)."""
        args = BwdTensors(mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mAlibi, None, None, None, mRng, aux_tensors,
                          BlockSparse.of(block_sparse))
        self.launch(args, BwdScalars(softmax_scale, scale_log2, score_premul, alibi_div, window_left, window_right),
                    (grid_x, mQ.shape[0], mQ.shape[2]), stream)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                    mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mAlibi, mRng,
                    aux_tensors, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK,
                    softmax_scale: cutlass.Float32, scale_log2: cutlass.Float32, score_premul: cutlass.Float32,
                    alibi_div: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32,
                    grid_x: cutlass.Int32, stream):
        """Packed batches: mQ/mdO (total_q, heads, d), mK/mV (total_k, heads_k, d), mdK/mdV
        (total_k, heads, d), mLSE/mD (heads, total_q), mdQaccum (slices, heads, total_q //
        kBlockM + batch + 1, kBlockM * kHeadDim); grid_x covers max_seqlen_k (or the split count)."""
        args = BwdTensors(mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mAlibi, mCuSeqlensQ, mCuSeqlensK,
                          mSeqUsedK, mRng, aux_tensors)
        self.launch(args, BwdScalars(softmax_scale, scale_log2, score_premul, alibi_div, window_left, window_right),
                    (grid_x, mCuSeqlensQ.shape[0] - 1, mQ.shape[1]), stream)

    @cute.jit
    def launch(self, args: BwdTensors, scalars: BwdScalars, grid, stream):
        t = self.t
        sQ_layout = lsmem.smem_layout_q(t)
        sKV_layout = lsmem.smem_layout_kv(t)
        sPdS_layout = lsmem.smem_layout_pds(t)

        SharedStorage = self.shared_storage(sQ_layout, sKV_layout, sPdS_layout)
        recipe = BwdRecipe(sQ_layout, sKV_layout, sPdS_layout, lcopy.gmem_tiled_copy_qkv(t), lcopy.gmem_tiled_copy_o(t),
                           lmma.tiled_mma_grid(t, t.atom_m_sdp), lmma.tiled_mma_grid(t, t.atom_n_dkv),
                           lmma.tiled_mma_grid(t, t.atom_m_dq))
        self.kernel(args, scalars, recipe, SharedStorage).launch(
            grid=grid, block=[t.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    def shared_storage(self, sQ_layout, sKV_layout, sPdS_layout):
        """The kernel's shared-memory struct (plain Python, run while tracing): the fp32 dQ
        staging tile exists only with dq_bulk."""
        t, dtype = self.t, self.dtype
        qdo = cute.cosize(sQ_layout) * t.q_stages
        tiles = {"sQ": (dtype, qdo, 1024), "sdO": (dtype, qdo, 1024),
                 "sK": (dtype, cute.cosize(sKV_layout), 1024), "sV": (dtype, cute.cosize(sKV_layout), 1024),
                 "sP": (dtype, cute.cosize(sPdS_layout), 1024), "sdS": (dtype, cute.cosize(sPdS_layout), 1024)}
        if self.config.dq_bulk:
            tiles["sdQaccum"] = (cutlass.Float32, t.block_m * t.head_dim, 1024)
        return lsmem.smem_struct(tiles)

    @cute.kernel
    def kernel(self, args: BwdTensors, scalars: BwdScalars, recipe: BwdRecipe, SharedStorage: cutlass.Constexpr):
        cfg, t = self.config, self.t
        x, bidb, bidh = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        seq, views = self.sequence(args, x if cutlass.const_expr(cfg.deterministic) else 0, bidb, bidh)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sdQaccum = None
        if cutlass.const_expr(cfg.dq_bulk):
            sdQaccum = storage.sdQaccum.get_tensor(cute.make_layout(t.block_m * t.head_dim))
        smem = BwdSmem(storage.sQ.get_tensor(recipe.sQ_layout), storage.sdO.get_tensor(recipe.sQ_layout),
                       storage.sK.get_tensor(recipe.sKV_layout), storage.sV.get_tensor(recipe.sKV_layout),
                       storage.sP.get_tensor(recipe.sPdS_layout), storage.sdS.get_tensor(recipe.sPdS_layout),
                       sdQaccum)
        window = Window(scalars.window_left, scalars.window_right, cfg.has_left, cfg.has_right)
        slope = cutlass.Float32(0.0)
        if cutlass.const_expr(cfg.has_alibi):
            slope = args.mAlibi[bidb, bidh] * scalars.alibi_div
        # softcap is applied here, not by ScoreMods: its derivative needs tanh before the masks
        user = None
        if cutlass.const_expr(cfg.mods is not None):
            user = ModCall.make(cfg.mods, bidb, bidh, seq, args.aux, scalars.score_premul)
        mods = ScoreMods(Mask(seq.seqlen_q, seq.seqlen_k, window), scalars.score_premul, slope, False,
                         cfg.has_alibi, (t.block_m, t.block_n), user=user)
        dropout = None
        if cutlass.const_expr(cfg.has_dropout):
            dropout = Dropout.load(args.mRng, bidb, bidh, args.mQ.shape[1 if cutlass.const_expr(cfg.varlen) else 2])
        for n_block in cutlass.range(x, cute.ceil_div(seq.seqlen_k, t.block_n), grid_x, unroll=1):
            sparse = None
            if cutlass.const_expr(args.sparse is not None):
                sparse = args.sparse.row(bidb, bidh, n_block)
            self.key_block(n_block, seq, views, scalars, recipe, smem, mods, window, dropout, sparse)
        if cutlass.const_expr(cfg.dq_bulk):
            if cute.arch.lane_idx() == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory outlives the bulk reads

    @cute.jit
    def sequence(self, args: BwdTensors, slot, bidb, bidh):
        """(SeqInfo, BwdViews) of sequence bidb, head bidh; `slot` is the dQaccum slice."""
        cfg = self.config
        mQ, mK = args.mQ, args.mK
        head_axis = cfg.q_head_axis
        bidh_kv = bidh // (mQ.shape[head_axis] // mK.shape[head_axis])
        if cutlass.const_expr(cfg.varlen):
            seq = SeqInfo.make(bidb, mQ.shape[0], mK.shape[0], args.mCuSeqlensQ, args.mCuSeqlensK, args.mSeqUsedK)
            k_off = (seq.sum_s_k, 0)
            mK_s = cute.domain_offset(k_off, mK[None, bidh_kv, None])       # (seqlen_k, d)
            mV_s = cute.domain_offset(k_off, args.mV[None, bidh_kv, None])
            mdK_s = cute.domain_offset(k_off, args.mdK[None, bidh, None])   # (seqlen_k, d)
            mdV_s = cute.domain_offset(k_off, args.mdV[None, bidh, None])
            mdQ_tiles = cute.domain_offset((first_tile(seq, bidb, self.t.block_m), 0),
                                           tiles_of(args.mdQaccum, slot, bidb, bidh, True))  # (tiles, chunk)
        else:
            seq = SeqInfo.make(bidb, mQ.shape[1], mK.shape[1])
            mK_s, mV_s = mK[bidb, None, bidh_kv, None], args.mV[bidb, None, bidh_kv, None]  # (seqlen_k, d)
            mdK_s, mdV_s = args.mdK[bidb, None, bidh, None], args.mdV[bidb, None, bidh, None]
            mdQ_tiles = tiles_of(args.mdQaccum, slot, bidb, bidh, False)
        views = BwdViews(head_rows(mQ, seq, bidb, bidh), mK_s, mV_s,
                         head_rows(args.mdO, seq, bidb, bidh),   # (seqlen_q, d)
                         head_rows(args.mLSE, seq, bidb, bidh),  # (seqlen_q,)
                         head_rows(args.mD, seq, bidb, bidh), mdQ_tiles, mdK_s, mdV_s, mQ.shape[head_axis + 1])
        return seq, views

    @cute.jit
    def key_block(self, n_block, seq: SeqInfo, views: BwdViews, scalars: BwdScalars, recipe: BwdRecipe,
                  smem: BwdSmem, mods: ScoreMods, window: Window, dropout, sparse=None):
        """dK and dV of key block n_block, and its share of dQ: query blocks m_block_max - 1 down
        to m_block_min, or a block-sparse launch's listed ones (`sparse`, a SparseRow; Q and dO
        loads check their rows whatever the block)."""
        cfg, t = self.config, self.t
        bm, bn, d = t.block_m, t.block_n, t.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        rows_k = seq.seqlen_k - n_block * bn
        cKV = cute.make_identity_tensor((bn, d))  # (bn, d) tile coordinates
        gmem_thr_copy = recipe.gmem_tiled_copy_QKV.get_slice(tidx)
        tKVcKV = gmem_thr_copy.partition_S(cKV)   # (CPY, CPY_N, CPY_K)
        kvpred = column_predicate(tKVcKV, views.head_dim)

        cute.arch.barrier()  # a previous key block's epilogue may still read sK / sV
        for src, dst in ((views.mK_s, smem.sK), (views.mV_s, smem.sV)):
            g = cute.local_tile(src, (bn, d), (n_block, 0))  # (bn, d)
            copy_tile(recipe.gmem_tiled_copy_QKV, gmem_thr_copy.partition_S(g), gmem_thr_copy.partition_D(dst),
                      tKVcKV, kvpred, rows_k, True, cfg.even_k, True)

        thr_dkv = recipe.mma_dkv.get_slice(tidx)
        acc_dk = cute.make_rmem_tensor(thr_dkv.partition_shape_C((bn, d)), cutlass.Float32)  # (MMA, MMA_N, MMA_D)
        acc_dv = cute.make_rmem_tensor(thr_dkv.partition_shape_C((bn, d)), cutlass.Float32)
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)
        kb = KeyBlock(n_block, acc_dk, acc_dv, mods, dropout, sparse)

        blocks = QueryBlocks.make(seq, n_block, bm, bn, window)
        count = blocks.m_block_max - blocks.m_block_min
        if cutlass.const_expr(sparse is not None):
            count = sparse.count()
        if count > 0:
            self.load_q(self.visit(kb, blocks.m_block_max - 1, 0, count), 0, seq, views, recipe, smem)
        cute.arch.cp_async_commit_group()
        for i in cutlass.range(count, unroll=1):
            m_block = self.visit(kb, blocks.m_block_max - 1 - i, i, count)
            stage = 0
            if cutlass.const_expr(t.q_stages == 2):
                stage = i % 2
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if cutlass.const_expr(t.q_stages == 2):
                if i + 1 < count:
                    self.load_q(self.visit(kb, m_block - 1, i + 1, count), 1 - stage, seq, views, recipe, smem)
                cute.arch.cp_async_commit_group()
            self.query_block(m_block, stage, kb, seq, views, scalars, recipe, smem, i)
            if cutlass.const_expr(t.q_stages == 1):
                cute.arch.barrier()
                if i + 1 < count:
                    self.load_q(self.visit(kb, m_block - 1, i + 1, count), 0, seq, views, recipe, smem)
                cute.arch.cp_async_commit_group()
        self.store_dkv(kb, rows_k, views, scalars, recipe, smem)

    @cute.jit
    def visit(self, kb: KeyBlock, dense_block, i, count):
        """Visit i (< count) of the key block: `dense_block`, the dense walk's, or a block-sparse
        key block's i-th listed query block."""
        m_block = dense_block
        if cutlass.const_expr(kb.sparse is not None):
            m_block = kb.sparse.block(cutlass.min(i, count - 1))
        return m_block

    @cute.jit
    def staged(self, s: cute.Tensor, stage):
        """Stage `stage` of a double-buffered (bm, d) tile: the next cosize elements."""
        size = cute.cosize(s.layout)
        return cute.make_tensor(s.iterator + cute.assume(stage * size, divby=size), s.layout)

    @cute.jit
    def load_q(self, m_block, stage, seq: SeqInfo, views: BwdViews, recipe: BwdRecipe, smem: BwdSmem):
        """Issue the cp.async copies of Q[m_block] and dO[m_block] into `stage` (rows past
        seqlen_q and columns past d zero-filled: they enter S and dP)."""
        t = self.t
        bm, d = t.block_m, t.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        gmem_thr_copy = recipe.gmem_tiled_copy_QKV.get_slice(tidx)
        tQcQ = gmem_thr_copy.partition_S(cute.make_identity_tensor((bm, d)))  # (CPY, CPY_M, CPY_K)
        qpred = column_predicate(tQcQ, views.head_dim)
        rows_q = seq.seqlen_q - m_block * bm
        for src, dst in ((views.mQ_s, smem.sQ), (views.mdO_s, smem.sdO)):
            g = cute.local_tile(src, (bm, d), (m_block, 0))  # (bm, d)
            copy_tile(recipe.gmem_tiled_copy_QKV, gmem_thr_copy.partition_S(g),
                      gmem_thr_copy.partition_D(self.staged(dst, stage)), tQcQ, qpred, rows_q, True,
                      self.config.even_k, True)

    @cute.jit
    def query_block(self, m_block, stage, kb: KeyBlock, seq: SeqInfo, views: BwdViews, scalars: BwdScalars,
                    recipe: BwdRecipe, smem: BwdSmem, i=0):
        cfg, t = self.config, self.t
        bm, bn, d = t.block_m, t.block_n, t.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        sQ, sdO = self.staged(smem.sQ, stage), self.staged(smem.sdO, stage)
        mma_sdp = recipe.mma_sdp
        thr_sdp = mma_sdp.get_slice(tidx)

        # LSE and D of this thread's rows, loaded first so their latency hides under the GEMMs
        # (rows past the sequence: LSE +inf, so P = 0 there).
        tScS_mn = lmma.acc_mn_view(thr_sdp.partition_C(cute.make_identity_tensor((bm, bn))))
        rows = cute.size(tScS_mn.shape[0])
        lse_log2 = cute.make_rmem_tensor((rows,), cutlass.Float32)
        dot = cute.make_rmem_tensor((rows,), cutlass.Float32)
        for r in cutlass.range_constexpr(rows):
            row = m_block * bm + tScS_mn[r, 0][0]
            lse_log2[r] = cutlass.Float32.inf
            dot[r] = 0.0
            if row < seq.seqlen_q:
                lse_log2[r] = views.mLSE_s[row] * LOG2E
                dot[r] = views.mD_s[row]

        # S = Q K^T, dP = dO V^T
        acc_s = cute.make_rmem_tensor(thr_sdp.partition_shape_C((bm, bn)), cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        acc_dp = cute.make_rmem_tensor(thr_sdp.partition_shape_C((bm, bn)), cutlass.Float32)
        acc_s.fill(0.0)
        acc_dp.fill(0.0)
        copy_a = lcopy.smem_tiled_copy_a(t, mma_sdp, False)
        copy_b = lcopy.smem_tiled_copy_b(t, mma_sdp, False)
        SmemGemm.make(mma_sdp, copy_a, sQ, copy_b, smem.sK, tidx).run(acc_s)
        SmemGemm.make(mma_sdp, copy_a, sdO, copy_b, smem.sV, tidx).run(acc_dp)

        dtanh = None
        if cutlass.const_expr(cfg.has_softcap):
            dtanh = softcap_with_derivative(acc_s, scalars.score_premul)
        pre = None  # a score_mod's input, scale * S, for its backward
        if cutlass.const_expr(cfg.mods is not None and cfg.mods.score_mod_bwd is not None):
            pre = cute.make_fragment_like(acc_s, cutlass.Float32)  # (MMA, MMA_M, MMA_N)
            pre.store(acc_s.load() * scalars.score_premul)
        # Only tiles crossing the sequence end or a window edge run the mask (dynamic test)
        acc_s_mn = lmma.acc_mn_view(acc_s)
        lo, hi = BlockRange.unmasked(seq, m_block, bm, bn, kb.mods.mask.window)
        visit_key_block(kb.sparse, i, kb.n_block, lo, hi,
                        functools.partial(kb.mods.apply, mma_sdp, acc_s, m_block, kb.n_block))
        acc_dp_mn = lmma.acc_mn_view(acc_dp)
        if cutlass.const_expr(cfg.has_dropout):
            self.dropout_p_ds(kb.dropout, acc_s, acc_dp, lse_log2, dot, thr_sdp, m_block * bm, kb.n_block * bn,
                              scalars.scale_log2)
        else:
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(cute.size(acc_s_mn.shape[1])):
                    p = cute.math.exp2(acc_s_mn[r, c] * scalars.scale_log2 - lse_log2[r], fastmath=True)
                    acc_s_mn[r, c] = p
                    acc_dp_mn[r, c] = p * (acc_dp_mn[r, c] - dot[r])
        if cutlass.const_expr(cfg.has_softcap):
            for i in cutlass.range(cute.size(acc_dp), unroll_full=True):
                acc_dp[i] = acc_dp[i] * dtanh[i]
        if cutlass.const_expr(pre is not None):
            kb.mods.user.backward(acc_dp_mn, lmma.acc_mn_view(pre), tScS_mn, m_block * bm, kb.n_block * bn)

        # P, dS -> smem (the dK/dV and dQ GEMMs read them in other warp grids)
        smem_copy_c = lcopy.smem_tiled_copy_c(t, mma_sdp).get_slice(tidx)
        for acc, dst in ((acc_s, smem.sP), (acc_dp, smem.sdS)):
            r = cute.make_fragment_like(acc, self.dtype)  # (MMA, MMA_M, MMA_N)
            r.store(acc.load().to(self.dtype))
            cute.copy(smem_copy_c, smem_copy_c.retile(r), smem_copy_c.partition_D(dst))
        cute.arch.barrier()

        # dV += P^T dO; dQ = dS K added into this CTA's dQaccum slice; dK += dS^T Q (after the
        # dQ atomics, so their latency hides under it)
        mma_dkv = recipe.mma_dkv
        copy_at = lcopy.smem_tiled_copy_a(t, mma_dkv, True)
        copy_bt = lcopy.smem_tiled_copy_b(t, mma_dkv, True)
        SmemGemm.make(mma_dkv, copy_at, lsmem.transposed_view(smem.sP), copy_bt, lsmem.transposed_view(sdO),
                      tidx).run(kb.acc_dv)

        mma_dq = recipe.mma_dq
        thr_dq = mma_dq.get_slice(tidx)
        acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((bm, d)), cutlass.Float32)  # (MMA, MMA_M, MMA_D)
        acc_dq.fill(0.0)
        SmemGemm.make(mma_dq, lcopy.smem_tiled_copy_a(t, mma_dq, False), smem.sdS,
                      lcopy.smem_tiled_copy_b(t, mma_dq, True), lsmem.transposed_view(smem.sK), tidx).run(acc_dq)
        chunk = views.mdQ_tiles[m_block, None]  # (bm * d,) fp32 in warp order: coalesced adds
        if cutlass.const_expr(cfg.dq_bulk):
            self.add_dq_bulk(acc_dq, chunk, smem.sdQaccum)
        else:
            vec = cfg.dq_vec
            per_thread = cute.size(acc_dq)
            for j in cutlass.range(per_thread // vec, unroll_full=True):
                where = chunk.iterator + chunk_index(j * vec, tidx, per_thread, vec)
                if cutlass.const_expr(vec == 1):
                    cute.arch.red(where, acc_dq[j], op="add", dtype="f32", sem="relaxed", scope="gpu")
                else:
                    pack = cute.make_rmem_tensor((vec,), cutlass.Float32)
                    for u in cutlass.range_constexpr(vec):
                        pack[u] = acc_dq[j * vec + u]
                    cute.arch.red(where, pack.load(), op="add", dtype="f32", sem="relaxed", scope="gpu")

        SmemGemm.make(mma_dkv, copy_at, lsmem.transposed_view(smem.sdS), copy_bt, lsmem.transposed_view(sQ),
                      tidx).run(kb.acc_dk)

    @cute.jit
    def dropout_p_ds(self, dropout: Dropout, acc_s, acc_dp, lse_log2, dot, thr_sdp, row0, col0, scale_log2):
        """With dropout (Z the forward's keep mask, 1 / P(keep) its scale): acc_s becomes the
        dropped P~ = P Z / P(keep) that dV reads, acc_dp becomes dS = P (dP Z / P(keep) - D) (D,
        rowsum(dO * O), is already the dropped output's). Per mma.sync atom (m, n): one Philox
        call for its 4 values (v, m, n) at rows r + 8 (v // 2), columns c + v % 2."""
        bm, bn = self.t.block_m, self.t.block_n
        tScS = thr_sdp.partition_C(cute.make_identity_tensor((bm, bn)))  # (MMA, MMA_M, MMA_N) coordinates
        scale = dropout.scale()
        for m in cutlass.range_constexpr(cute.size(acc_s.shape[1])):
            for n in cutlass.range_constexpr(cute.size(acc_s.shape[2])):
                rc = tScS[0, m, n]
                keeps = dropout.atom_keeps(row0 + rc[0], col0 + rc[1])
                for v in cutlass.range_constexpr(4):
                    r = v // 2 + 2 * m  # the value's row in acc_mn_view order
                    p = cute.math.exp2(acc_s[v, m, n] * scale_log2 - lse_log2[r], fastmath=True)
                    z = cutlass.Float32(0.0)
                    if keeps[v]:
                        z = scale
                    acc_s[v, m, n] = p * z
                    acc_dp[v, m, n] = p * (acc_dp[v, m, n] * z - dot[r])

    @cute.jit
    def add_dq_bulk(self, acc_dq: cute.Tensor, chunk: cute.Tensor, sdQaccum: cute.Tensor):
        """This warp's dQ values -> its run of sdQaccum (16-byte stores, a warp's store covering
        512 consecutive bytes) -> one bulk reduce-add of the run into the same run of `chunk`,
        issued by lane 0 (dQaccum's warp order, dq_accum.py)."""
        run = cute.size(acc_dq) * 32  # floats
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last bulk add has read this run
        cute.arch.sync_warp()
        stage_run(acc_dq, sdQaccum, cute.assume(warp * run + lane * 4, divby=4), 4, 32)
        cute.arch.sync_warp()
        if lane == 0:
            bulk_add_run(chunk, sdQaccum, warp * run, run)

    @cute.jit
    def store_dkv(self, kb: KeyBlock, rows_k, views: BwdViews, scalars: BwdScalars, recipe: BwdRecipe,
                  smem: BwdSmem):
        """dK (times the softmax scale) and dV through smem (reusing sK, sV) to 128-bit stores;
        rows past seqlen_k and columns past d are not written."""
        t = self.t
        bn, d = t.block_n, t.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        acc_dk = kb.acc_dk  # (a loop that writes through kb would carry all of it, the mods' names too)
        for i in cutlass.range(cute.size(acc_dk), unroll_full=True):
            acc_dk[i] = acc_dk[i] * scalars.softmax_scale
        cute.arch.cp_async_wait_group(0)  # with no query block, the K / V copies may still be landing
        cute.arch.barrier()  # every warp is done reading sK (dQ) and sV
        smem_copy_c = lcopy.smem_tiled_copy_c(t, recipe.mma_dkv).get_slice(tidx)
        for acc, dst in ((kb.acc_dk, smem.sK), (kb.acc_dv, smem.sV)):
            r = cute.make_fragment_like(acc, self.dtype)  # (MMA, MMA_N, MMA_D)
            r.store(acc.load().to(self.dtype))
            cute.copy(smem_copy_c, smem_copy_c.retile(r), smem_copy_c.partition_D(dst))
        cute.arch.barrier()
        cKV = cute.make_identity_tensor((bn, d))
        gmem_thr_copy = recipe.gmem_tiled_copy_O.get_slice(tidx)
        tcKV = gmem_thr_copy.partition_D(cKV)  # (CPY, CPY_N, CPY_K) coordinates
        kpred = column_predicate(tcKV, views.head_dim)
        for src, out in ((smem.sK, views.mdK_s), (smem.sV, views.mdV_s)):
            tsX = gmem_thr_copy.partition_S(src)  # (CPY, CPY_N, CPY_K)
            trX = cute.make_fragment_like(tsX, self.dtype)
            cute.copy(recipe.gmem_tiled_copy_O, tsX, trX)
            g = cute.local_tile(out, (bn, d), (kb.n_block, 0))  # (bn, d)
            copy_tile(recipe.gmem_tiled_copy_O, trX, gmem_thr_copy.partition_D(g), tcKV, kpred, rows_k, True,
                      self.config.even_k, False)


def entry(config: BwdConfig):
    """The jit function `config` compiles: `__call__` (dense) or `call_varlen`."""
    kernel = FlashBwd(config)
    return kernel.call_varlen if config.varlen else kernel


def fake_args(config: BwdConfig) -> list:
    """Placeholders for `FlashBwd.__call__` / `call_varlen`, in parameter order (as the
    forward's `fake_args`)."""
    dtype = element_type(config.traits)
    rank = 3 if config.varlen else 4

    def elems():
        return fake_tensor(dtype, rank, ALIGN, COPY_BYTES)

    def f32(r):
        return fake_tensor(cutlass.Float32, r)

    accum = fake_dq_accum(config.traits, config.varlen)
    tensors = [elems() for _ in range(4)] + [f32(rank - 1), f32(rank - 1), accum, elems(), elems(),
                                             f32(2) if config.has_alibi else None,
                                             fake_tensor(cutlass.Uint32, 1) if config.has_dropout else None,
                                             config.mods.fake_aux() if config.mods is not None else None]
    if not config.varlen:
        tensors.append(fake_block_sparse() if config.block_sparse else None)
    if config.varlen:
        i32 = fake_tensor(cutlass.Int32, 1)
        tensors += [i32, fake_tensor(cutlass.Int32, 1), fake_tensor(cutlass.Int32, 1) if config.has_seqused_k else None]
    return tensors + [1.0, 1.0, 1.0, 1.0, -1, -1, 1, fake_stream()]
