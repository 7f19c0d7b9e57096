"""Append-KV with rotary embedding: write the new keys and values of `flash_attn_with_kvcache`
into the cache at cache_seqlens[b] (contiguous rows or pages), rotating k on the way, and rotate
q into a fresh buffer.

One CTA per (token, batch, head); threads walk the head dim. Rotary works in fp32 and rounds
once, like the reference: interleaved rotates pairs (x[2j], x[2j + 1]), the GPT-NeoX form pairs
(x[j], x[j + rotary_dim / 2]), both by the angle of row `pos`, column j of cos/sin; features past
rotary_dim are copied. Keys are rotated at their cache positions cache_seqlens[b] + i; q rows
at cache_seqlens[b] + i when the mask is causal or local, else all at cache_seqlens[b]
(flash-attn's rule).

Metadata never sends a write outside the caches: a row whose position lies outside the cache
(or outside what the block table addresses), whose block id is outside [0, num_blocks) or whose
cache_batch_idx is outside the cache's batch is skipped, and rotary angles are read at the
position clamped into the cos/sin table.

flash-attn 2.8.3 does this inside its split-KV kernel; here it is a separate launch just before
it on the same stream: one more kernel and one more TVM-FFI call per decode step (not yet timed
on its own; the decode bench appends nothing).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.common.seq_info import clamp
from layouts.traits import element_type

NUM_THREADS = 128


@dataclass(frozen=True)
class AppendConfig:
    """The append kernel's compile-time choices; with the arch, its compile key."""
    dtype: str             # "fp16" | "bf16"
    paged: bool            # caches are pages behind a block table
    has_batch_idx: bool    # cache_batch_idx picks each sequence's cache row
    rotary: bool           # rotate k (and q) by cos/sin
    interleaved: bool      # rotary pairs (x[2j], x[2j + 1]) instead of (x[j], x[j + rotary_dim / 2])
    q_per_row: bool        # q row i rotated at cache_seqlens + i (causal or local), else all at cache_seqlens

    @property
    def name(self) -> str:
        flags = "".join(letter if on else "." for letter, on in zip(
            "PBRIQ", (self.paged, self.has_batch_idx, self.rotary, self.interleaved, self.q_per_row)))
        return f"append_{self.dtype}-{flags}"


