"""Score modifiers applied to one S tile in registers: sequence-end / causal / local masks, ALiBi.

Coordinates come from the MMA's C partition of an identity tensor, viewed row/column like the
accumulator (`layouts.mma.acc_mn_view`), so `tScS_mn[r, c]` is the (row, col) inside the tile of
`acc_S_mn[r, c]`. Query i sees key j iff j < seqlen_k and, per window side,
i + sk - sq - left <= j <= i + sk - sq + right (causal: right = 0, no left).
"""
import cutlass
import cutlass.cute as cute


class Mask:
    def __init__(self, seqlen_q, seqlen_k, window_left, window_right,
                 has_left: cutlass.Constexpr, has_right: cutlass.Constexpr):
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.window_left = window_left
        self.window_right = window_right
        self.has_left = has_left
        self.has_right = has_right

    @cute.jit
    def apply(self, acc_S_mn: cute.Tensor, tScS_mn: cute.Tensor, row0, col0):
        """Set invisible scores to -inf; row0/col0 are the tile's first query row and key column."""
        shift = self.seqlen_k - self.seqlen_q
        for r in cutlass.range_constexpr(cute.size(acc_S_mn.shape[0])):
            row = row0 + tScS_mn[r, 0][0]
            limit_right = self.seqlen_k
            if cutlass.const_expr(self.has_right):
                limit_right = cutlass.min(limit_right, row + shift + self.window_right + 1)
            limit_left = 0
            if cutlass.const_expr(self.has_left):
                limit_left = row + shift - self.window_left
            for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                col = col0 + tScS_mn[0, c][1]
                if cutlass.const_expr(self.has_left):
                    if col >= limit_right or col < limit_left:
                        acc_S_mn[r, c] = -cutlass.Float32.inf
                else:
                    if col >= limit_right:
                        acc_S_mn[r, c] = -cutlass.Float32.inf


@cute.jit
def apply_alibi(acc_S_mn: cute.Tensor, tScS_mn: cute.Tensor, row0, col0, shift, slope):
    """Add -slope * |i + sk - sq - j|; `slope` is pre-divided by the softmax multiplier, so the
    bias lands on the scaled score as flash-attn defines it."""
    for r in cutlass.range_constexpr(cute.size(acc_S_mn.shape[0])):
        diag = row0 + tScS_mn[r, 0][0] + shift
        for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
            dist = diag - (col0 + tScS_mn[0, c][1])
            if dist < 0:
                dist = -dist
            acc_S_mn[r, c] = acc_S_mn[r, c] - slope * cutlass.Float32(dist)
