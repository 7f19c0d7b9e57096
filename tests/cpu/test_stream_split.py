"""Stream-K split-KV's arithmetic (`cute_flash.kernels.common.split_kv.StreamSplit`), which the Hopper
KV-cache kernel runs on Int32 and the host on ints: every key block of every tile goes to
exactly one CTA, the CTAs a tile names are the ones that have a share of it, numbered 0.. in
order, and each CTA's shares are as even as whole blocks allow."""
import math

from hypothesis import given
from hypothesis import strategies as st

from cute_flash.kernels.common.split_kv import StreamSplit


@given(tiles=st.integers(1, 80), ctas=st.integers(1, 300), data=st.data())
def test_every_key_block_has_one_cta(tiles, ctas, data):
    blocks = data.draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 300)), min_size=tiles, max_size=tiles))
    stream = StreamSplit(tiles, ctas)
    owners = {}  # (tile, block) -> (cta, split index)
    sharers = {t: [] for t in range(tiles)}
    for cta in range(ctas):
        first, end = stream.tiles_of(cta)
        assert 0 <= first < end <= tiles
        for t in range(first, end):
            sharers[t].append(cta)
            n_min, count = blocks[t]
            lo, hi = stream.share(cta, t, n_min, n_min + count)
            assert n_min <= lo <= hi <= n_min + count
            for n in range(lo, hi):
                assert (t, n) not in owners, "a key block in two shares"
                owners[(t, n)] = cta
    for t in range(tiles):
        n_min, count = blocks[t]
        assert all((t, n) in owners for n in range(n_min, n_min + count)), "a key block in no share"
        first, splits = stream.splits_of(t)
        assert sharers[t] == list(range(first, first + splits)), "the tile's CTAs are not the ones sharing it"
    assert stream.max_splits() == max(len(c) for c in sharers.values())
    assert stream.max_splits() <= math.ceil(ctas / tiles) + 1


def test_an_inverted_window_gives_no_block():
    """A window can end before it starts (n_block_min > n_block_max): every share is empty."""
    stream = StreamSplit(2, 5)
    assert all(stream.share(c, t, 7, 3)[0] == stream.share(c, t, 7, 3)[1] for t in range(2) for c in range(5))


@given(tiles=st.integers(1, 40), ctas=st.integers(1, 300), blocks=st.integers(1, 2000))
def test_equal_tiles_split_evenly(tiles, ctas, blocks):
    """Tiles of equal length: a CTA's blocks over all its shares are within one block of
    tiles x blocks / ctas for each share it has (each share's cut rounds down once at each end)."""
    stream = StreamSplit(tiles, ctas)
    ideal = tiles * blocks / ctas
    for cta in range(ctas):
        first, end = stream.tiles_of(cta)
        taken = sum(hi - lo for lo, hi in (stream.share(cta, t, 0, blocks) for t in range(first, end)))
        assert abs(taken - ideal) <= end - first


def test_sixty_four_tiles_on_an_h200():
    """The decode bench's eight sequences of 8 kv heads, 1024 key blocks each, on 132 SMs:
    every CTA takes 496 or 497 blocks (64 x 1024 / 132 = 496.48), from one or two tiles; every
    tile has three CTAs (a tile is 132 units, a CTA 64, and a tile starts 4t mod 64 <= 60 units
    into a CTA's: 2 x 64 < 132 <= 3 x 64 - 60)."""
    stream = StreamSplit(64, 132)
    taken = []
    for cta in range(132):
        first, end = stream.tiles_of(cta)
        assert end - first in (1, 2)
        taken.append(sum(hi - lo for lo, hi in (stream.share(cta, t, 0, 1024) for t in range(first, end))))
    assert sum(taken) == 64 * 1024 and set(taken) <= {496, 497}
    assert {stream.splits_of(t)[1] for t in range(64)} == {3}
