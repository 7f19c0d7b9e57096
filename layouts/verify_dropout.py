"""Host-side check of what dropout in the kernels will rely on (`cute_flash/philox.py`): in every
tiled MMA that holds an attention score tile, each thread's accumulator values come in groups
of 8 that share one Philox counter, and the word each value takes is a static function of its
index in the fragment. A kernel then makes one Philox call per group and picks words without
run-time selects; and each group's first value sits the same multiple of 16 rows and columns
past the thread's first value in every thread, so a group's counter is the thread's first
counter plus compile-time steps (`Dropout.apply_sm80` reads those steps off thread 0).

The Hopper backward holds S transposed (keys on wgmma's M), so no thread holds a whole group:
`lane_pairs` checks what a kernel would use instead, that lanes t and t ^ 4 hold each of their
groups 4 values apiece (one Philox call per 8 values between them, 4 words exchanged).

Groups, by accumulator shape:
- mma.sync m16n8 fragments ((2, 2), MMA_M, MMA_N), SM80 forward and backward: value (v, m, n)
  belongs to the group of (0, m, n - n % 2) and takes word 4 (v // 2) + 2 (n % 2) + v % 2;
- wgmma fragments ((2, 2, N / 8), MMA_M, MMA_N), Hopper: value ((c, r, k), m, n) belongs to the
  group of ((0, 0, k - k % 2), m, n) and takes word 4 r + 2 (k % 2) + c.
"""
from __future__ import annotations

import numpy as np

from cute_flash import philox
from layouts.verify import partition_coords


def _groups_sm80(shape):
    """(representative flat index, word) of every flat index of a ((2, 2), MMA_M, MMA_N) fragment."""
    (_, _), mm, nn = shape
    v, m, n = np.meshgrid(np.arange(4), np.arange(mm), np.arange(nn), indexing="ij")
    flat = lambda v, m, n: v + 4 * (m + mm * n)  # noqa: E731 (colexicographic)
    return flat(v, m, n).ravel(), flat(0, m, n - n % 2).ravel(), (4 * (v // 2) + 2 * (n % 2) + v % 2).ravel()


def _groups_wgmma(shape):
    """The same for a ((2, 2, N / 8), MMA_M, MMA_N) wgmma fragment."""
    (_, _, kk), mm, nn = shape
    c, r, k, m, n = np.meshgrid(np.arange(2), np.arange(2), np.arange(kk), np.arange(mm), np.arange(nn),
                                indexing="ij")
    flat = lambda c, r, k, m, n: c + 2 * (r + 2 * (k + kk * (m + mm * n)))  # noqa: E731
    return (flat(c, r, k, m, n).ravel(), flat(0, 0, k - k % 2, m, n).ravel(),
            (4 * r + 2 * (k % 2) + c).ravel())


def word_groups(tiled_mma, tile_mn, wgmma: bool) -> dict:
    """For every thread: the counter of each value equals its group representative's, the words
    of a group are 0..7 once each, and equal the Philox map's; and the representatives' steps
    from the thread's first value are thread 0's, multiples of 16 (inside a trace)."""
    import cutlass.cute as cute

    shape = _static_shape(tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_mn)).shape)
    idx, rep, word = (_groups_wgmma if wgmma else _groups_sm80)(shape)
    coords = partition_coords(tiled_mma, "partition_C", tile_mn)[:, 0]  # (threads, values, (row, col))
    reps = np.unique(rep)
    steps_0 = coords[0][reps] - coords[0][0]
    bad = 0
    for xy in coords:
        c0, c1, s = philox.counter_of(xy[:, 0], xy[:, 1])
        same_counter = (c0[idx] == c0[rep]).all() and (c1[idx] == c1[rep]).all()
        words_match = np.array_equal(s[idx], word)
        complete = all(sorted(word[rep == g]) == list(range(8)) for g in reps)
        steps = xy[reps] - xy[0]
        static_steps = np.array_equal(steps, steps_0) and not (steps % 16).any()
        bad += int(not (same_counter and words_match and complete and static_steps))
    return {"threads": len(coords), "bad_threads": bad, "ok": bad == 0}


def lane_pairs(tiled_mma, tile_kq, partner_xor: int = 4) -> dict:
    """S^T tiles (keys, queries): for every thread t, each Philox counter among its values has
    4 of its 8 values in t and the other 4 in thread t ^ partner_xor, whose words are the
    remaining ones (inside a trace)."""
    coords = partition_coords(tiled_mma, "partition_C", tile_kq)[:, 0]  # (threads, values, (key, query))
    bad = 0
    for t, mine in enumerate(coords):
        theirs = coords[t ^ partner_xor]
        c0, c1, s = philox.counter_of(mine[:, 1], mine[:, 0])
        d0, d1, ds = philox.counter_of(theirs[:, 1], theirs[:, 0])
        for a, b in set(zip(c0.tolist(), c1.tolist())):
            m, o = (c0 == a) & (c1 == b), (d0 == a) & (d1 == b)
            if not (m.sum() == 4 and o.sum() == 4 and sorted(s[m].tolist() + ds[o].tolist()) == list(range(8))):
                bad += 1
                break
    return {"threads": len(coords), "bad_threads": bad, "ok": bad == 0}


def _static_shape(shape):
    return tuple(_static_shape(x) if isinstance(x, tuple) else int(x) for x in shape)


def atom_checks(tiled_mma, tile_mn) -> dict:
    """mma.sync fragments, atom by atom (what `Dropout.atom_keeps` relies on, in any warp
    grid): values (v, m, n), v = 0..3, sit at (i + 8 (v // 2), j + v % 2) with i mod 16 < 8 and
    j even, so the 4 share one Philox counter (inside a trace)."""
    coords = partition_coords(tiled_mma, "partition_C", tile_mn)[:, 0]  # (threads, values, (row, col))
    want = np.array([[0, 0], [0, 1], [8, 0], [8, 1]])
    bad = 0
    for flat in coords:
        xy = flat.reshape(-1, 4, 2)  # (atom, v, (row, col)): v is the fastest mode
        i0, j0 = xy[:, 0, 0], xy[:, 0, 1]
        c0, c1, _ = philox.counter_of(xy[..., 0], xy[..., 1])
        ok = (((xy - xy[:, :1, :]) == want).all() and (i0 % 16 < 8).all() and (j0 % 2 == 0).all()
              and (c0 == c0[:, :1]).all() and (c1 == c1[:, :1]).all())
        bad += int(not ok)
    return {"threads": len(coords), "bad_threads": bad, "ok": bad == 0}
