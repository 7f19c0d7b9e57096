"""The Hopper forward (kernels/fwd_sm90.py) on validated CUDA tensors, and when to take it.

The default on sm_90 GPUs (`dense.takes_hopper_path`) for dense forwards, for packed batches
over contiguous keys or pages of a multiple of its key block (`flash_fwd_varlen_sm90`,
`hopper_pages_fit`) and for KV caches without cache_batch_idx or cache_leftpad, in one row a
sequence or in pages of a multiple of its key block (launched by `kvcache.py` through the SM80
KV-cache kernel's parameters, split-KV included). It leads the SM80 kernel on the forward
grid, the packed batch of the varlen bench and the large decode cells (docs/perf.md).
`CUTE_FLASH_ARCH_PATH=sm80` selects the SM80 kernel instead; smaller pages take it too, and
docs/perf.md lists these fall backs and why.
"""
from __future__ import annotations

import torch

from cute_flash.dropout import DropoutArgs, rng_of
from cute_flash.kernels.fwd_sm90 import Sm90FwdConfig
from cute_flash.launch import compiled
from cute_flash.launch.align import aligned
from cute_flash.launch.dense import alibi_2d, device_index, scales, score_flags, window_edges
from cute_flash.launch.per_stream import per_stream, zeroed_counters
from layouts.hopper import TALL_D64_MIN_SEQLEN_K, TALL_D64_UNMASKED_MIN_SEQLEN_K, choose_hopper_traits


PERSISTENT_MAX_KEY_BLOCKS = 64
L2_SECTION_BYTES = 32 << 20  # K / V bytes a scheduling section's heads may span: ~2/3 of the H200's 50 MB L2
ONE_WAVE_MAX_M_BLOCKS = 8  # up to this many query blocks a pair, a section is one wave's pairs (section_heads)


