"""Block sparsity: per query block, the key blocks a mask_mod cuts (partial: the mask is
evaluated there) and those it keeps whole (full: no mask), every other key block skipped; the
backward's lists are the transpose (per key block, its query blocks).

The host builds the lists from a FlexAttention `BlockMask` at the kernel's own tile sizes
(`launch/block_sparse.py`); a CTA visits its row's partial blocks, then its full ones, in list
order.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.fake import fake_tensor


@dataclass(frozen=True)
class BlockSparse:
    """The lists of a launch, int32, by row (the forward's query blocks, the backward's key
    blocks); batch and heads extents are the call's or 1 (one list for all of them)."""
    mPartialCnt: cute.Tensor  # (batch, heads, rows)
    mPartialIdx: cute.Tensor  # (batch, heads, rows, blocks): the first mPartialCnt entries count
    mFullCnt: cute.Tensor     # (batch, heads, rows)
    mFullIdx: cute.Tensor     # (batch, heads, rows, blocks)

    @staticmethod
    def of(tensors) -> "BlockSparse | None":
        """The entry's block_sparse argument: [partial_cnt, partial_idx, full_cnt, full_idx], or None."""
        return None if tensors is None else BlockSparse(*tensors)

    @cute.jit
    def row(self, bidb, bidh, row, counts=None) -> "SparseRow":
        """Row `row` of (bidb, bidh); counts: its (partial, full) counts where the caller has
        them (a consumer, from the producer's announcement: no global load before its first
        block), else read here."""
        b = cutlass.min(bidb, self.mPartialCnt.shape[0] - 1)
        h = cutlass.min(bidh, self.mPartialCnt.shape[1] - 1)
        if cutlass.const_expr(counts is None):
            counts = (self.mPartialCnt[b, h, row], self.mFullCnt[b, h, row])
        return SparseRow(counts[0], counts[1], self.mPartialIdx[b, h, row, None], self.mFullIdx[b, h, row, None])


@dataclass(frozen=True)
class SparseRow:
    """One row's blocks: visit i < partial is partial_idx[i], later ones full_idx[i - partial]."""
    partial: object
    full: object
    partial_idx: cute.Tensor  # (blocks,)
    full_idx: cute.Tensor     # (blocks,)

    def count(self):
        return self.partial + self.full

    @cute.jit
    def block(self, i):
        n = self.full_idx[cutlass.max(i - self.partial, 0)]
        if i < self.partial:
            n = self.partial_idx[i]
        return n

    def is_partial(self, i):
        return i < self.partial

    @cute.jit
    def visit(self, i, n_block, unmasked_lo, unmasked_hi, run, edges: cutlass.Constexpr = True):
        """Visit i, key block n_block, as `run(masked=, user_mask=)` (both compile time): a partial
        block with every mask, a full one without the mask_mod, and without the built-in masks too
        where no edge crosses it (n_block in [unmasked_lo, unmasked_hi), `BlockRange.unmasked`).
        edges False (a forward with no built-in mask, whose lists never call the block the
        sequence's end cuts full: `launch/block_sparse.py`): a full block takes no mask, and
        n_block is not read for it."""
        if self.is_partial(i):
            run(masked=True, user_mask=True)
        elif cutlass.const_expr(not edges):
            run(masked=False, user_mask=False)
        elif unmasked_lo <= n_block and n_block < unmasked_hi:
            run(masked=False, user_mask=False)
        else:
            run(masked=True, user_mask=False)


def fake_block_sparse() -> list:
    """Placeholders for an entry's block_sparse argument."""
    return [fake_tensor(cutlass.Int32, rank) for rank in (3, 4, 3, 4)]
