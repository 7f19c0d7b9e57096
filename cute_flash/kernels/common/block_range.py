"""The key blocks one CTA visits: those any of its query rows can see, cut to its split's share.

Query i sees key j in [i + sk - sq - left, i + sk - sq + right] (causal is right = 0). Blocks
that a diagonal or window edge crosses need the mask; `unmasked` gives the ones every row of
the m-block sees whole, where the main loop runs a mask-free step (`visit_key_block`).

Under a query fold (`Window.group` g > 1: the KV-cache entry's GQA fold of several query rows)
row r of a tile is query r // g: g heads' rows of one query are consecutive, and seqlen_q
counts rows (g x the queries).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.seq_info import SeqInfo


@dataclass(frozen=True)
class Window:
    """Window edges as the kernel takes them (run time), whether each exists, and the rows a
    query holds (compile time)."""
    left: object
    right: object
    has_left: bool
    has_right: bool
    group: int = 1  # rows per query: row r is query r // group (a query fold), seqlen_q / group queries

    def query(self, row):
        """The query of tile row `row`."""
        return row // self.group if self.group > 1 else row

    def query_end(self, row_end):
        """One past the query of row `row_end` - 1: the queries of rows [.., row_end)."""
        return (row_end - 1) // self.group + 1 if self.group > 1 else row_end

    def shift(self, seqlen_q, seqlen_k):
        """sk - sq in queries (seqlen_q counts rows): query i's diagonal lies at key i + shift."""
        return seqlen_k - (seqlen_q // self.group if self.group > 1 else seqlen_q)


@dataclass(frozen=True)
class BlockRange:
    n_block_min: object  # [n_block_min, n_block_max): this CTA's key blocks
    n_block_max: object

    @staticmethod
    def make(seq: SeqInfo, m_block, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr, window: Window,
             split_idx=0, num_splits=1, split: cutlass.Constexpr = False):
        """Blocks holding any key visible from this m-block; a split takes the split_idx-th of
        num_splits equal shares of them."""
        shift = window.shift(seq.seqlen_q, seq.seqlen_k)
        n_block_max = cute.ceil_div(seq.seqlen_k, block_n)
        if cutlass.const_expr(window.has_right):
            last_col = window.query_end((m_block + 1) * block_m) + shift + window.right
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(cutlass.max(last_col, 0), block_n))
        n_block_min = 0
        if cutlass.const_expr(window.has_left):
            first_col = window.query(m_block * block_m) + shift - window.left
            n_block_min = cutlass.max(first_col, 0) // block_n
        if cutlass.const_expr(split):
            per_split = cute.ceil_div(n_block_max - n_block_min, num_splits)
            n_block_min = n_block_min + split_idx * per_split
            n_block_max = cutlass.min(n_block_max, n_block_min + per_split)
        return BlockRange(n_block_min, n_block_max)

    @staticmethod
    def unmasked(seq: SeqInfo, m_block, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr, window: Window):
        """[lo, hi): key blocks every row of this m-block sees whole, so no mask is applied there."""
        shift = window.shift(seq.seqlen_q, seq.seqlen_k)
        hi = seq.seqlen_k // block_n
        if cutlass.const_expr(window.has_right):
            hi = cutlass.min(hi, cutlass.max(window.query(m_block * block_m) + shift + window.right + 1, 0) // block_n)
        lo = 0
        if cutlass.const_expr(window.has_left):
            lo = cute.ceil_div(cutlass.max(window.query((m_block + 1) * block_m - 1) + shift - window.left, 0),
                               block_n)
        return lo, hi


@dataclass(frozen=True)
class QueryBlocks:
    """The backward's view: [m_block_min, m_block_max) are the query blocks holding any row
    that sees a key of key block n_block."""
    m_block_min: object
    m_block_max: object

    @staticmethod
    def make(seq: SeqInfo, n_block, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr, window: Window):
        """Row i sees key j iff i + shift - left <= j <= i + shift + right (shift = sk - sq): the
        block's first key bounds the rows from below through the right edge, its last key from
        above through the left edge."""
        shift = seq.seqlen_k - seq.seqlen_q
        m_block_max = cute.ceil_div(seq.seqlen_q, block_m)
        if cutlass.const_expr(window.has_left):
            last_row = (n_block + 1) * block_n - 1 - shift + window.left
            m_block_max = cutlass.min(m_block_max, cute.ceil_div(cutlass.max(last_row + 1, 0), block_m))
        m_block_min = 0
        if cutlass.const_expr(window.has_right):
            m_block_min = cutlass.max(n_block * block_n - shift - window.right, 0) // block_m
        return QueryBlocks(m_block_min, m_block_max)


@cute.jit
def visit_key_block(sparse, i, n_block, unmasked_lo, unmasked_hi, run, edges: cutlass.Constexpr = True):
    """Visit i of a tile's key blocks, block n_block, as `run(masked=)` (compile time): with a
    block-sparse row (`SparseRow`, else None), its choice, which passes `user_mask=` too (edges:
    `SparseRow.visit`'s); otherwise the masks only where an edge crosses the block (n_block
    outside [unmasked_lo, unmasked_hi), `BlockRange.unmasked`)."""
    if cutlass.const_expr(sparse is not None):
        sparse.visit(i, n_block, unmasked_lo, unmasked_hi, run, edges)
    elif unmasked_lo <= n_block and n_block < unmasked_hi:
        run(masked=False)
    else:
        run(masked=True)