def prefers_persistent(traits, seqlen_k: int, masked: bool) -> bool:
    """The persistent kernel (one CTA per SM, tiles claimed from a counter) where it measured
    faster than one CTA per tile (H200, bf16, TFLOP/s, docs/perf.md): always without a causal
    / local mask (d 128 512 / 2k / 16k: 446 / 564 / 613 against 409 / 546 / 610); under one, up
    to 64 key blocks per tile (since Q is released early, d 128 causal 4k / 8k: 585 / 616
    against 547 / 596), not beyond (16k: 633 against 635); 192-row tiles always (d 64 512: 317
    against 138)."""
    if not Sm90FwdConfig.fits_persistent(traits):
        return False
    return (traits.warpgroups == 3 or not masked
            or -(-seqlen_k // traits.block_n) <= PERSISTENT_MAX_KEY_BLOCKS)


# Three K / V stages up to this many keys (8 key blocks a tile): a third block in flight, likely
# the next tile's first while this one's last ones and its epilogue run (not profiled)
DEEP_PIPELINE_MAX_SEQLEN_K = 1024
DEEP_PIPELINE_MAX_HEAD_DIM = 96  # measured at 32 / 64 / 96; d 128's do not fit beside O's tile


def kv_stages(traits, seqlen_k: int, persistent: bool) -> int:
    """K / V pipeline depth: 3 stages for the persistent kernel's 128-row tiles up to
    DEEP_PIPELINE_MAX_SEQLEN_K keys at d <= DEEP_PIPELINE_MAX_HEAD_DIM (192 KB of shared memory
    at d 96), 2 otherwise. H200, time with 2 stages over time with 3, best of 3 (docs/perf.md,
    Hopper step 18): d 64 non-causal 512 1.022-1.028, causal 512 1.025, causal 1k 1.027-1.033;
    d 32 512 1.008, causal 1k 1.019; d 96 512 1.026, causal 1k 1.009; but at 4k-8k keys
    0.974-1.001 (d 32 and 96), and on 192-row tiles 0.986-1.031."""
    deep = (seqlen_k <= DEEP_PIPELINE_MAX_SEQLEN_K and persistent and traits.warpgroups == 2
            and traits.head_dim <= DEEP_PIPELINE_MAX_HEAD_DIM)
    return 3 if deep else 2


def takes_tall_tiles(seqlen_k: int, masked: bool, dropout) -> bool:
    """d 64's 192-row tiles (`choose_hopper_traits`' long_keys): from 2048 keys under a causal
    / local mask, from 1024 without one (1k: 417-420 TFLOP/s against 395-404 non-causal, 288
    against 325 causal; H200, docs/perf.md); never with dropout (three consumer warpgroups
    leave a thread 160 registers, and ptxas spilled 150-640 B)."""
    return dropout is None and seqlen_k >= (TALL_D64_MIN_SEQLEN_K if masked else TALL_D64_UNMASKED_MIN_SEQLEN_K)


# Under a causal / local mask speculative maxima start from this many keys: below it a tile's
# second key block, where the diagonal block's few keys leave a low kept maximum in some rows,
# is a large share of its blocks, and those fall back (H200, d 128 causal 512: 0.975x).
SPECULATIVE_MASKED_MIN_SEQLEN_K = 1024
# ... from this many at d 64 and below, where the softmax is a larger share of a block's work
# (H200, causal 512, beside / update: d 32 1.014-1.020, d 64 1.008-1.015; 768: 1.033-1.038)
SPECULATIVE_MASKED_MIN_SEQLEN_K_D64 = 512
# ... and on 192-row tiles, where P goes over S (`speculates_in_place`) and a warpgroup's vote
# fails where any of its warps' would, from this many under a window's left edge, whose blocks
# speculate too (H200, d 64 causal when every block speculated, in place / update: 2k
# 0.954-0.968, 4k 0.982-0.991, 8k 1.000-1.035, 16k 1.031-1.032). Under a causal mask the
# diagonal's blocks take `update` (`FlashFwdSm90.scores`) and the rest speculate at any length.
SPECULATIVE_IN_PLACE_LEFT_EDGE_MIN_SEQLEN_K = 8192


def takes_speculative_max(traits, seqlen_k: int, has_left: bool, has_right: bool, dropout, alibi: bool) -> bool:
    """P from the kept row maxima first (`OnlineSoftmax.update_speculative`), not with dropout
    (its calls need the registers) nor with ALiBi where P goes over S (ptxas 13.0 spilled
    236-1132 B there, up to 538 spill instructions in the key-block loop, against 136-380 B
    without speculation), and under a mask from SPECULATIVE_MASKED_MIN_SEQLEN_K keys (the _D64
    edge at d 64 and below; where P goes over S, any length under a causal mask, and
    SPECULATIVE_IN_PLACE_LEFT_EDGE_MIN_SEQLEN_K under a window's left edge).
    H200, against `update`, best of 3: d 128 non-causal 8k / 16k 1.069 / 1.070, causal 4k /
    16k 1.039 / 1.055, d 64 512 1.037, causal 1k 1.037 (P beside S); d 64's 192-row tiles
    non-causal 1k / 2k / 8k / 16k 1.011-1.025 / 1.022-1.028 / 1.029-1.040 / 1.036-1.047, causal
    (diagonal blocks eager) 2k / 4k / 8k / 16k 1.017-1.019 / 1.028-1.031 / 1.035-1.045 /
    1.044-1.060 (P over S; docs/perf.md, Hopper steps 16-18)."""
    in_place = speculates_in_place(traits)
    if in_place:
        min_masked = SPECULATIVE_IN_PLACE_LEFT_EDGE_MIN_SEQLEN_K if has_left else 0
    elif traits.head_dim <= 64:
        min_masked = SPECULATIVE_MASKED_MIN_SEQLEN_K_D64
    else:
        min_masked = SPECULATIVE_MASKED_MIN_SEQLEN_K
    masked = has_left or has_right
    return dropout is None and not (alibi and in_place) and (not masked or seqlen_k >= min_masked)


def speculates_in_place(traits) -> bool:
    """Speculative P over S (`Sm90FwdConfig.speculative_in_place`: a failed vote issues the
    warpgroup's Q K^T again) rather than beside it in 64 more registers a thread: on 192-row
    tiles, whose 160 registers a thread have no room for them (ptxas 13.0: 1016 B of spills).
    128-row tiles keep P beside S: in place measured 0.966-1.000x of it at d 128 (4k-16k, causal
    1k-16k) and 0.71x at d 64 non-causal 512 (H200, docs/perf.md, Hopper step 17)."""
    return traits.warpgroups == 3


# K / V multicast from this many keys, at d 128 (`takes_kv_multicast`)
KV_MULTICAST_MIN_SEQLEN_K = 2048
KV_MULTICAST_HEAD_DIM = 128


def kv_multicast_fits(traits, seqlen_q: int, masked: bool, persistent: bool) -> bool:
    """Where `Sm90FwdConfig.kv_multicast` can pair tiles: the persistent schedule without a
    causal / local mask (every tile of a head sees the same key blocks) and an even number of
    query blocks a head, so that tiles 2c and 2c + 1, a cluster's, are one head's."""
    return persistent and not masked and -(-seqlen_q // traits.block_m) % 2 == 0


def takes_kv_multicast(traits, seqlen_q: int, seqlen_k: int, masked: bool, persistent: bool, dropout) -> bool:
    """K / V multicast by default where it fits, at d 128 from KV_MULTICAST_MIN_SEQLEN_K keys,
    without dropout (not measured with it). H200, d 128 non-causal, against the same kernel
    unicast, best of 3: 1k 1.004, 2k 1.025, 4k 1.022, 8k 1.041, 16k 1.016; 16k held for 3.5 s
    679 -> 699 TFLOP/s at the same 689-690 W (the clock 1584-1591 -> 1625-1626 MHz: half the
    K / V bytes from L2 a tile); d 64 0.962-0.995, so not there (docs/perf.md, Hopper step 20)."""
    return (traits.head_dim == KV_MULTICAST_HEAD_DIM and seqlen_k >= KV_MULTICAST_MIN_SEQLEN_K
            and dropout is None and kv_multicast_fits(traits, seqlen_q, masked, persistent))


def section_heads(q, k, longest_first: bool, block_m: int, num_sms: int) -> int:
    """(batch, head) pairs per scheduling section (`FlashFwdSm90.tile`). longest_first (the
    persistent kernel under a causal or local mask): tiles go longest first across a section's
    pairs. Over many pairs of at most ONE_WAVE_MAX_M_BLOCKS query blocks, a pair's tiles land
    in different waves, so a section is the pairs whose tiles fill one wave (a K / V head read
    by all its tiles while in L2); a longer pair has tiles in flight together, and a section is
    as many pairs as keep the K / V read within L2_SECTION_BYTES (a K / V head shared by a
    group of query heads counting once). H200 causal, TFLOP/s, 32 MB sections against 32 / 16
    pairs (one wave: 33 / 16): d 64 512 260-262 / 265-267, 1k 342-348 / 350-354; d 128 512
    333-336 / 353-355, 1k 441-460 / 460-464; smaller sections lost from 16 blocks (d 128 4k: 16
    pairs (32 MB) 602-624, 8 pairs 597-603, 2 pairs 573-600; docs/perf.md, Hopper step 22).
    Otherwise a section is one pair: its tiles are equal, or the hardware hands out one CTA per
    tile in order, which balances them itself (one CTA per tile, d 128 causal 512 / 2k / 16k:
    242 / 416 / 565 TFLOP/s in per-pair order, 236 / 437 / 560 longest first)."""
    if not longest_first:
        return 1
    pairs = q.shape[0] * q.shape[2]  # the cap keeps section_heads * query blocks within int32
    m_blocks = -(-q.shape[1] // block_m)
    if m_blocks <= ONE_WAVE_MAX_M_BLOCKS:
        return min(pairs, max(1, num_sms // m_blocks))
    kv_head_bytes = 2 * k.shape[1] * k.shape[3] * k.element_size()
    return min(pairs, max(1, L2_SECTION_BYTES // kv_head_bytes) * (q.shape[2] // k.shape[2]))


@per_stream
def tile_counter(device: torch.device) -> torch.Tensor:
    """The persistent kernel's (2,) int32 tile counter, zero between launches (the kernel leaves
    it so); kept per (device, stream)."""
    return zeroed_counters((2,), device)


def flash_fwd_sm90(q, k, v, *, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   dropout: DropoutArgs | None = None, traits=None, persistent=None, sections=None,
                   speculative_max=None, speculative_in_place=None, stages=None, kv_multicast=None):
    """Dense forward on the Hopper kernel: q (b, sq, h, d), k/v (b, sk, hk, d); returns (out,
    lse (b, h, sq)) as `flash_fwd` does. `traits` (HopperTileTraits), `persistent`,
    `sections` (pairs per scheduling section), `speculative_max`, `speculative_in_place` and
    `stages` (K / V pipeline depth) override the kernel's choices (`tune --sm90`);
    `kv_multicast` (sharing each K / V block between a cluster's two tiles) too, where
    `kv_multicast_fits`."""
    b, sq, h, d = q.shape
    q, k, v = aligned(q), aligned(k), aligned(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    left, right = window_edges(causal, window_size)
    masked = left >= 0 or right >= 0  # a causal or local mask
    traits = traits or choose_hopper_traits(q.shape[-1], compiled.DTYPE_NAMES[q.dtype],
                                            takes_tall_tiles(k.shape[1], masked, dropout))
    if persistent is None:
        persistent = prefers_persistent(traits, k.shape[1], masked)
    if speculative_max is None:
        speculative_max = takes_speculative_max(traits, k.shape[1], left >= 0, right >= 0, dropout,
                                                alibi_slopes is not None)
    if speculative_in_place is None:
        speculative_in_place = speculative_max and speculates_in_place(traits)
    if stages is None:
        stages = kv_stages(traits, k.shape[1], persistent)
    if kv_multicast is None:
        kv_multicast = takes_kv_multicast(traits, sq, k.shape[1], masked, persistent, dropout)
    elif kv_multicast and not kv_multicast_fits(traits, sq, masked, persistent):
        raise ValueError("kv_multicast pairs one head's query blocks: the persistent schedule, no causal / local "
                         "mask, an even number of query blocks")
    config = Sm90FwdConfig(traits, stages, persistent=persistent, speculative_max=speculative_max,
                           speculative_in_place=speculative_in_place, kv_multicast=kv_multicast,
                           **score_flags(left, right, alibi_slopes, softcap, dropout))
    num_sms = compiled.num_sms(device_index(q.device))
    if sections is None:
        sections = section_heads(q, k, persistent and masked, traits.block_m, num_sms)
    compiled.sm90_kernel_for(config)(q, k, v, out, lse, alibi_2d(alibi_slopes, b, h), rng_of(dropout, q.device),
                                     tile_counter(q.device), *scales(softmax_scale, softcap), left, right,
                                     sections, num_sms)
    return (out if out.shape[-1] == d else out[..., :d]), lse


def hopper_pages_fit(q, k_pages) -> bool:
    """Pages (num_pages, page_size, hk, d) the Hopper kernel reads by key block: page_size a
    multiple of its key block (128 rows up to d 128, 64 above), so no TMA box spans pages."""
    return k_pages.shape[1] % choose_hopper_traits(q.shape[-1], compiled.DTYPE_NAMES[q.dtype]).block_n == 0


def flash_fwd_varlen_sm90(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, seqused_k=None, block_table=None,
                          dropout: DropoutArgs | None = None):
    """Packed batches on the Hopper kernel: q (total_q, h, d), k/v (total_k, hk, d) or pages
    (num_pages, page_size, hk, d) through block_table (`hopper_pages_fit`), int32 prefix sums,
    seqused_k (batch,) int32 key lengths or None; returns (out (total_q, h, d), lse (h,
    total_q)) as `flash_fwd_varlen` does.
    One CTA per tile (the persistent schedule's tile numbering assumes equal lengths), and
    128-row tiles at every d (192-row ones ran at half speed with one CTA per tile)."""
    total_q, h, d = q.shape
    q, k, v = aligned(q), aligned(k), aligned(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((h, total_q), dtype=torch.float32, device=q.device)
    left, right = window_edges(causal, window_size)
    config = Sm90FwdConfig(choose_hopper_traits(q.shape[-1], compiled.DTYPE_NAMES[q.dtype]), varlen=True,
                           has_seqused_k=seqused_k is not None, paged=block_table is not None,
                           **score_flags(left, right, alibi_slopes, softcap, dropout))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused = None if seqused_k is None else seqused_k.contiguous()
    compiled.sm90_kernel_for(config)(q, k, v, out, lse, alibi_2d(alibi_slopes, cu_seqlens_q.shape[0] - 1, h),
                                     rng_of(dropout, q.device), cu_seqlens_q, cu_seqlens_k, seqused, block_table,
                                     max_seqlen_q, *scales(softmax_scale, softcap), left, right)
    return (out if out.shape[-1] == d else out[..., :d]), lse
