"""`flash_attn_with_kvcache` with a query count of its own per sequence (`cu_seqlens_q`,
`cu_seqlens_k_new`, `max_seqlen_q`; `cute_flash.kvcache_varlen`) on the CPU: each sequence's
output, LSE and appended cache rows against the reference run on that sequence alone, over a
stand-in for the launchers that computes with the reference (tests/helpers/reference_launch.py).
The GPU tests run the same calls on the kernels."""
import pytest
import torch

import cute_flash
from cute_flash.reference import attention_kvcache_ref
from tests.helpers import reference_launch

BF16 = dict(atol=2e-2, rtol=2e-2)
H, HK, D, CAPACITY = 4, 2, 32, 64


@pytest.fixture
def launch(monkeypatch):
    return reference_launch.install(monkeypatch)


def _case(n_q, n_new, lens, page_size=None, rotary=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(n_q)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    case = dict(q=rnd(sum(n_q), H, D), cu_seqlens_q=torch.tensor([0, *torch.tensor(n_q).cumsum(0)], dtype=torch.int32),
                max_seqlen_q=max(n_q), cache_seqlens=torch.tensor(lens, dtype=torch.int32))
    if page_size is None:
        case.update(k_cache=rnd(b, CAPACITY, HK, D), v_cache=rnd(b, CAPACITY, HK, D))
    else:
        pages = CAPACITY // page_size
        case.update(k_cache=rnd(b * pages, page_size, HK, D), v_cache=rnd(b * pages, page_size, HK, D),
                    block_table=torch.randperm(b * pages, generator=g).to(torch.int32).view(b, pages))
    if n_new is not None:
        case.update(k=rnd(sum(n_new), HK, D), v=rnd(sum(n_new), HK, D),
                    cu_seqlens_k_new=torch.tensor([0, *torch.tensor(n_new).cumsum(0)], dtype=torch.int32))
    if rotary:
        angles = torch.rand(CAPACITY, D // 4, generator=g) * 6.28
        case.update(rotary_cos=angles.cos().bfloat16(), rotary_sin=angles.sin().bfloat16())
    return case


def _check_each_sequence(case, out, lse, caches, **opts):
    """Sequence by sequence: its rows of out and lse, and the caches after the appends."""
    cu_q = case["cu_seqlens_q"].tolist()
    cu_k = case["cu_seqlens_k_new"].tolist() if "k" in case else None
    for b in range(len(cu_q) - 1):
        q = case["q"][None, cu_q[b]:cu_q[b + 1]]
        if q.shape[1] == 0:
            continue
        per_seq = dict(cache_seqlens=case["cache_seqlens"][b:b + 1], rotary_cos=case.get("rotary_cos"),
                       rotary_sin=case.get("rotary_sin"), **opts)
        if "block_table" in case:
            per_seq.update(block_table=case["block_table"][b:b + 1])
            k_cache, v_cache = caches
        else:
            k_cache, v_cache = (c[b:b + 1] for c in caches)
        if cu_k is not None:
            per_seq.update(k=case["k"][None, cu_k[b]:cu_k[b + 1]], v=case["v"][None, cu_k[b]:cu_k[b + 1]])
        ref_out, ref_lse, *_ = attention_kvcache_ref(q, k_cache, v_cache, **per_seq)
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]].float(), ref_out[0].float(), **BF16)
        torch.testing.assert_close(lse[:, cu_q[b]:cu_q[b + 1]], ref_lse[0], **BF16)


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("rotary, interleaved", [(False, False), (True, False), (True, True)])
def test_each_sequence_gets_its_own_queries_and_appends(launch, page_size, rotary, interleaved, fold):
    """`fold`: the launch folds the GQA group (the packing launch writes each row's heads in the
    fold's order, the unpad reads the folded output), or not."""
    launch.fold_queries = fold
    case = _case([1, 4, 0, 7], [1, 4, 0, 7], [10, 0, 30, 5], page_size, rotary)
    before = [c.clone() for c in (case["k_cache"], case["v_cache"])]
    out, lse = cute_flash.flash_attn_with_kvcache(**case, causal=True, rotary_interleaved=interleaved,
                                                  return_softmax_lse=True)
    assert out.shape == case["q"].shape and lse.shape == (H, case["q"].shape[0])
    assert launch.calls == ["kvcache_query_group", "pack_kvcache_queries", "flash_fwd_kvcache"]
    _check_each_sequence(case, out, lse, before, causal=True, rotary_interleaved=interleaved)
    # the appends landed where the reference puts them
    ref = case.copy()
    for b, (lo, hi) in enumerate(zip(case["cu_seqlens_k_new"][:-1].tolist(), case["cu_seqlens_k_new"][1:].tolist())):
        pos = case["cache_seqlens"][b].item() + torch.arange(hi - lo)
        k_new = case["k"][lo:hi]
        if rotary:
            from cute_flash.reference import apply_rotary_ref
            k_new = apply_rotary_ref(k_new[None], case["rotary_cos"], case["rotary_sin"],
                                     seqlen_offsets=case["cache_seqlens"][b:b + 1], interleaved=interleaved)[0]
        if page_size is None:
            got = case["k_cache"][b, pos]
        else:
            got = case["k_cache"][ref["block_table"][b, pos // page_size].long(), pos % page_size]
        torch.testing.assert_close(got.float(), k_new.float(), **BF16)


def test_queries_without_new_keys_verify_tokens_already_in_the_cache(launch):
    case = _case([3, 1, 5], None, [20, 7, 64])
    caches = [c.clone() for c in (case["k_cache"], case["v_cache"])]
    out, lse = cute_flash.flash_attn_with_kvcache(**case, causal=True, window_size=(6, 0), softcap=5.0,
                                                  return_softmax_lse=True)
    assert torch.equal(case["k_cache"], caches[0])  # nothing appended
    _check_each_sequence(case, out, lse, caches, causal=True, window_size=(6, 0), softcap=5.0)


def test_a_learnable_sink_reaches_the_packed_queries(launch):
    case = _case([2, 3], [2, 3], [4, 9])
    sink = torch.randn(H)
    before = [c.clone() for c in (case["k_cache"], case["v_cache"])]
    out, lse = cute_flash.flash_attn_with_kvcache(**case, causal=True, return_softmax_lse=True, learnable_sink=sink)
    cu = case["cu_seqlens_q"].tolist()
    for b in range(2):
        k_cache, v_cache = (c[b:b + 1] for c in before)
        lo, hi = case["cu_seqlens_k_new"][b].item(), case["cu_seqlens_k_new"][b + 1].item()
        ref_out, ref_lse, *_ = attention_kvcache_ref(
            case["q"][None, cu[b]:cu[b + 1]], k_cache, v_cache, case["k"][None, lo:hi], case["v"][None, lo:hi],
            cache_seqlens=case["cache_seqlens"][b:b + 1], causal=True, learnable_sink=sink)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]].float(), ref_out[0].float(), **BF16)
        torch.testing.assert_close(lse[:, cu[b]:cu[b + 1]], ref_lse[0], **BF16)


