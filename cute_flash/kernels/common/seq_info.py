"""The sequence one CTA works on: its lengths and where it starts in the tensors (flash-attn 2's
BlockInfo), with every value read from metadata clamped into what the tensors hold.

Dense batches index sequence b directly; packed varlen batches start at `cu_seqlens[b]` with
lengths from the prefix sums (and `seqused_k`); KV caches take seqlen_k from cache_seqlens and
may hide a left padding. Everything downstream (tiles, masks, the key-block range) only reads
`seqlen_q`, `seqlen_k` and the offsets, so varlen, caches and paged KV plug in here without
touching the kernel body.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute


def clamp(x, lo, hi):
    """x moved into [lo, hi] (lo <= hi): two compares, no branch."""
    return cutlass.min(cutlass.max(x, lo), hi)


@dataclass(frozen=True)
class SeqInfo:
    seqlen_q: object
    seqlen_k: object
    sum_s_q: object    # first query row in a packed batch (None: dense)
    sum_s_k: object    # first key row in a packed, unpaged batch (None otherwise)
    leftpad_k: object  # keys hidden at the start of a cache row (0 without cache_leftpad)

    @staticmethod
    def make(bidb, rows_q, rows_k, mCuSeqlensQ=None, mCuSeqlensK=None, mSeqUsedK=None, mLeftpadK=None,
             k_extra=0, paged: cutlass.Constexpr = False):
        """Lengths of sequence bidb. `rows_q`, `rows_k` are the rows the tensors hold: the
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
        sum_s_q = sum_s_k = None
        seqlen_q, seqlen_k, leftpad_k = rows_q, rows_k, 0
        room_k = rows_k  # key rows from this sequence's first key to the end of the tensor
        if cutlass.const_expr(mCuSeqlensQ is not None):
            sum_s_q = clamp(mCuSeqlensQ[bidb], 0, rows_q)
            seqlen_q = clamp(mCuSeqlensQ[bidb + 1], sum_s_q, rows_q) - sum_s_q
        if cutlass.const_expr(mCuSeqlensK is not None):
            if cutlass.const_expr(paged):  # a table row per sequence: only the length matters
                seqlen_k = clamp(mCuSeqlensK[bidb + 1] - mCuSeqlensK[bidb], 0, rows_k)
            else:
                sum_s_k = clamp(mCuSeqlensK[bidb], 0, rows_k)
                seqlen_k = clamp(mCuSeqlensK[bidb + 1], sum_s_k, rows_k) - sum_s_k
                room_k = rows_k - sum_s_k
        if cutlass.const_expr(mSeqUsedK is not None):
            seqlen_k = clamp(mSeqUsedK[bidb] + k_extra, 0, room_k)
        if cutlass.const_expr(mLeftpadK is not None):
            leftpad_k = clamp(mLeftpadK[bidb], 0, seqlen_k)
            seqlen_k = seqlen_k - leftpad_k
        return SeqInfo(seqlen_q, seqlen_k, sum_s_q, sum_s_k, leftpad_k)


def query_rows(mX, bidb, bidh, mCuSeqlensQ=None):
    """(SeqInfo, (seqlen_q, d) rows of head bidh of sequence bidb, the run-time head dim) of a
    query-side tensor: (batch, seqlen_q, heads, d), or packed (total_q, heads, d) delimited by
    mCuSeqlensQ. For the kernels that read query rows only (the backward's preprocess and dQ
    convert)."""
    if cutlass.const_expr(mCuSeqlensQ is not None):
        seq = SeqInfo.make(bidb, mX.shape[0], 0, mCuSeqlensQ)
        return seq, cute.domain_offset((seq.sum_s_q, 0), mX[None, bidh, None]), mX.shape[2]
    return SeqInfo.make(bidb, mX.shape[1], 0), mX[bidb, None, bidh, None], mX.shape[3]


def head_rows(mX, seq: SeqInfo, bidb, bidh):
    """The (seqlen_q, ...) rows of head bidh of sequence bidb (as `query_rows` found it) in another
    query-side tensor: (batch, seqlen_q, heads, d) / (batch, heads, seqlen_q) dense, (total_q, heads,
    d) / (heads, total_q) packed."""
    if cutlass.const_expr(seq.sum_s_q is None):
        return mX[bidb, None, bidh, None] if cutlass.const_expr(cute.rank(mX) == 4) else mX[bidb, bidh, None]
    if cutlass.const_expr(cute.rank(mX) == 3):
        return cute.domain_offset((seq.sum_s_q, 0), mX[None, bidh, None])
    return cute.domain_offset((seq.sum_s_q,), mX[bidh, None])
