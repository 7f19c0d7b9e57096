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
"""
from __future__ import annotations

import functools
import math

import cutlass
import cutlass.cute as cute
import torch

from cute_flash.compile_cache import get_or_compile
from cute_flash.kernels.block_info import BlockInfo
from cute_flash.kernels.gemm import gemm_rs, gemm_ss
from cute_flash.kernels.mask import Mask, apply_alibi
from cute_flash.kernels.softmax import OnlineSoftmax
from cute_flash.kernels.tile_copy import column_predicate, copy_tile
from layouts import copy as lcopy
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.traits import FwdTraits, choose_fwd_traits, element_type

LOG2E = math.log2(math.e)


class FlashFwd:
    """Compile-time configuration: traits plus the mask/modifier flags (each combination is one
    compiled kernel). Everything else (lengths, strides, window sizes, scales) is a run-time
    argument."""

    def __init__(self, traits: FwdTraits, has_left: bool = False, has_right: bool = False,
                 has_alibi: bool = False, has_softcap: bool = False, even_k: bool = True,
                 varlen: bool = False, has_seqused_k: bool = False):
        self.t = traits
        self.varlen = varlen
        self.has_seqused_k = has_seqused_k
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
        self.launch(mQ, mK, mV, mO, mLSE, mAlibi, None, None, None,
                    (cute.ceil_div(mQ.shape[1], self.t.block_m), mQ.shape[0], mQ.shape[2]),
                    scale_log2, score_premul, alibi_div, window_left, window_right, stream)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                    mLSE: cute.Tensor, mAlibi: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                    mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor, max_seqlen_q: cutlass.Int32,
                    scale_log2: cutlass.Float32, score_premul: cutlass.Float32, alibi_div: cutlass.Float32,
                    window_left: cutlass.Int32, window_right: cutlass.Int32, stream):
        """Packed batches: mQ/mO (total_q, heads, d), mK/mV (total_k, heads_k, d), mLSE (heads,
        total_q), int32 prefix sums mCuSeqlens* (batch + 1,) and mSeqUsedK (batch,) (ignored
        unless has_seqused_k). The grid covers max_seqlen_q; CTAs past a sequence's end exit."""
        self.launch(mQ, mK, mV, mO, mLSE, mAlibi, mCuSeqlensQ, mCuSeqlensK,
                    mSeqUsedK if cutlass.const_expr(self.has_seqused_k) else None,
                    (cute.ceil_div(max_seqlen_q, self.t.block_m), mCuSeqlensQ.shape[0] - 1, mQ.shape[1]),
                    scale_log2, score_premul, alibi_div, window_left, window_right, stream)

    @cute.jit
    def launch(self, mQ, mK, mV, mO, mLSE, mAlibi, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, grid,
               scale_log2, score_premul, alibi_div, window_left, window_right, stream):
        t = self.t
        sQ_layout = lsmem.smem_layout_q(t)
        sKV_layout = lsmem.smem_layout_kv(t)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        self.kernel(
            mQ, mK, mV, mO, mLSE, mAlibi, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, sQ_layout, sKV_layout,
            lcopy.gmem_tiled_copy_qkv(t), lcopy.gmem_tiled_copy_o(t), lmma.tiled_mma(t),
            scale_log2, score_premul, alibi_div, window_left, window_right, SharedStorage,
        ).launch(grid=grid, block=[t.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mAlibi: cute.Tensor, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               gmem_tiled_copy_QKV: cute.TiledCopy, gmem_tiled_copy_O: cute.TiledCopy,
               tiled_mma: cute.TiledMma, scale_log2: cutlass.Float32, score_premul: cutlass.Float32,
               alibi_div: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32,
               SharedStorage: cutlass.Constexpr):
        m_block, bidb, bidh = cute.arch.block_idx()
        if cutlass.const_expr(self.varlen):
            binfo = BlockInfo(bidb, 0, 0, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
            bidh_kv = bidh // (mQ.shape[1] // mK.shape[1])
            # (seqlen, d) views of this sequence and head; LSE (seqlen,)
            mQ_s = cute.domain_offset((binfo.sum_s_q, 0), mQ[None, bidh, None])
            mO_s = cute.domain_offset((binfo.sum_s_q, 0), mO[None, bidh, None])
            mK_s = cute.domain_offset((binfo.sum_s_k, 0), mK[None, bidh_kv, None])
            mV_s = cute.domain_offset((binfo.sum_s_k, 0), mV[None, bidh_kv, None])
            mLSE_s = cute.domain_offset((binfo.sum_s_q,), mLSE[bidh, None])
            if m_block * self.t.block_m < binfo.seqlen_q:
                self.attend(mQ_s, mK_s, mV_s, mO_s, mLSE_s, mAlibi, binfo, m_block, bidb, bidh,
                            mQ.shape[2], sQ_layout, sKV_layout, gmem_tiled_copy_QKV, gmem_tiled_copy_O,
                            tiled_mma, scale_log2, score_premul, alibi_div, window_left, window_right,
                            SharedStorage)
        else:
            binfo = BlockInfo(bidb, mQ.shape[1], mK.shape[1])
            bidh_kv = bidh // (mQ.shape[2] // mK.shape[2])
            self.attend(mQ[bidb, None, bidh, None], mK[bidb, None, bidh_kv, None],
                        mV[bidb, None, bidh_kv, None], mO[bidb, None, bidh, None], mLSE[bidb, bidh, None],
                        mAlibi, binfo, m_block, bidb, bidh, mQ.shape[3], sQ_layout, sKV_layout,
                        gmem_tiled_copy_QKV, gmem_tiled_copy_O, tiled_mma, scale_log2, score_premul,
                        alibi_div, window_left, window_right, SharedStorage)

    @cute.jit
    def attend(self, mQ_s: cute.Tensor, mK_s: cute.Tensor, mV_s: cute.Tensor, mO_s: cute.Tensor,
               mLSE_s: cute.Tensor, mAlibi: cute.Tensor, binfo: BlockInfo, m_block, bidb, bidh, head_dim,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               gmem_tiled_copy_QKV: cute.TiledCopy, gmem_tiled_copy_O: cute.TiledCopy,
               tiled_mma: cute.TiledMma, scale_log2: cutlass.Float32, score_premul: cutlass.Float32,
               alibi_div: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32,
               SharedStorage: cutlass.Constexpr):
        """One CTA's work on (seqlen, d) views of its sequence and head: BlockInfo gives the
        lengths, so dense and packed batches share everything from here on."""
        t = self.t
        bm, bn, d = t.block_m, t.block_n, t.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        n_block_min, n_block_max = binfo.n_block_range(
            m_block, bm, bn, window_left, window_right, self.has_left, self.has_right)

        # (bm, d) tiles of this CTA's rows
        gQ = cute.local_tile(mQ_s, (bm, d), (m_block, 0))
        gO = cute.local_tile(mO_s, (bm, d), (m_block, 0))
        # (bn, d, n_blocks)
        gK = cute.local_tile(mK_s, (bn, d), (None, 0))
        gV = cute.local_tile(mV_s, (bn, d), (None, 0))
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
        tKgK = gmem_thr_copy_QKV.partition_S(gK)  # (KCPY, KCPY_N, KCPY_K, n_blocks)
        tKsK = gmem_thr_copy_QKV.partition_D(sK)
        tVgV = gmem_thr_copy_QKV.partition_S(gV)
        tVsV = gmem_thr_copy_QKV.partition_D(sV)
        tKVcKV = gmem_thr_copy_QKV.partition_S(cKV)
        tQpQ = column_predicate(tQcQ, head_dim)
        tKVpKV = column_predicate(tKVcKV, head_dim)

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
                tKgK, tKsK, tVgV, tVsV, tKVcKV, tKVpKV, tSrQ, tSrK, tOrVt, acc_o, acc_o_mn,
                ops, softmax, mask, score_premul, slope)

        # Epilogue (also the early exit: no visible key leaves O = 0 and LSE = +inf).
        lse = cute.make_rmem_tensor(softmax.row_max.layout, cutlass.Float32)
        softmax.finalize(acc_o_mn, lse)
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
                 tKgK, tKsK, tVgV, tVsV, tKVcKV, tKVpKV, tSrQ, tSrK, tOrVt, acc_o, acc_o_mn,
                 ops, softmax, mask, score_premul, slope):
        """Prologue loads, the first (masked) block, then right-masked, mask-free and
        left-masked blocks in decreasing n."""
        t = self.t
        bm, bn = t.block_m, t.block_n
        # Prologue: Q and the last K block, rows past the sequence ends zero-filled.
        n_last = n_block_max - 1
        copy_tile(gmem_tiled_copy_QKV, tQgQ, tQsQ, tQcQ, tQpQ, rows_q, True, self.even_k, True)
        copy_tile(gmem_tiled_copy_QKV, tKgK[None, None, None, n_last], tKsK, tKVcKV, tKVpKV,
                  binfo.seqlen_k - n_last * bn, True, self.even_k, True)
        cute.arch.cp_async_commit_group()

        step_args = (tiled_mma, gmem_tiled_copy_QKV, tKgK, tKsK, tVgV, tVsV, tKVcKV, tKVpKV,
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
    def step(self, n_block, tiled_mma, gmem_tiled_copy_QKV, tKgK, tKsK, tVgV, tVsV, tKVcKV, tKVpKV,
             tSrQ, tSrK, tOrVt, acc_o, acc_o_mn, ops, softmax, mask, binfo, m_block,
             n_block_min, score_premul, slope, is_first: cutlass.Constexpr, masked: cutlass.Constexpr):
        """One key block: S = Q K^T, modifiers, online softmax, O += P V, with the next K in flight."""
        t = self.t
        copy_Q, tSsQ, tSrQ_view, copy_K, tSsK, tSrK_view, copy_V, tOsVt, tOrVt_view = ops
        acc_s = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_C((t.block_m, t.block_n)),
                                      cutlass.Float32)
        acc_s.fill(0.0)

        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        # V[n]: only the first block processed can run past seqlen_k.
        copy_tile(gmem_tiled_copy_QKV, tVgV[None, None, None, n_block], tVsV, tKVcKV, tKVpKV,
                  binfo.seqlen_k - n_block * t.block_n, is_first, self.even_k, True)
        cute.arch.cp_async_commit_group()

        gemm_ss(tiled_mma, acc_s, copy_Q, tSsQ, tSrQ_view, tSrQ, copy_K, tSsK, tSrK_view, tSrK)

        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if n_block > n_block_min:
            copy_tile(gmem_tiled_copy_QKV, tKgK[None, None, None, n_block - 1], tKsK, tKVcKV, tKVpKV,
                      0, False, self.even_k, True)
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
        gemm_rs(tiled_mma, acc_o, tOrP, copy_V, tOsVt, tOrVt_view, tOrVt)


