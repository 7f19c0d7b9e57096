"""The split-count heuristic (cute_flash.launch.policy.num_splits_heuristic) on cases worked by hand from
its rule: no split once the CTAs fill 80% of the slots (SMs x 2); otherwise, among counts whose CTAs
fit the slots at once (two waves where none but 1 does and SMs would idle unsplit) and that change
the blocks per split, the smallest with the least busiest-SM time, k (ceil(n / s) + 0.5 [s > 1]) /
(0.95 if k == 1 and two CTAs share an SM else 1) with k = ceil(work * s / SMs); at one CTA an SM,
12 splits instead (the fewest at ceil(n / 12) blocks a split: 10-12) where the winner's CTAs fill
less than 80% of the SM slots over its waves, the keys make at least 48 blocks and those splits are
not slower by that time. Where s splits merge in one thread-block cluster, k counts the clusters
the GPU holds at once instead (k = ceil(work * ctas_per_sm / clusters[s - 1]))."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cute_flash.launch.policy import num_splits_heuristic, split_choice
from tests.helpers.clusters import H200_CLUSTERS

SLOTS = 2 * 132


@pytest.mark.parametrize("work, n_blocks, expected, why", [
    (212, 1000, 1, "212 >= 0.8 * 264 CTAs: the grid is full without splitting"),
    (150, 100, 1, "two splits would need 300 CTAs, more than the 264 slots"),
    (8, 8, 8, "one block per split, one CTA per SM: 1.5 / 0.95 = 1.58 against s=4's 2.5 / 0.95 = 2.63"),
    (1, 5, 5, "5 blocks: counts 1, 2, 3, 5; one CTA per split, the most splits wins"),
    (64, 100, 4, "s=4: 256 CTAs, 2 x 25.5 = 51; s=2: 50.5 / 0.95 = 53.2; s=3: 192 CTAs, 2 x 34.5 = 69"),
    (8, 64, 16, "s=16: 128 CTAs, 4.5 / 0.95 = 4.74; s=32: 256 CTAs, 2 x 2.5 = 5 (flash-attn's rule took 32)"),
    (8, 1024, 32, "s=32: 2 x 32.5 = 65 against s=16's 64.5 / 0.95 = 67.9; s=33 keeps 32 blocks a split, "
                  "s=34 needs two waves"),
    (8, 1, 1, "one key block: nothing to split"),
])
def test_worked_cases(work, n_blocks, expected, why):
    assert num_splits_heuristic(work, 132, n_blocks) == expected, why


@pytest.mark.parametrize("work, n_blocks, expected, why", [
    (106, 1000, 1, "106 >= 0.8 * 132 CTAs: one CTA per SM fills the grid without splitting"),
    (64, 256, 2, "132 slots hold 2 splits of 64 CTAs: 128.5 / 0.95 against 256 / 0.95"),
    (8, 1024, 16, "16 x 8 = 128 CTAs, one wave: the most splits, 64.5 / 0.95 (s=32 would need 256)"),
    (8, 8, 8, "one block per split: 1.5 / 0.95 against s=4's 2.5 / 0.95"),
    (72, 1024, 3, "no split fits 132 slots; two waves: s=3, 216 CTAs (82% of 264), 2 x 342.5 = 685"),
    (88, 1024, 3, "s=3: 264 CTAs, two an SM, 2 x 342.5 = 685"),
    (68, 1024, 12, ("s=3's 204 CTAs fill 77% of two waves; s=12: 816 CTAs, 7 x 86.5 = 605.5 against "
                    "685")),
    (104, 1024, 12, "unsplit fills 79% of the SMs, 1024; s=12: 1248 CTAs, 10 x 86.5 = 865"),
    (104, 64, 11, ("8k keys: 12 splits of 6 blocks would leave the last empty; 11: 1144 CTAs, 9 x 6.5 = 58.5 "
                   "against 64 unsplit")),
    (104, 40, 1, "40 key blocks, under 4 a split at 12 splits: unsplit stays at 79%"),
    (48, 1024, 12, "s=2's 96 CTAs fill 73%, 512.5; s=12: 576 CTAs, 5 x 86.5 = 432.5"),
    (48, 64, 11, "11 splits of 6 blocks: 528 CTAs, 4 x 6.5 = 26 against s=2's 32.5"),
    (60, 1024, 2, "s=2 fills 91% of one wave"),
    (48, 11, 2, "11 key blocks: s=2 stays at 73%"),
])
def test_worked_cases_one_cta_per_sm(work, n_blocks, expected, why):
    """The Hopper KV-cache entry's CTAs fill an SM's shared memory (ctas_per_sm=1): 132 slots."""
    assert num_splits_heuristic(work, 132, n_blocks, ctas_per_sm=1) == expected, why



@pytest.mark.parametrize("work, n_blocks, expected, why", [
    (88, 1024, 12, ("s=3: 88 clusters of 3, 39 at once: k = 3, 3 x 342.5 = 1027.5, 67% of three waves; "
                    "s=12 (merged in global memory, no cluster): 1056 CTAs, 8 x 86.5 = 692")),
    (16, 1024, 6, ("s=8: 16 clusters of 8, 15 at once: 2 x 128.5 = 257; s=7 too (15); s=6: 16 of 17, "
                   "171.5; s=12: 2 x 86.5 = 173")),
    (16, 8, 4, "8 blocks: s=8 takes two waves of clusters, 2 x 1.5 = 3; s=4: 16 clusters of 30, 2.5"),
    (24, 256, 4, "s=5: 24 clusters of 5, 22 at once: 2 x 52 = 104; s=4: 24 of 30, 64.5"),
    (72, 1024, 3, "72 clusters of 3 still take the two waves counted without clusters: 2 x 342.5"),
    (64, 256, 2, "64 clusters of 2, 66 at once: one wave, as without clusters"),
])
def test_worked_cases_counting_clusters(work, n_blocks, expected, why):
    """Splits of 2-8 merged in one cluster each (the Hopper entry): the busiest SM runs
    ceil(work / clusters[s - 1]) of them at one CTA an SM."""
    assert num_splits_heuristic(work, 132, n_blocks, ctas_per_sm=1, clusters=H200_CLUSTERS[1]) == expected, why


@given(work=st.integers(1, 400), n_blocks=st.integers(1, 2000))
def test_choice_is_eligible_and_bounded(work, n_blocks):
    s = num_splits_heuristic(work, 132, n_blocks)
    assert 1 <= s <= min(128, n_blocks)
    if s > 1:
        assert math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1))  # no empty-split padding
        assert work < 0.8 * SLOTS and work * s <= SLOTS  # one wave


@given(work=st.integers(1, 200), n_blocks=st.integers(1, 2000))
def test_one_cta_per_sm_takes_more_waves_only_where_sms_would_idle(work, n_blocks):
    s = num_splits_heuristic(work, 132, n_blocks, ctas_per_sm=1)
    assert 1 <= s <= min(128, n_blocks)
    if s > 1:
        assert math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1))
        assert work < 0.8 * 132
    waves = 2 if 66 < work < 132 else 1
    if 1 < s > waves * 132 // work:  # more waves: 10-12 splits where their rival leaves SMs idle
        assert s in (10, 11, 12) and n_blocks >= 48 and math.ceil(n_blocks / s) == math.ceil(n_blocks / 12)
        rival = num_splits_heuristic(work, 132, n_blocks, max_splits=waves * 132 // work, ctas_per_sm=1)
        assert work * rival < 0.8 * 132 * math.ceil(work * rival / 132)


@given(work=st.integers(1, 200), n_blocks=st.integers(1, 2000), ctas_per_sm=st.sampled_from([1, 2]))
def test_stream_k_replaces_exactly_the_many_wave_splits(work, n_blocks, ctas_per_sm):
    """`split_choice` asks for stream-K where, and only where, the equal splits would be the
    many-wave count (more waves than the one- or two-wave candidates allow, at one CTA an SM);
    its count is the one a kernel without stream-K takes."""
    choice = split_choice(work, 132, n_blocks, ctas_per_sm=ctas_per_sm)
    assert choice.num_splits == num_splits_heuristic(work, 132, n_blocks, ctas_per_sm=ctas_per_sm)
    slots = ctas_per_sm * 132
    waves = 2 if slots / 2 < work < 132 else 1
    many_waves = choice.num_splits > max(1, waves * slots // work)
    assert choice.stream_k == many_waves
    assert not (choice.stream_k and ctas_per_sm == 2)


def test_no_cluster_query_while_a_graph_is_captured(monkeypatch):
    """`launch.clusters.resident_clusters` loads and unloads a module, which invalidates a CUDA
    graph capture: while the stream captures it answers None (the count then assumes every SM)
    without asking the driver or remembering the answer, and asks once the capture is over."""
    import torch

    from cute_flash.launch import clusters

    asked = []
    monkeypatch.setattr(clusters, "_known", {})
    monkeypatch.setattr(clusters, "_query", lambda *key: asked.append(key) or H200_CLUSTERS[key[1]][:key[2]])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert clusters.resident_clusters(0, 1, 8) is None and asked == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert clusters.resident_clusters(0, 1, 8) == H200_CLUSTERS[1] and asked == [(0, 1, 8)]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert clusters.resident_clusters(0, 1, 8) == H200_CLUSTERS[1] and len(asked) == 1
