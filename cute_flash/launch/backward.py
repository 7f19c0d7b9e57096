"""The backward pass on validated CUDA tensors: D = rowsum(dO * O) (preprocess kernel), the
main kernel (dK, dV, and dQ accumulated in fp32), dQ converted (`DQConvert`), GQA heads summed.
The main kernel is the Hopper one (kernels/sm90/bwd.py) on sm_90 where it exists
(`takes_hopper_bwd`), dense and packed, the SM80 one (kernels/sm80/bwd.py) otherwise.

Extra memory is O(seqlen): dQaccum (fp32, one slice, or one per split when deterministic; its
layout is `kernels/common/dq_accum.py`'s), D, and with GQA per-query-head dK/dV before the group sum
(flash-attn 2 does the same).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from cute_flash.kernels.sm80.bwd import BwdConfig
from cute_flash.kernels.sm80.bwd_preprocess import PreprocessConfig
from cute_flash.kernels.sm80.dq_convert import DQConvertConfig
from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
from cute_flash.launch import compiled, gpu, policy
from cute_flash.launch.align import aligned
from cute_flash.launch.args import alibi_2d, positive_scale, scales, score_flags, window_edges
from cute_flash.launch.batch_chunks import (batch_chunks, chunked, lengths_of, refuse_chunked_dropout, rows_of,
                                            slopes_of)
from cute_flash.launch.block_sparse import block_lists
from cute_flash.launch.mods import ModArgs, aux_of, has_score_mod, mod_flags, refuse_chunked_mods
from cute_flash.launch.rng import DropoutArgs, rng_of
from cute_flash.launch.value_dim import padded_backward
from cute_flash.launch.varlen_order import key_blocks_longest_first
from layouts.hopper import choose_hopper_bwd_traits
from layouts.traits import choose_bwd_traits, tile_arch


def _config(d_pad, dtype, index, left, right, alibi_slopes, softcap, varlen, seqused_k, deterministic,
            dropout=None, mods: ModArgs | None = None):
    arch = gpu.device_arch(index)
    traits = choose_bwd_traits(d_pad, gpu.DTYPE_NAMES[dtype], tile_arch(arch))
    return BwdConfig(traits, **score_flags(left, right, alibi_slopes, softcap, dropout),
                     even_k=d_pad == traits.head_dim, varlen=varlen, has_seqused_k=seqused_k is not None,
                     deterministic=deterministic, **policy.dq_reduction(traits, arch, deterministic),
                     **dict(mod_flags(mods, backward=True)))


def _grid_x(config: BwdConfig, max_seqlen_k, batch, nheads, index):
    """Key blocks; deterministic: flash-attn 2's split count, enough CTAs to fill the GPU once."""
    n_blocks = -(-max_seqlen_k // config.traits.block_n)
    if not config.deterministic:
        return n_blocks
    return max(1, min(n_blocks, -(-gpu.num_sms(index) // (batch * nheads))))


def _finish(dq, dk, dv, d, nheads_k, grads, dot, d_v=None):
    """dQ and dK cut to d, dV to d_v (d unless given), dK/dV summed over each GQA group; written
    into the caller's tensors where given (`grads`: dq, dk, dv or None). Returns (dq, dk, dv,
    softmax_d), flash-attn's C++ backward's result."""
    dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d_v or d]
    nheads = dk.shape[-2]
    if nheads != nheads_k:
        g = nheads // nheads_k
        dk = dk.unflatten(-2, (nheads_k, g)).sum(-2)
        dv = dv.unflatten(-2, (nheads_k, g)).sum(-2)
    out = []
    for given, grad in zip(grads, (dq, dk, dv)):
        if given is None:
            out.append(grad)
        else:
            given.copy_(grad)
            out.append(given)
    return (*out, dot)


def _signed_dq(grads, dq_sign):
    """(dq, dk, dv, softmax_d) with dq times `positive_scale`'s dq_sign, in place (dq may be
    the caller's tensor): dk = dS^T q scale is the same for (-q, -scale) and dv has no q."""
    if dq_sign < 0:
        grads[0].neg_()
    elif dq_sign == 0:
        grads[0].zero_()
    return grads


def _zeros(q, k, v, dot_shape, grads):
    """An empty problem (no query rows or no keys): every gradient is zero."""
    zeros = [torch.zeros_like(x) if g is None else g.zero_() for g, x in zip(grads, (q, k, v))]
    return (*zeros, torch.zeros(dot_shape, dtype=torch.float32, device=q.device))


def varlen_dq_tiles(total_q: int, batch: int, block_m: int) -> int:
    """dQaccum tiles of a packed batch: sequence b's start at cu_seqlens_q[b] // block_m + b
    (`kernels/common/dq_accum.py:first_tile`), so no tile holds rows of two sequences; the last one
    ends by total_q // block_m + batch + 1."""
    return total_q // block_m + batch + 1


def _semaphores(config: Sm90BwdConfig, dq_accum: torch.Tensor):
    """Deterministic mode: one zeroed int32 count of dQ adds per dQaccum tile (the kernel's
    `DqTurn`s: key blocks add in a fixed order); None otherwise."""
    if not config.deterministic:
        return None
    return torch.zeros(dq_accum.shape[1:-1], dtype=torch.int32, device=dq_accum.device)


def _hopper_config(config: BwdConfig, hopper_variant, d_v: int, **fields) -> Sm90BwdConfig:
    """The Hopper backward's config of a call the dispatcher gave `config` (its score flags,
    deterministic mode, mods; the bucket's Hopper tiles, V's `d_v` wide), with `fields`, then the
    policy's dQ path (`policy.hopper_bwd_dq`) or, where the caller gives them, its
    `hopper_variant` fields instead."""
    traits = choose_hopper_bwd_traits(config.traits.head_dim, config.traits.dtype, d_v)
    sm90 = Sm90BwdConfig(traits, config.has_left, config.has_right, config.has_alibi, config.has_softcap,
                         config.has_dropout, deterministic=config.deterministic, mods=config.mods, **fields)
    if hopper_variant is None:
        return policy.with_hopper_bwd_dq(sm90)
    return replace(sm90, **hopper_variant)


def _flash_bwd_sm90(dout, q, k, v, out, lse, config: BwdConfig, index, softmax_scale, softcap, alibi_slopes, left,
                    right, grads, d, d_v, dropout, mods: ModArgs | None = None, block_mask=None,
                    hopper_variant=None):
    """The Hopper backward on aligned tensors (v, out and dout d_v wide before alignment: MLA's
    at that width, `policy.takes_hopper_bwd_value_dim`). LSE (times log2 e) and D go in rows
    padded to whole query blocks, +inf and 0 past seqlen_q (the preprocess writes them there,
    `PreprocessConfig.hopper_rows`), so the kernel's bulk copies of a block's values need no
    bounds and its rows past the sequence get P = 0. A block mask's lists (by key block) skip
    the query blocks it leaves empty, except in deterministic mode, whose dQ turns count every
    key block of a query block."""
    b, sq, h, d_pad = q.shape
    sk, hk, dv_pad = k.shape[1], k.shape[2], v.shape[-1]
    sparse = block_mask is not None and not config.deterministic
    sm90 = _hopper_config(config, hopper_variant, dv_pad, block_sparse=sparse)
    t = sm90.traits
    even_k = d_pad == t.head_dim  # 96, 160, 224 run on the d 128 / 192 / 256 tiles
    sq_pad = -(-sq // t.block_m) * t.block_m
    lse_log2, dot_pad = (torch.empty((b, h, sq_pad), dtype=torch.float32, device=q.device) for _ in range(2))
    dot = dot_pad[..., :sq]
    compiled.kernel_for(PreprocessConfig(t.dv, t.dtype, dv_pad == t.dv, hopper_rows=t.block_m), index)(
        out, dout, dot, lse, lse_log2, dot_pad)
    dq_accum = torch.zeros((1, b, h, sq_pad // t.block_m, t.block_m * t.head_dim), dtype=torch.float32,
                           device=q.device)
    dk_h = torch.empty((b, sk, h, d_pad), dtype=q.dtype, device=q.device)
    dv_h = torch.empty((b, sk, h, dv_pad), dtype=q.dtype, device=q.device)
    lists = block_lists(block_mask, b, h, sq, sk, t.block_m, t.block_n, by_key=True) if sparse else None
    compiled.kernel_for(sm90, index)(q, k, v, dout, lse_log2, dot_pad, dq_accum, dk_h, dv_h,
                                     alibi_2d(alibi_slopes, b, h), rng_of(dropout, q.device),
                                     _semaphores(sm90, dq_accum), aux_of(mods), lists, softmax_scale,
                                     *scales(softmax_scale, softcap, has_score_mod(mods)), left, right)
    dq_out = torch.empty((b, sq, h, d_pad), dtype=q.dtype, device=q.device)
    compiled.kernel_for(DQConvertConfig.of_hopper(t, even_k, False), index)(
        dq_accum, dq_out, softmax_scale)
    return _finish(dq_out, dk_h, dv_h, d, hk, grads, dot, d_v)


def _flash_bwd_sm90_varlen(dout, q, k, v, out, lse, config: BwdConfig, index, cu_seqlens_q, cu_seqlens_k, seqused_k,
                           max_seqlen_q, softmax_scale, softcap, alibi_slopes, left, right, grads, d, d_v,
                           dropout, mods: ModArgs | None = None, hopper_variant=None):
    """The Hopper backward of a packed batch on aligned tensors: LSE (times log2 e), D and
    dQaccum in rows padded per sequence to whole query blocks (sequence b's from tile
    cu_seqlens_q[b] // block_m + b; +inf, 0 and 0 past each sequence: the preprocess writes LSE
    and D there, `PreprocessConfig.hopper_rows`), so the kernel's bulk copies need no bounds,
    as in the dense call; its CTAs take the key blocks longest first (`varlen_order`)."""
    total_q, h, d_pad = q.shape
    total_k, hk, dv_pad = k.shape[0], k.shape[1], v.shape[-1]
    batch = cu_seqlens_q.shape[0] - 1
    sm90 = _hopper_config(config, hopper_variant, dv_pad, varlen=True, has_seqused_k=seqused_k is not None)
    t = sm90.traits
    even_k = d_pad == t.head_dim  # 96, 160, 224 run on the d 128 / 192 / 256 tiles
    tiles = varlen_dq_tiles(total_q, batch, t.block_m)
    dot = torch.empty((h, total_q), dtype=torch.float32, device=q.device)
    # rows between the sequences' padded runs and in the last tile: never read
    lse_log2, dot_pad = (torch.empty((h, tiles * t.block_m), dtype=torch.float32, device=q.device) for _ in range(2))
    compiled.kernel_for(PreprocessConfig(t.dv, t.dtype, dv_pad == t.dv, True, hopper_rows=t.block_m), index)(
        out, dout, dot, cu_seqlens_q, max_seqlen_q, lse, lse_log2, dot_pad)
    dq_accum = torch.zeros((1, h, tiles, t.block_m * t.head_dim), dtype=torch.float32, device=q.device)
    dk_h = torch.zeros((total_k, h, d_pad), dtype=q.dtype, device=q.device)  # keys no sequence covers (or past
    dv_h = torch.zeros((total_k, h, dv_pad), dtype=q.dtype, device=q.device)  # seqused_k) get a zero gradient
    compiled.kernel_for(sm90, index)(q, k, v, dout, lse_log2, dot_pad, dq_accum, dk_h, dv_h,
                                     alibi_2d(alibi_slopes, batch, h), rng_of(dropout, q.device),
                                     _semaphores(sm90, dq_accum), aux_of(mods), cu_seqlens_q, cu_seqlens_k, seqused_k,
                                     key_blocks_longest_first(cu_seqlens_q, cu_seqlens_k, total_k, t.block_m,
                                                              t.block_n, right, policy.packed_bwd_by_sequence(sm90)),
                                     softmax_scale,
                                     *scales(softmax_scale, softcap, has_score_mod(mods)), left, right)
    dq_out = torch.zeros((total_q, h, d_pad), dtype=q.dtype, device=q.device)  # rows no sequence covers: 0
    compiled.kernel_for(DQConvertConfig.of_hopper(t, even_k, True), index)(
        dq_accum, dq_out, cu_seqlens_q, max_seqlen_q, softmax_scale)
    return _finish(dq_out, dk_h, dv_h, d, hk, grads, dot, d_v)


def flash_bwd(dout, q, k, v, out, lse, *, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None, variant=None,
              dropout: DropoutArgs | None = None, mods=None, block_mask=None, hopper_variant=None):
    """Gradients of the dense forward: q/dout/out (b, sq, h, d), k/v (b, sk, hk, d), lse
    (b, h, sq) from the forward; returns (dq, dk, dv, softmax_d), the gradients written into
    dq/dk/dv when given; softmax_d (b, h, sq) fp32 is D = rowsum(dO * O). `variant`: BwdConfig
    fields replacing the dispatcher's choice (traits, dq_bulk: `python -m cute_flash tune --bwd`);
    `hopper_variant`: Sm90BwdConfig fields replacing the Hopper kernel's (the bucket's tiles and
    "bulk" dQ path, not the policy's), on a call it takes (`python -m cute_flash tune --bwd-dq`).
    `dropout`: the forward's (the same seed and offset recompute its mask); `mods`: the forward's
    Python-written mods with the score_mod's backward (`ModArgs.of`); `block_mask`: the forward's
    FlexAttention BlockMask of the mask_mod, whose empty blocks either kernel skips (the Hopper
    one not in deterministic mode)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    mods = ModArgs.of(mods)
    if b == 0 or sq == 0 or sk == 0:
        return _zeros(q, k, v, (b, h, sq), (dq, dk, dv))
    d_v = v.shape[-1]
    if d_v != d and not (variant is None and policy.takes_hopper_bwd_value_dim(d, d_v, gpu.device_index(q.device))):
        return padded_backward(functools.partial(  # v's head dim of its own, on a kernel that takes one
            flash_bwd, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, deterministic=deterministic, variant=variant, dropout=dropout, mods=mods,
            block_mask=block_mask, hopper_variant=hopper_variant), dout, q, k, v, out, lse, dq, dk, dv)
    if chunked(b):  # launch/batch_chunks.py: each chunk writes its rows of the gradients
        refuse_chunked_dropout(dropout, b)
        refuse_chunked_mods(mods, b)
        dq, dk, dv = (torch.empty_like(x) if g is None else g for g, x in zip((dq, dk, dv), (q, k, v)))
        dot = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
        for s in batch_chunks(b):
            dot[s] = flash_bwd(dout[s], q[s], k[s], v[s], out[s], lse[s], softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap, alibi_slopes=slopes_of(alibi_slopes, s),
                               deterministic=deterministic, dq=dq[s], dk=dk[s], dv=dv[s], variant=variant,
                               hopper_variant=hopper_variant)[3]
        return dq, dk, dv, dot
    q, softmax_scale, dq_sign = positive_scale(q, softmax_scale)
    q, k, v, out, dout = (aligned(x) for x in (q, k, v, out, dout))
    lse = lse.contiguous()  # a caller's view (ring-flash-attn's is transposed): the kernels read it dense
    d_pad = q.shape[-1]
    index = gpu.device_index(q.device)
    left, right = window_edges(causal, window_size)
    config = _config(d_pad, q.dtype, index, left, right, alibi_slopes, softcap, False, None, deterministic,
                     dropout, mods)
    if variant is None and policy.takes_hopper_bwd(config, index):
        return _signed_dq(_flash_bwd_sm90(dout, q, k, v, out, lse, config, index, softmax_scale, softcap,
                                          alibi_slopes, left, right, (dq, dk, dv), d, d_v, dropout, mods, block_mask,
                                          hopper_variant),
                          dq_sign)
    config = replace(config, **(variant or {}), block_sparse=block_mask is not None)
    lists = None
    if block_mask is not None:  # the lists by key block at the SM80 tiles
        lists = block_lists(block_mask, b, h, sq, sk, config.traits.block_m, config.traits.block_n, by_key=True)
    dot = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    compiled.kernel_for(PreprocessConfig(config.traits.head_dim, config.traits.dtype, config.even_k),
                            index)(out, dout, dot, None, None, None)
    grid_x = _grid_x(config, sk, b, h, index)
    t = config.traits
    dq_accum = torch.zeros((grid_x if deterministic else 1, b, h, -(-sq // t.block_m), t.block_m * t.head_dim),
                           dtype=torch.float32, device=q.device)
    dk_h = torch.empty((b, sk, h, d_pad), dtype=q.dtype, device=q.device)
    dv_h = torch.empty((b, sk, h, d_pad), dtype=q.dtype, device=q.device)
    compiled.kernel_for(config, index)(
        q, k, v, dout, lse, dot, dq_accum, dk_h, dv_h, alibi_2d(alibi_slopes, b, h), rng_of(dropout, q.device),
        aux_of(mods), lists, softmax_scale, *scales(softmax_scale, softcap, has_score_mod(mods)), left, right, grid_x)
    dq_out = torch.empty((b, sq, h, d_pad), dtype=q.dtype, device=q.device)
    compiled.kernel_for(DQConvertConfig(t, config.even_k, False, config.dq_vec), index)(
        dq_accum, dq_out, softmax_scale)
    return _signed_dq(_finish(dq_out, dk_h, dv_h, d, hk, (dq, dk, dv), dot), dq_sign)


def flash_bwd_varlen(dout, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     seqused_k=None, deterministic=False, dq=None, dk=None, dv=None,
                     dropout: DropoutArgs | None = None, mods=None, hopper_variant=None):
    """Gradients of the packed forward: q/dout/out (total_q, h, d), k/v (total_k, hk, d), lse
    (h, total_q); returns (dq, dk, dv, softmax_d (h, total_q)). `dropout`, `mods`: the forward's;
    `hopper_variant` as `flash_bwd`'s."""
    total_q, h, d = q.shape
    total_k, hk = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    if batch == 0 or total_q == 0 or total_k == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return _zeros(q, k, v, (h, total_q), (dq, dk, dv))  # the forward computed nothing either
    d_v = v.shape[-1]
    if d_v != d and (chunked(batch) or not policy.takes_hopper_bwd_value_dim(d, d_v, gpu.device_index(q.device))):
        return padded_backward(functools.partial(  # v's head dim of its own, on a kernel that takes one
            flash_bwd_varlen, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, seqused_k=seqused_k, deterministic=deterministic,
            dropout=dropout, mods=mods, hopper_variant=hopper_variant), dout, q, k, v, out, lse, dq, dk, dv)
    refuse_chunked_dropout(dropout, batch)
    mods = ModArgs.of(mods)
    refuse_chunked_mods(mods, batch)
    q, softmax_scale, dq_sign = positive_scale(q, softmax_scale)
    q, k, v, out, dout = (aligned(x) for x in (q, k, v, out, dout))
    lse = lse.contiguous()  # a caller's view (ring-flash-attn's is transposed): the kernels read it dense
    d_pad = q.shape[-1]
    index = gpu.device_index(q.device)
    left, right = window_edges(causal, window_size)
    config = _config(d_pad, q.dtype, index, left, right, alibi_slopes, softcap, True, seqused_k, deterministic,
                     dropout, mods)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused = None if seqused_k is None else seqused_k.contiguous()
    if policy.takes_hopper_bwd(config, index) and not chunked(batch):
        return _signed_dq(_flash_bwd_sm90_varlen(dout, q, k, v, out, lse, config, index, cu_seqlens_q, cu_seqlens_k,
                                                 seqused, max_seqlen_q, softmax_scale, softcap,
                                                 alibi_slopes, left, right, (dq, dk, dv), d, d_v, dropout, mods,
                                                 hopper_variant),
                          dq_sign)
    grid_x = _grid_x(config, max_seqlen_k, batch, h, index)
    t = config.traits
    dot = torch.empty((h, total_q), dtype=torch.float32, device=q.device)
    dq_accum = torch.zeros((grid_x if deterministic else 1, h, varlen_dq_tiles(total_q, batch, t.block_m),
                            t.block_m * t.head_dim), dtype=torch.float32, device=q.device)
    dk_h = torch.zeros((total_k, h, d_pad), dtype=q.dtype, device=q.device)  # keys no sequence covers (or past
    dv_h = torch.zeros((total_k, h, d_pad), dtype=q.dtype, device=q.device)  # seqused_k) get a zero gradient
    dq_out = torch.zeros((total_q, h, d_pad), dtype=q.dtype, device=q.device)  # rows no sequence covers: 0
    alibi, rng = alibi_2d(alibi_slopes, batch, h), rng_of(dropout, q.device)
    for i, s in enumerate(batch_chunks(batch)):  # one unless past GRID_MAX_BATCH sequences (launch/batch_chunks.py)
        cu_q, cu_k = lengths_of(cu_seqlens_q, s), lengths_of(cu_seqlens_k, s)
        if i:
            dq_accum.zero_()  # a chunk's row blocks count from its own first sequence: they overlap the last's
        compiled.kernel_for(PreprocessConfig(t.head_dim, t.dtype, config.even_k, True), index)(
            out, dout, dot, cu_q, max_seqlen_q, None, None, None)
        compiled.kernel_for(config, index)(
            q, k, v, dout, lse, dot, dq_accum, dk_h, dv_h, rows_of(alibi, s), rng, aux_of(mods), cu_q, cu_k,
            rows_of(seqused, s), softmax_scale, *scales(softmax_scale, softcap, has_score_mod(mods)), left, right,
            grid_x)
        compiled.kernel_for(DQConvertConfig(t, config.even_k, True, config.dq_vec), index)(
            dq_accum, dq_out, cu_q, max_seqlen_q, softmax_scale)
    return _signed_dq(_finish(dq_out, dk_h, dv_h, d, hk, (dq, dk, dv), dot), dq_sign)
