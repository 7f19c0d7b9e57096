"""traincheck's packed rows (`train_check.documents`): the documents fill the row, none is
empty, and the draw depends on the generator's seed only."""
import torch
from hypothesis import given, settings, strategies as st

from cute_flash.tools.train_check import documents


@settings(max_examples=50, deadline=None)
@given(tokens=st.integers(2, 4096), count=st.integers(1, 64), seed=st.integers(0, 2 ** 31))
def test_documents_fill_the_row(tokens, count, seed):
    count = min(count, tokens)
    cu = documents(tokens, count, torch.Generator().manual_seed(seed))
    assert cu.dtype == torch.int32 and cu.shape == (count + 1,)
    assert cu[0] == 0 and cu[-1] == tokens
    assert bool((cu[1:] > cu[:-1]).all())
    assert torch.equal(cu, documents(tokens, count, torch.Generator().manual_seed(seed)))
