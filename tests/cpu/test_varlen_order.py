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


def test_on_the_gpu_each_list_is_one_launch_of_the_order_kernel(recorder, monkeypatch):
    """On CUDA prefix sums (the dispatch told so here) a list is one launch of the launch-order
    kernel, its config naming the list, with the list's entries and the sort's power of two;
    past the kernel's CAPACITY (and on CPU tensors) torch builds it."""
    from cute_flash.kernels.common.varlen_order import CAPACITY, VarlenOrderConfig
    from cute_flash.launch import varlen_order

    monkeypatch.setattr(varlen_order, "builds_on_device", lambda cu, entries: entries <= CAPACITY)
    cu_q, cu_k = prefix([5, 300]), prefix([200, 700])
    key_blocks_longest_first(cu_q, cu_k, 900, 64, 128, 0, descending=True)
    query_blocks_longest_first(cu_q, cu_k, 305, 128, 128, -1)
    past = key_blocks_longest_first(prefix([128 * CAPACITY]), prefix([128 * CAPACITY]), 128 * CAPACITY, 64, 128, -1)
    keys, queries = recorder.launches
    assert keys.config == VarlenOrderConfig(by_key=True, has_right=True, descending=True)
    assert keys["mCuSeqlensQ"] is cu_q and keys["mCuSeqlensK"] is cu_k
    assert keys["mTiles"].shape == (tile_bound(900, 2, 128), 2) and keys["padded"] == 16  # 9 entries
    assert (keys["block_m"], keys["block_n"], keys["right"]) == (64, 128, 0)
    assert queries.config == VarlenOrderConfig(by_key=False, has_right=False)
    assert queries["mTiles"].shape == (4, 2) and queries["padded"] == 4 and queries["right"] == -1
    assert past.shape == (CAPACITY + 1, 2) and past[0].tolist() == [0, 0]


def test_cpu_prefix_sums_take_the_torch_calls():
    """The kernel runs on CUDA prefix sums only: CPU ones (these tests) take the torch calls."""
    from cute_flash.launch.varlen_order import builds_on_device

    assert not builds_on_device(prefix([5, 300]), 4)
