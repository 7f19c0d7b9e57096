"""Where the main loop fetches key block n from: a contiguous (seqlen_k, d) view of one sequence
and kv head, or the pages of a paged cache through one block-table row.

Paged caches are (num_blocks, page_size, d) per kv head with page_size any size >= 1, so a
64- or 128-row key block may span several pages, or lie inside one. The gather happens inside
the cp.async copy, with no staging; rows at or past seqlen_k are zero-filled like the
contiguous tail. Page slots and offsets come from a multiply-shift divisor of page_size made
once per CTA (`cute.fast_divmod_create_divisor_v2`), not from integer divisions. Every block id
read from the table is clamped into [0, num_blocks) (`page_at`): a bad id reads some page of
this cache, never memory outside it. Pages of a multiple of 16 rows take one of two ways to
find each row's page, each where it measured faster (docs/tuning/sm80-forward.md, tuning log steps 4-6):

- Prefill kernels copy with `layouts.copy.gmem_tiled_copy_kv_paged`, which deals each thread's
  rows out in runs lying in one aligned group of 16 rows, hence in one page: a thread reads
  the table once per run, just before the run's copies, and issues them at constant row
  offsets from one base address.
- KV-cache kernels, memory-bound with little work per block to hide a table load behind, keep
  the plain row order (a warp's copy covers consecutive rows) and read block n's page ids a
  step ahead (`page_ids`: lane l of each warp holds the block's l-th page); each row takes its
  page from its lane with a warp shuffle.

Pages of any other size (`rows=True`: 1, 8, 1000 rows...) break both assumptions (a run may
cross a page; a block may span more than 32 pages), so each row of a thread finds its own page:
one table read per row (KV-cache kernels read block n-1's a step ahead, like `page_ids`).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.seq_info import clamp
from cute_flash.kernels.common.tile_copy import copy_or_fill_row, copy_tile


@dataclass(frozen=True)
class KVTiles:
    """Frozen, so that the DSL treats it as read-only inside run-time `if`s and loops."""
    tiled_copy: object
    thr_copy: object
    tKVcKV: cute.Tensor  # (KCPY, KCPY_N, KCPY_K) block coordinates (row, col) of this thread's copies
    tKVpKV: cute.Tensor  # (KCPY_K,) head-dim predicates
    mK_s: cute.Tensor    # (seqlen_k, d), or (num_blocks, page_size, d) when paged
    mV_s: cute.Tensor
    seqlen_k: object
    bn: int
    d: int
    even_k: bool
    run: object          # paged prefill: rows per run of the copy; None: the plain row order
    rows: bool           # paged, pages of any size: each row looks its page up
    mTable: object       # (max_blocks,) page indices of this sequence, or None
    page_div: object     # page_size as a fast divisor (multiply-shift), or None
    tKgK: object         # (KCPY, KCPY_N, KCPY_K, n_blocks) when contiguous, else None
    tVgV: object

    @staticmethod
    def make(tiled_copy, thr_copy, tKVcKV: cute.Tensor, tKVpKV: cute.Tensor, mK_s: cute.Tensor,
             mV_s: cute.Tensor, seqlen_k, block_n: int, head_dim: int, even_k: bool, run=None, rows=False,
             mTable=None):
        tKgK = tVgV = page_div = None
        if cutlass.const_expr(mTable is not None):
            page_div = cute.fast_divmod_create_divisor_v2(mK_s.shape[1])
        else:
            tKgK = thr_copy.partition_S(cute.local_tile(mK_s, (block_n, head_dim), (None, 0)))
            tVgV = thr_copy.partition_S(cute.local_tile(mV_s, (block_n, head_dim), (None, 0)))
        return KVTiles(tiled_copy, thr_copy, tKVcKV, tKVpKV, mK_s, mV_s, seqlen_k, block_n, head_dim, even_k,
                       run, rows, mTable, page_div, tKgK, tVgV)

    @property
    def paged(self) -> bool:
        return self.mTable is not None

    @cute.jit
    def page_at(self, slot):
        """Table entry `slot` (inside the table), clamped into [0, num_blocks)."""
        return clamp(self.mTable[slot], 0, self.mK_s.shape[0] - 1)

    @cute.jit
    def page_ids(self, n_block):
        """Lane l: the table entry of block n's l-th page (0 past the table, and when not paged);
        with `rows`, a (KCPY_N,) fragment: the page of each of this thread's rows of block n.
        Called with n = -1 after the last block: whatever it reads there, no copy uses."""
        if cutlass.const_expr(self.rows):
            ids = cute.make_rmem_tensor((cute.size(self.tKVcKV, mode=[1]),), cutlass.Int32)
            for m in cutlass.range_constexpr(cute.size(ids)):
                ids[m] = self.row_page(n_block, m)
        else:
            ids = cutlass.Int32(0)
            if cutlass.const_expr(self.paged):
                slot = (n_block * self.bn) // self.page_div + cute.arch.lane_idx()
                if slot >= 0 and slot < self.mTable.shape[0]:
                    ids = self.page_at(slot)
        return ids

    @cute.jit
    def row_page(self, n_block, m: cutlass.Constexpr):
        """The page holding this thread's row m of block n (0 when past the table)."""
        page = cutlass.Int32(0)
        slot = (n_block * self.bn + self.tKVcKV[0, m, 0][0]) // self.page_div
        if slot >= 0 and slot < self.mTable.shape[0]:
            page = self.page_at(slot)
        return page

    @cute.jit
    def load(self, is_v: cutlass.Constexpr, n_block, pages, dst: cute.Tensor, check_rows: cutlass.Constexpr):
        """cp.async key block n of K (or V) into `dst`; check_rows: the block may pass seqlen_k.
        Paged in the plain row order: `pages` is `page_ids(n_block)`, read ahead (with `rows`,
        None reads each row's page here)."""
        rows_left = self.seqlen_k - n_block * self.bn
        if cutlass.const_expr(not self.paged):
            src = self.tVgV if cutlass.const_expr(is_v) else self.tKgK
            copy_tile(self.tiled_copy, src[None, None, None, n_block], dst, self.tKVcKV, self.tKVpKV, rows_left,
                      check_rows, self.even_k, True)
        elif cutlass.const_expr(self.rows):
            mX = self.mV_s if cutlass.const_expr(is_v) else self.mK_s
            for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
                row = self.tKVcKV[0, m, 0][0]
                row_ok = True
                if cutlass.const_expr(check_rows):
                    row_ok = cute.elem_less(row, rows_left)
                copy_or_fill_row(self.tiled_copy, lambda: self.row_window(mX, n_block, m, row, pages), dst, m,
                                 self.tKVpKV, row_ok, self.even_k, True)
        elif cutlass.const_expr(self.run is not None):
            for g in cutlass.range_constexpr(cute.size(dst, mode=[1]) // self.run):
                if cutlass.const_expr(check_rows):
                    if cute.elem_less(self.tKVcKV[0, g * self.run, 0][0], rows_left):
                        self.load_run(is_v, n_block, g, dst, rows_left, True)
                    else:
                        for i in cutlass.range_constexpr(self.run):
                            dst[None, g * self.run + i, None].fill(0)
                else:
                    self.load_run(is_v, n_block, g, dst, rows_left, False)
        else:
            mX = self.mV_s if cutlass.const_expr(is_v) else self.mK_s
            page_size = mX.shape[1]
            num_rows = cute.size(dst, mode=[1])
            row_step = self.bn // num_rows  # tile rows between a thread's consecutive rows
            # Page slot relative to the block's first page (the lane holding its page id) and
            # offset of this thread's first row; later rows step by row_step, and a page holds
            # at least 16 rows, so each step wraps at most ceil(row_step / 16) times.
            pos = n_block * self.bn + self.tKVcKV[0, 0, 0][0]
            pos = pos - (n_block * self.bn) // self.page_div * page_size
            slot, offset = divmod(pos, self.page_div)
            for m in cutlass.range_constexpr(num_rows):
                if cutlass.const_expr(m > 0):
                    offset = offset + row_step
                    for _ in cutlass.range_constexpr((row_step + 15) // 16):
                        wrap = cutlass.Int32(offset >= page_size)
                        offset = offset - wrap * page_size
                        slot = slot + wrap
                page = cute.arch.shuffle_sync(pages, slot)  # every lane, before the row predicate
                row = self.tKVcKV[0, m, 0][0]
                row_ok = True
                if cutlass.const_expr(check_rows):
                    row_ok = cute.elem_less(row, rows_left)
                copy_or_fill_row(self.tiled_copy, lambda: self.page_window(mX, page, offset - row), dst, m,
                                 self.tKVpKV, row_ok, self.even_k, True)

    @cute.jit
    def load_run(self, is_v: cutlass.Constexpr, n_block, g: cutlass.Constexpr, dst: cute.Tensor, rows_left,
                 check_rows: cutlass.Constexpr):
        """Run g of this thread's rows (its first row inside the keys): one table read, then
        one cp.async per row."""
        mX = self.mV_s if cutlass.const_expr(is_v) else self.mK_s
        m0 = g * self.run
        row0 = self.tKVcKV[0, m0, 0][0]
        slot, offset = divmod(n_block * self.bn + row0, self.page_div)
        src = self.page_window(mX, self.page_at(slot), offset - row0)
        for i in cutlass.range_constexpr(self.run):
            m = m0 + i
            row_ok = True
            if cutlass.const_expr(check_rows):
                row_ok = cute.elem_less(self.tKVcKV[0, m, 0][0], rows_left)
            copy_or_fill_row(self.tiled_copy, lambda: src, dst, m, self.tKVpKV, row_ok, self.even_k, True)

    @cute.jit
    def row_window(self, mX, n_block, m: cutlass.Constexpr, row, pages):
        """`page_window` for this thread's row m of block n, pages of any size: its page from
        `pages` (read ahead) or the table, and its offset in that page."""
        page = self.row_page(n_block, m) if cutlass.const_expr(pages is None) else pages[m]
        offset = (n_block * self.bn + row) % self.page_div
        return self.page_window(mX, page, offset - row)

    @cute.jit
    def page_window(self, mX, page, shift):
        """This thread's copy partition of a (block_n, d) window of `page` shifted by `shift`
        rows, so that the copy's own row offsets land on the right page rows."""
        mX_page = cute.domain_offset((page, shift, 0), mX)
        return self.thr_copy.partition_S(cute.local_tile(mX_page[0, None, None], (self.bn, self.d), (0, 0)))
