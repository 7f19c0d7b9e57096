"""The device Philox (kernels/common/philox.py) against the numpy reference (layouts/philox.py),
word for word, on a grid of coordinates past 2^16 in both directions and several head rows,
seeds and offsets: any difference in the rounds, the counter map or the 64-bit multiply shows."""
import numpy as np
import pytest
import torch

from layouts import philox

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed, offset, bh", [(0, 0, 0), (2024, 7, 5), ((1 << 64) - 1, (1 << 32) + 3, 70000)])
@pytest.mark.parametrize("rows, cols, row0, col0", [(64, 48, 0, 0), (40, 72, 70000, 131000)],
                         ids=["origin", "far"])
def test_device_words_match_reference(seed, offset, bh, rows, cols, row0, col0):
    from tests.helpers.philox_probe import philox_probe

    out = torch.full((rows, cols, 4), 0x5A5A5A5A, dtype=torch.int32, device="cuda").view(torch.uint32)
    philox_probe(out, seed, offset, bh, row0, col0)
    torch.cuda.synchronize()
    got = out.cpu().view(torch.int32).numpy().astype(np.int64) & philox.MASK32
    i = np.arange(row0, row0 + rows, dtype=np.int64)[:, None]
    j = np.arange(col0, col0 + cols, dtype=np.int64)[None, :]
    c0, c1, _ = (np.broadcast_to(x, (rows, cols)) for x in philox.counter_of(i, j))
    key = philox.split_seed(seed)
    want = philox.philox4x32((c0, c1, np.full(c0.shape, bh, np.uint64),
                              np.full(c0.shape, offset & philox.MASK32, np.uint64)), key)
    assert np.array_equal(got, np.stack([np.asarray(w, dtype=np.int64) for w in want], axis=-1))
