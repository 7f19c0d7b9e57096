"""The Hopper forward (kernels/sm90/fwd.py, the default for dense forwards on sm_90) against
`cute_flash.reference` on an sm_90 GPU, through the public `flash_attn_func`, by the criterion
of docs/semantics.md with the allocator poisoned first: the SM80 forward's hypothesis shapes
and head-dim buckets (tests/helpers/forward.py), plus the score modifiers with GQA. Each test
also checks that the Hopper kernel ran: a silent fall back to the SM80 kernel would pass the
comparison."""
import pytest
import torch

from tests.helpers.forward import (check_dense_matches_reference, check_every_head_dim_bucket, dense_cases,
                                   head_dim_cases, inputs, run_forward)
from tests.helpers.gpu_utils import assert_matches_reference, captures_graph, only_the_hopper_kernel

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hopper_path(monkeypatch, kernels):
    with only_the_hopper_kernel(monkeypatch, kernels, "fwd", "forwards"):
        yield


# The SM80 forward's shape tests (tests/gpu/test_fwd_gpu.py), here under this module's fixture (Hopper path on).
@dense_cases
def test_dense_matches_reference(rng, b, sq, sk, hh, d, causal, dtype, layout):
    check_dense_matches_reference(b, sq, sk, hh, d, causal, dtype, layout)


@head_dim_cases
def test_every_head_dim_bucket(d, causal):
    check_every_head_dim_bucket(d, causal)


@pytest.mark.parametrize("opts", [dict(window_size=(64, 0)), dict(window_size=(100, 37)),
                                  dict(softcap=30.0), dict(causal=True, softcap=20.0, window_size=(200, 0))],
                         ids=["window-left", "window-both", "softcap", "causal-window-softcap"])
def test_score_modifiers_with_gqa(opts):
    q, k, v = inputs(2, 300, 513, 8, 2, 128, torch.bfloat16)
    out, lse = run_forward(q, k, v, **opts)
    assert_matches_reference(out, lse, q, k, v, **opts)


def test_alibi_with_gqa():
    q, k, v = inputs(2, 257, 400, 6, 3, 64, torch.float16)
    slopes = torch.rand(2, 6, device="cuda", dtype=torch.float32)
    out, lse = run_forward(q, k, v, causal=True, alibi_slopes=slopes)
    assert_matches_reference(out, lse, q, k, v, causal=True, alibi_slopes=slopes)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "cta-per-tile"])
@pytest.mark.parametrize("d, sk, opts", [(64, 1500, {}), (128, 700, dict(causal=True)),
                                         (128, 1100, dict(window_size=(300, 40))), (96, 600, dict(softcap=20.0))],
                         ids=["d64", "d128-causal-sq>sk", "d128-window", "d96-softcap"])
def test_both_schedules(persistent, d, sk, opts):
    """Both schedules whatever the launcher would choose, on more tiles than SMs (3 x 12 heads x 8
    query blocks), so a persistent CTA runs several tiles: its pipelines, Q's barriers and O's
    staging tile carry over from tile to tile; sq > sk leaves causal rows with no key (tiles with
    no key block)."""
    from cute_flash.launch.hopper import flash_fwd_sm90
    from tests.helpers.gpu_utils import poison_allocator

    q, k, v = inputs(3, 1000, sk, 12, 4, d, torch.bfloat16)
    poison_allocator()
    out, lse = flash_fwd_sm90(q, k, v, softmax_scale=d ** -0.5, persistent=persistent, **opts)
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, q, k, v, **opts)


@pytest.mark.parametrize("d, sq, sk, h, hk, opts", [
    (128, 1000, 1500, 12, 4, {}), (128, 256, 4096, 16, 16, dict(softcap=20.0)), (64, 1100, 2000, 8, 8, {}),
    (160, 500, 900, 4, 2, {}), (96, 700, 333, 6, 3, dict(window_size=(-1, -1))),
], ids=["d128-gqa", "d128-softcap", "d64-192-rows", "d160-64-key-blocks", "d96"])
def test_kv_multicast_matches_unicast(d, sq, sk, h, hk, opts):
    """K / V multicast (`Sm90FwdConfig.kv_multicast`: a cluster's two CTAs take one head's
    neighbouring query blocks and each loads half of every K / V block into both) computes
    what each CTA loading its own does, bit for bit, and the reference: an even number of
    query blocks with a partial last one, keys ending inside a block (TMA zero-fills the half
    boxes past the end), GQA, 192-row tiles, 64-key blocks (halves of 32 rows), on 3 batches
    so that each CTA runs several tiles. Pairs that would straddle heads, or a mask, are
    refused."""
    from cute_flash.launch.hopper import flash_fwd_sm90
    from tests.helpers.gpu_utils import poison_allocator

    q, k, v = inputs(3, sq, sk, h, hk, d, torch.bfloat16)
    poison_allocator()
    (o0, l0), (o1, l1) = (flash_fwd_sm90(q, k, v, softmax_scale=d ** -0.5, kv_multicast=m, **opts)
                          for m in (False, True))
    torch.cuda.synchronize()
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    assert_matches_reference(o1, l1, q, k, v, **opts)
    for refused in (dict(causal=True), dict(window_size=(100, 0))):
        with pytest.raises(ValueError, match="kv_multicast"):
            flash_fwd_sm90(q, k, v, softmax_scale=d ** -0.5, kv_multicast=True, **refused)
    with pytest.raises(ValueError, match="kv_multicast"):  # one query block: an odd number
        flash_fwd_sm90(q[:, :100], k, v, softmax_scale=d ** -0.5, kv_multicast=True)


