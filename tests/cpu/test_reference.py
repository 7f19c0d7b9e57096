"""CPU tests of cute_flash.reference: against SDPA, hand-computed cases, and independent paths."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from cute_flash.reference import (
    ROUNDED_FP32_GEMMS,
    apply_rotary_ref,
    attention_kvcache_ref,
    attention_ref,
    attention_varlen_ref,
    gather_paged,
)

INF = float("inf")


def sdpa(q, k, v, **kw):
    """SDPA math backend on (b, s, h, d) tensors, GQA by repeating kv heads."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), **kw)
    return out.transpose(1, 2)


def explicit_lse(q, k, scale, mask=None):
    g = q.shape[2] // k.shape[2]
    k = k.float().repeat_interleave(g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -INF)
    return torch.logsumexp(scores, dim=-1)


@st.composite
def problems(draw, equal_lengths=False):
    b = draw(st.integers(1, 2))
    sq = draw(st.integers(1, 40))
    sk = sq if equal_lengths else draw(st.integers(1, 40))
    h = draw(st.sampled_from([1, 2, 4]))
    hk = draw(st.sampled_from([x for x in (1, 2, 4) if h % x == 0]))
    d = draw(st.sampled_from([8, 16, 32, 40, 64]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(b, sq, h, d, generator=gen).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=gen).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=gen).to(dtype)
    return q, k, v


def check_out(out, expected):
    """fp32 outputs agree to rounding; bf16 ones (fp32 math, rounded once) to one bf16 ulp."""
    assert out.dtype == expected.dtype
    atol = 1e-5 if out.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


# ---------------------------------------------------------------- against SDPA


@settings(max_examples=40, deadline=None)
@given(problems(equal_lengths=True), st.booleans(), st.sampled_from([None, 0.3]))
def test_matches_sdpa(qkv, causal, scale):
    q, k, v = qkv
    out, lse = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
    expected = sdpa(q.float(), k.float(), v.float(), is_causal=causal, scale=scale).to(q.dtype)
    check_out(out, expected)
    sq, sk = q.shape[1], k.shape[1]
    mask = torch.ones(sq, sk, dtype=torch.bool).tril() if causal else None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], sq)
    torch.testing.assert_close(lse, explicit_lse(q, k, scale, mask), atol=1e-4, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(problems())
def test_causal_is_bottom_right(qkv):
    q, k, v = qkv
    sq, sk = q.shape[1], k.shape[1]
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    out, lse = attention_ref(q, k, v, causal=True)
    check_out(out, sdpa(q.float(), k.float(), v.float(), attn_mask=mask).to(q.dtype))
    expected_lse = explicit_lse(q, k, q.shape[-1] ** -0.5, mask)
    expected_lse[..., ~mask.any(-1)] = INF  # rows with no key: +inf, not logsumexp's -inf
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


def test_upcast_false_computes_in_input_dtype():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 2, 64, generator=gen).bfloat16() for _ in range(3))
    hi, _ = attention_ref(q, k, v)
    lo, lse_lo = attention_ref(q, k, v, upcast=False)
    assert lo.dtype == torch.bfloat16 and lse_lo.dtype == torch.float32
    err = (lo.float() - hi.float()).abs().max().item()
    assert 0 < err < 0.1


def test_rounded_float32_gemms_stay_in_the_input_dtype_between_gemms(monkeypatch):
    """Under racecheck the input-dtype reference runs its GEMMs in float32 and rounds each product
    (ROUNDED_FP32_GEMMS): still an input-dtype result, as far from the float32 one as before."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 2, 64, generator=gen).bfloat16() for _ in range(3))
    hi, _ = attention_ref(q, k, v)
    lo, _ = attention_ref(q, k, v, upcast=False)
    monkeypatch.setenv(ROUNDED_FP32_GEMMS, "1")
    rounded, _ = attention_ref(q, k, v, upcast=False)
    assert rounded.dtype == torch.bfloat16
    err, err_rounded = ((x.float() - hi.float()).abs().max().item() for x in (lo, rounded))
    assert 0 < err_rounded < 2 * err


# ---------------------------------------------------------------- hand-checkable cases


def one_hot_problem(sq, sk, h=1):
    """q = 0 so every visible key weighs the same; v = identity so out[i] is row i's weights."""
    q = torch.zeros(1, sq, h, sk)
    k = torch.randn(1, sk, 1, sk)
    v = torch.eye(sk).view(1, sk, 1, sk)
    return q, k, v


