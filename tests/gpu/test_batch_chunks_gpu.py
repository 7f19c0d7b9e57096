"""More sequences than a launch grid's y / z dimension holds (65535): each entry runs in chunks
(cute_flash/launch/batch_chunks.py) and still matches the reference. At the real limit (65537
sequences, two chunks) on both kernel paths, and with the limit lowered to 2 sequences on
ragged packed batches (three chunks whose dQaccum row blocks overlap)."""
import pytest
import torch

from cute_flash import flash_attn_func, flash_attn_varlen_func
from cute_flash.launch import batch_chunks
from cute_flash.reference import attention_ref, attention_varlen_ref
from tests.helpers.backward import assert_grads_match, ours
from tests.helpers.caches import run_case
from tests.helpers.gpu_utils import assert_matches_reference, backward_on_path, cu_seqlens, on_path

pytestmark = pytest.mark.gpu
# 65537-CTA grids: minutes each under racecheck, 6 of 8 past 7 minutes (docs/tuning/gpu-suite.md, eleventh session)
past_the_limit = pytest.mark.sanitizer_slow

PAST = batch_chunks.GRID_MAX_BATCH + 2
PATHS = ["sm80", "sm90"]
# A packed backward in chunks runs the SM80 kernel on either path: the Hopper one's preprocess and dQ
# conversion put the batch on a grid dimension and are not chunked (launch/backward.py:flash_bwd_varlen)
CHUNKED_PACKED_BWD = {"sm80_bwd"}


@past_the_limit
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
def test_dense_past_the_grid_limit(path, causal, monkeypatch, kernels):
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
    q, dout = (torch.randn(PAST, 3, 2, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(PAST, 5, 1, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert_matches_reference(out, lse, q, k, v, causal=causal)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)
    assert kernels == on_path(path, "fwd") | backward_on_path(path, 32), kernels


@past_the_limit
@pytest.mark.parametrize("path", PATHS)
def test_packed_past_the_grid_limit(path, monkeypatch, kernels):
    """65537 sequences of 3 query and 5 key rows: the dense reference of the same rows."""
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
    q, dout = (torch.randn(PAST * 3, 2, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(PAST * 5, 1, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (torch.arange(0, n * (PAST + 1), n, device="cuda", dtype=torch.int32) for n in (3, 5))

    def dense(x, rows):
        return x.view(PAST, rows, *x.shape[1:])

    def ref(q, k, v, **opts):
        out, lse = attention_ref(dense(q, 3), dense(k, 5), dense(v, 5), **opts)
        return out.flatten(0, 1), lse.permute(1, 0, 2).flatten(1)  # lse (h, total_q)

    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, causal=True, return_attn_probs=True)
    assert_matches_reference(out, lse, q, k, v, ref_fn=ref, causal=True)
    out, grads = ours(lambda q, k, v, **o: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, **o), dout, q, k, v,
                      causal=True)
    assert_grads_match(grads, q, k, v, dout, out=out, ref_fn=ref, causal=True)
    assert kernels == on_path(path, "fwd") | CHUNKED_PACKED_BWD, kernels


@past_the_limit
@pytest.mark.parametrize("path", PATHS)
def test_kvcache_past_the_grid_limit(path, monkeypatch, kernels):
    """Decode over 65537 caches of 1-32 keys (run_case checks output, LSE and the caches)."""
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
    run_case(PAST, 1, 4, 1, 64, torch.bfloat16, 32, torch.randint(1, 33, (PAST,)).tolist(), 0, 0)
    assert kernels == on_path(path, "fwd"), kernels


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged"])
def test_kvcache_append_in_chunks(path, layout, monkeypatch, kernels):
    """The limit at 2: five sequences append two rows each and attend, in chunks of 2, 2 and 1
    (cache_batch_idx on the SM80 kernel on either path: `policy.hopper_cache_fits`)."""
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
    monkeypatch.setattr(batch_chunks, "GRID_MAX_BATCH", 2)
    run_case(5, 2, 8, 2, 128, torch.bfloat16, 512, [0, 300, 17, 128, 510], 2, 0, causal=True,
             page_size=256 if layout == "paged" else None, batch_idx=layout == "batch_idx")
    assert kernels == on_path("sm80" if layout == "batch_idx" else path, "fwd"), kernels


@pytest.mark.parametrize("path", PATHS)
def test_packed_ragged_chunks(path, monkeypatch, kernels):
    """The limit at 2: five ragged sequences in chunks of 2, 2 and 1, forward and backward."""
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
    monkeypatch.setattr(batch_chunks, "GRID_MAX_BATCH", 2)
    lq, lk = [70, 1, 200, 129, 5], [90, 300, 1, 128, 64]
    q, dout = (torch.randn(sum(lq), 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(sum(lk), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)

    def ref(q, k, v, **opts):
        return attention_varlen_ref(q, k, v, cu_q, cu_k, **opts)

    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True)
    assert_matches_reference(out, lse, q, k, v, ref_fn=ref)
    out, grads = ours(lambda q, k, v, **o: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), **o),
                      dout, q, k, v)
    assert_grads_match(grads, q, k, v, dout, out=out, ref_fn=ref)
    assert kernels == on_path(path, "fwd") | CHUNKED_PACKED_BWD, kernels
