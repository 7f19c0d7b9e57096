"""The Hopper recipes (layouts/hopper.py) on the GPU, one tile: TMA -> GMMA-swizzled smem ->
wgmma S = Q K^T, then O = P V with P = S rounded to the input dtype in the accumulators' own
registers. Both must match torch to fp32 summation-order error for every head-dim bucket, both
warpgroup counts, both key-tile widths and both dtypes; a misplaced element is off by O(1)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

CASES = [(d, bm, bn, dtype) for d in (32, 64, 96, 128, 160, 192, 224, 256) for bm in (64, 128) for bn in (64, 128)
         for dtype in ("bf16", "fp16")]


@pytest.mark.parametrize("d, bm, bn, dtype", CASES, ids=lambda x: str(x))
def test_tile_products_match_torch(d, bm, bn, dtype):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma and TMA tiles are sm_90a")
    from tests.helpers.hopper_tile import hopper_tile
    from layouts.hopper import HopperTileTraits

    el = torch.bfloat16 if dtype == "bf16" else torch.float16
    q = torch.randn(bm, d, device="cuda", dtype=el)
    k = torch.randn(bn, d, device="cuda", dtype=el)
    v = torch.randn(bn, d, device="cuda", dtype=el)
    s, o = hopper_tile(q, k, v, HopperTileTraits(d, bm, bn, dtype))
    torch.cuda.synchronize()
    s_ref = q.float() @ k.float().T
    assert (s - s_ref).abs().max().item() <= 1e-5 * s_ref.abs().max().item() * d ** 0.5 + 1e-4
    o_ref = s.to(el).float() @ v.float()  # the kernel's own P: the same rounding of the same S
    assert (o - o_ref).abs().max().item() <= 1e-5 * o_ref.abs().max().item() * bn ** 0.5 + 1e-4