@pytest.mark.parametrize(
    "sq, sk, causal, window, pattern",
    [
        (2, 5, True, (-1, -1), ["11110", "11111"]),
        (5, 2, True, (-1, -1), ["00", "00", "00", "10", "11"]),
        (2, 5, False, (-1, 0), ["11110", "11111"]),
        (2, 5, False, (-1, -1), ["11111", "11111"]),
        (4, 4, False, (1, 0), ["1000", "1100", "0110", "0011"]),
        (3, 3, True, (1, -1), ["100", "110", "011"]),
        (3, 5, False, (1, 1), ["01110", "00111", "00011"]),
        (3, 5, False, (0, -1), ["00111", "00011", "00001"]),
        (3, 5, False, (-1, 1), ["11110", "11111", "11111"]),
    ],
)
def test_mask_patterns(sq, sk, causal, window, pattern):
    q, k, v = one_hot_problem(sq, sk)
    out, lse = attention_ref(q, k, v, causal=causal, window_size=window)
    for i, row in enumerate(pattern):
        seen = torch.tensor([float(c) for c in row])
        n = int(seen.sum())
        expected = seen / n if n else seen
        torch.testing.assert_close(out[0, i, 0], expected)
        assert lse[0, 0, i].item() == pytest.approx(math.log(n) if n else INF, abs=1e-6)


def test_gqa_head_mapping():
    q = torch.randn(1, 3, 4, 8)
    k = torch.randn(1, 5, 2, 8)
    v = torch.arange(1.0, 3.0).view(1, 1, 2, 1).expand(1, 5, 2, 8)  # kv head g holds g + 1
    out, _ = attention_ref(q, k, v)
    for head in range(4):
        torch.testing.assert_close(out[0, :, head], torch.full((3, 8), head // 2 + 1.0))


def test_softcap_scales_before_tanh():
    q = torch.tensor([2.0, 0.0]).view(1, 1, 1, 2)
    k = torch.tensor([[2.0, 0.0], [0.0, 0.0]]).view(1, 2, 1, 2)
    v = torch.eye(2).view(1, 2, 1, 2)
    out, lse = attention_ref(q, k, v, softmax_scale=0.5, softcap=1.0)
    s = math.tanh(4 * 0.5)  # scaled score 2, capped by tanh; scores for key 1 are 0
    z = math.exp(s) + 1
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([math.exp(s) / z, 1 / z]))
    assert lse.item() == pytest.approx(math.log(z), rel=1e-6)


def test_softcap_caps_large_scores():
    q = torch.tensor([10.0, 0.0]).view(1, 1, 1, 2)
    k = torch.tensor([[10.0, 0.0], [0.0, 0.0]]).view(1, 2, 1, 2)
    v = torch.eye(2).view(1, 2, 1, 2)
    _, lse = attention_ref(q, k, v, softmax_scale=1.0, softcap=5.0)
    assert lse.item() == pytest.approx(math.log(math.exp(5.0) + 1), rel=1e-6)


def test_softcap_with_tiny_scores_is_plain_attention():
    q, k, v = (torch.randn(2, 7, 2, 16) * 0.1 for _ in range(3))
    out, _ = attention_ref(q, k, v, softcap=50.0)
    torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-6, rtol=0)


@pytest.mark.parametrize("batched_slopes", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 1.0])
def test_alibi_identical_keys(batched_slopes, softcap):
    b, sq, sk, h, d = 2, 2, 4, 2, 4
    slopes = torch.tensor([[0.5, 1.0], [0.25, 2.0]] if batched_slopes else [0.5, 1.0])
    q = torch.randn(b, sq, h, d)
    key = torch.randn(d)
    k = key.expand(b, sk, 1, d)
    v = torch.eye(sk).view(1, sk, 1, sk).expand(b, sk, 1, sk)
    out, lse = attention_ref(q, k, v, softcap=softcap, alibi_slopes=slopes)
    for bi in range(b):
        for hi in range(h):
            slope = (slopes[bi] if batched_slopes else slopes)[hi].item()
            for i in range(sq):
                raw = float(q[bi, i, hi] @ key) / math.sqrt(d)
                s = softcap * math.tanh(raw / softcap) if softcap else raw
                w = [math.exp(-slope * abs(i + sk - sq - j)) for j in range(sk)]
                expected = torch.tensor(w) / sum(w)
                torch.testing.assert_close(out[bi, i, hi], expected)
                expected_lse = s + math.log(sum(w))
                assert lse[bi, hi, i].item() == pytest.approx(expected_lse, rel=1e-5, abs=1e-5)


