"""Online softmax on register tiles.

Each thread holds two rows per MMA_M step of S and O; the other three threads of its quad hold
the remaining columns, so row maxima are completed with two butterfly shuffles. Row sums stay
per-thread partial until the end (one reduction instead of one per block). Scores are kept
unscaled: exp2(s * scale_log2 - max * scale_log2) is one FFMA and one EX2 per element.

Row maxima are a pairwise tree of `max.f32` (`row_max`): `TensorSSA.reduce(MAX)` emits
`max.NaN.f32` (SASS FMNMX.NAN), and with the same instruction count the Hopper forward ran
slower with it (docs/tuning/hopper-forward.md, Hopper step 7). A NaN score still reaches the
output: exp2 of it is NaN, which the row sum and P V carry.
"""
import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.constants import LN2


@cute.jit
def quad_allreduce_max(val: cutlass.Float32) -> cutlass.Float32:
    val = cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=2))
    return cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=1))


@cute.jit
def quad_allreduce_sum(val: cutlass.Float32) -> cutlass.Float32:
    val = val + cute.arch.shuffle_sync_bfly(val, offset=2)
    return val + cute.arch.shuffle_sync_bfly(val, offset=1)


@cute.jit
def exp2_shifted(s_row, scale_log2: cutlass.Float32, max_scaled: cutlass.Float32):
    """exp2(s * scale_log2 - max_scaled), the multiply-add fused explicitly, for
    `update_speculative`: written as a multiply and a subtract, LLVM shared its products with
    the `update` it falls back to and ptxas fused only one side, so P from the kept maxima
    differed from `update`'s by a unit in the last place in a few rows. `update` keeps the
    multiply and subtract, which ptxas fuses: with this there, d 64's 192-row tile spilled
    804 B instead of 20 (ptxas 13.0; docs/tuning/hopper-forward.md, Hopper step 16)."""
    return cute.math.exp2(cute.math.fma(s_row, cute.full_like(s_row, scale_log2), cute.full_like(s_row, -max_scaled)),
                          fastmath=True)


# Lazy rescaling keeps a row's maximum until a block raises it by more than this (log2 units):
# P then stays below 2^8, far from overflow in fp32 sums and in range for fp16 / bf16 P.
LAZY_RESCALE_LOG2 = 8.0
# `update_speculative` keeps P from the kept maxima when every thread's part of each row of it
# sums to at most this: then no value passes 2^LAZY_RESCALE_LOG2, the bound lazy rescaling keeps.
SPECULATIVE_SUM_MAX = 2.0 ** LAZY_RESCALE_LOG2


def row_max(acc_s_mn: cute.Tensor, r: int):
    """Max of row r of a register tile (a thread's part of it), a pairwise tree of max.f32.
    Plain Python: it unrolls while the kernel is traced."""
    vals = [acc_s_mn[r, j] for j in range(cute.size(acc_s_mn.shape[1]))]
    while len(vals) > 1:
        pairs = [cute.arch.fmax(vals[i], vals[i + 1]) for i in range(0, len(vals) - 1, 2)]
        vals = pairs + vals[len(pairs) * 2:]
    return vals[0]