class AppendKV:
    def __init__(self, config: AppendConfig):
        self.config = config
        self.dtype = element_type(config.dtype)
        self.paged = config.paged
        self.has_batch_idx = config.has_batch_idx
        self.rotary = config.rotary
        self.interleaved = config.interleaved
        self.q_per_row = config.q_per_row

    @cute.jit
    def __call__(self, mKnew: cute.Tensor, mVnew: cute.Tensor, mKcache: cute.Tensor, mVcache: cute.Tensor,
                 mCacheSeqlens: cute.Tensor, mBatchIdx, mBlockTable, mCos, mSin, mQ: cute.Tensor, mQrot,
                 stream):
        """mKnew/mVnew (batch, seqlen_new, heads_k, d); caches (batch_cache, seqlen_cache, heads_k,
        d) or paged (num_blocks, page_size, heads_k, d) with mBlockTable (batch, max_blocks);
        mCos/mSin (seqlen_ro, rotary_dim / 2); mQ -> mQrot (batch, seqlen_q, heads, d), rotated
        only when rotary is on (mQ's shape sizes the grid either way). Tensors the config does
        not read are None: mBatchIdx, mBlockTable, and mCos / mSin / mQrot without rotary."""
        rows = mKnew.shape[1]
        if cutlass.const_expr(self.rotary):
            rows = rows + mQ.shape[1]
        self.kernel(mKnew, mVnew, mKcache, mVcache, mCacheSeqlens, mBatchIdx, mBlockTable,
                    mCos, mSin, mQ, mQrot).launch(
            grid=[rows, mKnew.shape[0], mQ.shape[2]], block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mKnew: cute.Tensor, mVnew: cute.Tensor, mKcache: cute.Tensor, mVcache: cute.Tensor,
               mCacheSeqlens: cute.Tensor, mBatchIdx, mBlockTable, mCos, mSin, mQ: cute.Tensor, mQrot):
        x, bidb, bidh = cute.arch.block_idx()
        seqlen_new = mKnew.shape[1]
        start = mCacheSeqlens[bidb]
        if x < seqlen_new:
            if bidh < mKnew.shape[2]:
                row_b = bidb
                if cutlass.const_expr(self.has_batch_idx):
                    row_b = mBatchIdx[bidb]
                self.append_key(mKnew[bidb, x, bidh, None], mVnew[bidb, x, bidh, None], mKcache, mVcache,
                                mBlockTable, mCos, mSin, row_b, bidh, start + x)
        else:
            if cutlass.const_expr(self.rotary):
                i = x - seqlen_new
                pos = start
                if cutlass.const_expr(self.q_per_row):
                    pos = start + i
                self.rotate(mQ[bidb, i, bidh, None], mQrot[bidb, i, bidh, None], mCos, mSin, pos)

    @cute.jit
    def append_key(self, k_row, v_row, mKcache: cute.Tensor, mVcache: cute.Tensor, mBlockTable, mCos, mSin, row_b,
                   bidh, pos):
        """One new key row of head bidh into the cache at `pos` of cache row `row_b` (`to_slot`)."""
        self.to_slot(mKcache, mVcache, mBlockTable, row_b, pos, lambda k_slot, v_slot: self.write_row(
            k_row, v_row, k_slot[bidh, None], v_slot[bidh, None], mCos, mSin, pos))

    @cute.jit
    def to_slot(self, mKcache: cute.Tensor, mVcache: cute.Tensor, mBlockTable, row_b, pos, write):
        """write(k_slot, v_slot) with the caches' (heads_k, d) rows at `pos` of cache row `row_b`
        (paged: of block-table row `row_b`), skipped where the row, the position or its page lies
        outside the cache."""
        if cutlass.const_expr(self.paged):
            page_size = mKcache.shape[1]
            if pos >= 0 and pos < mBlockTable.shape[1] * page_size:
                page = mBlockTable[row_b, pos // page_size]
                if page >= 0 and page < mKcache.shape[0]:
                    write(mKcache[page, pos % page_size, None, None], mVcache[page, pos % page_size, None, None])
        else:
            if row_b >= 0 and row_b < mKcache.shape[0] and pos >= 0 and pos < mKcache.shape[1]:
                write(mKcache[row_b, pos, None, None], mVcache[row_b, pos, None, None])

    @cute.jit
    def write_row(self, k_row, v_row, k_dst, v_dst, mCos, mSin, pos):
        tidx, _, _ = cute.arch.thread_idx()
        for c in cutlass.range(tidx, v_row.shape[0], NUM_THREADS, unroll=1):
            v_dst[c] = v_row[c]
        self.rotate(k_row, k_dst, mCos, mSin, pos)

    @cute.jit
    def rotate(self, src, dst, mCos, mSin, pos):
        """dst = src rotated at position `pos` (or copied when rotary is off)."""
        tidx, _, _ = cute.arch.thread_idx()
        half, pos = self.angles(mCos, pos)
        for c in cutlass.range(tidx, src.shape[0], NUM_THREADS, unroll=1):
            self.rotate_element(src, dst, c, mCos, mSin, pos, half)

    def angles(self, mCos, pos):
        """(rotary_dim / 2, `pos` clamped into the cos / sin table) with rotary, else (None, pos)."""
        if cutlass.const_expr(not self.rotary):
            return None, pos
        return mCos.shape[1], clamp(pos, 0, mCos.shape[0] - 1)

    @cute.jit
    def rotate_element(self, src, dst, c, mCos, mSin, pos, half):
        """dst[c] = element c of the row src rotated at position `pos` (`angles`), or copied."""
        if cutlass.const_expr(not self.rotary):
            dst[c] = src[c]
        else:
            if c < 2 * half:
                val = src[c].to(cutlass.Float32)
                if cutlass.const_expr(self.interleaved):
                    cos = mCos[pos, c // 2].to(cutlass.Float32)
                    sin = mSin[pos, c // 2].to(cutlass.Float32)
                    if c % 2 == 0:
                        dst[c] = (val * cos - src[c + 1].to(cutlass.Float32) * sin).to(self.dtype)
                    else:
                        dst[c] = (val * cos + src[c - 1].to(cutlass.Float32) * sin).to(self.dtype)
                else:
                    if c < half:
                        cos = mCos[pos, c].to(cutlass.Float32)
                        sin = mSin[pos, c].to(cutlass.Float32)
                        dst[c] = (val * cos - src[c + half].to(cutlass.Float32) * sin).to(self.dtype)
                    else:
                        cos = mCos[pos, c - half].to(cutlass.Float32)
                        sin = mSin[pos, c - half].to(cutlass.Float32)
                        dst[c] = (val * cos + src[c - half].to(cutlass.Float32) * sin).to(self.dtype)
            else:
                dst[c] = src[c]


def entry(config: AppendConfig):
    """The jit function `config` compiles."""
    return AppendKV(config)


def fake_args(config: AppendConfig) -> list:
    """Placeholders in `AppendKV.__call__`'s parameter order; None where the config reads nothing."""
    el, i32 = element_type(config.dtype), cutlass.Int32
    rotary = fake_tensor(el, 2) if config.rotary else None
    return ([fake_tensor(el, 4) for _ in range(4)] + [fake_tensor(i32, 1)]
            + [fake_tensor(i32, 1) if config.has_batch_idx else None, fake_tensor(i32, 2) if config.paged else None]
            + [rotary, fake_tensor(el, 2) if config.rotary else None, fake_tensor(el, 4),
               fake_tensor(el, 4) if config.rotary else None, fake_stream()])
