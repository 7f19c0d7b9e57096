"""Score modifiers applied to one S tile in registers: softcap, ALiBi, and the sequence-end /
causal / local masks.

Coordinates come from the MMA's C partition of an identity tensor, viewed row/column like the
accumulator (`layouts.mma.acc_mn_view`), so `tScS_mn[r, c]` is the (row, col) inside the tile of
`acc_s_mn[r, c]`. Query i sees key j iff j < seqlen_k and, per window side,
i + sk - sq - left <= j <= i + sk - sq + right (causal: right = 0, no left).
"""
import re
import warnings
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning

from cute_flash.kernels.common.block_range import Window
from layouts import mma as lmma

# The column loops over a thread's register tile (S tile) stay static (range_constexpr), 64
# iterations where a tile is wide: each column is its own register. As dynamic loops
# (cutlass.range(..., unroll_full=True)) they grew the PTX by 9-107% on three sm_90a kernels, so
# the DSL's advice for long static loops is silenced for this module only.
warnings.filterwarnings("ignore", category=DSLOptimizationWarning, module=re.escape(__name__) + "$")


@dataclass(frozen=True)
class Mask:
    seqlen_q: object
    seqlen_k: object
    window: Window

    @cute.jit
    def apply(self, acc_s_mn: cute.Tensor, tScS_mn: cute.Tensor, row0, col0):
        """Set invisible scores to -inf; row0/col0 are the tile's first row and key column (a row is
        a query unless the rows are folded, `Window.group`)."""
        shift = self.window.shift(self.seqlen_q, self.seqlen_k)
        for r in cutlass.range_constexpr(cute.size(acc_s_mn.shape[0])):
            row = self.window.query(row0 + tScS_mn[r, 0][0])
            limit_right = self.seqlen_k
            if cutlass.const_expr(self.window.has_right):
                limit_right = cutlass.min(limit_right, row + shift + self.window.right + 1)
            limit_left = 0
            if cutlass.const_expr(self.window.has_left):
                limit_left = row + shift - self.window.left
            for c in cutlass.range_constexpr(cute.size(acc_s_mn.shape[1])):
                col = col0 + tScS_mn[0, c][1]
                if cutlass.const_expr(self.window.has_left):
                    if col >= limit_right or col < limit_left:
                        acc_s_mn[r, c] = -cutlass.Float32.inf
                else:
                    if col >= limit_right:
                        acc_s_mn[r, c] = -cutlass.Float32.inf


@cute.jit
def apply_alibi(acc_s_mn: cute.Tensor, tScS_mn: cute.Tensor, row0, col0, shift, slope):
    """Add -slope * |i + sk - sq - j|; `slope` is pre-divided by the softmax multiplier, so the
    bias lands on the scaled score as flash-attn defines it. The distance is taken in fp32: the
    thread's first (row, column) converted once, each score's offset from it a compile-time
    constant (the coordinates' layout is static), exact below 2^24 as the int was; an int to
    float conversion per score ran at the exponentials' rate, a sixteenth of fp32 math's."""
    first_row, first_col = tScS_mn[0, 0][0], tScS_mn[0, 0][1]
    diag0 = cutlass.Float32(row0 + first_row + shift - col0 - first_col)
    for r in cutlass.range_constexpr(cute.size(acc_s_mn.shape[0])):
        dr = tScS_mn[r, 0][0] - first_row
        for c in cutlass.range_constexpr(cute.size(acc_s_mn.shape[1])):
            dist = diag0 + cutlass.Float32(dr - (tScS_mn[0, c][1] - first_col))
            acc_s_mn[r, c] = acc_s_mn[r, c] - slope * cute.arch.fmax(dist, -dist)


@cute.jit
def softcap_with_derivative(acc_s: cute.Tensor, score_premul) -> cute.Tensor:
    """The backward's softcap: S becomes tanh(S * score_premul) in place; returns 1 - tanh^2
    per element, the derivative dP is multiplied by on its way to dS."""
    dtanh = cute.make_fragment_like(acc_s, cutlass.Float32)
    for i in cutlass.range(cute.size(acc_s), unroll_full=True):
        th = cute.math.tanh(acc_s[i] * score_premul, fastmath=True)
        acc_s[i] = th
        dtanh[i] = 1.0 - th * th
    return dtanh


@dataclass(frozen=True)
class ScoreMods:
    """What turns Q K^T into the scores the softmax sees, for one CTA. The softmax scale itself
    is folded into the exponent (`OnlineSoftmax`); with softcap, S becomes tanh(S * score_premul)
    and the scale carries the cap."""
    mask: Mask
    score_premul: object  # scale / softcap (softcap only)
    slope: object         # this head's ALiBi slope over the softmax multiplier (ALiBi only)
    has_softcap: bool
    has_alibi: bool
    tile_mn: tuple        # (block_m, block_n): the S tile
    mma_tidx: object = None  # the thread's index in the MMA (None: its thread index)
    user: object = None   # ModCall: Python-written mods (kernels/common/user_mods.py), on every tile

    @cute.jit
    def apply(self, tiled_mma: cute.TiledMma, acc_s: cute.Tensor, m_block, n_block, masked: cutlass.Constexpr,
              user_mask: cutlass.Constexpr = True):
        """Modify the (MMA, MMA_M, MMA_N) S tile of (m_block, n_block) in place; `masked`: the
        tile crosses a mask edge; `user_mask` False: a mask_mod is known to keep the whole tile
        (block sparsity's full blocks). Returns its (row, col) view."""
        acc_s_mn = lmma.acc_mn_view(acc_s)
        if cutlass.const_expr(self.has_softcap):
            for i in cutlass.range(cute.size(acc_s), unroll_full=True):
                acc_s[i] = cute.math.tanh(acc_s[i] * self.score_premul, fastmath=True)
        row0 = m_block * self.tile_mn[0]
        col0 = n_block * self.tile_mn[1]
        user = self.user is not None and (user_mask or self.user.mods.score_mod is not None)  # a mod to call
        # (row, col) of each S element this thread holds; built here, not hoisted out of the
        # loop, so the coordinates are rematerialised instead of occupying registers.
        tScS_mn = None
        if cutlass.const_expr(masked or self.has_alibi or user):
            tidx = self.mma_tidx
            if cutlass.const_expr(tidx is None):
                tidx, _, _ = cute.arch.thread_idx()
            cS = cute.make_identity_tensor(self.tile_mn)
            tScS_mn = lmma.acc_mn_view(tiled_mma.get_slice(tidx).partition_C(cS))
        if cutlass.const_expr(self.has_alibi):
            apply_alibi(acc_s_mn, tScS_mn, row0, col0, self.mask.seqlen_k - self.mask.seqlen_q, self.slope)
        if cutlass.const_expr(user):
            self.user.apply(acc_s_mn, tScS_mn, row0, col0, user_mask)
        if cutlass.const_expr(masked):
            self.mask.apply(acc_s_mn, tScS_mn, row0, col0)
        return acc_s_mn


@dataclass(frozen=True)
class BwdScalars:
    """The backward's run-time scalars (both archs' kernels)."""
    softmax_scale: object  # applied to dK here (and to dQ by the host)
    scale_log2: object     # as the forward's: scale * log2(e), times softcap with softcap
    score_premul: object   # scale / softcap (softcap only)
    alibi_div: object
    window_left: object
    window_right: object