class OnlineSoftmax:
    def __init__(self, num_rows: cutlass.Constexpr, scale_log2: cutlass.Float32, lazy: bool = False):
        """lazy (the Hopper forward, which rescales O in a step of its own): keep each row's
        maximum unless a block raises it by more than LAZY_RESCALE_LOG2, so that most blocks
        leave every factor at exactly 1 and `rescale` skips O (64 multiplies per thread and block
        at d 128); the row sum and LSE use the kept maximum, so the result is the same up to
        rounding; it ran faster than eager rescaling (docs/tuning/hopper-forward.md, Hopper step 7)."""
        self.row_max = cute.make_rmem_tensor((num_rows,), cutlass.Float32)
        self.row_sum = cute.make_rmem_tensor((num_rows,), cutlass.Float32)
        self.scale_log2 = scale_log2
        self.lazy = lazy

    @cute.jit
    def step(self, acc_s_mn: cute.Tensor, acc_o_mn: cute.Tensor,
             is_first: cutlass.Constexpr, check_inf: cutlass.Constexpr):
        """Turn S into unnormalised P in place and rescale O by exp(old max - new max)."""
        self.update(acc_s_mn, acc_o_mn, is_first, check_inf, True)

    @cute.jit
    def update(self, acc_s_mn: cute.Tensor, scale_to: cute.Tensor, is_first: cutlass.Constexpr,
               check_inf: cutlass.Constexpr, rescale_o: cutlass.Constexpr = False, dst_mn=None,
               eager: cutlass.Constexpr = False):
        """Turn S into unnormalised P in place (or into dst_mn, S left as it is) and update the
        row maxima and sums. Unless is_first, each row's exp(old max - new max) goes to
        `scale_to`: O's rows are rescaled by it there (rescale_o: scale_to is O's (row, col)
        view), or it is stored as row_scale[r] for `rescale` to apply later (the Hopper kernel,
        once the P V in flight has landed).

        check_inf: a masked tile can leave a row all -inf; its max is then taken as 0 so that
        exp2 gives 0 instead of NaN. eager: a lazy softmax's maxima follow every rise this once
        (`update_speculative`'s fallback).
        """
        lazy = self.lazy and not eager
        dst = acc_s_mn if cutlass.const_expr(dst_mn is None) else dst_mn
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            s_row = acc_s_mn[r, None].load()
            row_max_r = quad_allreduce_max(row_max(acc_s_mn, r))
            if cutlass.const_expr(not is_first):
                row_max_r = cute.arch.fmax(self.row_max[r], row_max_r)
                if cutlass.const_expr(lazy):
                    # -inf - -inf is NaN: a row with no key yet keeps -inf (and its factor 1)
                    grows = (row_max_r - self.row_max[r]) * self.scale_log2 > LAZY_RESCALE_LOG2
                    row_max_r = row_max_r if grows else self.row_max[r]
            max_scaled = row_max_r * self.scale_log2
            if cutlass.const_expr(check_inf):
                max_scaled = 0.0 if row_max_r == -cutlass.Float32.inf else max_scaled
            p_row = cute.math.exp2(s_row * self.scale_log2 - max_scaled, fastmath=True)
            row_sum = p_row.reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0)
            if cutlass.const_expr(is_first):
                self.row_sum[r] = row_sum
            else:
                correction = cute.math.exp2(self.row_max[r] * self.scale_log2 - max_scaled, fastmath=True)
                if cutlass.const_expr(lazy):
                    correction = correction if grows else cutlass.Float32(1.0)  # exactly 1: `rescale` tests it
                self.row_sum[r] = self.row_sum[r] * correction + row_sum
                if cutlass.const_expr(rescale_o):
                    scale_to[r, None] = scale_to[r, None].load() * correction
                else:
                    scale_to[r] = correction
            self.row_max[r] = row_max_r
            dst[r, None] = p_row

    @cute.jit
    def update_speculative(self, acc_s_mn: cute.Tensor, dst_mn, row_scale: cute.Tensor,
                           check_inf: cutlass.Constexpr, agree=None, rescore=None):
        """`update` for a block after the first (lazy), P into dst_mn, without row maxima where
        it can: P from the kept maxima first, and if every thread of the warp finds each of its
        rows' part of P summing to at most SPECULATIVE_SUM_MAX (no value past the lazy bound),
        that P and those sums stand, the maxima and O as they were. Otherwise (a maximum rose,
        a row's kept maximum is low enough that its sum passes the bound, or a row has seen no
        key yet: its P is inf or NaN) the warp runs `update` from S, still in acc_s_mn, eagerly:
        a low kept maximum that lazy rescaling would keep fails the test again every block
        (the test emulated in torch on random scores under a causal mask: a bound of 256 with an
        eager fallback failed least; none failed non-causal, where the first block's maxima are
        over 128 keys; docs/tuning/hopper-forward.md, Hopper step 16). The common path skips
        each row's max tree and quad shuffles (31 + 2 FMNMX and 2 SHFL a row at 128 keys) and
        the factor's exp2.

        dst_mn None: P over S, for tiles with no registers for a second one. Then S is gone
        when the test fails, so the decision is the warpgroup's (agree(fits): every thread of
        it fits), and a failed one takes S again from rescore() (the warpgroup's Q K^T issued
        again, with the score modifiers)."""
        dst = acc_s_mn if cutlass.const_expr(dst_mn is None) else dst_mn
        sums = []
        fits = cutlass.Boolean(True)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            p_row = exp2_shifted(acc_s_mn[r, None].load(), self.scale_log2, self.row_max[r] * self.scale_log2)
            dst[r, None] = p_row
            sums.append(p_row.reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0))
            fits = fits & (sums[r] <= SPECULATIVE_SUM_MAX)
        row_sum = self.row_sum  # a local: the DSL's run-time `if` cannot carry `self` through
        agreed = cute.arch.vote_all_sync(fits) if cutlass.const_expr(agree is None) else agree(fits)
        if agreed:
            for r in cutlass.range_constexpr(cute.size(row_sum)):
                row_sum[r] = row_sum[r] + sums[r]
                row_scale[r] = cutlass.Float32(1.0)
        else:
            s_mn = acc_s_mn if cutlass.const_expr(rescore is None) else rescore()
            self.update(s_mn, row_scale, False, check_inf, dst_mn=dst_mn, eager=True)

    @cute.jit
    def rescale(self, acc_o_mn: cute.Tensor, row_scale: cute.Tensor):
        """O's rows times the factors `update` stored; lazy, only where a factor of the warp's
        rows is not 1 (a warp-uniform branch: the warp's rows are its own)."""
        if cutlass.const_expr(self.lazy):
            changed = row_scale[0] != 1.0
            for r in cutlass.range_constexpr(1, cute.size(self.row_max)):
                changed = changed | (row_scale[r] != 1.0)
            if cute.arch.vote_any_sync(changed):
                self.scale_rows(acc_o_mn, row_scale)
        else:
            self.scale_rows(acc_o_mn, row_scale)

    @cute.jit
    def scale_rows(self, acc_o_mn: cute.Tensor, row_scale: cute.Tensor):
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            acc_o_mn[r, None] = acc_o_mn[r, None].load() * row_scale[r]

    def init_empty(self):
        self.row_max.fill(-cutlass.Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def finalize(self, acc_o_mn: cute.Tensor, lse: cute.Tensor, empty_lse: cutlass.Float32, sink_log2=None):
        """Normalise O and write the natural-log LSE per row into `lse` (registers).

        A row that saw no key has sum 0: O stays 0 and its LSE is `empty_lse` (+inf for a final
        result, flash-attn's convention; -inf for a split's partial). `sink_log2`, a learnable
        sink's logit times log2 e (cute_flash/sinks.py), joins each row's denominator: with m
        the row's max and t = max(m, sink), O / (sum exp2(m - t) + exp2(sink - t)) * exp2(m - t)
        and LSE (t + log2 of that denominator) ln 2; a row with no key gets O 0 and LSE the sink.
        One value for every row (a head's rows), or a register tensor of one per row (`lse`'s
        layout: KV-cache tiles, whose folded rows are several heads'), where -inf is no sink
        (the split partials that do not carry it): a row with neither keys nor sink then gets
        `empty_lse`.
        """
        per_row = cutlass.const_expr(isinstance(sink_log2, cute.Tensor))
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row_sum = quad_allreduce_sum(self.row_sum[r])
            empty = row_sum == 0.0 or row_sum != row_sum
            if cutlass.const_expr(sink_log2 is None):
                inv = 0.0 if empty else cute.arch.rcp_approx(row_sum)
                acc_o_mn[r, None] = acc_o_mn[r, None].load() * inv
                lse[r] = (
                    empty_lse
                    if empty
                    else (self.row_max[r] * self.scale_log2 + cute.math.log2(row_sum, fastmath=True)) * LN2
                )
            else:
                sink = sink_log2
                if cutlass.const_expr(per_row):
                    sink = sink_log2[r]
                row_max = self.row_max[r] * self.scale_log2
                top = sink if empty else cute.arch.fmax(row_max, sink)
                nothing = False  # a row with neither keys nor sink (per row, -inf: no sink)
                if cutlass.const_expr(per_row):
                    nothing = empty and sink == -cutlass.Float32.inf
                    top = 0.0 if nothing else top
                keys = 0.0 if empty else cute.math.exp2(row_max - top, fastmath=True)
                total = (0.0 if empty else row_sum * keys) + cute.math.exp2(sink - top, fastmath=True)
                if cutlass.const_expr(per_row):
                    acc_o_mn[r, None] = acc_o_mn[r, None].load() * (
                        0.0 if nothing else keys * cute.arch.rcp_approx(total))
                else:
                    acc_o_mn[r, None] = acc_o_mn[r, None].load() * (keys * cute.arch.rcp_approx(total))
                lse[r] = (top + cute.math.log2(total, fastmath=True)) * LN2
                if cutlass.const_expr(per_row):
                    lse[r] = empty_lse if nothing else lse[r]
