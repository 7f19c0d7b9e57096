"""`flash_attn_with_kvcache` on the host: per-signature call setup, the split-KV workspace, the
append launch, then one attention launch (split partials merged inside it).

A decode loop repeats one signature (the interface's summary of every argument's metadata and
options), and deciding from the arguments costs more host time than launching, so what a call
decides from metadata alone is kept per signature and kernel path (`KVCacheCall`): the config
and its compiled kernel, the split count, the scalars. Workspaces are kept per (call, stream).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cute_flash.kernels.common.split_kv import StreamSplit, workspace_shapes
from cute_flash.kernels.sm80.append import AppendConfig
from cute_flash.kernels.sm80.append_packed import PackedAppendConfig
from cute_flash.kernels.sm80.fwd import FwdConfig
from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
from cute_flash.launch import compiled, gpu
from cute_flash.launch.align import aligned, is_aligned
from cute_flash.launch.args import (alibi_2d, positive_scale, positive_scale_value, scales, score_flags, sink_logits,
                                   window_edges)
from cute_flash.launch.batch_chunks import batch_chunks, chunked, rows_of, slopes_of, splits_within_grid
from cute_flash.launch.clusters import resident_clusters
from cute_flash.launch.per_stream import per_stream, zeroed_counters
from cute_flash.launch.policy import (CLUSTER_MAX_SPLITS, PAGE_ROWS, arch_path, cache_stages, hopper_cache_fits,
                                      query_fold_group, split_choice, takes_dependent_launch, takes_hopper_path,
                                      takes_pack_gqa, takes_two_ctas_per_sm)
from layouts.hopper import choose_hopper_cache_traits, choose_hopper_latent_traits
from layouts.traits import ALIGN, LATENT_DIMS, choose_decode_traits, tile_arch


@dataclass(frozen=True, eq=False)
class KVCachePlan:
    """Everything a KV-cache call decides from its shapes and options alone. Compared and hashed
    by identity: it keys the workspace cache on every call, and calls of one signature share
    one plan."""
    config: object   # FwdConfig, or Sm90FwdConfig (the Hopper KV-cache entry)
    num_splits: int  # CTAs a tile (stream-K: the most any tile has, the workspace's split extent)
    launch: object   # the compiled kernel's TVM-FFI function (either kernel's call_kvcache), called positionally
    batch: int
    nheads: int      # (heads, seqlen_q) as the caller has them
    seqlen_q: int
    rows: int        # (rows, heads) as the kernel tiles them: (g, nheads_k) with pack_gqa, (g x seqlen_q,
    heads: int       # nheads_k) with a query fold
    m_blocks: int
    query_group: int = 1  # g > 1: q folded on the host (`fold_queries`), the kernel's O and LSE unfolded

    @property
    def lse_shape(self) -> tuple:
        """The LSE the kernel writes: the caller's (batch, nheads, seqlen_q), or the folded rows'
        (batch, nheads_k, g x seqlen_q) under a query fold (pack_gqa folds it in the kernel)."""
        if self.query_group > 1:
            return (self.batch, self.heads, self.rows)
        return (self.batch, self.nheads, self.seqlen_q)

    @property
    def traits(self):
        """FwdTraits, or HopperTileTraits for the Hopper entry."""
        return self.config.traits

    @property
    def global_partials(self) -> bool:
        """Splits that merge through global memory: not the Hopper entry's cluster merge."""
        return self.config.split and not (isinstance(self.config, Sm90FwdConfig) and self.config.cluster_merge)


@dataclass(frozen=True)
class KVCacheCall:
    """What a KV-cache call decides from its arguments' metadata and options, kept per signature."""
    plan: KVCachePlan
    device: torch.device
    index: int
    realign: bool    # q's rows break 128-bit copies: take `aligned`'s copy
    seqlens: object  # the (batch,) int32 tensor standing for an int (or absent) cache_seqlens
    append: bool     # k, v (or rotary) given: launch the append kernel first
    q_per_row: bool  # rotary angle of q row i at cache_seqlens + i (causal or local)
    scalars: tuple   # k_extra, num_splits, scales, window edges


_calls: dict = {}
_CALLS_MAX = 4096


