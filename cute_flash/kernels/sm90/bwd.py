"""The Hopper backward (sm_90a): TMA loads on mbarrier pipelines, wgmma from shared memory and
registers, a producer warp and two consumer warpgroups (FlashAttention-3's design, written
here). Device code only; its state dataclasses are in bwd_state.py, its dQ adds (`DqAdds`) in
bwd_dq.py, its dK / dV epilogue (`BwdEpilogue`) in bwd_epilogue.py.

One CTA owns block_n = 128 keys of one (batch, head); consumer warpgroup w owns keys
64 w .. 64 w + 63 of them (above d 128, below, 64 or 96 keys shared by both). The producer loads K
and V once, then Q (with LSE) and dO (with D) of each query block that sees a key of the
block into two-stage pipelines. Per query block, each consumer warpgroup:

    S^T  = K_w Q^T,  dP^T = V_w dO^T         (issued together; keys on wgmma's M)
    P^T  = exp2(S^T * scale_log2 - LSE_log2)  (masks, ALiBi, softcap as the forward's)
    dS^T = P^T * (dP^T - D)
    dV_w += P^T dO                            (A from registers: the accumulator, converted)
    dS^T -> shared memory; both warpgroups meet
    dQ   = dS K (its half of dQ's rows or columns)
    dK_w += dS^T Q                            (A from registers)
    dQ -> staged in shared memory -> one bulk reduce-add (`cp.reduce.async.bulk`) of the
          warpgroup's run into dQaccum, done by the TMA unit, while dK's wgmma runs
then dK (times the softmax scale) and dV through shared memory to TMA stores.

Computing S and dP transposed keeps P^T and dS^T in the registers the dV and dK GEMMs read
them from (layouts/hopper.py); only dQ reads dS from shared memory. Every consumer thread reads
a stage's LSE and D, so each arrives on the stage's empty barrier itself when done (`release`):
compute-sanitizer's racecheck follows that ordering, not one lane's arrive after a named
barrier (docs/architecture.md, Sanitizers). LSE (already times log2 e)
and D come padded to whole query blocks (+inf and 0 past seqlen_q: P = 0 there), so rows past
the sequence need no test: TMA zero-fills their Q and dO, and drops dK / dV rows past seqlen_k.
dQaccum holds each query tile in warpgroup-run order (kernels/common/dq_accum.py), converted by
`DQConvert` with `hopper=True`. With GQA every query head writes its own dK / dV rows and the
host sums a group's heads, as on the SM80 path.

Above d 128 (`layouts.hopper.bwd_splits_head_dim`) one warpgroup's dK and dV of 64 keys would
take 256 registers a thread (d 256), so the two warpgroups share a CTA's keys. A CTA owns 64
keys and its warpgroups split each GEMM along N: S^T and dP^T by queries (64 keys x
block_m / 2 each), dV, dK and dQ by head-dim columns (d / 2 each). P^T and dS^T go to shared
memory (two stages each), where dV += P^T dO and dK += dS^T Q read them whole as A operands
after the warpgroups meet; warpgroup 0 stores dK, warpgroup 1 dV. Q and dO take one stage
at d 256 (`BwdTraits.q_stages`: two do not fit beside the dQ staging tile).

MLA's q / k 192 with v 128 (and d 192 with v 192: `policy.hopper_bwd_dq`) takes 96 keys a CTA
(FA3's tiles, `layouts.hopper.bwd_keys_on_n`), not a multiple of a warpgroup's 64 rows, so
S = Q K^T and dP = dO V^T put the queries on wgmma's M and each warpgroup's 48 keys on N; P
and dS go into (block_m, 96) tiles as the accumulators lie, two keys a 32-bit store, where
dV^T += dO^T P and dK^T += Q^T dS, the head dim on M, read the warpgroup's own 48 keys as
MN-major B operands, and dQ reads dS whole (K-major A). So P meets only its own warpgroup
(`issue_dv`: stored and dV^T issued while dP's wgmma runs, without dropout), and dS both: one
stage, whose next stores a `DS_FREE` barrier holds until both warpgroups' dQ has read it. The
epilogue writes the transposed accumulators into sK / sV through transposed views. Dropout
draws its keep mask on S as the forward does (`dropout_ds_qk`). MLA's V, dO and dV are 128
wide (`BwdTraits.head_dim_v`: dP over 128 columns, dV^T 128 rows), Q, K, dK and dQ 192. The
tiles of d 192 take 32-column swizzle atoms (`layouts.hopper.bwd_atom_cols`), so that each
warpgroup's 96 columns of dK, dV or dQ start on one (d 96's 16-column ones, for each
warpgroup's 48 columns of dQ); the buckets 160 and 224 run on the d 192 and d 256 tiles.

Packed batches (`call_varlen`): a CTA per (key block, head) of a list of the batch's key blocks
in launch order (`VarlenTiles`: the host puts those with the most query blocks first); an entry
past its sequence's keys walks no query block and stores nothing. Its loads start at the sequence's
first row, so rows past the sequence are the next sequence's, which may hold NaN: the consumers
zero them in shared memory (`clear_rows`: the key block's last K / V rows once, the last query
block's Q / dO rows) before a wgmma reads them, and dK / dV go out by a row-predicated copy
(`store_dkv_rows`) in place of TMA. LSE, D and dQaccum rows are padded per
sequence to whole query blocks (`kernels/common/dq_accum.py:first_tile`).

Deterministic mode adds each query tile's dQ in key-block order (`DqTurn`): a CTA waits until
the key blocks before it have added. That wait is not the consumers': warp 1 + w of the
producer warpgroup takes warpgroup w's staged run (`hand_dq`, `write_dq`; named barriers
`DQ_FULL` / `DQ_EMPTY` of the warpgroup's 128 threads and the warp's 32), waits for the turn,
issues the bulk add and hands the staging run back once the add has read it, while the
warpgroup goes on with its next query block.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from cute_flash.kernels.common.block_range import BlockRange, QueryBlocks, Window, visit_key_block
from cute_flash.kernels.common.block_sparse import BlockSparse, fake_block_sparse
from cute_flash.kernels.common.dq_accum import fake_dq_accum, first_tile
from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.common.flags import score_letters
from cute_flash.kernels.common.gemm import wgmma_issue
from cute_flash.kernels.common.philox import Dropout, keep_bit, wgmma_groups
from cute_flash.kernels.common.score_mods import BwdScalars, Mask, apply_alibi, softcap_with_derivative
from cute_flash.kernels.common.seq_info import SeqInfo
from cute_flash.kernels.common.user_mods import ModCall, check_mods
from cute_flash.kernels.common.varlen_tiles import VarlenTiles, fake_tiles
from cute_flash.kernels.sm90.barriers import BwdBarrier
from cute_flash.kernels.sm90.bwd_dq import DqAdds
from cute_flash.kernels.sm90.bwd_epilogue import BwdEpilogue
from cute_flash.kernels.sm90.bwd_state import (KeyTile, Sm90BwdPipes, Sm90BwdRecipe, Sm90BwdSmem, Sm90BwdTensors,
                                               Sm90BwdVarlen)
from cute_flash.kernels.sm90.pipeline import seq_first, tma_rows, use_state
from layouts import hopper
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.traits import ALIGN, COPY_BYTES, ELEMENT_BYTES, SMEM_LIMIT, BwdTraits, element_type

REGISTERS = (24, 240)  # (producer, consumer) per thread: 128 x 24 + 256 x 240 <= 64K


# the default mode's dQ adds -> the name's letters: "bulk", each consumer warpgroup stages its run
# in shared memory and issues one bulk reduce-add of it; "writer", the staged run handed to a
# producer warp that issues the add (as deterministic mode's, without its turn); "atomic",
# `red.global.add.v4.f32` from registers (no staging tile: its 4 * block_m * head_dim bytes of
# shared memory free, e.g. for a second Q / dO stage at d 256)
DQ_PATHS = {"bulk": "", "writer": "-W", "atomic": "-A"}


@dataclass(frozen=True)
class Sm90BwdConfig:
    """One compiled Hopper backward variant: the tiles (BwdTraits: block_m x block_n, the
    head-dim bucket, dtype; the warp grids are the SM80 kernel's and unused here) and the score
    flags."""
    traits: BwdTraits
    has_left: bool = False
    has_right: bool = False
    has_alibi: bool = False
    has_softcap: bool = False
    has_dropout: bool = False  # the forward's Philox mask, recomputed (kernels/common/philox.py)
    varlen: bool = False       # packed batches (`call_varlen`)
    has_seqused_k: bool = False
    deterministic: bool = False  # dQ's adds in key-block order (`DqTurn`): bitwise repeatable
    dq_path: str = "bulk"        # how the other mode adds dQ (`DQ_PATHS`)
    mods: object = None          # UserMods: Python-written score / mask mods (kernels/common/user_mods.py)
    block_sparse: bool = False   # dense: each key block visits its listed query blocks alone, the mask_mod
                                 # evaluated on the partial ones (kernels/common/block_sparse.py)

    def __post_init__(self):
        keys = (64, 96) if hopper.bwd_splits_head_dim(self.traits) else (128,)
        if self.traits.block_n not in keys or self.traits.block_m % 64:
            raise ValueError("the Hopper backward takes 128 keys per CTA (64 or 96 above d 128) and query blocks of "
                             "64 rows or more")
        if self.has_seqused_k and not self.varlen:
            raise ValueError("has_seqused_k belongs to packed batches (varlen)")
        check_mods(self.mods, False, self.has_softcap, self.has_alibi, backward=True)
        if self.block_sparse and (self.mods is None or self.mods.mask_mod is None or self.varlen
                                  or self.deterministic):
            raise ValueError("block sparsity lists the blocks a mask_mod cuts, in a dense launch; deterministic "
                             "dQ adds count every key block of a query block")
        if self.dq_path not in DQ_PATHS or (self.deterministic and self.dq_path != "bulk"):
            raise ValueError(f"dq_path is one of {tuple(DQ_PATHS)}, the default mode's: deterministic mode's dQ "
                             "adds are its writer warps', in turn")
        if self.smem_bytes > SMEM_LIMIT[90]:  # e.g. a tuning override's stages beside the dQ staging tile
            raise ValueError(f"{self.name} takes {self.smem_bytes} bytes of shared memory, over {SMEM_LIMIT[90]}")

    @property
    def writes_dq_apart(self) -> bool:
        """Consumer warpgroups hand their staged dQ run to a producer warp that issues its bulk
        add (`DqAdds.write_dq`) and go on: deterministic mode (in turn) and the "writer" path."""
        return self.deterministic or self.dq_path == "writer"

    @property
    def stages_dq(self) -> bool:
        """dQ goes through an fp32 staging tile in shared memory (every path but "atomic";
        deterministic mode's is "bulk")."""
        return self.dq_path != "atomic"

    @property
    def dq_descending(self) -> bool:
        """Deterministic with a right edge (causal, or a window's right side): a query block's
        dQ adds run from its last key block down, and the key blocks launch in that order. A
        right edge makes key block n's first query block grow with n, so in increasing order
        each key block waited for the one below to reach its first query block, a chain as long
        as the sequence; in decreasing order a key block's turn comes as it gets there
        (docs/tuning/backward.md, "Deterministic mode: the order of the dQ adds")."""
        return self.deterministic and self.has_right

    @property
    def num_threads(self) -> int:
        """The consumer warpgroups and one producer warpgroup."""
        return 128 * (hopper.bwd_warpgroups(self.traits) + 1)

    @property
    def smem_bytes(self) -> int:
        """`layouts.hopper.bwd_smem_bytes` of its tiles and dQ path."""
        return hopper.bwd_smem_bytes(self.traits, self.stages_dq)

    @property
    def name(self) -> str:
        t = self.traits
        modes = ("-V" if self.varlen else "") + ("-D" if self.deterministic else "") + DQ_PATHS[self.dq_path]
        modes += "-B" if self.block_sparse else ""
        if self.mods is not None:
            modes += "-M" + "".join(m.digest for m in (self.mods.score_mod, self.mods.mask_mod) if m is not None)
        value = "" if t.head_dim_v is None else f"_v{t.head_dim_v}"
        stages = f"q{t.q_stages}" + ("" if t.do_stages is None else f"o{t.do_stages}")
        return (f"sm90_bwd_d{t.head_dim}{value}_m{t.block_m}_n{t.block_n}_{stages}_{t.dtype}-{score_letters(self)}"
                f"{modes}")


class FlashBwdSm90(DqAdds, BwdEpilogue):
    def __init__(self, config: Sm90BwdConfig):
        self.config = config
        self.t = config.traits
        self.dtype = element_type(config.traits)
        self.wgs = hopper.bwd_warpgroups(config.traits)
        self.split = hopper.bwd_splits_head_dim(config.traits)
        self.q_stages = config.traits.q_stages  # Q / LSE stages
        self.do_stages = config.traits.stages_do  # dO / D stages
        self.keys_on_n = hopper.bwd_keys_on_n(config.traits)
        self.ds_stages = hopper.bwd_ds_stages(config.traits)  # dS^T (and P^T)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mAlibi, mRng, mSemaphore,
                 aux_tensors, block_sparse, softmax_scale: cutlass.Float32, scale_log2: cutlass.Float32,
                 score_premul: cutlass.Float32,
                 alibi_div: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """mQ / mdO (batch, seqlen_q, heads, d / dv), mK / mV (batch, seqlen_k, heads_k, d / dv),
        mdK / mdV (batch, seqlen_k, heads, d / dv), mLSE / mD (batch, heads, seqlen_q_pad) fp32 (see
        Sm90BwdTensors), mdQaccum (1, batch, heads, seqlen_q_pad / bm, bm * d) fp32 zeroed; mRng
        (4,) uint32, the forward's dropout state, or None; mSemaphore (batch, heads, seqlen_q_pad /
        bm) int32 zeroed when deterministic, else None; block_sparse the lists by key block of
        `BlockSparse.of` (`Sm90BwdConfig.block_sparse`), else None."""
        grid = (cute.ceil_div(mK.shape[1], self.t.block_n), mQ.shape[2], mQ.shape[0])
        self.launch(mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mAlibi, mRng, mSemaphore, None, grid,
                    BwdScalars(softmax_scale, scale_log2, score_premul, alibi_div, window_left, window_right), stream,
                    aux_tensors, BlockSparse.of(block_sparse))

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                    mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mAlibi, mRng,
                    mSemaphore, aux_tensors, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK,
                    mTiles: cute.Tensor,
                    softmax_scale: cutlass.Float32, scale_log2: cutlass.Float32, score_premul: cutlass.Float32,
                    alibi_div: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """Packed batches: mQ / mdO (total_q, heads, d / dv), mK / mV (total_k, heads_k, d / dv),
        mdK / mdV (total_k, heads, d / dv) zeroed, mLSE / mD (heads, tiles * bm) and mdQaccum (1, heads, tiles, bm
        * d) in rows padded per sequence to whole query blocks (`dq_accum.first_tile`),
        cu_seqlens (batch + 1,) int32, seqused_k (batch,) int32 or None, mSemaphore (heads, tiles)
        int32 zeroed when deterministic, mTiles (entries, 2) int32 (sequence, key block) in launch
        order (`VarlenTiles`; deterministic: a sequence's key blocks in increasing order)."""
        varlen = Sm90BwdVarlen(mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mdK, mdV, VarlenTiles(mTiles, mQ.shape[1]))
        grid = (varlen.tiles.ctas(), 1, 1)
        self.launch(mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdK, mdV, mAlibi, mRng, mSemaphore, varlen, grid,
                    BwdScalars(softmax_scale, scale_log2, score_premul, alibi_div, window_left, window_right), stream,
                    aux_tensors)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
               mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mAlibi, mRng, mSemaphore,
               varlen, grid, scalars: BwdScalars, stream, aux_tensors=None, sparse=None):
        """The TMA atoms, shared storage and recipe of either entry, then the kernel on `grid`."""
        t = self.t
        bm, bn, d, dv = t.block_m, t.block_n, t.head_dim, t.dv
        sQ_layout = hopper.bwd_smem_layout(t, bm, self.q_stages)
        sdO_layout = hopper.bwd_smem_layout(t, bm, self.do_stages, dv)
        sK_layout = hopper.bwd_smem_layout(t, bn)
        sV_layout = hopper.bwd_smem_layout(t, bn, cols=dv)
        sdS_layout = hopper.smem_layout_ds(t, self.ds_stages)
        tma_q, tma_mQ = hopper.tma_load_atom(t, seq_first(mQ), cute.slice_(sQ_layout, (None, None, 0)), bm)
        tma_do, tma_mdO = hopper.tma_load_atom(t, seq_first(mdO), cute.slice_(sdO_layout, (None, None, 0)), bm,
                                               cols=dv)
        tma_k, tma_mK = hopper.tma_load_atom(t, seq_first(mK), sK_layout, bn)
        tma_v, tma_mV = hopper.tma_load_atom(t, seq_first(mV), sV_layout, bn, cols=dv)
        rows = bn if self.split else hopper.WGMMA_M  # what one TMA store of dK / dV covers
        tma_dk, tma_mdK = hopper.tma_store_atom(t, seq_first(mdK), hopper.bwd_smem_layout(t, rows), rows)
        tma_dv, tma_mdV = hopper.tma_store_atom(t, seq_first(mdV), hopper.bwd_smem_layout(t, rows, cols=dv), rows,
                                                cols=dv)

        fields = {
            "kv_barrier": (cutlass.Int64, 1, None), "q_barriers": (cutlass.Int64, 2 * self.q_stages, None),
            "do_barriers": (cutlass.Int64, 2 * self.do_stages, None),
            "sQ": (self.dtype, cute.cosize(sQ_layout), 1024), "sdO": (self.dtype, cute.cosize(sdO_layout), 1024),
            "sK": (self.dtype, cute.cosize(sK_layout), 1024), "sV": (self.dtype, cute.cosize(sV_layout), 1024),
            "sdS": (self.dtype, cute.cosize(sdS_layout), 1024),
            "sdQaccum": (cutlass.Float32, bm * d, 1024), "sLSE": (cutlass.Float32, bm * self.q_stages, 128),
            "sD": (cutlass.Float32, bm * self.do_stages, 128)}
        if cutlass.const_expr(not self.config.stages_dq):
            del fields["sdQaccum"]
        if cutlass.const_expr(self.split):
            fields["sP"] = (self.dtype, cute.cosize(sdS_layout), 1024)
        SharedStorage = lsmem.smem_struct(fields)

        recipe = Sm90BwdRecipe(sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, tma_q, tma_do, tma_k, tma_v,
                               tma_dk, tma_dv, hopper.tiled_mma_sdp_t(t), hopper.tiled_mma_dk(t),
                               hopper.tiled_mma_dkv(t, dv), hopper.tiled_mma_dq(t))
        args = Sm90BwdTensors(tma_mQ, tma_mK, tma_mV, tma_mdO, tma_mdK, tma_mdV, mLSE, mD, mdQaccum, mAlibi, mRng,
                              mSemaphore, varlen, aux_tensors, sparse)
        self.kernel(args, scalars, recipe, SharedStorage).launch(
            grid=grid, block=[self.config.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, args: Sm90BwdTensors, scalars: BwdScalars, recipe: Sm90BwdRecipe,
               SharedStorage: cutlass.Constexpr):
        cfg, t = self.config, self.t
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if cutlass.const_expr(args.varlen is None):
            n_block, bidh, bidb = cute.arch.block_idx()
            if cutlass.const_expr(cfg.dq_descending):  # the last key block launches first (`DqTurn`)
                n_block = cute.arch.grid_dim()[0] - 1 - n_block
        else:
            bidb, n_block, bidh = args.varlen.tiles.at(cute.arch.block_idx()[0])

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        kv_full = storage.kv_barrier.data_ptr()
        if warp == 0:
            for atom in (recipe.tma_q, recipe.tma_do, recipe.tma_k, recipe.tma_v):
                cpasync.prefetch_descriptor(atom)
        if tidx == 0:
            cute.arch.mbarrier_init(kv_full, 1)
        consumer_threads = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.wgs)  # all arrive: `release`
        q_pipe, do_pipe = (pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers, num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread), consumer_group=consumer_threads,
            tx_count=cute.size_in_bytes(self.dtype, cute.slice_(layout, (None, None, 0))) + 4 * t.block_m,
            defer_sync=True) for barriers, layout, stages in (
                (storage.q_barriers.data_ptr(), recipe.sQ_layout, self.q_stages),
                (storage.do_barriers.data_ptr(), recipe.sdO_layout, self.do_stages)))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        pipes = Sm90BwdPipes(kv_full, q_pipe, do_pipe)
        sP = None
        if cutlass.const_expr(self.split):
            sP = storage.sP.get_tensor(recipe.sdS_layout.outer, swizzle=recipe.sdS_layout.inner)
        smem = Sm90BwdSmem(
            storage.sQ.get_tensor(recipe.sQ_layout.outer, swizzle=recipe.sQ_layout.inner),
            storage.sdO.get_tensor(recipe.sdO_layout.outer, swizzle=recipe.sdO_layout.inner),
            storage.sK.get_tensor(recipe.sK_layout.outer, swizzle=recipe.sK_layout.inner),
            storage.sV.get_tensor(recipe.sV_layout.outer, swizzle=recipe.sV_layout.inner),
            storage.sdS.get_tensor(recipe.sdS_layout.outer, swizzle=recipe.sdS_layout.inner),
            storage.sLSE.get_tensor(cute.make_layout((t.block_m, self.q_stages))),
            storage.sD.get_tensor(cute.make_layout((t.block_m, self.do_stages))),
            storage.sdQaccum.get_tensor(cute.make_layout(t.block_m * t.head_dim)) if cfg.stages_dq else None, sP)

        window = Window(scalars.window_left, scalars.window_right, cfg.has_left, cfg.has_right)
        if cutlass.const_expr(args.varlen is None):
            seq = SeqInfo.make(bidb, args.tma_mQ.shape[0], args.tma_mK.shape[0])
            blocks = QueryBlocks.make(seq, n_block, t.block_m, t.block_n, window)
            sparse = None
            if cutlass.const_expr(args.sparse is not None):  # the key block's listed query blocks alone
                sparse = args.sparse.row(bidb, bidh, n_block)
            tile = KeyTile(n_block, bidh, bidb, seq, blocks.m_block_min, blocks.m_block_max, sparse)
        else:
            seq = SeqInfo.make(bidb, args.tma_mQ.shape[0], args.tma_mK.shape[0], args.varlen.mCuSeqlensQ,
                               args.varlen.mCuSeqlensK, args.varlen.mSeqUsedK)
            blocks = QueryBlocks.make(seq, n_block, t.block_m, t.block_n, window)
            m_block_max = blocks.m_block_max  # a block past the sequence's keys walks no query block
            if n_block * t.block_n >= seq.seqlen_k:
                m_block_max = blocks.m_block_min
            tile = KeyTile(n_block, bidh, bidb, seq, blocks.m_block_min, m_block_max)

        producer_regs, consumer_regs = REGISTERS
        if warp < 4:
            cute.arch.setmaxregister_decrease(producer_regs)
            if warp == 0:
                self.produce(args, recipe, pipes, smem, tile)
            if cutlass.const_expr(cfg.writes_dq_apart):
                if warp >= 1:
                    if warp <= self.wgs:  # warp 1 + w: warpgroup w's dQ adds (deterministic: each in its turn)
                        self.write_dq(args, smem, tile, window, warp - 1)
        else:
            cute.arch.setmaxregister_increase(consumer_regs)
            self.consume(args, scalars, recipe, pipes, smem, tile, window, tidx - 128)

    @cute.jit
    def produce(self, args: Sm90BwdTensors, recipe: Sm90BwdRecipe, pipes: Sm90BwdPipes, smem: Sm90BwdSmem,
                tile: KeyTile):
        """Warp 0: K and V, then Q + LSE and dO + D of each query block into the next free stage
        of their pipelines (a TMA copy is issued by the whole warp: it elects one lane itself;
        LSE and D, contiguous runs of block_m floats, by one lane's bulk copy)."""
        t = self.t
        bm, bn, d, dv = t.block_m, t.block_n, t.head_dim, t.dv
        heads = args.tma_mQ.shape[2]
        bidh_kv = tile.bidh // (heads // args.tma_mK.shape[2])
        one = cute.make_layout(1)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(pipes.kv_full, cute.size_in_bytes(self.dtype, recipe.sK_layout)
                                                    + cute.size_in_bytes(self.dtype, recipe.sV_layout))
        for atom, src, dst, cols in ((recipe.tma_k, args.tma_mK, smem.sK, d), (recipe.tma_v, args.tma_mV, smem.sV, dv)):
            g = cute.local_tile(tma_rows(src, tile.seq.sum_s_k, bidh_kv, tile.bidb), (bn, cols),
                                (tile.n_block, 0))  # (bn, d) K's, (bn, dv) V's
            tXsX, tXgX = cpasync.tma_partition(atom, 0, one, cute.group_modes(dst, 0, 2),
                                               cute.group_modes(g, 0, 2))  # (TMA,), (TMA,)
            cute.copy(atom, tXgX, tXsX, tma_bar_ptr=pipes.kv_full)

        gQ = cute.local_tile(tma_rows(args.tma_mQ, tile.seq.sum_s_q, tile.bidh, tile.bidb), (bm, d),
                             (None, 0))  # (bm, d, m_blocks)
        gdO = cute.local_tile(tma_rows(args.tma_mdO, tile.seq.sum_s_q, tile.bidh, tile.bidb), (bm, dv),
                              (None, 0))  # (bm, dv, m_blocks)
        tQsQ, tQgQ = cpasync.tma_partition(recipe.tma_q, 0, one, cute.group_modes(smem.sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))  # (TMA, stages), (TMA, m_blocks)
        tdOsdO, tdOgdO = cpasync.tma_partition(recipe.tma_do, 0, one, cute.group_modes(smem.sdO, 0, 2),
                                               cute.group_modes(gdO, 0, 2))  # (TMA, stages), (TMA, m_blocks)
        lse_row, d_row = self.stat_rows(args.mLSE, tile), self.stat_rows(args.mD, tile)  # (seqlen_q_pad,)
        for i in cutlass.range(tile.count(), unroll=1):
            m_block = tile.m_block(i)
            write, write_do = use_state(i, self.q_stages, producer=True), use_state(i, self.do_stages, producer=True)
            pipes.q.producer_acquire(write)
            bar = pipes.q.producer_get_barrier(write)
            cute.copy(recipe.tma_q, tQgQ[None, m_block], tQsQ[None, write.index], tma_bar_ptr=bar)
            self.bulk_load(lse_row, smem.sLSE, m_block, write.index, bar)
            pipes.do.producer_acquire(write_do)
            bar = pipes.do.producer_get_barrier(write_do)
            cute.copy(recipe.tma_do, tdOgdO[None, m_block], tdOsdO[None, write_do.index], tma_bar_ptr=bar)
            self.bulk_load(d_row, smem.sD, m_block, write_do.index, bar)

    def stat_rows(self, mX: cute.Tensor, tile: KeyTile) -> cute.Tensor:
        """This (sequence, head)'s padded LSE or D row: dense (batch, heads, seqlen_q_pad) indexed,
        packed (heads, rows) from the sequence's first tile (a multiple of block_m floats: the
        bulk copies stay 16-byte aligned)."""
        if cutlass.const_expr(tile.seq.sum_s_q is None):
            return mX[tile.bidb, tile.bidh, None]
        return cute.domain_offset((first_tile(tile.seq, tile.bidb, self.t.block_m) * self.t.block_m,),
                                  mX[tile.bidh, None])

    @cute.jit
    def bulk_load(self, row: cute.Tensor, s: cute.Tensor, m_block, stage, bar):
        """block_m floats of `row` from m_block * block_m into stage `stage` of `s`, completing
        on mbarrier `bar` (16-byte aligned: the rows are padded to whole query blocks)."""
        bm = self.t.block_m
        with cute.arch.elect_one():
            src = row.iterator + cute.assume(m_block * bm, divby=bm)
            dst = s.iterator + cute.assume(stage * bm, divby=bm)
            cute.arch.inline_ptx(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], {$r2}, [{$r3}];",
                read_only_args=[dst.toint(), src.toint(), cutlass.Int32(bm * 4), bar.toint()])

    @cute.jit
    def consume(self, args: Sm90BwdTensors, scalars: BwdScalars, recipe: Sm90BwdRecipe, pipes: Sm90BwdPipes,
                smem: Sm90BwdSmem, tile: KeyTile, window: Window, mma_tidx):
        """A consumer warpgroup: dK and dV of its keys (64; 48 on the 96-key tiles), and its share
        of each query block's dQ (mma_tidx: the thread's index among the consumers)."""
        cfg, t = self.config, self.t
        bm, bn, d, dv = t.block_m, t.block_n, t.head_dim, t.dv
        wg_idx = cute.arch.make_warp_uniform(mma_tidx // 128)  # so the wgmma descriptors it offsets stay uniform
        wg = cute.make_layout(self.wgs, stride=128)  # A / B partitions are per warpgroup: its first thread
        wg_sdp = recipe.mma_sdp.get_slice(wg(wg_idx))
        wg_dkv = recipe.mma_dkv.get_slice(wg(wg_idx))
        wg_dv = recipe.mma_dv.get_slice(wg(wg_idx))
        wg_dq = recipe.mma_dq.get_slice(wg(wg_idx))
        tdVsP = tdKsdS = None  # above d 128: P^T and dS^T from shared memory (dV's, dK's A; 96 keys: P, dS as B)
        if cutlass.const_expr(self.keys_on_n):  # S = Q K^T, dP = dO V^T; dV^T += dO^T P, dK^T += Q^T dS
            tSrQ = recipe.mma_sdp.make_fragment_A(wg_sdp.partition_A(smem.sQ))     # (MMA, MMA_M, MMA_K, stages)
            tSrK = recipe.mma_sdp.make_fragment_B(wg_sdp.partition_B(smem.sK))     # (MMA, MMA_N, MMA_K)
            tdPrdO = recipe.mma_sdp.make_fragment_A(wg_sdp.partition_A(smem.sdO))  # (MMA, MMA_M, MMA_K, stages)
            tdPrV = recipe.mma_sdp.make_fragment_B(wg_sdp.partition_B(smem.sV))    # (MMA, MMA_N, MMA_K)
            tdVrdO = recipe.mma_dv.make_fragment_A(wg_dv.partition_A(lsmem.transposed_view(smem.sdO)))  # (.., stages)
            tdKrQ = recipe.mma_dkv.make_fragment_A(wg_dkv.partition_A(lsmem.transposed_view(smem.sQ)))  # (.., stages)
            tdQrdS = recipe.mma_dq.make_fragment_A(wg_dq.partition_A(smem.sdS))  # (MMA, MMA_M, MMA_K, stages)
            tdQrK = recipe.mma_dq.make_fragment_B(wg_dq.partition_B(lsmem.transposed_view(smem.sK)))    # (MMA, N, K)
            tdVsP = recipe.mma_dv.make_fragment_B(wg_dv.partition_B(lsmem.transposed_view(smem.sP)))     # (.., stages)
            tdKsdS = recipe.mma_dkv.make_fragment_B(wg_dkv.partition_B(lsmem.transposed_view(smem.sdS)))  # (.., stages)
        else:
            tSrK = recipe.mma_sdp.make_fragment_A(wg_sdp.partition_A(smem.sK))     # (MMA, MMA_M, MMA_K)
            tSrQ = recipe.mma_sdp.make_fragment_B(wg_sdp.partition_B(smem.sQ))     # (MMA, MMA_N, MMA_K, stages)
            tdPrV = recipe.mma_sdp.make_fragment_A(wg_sdp.partition_A(smem.sV))    # (MMA, MMA_M, MMA_K)
            tdPrdO = recipe.mma_sdp.make_fragment_B(wg_sdp.partition_B(smem.sdO))  # (MMA, MMA_N, MMA_K, stages)
            tdVrdO = recipe.mma_dv.make_fragment_B(wg_dv.partition_B(lsmem.transposed_view(smem.sdO)))  # (.., stages)
            tdKrQ = recipe.mma_dkv.make_fragment_B(wg_dkv.partition_B(lsmem.transposed_view(smem.sQ)))  # (.., stages)
            tdQrdS = recipe.mma_dq.make_fragment_A(wg_dq.partition_A(lsmem.transposed_view(smem.sdS)))  # (.., stages)
            tdQrK = recipe.mma_dq.make_fragment_B(wg_dq.partition_B(lsmem.transposed_view(smem.sK)))    # (MMA, N, K)
            if cutlass.const_expr(self.split):
                tdVsP = recipe.mma_dv.make_fragment_A(wg_dv.partition_A(smem.sP))      # (MMA, MMA_M, MMA_K, stages)
            if cutlass.const_expr(hopper.bwd_dk_reads_smem(t)):  # dS^T from shared memory: dK's A
                tdKsdS = recipe.mma_dkv.make_fragment_A(wg_dkv.partition_A(smem.sdS))  # (MMA, MMA_M, MMA_K, stages)
        scores = hopper.bwd_scores_shape(t)  # (bn, bm), or (bm, bn) on the 96-key tiles
        acc_s = cute.make_rmem_tensor(wg_sdp.partition_shape_C(scores), cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        acc_dp = cute.make_rmem_tensor(wg_sdp.partition_shape_C(scores), cutlass.Float32)
        acc_dk = cute.make_rmem_tensor(wg_dkv.partition_shape_C(hopper.bwd_dkv_shape(t)),
                                       cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        acc_dv = cute.make_rmem_tensor(wg_dv.partition_shape_C(hopper.bwd_dkv_shape(t, dv)), cutlass.Float32)
        acc_dq = cute.make_rmem_tensor(wg_dq.partition_shape_C((bm, d)), cutlass.Float32)
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)

        slope = cutlass.Float32(0.0)
        if cutlass.const_expr(cfg.has_alibi):
            slope = args.mAlibi[tile.bidb, tile.bidh] * scalars.alibi_div
        mask = Mask(tile.seq.seqlen_q, tile.seq.seqlen_k, window)
        user = None
        if cutlass.const_expr(cfg.mods is not None):
            user = ModCall.make(cfg.mods, tile.bidb, tile.bidh, tile.seq, args.aux, scalars.score_premul)
        dropout = None
        if cutlass.const_expr(cfg.has_dropout):
            dropout = Dropout.load(args.mRng, tile.bidb, tile.bidh, args.tma_mQ.shape[2], packed=self.keys_on_n)
        cute.arch.mbarrier_wait(pipes.kv_full, 0)
        packed = cutlass.const_expr(args.varlen is not None)
        if cutlass.const_expr(packed):  # the next sequence's keys in the block's last rows: zeroed
            keys = tile.seq.seqlen_k - tile.n_block * bn
            if keys < bn:
                if tile.m_block_max > tile.m_block_min:  # (a block past the keys walks nothing)
                    self.clear_rows((smem.sK, smem.sV), keys, bn, mma_tidx)
        for i in cutlass.range(tile.count(), unroll=1):
            m_block = tile.m_block(i)
            read, read_do = use_state(i, self.q_stages, producer=False), use_state(i, self.do_stages, producer=False)
            ds = read.index  # the dS^T (and P^T) stage
            if cutlass.const_expr(self.q_stages != self.ds_stages):
                ds = i % self.ds_stages
            # MMAs of this iteration's own: wgmma sets an MMA's accumulate field, state that
            # must not escape the loop it was set in.
            mma_s, mma_dp = hopper.tiled_mma_sdp_t(t), hopper.tiled_mma_sdp_t(t)
            mma_dv, mma_dk, mma_dq = hopper.tiled_mma_dkv(t, dv), hopper.tiled_mma_dk(t), hopper.tiled_mma_dq(t)
            pipes.q.consumer_wait(read)
            if cutlass.const_expr(packed):  # the next sequence's queries in the block's last rows: zeroed
                pipes.do.consumer_wait(read_do)
                queries = tile.seq.seqlen_q - m_block * bm
                if queries < bm:
                    self.clear_rows((smem.sQ[None, None, read.index], smem.sdO[None, None, read_do.index]), queries,
                                    bm, mma_tidx)
            if cutlass.const_expr(self.keys_on_n):
                wgmma_issue(mma_s, acc_s, tSrQ[None, None, None, read.index], tSrK)
                pipes.do.consumer_wait(read_do)
                wgmma_issue(mma_dp, acc_dp, tdPrdO[None, None, None, read_do.index], tdPrV)
            else:
                wgmma_issue(mma_s, acc_s, tSrK, tSrQ[None, None, None, read.index])
                pipes.do.consumer_wait(read_do)
                wgmma_issue(mma_dp, acc_dp, tdPrV, tdPrdO[None, None, None, read_do.index])
            warpgroup.wait_group(1)  # S^T landed; dP^T may still run

            dtanh = None
            if cutlass.const_expr(cfg.has_softcap):
                dtanh = softcap_with_derivative(acc_s, scalars.score_premul)
            pre = None  # a score_mod's input, scale * S^T, for its backward
            if cutlass.const_expr(user is not None and cfg.mods.score_mod_bwd is not None):
                pre = cute.make_fragment_like(acc_s, cutlass.Float32)  # (MMA, MMA_M, MMA_N)
                pre.store(acc_s.load() * scalars.score_premul)
            lo, hi = BlockRange.unmasked(tile.seq, m_block, bm, bn, window)
            visit_key_block(tile.sparse, i, tile.n_block, lo, hi, functools.partial(
                self.modify, acc_s, mask, slope, m_block, tile.n_block, mma_tidx, recipe, user=user))

            c_sdp = recipe.mma_sdp.get_slice(mma_tidx)
            tLSE = self.keys_by_queries(c_sdp.partition_C(self.by_query(smem.sLSE, read.index)))  # (keys, queries)
            tD = self.keys_by_queries(c_sdp.partition_C(self.by_query(smem.sD, read_do.index)))
            acc_s_mn = self.keys_by_queries(acc_s)  # (keys, queries)
            acc_dp_mn = self.keys_by_queries(acc_dp)
            for c in cutlass.range_constexpr(cute.size(acc_s_mn.shape[1])):
                lse = tLSE[0, c]
                for r in cutlass.range_constexpr(cute.size(acc_s_mn.shape[0])):
                    acc_s_mn[r, c] = cute.math.exp2(acc_s_mn[r, c] * scalars.scale_log2 - lse, fastmath=True)
            if cutlass.const_expr(self.keys_on_n and not cfg.has_dropout):  # P stored, dV^T issued while dP runs
                self.issue_dv(mma_dv, acc_dv, acc_s, smem.sP, ds, c_sdp, tdVrdO[None, None, None, read_do.index],
                              tdVsP[None, None, None, ds], wg_idx)
                warpgroup.wait_group(1)  # dP landed; dV^T may still run
            else:
                warpgroup.wait_group(0)  # dP^T landed
            if cutlass.const_expr(cfg.has_dropout and self.keys_on_n):
                self.dropout_ds_qk(dropout, recipe, mma_tidx, m_block, tile.n_block, acc_s, acc_dp,
                                   c_sdp.partition_C(self.by_query(smem.sD, read_do.index)))
            elif cutlass.const_expr(cfg.has_dropout):
                keep_bits = dropout.pair_keep_bits(recipe.mma_sdp, mma_tidx, m_block * bm, tile.n_block * bn, (bn, bm))
                self.dropout_ds(dropout, keep_bits, acc_s, acc_dp,
                                c_sdp.partition_C(self.by_query(smem.sD, read_do.index)))
            else:
                for c in cutlass.range_constexpr(cute.size(acc_s_mn.shape[1])):
                    dot = tD[0, c]
                    for r in cutlass.range_constexpr(cute.size(acc_s_mn.shape[0])):
                        acc_dp_mn[r, c] = acc_s_mn[r, c] * (acc_dp_mn[r, c] - dot)
            if cutlass.const_expr(cfg.has_softcap):
                for j in cutlass.range(cute.size(acc_dp), unroll_full=True):
                    acc_dp[j] = acc_dp[j] * dtanh[j]
            if cutlass.const_expr(pre is not None):
                tScS = self.query_key_coords(recipe, mma_tidx)
                user.backward(transposed(self.keys_by_queries(acc_dp)), transposed(self.keys_by_queries(pre)), tScS,
                              m_block * bm, tile.n_block * bn)

            if cutlass.const_expr(self.keys_on_n):  # dS into its tile: dK^T's B and dQ's A
                if cutlass.const_expr(cfg.has_dropout):  # the dropped P, dV^T's B
                    self.issue_dv(mma_dv, acc_dv, acc_s, smem.sP, ds, c_sdp, tdVrdO[None, None, None, read_do.index],
                                  tdVsP[None, None, None, ds], wg_idx)
                # the last block's dQ wgmmas, which read every warpgroup's dS, are done (each
                # warpgroup waited for its own before arriving)
                cute.arch.barrier(barrier_id=BwdBarrier.DS_FREE, number_of_threads=128 * self.wgs)
                self.store_scores(acc_dp, smem.sdS, ds, c_sdp)
                cute.arch.fence_view_async_shared()  # the dS stores, before wgmma (async proxy) reads them
                cute.arch.barrier(barrier_id=BwdBarrier.DS, number_of_threads=128 * self.wgs)
                wgmma_issue(mma_dq, acc_dq, tdQrdS[None, None, None, ds], tdQrK)
                wgmma_issue(mma_dk, acc_dk, tdKrQ[None, None, None, read.index], tdKsdS[None, None, None, ds],
                            accumulate=True)
            elif cutlass.const_expr(self.split):  # P^T and dS^T to shared memory: dV and dK read them whole
                self.store_scores(acc_s, smem.sP, ds, c_sdp)
            else:
                tdVrP = hopper.p_operand(acc_s, self.dtype)  # ((2, 2, 2), MMA_M, MMA_K): P^T as dV's A
                wgmma_issue(mma_dv, acc_dv, tdVrP, tdVrdO[None, None, None, read_do.index], accumulate=True)
            if cutlass.const_expr(not self.keys_on_n):
                rdS = self.store_scores(acc_dp, smem.sdS, ds, c_sdp)  # (MMA, MMA_M, MMA_N): dS^T, dK's A up to d 128
                cute.arch.fence_view_async_shared()  # the P^T / dS^T stores, before wgmma (async proxy) reads them
                cute.arch.barrier(barrier_id=BwdBarrier.DS, number_of_threads=128 * self.wgs)
                if cutlass.const_expr(self.split):
                    wgmma_issue(mma_dv, acc_dv, tdVsP[None, None, None, ds], tdVrdO[None, None, None, read_do.index],
                                accumulate=True)
                    wgmma_issue(mma_dq, acc_dq, tdQrdS[None, None, None, ds], tdQrK)
                    wgmma_issue(mma_dk, acc_dk, tdKsdS[None, None, None, ds], tdKrQ[None, None, None, read.index],
                                accumulate=True)
                else:
                    wgmma_issue(mma_dq, acc_dq, tdQrdS[None, None, None, ds], tdQrK)
                    tdKrdS = (tdKsdS[None, None, None, ds] if cutlass.const_expr(tdKsdS is not None)
                              else hopper.acc_as_operand_a(rdS))  # dK's A: dS^T from its tile or from registers
                    wgmma_issue(mma_dk, acc_dk, tdKrdS, tdKrQ[None, None, None, read.index], accumulate=True)
            warpgroup.wait_group(1)  # dV and dQ landed; dK runs under dQ's staging and bulk add
            self.release(pipes.do, read_do)
            if cutlass.const_expr(cfg.writes_dq_apart):
                self.hand_dq(acc_dq, smem.sdQaccum, mma_tidx)
            elif cutlass.const_expr(not cfg.stages_dq):
                self.add_dq_atomic(acc_dq, self.dq_chunk(args.mdQaccum, tile, m_block), mma_tidx)
            else:
                self.add_dq(acc_dq, self.dq_chunk(args.mdQaccum, tile, m_block), smem.sdQaccum, mma_tidx)
            warpgroup.wait_group(0)
            self.release(pipes.q, read)
        self.store_dkv(acc_dk, acc_dv, scalars, recipe, args, smem, tile, mma_tidx)

    @cute.jit
    def issue_dv(self, mma_dv: cute.TiledMma, acc_dv: cute.Tensor, acc_s: cute.Tensor, sP: cute.Tensor, ds, c_sdp,
                 tdVrdO: cute.Tensor, tdVsP: cute.Tensor, wg_idx):
        """The 96-key tiles: P (acc_s, queries on M) into stage `ds` of its (bm, bn) tile, then
        dV^T += dO^T P issued. A warpgroup's P columns are its own 48 keys, which only its own
        dV^T reads (its last one waited for at the end of the last block), so the warpgroup
        meets itself alone."""
        self.store_scores(acc_s, sP, ds, c_sdp)
        cute.arch.fence_view_async_shared()  # the P stores, before wgmma (async proxy) reads them
        cute.arch.barrier(barrier_id=BwdBarrier.P_READY + wg_idx, number_of_threads=128)
        wgmma_issue(mma_dv, acc_dv, tdVrdO, tdVsP, accumulate=True)

    @cute.jit
    def store_scores(self, acc: cute.Tensor, s: cute.Tensor, ds, c_sdp) -> cute.Tensor:
        """A scores-shaped accumulator (P^T or dS^T; on the 96-key tiles P or dS, as it lies:
        pairs of keys in 32-bit stores), converted, into stage `ds` of its shared-memory tile;
        returns the converted registers."""
        r = cute.make_rmem_tensor(acc.layout, self.dtype)  # (MMA, MMA_M, MMA_N)
        r.store(acc.load().to(self.dtype))
        cute.autovec_copy(r, c_sdp.partition_C(s[None, None, ds]))
        return r

    @cute.jit
    def clear_rows(self, tiles, first_row, rows: cutlass.Constexpr, mma_tidx):
        """Packed batches: zero rows first_row .. rows - 1 of each (rows, d) or (rows, dv)
        shared-memory tile in `tiles` (rows of the next sequence, which may hold NaN: P = 0 or dS
        = 0 times a NaN is NaN), 16 bytes at a time by every consumer thread, then meet before any
        wgmma reads them."""
        vec = 16 // ELEMENT_BYTES
        zeros = cute.make_rmem_tensor((vec,), self.dtype)
        zeros.fill(0.0)
        for s in tiles:
            chunks = cute.size(s, mode=[1]) // vec
            for c in cutlass.range(mma_tidx, (rows - first_row) * chunks, 128 * self.wgs, unroll=1):
                chunk = cute.local_tile(s[first_row + c // chunks, None], (vec,), (c % chunks,))  # (vec,)
                cute.autovec_copy(zeros, chunk)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, before wgmma (async proxy) reads
        cute.arch.barrier(barrier_id=BwdBarrier.CLEAR, number_of_threads=128 * self.wgs)

    @cute.jit
    def release(self, pipe, read):
        """This thread is done with stage `read` of `pipe` (its LSE or D values and, through the
        wgmmas it waited for, its Q or dO tile): one arrive on the stage's empty barrier, whose
        count is every consumer thread."""
        pipe.sync_object_empty.arrive(read.index, None)

    @cute.jit
    def dropout_ds(self, dropout: Dropout, keep_bits, acc_s: cute.Tensor, acc_dp: cute.Tensor, tD: cute.Tensor):
        """With dropout (Z the forward's keep mask, 1 / P(keep) its scale): acc_s (P^T) becomes
        the dropped P~^T = P^T Z / P(keep) that dV reads, acc_dp (dP^T) becomes dS^T = P^T (dP^T
        Z / P(keep) - D) (D, rowsum(dO * O), is already the dropped output's); keep_bits from
        `Dropout.pair_keep_bits`, drawn once dP^T has landed (drawn while S^T and dP^T ran, they
        measured 1-3% slower in 5 of 6 cells: docs/tuning/dropout.md, Dropout); tD (MMA, MMA_M, MMA_N)
        each value's D."""
        scale = dropout.scale()
        for k in cutlass.range_constexpr(cute.size(acc_s.shape[0][2])):
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(2):
                    v = ((c, r, k), 0, 0)
                    z = cutlass.Float32(0.0)
                    if keep_bit(keep_bits, c, r, k):
                        z = scale
                    p = acc_s[v]
                    acc_s[v] = p * z
                    acc_dp[v] = p * (acc_dp[v] * z - tD[v])

    @cute.jit
    def dropout_ds_qk(self, dropout: Dropout, recipe: Sm90BwdRecipe, mma_tidx, m_block, n_block, acc_s: cute.Tensor,
                      acc_dp: cute.Tensor, tD: cute.Tensor):
        """`dropout_ds` on the 96-key tiles' S and dP (queries on M, the forward's orientation):
        each value's factor Z / P(keep) from the forward's `Dropout.apply` on a tile of 1 / P(keep)
        (the same Philox counters, (query, key) of the head, so the same mask)."""
        bm, bn = self.t.block_m, self.t.block_n
        z = cute.make_fragment_like(acc_s, cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        z.fill(dropout.scale())
        dropout.apply(recipe.mma_sdp, z, wgmma_groups(z.shape), mma_tidx, m_block * bm, n_block * bn, (bm, bn), True)
        for j in cutlass.range(cute.size(acc_s), unroll_full=True):
            p = acc_s[j]
            acc_s[j] = p * z[j]
            acc_dp[j] = p * (acc_dp[j] * z[j] - tD[j])

    @cute.jit
    def by_query(self, s: cute.Tensor, stage):
        """Stage `stage` of a (bm, stages) per-query vector as a tile of S^T's shape (bn, bm)
        whose every row is the vector (on the 96-key tiles S's (bm, bn), every column):
        partitioned like the scores, it gives each accumulator value its query's value."""
        bm = self.t.block_m
        layout = cute.make_layout((self.t.block_n, bm), stride=(0, 1))
        if cutlass.const_expr(self.keys_on_n):
            layout = cute.make_layout((bm, self.t.block_n), stride=(1, 0))
        return cute.make_tensor(s.iterator + cute.assume(stage * bm, divby=bm), layout)

    def keys_by_queries(self, acc: cute.Tensor) -> cute.Tensor:
        """A (MMA, MMA_M, MMA_N) tile partitioned like the scores as a (keys, queries) view: its
        `acc_mn_view`, transposed on the 96-key tiles (queries on M)."""
        mn = lmma.acc_mn_view(acc)
        return transposed(mn) if self.keys_on_n else mn

    @cute.jit
    def modify(self, acc_s: cute.Tensor, mask: Mask, slope, m_block, n_block, mma_tidx, recipe: Sm90BwdRecipe,
               masked: cutlass.Constexpr, user=None, user_mask: cutlass.Constexpr = True):
        """ALiBi, a caller's mods (`ModCall`) and the masks on the S^T tile: its (keys, queries)
        views transposed, so that the forward's (query, key) code applies unchanged. user_mask
        False: a block-sparse full block, whose mask_mod keeps every score."""
        bm, bn = self.t.block_m, self.t.block_n
        if cutlass.const_expr(user is not None and not user_mask and self.config.mods.score_mod is None):
            user = None  # nothing of the mods to run here
        if cutlass.const_expr(masked or self.config.has_alibi or user is not None):
            acc_qk = transposed(self.keys_by_queries(acc_s))  # (queries, keys)
            tScS = self.query_key_coords(recipe, mma_tidx)
            row0, col0 = m_block * bm, n_block * bn
            if cutlass.const_expr(self.config.has_alibi):
                apply_alibi(acc_qk, tScS, row0, col0, mask.seqlen_k - mask.seqlen_q, slope)
            if cutlass.const_expr(user is not None):
                user.apply(acc_qk, tScS, row0, col0, user_mask)
            if cutlass.const_expr(masked):
                mask.apply(acc_qk, tScS, row0, col0)

    def query_key_coords(self, recipe: Sm90BwdRecipe, mma_tidx) -> cute.Tensor:
        """The (query, key) coordinates in the tile of this thread's S^T (or S) values, as a
        (queries, keys) view."""
        cS = cute.make_identity_tensor((self.t.block_m, self.t.block_n))  # (query, key) coordinates
        if self.keys_on_n:
            return lmma.acc_mn_view(recipe.mma_sdp.get_slice(mma_tidx).partition_C(cS))
        cSt = cute.make_tensor(cS.iterator, cute.select(cS.layout, mode=[1, 0]))  # (bn, bm) -> (query, key)
        return transposed(lmma.acc_mn_view(recipe.mma_sdp.get_slice(mma_tidx).partition_C(cSt)))


def transposed(t: cute.Tensor) -> cute.Tensor:
    """A rank-2 register or coordinate view with its modes swapped."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))


def entry(config: Sm90BwdConfig):
    """The jit function `config` compiles: `__call__` (dense) or `call_varlen`."""
    kernel = FlashBwdSm90(config)
    return kernel.call_varlen if config.varlen else kernel


def fake_args(config: Sm90BwdConfig) -> list:
    """Placeholders for `FlashBwdSm90.__call__` / `call_varlen`: LSE and D rows padded to whole
    query blocks (strides multiples of 4 floats: 16 bytes, what their bulk copies need)."""
    dtype = element_type(config.traits)
    rank = 3 if config.varlen else 4
    elems = [fake_tensor(dtype, rank, ALIGN, COPY_BYTES) for _ in range(4)]
    stats = [fake_tensor(cutlass.Float32, rank - 1, 4, COPY_BYTES) for _ in range(2)]
    grads = [fake_tensor(dtype, rank, ALIGN, COPY_BYTES) for _ in range(2)]
    alibi = fake_tensor(cutlass.Float32, 2) if config.has_alibi else None
    rng = fake_tensor(cutlass.Uint32, 1) if config.has_dropout else None
    semaphore = fake_tensor(cutlass.Int32, rank - 1) if config.deterministic else None
    aux = config.mods.fake_aux() if config.mods is not None else None
    packed = []
    if config.varlen:
        seqused = fake_tensor(cutlass.Int32, 1) if config.has_seqused_k else None
        packed = [fake_tensor(cutlass.Int32, 1), fake_tensor(cutlass.Int32, 1), seqused, fake_tiles()]
    sparse = [] if config.varlen else [fake_block_sparse() if config.block_sparse else None]
    return (elems + stats + [fake_dq_accum(config.traits, config.varlen)] + grads + [alibi, rng, semaphore, aux]
            + sparse + packed
            + [1.0, 1.0, 1.0, 1.0, -1, -1, fake_stream()])
