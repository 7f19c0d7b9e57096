"""Where the main loop fetches key block n from: a contiguous (seqlen_k, d) view of one sequence
and kv head, or the pages of a paged cache through one block-table row.

Paged caches are (num_blocks, page_size, d) per kv head with page_size any multiple of 16, so a
64- or 128-row key block may span several pages (at most block_n / 16 + 1 < 32), or lie inside
one. Each thread finds the page slot of each row it copies (rows `row + 16 i` of the tiled copy;
one division per block, then a running offset) and issues its cp.async from that page: the
gather happens inside the copy, with no staging. Prefill kernels read each row's page from the
table just before its copy. KV-cache kernels, memory-bound with little work per block to hide a
table load behind, read block n's page ids a step ahead (`page_ids`: lane l of each warp holds
the block's l-th page) and take each row's from its lane with a warp shuffle. Rows at or past
seqlen_k are zero-filled like the contiguous tail.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.tile_copy import copy_row, copy_tile


@dataclass(frozen=True)
class KVTiles:
    """Frozen, so that the DSL treats it as read-only inside run-time `if`s and loops."""
    thr_copy: object
    mK_s: cute.Tensor  # (seqlen_k, d), or (num_blocks, page_size, d) when paged
    mV_s: cute.Tensor
    seqlen_k: object
    bn: int
    d: int
    even_k: bool
    mTable: object     # (max_blocks,) page indices of this sequence, or None
    tKgK: object       # (KCPY, KCPY_N, KCPY_K, n_blocks) when contiguous, else None
    tVgV: object

    @staticmethod
    def make(thr_copy, mK_s: cute.Tensor, mV_s: cute.Tensor, seqlen_k, block_n: int, head_dim: int,
             even_k: bool, mTable=None):
        tKgK = tVgV = None
        if cutlass.const_expr(mTable is None):
            tKgK = thr_copy.partition_S(cute.local_tile(mK_s, (block_n, head_dim), (None, 0)))
            tVgV = thr_copy.partition_S(cute.local_tile(mV_s, (block_n, head_dim), (None, 0)))
        return KVTiles(thr_copy, mK_s, mV_s, seqlen_k, block_n, head_dim, even_k, mTable, tKgK, tVgV)

    @property
    def paged(self) -> bool:
        return self.mTable is not None

    @cute.jit
    def page_ids(self, n_block):
        """Lane l: the table entry of block n's l-th page (0 past the table, and when not paged)."""
        ids = cutlass.Int32(0)
        if cutlass.const_expr(self.paged):
            slot = (n_block * self.bn) // self.mK_s.shape[1] + cute.arch.lane_idx()
            if slot >= 0 and slot < self.mTable.shape[0]:
                ids = self.mTable[slot]
        return ids

    @cute.jit
    def load(self, tiled_copy: cute.TiledCopy, is_v: cutlass.Constexpr, n_block, pages, dst: cute.Tensor,
             tKVcKV: cute.Tensor, tKVpKV: cute.Tensor, check_rows: cutlass.Constexpr):
        """cp.async key block n of K (or V) into `dst`; check_rows: the block may pass seqlen_k.
        Paged: `pages` is `page_ids(n_block)`, read ahead, or None to read each row's page from
        the table as it is copied."""
        rows_left = self.seqlen_k - n_block * self.bn
        if cutlass.const_expr(not self.paged):
            src = self.tVgV if cutlass.const_expr(is_v) else self.tKgK
            copy_tile(tiled_copy, src[None, None, None, n_block], dst, tKVcKV, tKVpKV, rows_left,
                      check_rows, self.even_k, True)
        else:
            mX = self.mV_s if cutlass.const_expr(is_v) else self.mK_s
            page_size = mX.shape[1]
            num_rows = cute.size(dst, mode=[1])
            row_step = self.bn // num_rows  # tile rows between a thread's consecutive rows
            # Page slot (the table index, or with `pages` the lane: relative to the block's
            # first page) and offset of this thread's first row; later rows step by row_step,
            # and a page holds at least 16 rows, so each step wraps at most ceil(row_step / 16)
            # times.
            pos = n_block * self.bn + tKVcKV[0, 0, 0][0]
            if cutlass.const_expr(pages is not None):
                pos = pos - (n_block * self.bn) // page_size * page_size  # slots from the block's first page
            slot = pos // page_size
            offset = pos - slot * page_size
            for m in cutlass.range_constexpr(num_rows):
                if cutlass.const_expr(m > 0):
                    offset = offset + row_step
                    for _ in cutlass.range_constexpr((row_step + 15) // 16):
                        wrap = cutlass.Int32(offset >= page_size)
                        offset = offset - wrap * page_size
                        slot = slot + wrap
                if cutlass.const_expr(pages is not None):
                    page = cute.arch.shuffle_sync(pages, slot)  # every lane, before the row predicate
                row = tKVcKV[0, m, 0][0]
                row_ok = True
                if cutlass.const_expr(check_rows):
                    row_ok = cute.elem_less(row, rows_left)
                if row_ok:
                    if cutlass.const_expr(pages is None):
                        self.copy_row(tiled_copy, mX, self.mTable[slot], offset - row, m, dst, tKVpKV)
                    else:
                        self.copy_row(tiled_copy, mX, page, offset - row, m, dst, tKVpKV)
                else:
                    dst[None, m, None].fill(0)

    @cute.jit
    def copy_row(self, tiled_copy, mX, page, shift, m, dst, tKVpKV):
        """cp.async this thread's row m from `page`, through a (block_n, d) window of the page
        shifted by `shift` rows so that the copy's own row offset lands on the right page row."""
        mX_page = cute.domain_offset((page, shift, 0), mX)
        src = self.thr_copy.partition_S(cute.local_tile(mX_page[0, None, None], (self.bn, self.d), (0, 0)))
        copy_row(tiled_copy, src, dst, m, tKVpKV, self.even_k, True)
