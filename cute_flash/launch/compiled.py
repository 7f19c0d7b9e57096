"""Compiled kernels on the host: the fake arguments a compile traces with, the in-process cache
(one compiled kernel per (config, arch)), and the variant lists that CI and
`python -m cute_flash compile` build.

A compile needs no GPU and no real tensors: placeholders carry dtypes, ranks, the stride
divisibility the launcher guarantees and a stream taken from the caller (torch's current
stream) at call time. Run-time values (lengths, strides, scales, window sizes, the split count)
never enter the key, so a model's whole run typically compiles a handful of kernels once.
"""
from __future__ import annotations

import functools
import itertools

import cutlass
from cute_flash.compile_cache import get_or_compile
from cute_flash.kernels.bwd import FlashBwd
from cute_flash.kernels.bwd_preprocess import DotDoO, PreprocessConfig
from cute_flash.kernels.bwd_sm90 import FlashBwdSm90, Sm90BwdConfig
from cute_flash.kernels.config import CACHE_FLAGS, SCORE_FLAGS, BwdConfig, FwdConfig, dq_reduction
from cute_flash.kernels.dq_accum import DQConvert, DQConvertConfig
from cute_flash.kernels.fake import compile_tvm_ffi, fake_stream, fake_tensor
from cute_flash.kernels.fwd import FlashFwd
from cute_flash.kernels.fwd_sm90 import FlashFwdSm90, Sm90FwdConfig
from cute_flash.launch import gpu
from cute_flash.launch.policy import (DEEP_PIPELINE_MAX_SEQLEN_K, KV_MULTICAST_MIN_SEQLEN_K,
                                      SPECULATIVE_IN_PLACE_LEFT_EDGE_MIN_SEQLEN_K, SPECULATIVE_MASKED_MIN_SEQLEN_K,
                                      SPECULATIVE_MASKED_MIN_SEQLEN_K_D64, cache_stages, kv_stages, speculates_in_place,
                                      takes_kv_multicast, takes_speculative_max)
from layouts.hopper import (BWD_HEAD_DIMS, choose_hopper_bwd_traits, choose_hopper_cache_traits, choose_hopper_traits,
                            shipped_hopper_cache_traits, shipped_hopper_traits)
from layouts.traits import ALIGN, COPY_BYTES, DTYPES, HEAD_DIM_BUCKETS, choose_bwd_traits, choose_decode_traits, \
    choose_fwd_traits, element_type


def fake_fwd_args(config: FwdConfig):
    """Placeholders for compiling `config`'s entry (`FlashFwd.__call__`, `call_varlen` or
    `call_kvcache`, in their parameter order): every extent dynamic, every element-tensor stride
    but the last a multiple of 8 (the launcher guarantees it), int32 vectors and tables dense in
    their last dim; None for every tensor the config does not read (the kernel is specialised on
    its absence, and the caller passes None there)."""
    dtype = element_type(config.traits)

    def elems(rank):
        return fake_tensor(dtype, rank, ALIGN, COPY_BYTES)

    def f32(rank, on=True):
        return fake_tensor(cutlass.Float32, rank) if on else None

    def i32(rank, on=True):
        return fake_tensor(cutlass.Int32, rank) if on else None

    scalars = [1.0, 1.0, 1.0, -1, -1, fake_stream()]  # scales, window edges, stream
    alibi = f32(2, config.has_alibi)
    rng = fake_tensor(cutlass.Uint32, 1) if config.has_dropout else None
    if config.entry == "varlen":
        kv_rank = 4 if config.paged else 3
        return ([elems(3), elems(kv_rank), elems(kv_rank), elems(3), f32(2), alibi, rng, i32(1), i32(1)]
                + [i32(1, config.has_seqused_k), i32(2, config.paged), 1] + scalars)
    if config.entry == "kvcache":
        split = config.split
        accum = (fake_tensor(cutlass.Float32, 5, ALIGN, COPY_BYTES, last_extent=config.traits.head_dim)
                 if split else None)
        return ([elems(4), elems(4), elems(4), elems(4), f32(3), accum, f32(4, split), i32(1, split), alibi, i32(1)]
                + [i32(1, config.has_leftpad), i32(1, config.has_batch_idx), i32(2, config.paged), 0, 1] + scalars)
    return [elems(4) for _ in range(4)] + [f32(3), alibi, rng] + scalars


def _fake_dq_accum(traits, varlen):
    """dQaccum: (slices, [batch,] heads, tiles, chunk), the chunk (kBlockM * kHeadDim) static."""
    return fake_tensor(cutlass.Float32, 4 if varlen else 5, ALIGN, COPY_BYTES,
                       last_extent=traits.block_m * traits.head_dim)


