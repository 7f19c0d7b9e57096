"""The GPU tests' poisoning (tests/helpers/gpu_utils.py) reaches small outputs too: an unwritten element
of any output must read back NaN, whichever of the caching allocator's pools serves it."""
import pytest
import torch

from tests.helpers.gpu_utils import poison_allocator, poisons_the_cache

pytestmark = pytest.mark.gpu


@poisons_the_cache
@pytest.mark.parametrize("nbytes", [512, 4096, 100_000, 1 << 20, 3 << 20, 40 << 20])
def test_poisoned_allocations_read_nan(nbytes):
    # leave stale finite values in freed blocks of both pools, with live blocks between them
    live, stale = [], []
    for size in (512, 4096, 100_000, 1 << 20, 3 << 20, 40 << 20):
        live.append(torch.zeros(size // 4, device="cuda"))
        stale.append(torch.ones(size // 4, device="cuda"))
    del stale
    poison_allocator()
    out = torch.empty(nbytes // 4, device="cuda")
    assert out.isnan().all(), f"{(~out.isnan()).sum().item()} of {out.numel()} elements not poisoned"
    del live
