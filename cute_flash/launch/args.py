"""A call's options as the kernels take them: a positive softmax scale, the exp2 and softcap
scalars, the window's edges, the score flags of a kernel config, ALiBi slopes per (batch,
head)."""
from __future__ import annotations

import torch

from cute_flash.kernels.common.constants import LOG2E

def positive_scale(q, softmax_scale):
    """(q, softmax_scale, dq_sign) with a positive scale, as the kernels need: they take row
    maxima of unscaled scores and mask with -inf before scaling, so a negative scale would pick
    each row's smallest score as its maximum and turn masked scores into +inf, and 0 makes them
    -inf * 0 = NaN. scale q k^T = |scale| (-q) k^T, and at scale 0 every score is 0 as with
    q = 0 at scale 1. dq_sign multiplies the kernels' dq (computed for that q) into the
    caller's: -1, or 0 at scale 0. A positive scale costs two compares; the others a pass over
    q. (NaN passes through: the public functions refuse it, `_validate.check_softmax_scale`.)"""
    if softmax_scale < 0:
        return torch.neg(q), positive_scale_value(softmax_scale), -1
    if softmax_scale == 0:
        return torch.zeros_like(q), positive_scale_value(softmax_scale), 0
    return q, softmax_scale, 1


def positive_scale_value(softmax_scale: float) -> float:
    """The scale `positive_scale` gives the kernels: |scale|, 1 for 0."""
    return abs(softmax_scale) if softmax_scale else 1.0


def scales(softmax_scale, softcap, score_mod: bool = False):
    """(scale_log2, score_premul, alibi_div): with softcap the kernel applies tanh(s * scale /
    softcap) and exponentiates softcap * log2(e) * tanh; ALiBi slopes are divided by the
    multiplier so the bias lands on the scaled score. With a score_mod the kernel hands the mod
    scale * s and exponentiates its result times log2(e) (kernels/common/user_mods.py)."""
    if score_mod:
        return LOG2E, softmax_scale, 1.0 / softmax_scale
    if softcap > 0:
        return softcap * LOG2E, softmax_scale / softcap, 1.0 / softcap
    return softmax_scale * LOG2E, 1.0, 1.0 / softmax_scale


def window_edges(causal, window_size):
    """The window as the kernels take it: causal is a right edge at 0."""
    left, right = window_size
    return left, 0 if causal else right


def score_flags(left: int, right: int, alibi_slopes, softcap: float, dropout=None) -> dict:
    """The flags every kernel config (SM80 or Hopper, forward or backward) takes from a call's
    options: has_left / has_right from `window_edges`' edges, has_alibi, has_softcap,
    has_dropout."""
    return dict(has_left=left >= 0, has_right=right >= 0, has_alibi=alibi_slopes is not None, has_softcap=softcap > 0,
                has_dropout=dropout is not None)


def sink_logits(learnable_sink):
    """The kernels' mSink: learnable sink logits (heads,) as contiguous fp32, or None."""
    return None if learnable_sink is None else learnable_sink.detach().float().contiguous()


def alibi_2d(alibi_slopes, batch, nheads):
    """(batch, heads) slopes as the kernels read them (a (heads,) vector broadcast), or None."""
    if alibi_slopes is None or alibi_slopes.dim() == 2:
        return alibi_slopes
    return alibi_slopes.unsqueeze(0).expand(batch, nheads)
