"""The dense and packed-varlen forwards on validated CUDA tensors: align, pick the config,
look its compiled kernel up, launch on torch's current stream."""
from __future__ import annotations

import functools
import os

import torch

from cute_flash.kernels.config import FwdConfig
from cute_flash.kernels.constants import LOG2E
from cute_flash.launch.align import aligned
from cute_flash.launch import compiled
from cute_flash.launch.batch_chunks import (batch_chunks, chunked, lengths_of, refuse_chunked_dropout, rows_of,
                                            slopes_of)
from cute_flash.dropout import DropoutArgs, rng_of
from layouts.traits import FwdTraits, choose_fwd_traits, tile_arch

PAGE_ROWS = 16  # pages of a multiple of this many rows take the page-run / shared-page-id copies


def positive_scale(q, softmax_scale):
    """(q, softmax_scale, dq_sign) with a positive scale, as the kernels need: they take row
    maxima of unscaled scores and mask with -inf before scaling, so a negative scale would pick
    each row's smallest score as its maximum and turn masked scores into +inf, and 0 makes them
    -inf * 0 = NaN. scale q k^T = |scale| (-q) k^T, and at scale 0 every score is 0 as with
    q = 0 at scale 1. dq_sign multiplies the kernels' dq (computed for that q) into the
    caller's: -1, or 0 at scale 0. A positive scale costs two compares; the others a pass over
    q. (NaN passes through: the public functions refuse it, `_validate.check_softmax_scale`.)"""
    if softmax_scale < 0:
        return torch.neg(q), -softmax_scale, -1
    if softmax_scale == 0:
        return torch.zeros_like(q), 1.0, 0
    return q, softmax_scale, 1


def scales(softmax_scale, softcap):
    """(scale_log2, score_premul, alibi_div): with softcap the kernel applies tanh(s * scale /
    softcap) and exponentiates softcap * log2(e) * tanh; ALiBi slopes are divided by the
    multiplier so the bias lands on the scaled score."""
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


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def fwd_kernel(d_pad: int, dtype, device_index: int, causal: bool, traits: FwdTraits | None, flags: tuple):
    """The compiled forward of one call signature, flags: FwdConfig's (name, value) pairs
    (memoised on plain values: a cached call hashes no config)."""
    if traits is None:
        arch = tile_arch(compiled.device_arch(device_index))
        traits = choose_fwd_traits(d_pad, compiled.DTYPE_NAMES[dtype], arch, causal)
    return compiled.kernel_for(FwdConfig(traits, even_k=d_pad == traits.head_dim, **dict(flags)), device_index)


def alibi_2d(alibi_slopes, batch, nheads):
    """(batch, heads) slopes as the kernels read them (a (heads,) vector broadcast), or None."""
    if alibi_slopes is None or alibi_slopes.dim() == 2:
        return alibi_slopes
    return alibi_slopes.unsqueeze(0).expand(batch, nheads)


def takes_hopper_path(index: int) -> bool:
    """Dense forwards, packed batches (over pages of a multiple of its key block too) and KV
    caches (those the Hopper entry takes, launch/kvcache.py) on sm_90 GPUs take the Hopper
    kernel (launch/hopper.py) unless `CUTE_FLASH_ARCH_PATH=sm80` selects the SM80 kernel, which
    every other GPU runs (a packed batch measured 602 / 527 TFLOP/s on the Hopper kernel against
    367 / 338 on the SM80 one, non-causal / causal; decode 1.03-1.16x the SM80 kernel except at
    1k-key caches; H200, docs/perf.md)."""
    return os.environ.get("CUTE_FLASH_ARCH_PATH") != "sm80" and compiled.device_arch(index) == 90


