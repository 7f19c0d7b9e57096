"""The Hopper forward (kernels/fwd_sm90.py) on validated CUDA tensors, and when to take it.

The default for dense forwards on sm_90 GPUs (`dense.takes_hopper_path`): the full GPU suite
passes with it, and it leads the SM80 kernel on the forward grid (docs/perf.md).
`CUTE_FLASH_ARCH_PATH=sm80` selects the SM80 kernel instead. The other entries (varlen, paged,
KV cache, split-KV) and dropout take the SM80 kernel on every GPU; docs/perf.md lists these
fall backs and why.
"""
from __future__ import annotations

import torch

from cute_flash.kernels.fwd_sm90 import Sm90FwdConfig
from cute_flash.launch import compiled
from cute_flash.launch.align import aligned
from cute_flash.launch.dense import alibi_2d, device_index, scales, window_edges
from layouts.hopper import choose_hopper_traits


PERSISTENT_MAX_KEY_BLOCKS = 16


def prefers_persistent(traits, seqlen_k: int, left: int, right: int) -> bool:
    """The persistent kernel (one CTA per SM over a static round robin of tiles) where it
    measured faster: no causal / local mask (unequal tiles unbalance a static round robin: d 128
    causal 16k ran 417 TFLOP/s persistent, 585 one CTA per tile) and at most 16 key blocks per
    tile, where each tile's prologue and epilogue weigh (d 128 non-causal 512: 444 vs 418, d 64:
    326 vs 277; at 16k: 590 vs 605, d 64: 430 vs 450). H200, bf16, docs/perf.md."""
    unmasked = left < 0 and right < 0
    return (unmasked and -(-seqlen_k // traits.block_n) <= PERSISTENT_MAX_KEY_BLOCKS
            and Sm90FwdConfig.fits_persistent(traits))


def flash_fwd_sm90(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   traits=None, persistent=None):
    """Dense forward on the Hopper kernel: q (b, sq, h, d), k/v (b, sk, hk, d); returns (out,
    lse (b, h, sq)) as `flash_fwd` does. `traits` (HopperTileTraits) and `persistent` override
    the kernel's choices (`tune --sm90`)."""
    b, sq, h, d = q.shape
    q, k, v = aligned(q), aligned(k), aligned(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    left, right = window_edges(causal, window_size)
    traits = traits or choose_hopper_traits(q.shape[-1], compiled.DTYPE_NAMES[q.dtype])
    if persistent is None:
        persistent = prefers_persistent(traits, k.shape[1], left, right)
    config = Sm90FwdConfig(traits, persistent=persistent, has_left=left >= 0, has_right=right >= 0,
                           has_alibi=alibi_slopes is not None, has_softcap=softcap > 0)
    compiled.sm90_kernel_for(config)(q, k, v, out, lse, alibi_2d(alibi_slopes, b, h), *scales(softmax_scale, softcap),
                                     left, right, compiled.num_sms(device_index(q.device)))
    return (out if out.shape[-1] == d else out[..., :d]), lse
