"""The layouts' data path on the GPU: gmem -> swizzled smem -> ldmatrix registers -> gmem must
return the input bit for bit for every shipped traits and every MMA operand."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def _traits():
    from layouts.traits import shipped_fwd_traits

    return shipped_fwd_traits(90)


@pytest.mark.parametrize("operand", ["A", "B", "Bt"])
def test_roundtrip_exact(operand):
    from tests.helpers.roundtrip import roundtrip

    for traits in _traits():
        dtype = torch.bfloat16 if traits.dtype == "bf16" else torch.float16
        rows = 4 * max(traits.block_m, traits.block_n)
        x = torch.randn(rows, traits.head_dim, device="cuda", dtype=dtype)
        y = roundtrip(x, traits, operand)
        torch.cuda.synchronize()
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), f"{traits.name} {operand}"
