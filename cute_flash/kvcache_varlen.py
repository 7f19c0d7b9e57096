"""`flash_attn_with_kvcache` with a query count of its own per sequence (FA3's `cu_seqlens_q` /
`max_seqlen_q`, and `cu_seqlens_k_new` for the appended keys): chunked prefill and speculative
decoding, where each sequence verifies its own number of tokens.

The KV-cache kernels take one query count for the batch, so the call is met around them:
sequence b's n_b new keys are appended at cache_seqlens[b] (rotated at their positions when
rotary tables are given), its queries are laid into a (batch, max_seqlen_q) batch at its
*last* n_b rows (rotated as the fixed-length call rotates them), and the kernels see keys
cache_seqlens[b] + new_b. Bottom-right alignment then puts query i of sequence b at key
position cache_seqlens[b] + new_b - n_b + i, its own causal edge; the rows before it are
filler whose outputs are dropped. The appends, the rotations, the padded queries, each packed
query's padded row and the keys each sequence then has come from one launch
(`launch.kvcache.pack_kvcache_queries`, kernels/sm80/append_packed.py), every index computed
on the device from the prefix sums (no host sync), the queries in the order of the launch's
query fold where it folds (so no copy folds them and none unfolds its output); the attention
is the fixed-length call's, split-KV included; `unpad` takes the packed rows back.
"""
from __future__ import annotations

from torch import Tensor


def unpad(out: Tensor, lse: Tensor, flat: Tensor, fold: int = 1) -> tuple[Tensor, Tensor]:
    """The packed rows' out (total_q, heads, d) and lse (heads, total_q) from the padded call's
    out (batch, max_q, heads, d) and lse (batch, heads, max_q), or with `fold` > 1 from its
    folded ones (batch, fold x max_q, heads / fold, d) and (batch, heads / fold, fold x max_q):
    row j + fold i of K / V head kh holds query i of head kh fold + j."""
    batch, hk, d = out.shape[0], out.shape[2], out.shape[3]
    rows = out.reshape(-1, fold, hk, d).index_select(0, flat).transpose(1, 2).reshape(-1, hk * fold, d)
    by_row = lse.reshape(batch, hk, -1, fold).permute(0, 2, 1, 3).reshape(-1, hk * fold)
    return rows, by_row.index_select(0, flat).t()
