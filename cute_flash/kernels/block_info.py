"""Per-sequence bookkeeping of one CTA (the seed's BlockInfo) and its key-block range.

Dense batches index sequence b directly; packed varlen batches start at `cu_seqlens[b]` with
lengths from the prefix sums (and `seqused_k`); KV caches take seqlen_k from cache_seqlens and
may hide a left padding. Everything downstream (tiles, masks, n-block range) only reads
`seqlen_q`, `seqlen_k` and the offsets, so varlen, caches and paged KV plug in here without
touching the kernel body.
"""
import cutlass
import cutlass.cute as cute


def clamp(x, lo, hi):
    """x moved into [lo, hi] (lo <= hi): two compares, no branch."""
    return cutlass.min(cutlass.max(x, lo), hi)


class BlockInfo:
    def __init__(self, bidb, seqlen_q, seqlen_k, mCuSeqlensQ=None, mCuSeqlensK=None, mSeqUsedK=None,
                 mLeftpadK=None, k_extra=0, paged: cutlass.Constexpr = False):
        """Lengths of sequence bidb. `seqlen_q`, `seqlen_k` are the rows the tensors hold: the
        lengths of a dense batch; the totals of a packed one; for keys in a cache, its capacity
        (cache rows, or max_blocks * page_size through a block table). Packed batches take the
        lengths from the prefix sums (a paged one only its key lengths); seqused_k (a KV cache's
        cache_seqlens, plus `k_extra` rows appended after it) overrides seqlen_k; a cache's leftpad
        hides its first keys (the key view starts there, `leftpad_k`).

        Every value read from metadata is clamped into what the tensors hold, so no prefix sum,
        length or left pad can send a CTA outside them: cu_seqlens entries into [0, total] (an
        end never before its start), a paged length into [0, capacity], seqused_k + k_extra into
        the rows from the sequence's start to the end of the tensor (flash-attn reads
        seqused_k keys wherever they lie), leftpad into [0, seqlen_k]. Bad metadata gives
        undefined output, never an out-of-bounds access."""
        self.sum_s_q = None
        self.sum_s_k = None
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.leftpad_k = 0
        room_k = seqlen_k  # key rows from this sequence's first key to the end of the tensor
        if cutlass.const_expr(mCuSeqlensQ is not None):
            self.sum_s_q = clamp(mCuSeqlensQ[bidb], 0, seqlen_q)
            self.seqlen_q = clamp(mCuSeqlensQ[bidb + 1], self.sum_s_q, seqlen_q) - self.sum_s_q
        if cutlass.const_expr(mCuSeqlensK is not None):
            if cutlass.const_expr(paged):  # a table row per sequence: only the length matters
                self.seqlen_k = clamp(mCuSeqlensK[bidb + 1] - mCuSeqlensK[bidb], 0, seqlen_k)
            else:
                self.sum_s_k = clamp(mCuSeqlensK[bidb], 0, seqlen_k)
                self.seqlen_k = clamp(mCuSeqlensK[bidb + 1], self.sum_s_k, seqlen_k) - self.sum_s_k
                room_k = seqlen_k - self.sum_s_k
        if cutlass.const_expr(mSeqUsedK is not None):
            self.seqlen_k = clamp(mSeqUsedK[bidb] + k_extra, 0, room_k)
        if cutlass.const_expr(mLeftpadK is not None):
            self.leftpad_k = clamp(mLeftpadK[bidb], 0, self.seqlen_k)
            self.seqlen_k = self.seqlen_k - self.leftpad_k

    def n_block_range(self, m_block, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
                      window_left, window_right, has_left: cutlass.Constexpr, has_right: cutlass.Constexpr):
        """[n_block_min, n_block_max): key blocks that hold any key visible from this m-block.

        Query i sees key j in [i + sk - sq - left, i + sk - sq + right]; causal is right = 0.
        """
        shift = self.seqlen_k - self.seqlen_q
        n_block_max = cute.ceil_div(self.seqlen_k, block_n)
        if cutlass.const_expr(has_right):
            last_col = (m_block + 1) * block_m + shift + window_right
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(cutlass.max(last_col, 0), block_n))
        n_block_min = 0
        if cutlass.const_expr(has_left):
            first_col = m_block * block_m + shift - window_left
            n_block_min = cutlass.max(first_col, 0) // block_n
        return n_block_min, n_block_max

    def unmasked_range(self, m_block, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
                       window_left, window_right, has_left: cutlass.Constexpr, has_right: cutlass.Constexpr):
        """[lo, hi): key blocks every row of this m-block sees whole, so no mask is applied there."""
        shift = self.seqlen_k - self.seqlen_q
        hi = self.seqlen_k // block_n
        if cutlass.const_expr(has_right):
            hi = cutlass.min(hi, cutlass.max(m_block * block_m + shift + window_right + 1, 0) // block_n)
        lo = 0
        if cutlass.const_expr(has_left):
            lo = cute.ceil_div(cutlass.max((m_block + 1) * block_m - 1 + shift - window_left, 0), block_n)
        return lo, hi