def flash_fwd_kvcache(q, k_cache, v_cache, *, k=None, v=None, rotary_cos=None, rotary_sin=None,
                      cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                      softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0,
                      rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_lse=True,
                      learnable_sink=None, signature=None, hopper_variant=None, folded_q=False):
    """`flash_attn_with_kvcache` on validated CUDA tensors: append (rotary) k/v into the caches in
    place, then split-KV attention over them, merged in the same launch. Returns (out, lse (b, h,
    sq)), lse None unless return_lse. `learnable_sink` (h,): a logit per head in each row's
    denominator, added by either kernel's epilogue (its config's `learnable_sink`). `signature`:
    the interface's summary of every argument's metadata and options (`_validate.signature`);
    calls that share one share their setup.
    `hopper_variant` (tuning, `python -m cute_flash tune --decode` / `--splits`): dict(traits=
    HopperTileTraits, ctas_per_sm=1 or 2, stream_ctas=CTAs of a stream-K launch, dependent_launch=
    bool, stages=K / V pipeline depth) for the Hopper entry in place of its own choice, on a call
    it takes. `folded_q`: each row of q holds its heads in the order of the call's query fold g
    (`kvcache_query_group`, g > 1; the packed call's packing launch writes them so): no fold
    copy, and out (b, g sq, h / g, d) and lse (b, h / g, g sq) come back folded."""
    b, sq, h, d = q.shape
    if chunked(b):  # launch/batch_chunks.py
        return _by_batch_chunks(q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                                cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=softmax_scale,
                                causal=causal, window_size=window_size, softcap=softcap,
                                rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
                                num_splits=num_splits, return_lse=return_lse, learnable_sink=learnable_sink,
                                hopper_variant=hopper_variant)
    q, softmax_scale, _ = positive_scale(q, softmax_scale)  # rotary is linear: it commutes with -q
    call = _call_of(q, k_cache, v_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                    causal, window_size, softcap, alibi_slopes, rotary_cos, num_splits, learnable_sink, signature,
                    hopper_variant)
    if call is None:
        # Caches whose rows break 128-bit copies (a head dim not a multiple of 8, strides or a
        # base address off 16 bytes): work on aligned copies, zero-padded as flash-attn pads,
        # then copy the caches back if the call appended to them. Only appended rows differ, but
        # a whole-cache copy needs no index built from cache_seqlens (which may be bad metadata);
        # the cost (3-8x an aligned call) is in docs/tuning/varlen-paged.md.
        k_al, v_al = aligned(k_cache), aligned(v_cache)
        if d % ALIGN:
            q, k, v = (None if x is None else aligned(x) for x in (q, k, v))
        out, lse = flash_fwd_kvcache(
            q, k_al, v_al, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
            block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
            num_splits=num_splits, return_lse=return_lse, learnable_sink=learnable_sink)
        if k is not None:
            k_cache.copy_(k_al[..., :d])
            v_cache.copy_(v_al[..., :d])
        return out[..., :d], lse
    plan, index = call.plan, call.index
    if call.realign:
        q = aligned(q)
    seqlens = cache_seqlens if call.seqlens is None else call.seqlens
    if call.append:
        q = _append(q, k, v, k_cache, v_cache, seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
                    rotary_interleaved, call.q_per_row, index)

    group = plan.query_group
    if folded_q and group == 1:
        raise ValueError("folded_q: q's heads come in the order of a query fold this call does not take")
    if group > 1:
        q = q.view(b, sq * group, h // group, d) if folded_q else fold_queries(q, group)
    d_v = v_cache.shape[-1]
    out = torch.empty((b, plan.rows, plan.heads, d_v) if group > 1 else (b, sq, h, d_v), dtype=q.dtype,
                      device=call.device)
    o_acc, lse_acc, counters, lse = _workspace(plan, call.device)
    if return_lse:
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=call.device)
    plan.launch(q, k_cache, v_cache, out, lse, o_acc, lse_acc, counters, alibi_2d(alibi_slopes, b, h),
                sink_logits(learnable_sink), seqlens, cache_leftpad, cache_batch_idx, block_table, *call.scalars)
    if group > 1 and not folded_q:
        out, lse = unfold_rows(out, lse if return_lse else None, group)
    return out, (lse if return_lse else None)


def _call_of(q, k_cache, v_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale,
             causal, window_size, softcap, alibi_slopes, rotary_cos, num_splits, learnable_sink, signature,
             hopper_variant) -> KVCacheCall | None:
    """The call's setup (`KVCacheCall`), kept per signature and kernel path; None where the
    caches break 128-bit copies (the call works on aligned copies of them)."""
    key = None if signature is None else (signature, arch_path())  # the path picks the kernel
    call = _calls.get(key) if key is not None else None
    if call is None:
        if not (is_aligned(k_cache) and is_aligned(v_cache)):
            return None
        call = _kvcache_call(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, rotary_cos, num_splits,
                             learnable_sink is not None, hopper_variant,
                             latent=(q.shape[-1], v_cache.shape[-1]) == LATENT_DIMS)
        if key is not None:
            if len(_calls) >= _CALLS_MAX:
                _calls.clear()
            _calls[key] = call
    return call


