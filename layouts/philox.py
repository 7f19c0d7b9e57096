"""The random numbers of attention dropout: Philox4x32-7 and the map from an attention element
(batch, head, query row, key column) to its Philox counter. Pure arithmetic, no DSL: the host
reference (numpy, `keep_mask`) and the kernels (`kernels/common/philox.py`, DSL integers) run the same
functions with their own integer operations, so a kernel's mask can be checked element by
element against this one. `TorchOps` runs them on int64 tensors, on the device that holds a
call's drawn rng_state (`keep_mask_of_state`, which builds S_dmask without a host sync).

Philox4x32 (Salmon, Moraes, Dror, Shaw, SC 2011): a 128-bit counter and a 64-bit key give four
32-bit words through rounds of two 32x32 -> 64-bit multiplies. Its authors find 7 rounds the
fewest that pass their statistical tests (BigCrush) and default to 10 as a safety margin;
flash-attn 2 draws its dropout mask with 7, and so do we: the Hopper forward is issue-bound and
a call is most of dropout's cost there, so 7 rounds (14 wide multiplies a call, not 20) made it
and the Hopper backward faster (docs/tuning/dropout.md, Dropout, run 6). The map (docs/semantics.md,
"Dropout") depends only on the element's coordinates, the seed and the offset, never on a tile
shape or a split, so every kernel (forward, backward, SM80, Hopper) draws the same mask:

    key     = (seed mod 2^32, seed div 2^32)
    counter = (c0, c1, bh, offset mod 2^32) with
              c0 = 4 (j div 16) + (j mod 8) div 2   columns {2q, 2q+1, 2q+8, 2q+9} + 16 (j div 16)
              c1 = 8 (i div 16) + i mod 8            rows {r, r+8} + 16 (i div 16)
              bh = batch * heads + head
    element (i, j) takes 16-bit word  s = 4 ((i div 8) mod 2) + 2 ((j div 8) mod 2) + j mod 2
    of the 8 in the output (word s div 2, low half if s is even), and is kept iff that word's
    low 14 bits are below keep_threshold(p).

The 8 elements of one counter are exactly those one thread holds in a 16x16 piece of an S
accumulator, in the SM80 forward's mma.sync tiles (two adjacent n8 tiles) and in a wgmma's
m64nN layout: one Philox call per 8 elements, none wasted (layouts/verify_dropout.py; the
backward's S tile, whose warps interleave along N, uses 4 of each call's 8). 14 bits per
element (not 8 as flash-attn 2 uses) keep the kept fraction within 2^-15 of 1 - p. Why 14 and
not all 16: a 14-bit value is a finite, non-negative bfloat16 bit pattern, whose float order is
its integer order, so on sm_90 one bf16x2 compare (HSETP2 / HSET2) decides both elements of a
32-bit word (`kernels/common/philox.py:Dropout`): the decisions went from 5 instructions a word to 4 in
the Hopper forward and from about 6.5 to 3 in the Hopper backward (docs/tuning/dropout.md, Dropout, run 7).
"""
from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # key bumps (golden ratio, sqrt(3) - 1)
ROUNDS = 7  # Philox4x32-7, as flash-attn 2 (the module docstring says why not 10)
MASK32 = 0xFFFFFFFF
KEEP_BITS = 14  # of each 16-bit word, the low ones: the module docstring says why not 16
KEEP_RANGE = 1 << KEEP_BITS
KEEP_MASK = KEEP_RANGE - 1


class NumpyOps:
    """32-bit operations on uint64 numpy arrays (or Python ints) holding values below 2^32."""

    @staticmethod
    def mulhilo(a, b):
        prod = np.asarray(a, dtype=np.uint64) * np.asarray(b, dtype=np.uint64)
        return prod >> np.uint64(32), prod & np.uint64(MASK32)

    @staticmethod
    def add(a, b):
        return (np.asarray(a, dtype=np.uint64) + np.uint64(b)) & np.uint64(MASK32)

    @staticmethod
    def xor(a, b):
        return np.asarray(a, dtype=np.uint64) ^ np.asarray(b, dtype=np.uint64)

    @staticmethod
    def const(x):
        return np.uint64(x)


class TorchOps:
    """32-bit operations on torch int64 tensors holding values below 2^32. The multiply splits
    b into 16-bit halves so that no product passes 2^48 (int64 has no unsigned 64-bit product)."""

    @staticmethod
    def mulhilo(a, b):
        x = a * (b & 0xFFFF)  # < 2^48
        y = a * (b >> 16)  # < 2^48; a * b = y * 2^16 + x
        t = x + ((y & 0xFFFF) << 16)
        return (y >> 16) + (t >> 32), t & MASK32

    @staticmethod
    def add(a, b):
        return (a + b) & MASK32

    @staticmethod
    def xor(a, b):
        return a ^ b

    @staticmethod
    def const(x):
        return x


