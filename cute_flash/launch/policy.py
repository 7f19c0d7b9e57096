"""Every run-time rule of the launch layer: which kernel a call takes (the Hopper or the SM80
path), the Hopper kernels' schedule, pipeline depth, speculation, multicast and launch
choices, the split-KV count and the backward's dQ reduction. Each rule says what it does and
why in a line or two, and names where its measurements are: `docs/tuning/policy.md` under the
rule's name (what its docstring used to quote), and the dated entry of the log it came from."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

from cute_flash.kernels.sm80.bwd import DQ_STAGE_BYTES, BwdConfig
from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
from cute_flash.launch import gpu
from layouts.hopper import (BWD_SERVES, TALL_D64_MIN_SEQLEN_K, TALL_D64_UNMASKED_MIN_SEQLEN_K, TWO_CTAS_MAX_HEAD_DIM,
                            VALUE_DIM_PAIRS, choose_hopper_traits, wide_value_keys)
from layouts.traits import SMEM_LIMIT, BwdTraits, head_dim_bucket, tile_arch

PAGE_ROWS = 16  # pages of a multiple of this many rows take the page-run / shared-page-id copies


def arch_path() -> str | None:
    """`CUTE_FLASH_ARCH_PATH` ("sm80" takes the SM80 kernels on any GPU), read on every call so
    that a change mid-process takes effect."""
    return os.environ.get("CUTE_FLASH_ARCH_PATH")


def takes_hopper_path(index: int) -> bool:
    """Dense forwards, packed batches (over pages of a multiple of its key block too) and KV
    caches (those `hopper_cache_fits`) on sm_90 GPUs take the Hopper kernel, which leads the SM80
    one there, unless `CUTE_FLASH_ARCH_PATH=sm80` selects the SM80 kernel, which every other GPU
    runs (docs/tuning/policy.md; docs/tuning/hopper-forward.md, "Hopper forward")."""
    return arch_path() != "sm80" and gpu.device_arch(index) == 90


def takes_hopper_bwd(config: BwdConfig, index: int) -> bool:
    """Dense and packed backwards on sm_90 take the Hopper kernel (kernels/sm90/bwd.py) where it
    exists: every head-dim bucket (`layouts.hopper.BWD_SERVES`: 160 on the d 192 tiles, 224 on
    the d 256 ones), deterministic too (dQ's adds in key-block order);
    `CUTE_FLASH_ARCH_PATH=sm80` selects the SM80 kernel.
    docs/tuning/backward.md lists what falls back and why."""
    return takes_hopper_path(index) and config.traits.head_dim in BWD_SERVES


def takes_hopper_bwd_value_dim(head_dim: int, head_dim_v: int, index: int) -> bool:
    """A V head dim of its own (MLA's 192 / 128, `VALUE_DIM_PAIRS`) runs on the Hopper backward as
    it is, V, dO and dV at V's width: 1.07-1.15x forward + backward over padding to one head dim
    (docs/tuning/policy.md; docs/tuning/backward.md, "MLA at V's own head dim"); other pairs and
    the SM80 kernel pad (`launch/value_dim.py`)."""
    pair = (head_dim_bucket(head_dim), head_dim_bucket(head_dim_v))
    return takes_hopper_path(index) and pair in VALUE_DIM_PAIRS


def hopper_bwd_dq(traits: BwdTraits, deterministic: bool, softcap: bool = False) -> dict:
    """The dQ path on the Hopper backward's tiles (Sm90BwdConfig fields, the tiles it needs
    included). Default mode: d 64 on 128 x 128 tiles (flash-attn-4's; 0.99-1.05x the 64-row
    blocks, softcap's derivative spills there) and d 96 / 128 with the producer's writer warps'
    bulk adds (1.03-1.05x the consumers' own); d 192 with V 192 (160 too) on 96-key tiles with
    one dO stage, dQ by the writer warps (1.12-1.17x atomics with two dO stages); MLA by the
    writer warps (0.96-1.03x bulk); d 256 (224 too) `red.global` adds from registers, the
    staging tile's room a second Q / dO stage (1.29-1.31x); deterministic d 192 on the same
    96-key tiles, its turns its own (1.28-1.30x 64 keys); d 32 (not measured) and the rest of
    deterministic mode keep theirs. docs/tuning/policy.md; docs/tuning/backward.md, "The dQ
    paths measured", "d 192 on flash-attn-4's tiles", "d 64 on 128 x 128 tiles"."""
    if traits.head_dim == 192 and traits.head_dim_v is None:
        tiles = replace(traits, block_n=96, q_stages=2, do_stages=1)
        return dict(traits=tiles) if deterministic else dict(dq_path="writer", traits=tiles)
    if deterministic or traits.head_dim == 32:
        return {}
    if traits.head_dim == 64 and not softcap:
        return dict(dq_path="writer", traits=replace(traits, block_m=128))
    if traits.head_dim == 256:
        return dict(dq_path="atomic", traits=replace(traits, q_stages=2))
    return dict(dq_path="writer")


def with_hopper_bwd_dq(config):
    """An Sm90BwdConfig with the dQ path (and tiles) `hopper_bwd_dq` gives it: what the
    dispatcher launches."""
    return replace(config, **hopper_bwd_dq(config.traits, config.deterministic, config.has_softcap))


def takes_packed_persistent(traits) -> bool:
    """Packed forwards up to d 128 take the persistent schedule (one CTA an SM claiming the
    launch order's tiles): 1.05-1.22x one CTA a tile in the train_varlen cells, most at mean
    length 512, where a tile is a few key blocks, except without a mask at mean 2048 (0.95-1.01
    over three runs); above d 128 not measured. docs/tuning/policy.md; docs/tuning/backward.md,
    "The packed forward's schedule measured"."""
    return traits.head_dim <= 128 and Sm90FwdConfig.fits_persistent(traits)


def packed_bwd_by_sequence(config) -> bool:
    """The packed Hopper backward's launch order (`key_blocks_longest_first`): by sequence (the
    sequences by their first key block's work, each one's key blocks last first) under a right
    edge (causal: 1.27x at mean length 512, even at 2048; deterministic mode's dQ turns count in
    that order, `Sm90BwdConfig.dq_descending`), else key blocks by their work, most first (by
    sequence without a mask: 0.97 / 1.03). docs/tuning/backward.md, "The packed backward's
    launch order measured"."""
    return config.has_right


PERSISTENT_MAX_KEY_BLOCKS = 64


L2_SECTION_BYTES = 32 << 20  # K / V bytes a scheduling section's heads may span: ~2/3 of an H100 / H200 L2


ONE_WAVE_MAX_M_BLOCKS = 8  # up to this many query blocks a pair, a section is one wave's pairs (section_heads)


def schedules_as_masked(masked: bool, block_sparse: bool) -> bool:
    """A launch whose tiles differ in length, scheduled as a causal / local mask's
    (`takes_tall_tiles`, `prefers_persistent`, `section_heads`): a mask's, or block-sparse
    lists', which differ per query block (causal as a mask_mod 1.02-1.08x, a document mask
    1.05x that way; docs/tuning/policy.md)."""
    return masked or block_sparse


def prefers_persistent(traits, seqlen_k: int, masked: bool) -> bool:
    """The persistent kernel (one CTA per SM, tiles claimed from a counter) where it measured
    faster than one CTA per tile: always without a causal / local mask, under one up to
    PERSISTENT_MAX_KEY_BLOCKS key blocks a tile (Q released early pays there, not beyond), and
    192-row tiles always (docs/tuning/policy.md; docs/tuning/hopper-forward.md, "Tuning log")."""
    if not Sm90FwdConfig.fits_persistent(traits):
        return False
    return (traits.warpgroups == 3 or not masked
            or -(-seqlen_k // traits.block_n) <= PERSISTENT_MAX_KEY_BLOCKS)


DEEP_PIPELINE_MAX_SEQLEN_K = 1024  # three K / V stages up to this many keys (`kv_stages`)


DEEP_PIPELINE_MAX_HEAD_DIM = 96  # ... at this head dim and below: d 128's do not fit beside O's tile


def kv_stages(traits, seqlen_k: int, persistent: bool) -> int:
    """K / V pipeline depth: 3 stages for the persistent kernel's 128-row tiles up to
    DEEP_PIPELINE_MAX_SEQLEN_K keys at d <= DEEP_PIPELINE_MAX_HEAD_DIM (a third block in flight,
    likely the next tile's first while this one's epilogue runs), 2 otherwise: short keys
    gained, longer keys and 192-row tiles did not (docs/tuning/policy.md; docs/tuning/hopper-forward.md, Hopper
    step 18)."""
    deep = (seqlen_k <= DEEP_PIPELINE_MAX_SEQLEN_K and persistent and traits.warpgroups == 2
            and traits.head_dim <= DEEP_PIPELINE_MAX_HEAD_DIM)
    return 3 if deep else 2


def takes_tall_tiles(seqlen_k: int, masked: bool, dropout, mods=None) -> bool:
    """d 64's 192-row tiles (`choose_hopper_traits`' long_keys) from TALL_D64_MIN_SEQLEN_K keys
    under a causal / local mask and TALL_D64_UNMASKED_MIN_SEQLEN_K without one, where they
    measured faster; never with dropout, whose calls spill in the 160 registers a thread that
    three consumer warpgroups leave (docs/tuning/policy.md; docs/tuning/hopper-forward.md), nor
    with a mask_mod beside an aux tensor of a value per position (rank 2 and up, as the document
    mask's ids; `mods` the call's UserMods): the document forward spilled there and ran at 0.43
    of 128-row tiles (docs/tuning/mods.md, "The d 64 document forward on 128-row tiles")."""
    if mods is not None and mods.mask_mod is not None and any(rank >= 2 for _, rank in mods.aux):
        return False
    return dropout is None and seqlen_k >= (TALL_D64_MIN_SEQLEN_K if masked else TALL_D64_UNMASKED_MIN_SEQLEN_K)


def takes_value_dim_wide_keys(uneven: bool, dropout, mods=None) -> bool:
    """A V head dim of its own (MLA's 192 / 128) on 128-key blocks (`choose_hopper_traits`'
    `unmasked`) without a mask, dropout or mods: 1.05-1.11x the 64-key blocks at 4k / 16k; under
    a causal mask they lose persistence (0.95-0.98x), dropout spills 16 bytes there
    (docs/tuning/hopper-forward.md, "MLA's forward on 128-key blocks")."""
    return not uneven and dropout is None and mods is None


# Under a causal / local mask speculative maxima start from this many keys: below it the blocks
# after the diagonal one, whose few keys leave low kept maxima, are a large share and fall back
SPECULATIVE_MASKED_MIN_SEQLEN_K = 1024


# ... from this many at d 64 and below, where the softmax is a larger share of a block's work
SPECULATIVE_MASKED_MIN_SEQLEN_K_D64 = 512


# ... and on 192-row tiles (P over S, `speculates_in_place`) from this many under a window's left
# edge; under a causal mask the diagonal's blocks take `update` and the rest speculate at any length
SPECULATIVE_IN_PLACE_LEFT_EDGE_MIN_SEQLEN_K = 8192


def takes_speculative_max(traits, seqlen_k: int, has_left: bool, has_right: bool, dropout, alibi: bool) -> bool:
    """P from the kept row maxima first (`OnlineSoftmax.update_speculative`): not with dropout
    (its calls need the registers) nor with ALiBi where P goes over S (ptxas spilled there) or
    without a mask (a row's maximum moves with the diagonal, and the votes fail), and under a
    mask from the key counts above, where it measured faster than `update` (docs/tuning/policy.md;
    docs/tuning/hopper-forward.md, Hopper steps 16-18; docs/tuning/mods.md for ALiBi)."""
    in_place = speculates_in_place(traits)
    if in_place:
        min_masked = SPECULATIVE_IN_PLACE_LEFT_EDGE_MIN_SEQLEN_K if has_left else 0
    elif traits.head_dim <= 64:
        min_masked = SPECULATIVE_MASKED_MIN_SEQLEN_K_D64
    else:
        min_masked = SPECULATIVE_MASKED_MIN_SEQLEN_K
    masked = has_left or has_right
    return (dropout is None and not (alibi and (in_place or not masked))
            and (not masked or seqlen_k >= min_masked))


def speculates_in_place(traits) -> bool:
    """Speculative P over S (`Sm90FwdConfig.speculative_in_place`: a failed vote issues the
    warpgroup's Q K^T again) on 192-row tiles, whose 160 registers a thread have no room for P
    beside S; 128-row tiles keep P beside S, which measured faster (docs/tuning/policy.md;
    docs/tuning/hopper-forward.md, Hopper step 17), but MLA's 128-key ones (`wide_value_keys`),
    where P beside S spilled 160 bytes (hopper-forward.md, "MLA's forward on 128-key blocks")."""
    return traits.warpgroups == 3 or wide_value_keys(traits)


KV_MULTICAST_MIN_SEQLEN_K = 2048  # K / V multicast from this many keys, at d 128 (`takes_kv_multicast`)


KV_MULTICAST_HEAD_DIM = 128


def kv_multicast_fits(traits, seqlen_q: int, masked: bool, persistent: bool) -> bool:
    """Where `Sm90FwdConfig.kv_multicast` can pair tiles: the persistent schedule without a
    causal / local mask (every tile of a head sees the same key blocks) and an even number of
    query blocks a head, so that tiles 2c and 2c + 1, a cluster's, are one head's."""
    return persistent and not masked and -(-seqlen_q // traits.block_m) % 2 == 0


def takes_kv_multicast(traits, seqlen_q: int, seqlen_k: int, masked: bool, persistent: bool, dropout) -> bool:
    """K / V multicast by default where it fits, at d 128 from KV_MULTICAST_MIN_SEQLEN_K keys,
    without dropout (not measured with it): half the K / V bytes from L2 a tile let the clock
    rise at the power limit; d 64 measured slower (docs/tuning/policy.md; docs/tuning/hopper-forward.md, Hopper
    step 20)."""
    return (traits.head_dim == KV_MULTICAST_HEAD_DIM and seqlen_k >= KV_MULTICAST_MIN_SEQLEN_K
            and dropout is None and kv_multicast_fits(traits, seqlen_q, masked, persistent))


def section_heads(q, k, longest_first: bool, block_m: int, num_sms: int) -> int:
    """(batch, head) pairs per scheduling section (`FlashFwdSm90.tile`). longest_first (the
    persistent kernel under a causal or local mask): tiles go longest first across a section's
    pairs. Pairs of at most ONE_WAVE_MAX_M_BLOCKS query blocks: a section is the pairs whose
    tiles fill one wave; longer pairs: as many pairs as keep the K / V read within
    L2_SECTION_BYTES (a K / V head shared by a group of query heads counting once). Otherwise a
    section is one pair: its tiles are equal, or one CTA per tile balances itself (docs/tuning/policy.md;
    docs/tuning/hopper-forward.md, Hopper step 22)."""
    if not longest_first:
        return 1
    pairs = q.shape[0] * q.shape[2]  # the cap keeps section_heads * query blocks within int32
    m_blocks = -(-q.shape[1] // block_m)
    if m_blocks <= ONE_WAVE_MAX_M_BLOCKS:
        return min(pairs, max(1, num_sms // m_blocks))
    kv_head_bytes = 2 * k.shape[1] * k.shape[3] * k.element_size()
    return min(pairs, max(1, L2_SECTION_BYTES // kv_head_bytes) * (q.shape[2] // k.shape[2]))


def hopper_pages_fit(q, k_pages, v_pages) -> bool:
    """Pages (num_pages, page_size, hk, d) the Hopper kernel reads by key block: page_size a
    multiple of its key block (128 rows up to d 128, 64 above, by the wider of q's and v's head
    dims), so no TMA box spans pages."""
    traits = choose_hopper_traits(q.shape[-1], gpu.DTYPE_NAMES[q.dtype], head_dim_v=v_pages.shape[-1])
    return k_pages.shape[1] % traits.block_n == 0



def takes_pack_gqa(seqlen_q: int, heads: int, heads_k: int, left: int, right: int, alibi: bool) -> bool:
    """GQA decode folds a group's query heads into one CTA's rows (`pack_gqa`, flash-attn 2's
    seqlenq_ngroups_swapped), so each K / V tile is read once a group: one query row, no window
    edge, no ALiBi (whose slopes and masks are per query head and row)."""
    return seqlen_q == 1 and heads > heads_k and left < 0 and right < 0 and not alibi


def query_fold_group(seqlen_q: int, heads: int, heads_k: int, alibi: bool, block_m: int) -> int:
    """The Hopper KV-cache entry's fold of a GQA group's g heads into consecutive rows of one
    tile per query (`Sm90FwdConfig.query_group`) where `takes_pack_gqa` does not fold and the
    fold at least halves the tiles reading each K / V block (g x ceil(sq / bm) against
    ceil(g sq / bm)); else 1. Not with ALiBi (slopes per head). docs/tuning/decode.md, "Packed
    queries: the fold inside the kernel"."""
    g = heads // heads_k
    if g < 2 or alibi:
        return 1
    return g if g * -(-seqlen_q // block_m) >= 2 * -(-(g * seqlen_q) // block_m) else 1


def hopper_cache_fits(leftpad: bool, batch_idx: bool, page_size: int | None, traits) -> bool:
    """The Hopper KV-cache entry takes caches without cache_leftpad or cache_batch_idx (not built
    there), in one row a sequence or in pages of a multiple of its key block (a TMA box a block,
    inside one page); the rest take the SM80 kernel (docs/tuning/decode.md)."""
    return not leftpad and not batch_idx and (page_size is None or page_size % traits.block_n == 0)

TWO_CTAS_MAX_KEYS = 4096


CLUSTER_MAX_SPLITS = 8  # a portable cluster's CTAs: the Hopper entry's splits merge in one (ClusterMerge)


def takes_two_ctas_per_sm(work_ctas: int, num_sms: int, capacity: int, head_dim: int) -> bool:
    """The Hopper entry at two CTAs an SM (64 x 64 tiles, `Sm90FwdConfig.ctas_per_sm`) for caches
    of at most `TWO_CTAS_MAX_KEYS` keys whose tiles outnumber the SMs (so no split): one CTA's
    prologue and merge overlap the other's keys; longer caches and split ones gained nothing
    (docs/tuning/policy.md; docs/tuning/decode-splits.md, "Two CTAs an SM for short caches")."""
    return work_ctas > num_sms and capacity <= TWO_CTAS_MAX_KEYS and head_dim <= TWO_CTAS_MAX_HEAD_DIM


DEEP_CACHE_MAX_HEAD_DIM = 64


def cache_stages(traits, ctas_per_sm: int) -> int:
    """K / V pipeline depth of the Hopper entry: 3 stages at d <= `DEEP_CACHE_MAX_HEAD_DIM` and
    one CTA an SM, 2 otherwise: two d 64 stages leave too few bytes in flight to stream the
    cache, d 128 gained nothing (and 4 stages do not fit) (docs/tuning/policy.md; docs/tuning/decode.md, "Dense
    stream-K, d 64 decode stages, ...")."""
    return 3 if traits.head_dim <= DEEP_CACHE_MAX_HEAD_DIM and ctas_per_sm == 1 else 2


DEPENDENT_LAUNCH_MAX_KEYS = 8192


def takes_dependent_launch(ctas: int, slots: int, keys_per_cta: int) -> bool:
    """The Hopper entry launches as a programmatic dependent (`Sm90FwdConfig.dependent_launch`)
    unless its CTAs fit in one wave that leaves SM slots idle and each streams more than
    `DEPENDENT_LAUNCH_MAX_KEYS` keys: PDL saves a fixed part of a call (launch and prologue
    under the previous kernel) but slowed such launches (docs/tuning/policy.md; docs/tuning/decode.md, "PDL only
    where it pays")."""
    return ctas >= slots or keys_per_cta <= DEPENDENT_LAUNCH_MAX_KEYS


LONE_CTA_RATE = 0.95  # a decode CTA alone on its SM streams keys at this rate of each of a pair's
SPLIT_COST = 0.5      # a split's partial O and its share of the merge, in key blocks' time
MANY_WAVE_SPLITS = 12  # at one CTA an SM, the count of many waves that replaces one ...
BUSY_FLOOR = 0.8       # ... whose CTAs fill less than this share of the SM slots over its waves


@dataclass(frozen=True)
class SplitChoice:
    """How a split-KV launch shares out the key blocks (`split_choice`)."""
    num_splits: int  # equal splits of every tile (1: none)
    stream_k: bool   # the many-wave case: a kernel with stream-K (StreamSplit) takes it over every SM slot instead


def num_splits_heuristic(work_ctas: int, num_sms: int, num_n_blocks: int, max_splits: int = 128,
                         ctas_per_sm: int = 2, clusters: tuple[int, ...] | None = None) -> int:
    """How many equal splits of the key range (`split_choice`)."""
    return split_choice(work_ctas, num_sms, num_n_blocks, max_splits, ctas_per_sm, clusters).num_splits


@functools.lru_cache(maxsize=4096)
def split_choice(work_ctas: int, num_sms: int, num_n_blocks: int, max_splits: int = 128,
                 ctas_per_sm: int = 2, clusters: tuple[int, ...] | None = None) -> SplitChoice:
    """How many splits of the key range: the count whose busiest SM finishes first.

    Decode is bandwidth-bound, and an SM streams keys at about the same rate whether it holds
    one CTA or two (ctas_per_sm, the most that fit: 2 for the SM80 kernel, 1 for the Hopper
    KV-cache entry, by its shared memory). With s splits the busiest SM runs k = ceil(work_ctas *
    s / num_sms) CTAs of ceil(n / s) key blocks each, about k (ceil(n / s) + SPLIT_COST [s > 1])
    / (LONE_CTA_RATE if k == 1 < ctas_per_sm else 1) blocks' time. Candidates: no split once
    work_ctas fill 80% of the slots; otherwise the counts whose CTAs all fit in the slots at once
    (a second wave ran slower) and that change ceil(n / s) (the others add empty splits); where
    no split fits one wave and the unsplit CTAs leave SMs idle, counts of two waves too. The
    smallest count at the least time wins; the constants are fitted to a sweep of every count
    over the decode bench's cells, where flash-attn's rule ran slower.

    At one CTA an SM, a winner whose CTAs fill less than BUSY_FLOOR of the SM slots over its
    waves gives way to MANY_WAVE_SPLITS (the fewest at as many key blocks a split, so none is
    empty) where the key blocks are at least 4 a split and the model does not call that slower;
    a kernel with stream-K (the Hopper entry) takes stream-K over every SM slot instead
    (`SplitChoice.stream_k`).

    clusters: where s splits merge in one thread-block cluster (the Hopper entry, s up to
    len(clusters)), clusters[s - 1] of them run at once (`launch.clusters`), on fewer SMs than
    all where the GPCs do not divide into clusters of s: the busiest SM then runs
    ceil(work_ctas * ctas_per_sm / clusters[s - 1]) CTAs.

    docs/tuning/policy.md; docs/tuning/decode.md, "Decode"; docs/tuning/decode-splits.md, "Stream-K in place of
    many waves of splits" and "Clusters the GPU holds at once"."""
    slots = ctas_per_sm * num_sms
    if work_ctas >= 0.8 * slots:
        return SplitChoice(1, stream_k=False)
    waves = 2 if 2 * work_ctas > slots and work_ctas < num_sms else 1

    def busiest(s):  # CTAs on the busiest SM
        if clusters and 1 < s <= len(clusters):
            return -(-work_ctas * ctas_per_sm // clusters[s - 1])
        return -(-work_ctas * s // num_sms)

    def cost(s):
        k = busiest(s)
        blocks = -(-num_n_blocks // s) + (SPLIT_COST if s > 1 else 0.0)
        return k * blocks / (LONE_CTA_RATE if k == 1 < ctas_per_sm else 1.0)

    top = max(1, min(max_splits, num_n_blocks, waves * slots // work_ctas))
    counts = [s for s in range(1, top + 1) if s == 1 or -(-num_n_blocks // s) != -(-num_n_blocks // (s - 1))]
    best = min(counts, key=lambda s: (cost(s), s))
    busy = work_ctas * best / (num_sms * busiest(best))
    many = -(-num_n_blocks // -(-num_n_blocks // MANY_WAVE_SPLITS))  # the fewest at that many blocks: none empty
    if (ctas_per_sm == 1 and busy < BUSY_FLOOR and num_n_blocks >= 4 * MANY_WAVE_SPLITS and many <= max_splits
            and cost(many) < cost(best)):
        return SplitChoice(many, stream_k=True)
    return SplitChoice(best, stream_k=False)


def dq_reduction(traits: BwdTraits, arch: int, deterministic: bool = False) -> dict:
    """How the backward adds dQ into dQaccum on `arch` (BwdConfig's dq_vec and dq_bulk): one
    float per atomic before sm_90; on sm_90 four (`red.global.add.v4.f32`), and where shared
    memory holds an fp32 (block_m, head_dim) staging tile besides the traits' tiles and the run
    is not deterministic, one `cp.reduce.async.bulk` per warp instead, which hands the adds to
    the TMA unit while the warp goes on with the dK GEMM."""
    if arch < 90:
        return dict(dq_vec=1, dq_bulk=False)
    staging = DQ_STAGE_BYTES * traits.block_m * traits.head_dim
    return dict(dq_vec=4, dq_bulk=not deterministic and traits.smem_bytes + staging <= SMEM_LIMIT[tile_arch(arch)])
