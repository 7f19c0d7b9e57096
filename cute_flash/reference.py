"""Plain-torch attention that defines what the kernels must compute.

Semantics are flash-attn 2.8.3's (docs/semantics.md): the GPU tests compare our kernels against these
functions, computed in float32 on upcast inputs, and bound the kernel error by the error of the
same functions run in the input dtype (``upcast=False``). Only torch is imported, so this module
works without a GPU or the CuTe DSL. Nothing here is fast; everything here is meant to be obvious.
"""

import math
import os

import torch

# compute-sanitizer racecheck aborts on torch's own fp16/bf16 GEMMs (cuBLAS) on an H100, with no
# kernel of ours running (docs/tuning/gpu-suite.md, "seventh session"); `python -m cute_flash
# racecheck` sets this, and the input-dtype reference then rounds float32 GEMMs to its dtype
ROUNDED_FP32_GEMMS = "CUTE_FLASH_REFERENCE_GEMMS"


def _einsum(equation, a, b):
    """torch.einsum, or under ROUNDED_FP32_GEMMS=1 the same product in float32 rounded to a's
    dtype (both accumulate in float32; the order of the adds may differ)."""
    if os.environ.get(ROUNDED_FP32_GEMMS) == "1" and a.dtype in (torch.float16, torch.bfloat16):
        return torch.einsum(equation, a.float(), b.float()).to(a.dtype)
    return torch.einsum(equation, a, b)


