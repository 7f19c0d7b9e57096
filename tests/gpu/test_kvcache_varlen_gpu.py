"""`flash_attn_with_kvcache` with packed queries of their own count per sequence on the kernels
(chunked prefill, speculative decoding): each sequence's output and LSE against the reference
run on that sequence alone by the criterion of docs/semantics.md, and the cache rows the call
appended, on the Hopper path and the SM80 one, contiguous and paged, with rotary and split-KV.
tests/cpu/test_kvcache_varlen.py checks the same around a reference launcher on the CPU."""
import pytest
import torch

import cute_flash
from cute_flash.launch import kvcache
from cute_flash.reference import attention_kvcache_ref
from tests.helpers.gpu_utils import assert_matches_reference, config_lookups, on_path

pytestmark = pytest.mark.gpu
H, HK, D, CAPACITY = 32, 8, 128, 4096


def _case(n_q, lens, page_size, rotary, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = len(n_q)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    case = dict(q=rnd(sum(n_q), H, D), cu_seqlens_q=cu, max_seqlen_q=max(n_q), k=rnd(sum(n_q), HK, D),
                v=rnd(sum(n_q), HK, D), cu_seqlens_k_new=cu,
                cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"))
    if page_size is None:
        case.update(k_cache=rnd(b, CAPACITY, HK, D), v_cache=rnd(b, CAPACITY, HK, D))
    else:
        pages = CAPACITY // page_size
        case.update(k_cache=rnd(b * pages, page_size, HK, D), v_cache=rnd(b * pages, page_size, HK, D),
                    block_table=torch.randperm(b * pages, device="cuda").to(torch.int32).view(b, pages))
    if rotary:
        angles = torch.rand(CAPACITY, D // 2, device="cuda") * 6.28
        case.update(rotary_cos=angles.cos().bfloat16(), rotary_sin=angles.sin().bfloat16())
    return case


@pytest.mark.parametrize("page_size", [None, 256])
@pytest.mark.parametrize("rotary", [False, True])
def test_packed_queries_against_each_sequence_alone(arch_path, kernels, page_size, rotary, monkeypatch):
    """On the Hopper path the launch folds the 16 rows' GQA groups, and the packing launch
    writes the queries in the fold's order: no copy folds them or unfolds the output."""
    n_q = [1, 16, 3, 1, 8, 5, 2, 1]
    lens = [4000, 0, 1234, 17, 3000, 255, 4090, 64]
    case = _case(n_q, lens, page_size, rotary, seed=len(n_q) + (page_size or 0))
    before = [c.clone() for c in (case["k_cache"], case["v_cache"])]
    kvcache._calls.clear()
    if on_path(arch_path, "fwd") == on_path("sm90", "fwd"):
        for copy in ("fold_queries", "unfold_rows"):
            monkeypatch.setattr(kvcache, copy, lambda *args, name=copy: pytest.fail(f"{name} ran"))
    out, lse = cute_flash.flash_attn_with_kvcache(**case, causal=True, return_softmax_lse=True)
    assert out.shape == case["q"].shape and lse.shape == (H, sum(n_q))
    assert kernels == on_path(arch_path, "fwd")
    if on_path(arch_path, "fwd") == on_path("sm90", "fwd"):  # the Hopper entry folds the 16 rows' groups
        assert {call.plan.query_group for call in kvcache._calls.values()} == {H // HK}
    cu = case["cu_seqlens_q"].tolist()
    for b in range(len(n_q)):
        rows = slice(cu[b], cu[b + 1])
        per_seq = dict(cache_seqlens=case["cache_seqlens"][b:b + 1], causal=True, rotary_cos=case.get("rotary_cos"),
                       rotary_sin=case.get("rotary_sin"))
        if page_size is None:
            k_cache, v_cache = (c[b:b + 1] for c in before)
        else:
            k_cache, v_cache = before
            per_seq.update(block_table=case["block_table"][b:b + 1])
        _, _, k_new, _ = attention_kvcache_ref(case["q"][None, rows], k_cache, v_cache, case["k"][None, rows],
                                               case["v"][None, rows], **per_seq)

        def ref_fn(q, k, v, upcast=True, **opts):  # sequence b alone, the appends included
            out, lse, *_ = attention_kvcache_ref(q, k, v, case["k"][None, rows], case["v"][None, rows],
                                                 upcast=upcast, **opts)
            return out, lse

        assert_matches_reference(out[None, rows], lse[None, :, rows], case["q"][None, rows], k_cache, v_cache,
                                 ref_fn, **per_seq)
        if page_size is None:  # the call's appends are the reference's
            end = lens[b] + n_q[b]
            torch.testing.assert_close(case["k_cache"][b, lens[b]:end].float(), k_new[0, lens[b]:end].float(),
                                       atol=1e-2, rtol=1e-2)  # rotated in fp32 by each, rounded to bf16


@pytest.fixture
def packing(monkeypatch):
    """The packed-append configs the calls looked up (kernels/sm80/append_packed.py)."""
    from cute_flash.kernels.sm80.append_packed import PackedAppendConfig

    return config_lookups(monkeypatch, PackedAppendConfig)


def test_queries_without_new_keys_interleaved_rotary(packing):
    """Verifying tokens already in the cache: no append, every query rotated at its sequence's
    cache length (not causal: flash-attn's rule), interleaved pairs; against the reference."""
    n_q, lens = [3, 0, 7, 1], [100, 50, 2000, CAPACITY - 1]  # the last row of the rotary table
    case = _case(n_q, lens, None, True, seed=5)
    for key in ("k", "v", "cu_seqlens_k_new"):
        del case[key]
    out, lse = cute_flash.flash_attn_with_kvcache(**case, rotary_interleaved=True, return_softmax_lse=True)
    assert [(c.has_new, c.rotary, c.interleaved, c.q_per_row) for c in packing] == [(False, True, True, False)]
    cu = case["cu_seqlens_q"].tolist()
    for b in range(len(n_q)):
        rows = slice(cu[b], cu[b + 1])
        if cu[b] == cu[b + 1]:
            continue
        per_seq = dict(cache_seqlens=case["cache_seqlens"][b:b + 1], rotary_cos=case["rotary_cos"],
                       rotary_sin=case["rotary_sin"], rotary_interleaved=True)
        k_cache, v_cache = (c[b:b + 1] for c in (case["k_cache"], case["v_cache"]))

        def ref_fn(q, k, v, upcast=True, **opts):
            out, lse, *_ = attention_kvcache_ref(q, k, v, upcast=upcast, **opts)
            return out, lse

        assert_matches_reference(out[None, rows], lse[None, :, rows], case["q"][None, rows], k_cache, v_cache,
                                 ref_fn, **per_seq)


@pytest.mark.parametrize("page_size", [None, 256])
def test_appends_past_the_cache_are_skipped(packing, page_size):
    """Bad metadata: new rows past the capacity (contiguous caches) or in a page id past the pages
    (paged; its capacity kept, which the host guard checks) are skipped by the packing launch;
    every other cache row is as before or the call's append."""
    n_q = [4, 2]
    lens = [CAPACITY - 2, 10] if page_size is None else [100, 10]
    case = _case(n_q, lens, page_size, False, seed=9)
    if page_size is not None:
        case["block_table"][1, 0] = 1 << 20  # sequence 1's first page: past the pages
    before = [c.clone() for c in (case["k_cache"], case["v_cache"])]
    cute_flash.flash_attn_with_kvcache(**case, causal=True)
    torch.cuda.synchronize()
    assert [c.paged for c in packing] == [page_size is not None]
    if page_size is None:
        k_new = case["k"]
        assert torch.equal(case["k_cache"][0, CAPACITY - 2:], k_new[:2])  # rows 2 and 3 fell past the cache
        assert torch.equal(case["k_cache"][0, :CAPACITY - 2], before[0][0, :CAPACITY - 2])
        assert torch.equal(case["k_cache"][1, 10:12], k_new[4:6])
        assert torch.equal(case["k_cache"][1, 12:], before[0][1, 12:])
    else:
        changed = (case["k_cache"] != before[0]).flatten(1).any(1).nonzero().flatten().tolist()
        first = int(case["block_table"][0, 0])  # sequence 0's rows 100..103; sequence 1's page is past the pages
        assert changed == [first]
        assert torch.equal(case["k_cache"][first, 100:104], case["k"][:4])


@pytest.mark.parametrize("vec", [8, 1])
@pytest.mark.parametrize("heads, fold", [(12, 1), (12, 3), (32, 1), (32, 4), (32, 8)])
def test_the_packing_launch_writes_every_padded_row(heads, fold, vec, packing):
    """q_pad comes uninitialised (here NaN): the packing launch puts each sequence's queries in
    its last rows and zeros in the rows before them, over every head group (12 heads: a partial
    group of eight), each row's heads in the order of the query fold by `fold` (`fold_queries`'
    rows), and writes each query's flat row and each sequence's key count; with 16-byte copies,
    and one element at a time where q starts off a 16-byte boundary."""
    n_q, lens, max_q, d = [3, 0, 16, 1, 7], [5, 9, 0, 100, 2], 16, 64
    g = torch.Generator(device="cuda").manual_seed(heads)
    q = torch.randn(sum(n_q) * heads * d + 8, device="cuda", dtype=torch.bfloat16, generator=g)
    q = q[8 - vec:8 - vec + sum(n_q) * heads * d].view(sum(n_q), heads, d)  # vec 1: 14 bytes in
    k, v = (torch.randn(sum(n_q), 4, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k_cache, v_cache = (torch.zeros(len(n_q), 128, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q_pad = torch.full((len(n_q), max_q, heads, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    lengths = torch.empty(len(n_q), dtype=torch.int32, device="cuda")
    flat = kvcache.pack_kvcache_queries(q, q_pad, lengths, k_cache, v_cache, k, v, cu, cu, cache_seqlens, None, None,
                                        True, fold)
    assert [c.vec for c in packing] == [vec]
    want = torch.zeros_like(q_pad)
    rows = []
    for b, n in enumerate(n_q):
        want[b, max_q - n:] = q[cu[b]:cu[b + 1]]
        rows += [b * max_q + max_q - n + i for i in range(n)]
    assert torch.equal(q_pad, kvcache.fold_queries(want, fold).view(want.shape))
    assert flat.tolist() == rows and lengths.tolist() == [a + n for a, n in zip(lens, n_q)]
    for b, n in enumerate(n_q):  # the new rows at each sequence's end of the cache
        assert torch.equal(k_cache[b, lens[b]:lens[b] + n], k[cu[b]:cu[b + 1]])
        assert torch.equal(v_cache[b, lens[b]:lens[b] + n], v[cu[b]:cu[b + 1]])
