"""The packed backward's launch order (`launch/varlen_order.py`), on the CPU: every key block of
every sequence once, the heaviest first, each sequence's key blocks in increasing order
(deterministic mode's waits rely on it; in decreasing order where its adds run from the last
key block down), the rest past every sequence."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_flash.launch.varlen_order import PAST, key_blocks_longest_first, query_blocks_longest_first, tile_bound


def prefix(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


@settings(max_examples=200, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 700)), min_size=1, max_size=12),
       block_m=st.sampled_from([64, 128]), right=st.sampled_from([-1, 0, 37]))
def test_every_key_block_once_heaviest_first(lens, block_m, right):
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    table = key_blocks_longest_first(prefix(lq), prefix(lk), sum(lk), block_m, 128, right)
    assert table.dtype == torch.int32 and table.shape == (tile_bound(sum(lk), len(lens), 128), 2)
    listed = [(s, n) for s, n in table.tolist() if n != PAST]
    assert sorted(listed) == [(s, n) for s in range(len(lens)) for n in range(-(-lk[s] // 128))]
    assert table[len(listed):].tolist() == [[0, PAST]] * (len(table) - len(listed))  # the rest last

    def work(s, n):  # query blocks holding a row that sees key n * 128 (right edge only)
        blocks = -(-lq[s] // block_m)
        if right < 0:
            return blocks
        return max(blocks - max(n * 128 - (lk[s] - lq[s]) - right, 0) // block_m, 0)

    works = [work(s, n) for s, n in listed]
    assert works == sorted(works, reverse=True)
    for s in range(len(lens)):
        mine = [n for t, n in listed if t == s]
        assert mine == sorted(mine)


@settings(max_examples=200, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 700)), min_size=1, max_size=12),
       block_m=st.sampled_from([64, 128]), right=st.sampled_from([0, 37]))
def test_descending_lists_each_sequences_key_blocks_last_first(lens, block_m, right):
    """`descending` (deterministic with a right edge): every key block once, each sequence's in
    decreasing order, the sequences whose first key block has the most work first."""
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    table = key_blocks_longest_first(prefix(lq), prefix(lk), sum(lk), block_m, 128, right, descending=True)
    assert table.shape == (tile_bound(sum(lk), len(lens), 128), 2)
    listed = [(s, n) for s, n in table.tolist() if n != PAST]
    assert sorted(listed) == [(s, n) for s in range(len(lens)) for n in range(-(-lk[s] // 128))]
    assert table[len(listed):].tolist() == [[0, PAST]] * (len(table) - len(listed))
    for s in range(len(lens)):
        mine = [n for t, n in listed if t == s]
        assert mine == sorted(mine, reverse=True)
    first_work = [max(-(-lq[s] // block_m) - max(-(lk[s] - lq[s]) - right, 0) // block_m, 0) for s, _ in listed]
    assert first_work == sorted(first_work, reverse=True)


@settings(max_examples=200, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 700)), min_size=1, max_size=12),
       right=st.sampled_from([-1, 0, 37]))
def test_every_query_block_once_most_key_blocks_first(lens, right):
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    table = query_blocks_longest_first(prefix(lq), prefix(lk), sum(lq), 128, 128, right)
    assert table.shape == (tile_bound(sum(lq), len(lens), 128), 2)
    listed = [(s, m) for s, m in table.tolist() if m != PAST]
    assert sorted(listed) == [(s, m) for s in range(len(lens)) for m in range(-(-lq[s] // 128))]

    def work(s, m):  # key blocks holding a key some row of query block m sees (right edge only)
        blocks = -(-lk[s] // 128)
        if right < 0:
            return blocks
        return min(blocks, -(-max((m + 1) * 128 + lk[s] - lq[s] + right, 0) // 128))

    works = [work(s, m) for s, m in listed]
    assert works == sorted(works, reverse=True)
