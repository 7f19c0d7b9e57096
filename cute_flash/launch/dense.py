"""The dense and packed-varlen forwards on validated CUDA tensors: align, pick the config,
look its compiled kernel up, launch on torch's current stream."""
from __future__ import annotations

import functools

import torch

from cute_flash.kernels.sm80.fwd import FwdConfig
from cute_flash.launch import compiled, gpu
from cute_flash.launch.align import aligned
from cute_flash.launch.args import alibi_2d, positive_scale, scales, score_flags, sink_logits, window_edges
from cute_flash.launch.rng import DropoutArgs, rng_of
from cute_flash.launch.batch_chunks import (batch_chunks, chunked, lengths_of, refuse_chunked_dropout, rows_of,
                                            slopes_of)
from cute_flash.launch.block_sparse import block_lists
from cute_flash.launch.hopper import flash_fwd_sm90, flash_fwd_varlen_sm90
from cute_flash.launch.mods import ModArgs, aux_of, has_score_mod, mod_flags, refuse_chunked_mods
from cute_flash.launch.policy import PAGE_ROWS, hopper_pages_fit, takes_hopper_path
from cute_flash.launch.value_dim import one_head_dim, value_cols
from layouts.traits import FwdTraits, choose_fwd_traits, tile_arch


@functools.lru_cache(maxsize=None)
def fwd_kernel(d_pad: int, dtype, device_index: int, causal: bool, traits: FwdTraits | None, flags: tuple):
    """The compiled forward of one call signature, flags: FwdConfig's (name, value) pairs
    (memoised on plain values: a cached call hashes no config)."""
    if traits is None:
        arch = tile_arch(gpu.device_arch(device_index))
        traits = choose_fwd_traits(d_pad, gpu.DTYPE_NAMES[dtype], arch, causal)
    return compiled.kernel_for(FwdConfig(traits, even_k=d_pad == traits.head_dim, **dict(flags)), device_index)