# ---------------------------------------------------------------------------------------------
# Host side: compile (cached) and launch on torch tensors.

_ALIGN = 8  # elements per 16-byte copy
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _arch_option(arch: int | None) -> str:
    return "" if arch is None else f"--gpu-arch=sm_{arch}{'a' if arch >= 90 else ''}"


def fake_fwd_args(dtype, varlen: bool = False):
    """Placeholders for compiling FlashFwd (or its varlen entry): every extent dynamic, every
    stride but the last a multiple of 8 (the launcher guarantees it), plus a stream taken from
    the caller (torch's current stream) at call time."""
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    rank = 3 if varlen else 4

    def seq_tensor():
        shape = tuple(cute.sym_int() for _ in range(rank))
        stride = tuple(cute.sym_int64(divisibility=_ALIGN) for _ in range(rank - 1)) + (1,)
        return make_fake_tensor(dtype, shape, stride, assumed_align=16)

    def f32(rank_):
        return make_fake_tensor(cutlass.Float32, tuple(cute.sym_int() for _ in range(rank_)),
                                tuple(cute.sym_int64() for _ in range(rank_ - 1)) + (1,), assumed_align=4)

    def i32_vector():
        return make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)

    args = [seq_tensor() for _ in range(4)] + [f32(2 if varlen else 3), f32(2)]
    if varlen:
        args += [i32_vector(), i32_vector(), i32_vector(), 1]
    return args + [1.0, 1.0, 1.0, -1, -1, make_fake_stream(use_tvm_ffi_env_stream=True)]


