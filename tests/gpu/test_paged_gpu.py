"""Paged KV through `flash_attn_varlen_func(..., block_table=...)` on the GPU: shuffled block
tables, page sizes from 1 to 1000 (multiples of 16, which take the page-run copy, and any other
size, which looks each row's page up), smaller and larger than a key block, against the
reference and bitwise against the same keys stored contiguously on the kernel the paged call
took (on sm_90 the Hopper varlen entry where pages hold whole key blocks of it, else the SM80
kernel; hypothesis draws the SM80 path too, which other GPUs take); and the Hopper entry's
pages against the reference and its own contiguous calls. Each test asserts (`kernels`) which
kernel ran."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_flash.reference import attention_varlen_ref
from cute_flash.tools.peers import arch_path
from tests.helpers.caches import paged_cache
from tests.helpers.gpu_utils import assert_matches_reference, cu_seqlens, gpu_settings, on_path, varlen_attention

pytestmark = pytest.mark.gpu

GPU_SETTINGS = gpu_settings(12)
PAGE_SIZES = [16, 32, 48, 64, 80, 128, 256, 512, 1, 5, 8, 24, 100, 1000]


def hopper_takes(page_size, d):
    """The documented rule: the Hopper varlen entry reads pages that hold whole key blocks of it,
    128 keys up to head dim 128, 64 above."""
    return page_size % (128 if d <= 128 else 64) == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("causal", [False, True])
@GPU_SETTINGS
@given(rng=st.random_module(), data=st.data(), hh=st.sampled_from([(2, 2), (4, 1), (8, 2)]),
       d=st.one_of(st.sampled_from([64, 128, 256]), st.integers(1, 256)),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_paged_matches_reference_and_contiguous(rng, data, hh, d, causal, page_size, dtype, kernels):
    lq = data.draw(st.lists(st.one_of(st.sampled_from([0, 1, 17, 64, 129]), st.integers(0, 400)),
                            min_size=1, max_size=5))
    lk = data.draw(st.lists(st.one_of(st.sampled_from([1, 15, 16, 17, 63, 64, 65]), st.integers(0, 700)),
                            min_size=len(lq), max_size=len(lq)))
    if max(lk) == 0:
        lk[0] = 1
    h, hk = hh
    k_pages, v_pages, table, k, v = paged_cache(lk, page_size, hk, d, dtype)
    q = torch.randn(sum(lq), h, d, device="cuda", dtype=dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    path = data.draw(st.sampled_from(["sm90", "sm80"]), label="CUTE_FLASH_ARCH_PATH")
    taken = path if hopper_takes(page_size, d) else "sm80"  # smaller pages fall back to the SM80 kernel
    kernels.clear()  # the fixture spans every example
    with arch_path(path):
        out, lse = varlen_attention(q, k_pages, v_pages, cu_q, cu_k, lq, lk, causal=causal, block_table=table)
    assert kernels == (on_path(taken, "fwd") if sum(lq) else set())  # no query row: no launch
    assert_matches_reference(out, lse, q, k_pages, v_pages, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, block_table=table, causal=causal)
    # the contiguous keys on the kernel the paged call took
    with arch_path(taken):
        flat, flat_lse = varlen_attention(q, k, v, cu_q, cu_k, lq, lk, causal=causal)
    assert kernels == (on_path(taken, "fwd") if sum(lq) else set())
    assert torch.equal(out, flat) and torch.equal(lse, flat_lse)


@pytest.mark.parametrize("opts", [
    dict(window_size=(70, 10)), dict(softcap=15.0), dict(alibi=True, causal=True),
    dict(seqused=True, causal=True),
])
@pytest.mark.parametrize("page_size", [16, 256, 7])
def test_paged_modifiers(opts, page_size, kernels):
    lq, lk = [1, 100, 257, 33], [300, 1, 129, 600]
    k_pages, v_pages, table, _, _ = paged_cache(lk, page_size, 2, 128, torch.bfloat16)
    q = torch.randn(sum(lq), 4, 128, device="cuda", dtype=torch.bfloat16)
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(4, device="cuda", dtype=torch.float32)
    if opts.pop("seqused", False):
        opts["seqused_k"] = torch.tensor([0, 1, 100, 599], dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    with arch_path("default"):
        out, lse = varlen_attention(q, k_pages, v_pages, cu_q, cu_k, lq, lk, block_table=table, **opts)
    assert kernels == on_path("default" if hopper_takes(page_size, 128) else "sm80", "fwd")
    assert_matches_reference(out, lse, q, k_pages, v_pages, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, block_table=table, **opts)


@pytest.mark.parametrize("opts", [
    dict(), dict(causal=True), dict(window_size=(70, 10)), dict(softcap=15.0), dict(alibi=True, causal=True),
    dict(seqused=True, causal=True),
])
@pytest.mark.parametrize("d, page_size", [(128, 128), (128, 256), (64, 512), (256, 64), (96, 256)])
def test_hopper_paged_varlen(d, page_size, opts, kernels):
    """Paged varlen on the Hopper kernel's varlen entry (the sm_90 default for pages holding
    whole key blocks, 128 keys up to d 128, 64 above): against the reference, and bitwise
    against the same keys packed contiguously on the same kernel (the key blocks start at each
    sequence's first key either way; what the last block reads past seqlen_k, another
    sequence's rows or a page's unused ones, is masked in K and zeroed in V). Sequences of 1
    to 600 keys, an empty query row set, GQA 4 / 2."""
    lq, lk = [1, 100, 0, 257, 33], [300, 1, 5, 129, 600]
    k_pages, v_pages, table, k, v = paged_cache(lk, page_size, 2, d, torch.bfloat16)
    q = torch.randn(sum(lq), 4, d, device="cuda", dtype=torch.bfloat16)
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(4, device="cuda", dtype=torch.float32)
    if opts.pop("seqused", False):
        opts["seqused_k"] = torch.tensor([0, 1, 5, 100, 599], dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    with arch_path("sm90"):  # whatever the environment says
        out, lse = varlen_attention(q, k_pages, v_pages, cu_q, cu_k, lq, lk, block_table=table, **opts)
        flat, flat_lse = varlen_attention(q, k, v, cu_q, cu_k, lq, lk, **opts)
    assert kernels == on_path("sm90", "fwd")
    assert_matches_reference(out, lse, q, k_pages, v_pages, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, block_table=table, **opts)
    assert torch.equal(out, flat) and torch.equal(lse, flat_lse)