@pytest.mark.parametrize("change, match", [
    (dict(q=torch.zeros(1, 8, H, D, dtype=torch.bfloat16)), "q must be 3-D"),
    (dict(cache_seqlens=5), "cache_seqlens must be an int32 tensor"),
    (dict(cu_seqlens_k_new=None), "k, v and cu_seqlens_k_new go together"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), "not taken with cu_seqlens_q"),
    (dict(cu_seqlens_q=None), "go with cu_seqlens_q"),
])
def test_inconsistent_varlen_arguments_are_refused(launch, change, match):
    case = _case([2, 3], [2, 3], [4, 9])
    case.update(change)
    with pytest.raises(ValueError, match=match):
        cute_flash.flash_attn_with_kvcache(**case, causal=True)
    assert launch.calls == []


def test_a_refused_call_leaves_the_caches_as_they_were(launch):
    case = _case([2, 3], [2, 3], [4, 9])
    caches = [c.clone() for c in (case["k_cache"], case["v_cache"])]
    with pytest.raises(ValueError, match="alibi_slopes"):
        cute_flash.flash_attn_with_kvcache(**case, causal=True, alibi_slopes=torch.zeros(3))
    assert torch.equal(case["k_cache"], caches[0]) and torch.equal(case["v_cache"], caches[1])


def test_appends_past_the_cache_stay_inside_it(launch):
    """Bad metadata (rows past the capacity) writes nowhere outside the caches and raises nothing,
    as the append kernels skip such rows (docs/architecture.md, Bad metadata)."""
    case = _case([4, 1], [4, 1], [CAPACITY - 2, 0])
    cute_flash.flash_attn_with_kvcache(**case, causal=True)
    assert launch.calls == ["kvcache_query_group", "pack_kvcache_queries", "flash_fwd_kvcache"]


def test_checks_run_once_per_signature(launch, monkeypatch):
    """The fixed-length call's checks, run before the appends, are the call's only ones: the
    signature they are kept under is the inner call's, so a decode loop checks once."""
    from cute_flash import interface

    checks = []
    monkeypatch.setattr(interface, "_kvcache_checked", set())
    monkeypatch.setattr(interface, "_check_kvcache", lambda *args: checks.append(args[0].shape))
    for _ in range(2):
        cute_flash.flash_attn_with_kvcache(**_case([2, 3], [2, 3], [4, 9]), causal=True)
    assert checks == [(2, 3, H, D)]  # the padded queries' call, once


def test_a_cache_without_keys_gives_each_query_no_key(launch):
    """No key in the caches: the fixed-length call launches nothing (`_kvcache_skips`), so the
    packed queries are not folded either, and every row comes back 0 with LSE +inf."""
    case = _case([2, 3], None, [0, 0])
    case.update(k_cache=case["k_cache"][:, :0], v_cache=case["v_cache"][:, :0])
    out, lse = cute_flash.flash_attn_with_kvcache(**case, causal=True, return_softmax_lse=True)
    assert out.shape == case["q"].shape and lse.shape == (H, 5)
    assert (out == 0).all() and (lse == float("inf")).all()