def fake_bwd_args(config: BwdConfig):
    """Placeholders for `FlashBwd.__call__` / `call_varlen` in parameter order (as
    `fake_fwd_args`)."""
    dtype = element_type(config.traits)
    rank = 3 if config.varlen else 4

    def elems():
        return fake_tensor(dtype, rank, ALIGN, COPY_BYTES)

    def f32(r):
        return fake_tensor(cutlass.Float32, r)

    accum = _fake_dq_accum(config.traits, config.varlen)
    tensors = [elems() for _ in range(4)] + [f32(rank - 1), f32(rank - 1), accum, elems(), elems(),
                                             f32(2) if config.has_alibi else None,
                                             fake_tensor(cutlass.Uint32, 1) if config.has_dropout else None]
    if config.varlen:
        i32 = fake_tensor(cutlass.Int32, 1)
        tensors += [i32, fake_tensor(cutlass.Int32, 1), fake_tensor(cutlass.Int32, 1) if config.has_seqused_k else None]
    return tensors + [1.0, 1.0, 1.0, 1.0, -1, -1, 1, fake_stream()]


def fake_preprocess_args(config: PreprocessConfig):
    """Placeholders for `DotDoO.__call__` / `call_varlen`."""
    rank = 3 if config.varlen else 4
    elems = [fake_tensor(element_type(config.dtype), rank, ALIGN, COPY_BYTES) for _ in range(2)]
    lens = [fake_tensor(cutlass.Int32, 1), 1] if config.varlen else []
    return elems + [fake_tensor(cutlass.Float32, rank - 1)] + lens + [fake_stream()]


def fake_convert_args(config: DQConvertConfig):
    """Placeholders for `DQConvert.__call__` / `call_varlen`."""
    dq = fake_tensor(element_type(config.traits), 3 if config.varlen else 4, ALIGN, COPY_BYTES)
    lens = [fake_tensor(cutlass.Int32, 1), 1] if config.varlen else []
    return [_fake_dq_accum(config.traits, config.varlen), dq] + lens + [1.0, fake_stream()]


def fake_bwd_sm90_args(config: Sm90BwdConfig):
    """Placeholders for `FlashBwdSm90.__call__`: LSE and D rows padded to whole query blocks
    (strides multiples of 4 floats: 16 bytes, what their bulk copies need)."""
    dtype = element_type(config.traits)
    elems = [fake_tensor(dtype, 4, ALIGN, COPY_BYTES) for _ in range(4)]
    stats = [fake_tensor(cutlass.Float32, 3, 4, COPY_BYTES) for _ in range(2)]
    grads = [fake_tensor(dtype, 4, ALIGN, COPY_BYTES) for _ in range(2)]
    alibi = fake_tensor(cutlass.Float32, 2) if config.has_alibi else None
    rng = fake_tensor(cutlass.Uint32, 1) if config.has_dropout else None
    return (elems + stats + [_fake_dq_accum(config.traits, False)] + grads
            + [alibi, rng, 1.0, 1.0, 1.0, 1.0, -1, -1, fake_stream()])


def compile_bwd(config: BwdConfig | PreprocessConfig | DQConvertConfig | Sm90BwdConfig, arch: int | None = None,
                extra_options: str = ""):
    """Build a backward kernel (the main one, SM80 or Hopper, the preprocess or the dQ convert)
    as `compile_fwd` does."""
    if isinstance(config, Sm90BwdConfig):
        return compile_tvm_ffi(FlashBwdSm90(config), fake_bwd_sm90_args(config), arch, extra_options)
    if isinstance(config, PreprocessConfig):
        kernel, args = DotDoO(config), fake_preprocess_args(config)
    elif isinstance(config, DQConvertConfig):
        kernel, args = DQConvert(config), fake_convert_args(config)
    else:
        kernel, args = FlashBwd(config), fake_bwd_args(config)
    entry = kernel.call_varlen if config.varlen else kernel
    return compile_tvm_ffi(entry, args, arch, extra_options)


@functools.lru_cache(maxsize=None)
def bwd_kernel_for(config: BwdConfig | PreprocessConfig | DQConvertConfig | Sm90BwdConfig, device_index: int):
    """The TVM-FFI function of a backward config for the device's arch (memoised per device)."""
    arch = gpu.device_arch(device_index)
    return get_or_compile((config, arch), lambda: compile_bwd(config, arch))