def flash_fwd(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, traits: FwdTraits | None = None, dropout: DropoutArgs | None = None,
              mods: ModArgs | None = None, block_mask=None, learnable_sink=None):
    """Dense forward: q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, d_v); returns (out (b,
    sq, h, d_v), lse (b, h, sq)). On sm_90 the Hopper kernel (`takes_hopper_path`), which takes
    d_v as it is; the SM80 kernel takes one head dim (`value_dim.one_head_dim`). `traits` (SM80
    tiles) overrides the heuristic and selects the SM80 kernel (tile tuning, `python -m cute_flash tune`); `dropout`
    drops P's elements by the Philox mask (cute_flash/dropout.py), the same mask on either
    kernel; `mods` the call's Python-written score / mask mods and their aux tensors (`ModArgs.of`);
    `block_mask` a FlexAttention BlockMask of the mask_mod, whose empty blocks either kernel
    skips (`launch/block_sparse.py`); `learnable_sink` (h,) a logit per head in every row's
    denominator (cute_flash/sinks.py), which either kernel's epilogue adds."""
    b, sq, h, d = q.shape
    mods = ModArgs.of(mods)
    if chunked(b):  # launch/batch_chunks.py
        refuse_chunked_dropout(dropout, b)
        refuse_chunked_mods(mods, b)
        parts = [flash_fwd(q[s], k[s], v[s], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, alibi_slopes=slopes_of(alibi_slopes, s), traits=traits,
                           learnable_sink=learnable_sink)
                 for s in batch_chunks(b)]
        return torch.cat([out for out, _ in parts]), torch.cat([lse for _, lse in parts])
    index = gpu.device_index(q.device)
    q, softmax_scale, _ = positive_scale(q, softmax_scale)
    if traits is None and takes_hopper_path(index):
        return flash_fwd_sm90(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                              softcap=softcap, alibi_slopes=alibi_slopes, dropout=dropout, mods=mods,
                              block_mask=block_mask, learnable_sink=learnable_sink)
    d_v = v.shape[-1]
    if d_v != d:
        q, k, v = one_head_dim(q, k, v)
    q, k, v = aligned(q), aligned(k), aligned(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    left, right = window_edges(causal, window_size)
    sparse = None
    if block_mask is not None:  # the lists at the SM80 tiles
        traits = traits or choose_fwd_traits(q.shape[-1], gpu.DTYPE_NAMES[q.dtype],
                                             tile_arch(gpu.device_arch(index)), causal)
        sparse = block_lists(block_mask, b, h, sq, k.shape[1], traits.block_m, traits.block_n)
    kernel = fwd_kernel(q.shape[-1], q.dtype, index, causal, traits,
                        tuple(score_flags(left, right, alibi_slopes, softcap, dropout).items()) + mod_flags(mods)
                        + ((("block_sparse", True),) if sparse is not None else ())
                        + ((("learnable_sink", True),) if learnable_sink is not None else ()))
    kernel(q, k, v, out, lse, alibi_2d(alibi_slopes, b, h), sink_logits(learnable_sink), rng_of(dropout, q.device),
           aux_of(mods), sparse, *scales(softmax_scale, softcap, has_score_mod(mods)), left, right)
    return value_cols(out, d_v), lse


def flash_fwd_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     block_table=None, seqused_k=None, dropout: DropoutArgs | None = None,
                     mods: ModArgs | None = None, learnable_sink=None):
    """Packed-batch forward: q (total_q, h, d), k (total_k, hk, d) and v (.., d_v), or pages
    (num_blocks, page_size, hk, d / d_v) through block_table; returns (out (total_q, h, d_v),
    lse (h, total_q)); d_v and `learnable_sink` as `flash_fwd` takes them.
    Dropout's rows and columns count from each sequence's start. On sm_90 the Hopper kernel
    (`takes_hopper_path`), for pages when they hold whole key blocks of it (`hopper_pages_fit`);
    smaller pages take the SM80 kernel."""
    total_q, h, d = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    refuse_chunked_dropout(dropout, batch)
    mods = ModArgs.of(mods)
    refuse_chunked_mods(mods, batch)
    paged = block_table is not None
    q, softmax_scale, _ = positive_scale(q, softmax_scale)
    index = gpu.device_index(q.device)
    if takes_hopper_path(index):  # its grid holds every tile on x: no chunks
        if not paged or hopper_pages_fit(q, k, v):
            return flash_fwd_varlen_sm90(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                         max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                         seqused_k=seqused_k, block_table=block_table, dropout=dropout, mods=mods,
                                         learnable_sink=learnable_sink)
    d_v = v.shape[-1]
    if d_v != d:
        q, k, v = one_head_dim(q, k, v)
    q, k, v = aligned(q), aligned(k), aligned(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((h, total_q), dtype=torch.float32, device=q.device)
    left, right = window_edges(causal, window_size)
    kernel = fwd_kernel(q.shape[-1], q.dtype, index, causal, None, (
        *score_flags(left, right, alibi_slopes, softcap, dropout).items(), ("varlen", True),
        ("has_seqused_k", seqused_k is not None), ("paged", paged),
        ("any_page_size", paged and k.shape[1] % PAGE_ROWS != 0)) + mod_flags(mods)
        + ((("learnable_sink", True),) if learnable_sink is not None else ()))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused = None if seqused_k is None else seqused_k.contiguous()
    alibi, rng, sink = alibi_2d(alibi_slopes, batch, h), rng_of(dropout, q.device), sink_logits(learnable_sink)
    for s in batch_chunks(batch):  # one launch unless past GRID_MAX_BATCH sequences (launch/batch_chunks.py)
        kernel(q, k, v, out, lse, rows_of(alibi, s), sink, rng, aux_of(mods), lengths_of(cu_seqlens_q, s),
               lengths_of(cu_seqlens_k, s), rows_of(seqused, s), rows_of(block_table, s), max_seqlen_q,
               *scales(softmax_scale, softcap, has_score_mod(mods)), left, right)
    return value_cols(out, d_v), lse