def compile_fwd(kernel: FlashFwd, arch: int | None = None, extra_options: str = ""):
    """Build the cubin for `kernel`, callable through TVM-FFI with torch tensors. arch=None
    targets the current GPU; an explicit arch (80, 90) needs no GPU (nothing is launched)."""
    options = f"--enable-tvm-ffi {_arch_option(arch)} {extra_options}".strip()
    entry = kernel.call_varlen if kernel.varlen else kernel
    return cute.compile(entry, *fake_fwd_args(kernel.dtype, kernel.varlen), options=options)


def fwd_kernel_key(traits: FwdTraits, *flags):
    """flags: FlashFwd's constructor flags, in order after traits."""
    return ("fwd", traits) + tuple(bool(f) for f in flags)


def _aligned(x):
    """x itself when its rows suit 128-bit copies (unit last stride, every other stride and the
    base address 16-byte aligned, head dim a multiple of 8), else a copy that does: zero-padded
    to a multiple of 8 in the head dim, as flash-attn pads. A size-1 dim whose stride is not a
    multiple of 8 gets stride 0 (never stepped, and trivially aligned)."""

    shape, stride = x.shape, x.stride()
    low_bits = 0
    for s in stride[:-1]:
        low_bits |= s
    if shape[-1] % _ALIGN == 0 and stride[-1] == 1 and low_bits % _ALIGN == 0 and x.data_ptr() % 16 == 0:
        return x  # the common case, checked without generators (this runs on every call)
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
                varlen=False, has_seqused_k=False):
    """The compiled kernel for one call signature (memoised: a cached call hashes plain values
    once instead of rebuilding the traits and the compile-cache key)."""
    arch = _device_arch(device_index)
    if traits is None:
        traits = choose_fwd_traits(d_pad, _DTYPE_NAMES[dtype], min(arch, 90), causal)
    flags = (has_left, has_right, has_alibi, has_softcap, d_pad == traits.head_dim, varlen, has_seqused_k)
    return get_or_compile(fwd_kernel_key(traits, *flags) + (arch,),
                          lambda: compile_fwd(FlashFwd(traits, *flags)))


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
    if block_table is not None:
        raise NotImplementedError("paged KV (block_table) is not implemented yet")
    total_q, h, d = q.shape
    q, k, v, out, left, right, index = _prepare(q, k, v, causal, window_size)
    lse = torch.empty((h, total_q), dtype=torch.float32, device=q.device)
    compiled = _kernel_for(q.shape[-1], q.dtype, index, causal, left >= 0, right >= 0, alibi_slopes is not None,
                           softcap > 0, None, True, seqused_k is not None)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused = cu_seqlens_k if seqused_k is None else seqused_k.contiguous()  # read only if given
    compiled(q, k, v, out, lse, _alibi_2d(alibi_slopes, cu_seqlens_q.shape[0] - 1, h, index),
             cu_seqlens_q, cu_seqlens_k, seqused, max_seqlen_q, *_scales(softmax_scale, softcap), left, right)
    return (out if out.shape[-1] == d else out[..., :d]), lse


