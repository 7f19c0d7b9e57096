"""Packed queries in `flash_attn_with_kvcache` (`cu_seqlens_q`, `cu_seqlens_k_new`;
`cute_flash.kvcache_varlen`), in one launch: sequence b's new keys and values into its cache rows
from cache_seqlens[b] (k rotated at those positions), its queries (rotated as the fixed-length
call rotates them) into the last rows of its max_seqlen_q rows of the padded query batch, each
packed query's row there (`flat`, for the unpad), and the keys the padded call sees
(cache_seqlens[b] + the new keys). Where a torch version took about thirty small launches.

One CTA per (row, head) of three runs of rows: the new keys' (heads past heads_k idle), the
queries', then one per sequence for its length (head 0). A row finds its sequence by a binary
search of the prefix sums. The rotation and the bad-metadata rules are the append kernel's
(`AppendKV`: a key row whose position or page lies outside the cache is skipped).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.sm80.append import NUM_THREADS, AppendKV
from layouts.traits import element_type


@dataclass(frozen=True)
class PackedAppendConfig:
    """The packed append's compile-time choices; with the arch, its compile key."""
    dtype: str             # "fp16" | "bf16"
    paged: bool            # caches are pages behind a block table
    has_new: bool          # new keys and values to append (k, v, cu_seqlens_k_new)
    rotary: bool           # rotate k and q by cos/sin
    interleaved: bool      # rotary pairs (x[2j], x[2j + 1]) instead of (x[j], x[j + rotary_dim / 2])
    q_per_row: bool        # query i rotated at cache_seqlens + i (causal or local), else all at cache_seqlens

    @property
    def name(self) -> str:
        flags = "".join(letter if on else "." for letter, on in zip(
            "PNRIQ", (self.paged, self.has_new, self.rotary, self.interleaved, self.q_per_row)))
        return f"append_packed_{self.dtype}-{flags}"


@cute.jit
def sequence_of(mCuSeqlens: cute.Tensor, row, batch):
    """The sequence b of packed row `row` (cu[b] <= row < cu[b + 1]; empty sequences skipped):
    the last b in [0, batch) with cu[b] <= row, by binary search."""
    lo = cutlass.Int32(0)
    hi = batch - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mCuSeqlens[mid] <= row:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PackedAppend(AppendKV):
    def __init__(self, config: PackedAppendConfig):
        self.config = config
        self.dtype = element_type(config.dtype)
        self.paged = config.paged
        self.has_batch_idx = False
        self.rotary = config.rotary
        self.interleaved = config.interleaved
        self.q_per_row = config.q_per_row

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mQpad: cute.Tensor, mFlat: cute.Tensor, mLengths: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCacheSeqlens: cute.Tensor, mKnew, mVnew, mCuSeqlensK,
                 mKcache: cute.Tensor, mVcache: cute.Tensor, mBlockTable, mCos, mSin, stream):
        """mQ (total_q, heads, d) -> mQpad (batch * max_seqlen_q, heads, d), zeroed by the caller;
        mFlat (total_q,) int64 and mLengths (batch,) int32 written; mCuSeqlensQ (batch + 1,),
        mCacheSeqlens (batch,) int32; mKnew / mVnew (total_new, heads_k, d) and mCuSeqlensK
        (batch + 1,) int32, or None (`has_new` off); caches (batch, seqlen_cache, heads_k, d) or
        paged (num_blocks, page_size, heads_k, d) with mBlockTable (batch, max_blocks); mCos /
        mSin (seqlen_ro, rotary_dim / 2) or None."""
        rows = mQ.shape[0] + mCacheSeqlens.shape[0]
        if cutlass.const_expr(self.config.has_new):
            rows = rows + mKnew.shape[0]
        self.kernel(mQ, mQpad, mFlat, mLengths, mCuSeqlensQ, mCacheSeqlens, mKnew, mVnew, mCuSeqlensK, mKcache,
                    mVcache, mBlockTable, mCos, mSin).launch(
            grid=[rows, mQ.shape[1], 1], block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mQpad: cute.Tensor, mFlat: cute.Tensor, mLengths: cute.Tensor,
               mCuSeqlensQ: cute.Tensor, mCacheSeqlens: cute.Tensor, mKnew, mVnew, mCuSeqlensK,
               mKcache: cute.Tensor, mVcache: cute.Tensor, mBlockTable, mCos, mSin):
        x, bidh, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        batch = mCacheSeqlens.shape[0]
        total_q = mQ.shape[0]
        r = x  # the row within the queries' run
        if cutlass.const_expr(self.config.has_new):
            total_new = mKnew.shape[0]
            if x < total_new:
                if bidh < mKnew.shape[1]:
                    b = sequence_of(mCuSeqlensK, x, batch)
                    self.append_key(mKnew[x, bidh, None], mVnew[x, bidh, None], mKcache, mVcache, mBlockTable,
                                    mCos, mSin, b, bidh, mCacheSeqlens[b] + x - mCuSeqlensK[b])
            r = x - total_new
        if r >= 0 and r < total_q:
            b = sequence_of(mCuSeqlensQ, r, batch)
            i = r - mCuSeqlensQ[b]
            max_q = mQpad.shape[0] // batch
            row = b * max_q + max_q - (mCuSeqlensQ[b + 1] - mCuSeqlensQ[b]) + i
            pos = mCacheSeqlens[b]
            if cutlass.const_expr(self.q_per_row):
                pos = pos + i
            self.rotate(mQ[r, bidh, None], mQpad[row, bidh, None], mCos, mSin, pos)
            if bidh == 0 and tidx == 0:
                mFlat[r] = cutlass.Int64(row)
        elif r >= total_q:
            b = r - total_q
            if bidh == 0 and tidx == 0:
                new = cutlass.Int32(0)
                if cutlass.const_expr(self.config.has_new):
                    new = mCuSeqlensK[b + 1] - mCuSeqlensK[b]
                mLengths[b] = mCacheSeqlens[b] + new


def entry(config: PackedAppendConfig):
    """The jit function `config` compiles."""
    return PackedAppend(config)


def fake_args(config: PackedAppendConfig) -> list:
    """Placeholders in `PackedAppend.__call__`'s parameter order; None where the config reads
    nothing."""
    el, i32 = element_type(config.dtype), cutlass.Int32
    new = [fake_tensor(el, 3), fake_tensor(el, 3), fake_tensor(i32, 1)] if config.has_new else [None, None, None]
    rotary = [fake_tensor(el, 2), fake_tensor(el, 2)] if config.rotary else [None, None]
    return ([fake_tensor(el, 3), fake_tensor(el, 3), fake_tensor(cutlass.Int64, 1), fake_tensor(i32, 1),
             fake_tensor(i32, 1), fake_tensor(i32, 1)] + new
            + [fake_tensor(el, 4), fake_tensor(el, 4), fake_tensor(i32, 2) if config.paged else None] + rotary
            + [fake_stream()])
