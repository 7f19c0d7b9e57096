"""The packed backward's launch order (`launch/varlen_order.py`), on the CPU: every key block of
every sequence once, the heaviest first, each sequence's key blocks in increasing order
(deterministic mode's waits rely on it), the rest past every sequence."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_flash.launch.varlen_order import key_blocks_longest_first, tile_bound


def prefix(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


@settings(max_examples=200, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 700)), min_size=1, max_size=12),
       block_m=st.sampled_from([64, 128]), right=st.sampled_from([-1, 0, 37]))
def test_every_key_block_once_heaviest_first(lens, block_m, right):
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    table = key_blocks_longest_first(prefix(lq), prefix(lk), sum(lk), block_m, 128, right)
    assert table.dtype == torch.int32 and table.shape == (tile_bound(sum(lk), len(lens), 128), 2)
    listed = [(s, n) for s, n in table.tolist() if n != 1 << 20]
    assert sorted(listed) == [(s, n) for s in range(len(lens)) for n in range(-(-lk[s] // 128))]
    assert table[len(listed):].tolist() == [[0, 1 << 20]] * (len(table) - len(listed))  # the rest last

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
