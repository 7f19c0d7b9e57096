"""The Hopper forward (kernels/sm90/fwd.py) on validated CUDA tensors; when to take it and
its schedule are `policy`'s rules.

The default on sm_90 GPUs (`policy.takes_hopper_path`) for dense forwards, for packed batches
over contiguous keys or pages of a multiple of its key block (`flash_fwd_varlen_sm90`,
`policy.hopper_pages_fit`) and for KV caches without cache_batch_idx or cache_leftpad, in one row a
sequence or in pages of a multiple of its key block (launched by `kvcache.py` through the SM80
KV-cache kernel's parameters, split-KV included). It leads the SM80 kernel on the forward
grid, the packed batch of the varlen bench and the large decode cells (docs/tuning/hopper-forward.md).
`CUTE_FLASH_ARCH_PATH=sm80` selects the SM80 kernel instead; smaller pages take it too, and
docs/tuning/hopper-forward.md lists these fall backs and why.
"""
from __future__ import annotations

import torch

from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
from cute_flash.launch import compiled, gpu
from cute_flash.launch.align import aligned
from cute_flash.launch.args import alibi_2d, scales, score_flags, sink_logits, window_edges
from cute_flash.launch.per_stream import per_stream, zeroed_counters
from cute_flash.launch.block_sparse import block_lists
from cute_flash.launch.mods import ModArgs, aux_of, has_score_mod, mod_flags
from cute_flash.launch.rng import DropoutArgs, rng_of
from cute_flash.launch.value_dim import value_cols
from cute_flash.launch.varlen_order import query_blocks_longest_first
from cute_flash.launch.policy import (kv_multicast_fits, kv_stages, prefers_persistent, schedules_as_masked,
                                      section_heads, speculates_in_place, takes_kv_multicast, takes_packed_persistent,
                                      takes_speculative_max, takes_tall_tiles, takes_value_dim_wide_keys)
from layouts.hopper import choose_hopper_traits


@per_stream
def tile_counter(device: torch.device) -> torch.Tensor:
    """The persistent kernel's (2,) int32 tile counter, zero between launches (the kernel leaves
    it so); kept per (device, stream)."""
    return zeroed_counters((2,), device)


