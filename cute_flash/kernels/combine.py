"""Split-KV combine (the seed's flash_fwd_splitkv_combine_kernel): merge the num_splits partial
results of each query row into O and LSE.

Split s saw keys K_s and wrote O_s = softmax over K_s times V and LSE_s = log sum_{K_s} exp(s)
(-inf when K_s was empty). The full row is LSE = log sum_s exp(LSE_s) and O = sum_s
exp(LSE_s - LSE) O_s: a weighted sum, no second pass over keys. A row no split saw keeps O = 0
and LSE = +inf, the unsplit kernel's convention.

One thread per 4 columns of a row (tile: kHeadDim / 4 threads per row, 128 / that rows per CTA):
every thread of a row takes the max of the row's partial LSEs (they are few, and L1 serves the
repeats), then accumulates exp(LSE_s - max) and exp(LSE_s - max) O_s in one pass, reading its 4
columns of each split's O with one 128-bit load. Both loops are unrolled so that the loads of
several splits are in flight at once: a rolled loop waits one L2 round trip per split.
"""
import math

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.fake import compile_tvm_ffi, fake_stream, fake_tensor
from layouts.traits import HEAD_DIM_BUCKETS

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
VEC = 4  # fp32 columns per thread: one 128-bit load
UNROLL = 8  # splits whose loads are issued together
NUM_THREADS = 128


class FlashCombine:
    def __init__(self, head_dim: int, dtype):
        """head_dim: the kernel bucket (the partial O's last extent); dtype: O's DSL type."""
        if head_dim not in HEAD_DIM_BUCKETS:
            raise ValueError(f"head_dim {head_dim} is not a bucket {HEAD_DIM_BUCKETS}")
        self.d = head_dim
        self.dtype = dtype
        self.threads_per_row = head_dim // VEC
        self.rows_per_cta = NUM_THREADS // self.threads_per_row

    @cute.jit
    def __call__(self, mOaccum: cute.Tensor, mLSEaccum: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 stream):
        """mOaccum (num_splits, batch, heads, seqlen_q, kHeadDim) and mLSEaccum (num_splits, batch,
        heads, seqlen_q) fp32, contiguous; mO (batch, seqlen_q, heads, d <= kHeadDim, a multiple
        of 8) and mLSE (batch, heads, seqlen_q) fp32, any strides."""
        rows = mLSE.shape[0] * mLSE.shape[1] * mLSE.shape[2]
        self.kernel(mOaccum, mLSEaccum, mO, mLSE).launch(
            grid=[cute.ceil_div(rows, self.rows_per_cta), 1, 1], block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOaccum: cute.Tensor, mLSEaccum: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        batch, heads, seqlen_q = mLSE.shape
        num_splits = mLSEaccum.shape[0]
        row = bidx * self.rows_per_cta + tidx // self.threads_per_row
        chunk = tidx % self.threads_per_row
        if row < batch * heads * seqlen_q:
            i = row % seqlen_q
            bh = row // seqlen_q
            h = bh % heads
            b = bh // heads
            lse_max = -cutlass.Float32.inf
            for s in cutlass.range(num_splits, unroll=UNROLL):
                lse_max = cute.arch.fmax(lse_max, mLSEaccum[s, b, h, i])
            # All splits empty: every weight is exp2(-inf) = 0, the sum stays 0 and LSE is +inf.
            max_log2 = 0.0 if lse_max == -cutlass.Float32.inf else lse_max * LOG2E
            total = cutlass.Float32(0.0)
            acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            for s in cutlass.range(num_splits, unroll=UNROLL):
                weight = cute.math.exp2(mLSEaccum[s, b, h, i] * LOG2E - max_log2, fastmath=True)
                total = total + weight
                cute.autovec_copy(cute.local_tile(mOaccum[s, b, h, i, None], (VEC,), (chunk,)), part)
                for v in cutlass.range_constexpr(VEC):
                    acc[v] = acc[v] + weight * part[v]
            empty = total == 0.0 or total != total
            inv = 0.0 if empty else cute.arch.rcp_approx(total)
            if chunk * VEC < mO.shape[3]:
                out = cute.make_rmem_tensor((VEC,), self.dtype)
                out.store((acc.load() * inv).to(self.dtype))
                cute.autovec_copy(out, cute.local_tile(mO[b, i, h, None], (VEC,), (chunk,)))
            if chunk == 0:
                mLSE[b, h, i] = cutlass.Float32.inf if empty else (cute.math.log2(total, fastmath=True) + max_log2) * LN2


def fake_combine_args(head_dim: int, dtype):
    oacc = fake_tensor(cutlass.Float32, 5, VEC, 16, last_extent=head_dim)
    return [oacc, fake_tensor(cutlass.Float32, 4), fake_tensor(dtype, 4, 8, 16), fake_tensor(cutlass.Float32, 3),
            fake_stream()]


def compile_combine(head_dim: int, dtype, arch: int | None = None, extra_options: str = ""):
    return compile_tvm_ffi(FlashCombine(head_dim, dtype), fake_combine_args(head_dim, dtype), arch, extra_options)
