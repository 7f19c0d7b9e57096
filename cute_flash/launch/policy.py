"""Every run-time rule of the launch layer: which kernel a call takes (the Hopper or the SM80
path), and the Hopper kernels' schedule, pipeline depth, speculation, multicast and launch
choices. Each rule says why, with the measurement it rests on (docs/tuning/hopper-forward.md,
decode.md, backward.md)."""
from __future__ import annotations

import os

from cute_flash.kernels.config import BwdConfig
from cute_flash.kernels.fwd_sm90 import Sm90FwdConfig
from cute_flash.launch import gpu
from layouts.hopper import (BWD_HEAD_DIMS, TALL_D64_MIN_SEQLEN_K, TALL_D64_UNMASKED_MIN_SEQLEN_K, TWO_CTAS_MAX_HEAD_DIM,
                            choose_hopper_traits)

PAGE_ROWS = 16  # pages of a multiple of this many rows take the page-run / shared-page-id copies


def takes_hopper_path(index: int) -> bool:
    """Dense forwards, packed batches (over pages of a multiple of its key block too) and KV
    caches (those the Hopper entry takes, launch/kvcache.py) on sm_90 GPUs take the Hopper
    kernel (launch/hopper.py) unless `CUTE_FLASH_ARCH_PATH=sm80` selects the SM80 kernel, which
    every other GPU runs (a packed batch measured 602 / 527 TFLOP/s on the Hopper kernel against
    367 / 338 on the SM80 one, non-causal / causal; decode 1.03-1.16x the SM80 kernel except at
    1k-key caches; H200, docs/tuning/hopper-forward.md, docs/tuning/decode.md)."""
    return os.environ.get("CUTE_FLASH_ARCH_PATH") != "sm80" and gpu.device_arch(index) == 90


def takes_hopper_bwd(config: BwdConfig, index: int) -> bool:
    """Dense backwards on sm_90 take the Hopper kernel (kernels/bwd_sm90.py) where it exists:
    head-dim buckets 32, 64, 128 (`layouts.hopper.BWD_HEAD_DIMS`), not deterministic (its dQ
    adds are unordered bulk reduces); `CUTE_FLASH_ARCH_PATH=sm80` selects the SM80 kernel.
    docs/tuning/backward.md lists what falls back and why."""
    return (takes_hopper_path(index) and config.traits.head_dim in BWD_HEAD_DIMS and not config.deterministic
            and not config.varlen)


PERSISTENT_MAX_KEY_BLOCKS = 64


L2_SECTION_BYTES = 32 << 20  # K / V bytes a scheduling section's heads may span: ~2/3 of the H200's 50 MB L2


ONE_WAVE_MAX_M_BLOCKS = 8  # up to this many query blocks a pair, a section is one wave's pairs (section_heads)


def prefers_persistent(traits, seqlen_k: int, masked: bool) -> bool:
    """The persistent kernel (one CTA per SM, tiles claimed from a counter) where it measured
    faster than one CTA per tile (H200, bf16, TFLOP/s, docs/tuning/hopper-forward.md): always without a causal
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
    at d 96), 2 otherwise. H200, time with 2 stages over time with 3, best of 3 (docs/tuning/hopper-forward.md,
    Hopper step 18): d 64 non-causal 512 1.022-1.028, causal 512 1.025, causal 1k 1.027-1.033;
    d 32 512 1.008, causal 1k 1.019; d 96 512 1.026, causal 1k 1.009; but at 4k-8k keys
    0.974-1.001 (d 32 and 96), and on 192-row tiles 0.986-1.031."""
    deep = (seqlen_k <= DEEP_PIPELINE_MAX_SEQLEN_K and persistent and traits.warpgroups == 2
            and traits.head_dim <= DEEP_PIPELINE_MAX_HEAD_DIM)
    return 3 if deep else 2


def takes_tall_tiles(seqlen_k: int, masked: bool, dropout) -> bool:
    """d 64's 192-row tiles (`choose_hopper_traits`' long_keys): from 2048 keys under a causal
    / local mask, from 1024 without one (1k: 417-420 TFLOP/s against 395-404 non-causal, 288
    against 325 causal; H200, docs/tuning/hopper-forward.md); never with dropout (three consumer warpgroups
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
    1.044-1.060 (P over S; docs/tuning/hopper-forward.md, Hopper steps 16-18)."""
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
    1k-16k) and 0.71x at d 64 non-causal 512 (H200, docs/tuning/hopper-forward.md, Hopper step 17)."""
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
    K / V bytes from L2 a tile); d 64 0.962-0.995, so not there (docs/tuning/hopper-forward.md, Hopper step 20)."""
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
    pairs (32 MB) 602-624, 8 pairs 597-603, 2 pairs 573-600; docs/tuning/hopper-forward.md, Hopper step 22).
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


