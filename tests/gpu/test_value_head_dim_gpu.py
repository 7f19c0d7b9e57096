"""A value head dim of its own on the kernels (MLA's q / k 192 with v 128, and the other way):
outputs and gradients of the dense and packed calls against the reference by the criterion of
docs/semantics.md, on the Hopper path and the SM80 one, each asserting which kernels ran and,
on the Hopper forward and backward, its V head dim (`traits.head_dim_v`); the SM80 kernels, and
the Hopper backward but for MLA's pair, pad to one head dim (tests/cpu/test_launcher.py checks
the padding on the CPU)."""
import pytest
import torch

import cute_flash
from cute_flash.reference import attention_varlen_ref
from tests.helpers.backward import assert_grads_match
from tests.helpers.caches import paged_cache
from tests.helpers.gpu_utils import (assert_matches_reference, backward_on_path, config_lookups, cu_seqlens, on_path,
                                     varlen_attention)
from layouts.traits import head_dim_bucket

pytestmark = pytest.mark.gpu


def _inputs(shape_q, shape_k, d, d_v, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(*shape_q, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(*shape_k, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(*shape_k, d_v, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(*shape_q, d_v, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, dout


@pytest.mark.parametrize("d, d_v, causal", [(192, 128, True), (192, 128, False), (64, 128, True), (128, 64, False),
                                             (176, 120, True)])
def test_dense_call_with_a_value_head_dim_of_its_own(arch_path, kernels, hopper_value_dims, hopper_bwd_value_dims, d,
                                                     d_v, causal):
    q, k, v, dout = _inputs((2, 300, 16), (2, 300, 4), d, d_v, seed=d + d_v)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = cute_flash.flash_attn_func(*leaves, causal=causal, return_attn_probs=True)
    assert out.shape == (2, 300, 16, d_v)
    assert_matches_reference(out.detach(), lse, q, k, v, causal=causal)
    out.backward(dout)
    assert_grads_match([x.grad for x in leaves], q, k, v, dout, out=out, causal=causal)
    assert kernels == on_path(arch_path, "fwd") | backward_on_path(arch_path, max(d, d_v))
    if "sm90_fwd" in kernels:
        assert hopper_value_dims == [head_dim_bucket(d_v)]  # the buckets differ in each case
    if "sm90_bwd" in kernels:  # MLA's pair of buckets at V's own width, the others padded
        mla = (head_dim_bucket(d), head_dim_bucket(d_v)) == (192, 128)
        assert hopper_bwd_value_dims == [128 if mla else None]


def test_packed_call_with_a_value_head_dim_of_its_own(arch_path, kernels, hopper_bwd_value_dims):
    lengths = [300, 1, 129, 64]
    cu, total = cu_seqlens(lengths), sum(lengths)
    q, k, v, dout = _inputs((total, 16), (total, 4), 192, 128, seed=5)
    def ref_fn(q, k, v, **opts):
        return attention_varlen_ref(q, k, v, cu, cu, **opts)

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = cute_flash.flash_attn_varlen_func(*leaves, cu, cu, max(lengths), max(lengths), causal=True,
                                                    return_attn_probs=True)
    assert_matches_reference(out.detach(), lse, q, k, v, ref_fn, causal=True)
    out.backward(dout)
    assert_grads_match([x.grad for x in leaves], q, k, v, dout, out=out, ref_fn=ref_fn, causal=True)
    assert kernels == on_path(arch_path, "fwd") | backward_on_path(arch_path, 192)
    if "sm90_bwd" in kernels:
        assert hopper_bwd_value_dims == [128]


@pytest.fixture
def hopper_bwd_value_dims(monkeypatch):
    """The V head dims (`traits.head_dim_v`) of the Hopper backwards the test's calls looked up."""
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig

    return config_lookups(monkeypatch, Sm90BwdConfig, lambda config: config.traits.head_dim_v)


@pytest.fixture
def hopper_value_dims(monkeypatch):
    """The V head dims (`traits.head_dim_v`) of the Hopper forwards the test's calls looked up."""
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig

    return config_lookups(monkeypatch, Sm90FwdConfig, lambda config: config.traits.head_dim_v)


@pytest.mark.parametrize("d, d_v, causal, seqlen", [
    (192, 128, True, 300), (192, 128, False, 1000),   # MLA's: one CTA a tile and persistent
    (64, 128, True, 700), (128, 64, False, 300), (96, 256, True, 200), (256, 64, False, 129),
    (128, 120, True, 300),                            # one bucket: the plain traits, V's columns zero-filled
])
def test_a_forward_without_gradient_takes_v_as_it_is(arch_path, kernels, hopper_value_dims, d, d_v, causal, seqlen):
    """Without a gradient too the Hopper forward runs V's head dim as it is (O d_v wide, V's
    stages and O's tile of that width), at both schedules and across buckets; the SM80 path pads
    to one head dim."""
    q, k, v, _ = _inputs((2, seqlen, 16), (2, seqlen, 4), d, d_v, seed=d * d_v + seqlen)
    with torch.no_grad():
        out, lse, _ = cute_flash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == (2, seqlen, 16, d_v)
    assert_matches_reference(out, lse, q, k, v, causal=causal)
    assert kernels == on_path(arch_path, "fwd")
    if "sm90_fwd" in kernels:
        own = None if head_dim_bucket(d_v) == head_dim_bucket(d) else head_dim_bucket(d_v)
        assert hopper_value_dims == [own]


def test_a_packed_forward_without_gradient_takes_v_as_it_is(arch_path, kernels, hopper_value_dims):
    lengths = [300, 1, 129, 64, 0, 200]
    cu, total = cu_seqlens(lengths), sum(lengths)
    q, k, v, _ = _inputs((total, 16), (total, 4), 192, 128, seed=7)

    def ref_fn(q, k, v, **opts):
        return attention_varlen_ref(q, k, v, cu, cu, **opts)

    out, lse, _ = cute_flash.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                                    return_attn_probs=True)
    assert out.shape == (total, 16, 128)
    assert_matches_reference(out, lse, q, k, v, ref_fn, causal=True)
    assert kernels == on_path(arch_path, "fwd")
    if "sm90_fwd" in kernels:
        assert hopper_value_dims == [128]


@pytest.mark.parametrize("d, d_v, page_size", [(192, 128, 64), (128, 256, 64), (64, 128, 128)])
def test_a_paged_packed_forward_takes_v_as_it_is(monkeypatch, kernels, hopper_value_dims, d, d_v, page_size):
    """Keys and values in pages (the same table, each its own head dim) on the Hopper forward,
    V's pages read at V's width (`page_source`): against the reference, and bitwise against the
    same keys packed contiguously; pages of 64 rows hold whole key blocks when the wider head
    dim is above 128."""
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
    lq, lk = [1, 100, 0, 257, 33], [300, 1, 5, 129, 600]
    torch.manual_seed(11)
    k_pages, _, table, k, _ = paged_cache(lk, page_size, 2, d, torch.bfloat16)
    torch.manual_seed(11)
    _, v_pages, same_table, _, v = paged_cache(lk, page_size, 2, d_v, torch.bfloat16)
    assert torch.equal(table, same_table)
    q = torch.randn(sum(lq), 4, d, device="cuda", dtype=torch.bfloat16)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse = varlen_attention(q, k_pages, v_pages, cu_q, cu_k, lq, lk, block_table=table, causal=True)
    flat, flat_lse = varlen_attention(q, k, v, cu_q, cu_k, lq, lk, causal=True)
    assert out.shape == (sum(lq), 4, d_v)
    assert kernels == on_path("default", "fwd")
    if "sm90_fwd" in kernels:
        assert hopper_value_dims == [head_dim_bucket(d_v)] * 2
        assert torch.equal(out, flat) and torch.equal(lse, flat_lse)
    assert_matches_reference(out, lse, q, k_pages, v_pages, ref_fn=attention_varlen_ref, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, block_table=table, causal=True)


@pytest.mark.parametrize("causal, opts, block_n, in_place", [
    (False, {}, 128, True), (False, dict(softcap=20.0, learnable_sink=True), 128, True),
    (False, dict(alibi=True), 128, False), (True, {}, 64, False)], ids=["plain", "softcap-sink", "alibi", "causal"])
def test_mla_forward_without_a_mask_takes_128_key_blocks(monkeypatch, kernels, causal, opts, block_n, in_place):
    """MLA's 192 / 128 without a mask on 128-key blocks (`policy.takes_value_dim_wide_keys`),
    O staged in Q's tile, speculative maxima P over S but with ALiBi; a causal call keeps 64-key
    blocks. 1000 keys: a partial last block of each."""
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig

    seen = config_lookups(monkeypatch, Sm90FwdConfig)
    q, k, v, _ = _inputs((2, 1000, 16), (2, 1000, 4), 192, 128, seed=block_n + len(opts))
    extra = {}
    if opts.get("alibi"):
        extra["alibi_slopes"] = torch.rand(16, device="cuda", dtype=torch.float32)
    if "softcap" in opts:
        extra["softcap"] = opts["softcap"]
    sink = torch.randn(16, device="cuda", dtype=torch.float32) if opts.get("learnable_sink") else None
    with torch.no_grad():
        out, lse, _ = cute_flash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True,
                                                 learnable_sink=sink, **extra)
    assert_matches_reference(out, lse, q, k, v, causal=causal, learnable_sink=sink, **extra)
    assert kernels == on_path("default", "fwd")
    assert len(seen) == 1
    config, = seen
    assert (config.traits.block_n, config.traits.head_dim_v, config.speculative_in_place) == (block_n, 128, in_place)
    assert config.own_o_tile == config.persistent  # O in Q's tile unless persistent (never on 128-key blocks)
    assert block_n == 64 or not config.persistent