def entry_point(kernel: FlashFwd):
    """The jit function a config compiles: `__call__` (dense), `call_varlen` or `call_kvcache`."""
    return {"dense": kernel, "varlen": kernel.call_varlen, "kvcache": kernel.call_kvcache}[kernel.config.entry]


def compile_fwd(config: FwdConfig, arch: int | None = None, extra_options: str = ""):
    """Build the cubin for `config`, callable through TVM-FFI with torch tensors. arch=None
    targets the current GPU; an explicit arch (80, 90) needs no GPU (nothing is launched)."""
    return compile_tvm_ffi(entry_point(FlashFwd(config)), fake_fwd_args(config), arch, extra_options)


def compile_fwd_sm90(config: Sm90FwdConfig, arch: int | None = 90, extra_options: str = ""):
    """Build the Hopper forward of `config` (sm_90a; placeholders as `fake_fwd_args`): the
    dense entry, `call_varlen` for packed batches or `call_kvcache` for KV caches."""
    dtype = element_type(config.traits)
    kernel = FlashFwdSm90(config)
    if config.varlen:  # keys packed (total_k, heads_k, d) or in pages (num_pages, page_size, heads_k, d)
        kv_rank = 4 if config.paged else 3
        args = [fake_tensor(dtype, r, ALIGN, COPY_BYTES) for r in (3, kv_rank, kv_rank, 3)] + [
            fake_tensor(cutlass.Float32, 2), fake_tensor(cutlass.Float32, 2) if config.has_alibi else None,
            fake_tensor(cutlass.Uint32, 1) if config.has_dropout else None, fake_tensor(cutlass.Int32, 1),
            fake_tensor(cutlass.Int32, 1), fake_tensor(cutlass.Int32, 1) if config.has_seqused_k else None,
            fake_tensor(cutlass.Int32, 2) if config.paged else None, 1, 1.0, 1.0, 1.0, -1, -1, fake_stream()]
        return compile_tvm_ffi(kernel.call_varlen, args, arch, extra_options)
    if config.kvcache:
        split = [fake_tensor(cutlass.Float32, 5, ALIGN, COPY_BYTES, last_extent=config.traits.head_dim),
                 fake_tensor(cutlass.Float32, 4), fake_tensor(cutlass.Int32, 1)] \
            if config.split and not config.cluster_merge else [None] * 3  # a cluster merges in shared memory
        # the SM80 entry's parameters; cache_leftpad and cache_batch_idx are None here
        alibi = fake_tensor(cutlass.Float32, 2) if config.has_alibi else None
        table = fake_tensor(cutlass.Int32, 2) if config.paged else None
        args = ([fake_tensor(dtype, 4, ALIGN, COPY_BYTES) for _ in range(4)] + [fake_tensor(cutlass.Float32, 3)]
                + split + [alibi, fake_tensor(cutlass.Int32, 1), None, None, table, 0, 2]
                + [1.0, 1.0, 1.0, -1, -1, fake_stream()])
        return compile_tvm_ffi(kernel.call_kvcache, args, arch, extra_options)
    args = [fake_tensor(dtype, 4, ALIGN, COPY_BYTES) for _ in range(4)] + [
        fake_tensor(cutlass.Float32, 3), fake_tensor(cutlass.Float32, 2) if config.has_alibi else None,
        fake_tensor(cutlass.Uint32, 1) if config.has_dropout else None, fake_tensor(cutlass.Int32, 1),
        1.0, 1.0, 1.0, -1, -1, 1, 132, fake_stream()]
    return compile_tvm_ffi(kernel, args, arch, extra_options)


@functools.lru_cache(maxsize=None)
def sm90_kernel_for(config: Sm90FwdConfig):
    """The TVM-FFI function of a Hopper forward config, through the compile cache."""
    return get_or_compile((config, 90), lambda: compile_fwd_sm90(config, 90))


def cached_fwd(config: FwdConfig, arch: int):
    """The TVM-FFI function of `config` on `arch`, compiled or taken from the compile cache
    (memory, then disk); None where no GPU can load it."""
    return get_or_compile((config, arch), lambda: compile_fwd(config, arch))


@functools.lru_cache(maxsize=None)
def kernel_for(config: FwdConfig, device_index: int):
    """The TVM-FFI function of `config` for the device's arch, called positionally (memoised
    per device: a cached call hashes the config once)."""
    return cached_fwd(config, gpu.device_arch(device_index))


