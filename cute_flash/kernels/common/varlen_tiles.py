"""A packed batch's work tiles in the order the host chose (`launch/varlen_order.py`: the longest
first), one CTA per (tile, head).

A grid over max_seqlen's blocks x heads x sequences launches a CTA for every block of the
longest sequence in every sequence (three in four exit at once on a batch of exponential
lengths), and in sequence order, so a long sequence's heavy blocks may start last and run
alone at the end. Here the grid is the list's length x heads: CTA x takes entry x // heads,
head x % heads (a tile's heads neighbours: GQA heads share their K / V in L2), and entries past
the batch's blocks name a block past every sequence's end, which walks nothing.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.fake import fake_tensor


@dataclass(frozen=True)
class VarlenTiles:
    mTiles: cute.Tensor  # (tiles, 2) int32: (sequence, block of it) in launch order
    heads: object

    def ctas(self):
        return self.mTiles.shape[0] * self.heads

    @cute.jit
    def at(self, cta):
        """(sequence, block, head) of CTA `cta`."""
        entry = cta // self.heads
        return self.mTiles[entry, 0], self.mTiles[entry, 1], cta - entry * self.heads


def fake_tiles():
    """The table's placeholder: (tiles, 2) int32."""
    return fake_tensor(cutlass.Int32, 2, 2, 4, last_extent=2)
