"""Split-KV combine (the seed's flash_fwd_splitkv_combine_kernel): merge the num_splits partial
results of each query row into O and LSE.

Split s saw keys K_s and wrote O_s = softmax over K_s times V and LSE_s = log sum_{K_s} exp(s)
(-inf when K_s was empty). The full row is LSE = log sum_s exp(LSE_s) and O = sum_s
exp(LSE_s - LSE) O_s: a weighted sum, no second pass over keys. A row no split saw keeps O = 0
and LSE = +inf, the unsplit kernel's convention.

It runs inside the split-KV kernel, not as a kernel of its own: the CTA that finishes last among
the splits of a tile (`FlashFwd.merge_splits`) merges that tile's rows while the others exit.
That saves a launch per decode step, which at small batches costs more host time than the whole
GPU work.

Tile: kHeadDim / 4 threads per row, each owning 4 columns (one 128-bit load per split), so a
128-thread CTA merges 128 / (kHeadDim / 4) rows per pass. Every thread of a row takes the max of
the row's partial LSEs (they are few, and L1 serves the repeats), then accumulates
exp(LSE_s - max) and exp(LSE_s - max) O_s in one pass. Both loops are unrolled so that the loads
of several splits are in flight at once: a rolled loop waits one L2 round trip per split.
"""
import math

import cutlass
import cutlass.cute as cute

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
VEC = 4  # fp32 columns per thread: one 128-bit load
UNROLL = 8  # splits whose loads are issued together


class SplitCombine:
    """Mixed into the split-KV kernel class, which provides `t` (traits: head_dim, num_threads)
    and `dtype`. A method rather than a module function: the DSL re-traces a module-level jit
    function with run-time loops badly when it is called inside a run-time `if` (seen in one
    pytest process: "requires a code object with 0 free vars, not 2"), while methods of the
    kernel object are safe there."""

    @cute.jit
    def combine_tile(self, mOaccum: cute.Tensor, mLSEaccum: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                     rows):
        """Merge `rows` rows. mOaccum (num_splits, rows, kHeadDim) and mLSEaccum (num_splits,
        rows) fp32 partials; mO (rows, d <= kHeadDim) and mLSE (rows,) fp32, any strides."""
        tidx, _, _ = cute.arch.thread_idx()
        tpr = self.t.head_dim // VEC  # threads per row
        num_splits = mLSEaccum.shape[0]
        chunk = tidx % tpr
        for i in cutlass.range(tidx // tpr, rows, self.t.num_threads // tpr, unroll=1):
            lse_max = -cutlass.Float32.inf
            for s in cutlass.range(num_splits, unroll=UNROLL):
                lse_max = cute.arch.fmax(lse_max, mLSEaccum[s, i])
            # All splits empty: every weight is exp2(-inf) = 0, the sum stays 0 and LSE is +inf.
            max_log2 = 0.0 if lse_max == -cutlass.Float32.inf else lse_max * LOG2E
            total = cutlass.Float32(0.0)
            acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            for s in cutlass.range(num_splits, unroll=UNROLL):
                weight = cute.math.exp2(mLSEaccum[s, i] * LOG2E - max_log2, fastmath=True)
                total = total + weight
                cute.autovec_copy(cute.local_tile(mOaccum[s, i, None], (VEC,), (chunk,)), part)
                for v in cutlass.range_constexpr(VEC):
                    acc[v] = acc[v] + weight * part[v]
            empty = total == 0.0 or total != total
            inv = 0.0 if empty else cute.arch.rcp_approx(total)
            if chunk * VEC < mO.shape[1]:
                out = cute.make_rmem_tensor((VEC,), self.dtype)
                out.store((acc.load() * inv).to(self.dtype))
                cute.autovec_copy(out, cute.local_tile(mO[i, None], (VEC,), (chunk,)))
            if chunk == 0:
                mLSE[i] = cutlass.Float32.inf if empty else (cute.math.log2(total, fastmath=True) + max_log2) * LN2