# ---------------------------------------------------------------- padding, leftpad, varlen


def pack(x, lens):
    return torch.cat([x[i, :n] for i, n in enumerate(lens)])


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


OPTIONS = [
    {},
    {"causal": True},
    {"window_size": (2, 1)},
    {"causal": True, "alibi_slopes": torch.tensor([[0.3, 0.7], [0.1, 0.2], [0.5, 0.4]])},
    {"softcap": 2.0, "window_size": (-1, 3)},
]


@pytest.mark.parametrize("opts", OPTIONS)
def test_padding_masks_equal_varlen(opts):
    """Padded dense batches (masks) and packed sequences (slices) are two independent paths."""
    lens_q, lens_k = [5, 1, 7], [9, 4, 2]
    q, k, v = torch.randn(3, 7, 2, 8), torch.randn(3, 9, 2, 8), torch.randn(3, 9, 2, 8)
    qmask = torch.arange(7) < torch.tensor(lens_q)[:, None]
    kmask = torch.arange(9) < torch.tensor(lens_k)[:, None]
    out, lse = attention_ref(q, k, v, query_padding_mask=qmask, key_padding_mask=kmask, **opts)
    out_v, lse_v = attention_varlen_ref(
        pack(q, lens_q), pack(k, lens_k), pack(v, lens_k), cu(lens_q), cu(lens_k), **opts
    )
    torch.testing.assert_close(pack(out, lens_q), out_v)
    torch.testing.assert_close(pack(lse.transpose(1, 2), lens_q).T, lse_v)
    assert (out[~qmask] == 0).all() and (lse.transpose(1, 2)[~qmask] == INF).all()


@pytest.mark.parametrize("opts", OPTIONS)
def test_key_leftpad_equals_dropping_the_pad(opts):
    leftpad, seqlens = [2, 0, 5], [7, 4, 6]
    q, k, v = torch.randn(3, 4, 2, 8), torch.randn(3, 9, 2, 8), torch.randn(3, 9, 2, 8)
    kmask = torch.arange(9) < torch.tensor(seqlens)[:, None]
    lp_t = torch.tensor(leftpad, dtype=torch.int32)
    out, lse = attention_ref(q, k, v, key_padding_mask=kmask, key_leftpad=lp_t, **opts)
    for i, (lp, n) in enumerate(zip(leftpad, seqlens)):
        sub = {**opts}
        if "alibi_slopes" in opts:
            sub["alibi_slopes"] = opts["alibi_slopes"][i]
        o, l = attention_ref(q[i : i + 1], k[i : i + 1, lp:n], v[i : i + 1, lp:n], **sub)
        torch.testing.assert_close(out[i : i + 1], o)
        torch.testing.assert_close(lse[i : i + 1], l)


@pytest.mark.parametrize("opts", OPTIONS + [{"alibi_slopes": torch.tensor([0.3, 0.6])}])
def test_varlen_equals_dense_per_sequence(opts):
    lens_q, lens_k = [3, 0, 2, 5], [4, 2, 0, 1]  # lengths 0 and 1 on both sides
    if opts.get("alibi_slopes") is not None and opts["alibi_slopes"].dim() == 2:
        opts = {**opts, "alibi_slopes": torch.rand(4, 2)}
    pad = 2  # rows after the last sequence belong to none
    q = torch.randn(sum(lens_q) + pad, 2, 16)
    k, v = torch.randn(sum(lens_k), 1, 16), torch.randn(sum(lens_k), 1, 16)
    out, lse = attention_varlen_ref(q, k, v, cu(lens_q), cu(lens_k), **opts)
    assert out.shape == q.shape and lse.shape == (2, q.shape[0])
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for i in range(4):
        sub = {**opts}
        if "alibi_slopes" in opts and opts["alibi_slopes"].dim() == 2:
            sub["alibi_slopes"] = opts["alibi_slopes"][i]
        ks = slice(ck[i], ck[i + 1])
        o, l = attention_ref(q[None, cq[i] : cq[i + 1]], k[None, ks], v[None, ks], **sub)
        torch.testing.assert_close(out[cq[i] : cq[i + 1]], o[0])
        torch.testing.assert_close(lse[:, cq[i] : cq[i + 1]], l[0])
    assert (out[cq[2] : cq[3]] == 0).all() and (lse[:, cq[2] : cq[3]] == INF).all()  # no keys
    assert (out[-pad:] == 0).all() and (lse[:, -pad:] == INF).all()