def kvcache_query_group(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal=False,
                        window_size=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=0, learnable_sink=None,
                        signature=None) -> int:
    """The query fold g that `flash_fwd_kvcache` takes on these arguments (no new keys, no
    rotary: the packed call's attention), 1 for none or where it works on copies (caches that
    break 128-bit copies, batches past the grid limit): the packed call's packing launch writes
    its queries in that order (`pack_kvcache_queries(fold=)`), and the call takes them with
    `folded_q`. Keeps the call's setup under `signature`, which that call then finds."""
    if chunked(q.shape[0]):
        return 1
    call = _call_of(q, k_cache, v_cache, None, cache_seqlens, None, None, block_table,
                    positive_scale_value(softmax_scale), causal,
                    window_size, softcap, alibi_slopes, None, num_splits, learnable_sink, signature, None)
    return 1 if call is None else call.plan.query_group


def fold_queries(q: torch.Tensor, group: int) -> torch.Tensor:
    """q (batch, sq, heads, d) as (batch, sq x g, heads / g, d), a copy: row j + g i of K / V head
    kh holds query i of head kh g + j, so a tile's rows are a few queries of a whole GQA group
    (`Sm90FwdConfig.query_group`)."""
    b, sq, h, d = q.shape
    return q.view(b, sq, h // group, group, d).transpose(2, 3).reshape(b, sq * group, h // group, d)


def unfold_rows(out: torch.Tensor, lse, group: int):
    """The kernel's folded O (batch, sq x g, heads_k, d) and LSE (batch, heads_k, sq x g) (or
    None) back to (batch, sq, heads, d) and (batch, heads, sq)."""
    b, rows, hk, d = out.shape
    sq = rows // group
    out = out.view(b, sq, group, hk, d).transpose(2, 3).reshape(b, sq, hk * group, d)
    if lse is not None:
        lse = lse.view(b, hk, sq, group).transpose(2, 3).reshape(b, hk * group, sq)
    return out, lse


def _by_batch_chunks(q, k_cache, v_cache, *, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                     alibi_slopes, return_lse, **options):
    """`flash_fwd_kvcache` over consecutive chunks of at most GRID_MAX_BATCH sequences. A
    chunk's caches are its rows of contiguous ones; through cache_batch_idx or block_table it
    takes its rows of those and the whole caches. Appends land in the caller's caches."""
    whole = cache_batch_idx is not None or block_table is not None
    parts = []
    for s in batch_chunks(q.shape[0]):
        parts.append(flash_fwd_kvcache(
            q[s], k_cache if whole else k_cache[s], v_cache if whole else v_cache[s], k=rows_of(k, s), v=rows_of(v, s),
            cache_seqlens=cache_seqlens[s] if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens,
            cache_batch_idx=rows_of(cache_batch_idx, s), cache_leftpad=rows_of(cache_leftpad, s),
            block_table=rows_of(block_table, s), alibi_slopes=slopes_of(alibi_slopes, s), return_lse=return_lse,
            **options))
    return torch.cat([out for out, _ in parts]), (torch.cat([lse for _, lse in parts]) if return_lse else None)


def _kvcache_call(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                  causal, window_size, softcap, alibi_slopes, rotary_cos, num_splits, sink, hopper_variant=None,
                  latent=False):
    """`latent`: MLA decode (`layouts.traits.LATENT_DIMS`), on the Hopper entry's latent tiles only."""
    b, sq, h, d = q.shape
    device = q.device
    index = gpu.device_index(device)
    paged = block_table is not None
    hk = k_cache.shape[2]
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    seqlens = None
    if not isinstance(cache_seqlens, torch.Tensor):  # the (batch,) int32 tensor the kernels read
        seqlens = torch.full((b,), capacity if cache_seqlens is None else cache_seqlens, dtype=torch.int32,
                             device=device)
    left, right = window_edges(causal, window_size)
    pack_gqa = takes_pack_gqa(sq, h, hk, left, right, alibi_slopes is not None)
    rows, heads = (h // hk, hk) if pack_gqa else (sq, h)
    hopper = takes_hopper_path(index)
    variant = hopper_variant or {}
    group = 1
    if latent:  # no tuning variant: the latent tiles are the one choice
        traits, variant = choose_hopper_latent_traits(gpu.DTYPE_NAMES[q.dtype]), {}
        _latent_fits(hopper, k_cache.shape[1] if paged else None, traits)
    elif hopper:
        traits = variant.get("traits") or choose_hopper_cache_traits(d, gpu.DTYPE_NAMES[q.dtype])
        hopper = hopper_cache_fits(cache_leftpad is not None, cache_batch_idx is not None,
                                   k_cache.shape[1] if paged else None, traits)
    if hopper and not pack_gqa:
        group = query_fold_group(sq, h, hk, alibi_slopes is not None, traits.block_m)
        if group > 1:
            rows, heads = sq * group, hk
    if not hopper:
        traits = choose_decode_traits(d, gpu.DTYPE_NAMES[q.dtype], tile_arch(gpu.device_arch(index)))
    # CTAs an SM: the SM80 kernel's 2; the Hopper entry's CTA takes 144-160 KB of shared memory,
    # or half an SM's with 64-key blocks (`takes_two_ctas_per_sm`)
    ctas_per_sm = variant.get("ctas_per_sm", 1) if hopper else 2
    m_blocks = -(-rows // traits.block_m)
    work_ctas, num_sms = b * heads * m_blocks, gpu.num_sms(index)
    if latent:
        num_splits = 1  # the latent tiles' split partials and merges are not built (O 512 wide)
    elif hopper and not variant and num_splits <= 1 and takes_two_ctas_per_sm(work_ctas, num_sms, capacity, d):
        traits, ctas_per_sm = choose_hopper_cache_traits(d, gpu.DTYPE_NAMES[q.dtype], ctas_per_sm=2), 2
    n_blocks = -(-capacity // traits.block_n)
    stream_ctas = variant.get("stream_ctas", 0) if hopper else 0
    if num_splits == 0 and not stream_ctas:  # the Hopper entry's splits of up to CLUSTER_MAX_SPLITS merge in a cluster
        clusters = resident_clusters(index, ctas_per_sm, CLUSTER_MAX_SPLITS) if hopper else None
        choice = split_choice(work_ctas, num_sms, n_blocks, ctas_per_sm=ctas_per_sm, clusters=clusters)
        num_splits = choice.num_splits
        if hopper and choice.stream_k:  # stream-K over every SM slot in place of the many-wave splits
            stream_ctas = ctas_per_sm * num_sms
    if stream_ctas:
        num_splits = StreamSplit(work_ctas, stream_ctas).max_splits()
    cap = min(n_blocks, 128)
    if not hopper:  # the SM80 kernel's grid z holds splits x heads; the Hopper entry's x holds the splits
        cap = min(cap, splits_within_grid(heads))
    if not stream_ctas:
        num_splits = max(1, min(num_splits, cap))
    flags = score_flags(left, right, alibi_slopes, softcap)
    if hopper:
        ctas = stream_ctas or work_ctas * num_splits
        keys_per_cta = -(-n_blocks * work_ctas // ctas) * traits.block_n  # a split's keys, or a stream-K share's
        pdl = takes_dependent_launch(ctas, ctas_per_sm * num_sms, keys_per_cta)
        stages = variant.get("stages", cache_stages(traits, ctas_per_sm))
        config = Sm90FwdConfig(traits, stages, kvcache=True,
                               split=num_splits > 1 or bool(stream_ctas), paged=paged,
                               pack_gqa=pack_gqa, query_group=group, ctas_per_sm=ctas_per_sm,
                               stream_k=bool(stream_ctas),
                               cluster_merge=not stream_ctas and 1 < num_splits <= CLUSTER_MAX_SPLITS,
                               dependent_launch=variant.get("dependent_launch", pdl), learnable_sink=sink, **flags)
    else:
        config = FwdConfig(traits, **flags, even_k=d == traits.head_dim, paged=paged,
                           any_page_size=paged and k_cache.shape[1] % PAGE_ROWS != 0, kvcache=True,
                           split=num_splits > 1, has_leftpad=cache_leftpad is not None,
                           has_batch_idx=cache_batch_idx is not None, pack_gqa=pack_gqa, learnable_sink=sink)
    launch = compiled.kernel_for(config, index)
    plan = KVCachePlan(config, num_splits, launch, b, h, sq, rows, heads, m_blocks, group)
    append = k is not None and (k.shape[1] > 0 or rotary_cos is not None)  # an empty grid cannot launch
    k_extra = 0 if k is None else k.shape[1]
    return KVCacheCall(plan, device, index, not is_aligned(q), seqlens, append, causal or left >= 0 or right >= 0,
                       (k_extra, stream_ctas or num_splits, *scales(softmax_scale, softcap), left, right))


def _latent_fits(hopper: bool, page_size: int | None, traits):
    """MLA decode runs on the Hopper entry's latent tiles alone: on sm_90, and in pages the entry
    takes (`hopper_cache_fits`; cache_leftpad and cache_batch_idx the interface refused)."""
    if not hopper:
        raise ValueError("MLA decode (q / k_cache 576, v_cache 512) runs on the Hopper KV-cache kernel only: an "
                         "sm_90 GPU, without CUTE_FLASH_ARCH_PATH=sm80")
    if not hopper_cache_fits(False, False, page_size, traits):
        raise ValueError(f"MLA decode takes pages of a multiple of {traits.block_n} rows, got page_size {page_size}")


def _append(q, k, v, k_cache, v_cache, seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
            interleaved, q_per_row, index):
    """Launch the append kernel (rotary k into the caches; returns q, rotated when rotary)."""
    rotary = rotary_cos is not None
    k, v = k.contiguous(), v.contiguous()
    q_new = torch.empty_like(q) if rotary else None
    cos = rotary_cos.contiguous() if rotary else None
    sin = rotary_sin.contiguous() if rotary else None
    config = AppendConfig(gpu.DTYPE_NAMES[q.dtype], block_table is not None, cache_batch_idx is not None, rotary,
                          bool(interleaved), q_per_row)
    append = compiled.kernel_for(config, index)
    append(k, v, k_cache, v_cache, seqlens, cache_batch_idx, block_table, cos, sin, q, q_new)
    return q_new if rotary else q


def pack_kvcache_queries(q, q_pad, lengths, k_cache, v_cache, k, v, cu_seqlens_q, cu_seqlens_k_new, cache_seqlens,
                         block_table, rotary, per_row: bool, fold: int = 1):
    """Packed queries' setup around the fixed-length call (`cute_flash.kvcache_varlen`), in one
    launch of the packed append (kernels/sm80/append_packed.py): k, v (total_new, heads_k, d)
    into the caches from cache_seqlens[b] (None: nothing new), q (total_q, heads, d) into
    q_pad (batch, max_seqlen_q, heads, d) at each sequence's last rows (the rows before them
    zeroed: q_pad may come uninitialised), rotated when `rotary` is (cos, sin, interleaved)
    (query i at cache_seqlens[b] + i when `per_row`), each row's heads in the order of a query
    fold by `fold` (`kvcache_query_group`; 1: as they come), `lengths` (batch,) int32 the keys
    each sequence then has; returns each packed query's flat row of q_pad (int64, on the
    device: no sync)."""
    flat = torch.empty(q.shape[0], dtype=torch.int64, device=q.device)
    if lengths.numel() == 0:  # no sequence: no row to launch for (an empty grid cannot launch)
        return flat
    has_new = k is not None
    q = q.contiguous()
    k, v = (k.contiguous(), v.contiguous()) if has_new else (None, None)
    rows = (q, q_pad, k_cache, v_cache) + ((k, v) if has_new else ())
    vec = ALIGN if all(is_aligned(x) for x in rows) else 1  # 16-byte copies where every row allows them
    config = PackedAppendConfig(gpu.DTYPE_NAMES[q.dtype], block_table is not None, has_new, rotary is not None,
                                rotary is not None and rotary[2], rotary is not None and per_row, vec)
    cos, sin = (None, None) if rotary is None else (rotary[0].contiguous(), rotary[1].contiguous())
    compiled.kernel_for(config, gpu.device_index(q.device))(
        q, q_pad.view(-1, *q_pad.shape[2:]), flat, lengths, cu_seqlens_q, cache_seqlens, k, v,
        cu_seqlens_k_new if has_new else None, k_cache, v_cache, block_table, cos, sin, fold)
    return flat


@per_stream
def _workspace(plan: KVCachePlan, device: torch.device):
    """(partial O, partial LSE, arrival counters, LSE scratch) for one launch of `plan`: the
    partials and counters of a split launch (None otherwise), and where the final LSE goes when
    the caller does not want it. Kept per (plan, stream); the kernel leaves the counters at
    zero."""
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=device)
    if not plan.global_partials:
        return None, None, None, lse
    o_shape, lse_shape, counter_shape = workspace_shapes(plan.num_splits, plan.batch, plan.heads, plan.rows,
                                                         plan.traits.head_dim, plan.m_blocks)
    o_acc = torch.empty(o_shape, dtype=torch.float32, device=device)
    lse_acc = torch.empty(lse_shape, dtype=torch.float32, device=device)
    counters = zeroed_counters(counter_shape, device)
    return o_acc, lse_acc, counters, lse
