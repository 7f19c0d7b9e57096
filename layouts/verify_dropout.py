"""Host-side check of what dropout in the kernels will rely on (`layouts/philox.py`): in every
tiled MMA that holds an attention score tile, each thread's accumulator values come in groups
of 8 that share one Philox counter, and the word each value takes is a static function of its
index in the fragment. A kernel then makes one Philox call per group and picks words without
run-time selects; and each group's first value sits the same multiple of 16 rows and columns
past the thread's first value in every thread, so a group's counter is the thread's first
counter plus compile-time steps (`Dropout.apply` reads those steps off thread 0).

The Hopper backward holds S transposed (keys on wgmma's M), so no thread holds a whole group:
`pair_exchange` checks what its kernel uses instead, that lanes t and t ^ 4 hold each of their
groups 4 values apiece, at the other half of the same words (one Philox call per 8 values
between them, keep bits swapped by one shuffle).

Groups, by accumulator shape:
- mma.sync m16n8 fragments ((2, 2), MMA_M, MMA_N), SM80 forward and backward: value (v, m, n)
  belongs to the group of (0, m, n - n % 2) and takes word 4 (v // 2) + 2 (n % 2) + v % 2;
- wgmma fragments ((2, 2, N / 8), MMA_M, MMA_N), Hopper: value ((c, r, k), m, n) belongs to the
  group of ((0, 0, k - k % 2), m, n) and takes word 4 r + 2 (k % 2) + c.
"""
from __future__ import annotations

import numpy as np

from layouts import philox
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


def pair_exchange(tiled_mma, tile_kq, partner_xor: int = 4) -> dict:
    """S^T tiles (keys, queries), wgmma fragments ((2, 2, K), 1, 1): the scheme of
    `Dropout.pair_keep_bits`, checked for every thread t. With (key0, query0) its first value
    and jpar = key0 mod 2: value ((c, r, k), 0, 0) sits at (key0 + 8 r, query0 + 8 k + c) and
    takes counter (c0, c1 + 8 (k div 2) + c), with (c0, c1) the counter of the first value,
    16-bit word 2 (k mod 2) + r of the call, half jpar. Thread t ^ partner_xor, in the same
    warp, has the same (c0, c1) and the other parity: it holds the other half of each word, so
    the two can split the calls (a thread makes those with c = jpar) and swap keep bits (inside
    a trace)."""
    coords = partition_coords(tiled_mma, "partition_C", tile_kq)[:, 0]  # (threads, values, (key, query))
    c, r, k = np.arange(coords.shape[1]) % 2, np.arange(coords.shape[1]) // 2 % 2, np.arange(coords.shape[1]) // 4

    def scheme(xy):
        key0, query0 = xy[0]
        c0, c1, _ = philox.counter_of(query0, key0)
        return int(key0 % 2), int(c0), int(c1)

    bad = 0
    for t, xy in enumerate(coords):
        jpar, c0, c1 = scheme(xy)
        placed = (np.array_equal(xy[:, 0], xy[0, 0] + 8 * r) and np.array_equal(xy[:, 1], xy[0, 1] + 8 * k + c))
        e0, e1, s = philox.counter_of(xy[:, 1], xy[:, 0])
        maps = ((e0 == c0).all() and np.array_equal(e1, c1 + 8 * (k // 2) + c)
                and np.array_equal(s // 2, 2 * (k % 2) + r) and (s % 2 == jpar).all())
        partner = t ^ partner_xor
        pjpar, pc0, pc1 = scheme(coords[partner])
        pairs = partner // 32 == t // 32 and (pc0, pc1) == (c0, c1) and pjpar == 1 - jpar
        bad += int(not (placed and maps and pairs))
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
