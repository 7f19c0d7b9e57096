"""The kernel variants the dispatcher can choose: the covering subset that CI and `python -m
cute_flash compile` build, and with `full` every one (`compile --full`, and the checks that
every launch's config is among them). Lists of configs of every kernel; `compile.registry`
compiles any of them.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import replace

from cute_flash.kernels.common.flags import CACHE_FLAGS, SCORE_FLAGS
from cute_flash.kernels.common.varlen_order import VarlenOrderConfig
from cute_flash.kernels.sm80.append import AppendConfig
from cute_flash.kernels.sm80.append_packed import PackedAppendConfig
from cute_flash.kernels.sm80.bwd import BwdConfig
from cute_flash.kernels.sm80.bwd_preprocess import PreprocessConfig
from cute_flash.kernels.sm80.dq_convert import DQConvertConfig
from cute_flash.kernels.sm80.fwd import FwdConfig
from cute_flash.kernels.sm90.bwd import DQ_PATHS, Sm90BwdConfig
from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
from cute_flash.launch.policy import (DEEP_PIPELINE_MAX_SEQLEN_K, KV_MULTICAST_MIN_SEQLEN_K,
                                      SPECULATIVE_IN_PLACE_LEFT_EDGE_MIN_SEQLEN_K, SPECULATIVE_MASKED_MIN_SEQLEN_K,
                                      SPECULATIVE_MASKED_MIN_SEQLEN_K_D64, cache_stages, dq_reduction,
                                      kv_stages, speculates_in_place, takes_kv_multicast, takes_speculative_max,
                                      with_hopper_bwd_dq)
from layouts.hopper import (BWD_HEAD_DIMS, VALUE_DIM_PAIRS, choose_hopper_bwd_traits, choose_hopper_cache_traits,
                            choose_hopper_latent_traits, choose_hopper_traits, shipped_hopper_cache_traits,
                            shipped_hopper_latent_traits, shipped_hopper_traits, wide_value_keys)
from layouts.traits import DTYPES, HEAD_DIM_BUCKETS, choose_bwd_traits, choose_decode_traits, choose_fwd_traits

QUERY_GROUPS = (4, 8)  # the full list's query folds (`Sm90FwdConfig.query_group`): Llama's and Qwen's GQA groups


def fwd_variants(arch: int, full: bool = False) -> list[FwdConfig]:
    """Configs the dispatcher can choose on `arch`.

    full: every forward traits times every dense and varlen flag combination, and every
    KV-cache traits times every cache flag combination (causal or not, with a sink or not).
    Otherwise a covering subset for CI (a compile takes 5-20 s on its 2 cores): every head-dim
    bucket of both kernels (forward and KV-cache), fp16 on sm_80 and bf16 on sm_90 (the dtype
    only changes the MMA atom); the varlen, seqused_k and paged variants (pages of a multiple of
    16 rows, and of any size); dropout, dense and varlen; a learnable sink, dense, varlen and KV
    cache (split, GQA-folded); and on sm_90 each score flag alone and all together, each cache
    flag alone, and the split + paged pair with both page forms.
    """
    combos = [dict(zip(SCORE_FLAGS, bits)) for bits in itertools.product((False, True), repeat=len(SCORE_FLAGS))]
    causal = dict(has_left=False, has_right=True, has_alibi=False, has_softcap=False, even_k=True)
    fwd_traits = list(dict.fromkeys(choose_fwd_traits(d, dt, arch, c) for d in HEAD_DIM_BUCKETS
                                    for dt in DTYPES for c in (False, True)))
    decode_traits = list(dict.fromkeys(choose_decode_traits(d, dt, arch) for d in HEAD_DIM_BUCKETS for dt in DTYPES))
    cache_flags = [dict(zip(CACHE_FLAGS, bits)) for bits in itertools.product((False, True), repeat=len(CACHE_FLAGS))
                   if not (bits[0] and (bits[2] or bits[3]))]
    cache_flags += [dict(c, any_page_size=True) for c in cache_flags if c["paged"]]
    if full:
        combos += [dict(f, has_dropout=True) for f in combos]
        combos += [dict(f, learnable_sink=True) for f in combos]
        varlen = [dict(f, varlen=True, has_seqused_k=u, paged=p, any_page_size=a) for f in combos
                  for u in (False, True) for p in (False, True) for a in (False, True) if p or not a]
        cache = [dict(has_right=r, kvcache=True, learnable_sink=k, **c) for r in (False, True) for c in cache_flags
                 for k in (False, True) if not (r and c["pack_gqa"])]
        pairs = [(t, f) for t in fwd_traits for f in combos + varlen] + [(t, f) for t in decode_traits for f in cache]
        return [FwdConfig(t, **f) for t, f in pairs]
    dtype = "bf16" if arch >= 90 else "fp16"
    pivot = choose_fwd_traits(128, dtype, arch)
    decode_pivot = choose_decode_traits(128, dtype, arch)
    subset = [(t, causal) for t in fwd_traits if t.dtype == dtype]
    subset += [(t, dict(kvcache=True, split=True, pack_gqa=True)) for t in decode_traits if t.dtype == dtype]
    subset += [(pivot, dict(causal, varlen=True)), (pivot, dict(causal, varlen=True, has_seqused_k=True)),
               (pivot, dict(causal, varlen=True, paged=True)),
               (pivot, dict(causal, varlen=True, paged=True, any_page_size=True)),
               (pivot, dict(causal, has_dropout=True)), (pivot, dict(causal, varlen=True, has_dropout=True)),
               (pivot, dict(causal, learnable_sink=True)), (pivot, dict(causal, varlen=True, learnable_sink=True)),
               (decode_pivot, dict(kvcache=True, split=True, pack_gqa=True, learnable_sink=True))]
    if arch >= 90:
        all_on = dict(has_left=True, has_right=True, has_alibi=True, has_softcap=True, even_k=False)
        plain = dict(causal, has_right=False)
        alone = [dict(plain, **{n: not plain[n]}) for n in SCORE_FLAGS if n != "has_right"]
        subset += [(pivot, f) for f in alone + [all_on]]
        subset += [(decode_pivot, dict(causal, kvcache=True, **{n: True})) for n in CACHE_FLAGS if n != "pack_gqa"]
        subset += [(decode_pivot, dict(plain, kvcache=True, pack_gqa=True))]
        subset += [(decode_pivot, dict(causal, kvcache=True, paged=True, split=True, any_page_size=a))
                   for a in (False, True)]
    return [FwdConfig(t, **f) for t, f in subset]


def append_variants(full: bool = False) -> list:
    """AppendConfigs the KV-cache path can launch (fp16 and bf16 with `full`, else fp16): a
    paged cache has no batch index; without rotary, interleaving and per-row angles mean
    nothing. CI compiles three: plain, batch index + interleaved rotary, paged + per-row rotary."""
    if not full:
        return [AppendConfig("fp16", False, False, False, False, False),
                AppendConfig("fp16", False, True, True, True, False),
                AppendConfig("fp16", True, False, True, False, True)]
    layouts = [(False, False), (False, True), (True, False)]
    rotary = [(False, False, False)] + [(True, i, q) for i in (False, True) for q in (False, True)]
    return [AppendConfig(dt, *lay, *rot) for dt in DTYPES for lay in layouts for rot in rotary]


def packed_append_variants(full: bool = False) -> list:
    """PackedAppendConfigs packed queries in the KV-cache call can launch (fp16 and bf16 with
    `full`, else bf16): contiguous or paged caches, with or without new keys, with or without
    rotary (interleaving and per-row angles only with it), 16-byte copies or one element at a
    time. CI compiles four: new keys into a contiguous cache without rotary and into pages with
    per-row rotary (16-byte copies), interleaved rotary with no new keys and pages with neither
    (one element at a time)."""
    if not full:
        return [PackedAppendConfig("bf16", False, True, False, False, False, 8),
                PackedAppendConfig("bf16", True, True, True, False, True, 8),
                PackedAppendConfig("bf16", False, False, True, True, False, 1),
                PackedAppendConfig("bf16", True, False, False, False, False, 1)]
    rotary = [(False, False, False)] + [(True, i, q) for i in (False, True) for q in (False, True)]
    return [PackedAppendConfig(dt, paged, new, *rot, vec) for dt in DTYPES for paged in (False, True)
            for new in (False, True) for rot in rotary for vec in (1, 8)]


BWD_FLAGS = ("has_left", "has_right", "has_alibi", "has_softcap", "has_dropout", "even_k", "deterministic")


def _cache_flag_sets():
    """The Hopper KV-cache entry's score flags, each with the GQA folds (only without window
    edges or ALiBi, launch/kvcache.py) and the query folds (without ALiBi, `query_fold_group`, at
    common groups) they take: (flags, folds, groups)."""
    for bits in itertools.product((False, True), repeat=4):
        flags = dict(zip(("has_left", "has_right", "has_alibi", "has_softcap"), bits))
        folds = (False,) if flags["has_left"] or flags["has_right"] or flags["has_alibi"] else (False, True)
        groups = (1,) if flags["has_alibi"] else (1,) + QUERY_GROUPS
        yield flags, folds, groups


def sm90_variants(full: bool = False) -> list[Sm90FwdConfig]:
    """The Hopper forward configs the sm_90 dispatcher can choose (launch/hopper.py).

    full: every shipped traits (layouts.hopper.shipped_hopper_traits) times every score-flag
    combination, in each schedule `prefers_persistent` can choose for it (dropout not on
    192-row tiles, which the launcher does not give it), with and without speculative maxima
    where the key count decides (`takes_speculative_max`), persistent with three K / V stages
    where `kv_stages` gives short keys them, the packed-batch entry of every 128-row traits
    with and without seqused_k, paged and not, one CTA per tile and persistent (where it fits),
    and the KV-cache entry of every bucket and dtype
    with every score flag but dropout, split and not, paged and not, GQA-folded and not (the
    fold without window edges or ALiBi; the query fold of `QUERY_GROUPS` without ALiBi), at
    one CTA an SM and (up to `TWO_CTAS_MAX_HEAD_DIM`) two, at the K / V stages
    `policy.cache_stages` gives each. Otherwise the CI subset: every
    bucket in bf16 with a causal edge (the persistent variant where it fits, so both schedules
    compile; speculative maxima, as at 1024 keys and more), d 64's 192-row tiles likewise
    (speculating in place, as under a causal mask at any length), d 64 causal with three K / V
    stages (as up to 1024 keys), d 128 in fp16, d 128 with every score flag on, dropout at d 64
    (causal, one CTA per tile) and d 128 (persistent), packed batches (persistent, as
    `takes_packed_persistent` gives them, and one CTA per tile where named: d 128 causal, in
    both schedules, d 96 with seqused_k, d 64 fp16 with every flag, in both, d 128 causal over
    pages) and KV caches (d 128 plain, d
    64 split with softcap at its three stages, d 128 split, paged and GQA-folded, d 256 fp16
    with every flag, d 128 GQA-folded at two CTAs an SM; query folds: d 128 causal by 4, split in a
    cluster, paged and by 8, d 64 stream-K with both window edges and softcap by 4), d 128 with K / V multicast (as
    without a mask from 2048 keys), MLA's d 192 with V's 128 (`VALUE_DIM_PAIRS`), causal,
    dense and packed (one CTA per tile), and without a mask on its 128-key tiles (ALiBi,
    softcap, a sink), and a learnable sink (d 128 causal persistent, d 64
    causal packed; KV
    caches: d 128 GQA-folded split in a cluster, d 128 split and paged, d 64 causal stream-K
    folded by 4), MLA decode's latent tiles (paged and GQA-folded; causal with softcap, a sink
    and a query fold by 2); the full list has every variant with a sink too."""
    if full:
        out = []
        for t in shipped_hopper_traits():
            for bits in itertools.product((False, True), repeat=5):
                flags = dict(zip(("has_left", "has_right", "has_alibi", "has_softcap", "has_dropout"), bits))
                if flags["has_dropout"] and t.warpgroups == 3:
                    continue
                # speculative maxima by key count: a mask's short and long keys differ
                dropout = True if flags["has_dropout"] else None
                specs = {takes_speculative_max(t, sk, flags["has_left"], flags["has_right"], dropout,
                                               flags["has_alibi"])
                         for edge in (SPECULATIVE_MASKED_MIN_SEQLEN_K, SPECULATIVE_MASKED_MIN_SEQLEN_K_D64,
                                      SPECULATIVE_IN_PLACE_LEFT_EDGE_MIN_SEQLEN_K)
                         for sk in (edge - 1, edge)}
                masked = flags["has_left"] or flags["has_right"]
                if wide_value_keys(t) and (masked or flags["has_dropout"]):  # unmasked calls' tiles
                    continue
                for spec in sorted(specs):
                    kinds = {"speculative_max": spec, "speculative_in_place": spec and speculates_in_place(t)}
                    if t.warpgroups != 3 or not Sm90FwdConfig.fits_persistent(t):
                        out.append(Sm90FwdConfig(t, **kinds, **flags))
                    if Sm90FwdConfig.fits_persistent(t):
                        out.append(Sm90FwdConfig(t, persistent=True, **kinds, **flags))
                    if kv_stages(t, DEEP_PIPELINE_MAX_SEQLEN_K, True) == 3:  # short keys
                        out.append(Sm90FwdConfig(t, 3, persistent=True, **kinds, **flags))
                    # multicast as the launcher takes it: two query blocks, long keys, persistent
                    if Sm90FwdConfig.fits_persistent(t) and takes_kv_multicast(
                            t, 2 * t.block_m, KV_MULTICAST_MIN_SEQLEN_K, masked, True, dropout):
                        out.append(Sm90FwdConfig(t, persistent=True, kv_multicast=True, **kinds, **flags))
                if t.warpgroups != 3 and not wide_value_keys(t):
                    out += [Sm90FwdConfig(t, varlen=True, persistent=s, has_seqused_k=u, paged=p, **flags)
                            for s in (False, True) if not s or Sm90FwdConfig.fits_persistent(t)
                            for u in (False, True) for p in (False, True)]
        out += [replace(c, learnable_sink=True) for c in out]  # every dense and packed one with a sink
        caches = []
        for ctas in (1, 2):
            for t in shipped_hopper_cache_traits(ctas):
                for flags, folds, groups in _cache_flag_sets():
                    caches += [Sm90FwdConfig(t, cache_stages(t, ctas), kvcache=True, split=s, cluster_merge=m,
                                          stream_k=w, paged=p, pack_gqa=f, query_group=g, ctas_per_sm=ctas,
                                          dependent_launch=pdl, **flags)
                            for s, m, w in ((False, False, False), (True, False, False), (True, True, False),
                                            (True, False, True))
                            for p in (False, True) for f in folds for g in ((1,) if f else groups)
                            # stream-K fills every slot; two CTAs an SM stream at most 4096 keys each
                            for pdl in ((False, True) if ctas == 1 and not w else (True,))]
        for t in shipped_hopper_latent_traits():  # MLA decode: unsplit, one CTA an SM
            for flags, folds, groups in _cache_flag_sets():
                caches += [Sm90FwdConfig(t, cache_stages(t, 1), kvcache=True, paged=p, pack_gqa=f, query_group=g,
                                         dependent_launch=pdl, **flags)
                           for p in (False, True) for f in folds for g in ((1,) if f else groups)
                           for pdl in (False, True)]
        return out + caches + [replace(c, learnable_sink=True) for c in caches]  # and every one with a sink
    traits = [choose_hopper_traits(d, "bf16") for d in HEAD_DIM_BUCKETS]
    d64, cache64 = choose_hopper_traits(64, "bf16"), choose_hopper_cache_traits(64, "bf16")
    (mla_d, mla_dv), = VALUE_DIM_PAIRS
    latent = choose_hopper_latent_traits("bf16")
    mla = choose_hopper_traits(mla_d, "bf16", head_dim_v=mla_dv)
    wide_mla = choose_hopper_traits(mla_d, "bf16", head_dim_v=mla_dv, unmasked=True)
    out = [Sm90FwdConfig(t, persistent=Sm90FwdConfig.fits_persistent(t), has_right=True, speculative_max=True,
                         speculative_in_place=speculates_in_place(t))
           for t in traits + [choose_hopper_traits(64, "bf16", long_keys=True)]]
    return out + [Sm90FwdConfig(d64, kv_stages(d64, DEEP_PIPELINE_MAX_SEQLEN_K, persistent=True), persistent=True,
                                has_right=True, speculative_max=True),
                  Sm90FwdConfig(choose_hopper_traits(128, "fp16")),
                  Sm90FwdConfig(choose_hopper_traits(128, "bf16"), has_left=True, has_right=True, has_alibi=True,
                                has_softcap=True),
                  Sm90FwdConfig(choose_hopper_traits(64, "bf16"), has_right=True, has_dropout=True),
                  Sm90FwdConfig(choose_hopper_traits(128, "bf16"), persistent=True, has_dropout=True),
                  Sm90FwdConfig(choose_hopper_traits(128, "bf16"), persistent=True, speculative_max=True,
                                kv_multicast=True),
                  Sm90FwdConfig(choose_hopper_traits(128, "bf16"), has_right=True, varlen=True),
                  Sm90FwdConfig(choose_hopper_traits(96, "bf16"), varlen=True, has_seqused_k=True, persistent=True),
                  Sm90FwdConfig(choose_hopper_traits(128, "bf16"), has_right=True, varlen=True, paged=True,
                                persistent=True),
                  Sm90FwdConfig(choose_hopper_traits(64, "fp16"), has_left=True, has_alibi=True, has_softcap=True,
                                has_dropout=True, varlen=True),
                  Sm90FwdConfig(choose_hopper_traits(128, "bf16"), persistent=True, has_right=True, varlen=True),
                  Sm90FwdConfig(choose_hopper_traits(64, "fp16"), persistent=True, has_left=True, has_alibi=True,
                                has_softcap=True, has_dropout=True, varlen=True),
                  Sm90FwdConfig(choose_hopper_cache_traits(128, "bf16"), kvcache=True, dependent_launch=True),
                  Sm90FwdConfig(cache64, cache_stages(cache64, 1), has_softcap=True, kvcache=True, split=True,
                                dependent_launch=True),
                  Sm90FwdConfig(choose_hopper_cache_traits(128, "bf16"), kvcache=True, split=True, paged=True,
                                pack_gqa=True),
                  Sm90FwdConfig(choose_hopper_cache_traits(128, "bf16"), kvcache=True, split=True, cluster_merge=True,
                                pack_gqa=True),
                  Sm90FwdConfig(choose_hopper_cache_traits(128, "bf16"), kvcache=True, split=True, stream_k=True,
                                pack_gqa=True, dependent_launch=True),
                  Sm90FwdConfig(cache64, cache_stages(cache64, 1), has_right=True, kvcache=True, split=True,
                                stream_k=True, paged=True),
                  Sm90FwdConfig(choose_hopper_cache_traits(256, "fp16"), has_left=True, has_right=True,
                                has_alibi=True, has_softcap=True, kvcache=True),
                  Sm90FwdConfig(choose_hopper_cache_traits(128, "bf16", ctas_per_sm=2), kvcache=True, pack_gqa=True,
                                ctas_per_sm=2, dependent_launch=True),
                  Sm90FwdConfig(choose_hopper_cache_traits(128, "bf16"), has_right=True, kvcache=True, query_group=4),
                  Sm90FwdConfig(choose_hopper_cache_traits(128, "bf16"), has_right=True, kvcache=True, split=True,
                                cluster_merge=True, paged=True, query_group=8),
                  Sm90FwdConfig(cache64, cache_stages(cache64, 1), has_left=True, has_right=True, has_softcap=True,
                                kvcache=True, split=True, stream_k=True, query_group=4),
                  Sm90FwdConfig(choose_hopper_cache_traits(128, "bf16"), kvcache=True, split=True, cluster_merge=True,
                                pack_gqa=True, learnable_sink=True),
                  Sm90FwdConfig(choose_hopper_cache_traits(128, "bf16"), kvcache=True, split=True, paged=True,
                                learnable_sink=True),
                  Sm90FwdConfig(cache64, cache_stages(cache64, 1), has_right=True, kvcache=True, split=True,
                                stream_k=True, query_group=4, learnable_sink=True),
                  Sm90FwdConfig(mla, persistent=Sm90FwdConfig.fits_persistent(mla), has_right=True),
                  Sm90FwdConfig(latent, cache_stages(latent, 1), kvcache=True, paged=True, pack_gqa=True),
                  Sm90FwdConfig(latent, cache_stages(latent, 1), has_right=True, has_softcap=True, kvcache=True,
                                query_group=2, learnable_sink=True),
                  Sm90FwdConfig(mla, has_right=True, varlen=True),
                  Sm90FwdConfig(wide_mla, has_alibi=True, has_softcap=True, learnable_sink=True),
                  Sm90FwdConfig(choose_hopper_traits(128, "bf16"), persistent=True, has_right=True,
                                speculative_max=True, learnable_sink=True),
                  Sm90FwdConfig(choose_hopper_traits(64, "bf16"), has_right=True, varlen=True, learnable_sink=True,
                                persistent=True)]


@functools.cache
def sm90_traits_stages() -> tuple:
    """Every (traits, K / V stages) pair of a Hopper forward variant the dispatcher can choose
    (`sm90_variants(full=True)`: about 28k configs, built in a fifth of a second), sorted by
    name: what `python -m layouts report` checks, so that a traits is proved in the stage count
    it runs with (three at d <= 96 for short keys, and in the KV-cache entry at d <= 64)."""
    return tuple(sorted({(c.traits, c.stages) for c in sm90_variants(full=True)}, key=lambda p: (p[0].name, p[1])))


def bwd_variants(arch: int, full: bool = False) -> list:
    """Backward configs (main kernel, preprocess, dQ convert) the dispatcher can choose on `arch`.

    full: every backward traits times every flag combination, dense and varlen (with and
    without seqused_k). Otherwise, for CI: every head-dim bucket causal (bf16 on sm_90, fp16 on
    sm_80), and at d 128 each flag alone, all together, varlen, varlen + seqused_k; the
    preprocess and the dQ convert for every bucket (dense), and varlen with a padded head dim.
    """
    combos = [dict(zip(BWD_FLAGS, bits)) for bits in itertools.product((False, True), repeat=len(BWD_FLAGS))]
    traits = [choose_bwd_traits(d, dt, arch) for d in HEAD_DIM_BUCKETS for dt in DTYPES]
    vec = dq_reduction(traits[0], arch)["dq_vec"]

    def config(t, **flags):  # the launcher's dQ reduction for these traits and flags on `arch`
        return BwdConfig(t, **flags, **dq_reduction(t, arch, flags.get("deterministic", False)))

    if full:
        forms = [dict(), dict(varlen=True), dict(varlen=True, has_seqused_k=True)]
        pre = [PreprocessConfig(d, dt, e, vl) for d in HEAD_DIM_BUCKETS for dt in DTYPES for e in (False, True)
               for vl in (False, True)]
        convert = [DQConvertConfig(t, e, vl, vec) for t in traits for e in (False, True) for vl in (False, True)]
        return [config(t, **f, **form) for t in traits for f in combos for form in forms] + pre + convert
    dtype = "bf16" if arch >= 90 else "fp16"
    causal = dict(has_right=True)
    subset = [config(t, **causal) for t in traits if t.dtype == dtype]
    pivot = choose_bwd_traits(128, dtype, arch)
    plain = {name: name == "even_k" for name in BWD_FLAGS}
    subset += [config(pivot, **dict(plain, **{n: not plain[n]})) for n in BWD_FLAGS if n != "has_right"]
    subset += [config(pivot, **{n: n != "even_k" for n in BWD_FLAGS}),
               config(pivot, varlen=True, **causal),
               config(pivot, varlen=True, has_seqused_k=True)]
    pre = [PreprocessConfig(d, dtype) for d in HEAD_DIM_BUCKETS] + [PreprocessConfig(128, dtype, False, True)]
    convert = [DQConvertConfig(t, dq_vec=vec) for t in traits if t.dtype == dtype]
    convert += [DQConvertConfig(pivot, False, True, vec)]
    return subset + pre + convert


def sm90_bwd_variants(full: bool = False) -> list:
    """Hopper backward configs (main kernel and its dQ convert) the dispatcher can choose, each
    with the policy's dQ path (`policy.with_hopper_bwd_dq`).

    full: every head-dim bucket it takes (and MLA's V head dim of its own, `VALUE_DIM_PAIRS`) x
    dtype x every score-flag combination, dense and packed (with and without seqused_k), each
    also deterministic. Otherwise, for CI: every bucket causal (bf16), at d 128 no flag, each
    other flag alone, all together, and fp16; packed, every bucket causal and d 128 with every
    flag and seqused_k; deterministic at d 64 causal and d 128 with every flag, dense and
    packed; d 192 and 256 (the head dim split) with every flag, dense and packed, each also
    deterministic; MLA's 192 / 128 causal and with every flag, dense and packed, deterministic
    too; every dQ path (`DQ_PATHS`, on the bucket's tiles: `tune --bwd-dq`) at every bucket
    causal and at d 128 with every flag, packed; the converts of every bucket's tiles, dense and
    packed, and with a padded head dim at d 128, 192 and 256; the preprocess writing each
    bucket's padded LSE / D rows (`PreprocessConfig.hopper_rows`), dense and packed, and at d
    128, 192 and 256 with a padded head dim (full: every traits, all four)."""
    flags = ("has_left", "has_right", "has_alibi", "has_softcap", "has_dropout")
    if full:
        traits = [choose_hopper_bwd_traits(d, dt) for d in BWD_HEAD_DIMS for dt in DTYPES]
        traits += [choose_hopper_bwd_traits(d, dt, dv) for d, dv in VALUE_DIM_PAIRS for dt in DTYPES]
        mains = [Sm90BwdConfig(t, **dict(zip(flags, bits)), varlen=varlen, has_seqused_k=used) for t in traits
                 for bits in itertools.product((False, True), repeat=len(flags))
                 for varlen, used in ((False, False), (True, False), (True, True))]
        mains += [replace(c, deterministic=True) for c in mains]
        mains = [with_hopper_bwd_dq(c) for c in mains]
        converts = [DQConvertConfig.of_hopper(t, e, v) for t in traits for e in (False, True) for v in (False, True)]
        pre = [PreprocessConfig(dim, t.dtype, e, v, t.block_m) for t in traits for dim in {t.head_dim, t.dv}
               for e in (False, True) for v in (False, True)]
        return mains + list(dict.fromkeys(converts + pre))
    traits = [choose_hopper_bwd_traits(d) for d in BWD_HEAD_DIMS]
    pivot = choose_hopper_bwd_traits(128)
    mains = [Sm90BwdConfig(t, has_right=True) for t in traits]
    mains += [Sm90BwdConfig(pivot)] + [Sm90BwdConfig(pivot, **{f: True}) for f in flags if f != "has_right"]
    mains += [Sm90BwdConfig(pivot, **{f: True for f in flags}), Sm90BwdConfig(choose_hopper_bwd_traits(128, "fp16"))]
    # packed batches: every bucket causal, and at d 128 seqused_k with every flag
    mains += [Sm90BwdConfig(t, has_right=True, varlen=True) for t in traits]
    mains += [Sm90BwdConfig(pivot, **{f: True for f in flags}, varlen=True, has_seqused_k=True)]
    # deterministic: causal at d 64, every flag dense and packed at d 128
    mains += [Sm90BwdConfig(choose_hopper_bwd_traits(64), has_right=True, deterministic=True)]
    mains += [Sm90BwdConfig(pivot, **{f: True for f in flags}, varlen=v, deterministic=True) for v in (False, True)]
    # the d 192 and 256 tiles (the head dim split between the warpgroups): every flag, dense and packed,
    # deterministic too
    wide = [choose_hopper_bwd_traits(d) for d in (192, 256)]
    mains += [Sm90BwdConfig(t, **{f: True for f in flags}, varlen=v, deterministic=det)
              for t in wide for v in (False, True) for det in (False, True)]
    # MLA's V head dim of its own: causal and with every flag, dense and packed, deterministic too
    mla = [choose_hopper_bwd_traits(d, "bf16", dv) for d, dv in VALUE_DIM_PAIRS]
    mains += [Sm90BwdConfig(t, has_right=True, varlen=v) for t in mla for v in (False, True)]
    mains += [Sm90BwdConfig(t, **{f: True for f in flags}, varlen=v, deterministic=det)
              for t in mla for v in (False, True) for det in (False, True)]
    mains = [with_hopper_bwd_dq(c) for c in mains]
    # every dQ path on the bucket's tiles (`tune --bwd-dq`): every bucket causal, d 128 with every flag packed
    for path in DQ_PATHS:
        mains += [Sm90BwdConfig(t, has_right=True, dq_path=path) for t in traits]
        mains += [Sm90BwdConfig(pivot, **{f: True for f in flags}, varlen=True, dq_path=path)]
    mains = list(dict.fromkeys(mains))
    # the converts and preprocesses of the tiles the policy gives a bucket too (its query rows)
    traits = list(dict.fromkeys(traits + [c.traits for c in mains if c.traits.head_dim_v is None]))
    converts = [DQConvertConfig.of_hopper(t, True, v) for t in traits for v in (False, True)]
    converts += [DQConvertConfig.of_hopper(t, False, v) for t in (pivot, *wide) for v in (False, True)]
    # the preprocess, writing LSE and D in each bucket's padded rows, dense and packed (a padded head dim at d 128,
    # 192 and 256)
    pre = [PreprocessConfig(t.head_dim, t.dtype, True, v, t.block_m) for t in traits for v in (False, True)]
    return mains + converts + pre + [PreprocessConfig(t.head_dim, t.dtype, False, v, t.block_m)
                                     for t in (pivot, *wide) for v in (False, True)]


def order_variants() -> list[VarlenOrderConfig]:
    """The launch-order kernel's configs (`launch/varlen_order.py`): the forward's list and the
    backward's, with and without a right edge, and deterministic mode's descending one (which
    only a right edge asks for)."""
    return [VarlenOrderConfig(by_key, right) for by_key in (False, True) for right in (False, True)] + [
        VarlenOrderConfig(True, True, True)]


def every_variant(archs, full: bool = False) -> list[tuple[int, object]]:
    """(arch, config) for every kernel's variants on `archs` (80 and / or 90; the Hopper kernels
    on 90 only): what `python -m cute_flash compile` builds."""
    jobs = [(arch, config) for arch in archs for config in fwd_variants(arch, full)]
    jobs += [(arch, config) for arch in archs for config in append_variants(full) + packed_append_variants(full)]
    jobs += [(arch, config) for arch in archs for config in bwd_variants(arch, full)]
    if 90 in archs:
        jobs += [(90, config) for config in sm90_variants(full) + sm90_bwd_variants(full) + order_variants()]
    return jobs
