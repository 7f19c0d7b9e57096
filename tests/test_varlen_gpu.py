"""`flash_attn_varlen_func` against `cute_flash.reference.attention_varlen_ref` on the GPU:
packed batches of mixed lengths (0, 1, shorter than a block, ragged), seqused_k, every score
modifier, and equality with the dense path for equal-length batches."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_flash.reference import attention_varlen_ref
from tests.gpu_utils import assert_matches_reference, cu_seqlens, gpu_settings, poison_allocator, varlen_attention

pytestmark = pytest.mark.gpu

GPU_SETTINGS = gpu_settings(15)
seq_lengths = st.lists(st.one_of(st.sampled_from([0, 1, 2, 17, 63, 64, 65, 127, 128, 129]),
                                 st.integers(0, 600)), min_size=1, max_size=6)


def _packed(lq, lk, h, hk, d, dtype):
    q = torch.randn(sum(lq), h, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@GPU_SETTINGS
@given(lengths=st.data(), hh=st.sampled_from([(2, 2), (4, 1), (6, 3)]),
       d=st.one_of(st.sampled_from([64, 128]), st.integers(1, 256)))
def test_varlen_matches_reference(lengths, hh, d, causal, dtype):
    lq = lengths.draw(seq_lengths)
    lk = lengths.draw(st.lists(st.integers(0, 600), min_size=len(lq), max_size=len(lq)))
    if sum(lk) == 0:
        lk[0] = 1
    q, k, v = _packed(lq, lk, *hh, d, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, lq, lk, causal=causal)
    assert_matches_reference(out, lse, q, k, v, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, causal=causal)


@pytest.mark.parametrize("opts", [
    dict(window_size=(50, 0)), dict(window_size=(30, 70)), dict(softcap=20.0),
    dict(alibi="bh", causal=True), dict(alibi="h", window_size=(-1, 10)),
])
def test_varlen_modifiers(opts):
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


def test_seqused_k():
    from cute_flash import flash_attn_varlen_func

    lq, lk = [40, 200, 1], [300, 100, 64]
    q, k, v = _packed(lq, lk, 2, 2, 64, torch.float16)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    used = torch.tensor([10, 100, 0], dtype=torch.int32, device="cuda")
    poison_allocator()
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True, seqused_k=used,
                                         return_attn_probs=True)
    assert_matches_reference(out, lse, q, k, v, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, seqused_k=used, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_equal_lengths_match_the_dense_path(causal, monkeypatch):
    """Packed and dense calls share the SM80 kernel (on sm_90 dense ones default to the Hopper
    kernel, so the SM80 path is selected): equal lengths give bit-identical results."""
    from cute_flash import flash_attn_func, flash_attn_varlen_func

    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    b, s, h, d = 3, 333, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = cu_seqlens([s] * b)
    dense, dense_lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    out, lse, _ = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, s, s,
                                         causal=causal, return_attn_probs=True)
    assert torch.equal(out.view(b, s, h, d), dense)
    assert torch.equal(lse.view(h, b, s).transpose(0, 1), dense_lse)
