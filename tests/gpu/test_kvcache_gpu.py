"""`flash_attn_with_kvcache` against `cute_flash.reference.attention_kvcache_ref` on the GPU:
decode and chunked prefill, ragged cache_seqlens, cache_batch_idx permutations, leftpad, paged
caches with shuffled tables and pages of any size, GQA ratios 1..16, rotary (interleaved or not),
forced num_splits, head dims 1..256 (caches whose rows break 128-bit copies go through aligned
copies);
the caches after the append are checked element by element (appended rows against the
reference, every other element unchanged), and every num_splits agrees with num_splits=1. The
tests run the default path: on sm_90 the Hopper kernel's KV-cache entry for caches without
cache_batch_idx or cache_leftpad in one row a sequence or pages of a multiple of its key
block, the SM80 kernel for the rest (hypothesis draws both kinds); the long decode runs both
paths (`arch_path`), the Hopper entry's own tests pin it, and both kernels must ignore NaN in a
cache's unused rows."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_flash.reference import attention_kvcache_ref
from cute_flash.tools.peers import arch_path
from tests.helpers.caches import ref_with, run_case
from tests.helpers.gpu_utils import (
    assert_matches_reference,
    captures_graph,
    gpu_settings,
    on_path,
    poison_allocator,
)

pytestmark = pytest.mark.gpu

GPU_SETTINGS = gpu_settings(10)
SPLITS = [0, 1, 2, 7, 32]


@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("paged", [False, True])
@GPU_SETTINGS
@given(rng=st.random_module(), data=st.data(), b=st.integers(1, 4), ratio=st.sampled_from([1, 2, 4, 8, 16]),
       hk=st.sampled_from([1, 2]),
       d=st.one_of(st.sampled_from([64, 128, 256]), st.integers(1, 32).map(lambda x: 8 * x), st.integers(1, 256)),
       sq=st.one_of(st.just(1), st.integers(1, 128)), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       mask=st.sampled_from(["none", "causal", "window", "softcap", "alibi"]))
def test_kvcache_matches_reference(rng, data, b, ratio, hk, d, sq, dtype, mask, paged, num_splits):
    page_size = data.draw(st.sampled_from([16, 48, 64, 256, 1, 8, 24, 100])) if paged else None
    capacity = data.draw(st.sampled_from([1, 2, 8, 32, 64, 100, 160]).map(lambda n: n * (page_size or 16)))
    seqlen_new = data.draw(st.sampled_from([0, 0, 1, sq, min(sq, 5)]))
    seqlen_new = min(seqlen_new, capacity)
    if seqlen_new:
        sq = min(sq, capacity)
    seqlens = data.draw(st.lists(st.integers(0, capacity - seqlen_new), min_size=b, max_size=b))
    batch_idx = not paged and data.draw(st.booleans())
    leftpad = None
    if not paged and data.draw(st.booleans()):
        leftpad = [data.draw(st.integers(0, s)) for s in seqlens]
    rotary = None
    if d >= 2 and seqlen_new == sq and data.draw(st.booleans()):
        # Rotary reads cos/sin at the query positions too (cache_seqlens + i when causal or
        # local), which only stay inside the table when the queries are the appended tokens.
        # A rotary dim under 2 would make a table of width 0, which the interface refuses.
        dims = [r for r in (d, d // 2, min(16, d)) if r >= 2]
        rotary = (data.draw(st.sampled_from(dims)), data.draw(st.booleans()))
    opts = dict(causal=mask == "causal", alibi=mask == "alibi",
                softcap=20.0 if mask == "softcap" else 0.0,
                window=((data.draw(st.integers(0, 300)), data.draw(st.integers(0, 40))) if mask == "window"
                        else (-1, -1)))
    run_case(b, sq, hk * ratio, hk, d, dtype, capacity, seqlens, seqlen_new, num_splits, page_size,
             batch_idx, leftpad, rotary, **opts)


@pytest.mark.whole_gpu  # a sanitized process of these reached 80.8 GB (docs/tuning/gpu-suite.md, eleventh session)
@pytest.mark.parametrize("path", ["sm80", "sm90"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1, 20, 32])
def test_long_cache_decode(paged, num_splits, path, kernels):
    """32k-token caches, ragged, one query row, GQA 32/8, d 128: the decode shape (pages of
    256 rows: the Hopper entry's too). 20 splits: past the cluster merge's 8, and not a
    multiple of the global merge's unroll (8), so its loops run a remainder."""
    with arch_path(path):
        run_case(2, 1, 32, 8, 128, torch.bfloat16, 32768, [32767, 5000], 1, num_splits,
                 256 if paged else None, rotary=(128, False))
    assert kernels == on_path(path, "fwd")


@pytest.mark.parametrize("opts", [
    dict(causal=True, rotary=(64, True)), dict(window=(100, 0), rotary=(32, False)),
    dict(leftpad=[3, 0, 40], causal=True, rotary=(64, False)), dict(batch_idx=True, alibi=True),
])
def test_chunked_prefill(opts):
    run_case(3, 77, 8, 2, 64, torch.float16, 512, [100, 0, 300], 77, 0, **opts)


def _unaligned_cache(layout, shape):
    """A cache whose rows break 128-bit copies, as the caller owns it."""
    *lead, d = shape
    if layout == "rows_of_24":  # d 20 inside rows of 24: strides fine, the head dim is not
        return torch.randn(*lead, 24, device="cuda", dtype=torch.bfloat16)[..., :d]
    if layout == "misaligned":  # d 64, base address 2 bytes past a 16-byte boundary
        n = math.prod(shape)
        return torch.randn(n + 8, device="cuda", dtype=torch.bfloat16)[1:n + 1].view(shape)
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # contiguous, d 59


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("layout, d", [("rows_of_24", 20), ("contiguous", 59), ("misaligned", 64)])
def test_unaligned_cache_is_updated_in_place(layout, d, paged):
    """The launcher works on aligned copies of such caches and must still leave the append in the
    caller's cache, and nothing else changed."""
    from cute_flash import flash_attn_with_kvcache

    opts = dict(cache_seqlens=torch.tensor([5, 60], dtype=torch.int32, device="cuda"), causal=True)
    cache_shape = (2, 64, 2, d)
    if paged:
        cache_shape = (11, 16, 2, d)
        opts["block_table"] = torch.randperm(11, device="cuda")[:8].view(2, 4).int()
    k_cache, v_cache = _unaligned_cache(layout, cache_shape), _unaligned_cache(layout, cache_shape)
    q = torch.randn(2, 3, 4, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 3, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_orig, v_orig = k_cache.clone(), v_cache.clone()
    _, _, k_ref, v_ref = attention_kvcache_ref(q, k_orig, v_orig, k, v, **opts)
    poison_allocator()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, return_softmax_lse=True, **opts)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert_matches_reference(out, lse, q, k_orig, v_orig, ref_fn=ref_with(k, v), **opts)


@pytest.fixture
def hopper_cache_entry(kernels):
    """KV-cache calls take the Hopper kernel's KV-cache entry on sm_90 (the SM80 kernel
    elsewhere) whatever the environment says; afterwards, that the Hopper kernel and no other
    ran (`kernels` starts with no dispatch kept from an earlier test)."""
    with arch_path("sm90"):
        yield
    assert kernels == on_path("sm90", "fwd")


@pytest.mark.parametrize("case", [
    dict(b=3, sq=1, h=8, hk=2, d=128, seqlens=[0, 77, 300], seqlen_new=0),  # GQA fold, ragged, an empty cache
    dict(b=2, sq=1, h=32, hk=8, d=128, seqlens=[5, 298], seqlen_new=1, rotary=(128, False)),  # a decode step
    dict(b=2, sq=1, h=4, hk=4, d=64, seqlens=[1, 130], seqlen_new=1, rotary=(64, True)),  # no group to fold
    dict(b=2, sq=5, h=4, hk=2, d=64, seqlens=[10, 200], seqlen_new=5, causal=True),  # chunked prefill
    dict(b=2, sq=1, h=6, hk=3, d=256, seqlens=[130, 1], seqlen_new=0, window=(40, -1), softcap=10.0),
    dict(b=2, sq=3, h=4, hk=1, d=96, seqlens=[64, 129], seqlen_new=0, alibi=True, causal=True),
    dict(b=1, sq=1, h=2, hk=1, d=20, seqlens=[33], seqlen_new=1),  # d padded to 24, bucket 32
])
@pytest.mark.parametrize("num_splits", [1, 0, 5])
def test_hopper_cache_entry(case, num_splits, hopper_cache_entry):
    """run_case's checks on the Hopper KV-cache entry, 300-row caches: unsplit, the heuristic's
    split count, and 5 splits (merged by the last split CTA of each tile)."""
    case = dict(case)
    shape = [case.pop(k) for k in ("b", "sq", "h", "hk", "d")]
    run_case(*shape, torch.bfloat16, 300, case.pop("seqlens"), case.pop("seqlen_new"), num_splits, **case)


@pytest.mark.parametrize("case", [
    dict(b=2, sq=5, h=8, hk=2, d=128, seqlens=[10, 250], seqlen_new=5, causal=True),  # speculative verify
    dict(b=3, sq=16, h=32, hk=4, d=128, seqlens=[0, 17, 290], seqlen_new=0, causal=True),  # 128 rows: 2 blocks
    dict(b=2, sq=7, h=10, hk=2, d=64, seqlens=[293, 40], seqlen_new=7, causal=True, rotary=(64, False)),  # g 5
    dict(b=2, sq=3, h=8, hk=1, d=128, seqlens=[299, 120], seqlen_new=0, window=(50, 0), softcap=5.0),
    dict(b=2, sq=1, h=6, hk=2, d=256, seqlens=[299, 65], seqlen_new=1, window=(64, -1)),  # a window, one row
    dict(b=2, sq=4, h=16, hk=2, d=128, seqlens=[200, 299], seqlen_new=0, page_size=128, causal=True),
], ids=["verify", "two-blocks", "group-5", "local", "window-decode", "paged"])
@pytest.mark.parametrize("num_splits", [1, 0, 5])
def test_hopper_query_fold(case, num_splits, hopper_cache_entry):
    """The query fold (`Sm90FwdConfig.query_group`): several query rows (or one under a window
    edge) of a GQA group as consecutive rows of one tile, row r query r // g, with causal and
    local masks, appends with rotary, pages, splits; run_case's checks against the reference, and
    the plan folded on sm_90."""
    from cute_flash.launch import gpu, kvcache

    case = dict(case)
    shape = [case.pop(k) for k in ("b", "sq", "h", "hk", "d")]
    kvcache._calls.clear()
    run_case(*shape, torch.bfloat16, 300 if "page_size" not in case else 512, case.pop("seqlens"),
             case.pop("seqlen_new"), num_splits, **case)
    if gpu.device_arch(torch.cuda.current_device()) == 90:
        assert {call.plan.query_group for call in kvcache._calls.values()} == {shape[2] // shape[3]}


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("path", ["sm80", "sm90"])
@pytest.mark.parametrize("d", [64, 128])
def test_unused_cache_rows_hold_nan(d, path, num_splits, kernels):
    """A cache's rows past cache_seqlens hold NaN (an uninitialised cache may): no output may
    see them. The last key block read reaches into them (100 and 300 keys, 128-key blocks);
    the Hopper entry zeroes those V rows in shared memory, the SM80 kernel never loads them."""
    from cute_flash import flash_attn_with_kvcache

    seqlens = torch.tensor([100, 300], dtype=torch.int32, device="cuda")
    k_cache, v_cache = (torch.randn(2, 512, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    clean = k_cache.clone(), v_cache.clone()
    for i, n in enumerate(seqlens.tolist()):
        k_cache[i, n:], v_cache[i, n:] = float("nan"), float("nan")
        clean[0][i, n:], clean[1][i, n:] = 0.0, 0.0
    q = torch.randn(2, 1, 8, d, device="cuda", dtype=torch.bfloat16)
    poison_allocator()
    with arch_path(path):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits,
                                           return_softmax_lse=True)
    torch.cuda.synchronize()
    assert kernels == on_path(path, "fwd")
    assert_matches_reference(out, lse, q, *clean, ref_fn=ref_with(None, None), cache_seqlens=seqlens)


@pytest.mark.sanitizer_slow
@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("d, page_size", [(128, 128), (128, 256), (256, 128), (64, 512)])
def test_hopper_paged_cache(d, page_size, num_splits, hopper_cache_entry):
    """Paged caches on the Hopper KV-cache entry: shuffled pages of a multiple of its key block
    (128 keys up to d 128, 64 above: two blocks a page at d 256), ragged lengths, an empty
    cache, a decode step with rotary."""
    run_case(3, 1, 8, 2, d, torch.bfloat16, 1024, [0, 77, 1022], 1, num_splits, page_size, rotary=(64, True))


@pytest.mark.sanitizer_slow
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_two_ctas_per_sm(d, num_splits, paged, hopper_cache_entry):
    """Decode over 1k-key caches with more tiles than SMs (20 sequences x 8 kv heads, the GQA
    fold): the Hopper entry at two CTAs an SM (`policy.takes_two_ctas_per_sm`, 64 x 64 tiles),
    ragged lengths, an empty cache, a decode step with rotary, pages of 128 rows."""
    from cute_flash.launch import gpu, kvcache

    seqlens = [0, 1, 63, 64, 65, 1023, *torch.randint(1, 1024, (14,)).tolist()]
    run_case(20, 1, 32, 8, d, torch.bfloat16, 1024, seqlens, 1, num_splits, 128 if paged else None,
             rotary=(d, False))
    if gpu.device_arch(torch.cuda.current_device()) == 90:
        assert {call.plan.config.ctas_per_sm for call in kvcache._calls.values()} == {2}


@pytest.mark.parametrize("d", [64, 128])
def test_hopper_two_ctas_per_sm_split(d, hopper_cache_entry):
    """The two-CTAs-an-SM tiles split (what `tune --decode` runs for one and eight sequences):
    4 splits, merged by the last split CTA of each tile, against the reference; unused cache
    rows hold NaN."""
    from cute_flash.launch.kvcache import flash_fwd_kvcache
    from layouts.hopper import choose_hopper_cache_traits

    seqlens = torch.tensor([700, 0, 1024], dtype=torch.int32, device="cuda")
    k_cache, v_cache = (torch.randn(3, 1024, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    clean = k_cache.clone(), v_cache.clone()
    k_cache[0, 700:], v_cache[0, 700:] = float("nan"), float("nan")
    clean[0][0, 700:], clean[1][0, 700:] = 0.0, 0.0
    q = torch.randn(3, 1, 8, d, device="cuda", dtype=torch.bfloat16)
    variant = dict(traits=choose_hopper_cache_traits(d, "bf16", ctas_per_sm=2), ctas_per_sm=2)
    poison_allocator()
    out, lse = flash_fwd_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, softmax_scale=d ** -0.5,
                                 num_splits=4, hopper_variant=variant)
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, q, *clean, ref_fn=ref_with(None, None), cache_seqlens=seqlens)


@pytest.mark.parametrize("ctas", [1, 5, 13, 132, 300])
@pytest.mark.parametrize("case", [
    dict(b=3, sq=1, h=8, hk=2, d=128, seqlens=[700, 0, 1024], group=1),  # GQA fold, ragged, an empty cache
    dict(b=2, sq=1, h=32, hk=8, d=128, seqlens=[1024, 1], page_size=128, group=1),  # paged; 1 key: one share
    dict(b=2, sq=70, h=4, hk=2, d=64, seqlens=[600, 900], causal=True, group=1),  # chunked prefill: 2 blocks
    dict(b=1, sq=1, h=6, hk=3, d=256, seqlens=[1000], window=(300, -1), softcap=10.0, group=2),  # query fold
    dict(b=2, sq=6, h=16, hk=2, d=128, seqlens=[1000, 333], causal=True, group=8),  # query fold: 48 rows
], ids=["fold", "paged", "prefill", "window", "rows-fold"])
def test_hopper_stream_k(case, ctas, hopper_cache_entry):
    """Stream-K split-KV on the Hopper entry (`Sm90FwdConfig.stream_k`): `ctas` CTAs share
    every tile's key blocks, from fewer CTAs than tiles (a CTA runs several tiles in turn) to
    more CTAs than key blocks (empty shares), against the reference; unused rows of the unpaged
    caches hold NaN; a second call (the counters re-armed) gives the same bits."""
    from cute_flash.launch import gpu, kvcache
    from cute_flash.launch.kvcache import flash_fwd_kvcache

    case = dict(case)
    b, sq, h, hk, d, group = (case.pop(k) for k in ("b", "sq", "h", "hk", "d", "group"))
    seqlens = torch.tensor(case.pop("seqlens"), dtype=torch.int32, device="cuda")
    page_size = case.pop("page_size", None)
    causal, window, softcap = case.pop("causal", False), case.pop("window", (-1, -1)), case.pop("softcap", 0.0)
    capacity = 1024
    rows = b * capacity // page_size if page_size else b
    k_cache, v_cache = (torch.randn(rows, page_size or capacity, hk, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    opts = dict(cache_seqlens=seqlens, causal=causal, window_size=window, softcap=softcap)
    if page_size:
        opts["block_table"] = torch.randperm(rows, device="cuda").view(b, capacity // page_size).int()
    clean = k_cache.clone(), v_cache.clone()
    if not page_size:
        for i, n in enumerate(seqlens.tolist()):
            k_cache[i, n:], v_cache[i, n:] = float("nan"), float("nan")
            clean[0][i, n:], clean[1][i, n:] = 0.0, 0.0
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    poison_allocator()
    signature = ("stream-K test", b, sq, h, hk, d, page_size, causal, window, softcap, ctas)  # keeps the plan
    outs = [flash_fwd_kvcache(q, k_cache, v_cache, softmax_scale=d ** -0.5, hopper_variant=dict(stream_ctas=ctas),
                              signature=signature, **opts) for _ in range(2)]
    torch.cuda.synchronize()
    if gpu.device_arch(torch.cuda.current_device()) == 90:
        plan = kvcache._calls[signature, "sm90"].plan
        assert plan.config.stream_k and plan.query_group == group
    assert_matches_reference(*outs[0], q, *clean, ref_fn=ref_with(None, None), **opts)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@captures_graph
def test_a_captured_split_call_is_one_graph_node(hopper_cache_entry, monkeypatch):
    """b1 / 8k decode (16 splits, merged through global memory) captured into a CUDA graph: one
    kernel node. Its arrival counters come from the reserve zeroed before the capture
    (`per_stream.zeroed_counters`); without a reserve they are zeroed in the graph, a node more."""
    from cute_flash import flash_attn_with_kvcache
    from tests.helpers.gpu_utils import assert_counters_zeroed_before_capture

    k_cache, v_cache = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((1,), 8192, dtype=torch.int32, device="cuda")
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)

    def call():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)

    assert_counters_zeroed_before_capture(call, monkeypatch)


@pytest.mark.parametrize("graph", [False, pytest.param(True, marks=captures_graph)], ids=["eager", "graph"])
@pytest.mark.parametrize("b, capacity, num_splits", [(1, 1024, 0), (8, 1024, 0), (40, 1024, 1), (1, 8192, 0)],
                         ids=["b1-cluster-merge", "b8-cluster-merge", "b40-two-ctas", "b1-global-merge"])
def test_calls_read_what_the_kernel_before_them_wrote(b, capacity, num_splits, graph, hopper_cache_entry):
    """Decode calls whose inputs the kernel just before them wrote: V negated in place by a
    torch kernel, then two calls, the second one's q the first one's output; three times,
    eagerly or replayed from one CUDA graph. The Hopper entry launches as a programmatic
    dependent (`Sm90FwdConfig.dependent_launch`): a read issued before its wait for the
    previous grid would see V's old sign, or q still poisoned. The heuristic's 8 and 2 splits
    merge in a cluster, 40 sequences take two CTAs an SM, 16 splits merge through global
    memory (their counters, under capture, from the zeroed reserve)."""
    from cute_flash import flash_attn_with_kvcache

    h, hk, d = 32, 8, 128
    k_cache, v_cache = (torch.randn(b, capacity, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v0 = v_cache.clone()
    seqlens = torch.full((b,), capacity, dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)

    def steps():
        calls, x = [], q
        for _ in range(3):
            v_cache.neg_()
            for _ in range(2):
                out, lse = flash_attn_with_kvcache(x, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits,
                                                   return_softmax_lse=True)
                calls.append((x, out, lse))
                x = out
        return calls

    poison_allocator()
    if graph:
        steps()  # compiles and workspaces outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            calls = steps()
        for _, out, lse in calls:
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
        v_cache.copy_(v0)
        g.replay()
    else:
        calls = steps()
    torch.cuda.synchronize()
    for i, (x, out, lse) in enumerate(calls):
        v_then = -v0 if (i // 2) % 2 == 0 else v0
        assert_matches_reference(out, lse, x, k_cache, v_then, ref_fn=ref_with(None, None), cache_seqlens=seqlens)


def test_resident_clusters_agree_with_the_dsl_query():
    """`launch.clusters` (an empty PTX kernel, an SM's share of shared memory) against the DSL's
    own query (`cutlass.utils.HardwareInfo`, a compiled empty kernel at the most shared memory a
    CTA can take: one CTA an SM), for clusters of 1-8; at two CTAs an SM, clusters of one CTA
    fill every SM twice."""
    from cutlass.utils import HardwareInfo

    from cute_flash.launch.clusters import resident_clusters

    index = torch.cuda.current_device()
    torch.empty(1, device="cuda")  # the DSL's query needs a current CUDA context and makes none (alone it had none)
    hw = HardwareInfo(index)
    one = resident_clusters(index, 1, 8)
    assert one == tuple(hw.get_max_active_clusters(s) for s in range(1, 9))
    two = resident_clusters(index, 2, 8)
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    assert one[0] == sms and two[0] == 2 * sms
    assert all(a <= b for a, b in zip(one, two))