def flash_fwd_sm90(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   dropout: DropoutArgs | None = None, traits=None, persistent=None, sections=None,
                   speculative_max=None, speculative_in_place=None, stages=None, kv_multicast=None,
                   mods: ModArgs | None = None, block_mask=None, learnable_sink=None):
    """Dense forward on the Hopper kernel: q / k (b, sq / sk, h / hk, d), v (b, sk, hk, d_v);
    returns (out (b, sq, h, d_v), lse (b, h, sq)) as `flash_fwd` does. `traits`
    (HopperTileTraits), `persistent`, `sections` (pairs per scheduling section),
    `speculative_max`, `speculative_in_place` and `stages` (K / V pipeline depth) override the
    kernel's choices (`tune --sm90`); `kv_multicast` (sharing each K / V block between a
    cluster's two tiles) too, where `kv_multicast_fits`. `mods`: the call's Python-written mods
    (no speculative maxima with a score_mod); `block_mask`: a FlexAttention BlockMask of the
    mask_mod, whose empty blocks are skipped (`launch/block_sparse.py`); `learnable_sink` (h,):
    a logit per head in each row's denominator, folded in by the epilogue
    (`Sm90FwdConfig.learnable_sink`)."""
    b, sq, h, _ = q.shape
    d_v = v.shape[-1]
    q, k, v = aligned(q), aligned(k), aligned(v)
    out = torch.empty((b, sq, h, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    left, right = window_edges(causal, window_size)
    masked = left >= 0 or right >= 0  # a causal or local mask
    uneven = schedules_as_masked(masked, block_mask is not None)
    traits = traits or choose_hopper_traits(q.shape[-1], gpu.DTYPE_NAMES[q.dtype],
                                            takes_tall_tiles(k.shape[1], uneven, dropout, mods and mods.mods),
                                            own_value_dim(q, v), takes_value_dim_wide_keys(uneven, dropout, mods))
    if persistent is None:
        persistent = prefers_persistent(traits, k.shape[1], uneven)
    if speculative_max is None:
        speculative_max = (mods is None or mods.mods.score_mod is None) and takes_speculative_max(
            traits, k.shape[1], left >= 0, right >= 0, dropout, alibi_slopes is not None)
    if speculative_in_place is None:
        speculative_in_place = speculative_max and speculates_in_place(traits)
    if stages is None:
        stages = kv_stages(traits, k.shape[1], persistent)
    if kv_multicast is None:
        kv_multicast = block_mask is None and takes_kv_multicast(traits, sq, k.shape[1], masked, persistent, dropout)
    elif kv_multicast and not kv_multicast_fits(traits, sq, masked, persistent):
        raise ValueError("kv_multicast pairs one head's query blocks: the persistent schedule, no causal / local "
                         "mask, an even number of query blocks")
    config = Sm90FwdConfig(traits, stages, persistent=persistent, speculative_max=speculative_max,
                           speculative_in_place=speculative_in_place, kv_multicast=kv_multicast,
                           block_sparse=block_mask is not None, learnable_sink=learnable_sink is not None,
                           **score_flags(left, right, alibi_slopes, softcap, dropout), **dict(mod_flags(mods)))
    sparse = None if block_mask is None else block_lists(block_mask, b, h, sq, k.shape[1], traits.block_m,
                                                         traits.block_n)
    index = gpu.device_index(q.device)
    num_sms = gpu.num_sms(index)
    if sections is None:
        sections = section_heads(q, k, persistent and uneven, traits.block_m, num_sms)
    compiled.kernel_for(config, index)(q, k, v, out, lse, alibi_2d(alibi_slopes, b, h), sink_logits(learnable_sink),
                                       rng_of(dropout, q.device), aux_of(mods), sparse, tile_counter(q.device),
                                       *scales(softmax_scale, softcap, has_score_mod(mods)), left, right,
                                       sections, num_sms)
    return value_cols(out, d_v), lse


def flash_fwd_varlen_sm90(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, seqused_k=None, block_table=None,
                          dropout: DropoutArgs | None = None, mods: ModArgs | None = None, learnable_sink=None,
                          persistent=None):
    """Packed batches on the Hopper kernel: q (total_q, h, d), k (total_k, hk, d) and v (..,
    d_v), or pages (num_pages, page_size, hk, d / d_v) through block_table (`hopper_pages_fit`),
    int32 prefix sums, seqused_k (batch,) int32 key lengths or None; returns (out (total_q, h,
    d_v), lse (h, total_q)) as `flash_fwd_varlen` does; `learnable_sink` as `flash_fwd_sm90`'s.
    The tiles with the most key blocks first (`varlen_order`), 128-row tiles at every d (192-row
    ones ran at half speed with one CTA per tile); `persistent` (None: the policy's,
    `takes_packed_persistent`): one CTA an SM claiming the tiles in that order, else one CTA
    per tile."""
    total_q, h, _ = q.shape
    d_v = v.shape[-1]
    q, k, v = aligned(q), aligned(k), aligned(v)
    out = torch.empty((total_q, h, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((h, total_q), dtype=torch.float32, device=q.device)
    left, right = window_edges(causal, window_size)
    traits = choose_hopper_traits(q.shape[-1], gpu.DTYPE_NAMES[q.dtype], head_dim_v=own_value_dim(q, v))
    if persistent is None:
        persistent = takes_packed_persistent(traits)
    config = Sm90FwdConfig(traits, varlen=True, persistent=persistent,
                           has_seqused_k=seqused_k is not None, paged=block_table is not None,
                           learnable_sink=learnable_sink is not None,
                           **score_flags(left, right, alibi_slopes, softcap, dropout), **dict(mod_flags(mods)))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused = None if seqused_k is None else seqused_k.contiguous()
    index = gpu.device_index(q.device)
    compiled.kernel_for(config, index)(
        q, k, v, out, lse, alibi_2d(alibi_slopes, cu_seqlens_q.shape[0] - 1, h), sink_logits(learnable_sink),
        rng_of(dropout, q.device), aux_of(mods), cu_seqlens_q, cu_seqlens_k, seqused, block_table,
        query_blocks_longest_first(cu_seqlens_q, cu_seqlens_k, total_q, traits.block_m, traits.block_n, right),
        tile_counter(q.device) if persistent else None, gpu.num_sms(index),
        *scales(softmax_scale, softcap, has_score_mod(mods)), left, right)
    return value_cols(out, d_v), lse


def own_value_dim(q, v) -> int | None:
    """V's head dim where it is not q's (aligned tensors), else None: the traits' head_dim_v."""
    return None if v.shape[-1] == q.shape[-1] else v.shape[-1]