@pytest.mark.parametrize("opts", [{}, dict(causal=True), dict(window_size=(100, 37), softcap=20.0)],
                         ids=["plain", "causal", "window-softcap"])
@pytest.mark.parametrize("d, hh", [(64, (8, 8)), (128, (8, 2))], ids=["d64", "d128-gqa"])
def test_packed_persistent_schedule(d, hh, opts):
    """The packed entry's persistent schedule (`flash_fwd_varlen_sm90(persistent=True)`) on more
    tiles than SMs (40 sequences of up to 1100 rows, empty ones, one row, a block and a row past
    it, 8 heads), so each CTA claims several of the list's tiles, the list's entries past every
    sequence among them: bit for bit what one CTA per tile computes (the same tiles, in another
    order), and the reference; the tile counter is left zero for the next launch."""
    import random

    from cute_flash.launch.hopper import flash_fwd_varlen_sm90, tile_counter
    from cute_flash.reference import attention_varlen_ref
    from tests.helpers.gpu_utils import cu_seqlens, poison_allocator

    gen = random.Random(d)
    lq = [gen.choice([0, 1, 128, 129]) if i % 5 == 0 else gen.randint(1, 1100) for i in range(40)]
    lk = [n if i % 3 else gen.randint(1, 900) for i, n in enumerate(lq)]
    h, hk = hh
    q = torch.randn(sum(lq), h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lk), hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    poison_allocator()
    (o0, l0), (o1, l1) = (flash_fwd_varlen_sm90(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                                                softmax_scale=d ** -0.5, persistent=p, **opts) for p in (False, True))
    torch.cuda.synchronize()
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    assert_matches_reference(o1, l1, q, k, v, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             **opts)
    assert tile_counter(q.device).tolist() == [0, 0]


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "cta-per-tile"])
@pytest.mark.parametrize("sections", [1, 5, 36, 1000])
def test_scheduling_sections(persistent, sections):
    """Every tile computed once whatever the section size: 36 (batch, head) pairs in sections of
    1, 5 (the last one short), exactly all of them, or more than there are; causal, so tiles
    differ in length. The persistent launch leaves its tile counter at zero for the next one."""
    from cute_flash.launch.hopper import flash_fwd_sm90, tile_counter
    from tests.helpers.gpu_utils import poison_allocator

    q, k, v = inputs(3, 900, 900, 12, 4, 64, torch.bfloat16)
    poison_allocator()
    out, lse = flash_fwd_sm90(q, k, v, softmax_scale=0.125, causal=True, persistent=persistent, sections=sections)
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, q, k, v, causal=True)
    assert tile_counter(q.device).tolist() == [0, 0]


@captures_graph
def test_a_captured_persistent_forward_is_one_graph_node(monkeypatch):
    """The persistent kernel captured into a CUDA graph: one kernel node. Its tile counter
    comes from the reserve zeroed before the capture (`per_stream.zeroed_counters`); without a
    reserve it is zeroed in the graph, a node more."""
    from cute_flash.launch.hopper import flash_fwd_sm90
    from tests.helpers.gpu_utils import assert_counters_zeroed_before_capture

    q, k, v = inputs(2, 1024, 1024, 8, 8, 128, torch.bfloat16)

    def call():
        return flash_fwd_sm90(q, k, v, softmax_scale=0.125, causal=True, persistent=True)

    assert_counters_zeroed_before_capture(call, monkeypatch)


@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window_size=(700, 20), softcap=10.0)],
                         ids=["plain", "causal", "window-softcap"])
def test_tall_tiles_for_long_keys(opts):
    """d 64 with 2048 keys or more takes 192-row tiles (three consumer warpgroups, persistent):
    through the public API, with a query block that runs past seqlen_q and GQA."""
    from layouts.hopper import TALL_D64_MIN_SEQLEN_K

    q, k, v = inputs(2, 500, TALL_D64_MIN_SEQLEN_K + 52, 6, 2, 64, torch.bfloat16)  # 2100 keys
    out, lse = run_forward(q, k, v, **opts)
    assert_matches_reference(out, lse, q, k, v, **opts)


@pytest.mark.parametrize("d, sq, sk, opts, persistent", [
    (64, 300, 2100, {}, True),                                       # long keys: 128-row tiles with dropout
    (128, 1000, 700, dict(causal=True), True),                       # rows with no key
    (128, 1000, 700, dict(causal=True), False),
    (96, 500, 600, dict(window_size=(300, 40), softcap=20.0), True),
    (96, 500, 600, dict(window_size=(300, 40), softcap=20.0), False),
    (256, 200, 333, dict(causal=True), False),                       # 64-key blocks: one CTA per tile only
], ids=["d64-long-keys", "d128-causal-sq>sk-persistent", "d128-causal-sq>sk-cta-per-tile",
        "d96-window-softcap-persistent", "d96-window-softcap-cta-per-tile", "d256-causal"])
