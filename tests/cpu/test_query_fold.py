"""The KV-cache entry's query fold (`Sm90FwdConfig.query_group`) on the CPU: the key-block ranges
of folded rows (row r is query r // g) against every row's visible keys, the host's fold and
unfold of q, O and the LSE, the rule that picks it, and the fold over a stand-in for the kernel's
contract (each folded row attends as its query) against `cute_flash.reference`."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_flash.kernels.common.block_range import BlockRange, Window
from cute_flash.kernels.common.seq_info import SeqInfo
from cute_flash.launch.kvcache import fold_queries, unfold_rows
from cute_flash.launch.policy import query_fold_group
from cute_flash.reference import attention_kvcache_ref


def _visible(i, j, sq, sk, left, right):
    """Query i sees key j: flash-attn's bottom-right-aligned window (an edge < 0: none)."""
    shift = sk - sq
    return 0 <= j < sk and (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)


@settings(max_examples=200, deadline=None)
@given(sq=st.integers(1, 300), g=st.integers(1, 9), sk=st.integers(0, 400), left=st.integers(-1, 300),
       right=st.integers(-1, 300), bm=st.sampled_from([64, 128]), bn=st.sampled_from([64, 128]), data=st.data())
def test_folded_block_ranges_hold_every_visible_key(sq, g, sk, left, right, bm, bn, data):
    """`BlockRange.make` over folded rows is the hull of the key blocks any row of the m-block
    sees (rows past the end read as the queries after the last), and `unmasked` holds only blocks
    that every valid row sees whole."""
    rows = sq * g
    m_block = data.draw(st.integers(0, (rows - 1) // bm))
    seq = SeqInfo(rows, sk, None, None, 0)
    window = Window(left, right, left >= 0, right >= 0, g)
    blocks = BlockRange.make(seq, m_block, bm, bn, window)
    lo, hi = BlockRange.unmasked(seq, m_block, bm, bn, window)
    block_rows = range(m_block * bm, (m_block + 1) * bm)
    seen = {j // bn for r in block_rows for j in range(sk) if _visible(r // g, j, sq, sk, left, right)}
    if seen:  # (with no key seen, any range is safe: its blocks run masked to -inf)
        assert (blocks.n_block_min, blocks.n_block_max) == (min(seen), max(seen) + 1)
    for n in range(lo, hi):
        assert all(_visible(r // g, j, sq, sk, left, right)
                   for r in block_rows if r < rows for j in range(n * bn, (n + 1) * bn))


@given(b=st.integers(1, 3), sq=st.integers(1, 6), hk=st.integers(1, 3), g=st.integers(1, 5), d=st.integers(1, 9))
def test_fold_and_unfold_are_inverse_and_place_each_query(b, sq, hk, g, d):
    """Row j + g i of K / V head kh holds query i of head kh g + j; unfolding O and the LSE
    returns the caller's layout."""
    q = torch.randn(b, sq, hk * g, d)
    folded = fold_queries(q, g)
    assert folded.shape == (b, sq * g, hk, d)
    for i in range(sq):
        for j in range(g):
            assert torch.equal(folded[:, j + g * i], torch.stack([q[:, i, kh * g + j] for kh in range(hk)], dim=1))
    lse = torch.randn(b, hk * g, sq)
    lse_folded = torch.stack([torch.stack([lse[:, kh * g + r % g, r // g] for r in range(sq * g)], dim=1)
                              for kh in range(hk)], dim=1)  # (b, hk, sq g)
    out, lse_back = unfold_rows(folded, lse_folded, g)
    assert torch.equal(out, q) and torch.equal(lse_back, lse)
    assert unfold_rows(folded, None, g)[1] is None


@pytest.mark.parametrize("sq, h, hk, alibi, bm, expected", [
    (5, 32, 8, False, 64, 4),    # 4 tiles a K / V block -> 1
    (16, 32, 4, False, 64, 8),   # 8 -> 2
    (32, 8, 2, False, 64, 4),    # 4 -> 2: halves
    (33, 8, 2, False, 64, 1),    # 8 -> 5: not half
    (64, 16, 2, False, 64, 1),   # 8 -> 8
    (4, 8, 8, False, 64, 1),     # no group
    (4, 32, 8, True, 64, 1),     # ALiBi: slopes per head
    (1, 6, 2, False, 64, 3),     # one row (pack_gqa's case but for a window edge, which the launcher checks)
])
def test_the_fold_rule(sq, h, hk, alibi, bm, expected):
    assert query_fold_group(sq, h, hk, alibi, bm) == expected


def _contract(qf, k_cache, v_cache, seqlens, g, scale, left, right, softcap):
    """What the kernel computes on folded rows: row r of K / V head kh attends as query r // g
    over the first seqlens[b] keys (bottom-right aligned), O and the natural-log LSE."""
    b, rows, hk, d = qf.shape
    sq = rows // g
    out = torch.zeros(b, rows, hk, d)
    lse = torch.full((b, hk, rows), -math.inf)
    for bi in range(b):
        sk = int(seqlens[bi])
        for kh in range(hk):
            for r in range(rows):
                keep = torch.tensor([_visible(r // g, j, sq, sk, left, right) for j in range(sk)], dtype=torch.bool)
                if not keep.any():
                    continue
                s = (k_cache[bi, :sk, kh].float() @ qf[bi, r, kh].float()) * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                s = s.masked_fill(~keep, -math.inf)
                lse[bi, kh, r] = torch.logsumexp(s, 0)
                out[bi, r, kh] = torch.softmax(s, 0) @ v_cache[bi, :sk, kh].float()
    return out, lse


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), sq=st.integers(1, 5), hk=st.integers(1, 2), g=st.integers(2, 4), d=st.sampled_from([8, 16]),
       mask=st.sampled_from(["none", "causal", "local"]), softcap=st.sampled_from([0.0, 5.0]), data=st.data())
def test_folded_call_matches_the_reference(b, sq, hk, g, d, mask, softcap, data):
    """q folded, the contract on folded rows, O and LSE unfolded: flash-attn's KV-cache result
    (`attention_kvcache_ref`) for every mask, ragged lengths (an empty cache too)."""
    capacity = 24
    seqlens = torch.tensor(data.draw(st.lists(st.integers(0, capacity), min_size=b, max_size=b)), dtype=torch.int32)
    left, right = {"none": (-1, -1), "causal": (-1, 0), "local": (3, 1)}[mask]
    q = torch.randn(b, sq, hk * g, d)
    k_cache, v_cache = torch.randn(b, capacity, hk, d), torch.randn(b, capacity, hk, d)
    scale = d ** -0.5
    out_f, lse_f = _contract(fold_queries(q, g), k_cache, v_cache, seqlens, g, scale, left, right, softcap)
    out, lse = unfold_rows(out_f, lse_f, g)
    ref_out, ref_lse, _, _ = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, softmax_scale=scale,
                                                   causal=mask == "causal", window_size=(left, right) if mask == "local"
                                                   else (-1, -1), softcap=softcap)
    assert torch.allclose(out, ref_out.float(), atol=1e-4, rtol=1e-4)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and torch.allclose(lse[finite], ref_lse[finite].float(), atol=1e-4)