def philox4x32(ctr, key, ops=NumpyOps, rounds=ROUNDS):
    """Philox4x32 of counter (c0, c1, c2, c3) under key (k0, k1) with `rounds` rounds: four
    32-bit words. `ops` gives mulhilo(a, b) -> (hi, lo), add (mod 2^32), xor and const (a
    constant of the operations' integer type)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    m0, m1, w0, w1 = ops.const(M0), ops.const(M1), ops.const(W0), ops.const(W1)
    for r in range(rounds):
        if r:
            k0, k1 = ops.add(k0, w0), ops.add(k1, w1)
        hi0, lo0 = ops.mulhilo(m0, c0)
        hi1, lo1 = ops.mulhilo(m1, c2)
        c0, c1, c2, c3 = ops.xor(ops.xor(hi1, c1), k0), lo1, ops.xor(ops.xor(hi0, c3), k1), lo0
    return c0, c1, c2, c3


def counter_of(i, j):
    """(c0, c1, s): the first two counter words and the 16-bit word index of element (row i,
    column j); integer-generic (Python ints, numpy arrays, DSL integers)."""
    c0 = (j // 16) * 4 + (j % 8) // 2
    c1 = (i // 16) * 8 + i % 8
    s = ((i // 8) % 2) * 4 + ((j // 8) % 2) * 2 + j % 2
    return c0, c1, s


def keep_threshold(p: float) -> int:
    """An element is kept iff the low 14 bits of its 16-bit random word are below this:
    round((1 - p) * 2^14), which is 2^14 (always kept) for p = 0."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
    return int(round((1.0 - p) * KEEP_RANGE))


def split_seed(seed: int) -> tuple[int, int]:
    """The Philox key of a 64-bit seed."""
    seed &= (1 << 64) - 1
    return seed & MASK32, seed >> 32


def keep_mask(seed: int, offset: int, batch: int, heads: int, seqlen_q: int, seqlen_k: int, p: float):
    """(batch, heads, seqlen_q, seqlen_k) bool numpy array: True where dropout keeps the element."""
    k0, k1 = split_seed(seed)
    i = np.arange(seqlen_q, dtype=np.int64)[:, None]
    j = np.arange(seqlen_k, dtype=np.int64)[None, :]
    c0, c1, s = counter_of(i, j)
    c0, c1, s = np.broadcast_arrays(c0, c1, s)
    threshold = np.uint64(keep_threshold(p))
    out = np.empty((batch, heads, seqlen_q, seqlen_k), dtype=bool)
    for bh in range(batch * heads):
        words = philox4x32((c0, c1, np.full(c0.shape, bh, dtype=np.uint64),
                            np.full(c0.shape, offset & MASK32, dtype=np.uint64)), (k0, k1))
        word = np.choose(s // 2, words)
        half = (word >> (np.uint64(16) * (s % 2).astype(np.uint64))) & np.uint64(KEEP_MASK)
        out[bh // heads, bh % heads] = half < threshold
    return out


def keep_mask_of_state(rng_state, p: float, batch: int, heads: int, seqlen_q: int, seqlen_k: int):
    """`keep_mask` computed with torch on rng_state's device: rng_state (2,) int64 holds the seed
    (two's complement of the 64-bit value) and the offset, as `cute_flash/dropout.py:DropoutArgs`.
    (batch, heads, seqlen_q, seqlen_k) bool tensor."""
    import torch

    dev = rng_state.device
    seed, offset = rng_state[0].long(), rng_state[1].long()
    key = (seed & MASK32, (seed >> 32) & MASK32)  # the arithmetic shift's sign bits are masked off
    i = torch.arange(seqlen_q, device=dev).view(1, -1, 1)
    j = torch.arange(seqlen_k, device=dev).view(1, 1, -1)
    c0, c1, s = counter_of(i, j)
    bh = torch.arange(batch * heads, device=dev).view(-1, 1, 1)
    words = philox4x32((c0, c1, bh, offset & MASK32), key, TorchOps)
    shape = (batch * heads, seqlen_q, seqlen_k)
    word = torch.stack([w.expand(shape) for w in words]).gather(0, (s // 2).expand(shape).unsqueeze(0))[0]
    half = (word >> (16 * (s % 2))) & KEEP_MASK
    return (half < keep_threshold(p)).view(batch, heads, seqlen_q, seqlen_k)
