"""Packed queries in `flash_attn_with_kvcache` (`cu_seqlens_q`, `cu_seqlens_k_new`;
`cute_flash.kvcache_varlen`), in one launch: sequence b's new keys and values into its cache rows
from cache_seqlens[b] (k rotated at those positions), its queries (rotated as the fixed-length
call rotates them) into the last rows of its max_seqlen_q rows of the padded query batch (the
rows before them zeroed; each row's heads in the attention kernel's query-fold order where the
call folds, so that no copy folds them), each packed query's row there (`flat`, for the
unpad), and the keys the padded call sees (cache_seqlens[b] + the new keys). Where a torch
version took about thirty small launches.

One CTA per (row, group of HEADS_PER_CTA heads) of three runs of rows: the new keys' (groups
past heads_k idle), the queries', then one per sequence for its filler rows' zeros and its
length (group 0). A row finds its sequence by a binary search of the prefix sums, once for its
group of heads (a CTA per (row, head) was 34k CTAs of one element a thread at 64 sequences,
about 500 new rows and queries and 32 heads; docs/tuning/decode.md, "Packed queries: the setup
in one launch"). A thread copies `vec` elements at a time: 16 bytes where every tensor's rows
allow them (decode.md, "Packed queries: 16-byte copies"); a rotated element reads its pair's,
so rotation goes an element at a time. The rotation and the bad-metadata rules are the append
kernel's (`AppendKV`: a key row whose position or page lies outside the cache is skipped).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.sm80.append import NUM_THREADS, AppendKV
from layouts.traits import element_type

HEADS_PER_CTA = 8  # a CTA's heads of one row (at d 128, 1024 elements: one 16-byte copy a thread)


@dataclass(frozen=True)
class PackedAppendConfig:
    """The packed append's compile-time choices; with the arch, its compile key."""
    dtype: str             # "fp16" | "bf16"
    paged: bool            # caches are pages behind a block table
    has_new: bool          # new keys and values to append (k, v, cu_seqlens_k_new)
    rotary: bool           # rotate k and q by cos/sin
    interleaved: bool      # rotary pairs (x[2j], x[2j + 1]) instead of (x[j], x[j + rotary_dim / 2])
    q_per_row: bool        # query i rotated at cache_seqlens + i (causal or local), else all at cache_seqlens
    vec: int               # elements a thread copies at once: 8 (16 bytes) where every tensor's rows are
                           # 16-byte aligned (`launch.align.is_aligned`), else 1

    @property
    def name(self) -> str:
        flags = "".join(letter if on else "." for letter, on in zip(
            "PNRIQ", (self.paged, self.has_new, self.rotary, self.interleaved, self.q_per_row)))
        return f"append_packed_{self.dtype}-{flags}-v{self.vec}"


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
                 mKcache: cute.Tensor, mVcache: cute.Tensor, mBlockTable, mCos, mSin, fold: cutlass.Int32, stream):
        """mQ (total_q, heads, d) -> mQpad (batch * max_seqlen_q, heads, d), its filler rows zeroed,
        each row's heads in the order of the attention kernel's query fold by `fold` (head
        kh fold + j at j heads_k + kh: the rows (batch, max_seqlen_q x fold, heads_k, d) of
        `Sm90FwdConfig.query_group`; 1: as they come);
        mFlat (total_q,) int64 and mLengths (batch,) int32 written; mCuSeqlensQ (batch + 1,),
        mCacheSeqlens (batch,) int32; mKnew / mVnew (total_new, heads_k, d) and mCuSeqlensK
        (batch + 1,) int32, or None (`has_new` off); caches (batch, seqlen_cache, heads_k, d) or
        paged (num_blocks, page_size, heads_k, d) with mBlockTable (batch, max_blocks); mCos /
        mSin (seqlen_ro, rotary_dim / 2) or None."""
        rows = mQ.shape[0] + mCacheSeqlens.shape[0]
        if cutlass.const_expr(self.config.has_new):
            rows = rows + mKnew.shape[0]
        groups = (mQ.shape[1] + HEADS_PER_CTA - 1) // HEADS_PER_CTA
        self.kernel(mQ, mQpad, mFlat, mLengths, mCuSeqlensQ, mCacheSeqlens, mKnew, mVnew, mCuSeqlensK, mKcache,
                    mVcache, mBlockTable, mCos, mSin, fold).launch(
            grid=[rows, groups, 1], block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mQpad: cute.Tensor, mFlat: cute.Tensor, mLengths: cute.Tensor,
               mCuSeqlensQ: cute.Tensor, mCacheSeqlens: cute.Tensor, mKnew, mVnew, mCuSeqlensK,
               mKcache: cute.Tensor, mVcache: cute.Tensor, mBlockTable, mCos, mSin, fold: cutlass.Int32):
        x, group, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        batch = mCacheSeqlens.shape[0]
        total_q = mQ.shape[0]
        r = x  # the row within the queries' run
        if cutlass.const_expr(self.config.has_new):
            total_new = mKnew.shape[0]
            if x < total_new:
                if group * HEADS_PER_CTA < mKnew.shape[1]:
                    b = sequence_of(mCuSeqlensK, x, batch)
                    self.append_heads(mKnew[x, None, None], mVnew[x, None, None], mKcache, mVcache, mBlockTable,
                                      mCos, mSin, b, group, mCacheSeqlens[b] + x - mCuSeqlensK[b])
            r = x - total_new
        if r >= 0 and r < total_q:
            b = sequence_of(mCuSeqlensQ, r, batch)
            i = r - mCuSeqlensQ[b]
            max_q = mQpad.shape[0] // batch
            row = b * max_q + max_q - (mCuSeqlensQ[b + 1] - mCuSeqlensQ[b]) + i
            pos = mCacheSeqlens[b]
            if cutlass.const_expr(self.q_per_row):
                pos = pos + i
            if cutlass.const_expr(self.rotary):
                self.rotate_heads(mQ[r, None, None], mQpad[row, None, None], group, mCos, mSin, pos, fold)
            else:
                self.copy_heads(mQ[r, None, None], mQpad[row, None, None], group, fold)
            if group == 0 and tidx == 0:
                mFlat[r] = cutlass.Int64(row)
        elif r >= total_q:
            b = r - total_q
            self.zero_filler(mQpad, b, mCuSeqlensQ[b + 1] - mCuSeqlensQ[b], batch, group)
            if group == 0 and tidx == 0:
                new = cutlass.Int32(0)
                if cutlass.const_expr(self.config.has_new):
                    new = mCuSeqlensK[b + 1] - mCuSeqlensK[b]
                mLengths[b] = mCacheSeqlens[b] + new

    @cute.jit
    def zero_filler(self, mQpad: cute.Tensor, b, queries, batch, group):
        """Zeros into head group `group` of sequence b's filler rows: the first max_seqlen_q -
        `queries` of its rows of the padded batch (its queries take the last ones)."""
        tidx, _, _ = cute.arch.thread_idx()
        vec = self.config.vec
        max_q = mQpad.shape[0] // batch
        per_head = mQpad.shape[2] // vec
        per_row = HEADS_PER_CTA * per_head
        zeros = cute.make_rmem_tensor((vec,), self.dtype)
        zeros.fill(0.0)
        for c in cutlass.range(tidx, (max_q - queries) * per_row, NUM_THREADS, unroll=1):
            h = group * HEADS_PER_CTA + (c % per_row) // per_head
            if h < mQpad.shape[1]:
                cute.autovec_copy(zeros, cute.local_tile(mQpad[b * max_q + c // per_row, h, None], (vec,),
                                                         (c % per_head,)))

    @cute.jit
    def append_heads(self, k_rows, v_rows, mKcache: cute.Tensor, mVcache: cute.Tensor, mBlockTable, mCos, mSin,
                     row_b, group, pos):
        """Head group `group` of one new key row (heads_k, d) into the cache at `pos` of
        sequence row_b (`AppendKV.to_slot`: skipped outside the cache)."""
        self.to_slot(mKcache, mVcache, mBlockTable, row_b, pos, lambda k_slot, v_slot: self.write_heads(
            k_rows, v_rows, k_slot, v_slot, group, mCos, mSin, pos))

    @cute.jit
    def write_heads(self, k_rows, v_rows, k_dst, v_dst, group, mCos, mSin, pos):
        """v of head group `group` copied, k rotated (`rotate_heads`) or copied."""
        self.copy_heads(v_rows, v_dst, group)
        if cutlass.const_expr(self.rotary):
            self.rotate_heads(k_rows, k_dst, group, mCos, mSin, pos)
        else:
            self.copy_heads(k_rows, k_dst, group)

    @cute.jit
    def copy_heads(self, src, dst, group, fold=None):
        """dst = src (heads, d) for head group `group`, `vec` elements a thread at a time (each
        thread's one load, then its store), head h to `folded`'s head."""
        tidx, _, _ = cute.arch.thread_idx()
        vec = self.config.vec
        per_head = src.shape[1] // vec
        part = cute.make_rmem_tensor((vec,), self.dtype)
        for c in cutlass.range(tidx, HEADS_PER_CTA * per_head, NUM_THREADS, unroll=1):
            h = group * HEADS_PER_CTA + c // per_head
            if h < src.shape[0]:
                cute.autovec_copy(cute.local_tile(src[h, None], (vec,), (c % per_head,)), part)
                cute.autovec_copy(part, cute.local_tile(dst[folded(h, src.shape[0], fold), None], (vec,),
                                                        (c % per_head,)))

    @cute.jit
    def rotate_heads(self, src, dst, group, mCos, mSin, pos, fold=None):
        """dst = src (heads, d) rotated at `pos` for head group `group` (heads group *
        HEADS_PER_CTA on, at most HEADS_PER_CTA), the threads walking its heads x d elements
        (a rotated element reads its pair's), head h to `folded`'s head."""
        tidx, _, _ = cute.arch.thread_idx()
        half, pos = self.angles(mCos, pos)
        d = src.shape[1]
        for c in cutlass.range(tidx, HEADS_PER_CTA * d, NUM_THREADS, unroll=1):
            h = group * HEADS_PER_CTA + c // d
            if h < src.shape[0]:
                self.rotate_element(src[h, None], dst[folded(h, src.shape[0], fold), None], c % d, mCos, mSin,
                                    pos, half)


@cute.jit
def folded(h, heads, fold):
    """The destination head of head h of `heads`: (h % fold) heads / fold + h // fold under a
    query fold by `fold` (None: h)."""
    if cutlass.const_expr(fold is None):
        return h
    return (h % fold) * (heads // fold) + h // fold


def entry(config: PackedAppendConfig):
    """The jit function `config` compiles."""
    return PackedAppend(config)


def fake_args(config: PackedAppendConfig) -> list:
    """Placeholders in `PackedAppend.__call__`'s parameter order; None where the config reads
    nothing."""
    el, i32 = element_type(config.dtype), cutlass.Int32

    def rows(rank):  # q, the padded queries, the new keys and values, the caches
        return fake_tensor(el, rank, stride_divisibility=config.vec, assumed_align=config.vec * el.width // 8)

    new = [rows(3), rows(3), fake_tensor(i32, 1)] if config.has_new else [None, None, None]
    rotary = [fake_tensor(el, 2), fake_tensor(el, 2)] if config.rotary else [None, None]
    return ([rows(3), rows(3), fake_tensor(cutlass.Int64, 1), fake_tensor(i32, 1),
             fake_tensor(i32, 1), fake_tensor(i32, 1)] + new
            + [rows(4), rows(4), fake_tensor(i32, 2) if config.paged else None] + rotary
            + [1, fake_stream()])
