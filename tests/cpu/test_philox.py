"""The dropout RNG (layouts/philox.py) on the CPU: Philox4x32 against Random123's published
known-answer vectors (7 rounds, what the mask uses, and 10), the element -> counter map (a
bijection that gives each counter the 8 elements one thread holds in a 16x16 piece of an MMA
accumulator), the kept fraction, and independence between neighbouring heads, batches and
offsets. The device version compiles to 14 wide multiplies per call (tests/compile/test_philox_compile.py)
and tests/gpu/test_philox_gpu.py checks its words against these."""
import numpy as np
import pytest

from layouts import philox

# Random123's kat_vectors for philox4x32_7 and philox4x32_10: (rounds, counter, key, output).
PI_CTR, PI_KEY = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
KAT = [(7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
       (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
       (7, PI_CTR, PI_KEY, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
       (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       (10, PI_CTR, PI_KEY, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("rounds, ctr, key, expected", KAT)
def test_philox_known_answers(rounds, ctr, key, expected):
    out = philox.philox4x32(tuple(np.uint64(c) for c in ctr), tuple(np.uint64(k) for k in key), rounds=rounds)
    assert tuple(int(x) for x in out) == expected


def test_the_mask_uses_seven_rounds():
    """The mask's stream is Philox4x32-7 (docs/semantics.md): the default rounds give
    Random123's 7-round answer."""
    out = philox.philox4x32(tuple(np.uint64(c) for c in PI_CTR), tuple(np.uint64(k) for k in PI_KEY))
    assert tuple(int(x) for x in out) == KAT[2][3]


def test_counter_map_is_a_bijection_onto_8_words_per_counter():
    i, j = np.meshgrid(np.arange(96), np.arange(80), indexing="ij")
    c0, c1, s = philox.counter_of(i, j)
    triples = np.stack([c0.ravel(), c1.ravel(), s.ravel()], axis=1)
    assert len(np.unique(triples, axis=0)) == i.size
    assert s.min() == 0 and s.max() == 7
    counters, counts = np.unique(triples[:, :2], axis=0, return_counts=True)
    assert (counts == 8).all()


def test_a_counter_covers_one_threads_accumulator_elements():
    """mma.sync m16n8 (two n8 tiles) and wgmma m64nN give a thread, in each 16x16 piece of S,
    rows r and r + 8 (r = lane / 4) and columns 2q, 2q + 1, 2q + 8, 2q + 9 (q = lane % 4): one
    counter's 8 elements."""
    for lane in range(32):
        r, q = lane // 4, lane % 4
        for bi, bj in ((0, 0), (1, 2), (5, 3)):
            rows = [16 * bi + r, 16 * bi + r + 8]
            cols = [16 * bj + 2 * q + dc for dc in (0, 1, 8, 9)]
            got = {philox.counter_of(i, j)[:2] for i in rows for j in cols}
            subs = sorted(philox.counter_of(i, j)[2] for i in rows for j in cols)
            assert len(got) == 1 and subs == list(range(8))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_within_4_sigma(p):
    mask = philox.keep_mask(seed=2024, offset=3, batch=2, heads=4, seqlen_q=500, seqlen_k=520, p=p)
    n = mask.size
    assert abs(mask.mean() - (1 - p)) <= 4 * np.sqrt(p * (1 - p) / n)


def test_threshold_quantization_and_no_dropout():
    assert philox.keep_threshold(0.0) == 2 ** 14
    for p in (0.1, 0.17, 0.5, 0.999):
        assert abs(philox.keep_threshold(p) / 2 ** 14 - (1 - p)) <= 2 ** -15
    with pytest.raises(ValueError):
        philox.keep_threshold(1.0)
    assert philox.keep_mask(1, 0, 1, 1, 40, 40, 0.0).all()


def _chi2_2x2(a, b):
    """Pearson chi-square of the 2x2 table of two bool arrays (1 degree of freedom)."""
    table = np.array([[np.sum(~a & ~b), np.sum(~a & b)], [np.sum(a & ~b), np.sum(a & b)]], dtype=np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum())


def test_neighbouring_heads_batches_and_offsets_are_independent():
    """chi-square of the keep bits of neighbours at the same (row, column) below 10.83 (p = 0.001
    for one degree of freedom); the same call twice gives the same mask."""
    m = philox.keep_mask(seed=77, offset=11, batch=2, heads=3, seqlen_q=256, seqlen_k=256, p=0.3)
    assert _chi2_2x2(m[0, 0], m[0, 1]) < 10.83
    assert _chi2_2x2(m[0, 2], m[1, 0]) < 10.83  # last head of batch 0, first of batch 1
    assert _chi2_2x2(m[0, 0], m[1, 0]) < 10.83
    other = philox.keep_mask(seed=77, offset=12, batch=2, heads=3, seqlen_q=256, seqlen_k=256, p=0.3)
    assert _chi2_2x2(m, other) < 10.83
    again = philox.keep_mask(seed=77, offset=11, batch=2, heads=3, seqlen_q=256, seqlen_k=256, p=0.3)
    assert np.array_equal(m, again)
    seed_hi = philox.keep_mask(seed=77 + (1 << 32), offset=11, batch=1, heads=1, seqlen_q=64, seqlen_k=64, p=0.3)
    assert not np.array_equal(m[0, 0, :64, :64], seed_hi[0, 0])


def test_dropout_args_pack_the_kernels_rng_words():
    """cute_flash/dropout.py: (key_lo, key_hi, offset mod 2^32, threshold) as uint32, for seeds on
    both sides of 2^63 (stored as int64), and p outside what the kernels can draw refused."""
    import torch

    from cute_flash.launch.rng import DropoutArgs

    for hi in (7, 0x8000_0001):
        words = DropoutArgs.seeded(0.1, (hi << 32) | 0xFFFFFFF0, (5 << 32) + 9, "cpu").rng_tensor("cpu")
        assert words.dtype == torch.uint32
        assert [int(x) for x in words.view(torch.int32).to(torch.int64) & philox.MASK32] == [
            0xFFFFFFF0, hi, 9, philox.keep_threshold(0.1)]
    state = torch.zeros(2, dtype=torch.int64)
    for p in (0.0, 1.0, 1 - 2 ** -18):
        with pytest.raises(ValueError):
            DropoutArgs(p, state)
    with pytest.raises(ValueError, match="rng_state"):
        DropoutArgs(0.5, state.int())


def test_drawn_states_follow_torch_manual_seed():
    """DropoutArgs.draw takes its state from torch's generator: the same after the same
    manual_seed, different from one call to the next."""
    import torch

    from cute_flash.launch.rng import DropoutArgs

    torch.manual_seed(3)
    a, b = (DropoutArgs.draw(0.2, "cpu").rng_state for _ in range(2))
    torch.manual_seed(3)
    assert torch.equal(DropoutArgs.draw(0.2, "cpu").rng_state, a) and not torch.equal(a, b)


@pytest.mark.parametrize("seed, offset", [(0, 0), (2024, 7), ((1 << 64) - 1, (1 << 32) + 3), ((1 << 63) + 5, 11)])
def test_torch_mask_matches_numpy_mask(seed, offset):
    """philox.keep_mask_of_state (torch int64, what S_dmask is built from) against the numpy
    keep_mask, element for element, odd sizes past one 16x16 counter block."""
    from cute_flash.launch.rng import DropoutArgs

    state = DropoutArgs.seeded(0.3, seed, offset, "cpu").rng_state
    got = philox.keep_mask_of_state(state, 0.3, 2, 3, 37, 70).numpy()
    assert np.array_equal(got, philox.keep_mask(seed, offset, 2, 3, 37, 70, 0.3))