def test_varlen_seqused_k():
    lens_q, lens_k, used = [3, 2, 4], [5, 3, 4], [2, 3, 0]
    q = torch.randn(sum(lens_q), 2, 8)
    k, v = torch.randn(sum(lens_k), 2, 8), torch.randn(sum(lens_k), 2, 8)
    seqused = torch.tensor(used, dtype=torch.int32)
    out, lse = attention_varlen_ref(q, k, v, cu(lens_q), cu(lens_k), seqused_k=seqused, causal=True)
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    keep = torch.cat([torch.arange(ck[i], ck[i] + n) for i, n in enumerate(used)])
    out_e, lse_e = attention_varlen_ref(q, k[keep], v[keep], cu(lens_q), cu(used), causal=True)
    torch.testing.assert_close(out, out_e)
    torch.testing.assert_close(lse, lse_e)
    assert (out[cq[2] :] == 0).all()


def paginate(seqs, page_size, max_blocks, gen):
    """Scatter each (n, hk, d) sequence into pages of a shuffled pool; return cache, block_table."""
    b = len(seqs)
    perm = torch.randperm(b * max_blocks + 3, generator=gen)
    block_table = perm[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    cache = torch.randn(len(perm), page_size, *seqs[0].shape[1:], generator=gen)
    for i, seq in enumerate(seqs):
        for p in range(seq.shape[0]):
            cache[block_table[i, p // page_size], p % page_size] = seq[p]
    return cache, block_table


def test_gather_paged():
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randn(10, 2, 4, generator=gen) for _ in range(3)]
    cache, block_table = paginate(seqs, 3, 4, gen)
    torch.testing.assert_close(gather_paged(cache, block_table, 10), torch.stack(seqs))
    torch.testing.assert_close(gather_paged(cache, block_table, 4), torch.stack(seqs)[:, :4])


@pytest.mark.parametrize("use_seqused", [False, True])
def test_varlen_paged_equals_contiguous(use_seqused):
    gen = torch.Generator().manual_seed(2)
    lens_q, lens_k = [3, 1, 4], [4, 0, 7]
    seqused = torch.tensor([2, 0, 6], dtype=torch.int32) if use_seqused else None
    q = torch.randn(sum(lens_q), 4, 8, generator=gen)
    ks = [torch.randn(n, 2, 8, generator=gen) for n in lens_k]
    vs = [torch.randn(n, 2, 8, generator=gen) for n in lens_k]
    k_pages, block_table = paginate(ks, 3, 3, torch.Generator().manual_seed(3))
    v_pages, _ = paginate(vs, 3, 3, torch.Generator().manual_seed(3))
    opts = dict(causal=True, seqused_k=seqused)
    out, lse = attention_varlen_ref(q, torch.cat(ks), torch.cat(vs), cu(lens_q), cu(lens_k), **opts)
    out_p, lse_p = attention_varlen_ref(
        q, k_pages, v_pages, cu(lens_q), cu(lens_k), block_table=block_table, **opts
    )
    torch.testing.assert_close(out_p, out)
    torch.testing.assert_close(lse_p, lse)


# ---------------------------------------------------------------- rotary


def complex_rotary(x, angle, positions, interleaved):
    """Rotate feature pairs as complex numbers by e^{i * angle[position]} (float64)."""
    r = 2 * angle.shape[-1]
    xr = x[..., :r].double()
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], r // 2, 2).contiguous())
    else:
        z = torch.complex(xr[..., : r // 2], xr[..., r // 2 :])
    z = z * torch.polar(torch.ones_like(angle.double()), angle.double())[positions].unsqueeze(2)
    y = torch.view_as_real(z).flatten(-2) if interleaved else torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., r:]), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 8])