def test_dropout_matches_reference_with_the_philox_mask(d, sq, sk, opts, persistent):
    """Dropout in the Hopper forward (kernels/common/philox.py, `wgmma_groups`): out against the
    reference given `philox.keep_mask` of the same seed and offset, in each schedule (the
    persistent one runs several tiles per CTA: 3 x 12 heads) and tile shape; a wrong counter,
    word, threshold or scale in any element moves the output far past the criterion."""
    import functools

    from layouts import philox
    from cute_flash.launch.rng import DropoutArgs
    from cute_flash.launch.hopper import flash_fwd_sm90
    from cute_flash.reference import attention_ref
    from tests.helpers.gpu_utils import poison_allocator

    p, seed, offset = 0.15, 0xDEAD_BEEF_0123, 77
    q, k, v = inputs(3, sq, sk, 12, 4, d, torch.bfloat16)
    poison_allocator()
    out, lse = flash_fwd_sm90(q, k, v, softmax_scale=d ** -0.5, persistent=persistent,
                              dropout=DropoutArgs.seeded(p, seed, offset, "cuda"), **opts)
    torch.cuda.synchronize()
    mask = torch.from_numpy(philox.keep_mask(seed, offset, 3, 12, sq, sk, p)).cuda()
    assert_matches_reference(out, lse, q, k, v, ref_fn=functools.partial(attention_ref, dropout_p=p,
                                                                         dropout_mask=mask), **opts)


SPECULATIVE_CASES = [(64, False, None, 0.0), (64, True, None, 0.0), (64, True, 1.0, 0.0), (64, False, None, 0.05),
                     (32, True, 0.5, 0.02), (32, False, 0.5, 0.02), (64, False, 1.0, 0.05), (128, False, None, 0.0),
                     (128, True, 0.5, 0.05), (256, True, None, 0.02), (64, (250, 0), None, 0.05)]
SPECULATIVE_IDS = ["d64", "d64-causal", "d64-causal-scale1", "d64-ramp", "d32-causal-ramp", "d32-ramp",
                   "d64-scale1-ramp", "d128", "d128-causal-scale05-ramp", "d256-causal-ramp", "d64-window-ramp"]


@pytest.mark.parametrize("d, mask, scale, ramp, in_place, rows", [
    case + (in_place, rows)
    for in_place, rows in ((False, 128), (True, 128), (True, 192))
    for case in SPECULATIVE_CASES if rows == 128 or case[0] == 64
], ids=[f"{i}-{place}" for place, rows in (("beside", 128), ("in-place", 128), ("in-place-192", 192))
        for c, i in zip(SPECULATIVE_CASES, SPECULATIVE_IDS) if rows == 128 or c[0] == 64])
def test_speculative_maxima_match_reference(d, mask, scale, ramp, in_place, rows):
    """`OnlineSoftmax.update_speculative` (forced on here), with P beside S or over it
    (`speculative_in_place`, where a failed warpgroup vote issues Q K^T again; d 64's 192-row
    tiles too; in place, blocks a causal edge crosses take `update`, a window's left edge's
    speculate), where its guess holds and where it fails: keys scaled up by a ramp toward the
    start (the kernel visits key blocks last to first, so row maxima keep rising), large
    scales, causal rows that see no key for a while (sq > sk) or few in the first block.
    Scores stay below about 1000 so that the reference's LSE is good to 1e-3 (at scale 3, LSE
    ~2500, where fp32's spacing is 2.4e-4, the kernel and the reference differed by 2.2e-3).

    Non-causal without a ramp, the first block's maxima are over 88 keys of unit-variance
    scores (about 2.4); a thread's 32 values of a later block sum to about 8 against them, and
    reaching 2^8 would take a score near 8 standard deviations: the guess holds everywhere, so
    O and LSE must equal `update`'s bit for bit."""
    from cute_flash.launch.hopper import flash_fwd_sm90
    from layouts.hopper import HopperTileTraits

    q, k, v = inputs(2, 700, 600, 8, 8, d, torch.bfloat16)
    k = k * (1.0 + ramp * torch.arange(600, 0, -1, device="cuda", dtype=torch.float32)).view(1, -1, 1, 1).to(k.dtype)
    scale = scale or d ** -0.5
    opts = dict(causal=mask) if isinstance(mask, bool) else dict(window_size=mask)  # causal, or a window
    traits = HopperTileTraits(d, rows, 128 if d <= 128 else 64, "bf16")
    outs = [flash_fwd_sm90(q, k, v, softmax_scale=scale, traits=traits, speculative_max=s,
                           speculative_in_place=s and in_place, **opts) for s in (False, True)]
    (o0, l0), (o1, l1) = outs
    if mask is False and ramp == 0.0 and scale == d ** -0.5:
        assert torch.equal(o0, o1) and torch.equal(l0, l1)
    assert_matches_reference(o1, l1, q, k, v, softmax_scale=scale, **opts)
