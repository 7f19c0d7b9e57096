"""The Hopper forward (sm_90a), first version: TMA tile loads on mbarrier pipelines and wgmma,
the SM80 kernel's softmax and score modifiers; no warp specialization yet. Device code only.

One CTA computes O and LSE for block_m query rows of one (batch, head), one warpgroup per 64
rows. Warp 0 issues the TMA copies; everyone computes:

    warp 0: Q, then K[n] and V[n] of the first `stages` key blocks (last first)
    for n = last .. first:
        wait stage of n
        S = Q K^T            (wgmma, both operands in shared memory)
        mask / ALiBi / softcap, online softmax (`ScoreMods`, `OnlineSoftmax`: the SM80 code,
                              on the wgmma accumulator's row/column view)
        O += P V             (wgmma, P from the S accumulators' registers, V^T a view of sV)
        release the stage; warp 0 refills it with the block `stages` further on
    O /= rowsum; O, LSE stored from registers

TMA zero-fills what lies past a tensor's end (rows past seqlen, columns past a padded head
dim), so no load needs a predicate; the first block processed (the last one) and blocks a
window edge crosses run the mask. Dense batches only so far: the dispatcher keeps every other
entry (and everything until the GPU tests pass) on the SM80 kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync

from cute_flash.kernels.block_range import BlockRange, Window
from cute_flash.kernels.config import FLAG_LETTERS
from cute_flash.kernels.gemm import wgmma
from cute_flash.kernels.score_mods import Mask, ScoreMods
from cute_flash.kernels.seq_info import SeqInfo
from cute_flash.kernels.softmax import OnlineSoftmax
from layouts import hopper
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.hopper import HopperTileTraits
from layouts.traits import element_type


@dataclass(frozen=True)
class Sm90FwdConfig:
    """One compiled Hopper forward variant: traits, K/V pipeline depth and the score flags."""
    traits: HopperTileTraits
    stages: int = 2
    has_left: bool = False
    has_right: bool = False
    has_alibi: bool = False
    has_softcap: bool = False

    @property
    def smem_bytes(self) -> int:
        """The tiles, and the mbarriers (8 bytes each: Q's, a full and an empty one per stage)."""
        return self.traits.smem_bytes(self.stages) + 8 * (1 + 2 * self.stages)

    @property
    def name(self) -> str:
        flags = "".join(FLAG_LETTERS[f.name] if getattr(self, f.name) else "." for f in fields(self)
                        if f.name.startswith("has_"))
        return f"{self.traits.name}_s{self.stages}-{flags}"


@dataclass(frozen=True)
class Sm90Scalars:
    scale_log2: object
    score_premul: object
    alibi_div: object
    window_left: object
    window_right: object


@dataclass(frozen=True)
class Sm90Recipe:
    """Compile-time layouts and atoms (layouts/hopper.py)."""
    sQ_layout: cute.ComposedLayout   # (bm, d)
    sKV_layout: cute.ComposedLayout  # (bn, d, stages)
    tma_q: cute.CopyAtom
    tma_k: cute.CopyAtom
    tma_v: cute.CopyAtom
    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma


@dataclass(frozen=True)
class Sm90Tensors:
    tma_mQ: cute.Tensor  # (seqlen_q, d, heads, batch) TMA coordinates
    tma_mK: cute.Tensor  # (seqlen_k, d, heads_k, batch)
    tma_mV: cute.Tensor
    mO: cute.Tensor      # (batch, seqlen_q, heads, d)
    mLSE: cute.Tensor    # (batch, heads, seqlen_q) fp32
    mAlibi: object       # (batch, heads) fp32 slopes


@dataclass(frozen=True)
class KVLoads:
    """The TMA copies of K and V: atoms and partitions."""
    tma_k: cute.CopyAtom
    tKgK: cute.Tensor  # (TMA, n_blocks) TMA coordinates of each key block
    tKsK: cute.Tensor  # (TMA, stages)
    tma_v: cute.CopyAtom
    tVgV: cute.Tensor
    tVsV: cute.Tensor


@dataclass(frozen=True)
class Sm90Loop:
    """What every key-block step reads."""
    kv_pipe: object           # PipelineTmaAsync of the K / V stages
    tSrQ: cute.Tensor         # (MMA, MMA_M, MMA_K) smem descriptors
    tSrK: cute.Tensor         # (MMA, MMA_N, MMA_K, stages)
    tOrV: cute.Tensor         # (MMA, MMA_N, MMA_K, stages): V^T
    acc_o: cute.Tensor        # (MMA, MMA_M, MMA_N) fp32
    acc_o_mn: cute.Tensor     # its (row, col) view
    softmax: OnlineSoftmax
    mods: ScoreMods
    m_block: object
    unmasked_lo: object       # [lo, hi): key blocks no mask edge crosses (BlockRange.unmasked)
    unmasked_hi: object


def seq_first(t: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, d) as (seqlen, d, heads, batch): a TMA box is a (rows, d) tile
    and the trailing modes are coordinates."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


class FlashFwdSm90:
    def __init__(self, config: Sm90FwdConfig):
        self.config = config
        self.t = config.traits
        self.dtype = element_type(config.traits)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mAlibi, scale_log2: cutlass.Float32, score_premul: cutlass.Float32, alibi_div: cutlass.Float32,
                 window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """mQ / mO (batch, seqlen_q, heads, d), mK / mV (batch, seqlen_k, heads_k, d), mLSE
        (batch, heads, seqlen_q) fp32, mAlibi (batch, heads) fp32 or None."""
        t, stages = self.t, self.config.stages
        sQ_layout = hopper.smem_layout(t, t.block_m)
        sKV_layout = hopper.smem_layout_staged(t, t.block_n, stages)
        sKV_stage = cute.slice_(sKV_layout, (None, None, 0))
        tma_q, tma_mQ = hopper.tma_load_atom(t, seq_first(mQ), sQ_layout, t.block_m)
        tma_k, tma_mK = hopper.tma_load_atom(t, seq_first(mK), sKV_stage, t.block_n)
        tma_v, tma_mV = hopper.tma_load_atom(t, seq_first(mV), sKV_stage, t.block_n)

        kv = (self.dtype, cute.cosize(sKV_layout), 1024)
        SharedStorage = lsmem.smem_struct({"q_full": (cutlass.Int64, 1, None),
                                           "kv_barriers": (cutlass.Int64, 2 * stages, None),
                                           "sQ": (self.dtype, cute.cosize(sQ_layout), 1024), "sK": kv, "sV": kv})

        recipe = Sm90Recipe(sQ_layout, sKV_layout, tma_q, tma_k, tma_v, hopper.tiled_mma_qk(t),
                            hopper.tiled_mma_pv(t))
        args = Sm90Tensors(tma_mQ, tma_mK, tma_mV, mO, mLSE, mAlibi)
        scalars = Sm90Scalars(scale_log2, score_premul, alibi_div, window_left, window_right)
        self.kernel(args, scalars, recipe, SharedStorage).launch(
            grid=(cute.ceil_div(mQ.shape[1], t.block_m), mQ.shape[2], mQ.shape[0]), block=[t.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, args: Sm90Tensors, scalars: Sm90Scalars, recipe: Sm90Recipe, SharedStorage: cutlass.Constexpr):
        cfg, t = self.config, self.t
        bm, bn, d = t.block_m, t.block_n, t.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, bidh, bidb = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        heads, heads_k = args.tma_mQ.shape[2], args.tma_mK.shape[2]
        bidh_kv = bidh // (heads // heads_k)
        seq = SeqInfo.make(bidb, args.tma_mQ.shape[0], args.tma_mK.shape[0])
        window = Window(scalars.window_left, scalars.window_right, cfg.has_left, cfg.has_right)
        blocks = BlockRange.make(seq, m_block, bm, bn, window)
        count = blocks.n_block_max - blocks.n_block_min

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        q_full = storage.q_full.data_ptr()
        if warp == 0:
            for atom in (recipe.tma_q, recipe.tma_k, recipe.tma_v):
                cpasync.prefetch_descriptor(atom)
        if tidx == 0:
            cute.arch.mbarrier_init(q_full, 1)
        # K[n] and V[n] share a stage: one full barrier per stage with both tiles' bytes, one
        # empty barrier that every warp arrives on when done with the stage (this also
        # fences and synchronizes the barrier inits).
        kv_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_barriers.data_ptr(), num_stages=cfg.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, t.num_threads // 32),
            tx_count=2 * cute.size_in_bytes(self.dtype, cute.slice_(recipe.sKV_layout, (None, None, 0))))
        sQ = storage.sQ.get_tensor(recipe.sQ_layout.outer, swizzle=recipe.sQ_layout.inner)    # (bm, d)
        sK = storage.sK.get_tensor(recipe.sKV_layout.outer, swizzle=recipe.sKV_layout.inner)  # (bn, d, stages)
        sV = storage.sV.get_tensor(recipe.sKV_layout.outer, swizzle=recipe.sKV_layout.inner)  # (bn, d, stages)

        gQ = cute.local_tile(args.tma_mQ[None, None, bidh, bidb], (bm, d), (m_block, 0))  # (bm, d)
        gK = cute.local_tile(args.tma_mK[None, None, bidh_kv, bidb], (bn, d), (None, 0))  # (bn, d, n_blocks)
        gV = cute.local_tile(args.tma_mV[None, None, bidh_kv, bidb], (bn, d), (None, 0))  # (bn, d, n_blocks)
        one = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(recipe.tma_q, 0, one, cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))  # (TMA,), (TMA,)
        tKsK, tKgK = cpasync.tma_partition(recipe.tma_k, 0, one, cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))  # (TMA, stages), (TMA, n_blocks)
        tVsV, tVgV = cpasync.tma_partition(recipe.tma_v, 0, one, cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        kv_loads = KVLoads(recipe.tma_k, tKgK, tKsK, recipe.tma_v, tVgV, tVsV)

        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        if warp == 0:  # a TMA copy is issued by a whole warp: it elects one lane itself
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(q_full, cute.size_in_bytes(self.dtype, recipe.sQ_layout))
            cute.arch.sync_warp()
            cute.copy(recipe.tma_q, tQgQ, tQsQ, tma_bar_ptr=q_full)
            for i in cutlass.range(cutlass.min(count, cfg.stages), unroll=1):
                self.load_kv(kv_pipe, producer, blocks.n_block_max - 1 - i, kv_loads)
                producer.advance()

        wg = cute.make_layout(t.warpgroups, stride=128)  # A / B partitions are per warpgroup: its first thread
        wg_qk = recipe.mma_qk.get_slice(wg(tidx // 128))
        wg_pv = recipe.mma_pv.get_slice(wg(tidx // 128))
        tSrQ = recipe.mma_qk.make_fragment_A(wg_qk.partition_A(sQ))  # (MMA, MMA_M, MMA_K) descriptors
        tSrK = recipe.mma_qk.make_fragment_B(wg_qk.partition_B(sK))  # (MMA, MMA_N, MMA_K, stages)
        sVt = lsmem.transposed_view(sV)  # (d, bn, stages)
        tOrV = recipe.mma_pv.make_fragment_B(wg_pv.partition_B(sVt))  # (MMA, MMA_N, MMA_K, stages)
        acc_o = cute.make_rmem_tensor(wg_pv.partition_shape_C((bm, d)), cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        acc_o.fill(0.0)
        acc_o_mn = lmma.acc_mn_view(acc_o)
        tOcO_mn = lmma.acc_mn_view(recipe.mma_pv.get_slice(tidx).partition_C(cute.make_identity_tensor((bm, d))))

        softmax = OnlineSoftmax(cute.size(acc_o_mn.shape[0]), scalars.scale_log2)
        softmax.init_empty()
        slope = cutlass.Float32(0.0)
        if cutlass.const_expr(cfg.has_alibi):
            slope = args.mAlibi[bidb, bidh] * scalars.alibi_div
        mods = ScoreMods(Mask(seq.seqlen_q, seq.seqlen_k, window), scalars.score_premul, slope, cfg.has_softcap,
                         cfg.has_alibi, (bm, bn))
        lo, hi = BlockRange.unmasked(seq, m_block, bm, bn, window)

        loop = Sm90Loop(kv_pipe, tSrQ, tSrK, tOrV, acc_o, acc_o_mn, softmax, mods, m_block, lo, hi)
        cute.arch.mbarrier_wait(q_full, 0)
        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        for i in cutlass.range(count, unroll=1):
            n_block = blocks.n_block_max - 1 - i
            self.step(i, n_block, loop, consumer, recipe)
            consumer.advance()
            if warp == 0:
                if i + cfg.stages < count:
                    self.load_kv(kv_pipe, producer, n_block - cfg.stages, kv_loads)
                    producer.advance()

        lse = cute.make_rmem_tensor(softmax.row_max.layout, cutlass.Float32)
        softmax.finalize(acc_o_mn, lse, cutlass.Float32.inf)
        self.store(acc_o_mn, lse, tOcO_mn, args, seq, m_block, bidb, bidh)

    @cute.jit
    def step(self, i, n_block, loop: Sm90Loop, consumer, recipe: Sm90Recipe):
        """Key block n_block, the i-th processed: S, modifiers and softmax (the first block
        processed and blocks an edge crosses masked), O += P V; its stage released."""
        bm, bn = self.t.block_m, self.t.block_n
        loop.kv_pipe.consumer_wait(consumer)
        acc_s = cute.make_rmem_tensor(recipe.mma_qk.get_slice(0).partition_shape_C((bm, bn)),
                                      cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        wgmma(recipe.mma_qk, acc_s, loop.tSrQ, loop.tSrK[None, None, None, consumer.index])
        if i == 0:
            self.softmax_step(loop, acc_s, n_block, recipe, True, True)
        elif loop.unmasked_lo <= n_block and n_block < loop.unmasked_hi:
            self.softmax_step(loop, acc_s, n_block, recipe, False, False)
        else:
            self.softmax_step(loop, acc_s, n_block, recipe, False, True)
        tOrP = hopper.p_operand(acc_s, self.dtype)  # ((2, 2, 2), MMA_M, MMA_K)
        wgmma(recipe.mma_pv, loop.acc_o, tOrP, loop.tOrV[None, None, None, consumer.index], accumulate=True)
        loop.kv_pipe.consumer_release(consumer)

    @cute.jit
    def softmax_step(self, loop: Sm90Loop, acc_s, n_block, recipe: Sm90Recipe, is_first: cutlass.Constexpr,
                     masked: cutlass.Constexpr):
        acc_s_mn = loop.mods.apply(recipe.mma_qk, acc_s, loop.m_block, n_block, masked)
        loop.softmax.step(acc_s_mn, loop.acc_o_mn, is_first, masked)

    @cute.jit
    def load_kv(self, kv_pipe, producer, n_block, loads: KVLoads):
        """Warp 0: K[n_block] and V[n_block] into the producer's stage, once it is free."""
        kv_pipe.producer_acquire(producer)
        bar = kv_pipe.producer_get_barrier(producer)
        cute.copy(loads.tma_k, loads.tKgK[None, n_block], loads.tKsK[None, producer.index], tma_bar_ptr=bar)
        cute.copy(loads.tma_v, loads.tVgV[None, n_block], loads.tVsV[None, producer.index], tma_bar_ptr=bar)

    @cute.jit
    def store(self, acc_o_mn: cute.Tensor, lse: cute.Tensor, tOcO_mn: cute.Tensor, args: Sm90Tensors, seq: SeqInfo,
              m_block, bidb, bidh):
        """O from registers, rows past seqlen_q and columns past the tensor's head dim skipped;
        one thread of each quad writes its rows' LSE."""
        bm, d = self.t.block_m, self.t.head_dim
        rows_q = seq.seqlen_q - m_block * bm
        gO = cute.local_tile(args.mO[bidb, None, bidh, None], (bm, d), (m_block, 0))  # (bm, d)
        head_dim = args.mO.shape[3]
        for r in cutlass.range_constexpr(cute.size(acc_o_mn.shape[0])):
            row = tOcO_mn[r, 0][0]
            if row < rows_q:
                for c in cutlass.range(cute.size(acc_o_mn.shape[1]), unroll_full=True):
                    col = tOcO_mn[r, c][1]
                    if col < head_dim:
                        gO[row, col] = acc_o_mn[r, c].to(self.dtype)
                if tOcO_mn[0, 0][1] == 0:
                    args.mLSE[bidb, bidh, m_block * bm + row] = lse[r]
