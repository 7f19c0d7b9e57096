"""`flash_attn_varlen_func` against `cute_flash.reference.attention_varlen_ref` on the GPU:
packed batches of mixed lengths (0, 1, shorter than a block, ragged), seqused_k, every score
modifier, equality with the dense path for equal-length batches, and no leak of one sequence's
NaN into another's output. `path` selects the kernels (`CUTE_FLASH_ARCH_PATH`): sm80 the SM80
kernel; sm90 the sm_90 default, the Hopper kernel on an H200 (contiguous keys, with or without
seqused_k; the SM80 kernel elsewhere); each test asserts (`kernels`) that the path it names ran."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_flash.reference import attention_varlen_ref
from tests.helpers.gpu_utils import (assert_matches_reference, cu_seqlens, gpu_settings, on_path, poison_allocator,
                             varlen_attention)

pytestmark = pytest.mark.gpu

GPU_SETTINGS = gpu_settings(15)
seq_lengths = st.lists(st.one_of(st.sampled_from([0, 1, 2, 17, 63, 64, 65, 127, 128, 129]),
                                 st.integers(0, 600)), min_size=1, max_size=6)


def _select(path, monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)


def _packed(lq, lk, h, hk, d, dtype):
    q = torch.randn(sum(lq), h, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("path", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@GPU_SETTINGS
@given(rng=st.random_module(), lengths=st.data(), hh=st.sampled_from([(2, 2), (4, 1), (6, 3)]),
       d=st.one_of(st.sampled_from([64, 128]), st.integers(1, 256)))
def test_varlen_matches_reference(rng, lengths, hh, d, causal, dtype, path, monkeypatch, kernels):
    _select(path, monkeypatch)
    kernels.clear()  # the fixture spans every example
    lq = lengths.draw(seq_lengths)
    lk = lengths.draw(st.lists(st.integers(0, 600), min_size=len(lq), max_size=len(lq)))
    if sum(lk) == 0:
        lk[0] = 1
    q, k, v = _packed(lq, lk, *hh, d, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, lq, lk, causal=causal)
    assert_matches_reference(out, lse, q, k, v, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, causal=causal)
    assert kernels == (on_path(path, "fwd") if sum(lq) else set())  # no query row: no launch


@pytest.mark.parametrize("opts", [
    dict(window_size=(50, 0)), dict(window_size=(30, 70)), dict(softcap=20.0),
    dict(alibi="bh", causal=True), dict(alibi="h", window_size=(-1, 10)),
])
@pytest.mark.parametrize("path", ["sm80", "sm90"])
def test_varlen_modifiers(opts, path, monkeypatch, kernels):
    _select(path, monkeypatch)
    lq, lk = [0, 1, 100, 257, 33], [5, 0, 300, 129, 500]
    q, k, v = _packed(lq, lk, 4, 2, 96, torch.bfloat16)
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    if alibi:
        shape = (4,) if alibi == "h" else (len(lq), 4)
        opts["alibi_slopes"] = torch.rand(shape, device="cuda", dtype=torch.float32)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, lq, lk, **opts)
    assert_matches_reference(out, lse, q, k, v, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, **opts)
    assert kernels == on_path(path, "fwd")


@pytest.mark.parametrize("path", ["sm80", "sm90"])
@pytest.mark.parametrize("d", [64, 96])
def test_seqused_k(d, path, monkeypatch, kernels):
    """seqused_k below the prefix sums' lengths (10 of 300, the unused keys NaN: the one key
    block read reaches into them), equal (100 of 100) and 0."""
    from cute_flash import flash_attn_varlen_func

    _select(path, monkeypatch)
    lq, lk = [40, 200, 1], [300, 100, 64]
    q, k, v = _packed(lq, lk, 2, 2, d, torch.float16)
    k[10:300], v[10:300] = float("nan"), float("nan")
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    used = torch.tensor([10, 100, 0], dtype=torch.int32, device="cuda")
    poison_allocator()
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True, seqused_k=used,
                                         return_attn_probs=True)
    assert_matches_reference(out, lse, q, k, v, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, seqused_k=used, causal=True)
    assert kernels == on_path(path, "fwd")


@pytest.mark.parametrize("path", ["sm80", "sm90"])
@pytest.mark.parametrize("causal", [False, True])
def test_equal_lengths_match_the_dense_path(causal, path, monkeypatch, kernels):
    """Packed and dense calls run the same kernel code per tile, on either path (the Hopper
    one: the dense call persistent, the packed one a CTA per tile; keys past a sequence zeroed
    by TMA in one, masked and V-cleared in the other): equal lengths give bit-identical
    results."""
    from cute_flash import flash_attn_func, flash_attn_varlen_func

    _select(path, monkeypatch)
    b, s, h, d = 3, 333, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = cu_seqlens([s] * b)
    dense, dense_lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    out, lse, _ = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, s, s,
                                         causal=causal, return_attn_probs=True)
    assert torch.equal(out.view(b, s, h, d), dense)
    assert torch.equal(lse.view(h, b, s).transpose(0, 1), dense_lse)
    assert kernels == on_path(path, "fwd")


@pytest.mark.parametrize("path", ["sm80", "sm90"])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_a_sequences_nan_stays_in_it(d, path, monkeypatch, kernels):
    """NaN in the first rows of sequence 1's Q, K and V: sequence 0's last key block reaches into
    them (100 keys, 128-key blocks), where P = 0 must not meet a NaN (the Hopper kernel zeroes
    those V rows). Sequence 0 matches its reference alone; sequence 1 is NaN, as it should."""
    from cute_flash import flash_attn_varlen_func
    from cute_flash.reference import attention_ref

    _select(path, monkeypatch)
    lq, lk = [70, 30], [100, 60]
    q, k, v = _packed(lq, lk, 4, 2, d, torch.bfloat16)
    for x, start in ((q, lq[0]), (k, lk[0]), (v, lk[0])):
        x[start:start + 3] = float("nan")
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    for causal in (False, True):
        poison_allocator()
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                             return_attn_probs=True)
        torch.cuda.synchronize()
        assert out[lq[0]:].isnan().all()
        q0, k0, v0 = q[None, :lq[0]], k[None, :lk[0]], v[None, :lk[0]]
        assert_matches_reference(out[None, :lq[0]], lse[None, :, :lq[0]], q0, k0, v0, ref_fn=attention_ref,
                                 causal=causal)
    assert kernels == on_path(path, "fwd")


@pytest.mark.parametrize("path", ["sm80", "sm90"])
@pytest.mark.parametrize("used", [False, True])
def test_leftpad_k_skips_each_sequences_first_keys(used, path, monkeypatch, kernels):
    """`_flash_attn_varlen_forward(..., leftpad_k=)`: sequence b attends to its keys from
    leftpad_k[b] on (of seqused_k[b] when given), causal aligned to those; the skipped keys are
    NaN, so reading one would show."""
    from cute_flash.flash_attn_interface import _flash_attn_varlen_forward

    _select(path, monkeypatch)
    lq, lk, pad = [30, 1, 100], [90, 40, 130], [10, 0, 129]
    q, k, v = _packed(lq, lk, 4, 2, 64, torch.bfloat16)
    starts = [sum(lk[:b]) for b in range(len(lk))]
    seen = [n - p for n, p in zip(lk, pad)]
    if used:
        seen = [max(0, n - 5 - p) for n, p in zip(lk, pad)]  # seqused_k = length - 5
    for s, p in zip(starts, pad):
        k[s:s + p], v[s:s + p] = float("nan"), float("nan")
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    leftpad = torch.tensor(pad, dtype=torch.int32, device="cuda")
    seqused = torch.tensor([n - 5 for n in lk], dtype=torch.int32, device="cuda") if used else None
    poison_allocator()
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.0, 0.125, True,
                                                leftpad_k=leftpad, seqused_k=seqused)
    torch.cuda.synchronize()
    assert kernels == on_path(path, "fwd")
    # the same sequences with the skipped keys cut away, on the reference
    kept = [torch.arange(s + p, s + p + n, device="cuda") for s, p, n in zip(starts, pad, seen)]
    k_cut, v_cut = k[torch.cat(kept)], v[torch.cat(kept)]
    assert_matches_reference(out, lse, q, k_cut, v_cut, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_seqlens(seen), softmax_scale=0.125, causal=True)