def flash_fwd_kvcache(q, k_cache, v_cache, **kwargs):
    """The split-KV decode path (Flash-Decoding, append-KV, rotary) has no kernel yet."""
    raise NotImplementedError("flash_attn_with_kvcache is not implemented yet (split-KV decode kernel)")


FLAG_NAMES = ("has_left", "has_right", "has_alibi", "has_softcap", "even_k")  # dense score flags
ALL_FLAG_NAMES = FLAG_NAMES + ("varlen", "has_seqused_k")


def fwd_variants(arch: int, full: bool = False):
    """(traits, flags) pairs the dispatcher can choose on `arch`.

    full: every shipped traits times every flag combination. Otherwise a covering subset for
    CI (a compile takes 4-14 s on its 2 cores): every shipped traits with causal flags, and on
    sm_90 every flag combination on one traits too (the flags change the same code on both archs).
    """
    import itertools

    from layouts.traits import choose_fwd_traits, shipped_fwd_traits

    combos = [dict(zip(FLAG_NAMES, bits)) for bits in itertools.product((False, True), repeat=len(FLAG_NAMES))]
    if full:
        varlen = [dict(f, varlen=True, has_seqused_k=u) for f in combos for u in (False, True)]
        return [(t, f) for t in shipped_fwd_traits(arch) for f in combos + varlen]
    causal = dict(has_left=False, has_right=True, has_alibi=False, has_softcap=False, even_k=True)
    pivot = choose_fwd_traits(128, "bf16", arch)
    subset = [(t, causal) for t in shipped_fwd_traits(arch)]
    if arch >= 90:
        subset += [(pivot, f) for f in combos if f != causal]
    subset += [(pivot, dict(causal, varlen=True)), (pivot, dict(causal, varlen=True, has_seqused_k=True))]
    return subset

