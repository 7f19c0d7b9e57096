"""The Hopper forward (kernels/fwd_sm90.py) on validated CUDA tensors, and when to take it.

Opt-in for now: with `CUTE_FLASH_ARCH_PATH=sm90`, `dense.flash_fwd` routes dense forwards on
sm_90 GPUs here; every other call, and every call without the variable, takes the SM80 kernel.
The path becomes the default once its GPU tests (tests/test_fwd_sm90_gpu.py) pass and the
bench shows it ahead.
"""
from __future__ import annotations

import torch

from cute_flash.kernels.fwd_sm90 import Sm90FwdConfig
from cute_flash.launch import compiled
from cute_flash.launch.align import aligned
from cute_flash.launch.dense import alibi_2d, scales, window_edges
from layouts.hopper import choose_hopper_traits


def flash_fwd_sm90(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Dense forward on the Hopper kernel: q (b, sq, h, d), k/v (b, sk, hk, d); returns (out,
    lse (b, h, sq)) as `flash_fwd` does."""
    b, sq, h, d = q.shape
    q, k, v = aligned(q), aligned(k), aligned(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    left, right = window_edges(causal, window_size)
    config = Sm90FwdConfig(choose_hopper_traits(q.shape[-1], compiled.DTYPE_NAMES[q.dtype]), has_left=left >= 0,
                           has_right=right >= 0, has_alibi=alibi_slopes is not None, has_softcap=softcap > 0)
    compiled.sm90_kernel_for(config)(q, k, v, out, lse, alibi_2d(alibi_slopes, b, h), *scales(softmax_scale, softcap),
                                     left, right)
    return (out if out.shape[-1] == d else out[..., :d]), lse