@pytest.mark.parametrize("offsets", [0, 3, [2, 7]])
def test_rotary_is_complex_rotation(interleaved, rotary_dim, offsets):
    x = torch.randn(2, 5, 3, 16)
    angle = torch.rand(16, rotary_dim // 2) * 2 * math.pi
    off = torch.tensor(offsets, dtype=torch.int32) if isinstance(offsets, list) else offsets
    out = apply_rotary_ref(x, angle.cos(), angle.sin(), seqlen_offsets=off, interleaved=interleaved)
    positions = torch.tensor(offsets).view(-1, 1) + torch.arange(5)
    positions = positions.expand(2, 5)
    torch.testing.assert_close(out, complex_rotary(x, angle, positions, interleaved))
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


# ---------------------------------------------------------------- kv cache


def kvcache_problem(gen, b=2, cache_rows=None, sq=3, snew=2, h=4, hk=2, d=16, cache_len=12):
    q = torch.randn(b, sq, h, d, generator=gen)
    k_cache = torch.randn(cache_rows or b, cache_len, hk, d, generator=gen)
    v_cache = torch.randn(cache_rows or b, cache_len, hk, d, generator=gen)
    k = torch.randn(b, snew, hk, d, generator=gen) if snew else None
    v = torch.randn(b, snew, hk, d, generator=gen) if snew else None
    return q, k_cache, v_cache, k, v


@pytest.mark.parametrize(
    "opts",
    [{}, {"causal": True}, {"window_size": (3, 0)}, {"alibi_slopes": torch.rand(4) * 0.5}],
)
@pytest.mark.parametrize("with_leftpad", [False, True])
def test_kvcache_append(opts, with_leftpad):
    gen = torch.Generator().manual_seed(4)
    q, k_cache, v_cache, k, v = kvcache_problem(gen)
    originals = [t.clone() for t in (q, k_cache, v_cache, k, v)]
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    leftpad = torch.tensor([2, 0], dtype=torch.int32) if with_leftpad else None
    out, lse, k_new, v_new = attention_kvcache_ref(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad, **opts
    )
    for t, orig in zip((q, k_cache, v_cache, k, v), originals):
        assert torch.equal(t, orig)  # inputs untouched
    for i, n in enumerate(seqlens.tolist()):
        written = torch.zeros(k_cache.shape[1], dtype=torch.bool)
        written[n : n + 2] = True
        assert torch.equal(k_new[i, written], k[i]) and torch.equal(v_new[i, written], v[i])
        assert torch.equal(k_new[i, ~written], k_cache[i, ~written])
        assert torch.equal(v_new[i, ~written], v_cache[i, ~written])
        lp = leftpad[i].item() if with_leftpad else 0
        keys = torch.cat((k_cache[i, lp:n], k[i]))[None]
        values = torch.cat((v_cache[i, lp:n], v[i]))[None]
        o, l = attention_ref(q[i : i + 1], keys, values, **opts)
        torch.testing.assert_close(out[i : i + 1], o)
        torch.testing.assert_close(lse[i : i + 1], l)


def test_kvcache_defaults_attend_the_whole_cache():
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, _, _ = kvcache_problem(gen, snew=0)
    out, lse, k_new, v_new = attention_kvcache_ref(q, k_cache, v_cache, causal=True)
    o, l = attention_ref(q, k_cache, v_cache, causal=True)
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(lse, l)
    assert torch.equal(k_new, k_cache) and torch.equal(v_new, v_cache)


def test_kvcache_batch_idx_selects_cache_rows():
    gen = torch.Generator().manual_seed(6)
    q, k_cache, v_cache, k, v = kvcache_problem(gen, cache_rows=5)
    idx = torch.tensor([3, 0], dtype=torch.int32)
    seqlens = torch.tensor([4, 7], dtype=torch.int32)
    out, lse, k_new, v_new = attention_kvcache_ref(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=idx, causal=True
    )
    out_e, lse_e, k_e, v_e = attention_kvcache_ref(
        q, k_cache[idx.long()], v_cache[idx.long()], k, v, cache_seqlens=seqlens, causal=True
    )
    torch.testing.assert_close(out, out_e)
    torch.testing.assert_close(lse, lse_e)
    assert torch.equal(k_new[idx.long()], k_e) and torch.equal(v_new[idx.long()], v_e)
    untouched = [1, 2, 4]
    assert torch.equal(k_new[untouched], k_cache[untouched])
    assert torch.equal(v_new[untouched], v_cache[untouched])


def test_kvcache_paged_equals_contiguous():
    gen = torch.Generator().manual_seed(7)
    q, k_cache, v_cache, k, v = kvcache_problem(gen, cache_len=12)
    seqlens = torch.tensor([3, 10], dtype=torch.int32)
    k_pages, block_table = paginate(list(k_cache), 4, 3, torch.Generator().manual_seed(8))
    v_pages, _ = paginate(list(v_cache), 4, 3, torch.Generator().manual_seed(8))
    opts = dict(cache_seqlens=seqlens, causal=True, softcap=3.0)
    out, lse, k_new, v_new = attention_kvcache_ref(q, k_cache, v_cache, k, v, **opts)
    out_p, lse_p, kp_new, vp_new = attention_kvcache_ref(
        q, k_pages, v_pages, k, v, block_table=block_table, **opts
    )
    torch.testing.assert_close(out_p, out)
    torch.testing.assert_close(lse_p, lse)
    assert torch.equal(gather_paged(kp_new, block_table, 12), k_new)
    assert torch.equal(gather_paged(vp_new, block_table, 12), v_new)
    unused = torch.ones(k_pages.shape[0], dtype=torch.bool)
    unused[block_table.flatten().long()] = False
    assert torch.equal(kp_new[unused], k_pages[unused])


@pytest.mark.parametrize(
    "causal, window, per_row",
    [
        (False, (-1, -1), False),
        (True, (-1, -1), True),
        (False, (2, 1), True),
        (False, (50, -1), False),
    ],
)
@pytest.mark.parametrize("interleaved", [False, True])
def test_kvcache_rotary_positions(causal, window, per_row, interleaved):
    """k rows rotate at cache_seqlens + i; q rows too when causal/local (a window side >= the
    cache length, 12 here, is unbounded), else all at cache_seqlens. Leftpad does not shift them."""
    gen = torch.Generator().manual_seed(9)
    q, k_cache, v_cache, k, v = kvcache_problem(gen)
    seqlens = torch.tensor([5, 2], dtype=torch.int32)
    leftpad = torch.tensor([1, 0], dtype=torch.int32)
    angle = torch.rand(16, 6, generator=gen) * 2 * math.pi
    out, _, k_new, _ = attention_kvcache_ref(
        q, k_cache, v_cache, k, v, rotary_cos=angle.cos(), rotary_sin=angle.sin(),
        cache_seqlens=seqlens, cache_leftpad=leftpad, causal=causal, window_size=window,
        rotary_interleaved=interleaved,
    )
    base = seqlens.long().view(2, 1)
    k_pos = base + torch.arange(2)
    q_pos = base + torch.arange(3) if per_row else base.expand(2, 3)
    k_ro = complex_rotary(k, angle, k_pos, interleaved)
    q_ro = complex_rotary(q, angle, q_pos, interleaved)
    for i, n in enumerate(seqlens.tolist()):
        torch.testing.assert_close(k_new[i, n : n + 2], k_ro[i])
        lp = leftpad[i].item()
        keys = torch.cat((k_cache[i, lp:n], k_ro[i]))[None]
        values = torch.cat((v_cache[i, lp:n], v[i]))[None]
        o, _ = attention_ref(q_ro[i : i + 1], keys, values, causal=causal, window_size=window)
        torch.testing.assert_close(out[i : i + 1], o)


def test_kvcache_overflow_raises():
    gen = torch.Generator().manual_seed(10)
    q, k_cache, v_cache, k, v = kvcache_problem(gen, cache_len=6)
    with pytest.raises(ValueError, match="cache_seqlens"):
        seqlens = torch.tensor([5, 0], dtype=torch.int32)
        attention_kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)


def test_a_negative_scale_is_the_positive_one_on_minus_q():
    """What launch/args.py:positive_scale runs: scale -s on q is scale s on -q, masks included."""
    q, k, v = (torch.randn(1, 33, 2, 32) for _ in range(3))
    a, a_lse = attention_ref(q, k, v, softmax_scale=-0.4, causal=True)
    b, b_lse = attention_ref(-q, k, v, softmax_scale=0.4, causal=True)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a_lse, b_lse)
