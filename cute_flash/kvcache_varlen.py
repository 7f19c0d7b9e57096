"""`flash_attn_with_kvcache` with a query count of its own per sequence (FA3's `cu_seqlens_q` /
`max_seqlen_q`, and `cu_seqlens_k_new` for the appended keys): chunked prefill and speculative
decoding, where each sequence verifies its own number of tokens.

The KV-cache kernels take one query count for the batch, so the call is met around them:
sequence b's n_b new keys are appended at cache_seqlens[b] (rotated at their positions when
rotary tables are given), its queries are laid into a (batch, max_seqlen_q) batch at its
*last* n_b rows (rotated as the fixed-length call rotates them), and the kernels see keys
cache_seqlens[b] + new_b. Bottom-right alignment then puts query i of sequence b at key
position cache_seqlens[b] + new_b - n_b + i, its own causal edge; the rows before it are
filler whose outputs are dropped. Every index is computed on the device from the prefix sums
(no host sync); the kernel launch is the fixed-length call's, split-KV included.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _each_row(cu_seqlens: Tensor, values: Tensor, total: int) -> Tensor:
    """values[b] for each of `total` packed rows, b the row's sequence (repeat_interleave given
    its size: no host sync)."""
    return torch.repeat_interleave(values, cu_seqlens[1:] - cu_seqlens[:-1], output_size=total)


def _per_row(cu_seqlens: Tensor, values: Tensor, total: int) -> Tensor:
    """values[b] + t for each packed row t of `total`, b its sequence (int64): a per-sequence
    offset plus the row's packed index, where the row's index in its sequence took a gather."""
    return _each_row(cu_seqlens, values, total) + torch.arange(total, device=cu_seqlens.device)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of rows x (n, heads, d) at `positions` (n,): the first 2 * cos.shape[1]
    columns rotated, pairs (2i, 2i + 1) when interleaved, else (i, i + half); the rest as is."""
    rot = 2 * cos.shape[1]
    positions = positions.clamp(0, cos.shape[0] - 1)  # bad metadata: read inside the tables
    c, s = cos[positions].unsqueeze(1).float(), sin[positions].unsqueeze(1).float()  # (n, 1, rot / 2)
    xr = x[..., :rot].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., rot:]], dim=-1)


def append(k_cache, v_cache, k, v, cu_seqlens_k_new, cache_seqlens, block_table, rotary):
    """Sequence b's new rows k, v (total_new, heads_k, d) into its cache rows from
    cache_seqlens[b] on (through block_table's pages when paged), k rotated at those positions
    when `rotary` is (cos, sin, interleaved). Positions past the cache, and page ids past the
    pages, are clamped into them, as the append kernel keeps bad metadata inside the tensors
    (docs/architecture.md, "Bad metadata"): such a call's cache contents are undefined, no
    write leaves the caches, and nothing syncs with the host."""
    total = k.shape[0]
    seq = _each_row(cu_seqlens_k_new, torch.arange(cu_seqlens_k_new.shape[0] - 1, device=k.device), total)
    page_size = k_cache.shape[1]
    capacity = page_size if block_table is None else block_table.shape[1] * page_size
    # row j of sequence b (packed row t = cu[b] + j) lands at cache_seqlens[b] + j = t + cache_seqlens[b] - cu[b]
    base = cache_seqlens.long() - cu_seqlens_k_new[:-1]
    pos = (base[seq] + torch.arange(total, device=k.device)).clamp_(0, capacity - 1)
    if rotary is not None:
        k = rotate(k, rotary[0], rotary[1], pos, rotary[2])
    if block_table is None:
        k_cache[seq, pos] = k
        v_cache[seq, pos] = v
    else:
        page = block_table.long()[seq, pos // page_size].clamp(0, k_cache.shape[0] - 1)
        k_cache[page, pos % page_size] = k
        v_cache[page, pos % page_size] = v


def pad_queries(q: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int) -> tuple[Tensor, Tensor]:
    """q (total_q, heads, d) as (batch, max_seqlen_q, heads, d), each sequence's rows last, and
    the flat row of each packed row in it."""
    batch = cu_seqlens_q.shape[0] - 1
    # row i of sequence b (packed row t = cu[b] + i) goes to row b max + max - len_b + i,
    # which is t + (b + 1) max - cu[b + 1]
    ends = torch.arange(max_seqlen_q, (batch + 1) * max_seqlen_q, max_seqlen_q, device=q.device)
    flat = _per_row(cu_seqlens_q, ends - cu_seqlens_q[1:], q.shape[0])
    padded = q.new_zeros(batch * max_seqlen_q, *q.shape[1:])
    padded[flat] = q
    return padded.view(batch, max_seqlen_q, *q.shape[1:]), flat


def query_positions(cu_seqlens_q: Tensor, total_q: int, cache_seqlens: Tensor, per_row: bool) -> Tensor:
    """The rotary position of each packed query row: cache_seqlens[b] + i (`per_row`: causal or
    local calls), else cache_seqlens[b] for every row, as the fixed-length call rotates q."""
    if per_row:
        return _per_row(cu_seqlens_q, cache_seqlens.long() - cu_seqlens_q[:-1], total_q)
    return _each_row(cu_seqlens_q, cache_seqlens.long(), total_q)


def unpad(out: Tensor, lse: Tensor, flat: Tensor) -> tuple[Tensor, Tensor]:
    """The packed rows' out (total_q, heads, d) and lse (heads, total_q) from the padded call's
    out (batch, max_q, heads, d) and lse (batch, heads, max_q)."""
    rows = out.reshape(-1, *out.shape[2:])[flat]
    return rows, lse.transpose(1, 2).reshape(-1, lse.shape[1])[flat].t()
