"""MLA decode: `flash_attn_with_kvcache` with q and k_cache 576 wide (512 latent + 64 rope columns)
and v_cache = k_cache[..., :512], one KV head, on the Hopper KV-cache entry's latent tiles
(`layouts.hopper.HopperTileTraits.latent`: V read from K's stage, two warpgroups a 64-row block).
Output and LSE against the reference by the criterion of docs/semantics.md, paged and not, with
the GQA fold of one query row and the query fold of several, causal, softcap and a sink; each
test asserts the latent tiles ran. And the calls it refuses."""
import pytest
import torch

import cute_flash
from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
from cute_flash.reference import attention_kvcache_ref
from tests.helpers.caches import paged_cache
from tests.helpers.gpu_utils import assert_matches_reference, config_lookups

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                                 reason="MLA decode runs on the Hopper KV-cache kernel (sm_90) only")]
D, D_V = 576, 512


def _ref(q, k_cache, v_cache, upcast=True, **opts):
    out, lse, _, _ = attention_kvcache_ref(q, k_cache, v_cache, upcast=upcast, **opts)
    return out, lse


def _latent_cache(lens, page_size, dtype, g):
    """(k_cache, v_cache, block_table): pages of one KV head 576 wide (shuffled, as `paged_cache`
    lays them), or one contiguous row a sequence when page_size is None; v_cache the first 512
    columns of k_cache, a view."""
    if page_size is None:
        k_cache = torch.randn(len(lens), max(lens) + 37, 1, D, device="cuda", dtype=dtype, generator=g)
        table = None
    else:
        k_cache, _, table, _, _ = paged_cache(lens, page_size, 1, D, dtype, generator=torch.Generator().manual_seed(0))
    return k_cache, k_cache[..., :D_V], table


@pytest.mark.parametrize("b, sq, h, lens, page_size, dtype, opts", [
    (3, 1, 128, [1, 700, 2047], 64, torch.bfloat16, {}),
    (2, 1, 16, [129, 1000], None, torch.float16, {}),
    (2, 2, 64, [65, 1500], 128, torch.bfloat16, dict(causal=True)),
    (3, 4, 16, [300, 64, 999], None, torch.bfloat16, dict(causal=True, softcap=30.0, sink=True)),
], ids=["paged-gqa-fold", "fp16", "paged-causal-query-fold", "softcap-sink"])
def test_mla_decode_matches_reference(monkeypatch, b, sq, h, lens, page_size, dtype, opts):
    torch.manual_seed(sum(lens) + h)  # paged_cache's pages
    g = torch.Generator(device="cuda").manual_seed(sum(lens) + h)
    k_cache, v_cache, table = _latent_cache(lens, page_size, dtype, g)
    q = torch.randn(b, sq, h, D, device="cuda", dtype=dtype, generator=g)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    opts = dict(opts)
    if opts.pop("sink", False):
        opts["learnable_sink"] = torch.randn(h, device="cuda", generator=g)
    ran = config_lookups(monkeypatch, Sm90FwdConfig, lambda c: (c.traits.latent, c.split))
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                                  softmax_scale=0.1, return_softmax_lse=True, **opts)
    assert out.shape == (b, sq, h, D_V)
    assert ran == [(True, False)]
    assert_matches_reference(out, lse, q, k_cache, v_cache, ref_fn=_ref, cache_seqlens=seqlens, block_table=table,
                             softmax_scale=0.1, **opts)


def test_mla_decode_refusals(monkeypatch):
    """v_cache not a view of k_cache's first columns, a split count, appended keys, pages of 32
    rows, and the SM80 path: ValueErrors naming what is not built."""
    torch.manual_seed(1)
    g = torch.Generator(device="cuda").manual_seed(1)
    k_cache, v_cache, _ = _latent_cache([100], None, torch.bfloat16, g)
    q = torch.randn(1, 1, 16, D, device="cuda", dtype=torch.bfloat16, generator=g)
    with pytest.raises(ValueError, match=r"k_cache\[\.\.\., :512\]"):
        cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache.clone(), cache_seqlens=100)
    with pytest.raises(ValueError, match="num_splits > 1"):
        cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=50, num_splits=2)
    with pytest.raises(ValueError, match="appended keys"):
        cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_cache[:, :1], v=v_cache[:, :1],
                                           cache_seqlens=50)
    pages, _, table = _latent_cache([100], 32, torch.bfloat16, g)
    with pytest.raises(ValueError, match="multiple of 64"):
        cute_flash.flash_attn_with_kvcache(q, pages, pages[..., :D_V], cache_seqlens=100, block_table=table)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    with pytest.raises(ValueError, match="Hopper KV-cache kernel only"):
        cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=100)
