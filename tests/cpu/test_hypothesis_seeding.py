"""Hypothesis manages torch's generators (tests/conftest.py): an example's torch draws are a
function of the seed hypothesis prints for it, so a failing GPU example replays exactly."""
import re

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

seen = []


@settings(max_examples=6, database=None)
@given(rng=st.random_module(), n=st.integers(1, 3))
def _draw(rng, n):
    seen.append((int(re.fullmatch(r"RandomSeeder\((\d+)\)", repr(rng)).group(1)), torch.randn(n)))


def test_each_example_draws_from_its_printed_seed():
    seen.clear()
    _draw()
    assert len({seed for seed, _ in seen}) > 1  # the seeds vary between examples
    for seed, drawn in seen:
        assert torch.equal(drawn, torch.randn(len(drawn), generator=torch.Generator().manual_seed(seed)))


def test_the_generators_state_is_restored_after_the_test():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    _draw()
    assert torch.equal(torch.random.get_rng_state(), before)
