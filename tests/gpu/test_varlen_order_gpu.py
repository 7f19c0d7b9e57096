"""The launch-order kernel (kernels/common/varlen_order.py) against the torch calls it stands in
for (launch/varlen_order.py on CPU copies of the prefix sums, where the kernel never runs): the
same list, entry for entry, for the forward's and both backward orders, with and without a
right edge, on batches of empty, short and long sequences, more sequences than the kernel has
threads, and a list at its capacity; past the capacity torch builds the list on the GPU too."""
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_flash.kernels.common.varlen_order import CAPACITY, VarlenOrderConfig
from cute_flash.launch.varlen_order import key_blocks_longest_first, query_blocks_longest_first, tile_bound
from tests.helpers.gpu_utils import config_lookups, cu_seqlens, gpu_settings

pytestmark = pytest.mark.gpu


@pytest.fixture
def order_launches(monkeypatch):
    """The launch-order kernel's configs looked up by the test's calls."""
    return config_lookups(monkeypatch, VarlenOrderConfig)


def lists(lq, lk, block_m, right, which):
    """One list twice: from the kernel (CUDA prefix sums) and from torch (CPU ones)."""
    out = []
    on_gpu = cu_seqlens(lq), cu_seqlens(lk)
    for cu_q, cu_k in (on_gpu, [cu.cpu() for cu in on_gpu]):
        if which == "query":
            out.append(query_blocks_longest_first(cu_q, cu_k, sum(lq), block_m, 128, right))
        else:
            out.append(key_blocks_longest_first(cu_q, cu_k, sum(lk), block_m, 128, right,
                                                descending=which == "key-descending"))
    torch.cuda.synchronize()
    return out[0].cpu(), out[1]


@pytest.mark.parametrize("which", ["query", "key", "key-descending"])
@gpu_settings(40)
@given(lens=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000)), min_size=1, max_size=40),
       block_m=st.sampled_from([64, 128]), right=st.sampled_from([-1, 0, 37, 1000]))
def test_the_kernel_builds_the_hosts_list(which, lens, block_m, right, order_launches):
    if which == "key-descending" and right < 0:
        right = 0  # the descending order is deterministic mode's under a right edge
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    order_launches.clear()
    got, want = lists(lq, lk, block_m, right, which)
    assert torch.equal(got, want)
    assert order_launches == [VarlenOrderConfig(which != "query", right >= 0, which == "key-descending")]


@pytest.mark.parametrize("which", ["query", "key", "key-descending"])
@pytest.mark.parametrize("sequences, longest", [(3000, 700), (1500, 2400)], ids=["many-short", "near-capacity"])
def test_large_batches(which, sequences, longest, order_launches):
    """More sequences than threads (each thread a run of them), and lists of more than half the
    capacity (a sort 16384 long)."""
    gen = random.Random(sequences)
    lq = [gen.choice([0, 1, gen.randint(1, longest)]) if sequences == 3000 else gen.randint(0, longest)
          for _ in range(sequences)]
    lk = [gen.randint(0, longest) for _ in range(sequences)]
    entries = tile_bound(sum(lq) if which == "query" else sum(lk), sequences, 128)
    assert entries <= CAPACITY and (sequences == 3000 or entries > CAPACITY // 2)
    got, want = lists(lq, lk, 128, 0, which)
    assert torch.equal(got, want)
    assert len(order_launches) == 1


def test_past_the_capacity_torch_builds_the_list(order_launches):
    lengths = [128 * 20] * 900  # 18000 key blocks
    cu = cu_seqlens(lengths)
    table = key_blocks_longest_first(cu, cu, sum(lengths), 64, 128, -1)
    assert table.shape == (tile_bound(sum(lengths), 900, 128), 2) and table.shape[0] > CAPACITY
    assert order_launches == []
    assert torch.equal(table.cpu(), key_blocks_longest_first(cu.cpu(), cu.cpu(), sum(lengths), 64, 128, -1))