def hopper_pages_fit(q, k_pages) -> bool:
    """Pages (num_pages, page_size, hk, d) the Hopper kernel reads by key block: page_size a
    multiple of its key block (128 rows up to d 128, 64 above), so no TMA box spans pages."""
    return k_pages.shape[1] % choose_hopper_traits(q.shape[-1], gpu.DTYPE_NAMES[q.dtype]).block_n == 0


TWO_CTAS_MAX_KEYS = 4096


CLUSTER_MAX_SPLITS = 8  # a portable cluster's CTAs: the Hopper entry's splits merge in one (ClusterMerge)


def takes_two_ctas_per_sm(work_ctas: int, num_sms: int, capacity: int, head_dim: int) -> bool:
    """The Hopper entry at two CTAs an SM (64 x 64 tiles, `Sm90FwdConfig.ctas_per_sm`) for caches
    of at most `TWO_CTAS_MAX_KEYS` keys whose tiles outnumber the SMs (so no split): one CTA's
    prologue and merge overlap the other's keys. Measured against the shipped 64 x 128 tiles
    (H200, d 128, 32 / 8 heads, CUDA graphs, `tune --decode`; docs/tuning/decode-splits.md, "Two CTAs an SM
    for short caches"): 1.33x at 17 sequences of 1k keys (136 tiles: one wave plus 4 CTAs at
    one an SM), 1.05-1.14x at 24-64 sequences of 1k, 1.01-1.04x at 2k-4k, 1.00 at 8k, 0.98 at
    32k; where the shipped tiles split (1 and 8 sequences) 0.96-1.02x."""
    return work_ctas > num_sms and capacity <= TWO_CTAS_MAX_KEYS and head_dim <= TWO_CTAS_MAX_HEAD_DIM


DEEP_CACHE_MAX_HEAD_DIM = 64


def cache_stages(traits, ctas_per_sm: int) -> int:
    """K / V pipeline depth of the Hopper entry: 3 stages at d <= `DEEP_CACHE_MAX_HEAD_DIM` and
    one CTA an SM, 2 otherwise. A d 64 stage is 16 KB of K and 16 of V, so two stages leave
    too few bytes in flight to stream the cache. H200, 32 / 8 heads, CUDA graphs, us a call,
    2 stages / 3 / 4 / CUDNN (docs/tuning/decode.md, "Dense stream-K, d 64 decode stages, ..."): 8
    sequences of 32k 128-130 / 120-123 / 121-123 / 122; 8 of 128k 496-503 / 475-489 / 476-489
    / 468; 1 of 128k 66.8 / 64.2 / 65.4 / 66.2; 32 of 8k 127-129 / 122-124 / 123-124 / 119. d
    128 gained nothing (8 of 32k 235-236 against 236, and 4 stages do not fit). d 32, half a d
    64 stage, takes 3 by the same reasoning, not measured; two CTAs an SM, not measured, keep 2."""
    return 3 if traits.head_dim <= DEEP_CACHE_MAX_HEAD_DIM and ctas_per_sm == 1 else 2


DEPENDENT_LAUNCH_MAX_KEYS = 8192


def takes_dependent_launch(ctas: int, slots: int, keys_per_cta: int) -> bool:
    """The Hopper entry launches as a programmatic dependent (`Sm90FwdConfig.dependent_launch`)
    unless its CTAs fit in one wave that leaves SM slots idle and each streams more than
    `DEPENDENT_LAUNCH_MAX_KEYS` keys. PDL saves a fixed 0.1-1.3 us a call (launch and prologue
    under the previous kernel) but slowed such launches by 1-2% of their time. H200, d 128, 32 /
    8 heads, CUDA graphs, calls back to back, without PDL against with it (docs/tuning/decode.md, "PDL
    only where it pays"), on two machines, in one process and in separate ones: 8 sequences of
    128k keys (128 CTAs on 132 SMs, 2 splits) 922 / 943 us and 944 / 964, of 32k 235 / 239 and
    242 / 245; 16 sequences of 128k (128 CTAs unsplit) 1881 / 1922. A third machine measured
    0.2-0.4% the other way. Kept at one sequence of 128k (8k keys a CTA, 16 splits) for its gain
    after a GEMM (127.9 -> 127.1 us); more CTAs than SMs (32 and 64 sequences) within 0.3%."""
    return ctas >= slots or keys_per_cta <= DEPENDENT_LAUNCH_MAX_KEYS