def flash_fwd(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, traits: FwdTraits | None = None, dropout: DropoutArgs | None = None):
    """Dense forward: q (b, sq, h, d), k/v (b, sk, hk, d); returns (out, lse (b, h, sq)).
    On sm_90 the Hopper kernel (`takes_hopper_path`). `traits` (SM80 tiles) overrides the
    heuristic and selects the SM80 kernel (tile tuning, `python -m cute_flash tune`); `dropout`
    drops P's elements by the Philox mask (cute_flash/dropout.py), the same mask on either
    kernel."""
    b, sq, h, d = q.shape
    if chunked(b):  # launch/batch_chunks.py
        refuse_chunked_dropout(dropout, b)
        parts = [flash_fwd(q[s], k[s], v[s], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, alibi_slopes=slopes_of(alibi_slopes, s), traits=traits)
                 for s in batch_chunks(b)]
        return torch.cat([out for out, _ in parts]), torch.cat([lse for _, lse in parts])
    index = device_index(q.device)
    q, softmax_scale, _ = positive_scale(q, softmax_scale)
    if traits is None and takes_hopper_path(index):
        from cute_flash.launch.hopper import flash_fwd_sm90  # it imports this module's helpers

        return flash_fwd_sm90(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                              softcap=softcap, alibi_slopes=alibi_slopes, dropout=dropout)
    q, k, v = aligned(q), aligned(k), aligned(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    left, right = window_edges(causal, window_size)
    kernel = fwd_kernel(q.shape[-1], q.dtype, index, causal, traits,
                        tuple(score_flags(left, right, alibi_slopes, softcap, dropout).items()))
    kernel(q, k, v, out, lse, alibi_2d(alibi_slopes, b, h), rng_of(dropout, q.device), *scales(softmax_scale, softcap),
           left, right)
    return (out if out.shape[-1] == d else out[..., :d]), lse


def flash_fwd_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     block_table=None, seqused_k=None, dropout: DropoutArgs | None = None):
    """Packed-batch forward: q (total_q, h, d), k/v (total_k, hk, d) or pages (num_blocks,
    page_size, hk, d) through block_table; returns (out (total_q, h, d), lse (h, total_q)).
    Dropout's rows and columns count from each sequence's start. On sm_90 the Hopper kernel
    (`takes_hopper_path`), for pages when they hold whole key blocks of it (`hopper_pages_fit`);
    smaller pages take the SM80 kernel."""
    total_q, h, d = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    refuse_chunked_dropout(dropout, batch)
    paged = block_table is not None
    q, softmax_scale, _ = positive_scale(q, softmax_scale)
    index = device_index(q.device)
    if takes_hopper_path(index):  # its grid holds every tile on x: no chunks
        from cute_flash.launch.hopper import flash_fwd_varlen_sm90, hopper_pages_fit

        if not paged or hopper_pages_fit(q, k):
            return flash_fwd_varlen_sm90(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                         max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                         seqused_k=seqused_k, block_table=block_table, dropout=dropout)
    q, k, v = aligned(q), aligned(k), aligned(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((h, total_q), dtype=torch.float32, device=q.device)
    left, right = window_edges(causal, window_size)
    kernel = fwd_kernel(q.shape[-1], q.dtype, index, causal, None, (
        *score_flags(left, right, alibi_slopes, softcap, dropout).items(), ("varlen", True),
        ("has_seqused_k", seqused_k is not None), ("paged", paged),
        ("any_page_size", paged and k.shape[1] % PAGE_ROWS != 0)))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused = None if seqused_k is None else seqused_k.contiguous()
    alibi, rng = alibi_2d(alibi_slopes, batch, h), rng_of(dropout, q.device)
    for s in batch_chunks(batch):  # one launch unless past GRID_MAX_BATCH sequences (launch/batch_chunks.py)
        kernel(q, k, v, out, lse, rows_of(alibi, s), rng, lengths_of(cu_seqlens_q, s), lengths_of(cu_seqlens_k, s),
               rows_of(seqused, s), rows_of(block_table, s), max_seqlen_q, *scales(softmax_scale, softcap), left, right)
    return (out if out.shape[-1] == d else out[..., :d]), lse