def fwd_variants(arch: int, full: bool = False) -> list[FwdConfig]:
    """Configs the dispatcher can choose on `arch`.

    full: every forward traits times every dense and varlen flag combination, and every
    KV-cache traits times every cache flag combination (causal or not).
    Otherwise a covering subset for CI (a compile takes 5-20 s on its 2 cores): every head-dim
    bucket of both kernels (forward and KV-cache), fp16 on sm_80 and bf16 on sm_90 (the dtype
    only changes the MMA atom); the varlen, seqused_k and paged variants (pages of a multiple of
    16 rows, and of any size); dropout, dense and varlen; and on sm_90 each score flag alone and
    all together, each cache flag alone, and the split + paged pair with both page forms.
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
        varlen = [dict(f, varlen=True, has_seqused_k=u, paged=p, any_page_size=a) for f in combos
                  for u in (False, True) for p in (False, True) for a in (False, True) if p or not a]
        cache = [dict(has_right=r, kvcache=True, **c) for r in (False, True) for c in cache_flags
                 if not (r and c["pack_gqa"])]
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
               (pivot, dict(causal, has_dropout=True)), (pivot, dict(causal, varlen=True, has_dropout=True))]
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
    from cute_flash.kernels.append import AppendConfig

    if not full:
        return [AppendConfig("fp16", False, False, False, False, False),
                AppendConfig("fp16", False, True, True, True, False),
                AppendConfig("fp16", True, False, True, False, True)]
    layouts = [(False, False), (False, True), (True, False)]
    rotary = [(False, False, False)] + [(True, i, q) for i in (False, True) for q in (False, True)]
    return [AppendConfig(dt, *lay, *rot) for dt in DTYPES for lay in layouts for rot in rotary]


BWD_FLAGS = ("has_left", "has_right", "has_alibi", "has_softcap", "has_dropout", "even_k", "deterministic")


def sm90_variants(full: bool = False) -> list[Sm90FwdConfig]:
    """The Hopper forward configs the sm_90 dispatcher can choose (launch/hopper.py).

    full: every shipped traits (layouts.hopper.shipped_hopper_traits) times every score-flag
    combination, in each schedule `prefers_persistent` can choose for it (dropout not on
    192-row tiles, which the launcher does not give it), with and without speculative maxima
    where the key count decides (`takes_speculative_max`), persistent with three K / V stages
    where `kv_stages` gives short keys them, the packed-batch entry of every 128-row traits
    with and without seqused_k, paged and not, and the KV-cache entry of every bucket and dtype
    with every score flag but dropout, split and not, paged and not, GQA-folded and not (the
    fold without window edges or ALiBi), at one CTA an SM and (up to `TWO_CTAS_MAX_HEAD_DIM`)
    two, at the K / V stages `policy.cache_stages` gives each. Otherwise the CI subset: every
    bucket in bf16 with a causal edge (the persistent variant where it fits, so both schedules
    compile; speculative maxima, as at 1024 keys and more), d 64's 192-row tiles likewise
    (speculating in place, as under a causal mask at any length), d 64 causal with three K / V
    stages (as up to 1024 keys), d 128 in fp16, d 128 with every score flag on, dropout at d 64
    (causal, one CTA per tile) and d 128 (persistent), packed batches (d 128 causal, d 96 with
    seqused_k, d 64 fp16 with every flag, d 128 causal over pages) and KV caches (d 128 plain, d
    64 split with softcap at its three stages, d 128 split, paged and GQA-folded, d 256 fp16
    with every flag, d 128 GQA-folded at two CTAs an SM), and d 128 with K / V multicast (as
    without a mask from 2048 keys)."""
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
                for spec in sorted(specs):
                    kinds = {"speculative_max": spec, "speculative_in_place": spec and speculates_in_place(t)}
                    if t.warpgroups != 3 or not Sm90FwdConfig.fits_persistent(t):
                        out.append(Sm90FwdConfig(t, **kinds, **flags))
                    if Sm90FwdConfig.fits_persistent(t):
                        out.append(Sm90FwdConfig(t, persistent=True, **kinds, **flags))
                    if kv_stages(t, DEEP_PIPELINE_MAX_SEQLEN_K, True) == 3:  # short keys
                        out.append(Sm90FwdConfig(t, 3, persistent=True, **kinds, **flags))
                    masked = flags["has_left"] or flags["has_right"]
                    # multicast as the launcher takes it: two query blocks, long keys, persistent
                    if Sm90FwdConfig.fits_persistent(t) and takes_kv_multicast(t, 2 * t.block_m, KV_MULTICAST_MIN_SEQLEN_K,
                                                                               masked, True, dropout):
                        out.append(Sm90FwdConfig(t, persistent=True, kv_multicast=True, **kinds, **flags))
                if t.warpgroups != 3:
                    out += [Sm90FwdConfig(t, varlen=True, has_seqused_k=u, paged=p, **flags)
                            for u in (False, True) for p in (False, True)]
        for ctas in (1, 2):
            for t in shipped_hopper_cache_traits(ctas):
                for bits in itertools.product((False, True), repeat=4):
                    flags = dict(zip(("has_left", "has_right", "has_alibi", "has_softcap"), bits))
                    # the GQA fold only without window edges or ALiBi (launch/kvcache.py)
                    folds = (False,) if flags["has_left"] or flags["has_right"] or flags["has_alibi"] else (False, True)
                    out += [Sm90FwdConfig(t, cache_stages(t, ctas), kvcache=True, split=s, cluster_merge=m,
                                          stream_k=w, paged=p, pack_gqa=f, ctas_per_sm=ctas, dependent_launch=pdl,
                                          **flags)
                            for s, m, w in ((False, False, False), (True, False, False), (True, True, False),
                                            (True, False, True))
                            for p in (False, True) for f in folds
                            # stream-K fills every slot; two CTAs an SM stream at most 4096 keys each
                            for pdl in ((False, True) if ctas == 1 and not w else (True,))]
        return out
    traits = [choose_hopper_traits(d, "bf16") for d in HEAD_DIM_BUCKETS]
    d64, cache64 = choose_hopper_traits(64, "bf16"), choose_hopper_cache_traits(64, "bf16")
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
                  Sm90FwdConfig(choose_hopper_traits(96, "bf16"), varlen=True, has_seqused_k=True),
                  Sm90FwdConfig(choose_hopper_traits(128, "bf16"), has_right=True, varlen=True, paged=True),
                  Sm90FwdConfig(choose_hopper_traits(64, "fp16"), has_left=True, has_alibi=True, has_softcap=True,
                                has_dropout=True, varlen=True),
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
                                ctas_per_sm=2, dependent_launch=True)]


@functools.cache
def sm90_traits_stages() -> tuple:
    """Every (traits, K / V stages) pair of a Hopper forward variant the dispatcher can choose
    (`sm90_variants(full=True)`: about 9k configs, built in a tenth of a second), sorted by
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
    """Hopper backward configs (main kernel and its dQ convert) the dispatcher can choose.

    full: every head-dim bucket it takes x dtype x every score-flag combination. Otherwise, for
    CI: every bucket causal (bf16), at d 128 no flag, each other flag alone, all together, and
    fp16; the converts of every bucket's tiles, and with a padded head dim at d 128."""
    flags = ("has_left", "has_right", "has_alibi", "has_softcap", "has_dropout")
    if full:
        traits = [choose_hopper_bwd_traits(d, dt) for d in BWD_HEAD_DIMS for dt in DTYPES]
        mains = [Sm90BwdConfig(t, **dict(zip(flags, bits))) for t in traits
                 for bits in itertools.product((False, True), repeat=len(flags))]
        return mains + [DQConvertConfig(t, e, False, 4, hopper=True) for t in traits for e in (False, True)]
    traits = [choose_hopper_bwd_traits(d) for d in BWD_HEAD_DIMS]
    pivot = choose_hopper_bwd_traits(128)
    mains = [Sm90BwdConfig(t, has_right=True) for t in traits]
    mains += [Sm90BwdConfig(pivot)] + [Sm90BwdConfig(pivot, **{f: True}) for f in flags if f != "has_right"]
    mains += [Sm90BwdConfig(pivot, **{f: True for f in flags}), Sm90BwdConfig(choose_hopper_bwd_traits(128, "fp16"))]
    converts = [DQConvertConfig(t, True, False, 4, hopper=True) for t in traits]
    return mains + converts + [DQConvertConfig(pivot, False, False, 4, hopper=True)]


def compiler_of(config):
    """The compile function of a config of any kernel (`python -m cute_flash compile --keys`)."""
    from cute_flash.kernels.append import AppendConfig, compile_append

    bwd = (BwdConfig, PreprocessConfig, DQConvertConfig, Sm90BwdConfig)
    for kinds, fn in (((FwdConfig,), compile_fwd), (bwd, compile_bwd),
                      ((AppendConfig,), compile_append), ((Sm90FwdConfig,), compile_fwd_sm90)):
        if isinstance(config, kinds):
            return fn
    raise TypeError(f"no kernel compiles a {type(config).__name__}")


def cached_append(config, arch: int):
    """The TVM-FFI function of an append config on `arch`, through the compile cache."""
    from cute_flash.kernels.append import compile_append

    return get_or_compile((config, arch), lambda: compile_append(config, arch))
