"""KV caches on the GPU, shared by the GPU tests: a paged cache with its contiguous twin
(`paged_cache`: tests/gpu/test_paged_gpu.py, test_dropout_gpu.py) and one checked
`flash_attn_with_kvcache` case (`run_case`: tests/gpu/test_kvcache_gpu.py, test_batch_chunks_gpu.py,
test_scale_sign_gpu.py)."""
import torch

from cute_flash.reference import attention_kvcache_ref
from tests.helpers.gpu_utils import assert_matches_reference, poison_allocator


def paged_cache(lk, page_size, hk, d, dtype, generator=None, spare_pages=3):
    """A paged cache holding sequences of lengths lk in shuffled pages, plus the same keys and
    values packed contiguously: (k_pages, v_pages, block_table, k_packed, v_packed). Table
    entries past a sequence's pages point at real (unrelated) pages: the kernel must not read them."""
    pages_per_seq = [max(1, -(-n // page_size)) for n in lk]
    max_pages = max(pages_per_seq) + 1
    num_blocks = sum(pages_per_seq) + spare_pages
    k_pages = torch.randn(num_blocks, page_size, hk, d, device="cuda", dtype=dtype)
    v_pages = torch.randn(num_blocks, page_size, hk, d, device="cuda", dtype=dtype)
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.randint(0, num_blocks, (len(lk), max_pages), dtype=torch.int32)
    ks, vs = [], []
    for i, (n, p) in enumerate(zip(lk, pages_per_seq)):
        ids = [perm.pop() for _ in range(p)]
        table[i, :p] = torch.tensor(ids, dtype=torch.int32)
        ks.append(k_pages[ids].flatten(0, 1)[:n])
        vs.append(v_pages[ids].flatten(0, 1)[:n])
    return k_pages, v_pages, table.cuda(), torch.cat(ks), torch.cat(vs)


def ref_with(k, v):
    """The reference as assert_matches_reference calls it: (q, k_cache, v_cache, **opts), with
    the appended k, v bound here."""
    def ref(q, k_cache, v_cache, upcast=True, **opts):
        out, lse, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, upcast=upcast, **opts)
        return out, lse
    return ref


def _rotary(capacity, rotary_dim, dtype):
    angle = torch.rand(capacity, rotary_dim // 2, device="cuda") * 6.3
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _appended_rows(shape, cache_seqlens, seqlen_new, batch_idx=None, block_table=None):
    """Boolean (rows, seqlen) mask of the cache rows the append writes."""
    mask = torch.zeros(shape[:2], dtype=torch.bool, device="cuda")
    for i, start in enumerate(cache_seqlens.tolist()):
        pos = torch.arange(start, start + seqlen_new, device="cuda")
        if block_table is None:
            row = i if batch_idx is None else int(batch_idx[i])
            mask[row, pos] = True
        else:
            mask[block_table[i, pos // shape[1]].long(), pos % shape[1]] = True
    return mask


def run_case(b, sq, h, hk, d, dtype, capacity, seqlens, seqlen_new, num_splits, page_size=None,
             batch_idx=False, leftpad=None, rotary=None, causal=False, window=(-1, -1), softcap=0.0,
             alibi=False, softmax_scale=None):
    """Build a cache, run flash_attn_with_kvcache once with num_splits and once with 1, and
    check output, LSE and both caches."""
    from cute_flash import flash_attn_with_kvcache

    # a case whose appends run past the cache is bad metadata (tests/helpers/bad_metadata.py):
    # here the reference's rotary gather would assert on the device and take the worker's
    # CUDA context (every later test of the worker) with it
    assert all(n + seqlen_new <= capacity for n in seqlens), f"cache_seqlens {seqlens} + {seqlen_new} > {capacity}"
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    block_table = None
    if page_size is None:
        rows = b + 2 if batch_idx else b
        k_cache = torch.randn(rows, capacity, hk, d, device="cuda", dtype=dtype)
    else:
        per_seq = capacity // page_size
        num_blocks = b * per_seq + 3
        k_cache = torch.randn(num_blocks, page_size, hk, d, device="cuda", dtype=dtype)
        block_table = torch.randperm(num_blocks, device="cuda")[: b * per_seq].view(b, per_seq).int()
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = v = None
    if seqlen_new:
        k, v = (torch.randn(b, seqlen_new, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    opts = dict(cache_seqlens=cache_seqlens, block_table=block_table, causal=causal, window_size=window,
                softcap=softcap, softmax_scale=softmax_scale)
    if batch_idx:
        opts["cache_batch_idx"] = torch.randperm(b + 2, device="cuda")[:b].int()
    if leftpad is not None:
        opts["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device="cuda")
    if rotary is not None:
        rotary_dim, interleaved = rotary
        opts["rotary_cos"], opts["rotary_sin"] = _rotary(capacity, rotary_dim, dtype)
        opts["rotary_interleaved"] = interleaved
    if alibi:
        opts["alibi_slopes"] = torch.rand(h, device="cuda", dtype=torch.float32)

    k_orig, v_orig = k_cache.clone(), v_cache.clone()
    _, _, k_ref, v_ref = attention_kvcache_ref(q, k_orig, v_orig, k, v, **opts)
    poison_allocator()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=num_splits,
                                       return_softmax_lse=True, **opts)
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, q, k_orig, v_orig, ref_fn=ref_with(k, v), **opts)

    # The caches: appended rows as the reference writes them (rotary rounding may differ by an
    # ulp of the element type), everything else untouched.
    appended = _appended_rows(k_cache.shape, cache_seqlens, seqlen_new, opts.get("cache_batch_idx"),
                              block_table)
    for ours, orig, ref in ((k_cache, k_orig, k_ref), (v_cache, v_orig, v_ref)):
        assert torch.equal(ours[~appended], orig[~appended]), "cache changed outside the appended rows"
        torch.testing.assert_close(ours[appended], ref[appended], rtol=2 ** -7, atol=2 ** -7)
    assert torch.equal(v_cache[appended], v_ref[appended])

    # Appending the same rows again writes the same values: rerun unsplit and compare.
    one, one_lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=1,
                                           return_softmax_lse=True, **opts)
    _, bar = assert_matches_reference(one, one_lse, q, k_orig, v_orig, ref_fn=ref_with(k, v), **opts)
    assert (out.float() - one.float()).abs().max().item() <= bar
    fin = torch.isfinite(one_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    if fin.any():
        assert (lse[fin] - one_lse[fin]).abs().max().item() <= 1e-4

    # Without the LSE (it goes to scratch), twice: the split workspace and its arrival counters
    # are reused by the same call shape on the same stream, so the counters must be re-armed.
    for _ in range(2):
        again = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=num_splits, **opts)
        assert torch.equal(again, out)
