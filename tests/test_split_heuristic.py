"""The split-count heuristic (cute_flash.kernels.split_kv.num_splits_heuristic) on cases worked by hand from
its rule: no split once the CTAs fill 80% of the slots (SMs x 2), only counts that change the
blocks per split, the smallest count within 85% of the best wave efficiency."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cute_flash.kernels.split_kv import num_splits_heuristic

SLOTS = 2 * 132


@pytest.mark.parametrize("work, n_blocks, expected, why", [
    (212, 1000, 1, "212 >= 0.8 * 264 CTAs: the grid is full without splitting"),
    (8, 8, 8, "8 blocks: counts 1, 2, 3, 4, 8 change blocks per split; efficiency 8s/264 peaks at s=8"),
    (1, 5, 5, "5 blocks: counts 1, 2, 3, 5; one CTA per split, the most splits wins"),
    (64, 100, 4, "s=4 makes 256 of 264 slots busy (0.97); s=3 gives 0.73 < 0.85 x best"),
    (8, 1, 1, "one key block: nothing to split"),
])
def test_worked_cases(work, n_blocks, expected, why):
    assert num_splits_heuristic(work, 132, n_blocks) == expected, why


@given(work=st.integers(1, 400), n_blocks=st.integers(1, 2000))
def test_choice_is_eligible_and_bounded(work, n_blocks):
    s = num_splits_heuristic(work, 132, n_blocks)
    assert 1 <= s <= min(128, n_blocks)
    if s > 1:
        assert math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1))  # no empty-split padding
        assert work < 0.8 * SLOTS