def attention_ref(
    q,
    k,
    v,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    upcast=True,
    query_padding_mask=None,
    key_padding_mask=None,
    key_leftpad=None,
    dropout_p=0.0,
    dropout_mask=None,
    return_probs=False,
    learnable_sink=None,
    score_mod=None,
    mask_mod=None,
):
    """Dense attention: q (b, sq, h, d), k/v (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq),
    and with ``return_probs`` the probabilities before dropout (b, h, sq, sk), float32 when upcast.

    ``dropout_mask`` (b, h, sq, sk) bool (True: kept, e.g. ``philox.keep_mask``) drops
    probabilities after the softmax; the kept ones are scaled by 1 / P(keep), P(keep) being
    ``philox.keep_threshold(dropout_p) / 2^14`` (docs/semantics.md, Dropout). lse is not affected.

    ``key_padding_mask`` / ``query_padding_mask`` (b, s) bool mark the valid rows (a prefix) and
    ``key_leftpad`` (b,) hides the first key columns; the valid counts are the per-batch "sk" and
    "sq" of the bottom-right causal / window / ALiBi formulas, and key column j sits at logical
    position j - leftpad. Rows with no visible key (padded query rows included) give out 0 and
    lse +inf, as the kernel does. lse is float32 whatever ``upcast`` is.

    ALiBi is always ``-slope * |i + sk - sq - j|`` (docs/semantics.md). flash-attn's causal kernel adds
    ``slope * j`` instead: the same softmax, but its lse differs by a per-row constant.

    ``learnable_sink`` (h,): one more softmax column per row holding the head's logit (not
    scaled), with no value: it takes its share of every row's probabilities, lse includes it,
    and a row that sees no key gives out 0 and lse = the sink (docs/semantics.md, Sinks).

    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` (FlexAttention's
    torch conventions, on broadcast index tensors) rewrite the scaled scores and hide those the
    mask returns False for (docs/semantics.md, Score and mask mods).
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if h % hk != 0:
        raise ValueError(f"nheads ({h}) must be a multiple of nheads_k ({hk})")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out_dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    scores = _einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)

    dev = q.device
    row = torch.arange(sq, device=dev).view(1, 1, sq, 1)
    col = torch.arange(sk, device=dev).view(1, 1, 1, sk)
    leftpad = torch.zeros(b, 1, 1, 1, dtype=torch.long, device=dev)
    if key_leftpad is not None:
        leftpad = key_leftpad.long().view(b, 1, 1, 1)
    key_ok = col >= leftpad
    if key_padding_mask is not None:
        key_ok = key_ok & key_padding_mask.view(b, 1, 1, sk)
    query_ok = torch.ones(b, 1, sq, 1, dtype=torch.bool, device=dev)
    if query_padding_mask is not None:
        query_ok = query_padding_mask.view(b, 1, sq, 1)
    len_k = key_ok.sum(-1, keepdim=True)
    len_q = query_ok.sum(-2, keepdim=True)
    # diag[i, j] = (i + sk - sq) - (logical key position of column j)
    diag = row + len_k - len_q - (col - leftpad)

    left, right = (window_size[0], 0) if causal else window_size
    visible = key_ok & query_ok
    if left >= 0:
        visible = visible & (diag <= left)
    if right >= 0:
        visible = visible & (diag >= -right)
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().expand(b, h).reshape(b, h, 1, 1)
        scores = scores - (slopes * diag.abs()).to(scores.dtype)

    if score_mod is not None or mask_mod is not None:
        b_idx = torch.arange(b, device=dev).view(b, 1, 1, 1)
        h_idx = torch.arange(h, device=dev).view(1, h, 1, 1)
        if score_mod is not None:
            scores = score_mod(scores, b_idx, h_idx, row, col)
        if mask_mod is not None:
            visible = visible & mask_mod(b_idx, h_idx, row, col)
    scores = scores.masked_fill(~visible, float("-inf"))
    if learnable_sink is None:
        empty = ~visible.any(-1)
        lse = torch.logsumexp(scores.float(), dim=-1).masked_fill(empty, float("inf"))
        probs = torch.softmax(scores, dim=-1).masked_fill(empty.unsqueeze(-1), 0.0)
    else:
        sink = learnable_sink.to(scores.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
        with_sink = torch.cat([scores, sink], dim=-1)
        lse = torch.logsumexp(with_sink.float(), dim=-1)
        probs = torch.softmax(with_sink, dim=-1)[..., :-1]
    kept = probs
    if dropout_mask is not None:
        from layouts.philox import KEEP_RANGE, keep_threshold

        kept = probs.masked_fill(~dropout_mask.to(probs.device), 0.0) * (KEEP_RANGE / keep_threshold(dropout_p))
    out = _einsum("bhqk,bkhd->bqhd", kept.to(v.dtype), v)
    return (out.to(out_dtype), lse, probs) if return_probs else (out.to(out_dtype), lse)


def gather_paged(cache, block_table, seqlen):
    """Paged cache (num_blocks, page_size, hk, d) -> contiguous (b, seqlen, hk, d), page by page."""
    page_size = cache.shape[1]
    num_pages = -(-seqlen // page_size)
    pages = cache[block_table[:, :num_pages].long()]
    return pages.flatten(1, 2)[:, :seqlen]


def attention_varlen_ref(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    seqused_k=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    upcast=True,
    return_probs=False,
    learnable_sink=None,
    score_mod=None,
    mask_mod=None,
):
    """Packed sequences: q (total_q, h, d) -> out (total_q, h, d), lse (h, total_q), and with
    ``return_probs`` each sequence's probabilities in a zero (b, h, max sq, max sk) tensor.

    Each sequence is run through :func:`attention_ref` on its own. Its keys are
    k[cu_seqlens_k[b]:][:n], or with ``block_table`` the first n rows of its pages (k/v then are
    paged caches), where n = seqused_k[b] if given, else cu_seqlens_k[b+1] - cu_seqlens_k[b].
    Query rows outside every sequence keep out 0 and lse +inf (the sink, with ``learnable_sink``).
    ``score_mod`` / ``mask_mod`` see sequence b as batch index b, positions from its start.
    """
    h = q.shape[1]
    out = q.new_zeros(q.shape[:-1] + v.shape[-1:])  # v's head dim
    lse = torch.full((h, q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    if learnable_sink is not None:
        lse = learnable_sink.float().view(h, 1).expand(h, q.shape[0]).clone()
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lengths_k = seqused_k.tolist() if seqused_k is not None else [b - a for a, b in zip(cu_k, cu_k[1:])]
    probs = torch.zeros((len(lengths_q), h, max(lengths_q, default=0), max(lengths_k, default=0)),
                        dtype=torch.float32 if upcast else q.dtype, device=q.device) if return_probs else None
    for i in range(len(cu_q) - 1):
        q0, q1, k0 = cu_q[i], cu_q[i + 1], cu_k[i]
        n = int(seqused_k[i]) if seqused_k is not None else cu_k[i + 1] - k0
        if block_table is None:
            ki, vi = k[None, k0 : k0 + n], v[None, k0 : k0 + n]
        else:
            ki = gather_paged(k, block_table[i : i + 1], n)
            vi = gather_paged(v, block_table[i : i + 1], n)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[i : i + 1]
        o, l, *p = attention_ref(
            q[None, q0:q1], ki, vi, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=slopes, upcast=upcast, return_probs=return_probs,
            learnable_sink=learnable_sink, score_mod=_at_batch(score_mod, i, 1), mask_mod=_at_batch(mask_mod, i, 0),
        )
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
        if return_probs:
            probs[i, :, : q1 - q0, :n] = p[0][0]
    return (out, lse, probs) if return_probs else (out, lse)


def _at_batch(mod, b, position):
    """`mod` with its batch index (argument `position`) taken as b: a sequence run alone."""
    if mod is None:
        return None

    def at(*args):
        args = list(args)
        args[position] = args[position] + b
        return mod(*args)
    return at


def apply_rotary_ref(x, cos, sin, *, seqlen_offsets=0, interleaved=False):
    """Rotary embedding of x (b, s, h, d) at positions seqlen_offsets[b] + s, computed in float32.

    cos/sin (seqlen_ro, rotary_dim / 2). interleaved rotates pairs (x0, x1), (x2, x3), ...;
    otherwise (GPT-NeoX) pairs (x[i], x[i + rotary_dim / 2]). Features past rotary_dim pass
    through; the result has x's dtype, as the kernel stores it.
    """
    b, s = x.shape[:2]
    rot = 2 * cos.shape[-1]
    offsets = torch.as_tensor(seqlen_offsets, device=x.device).long().reshape(-1, 1)
    pos = offsets + torch.arange(s, device=x.device)
    c = cos.float()[pos].expand(b, s, -1).unsqueeze(2)
    sn = sin.float()[pos].expand(b, s, -1).unsqueeze(2)
    xr = x[..., :rot].float()
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else xr.chunk(2, dim=-1)
    y1, y2 = x1 * c - x2 * sn, x1 * sn + x2 * c
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., rot:]), dim=-1)


def attention_kvcache_ref(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    upcast=True,
    learnable_sink=None,
):
    """``flash_attn_with_kvcache`` without side effects -> (out, lse, k_cache_new, v_cache_new).

    New k/v rows (rotated at positions cache_seqlens[b] + i when rotary is given) are written at
    cache_seqlens[b] of updated copies of the caches, then q attends over the first
    cache_seqlens[b] + seqlen_new keys (keys before cache_leftpad[b] hidden). q is rotated at
    cache_seqlens[b] + i when causal or local, else every row at cache_seqlens[b], as flash-attn
    does; "local" follows flash-attn's clamp: a window side >= the cache length is unbounded.
    """
    b, sq = q.shape[:2]
    dev = q.device
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx cannot be used with block_table")
    page_size = k_cache.shape[1]
    cache_len = page_size * block_table.shape[1] if block_table is not None else k_cache.shape[1]
    batch_idx = torch.arange(b, device=dev) if cache_batch_idx is None else cache_batch_idx.long()
    if cache_seqlens is None:
        cache_seqlens = cache_len
    seqlens = torch.as_tensor(cache_seqlens, device=dev).long().expand(b)

    if rotary_cos is not None:
        def rope(x):
            return apply_rotary_ref(
                x, rotary_cos, rotary_sin, seqlen_offsets=seqlens, interleaved=rotary_interleaved
            )

        left, right = (window_size[0], 0) if causal else window_size
        if causal or 0 <= left < cache_len or 0 <= right < cache_len:
            q = rope(q)
        else:
            q = rope(q.reshape(b, 1, -1, q.shape[-1])).reshape(q.shape)
        if k is not None:
            k = rope(k)

    k_cache_new, v_cache_new = k_cache.clone(), v_cache.clone()
    seqlen_new = 0
    if k is not None:
        seqlen_new = k.shape[1]
        for i in range(b):
            pos = seqlens[i] + torch.arange(seqlen_new, device=dev)
            if int(seqlens[i]) + seqlen_new > cache_len:
                raise ValueError(f"batch {i}: cache_seqlens + seqlen_new exceeds {cache_len}")
            if block_table is None:
                dst = (batch_idx[i], pos)
            else:
                dst = (block_table[i, pos // page_size].long(), pos % page_size)
            k_cache_new[dst] = k[i]
            v_cache_new[dst] = v[i]

    if block_table is None:
        keys, values = k_cache_new[batch_idx], v_cache_new[batch_idx]
    else:
        keys = gather_paged(k_cache_new, block_table, cache_len)
        values = gather_paged(v_cache_new, block_table, cache_len)
    key_padding_mask = torch.arange(cache_len, device=dev) < (seqlens + seqlen_new).unsqueeze(1)
    out, lse = attention_ref(
        q, keys, values, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, upcast=upcast,
        key_padding_mask=key_padding_mask, key_leftpad=cache_leftpad, learnable_sink=learnable_sink,
    )
    return out, lse, k_cache_new, v_cache_new
