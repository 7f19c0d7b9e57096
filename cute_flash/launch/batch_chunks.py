"""Calls over more sequences than one launch's grid holds. The kernels put the batch (or a
packed call's sequence count) on the grid's y or z dimension, as flash-attn 2 does, and CUDA
caps those at 65535 (x takes 2^31 - 1): a launch past the cap fails with "invalid
configuration argument" (flash-attn 2 fails there, e.g. on 80,000 packed sequences of 16
tokens). The launchers run such calls over consecutive chunks of at most `GRID_MAX_BATCH`
sequences instead: views of the caller's tensors, the same kernels, one launch each per chunk.

Dropout's mask numbers each element's (batch, head) pair from the launch's first sequence
(layouts/philox.py), so a chunked call would draw another mask than the one the reference
and the backward define: calls with dropout over more sequences are refused."""
from __future__ import annotations

GRID_MAX_BATCH = 65535  # CUDA's gridDim.y / gridDim.z limit


def chunked(batch: int) -> bool:
    """Whether a call over `batch` sequences runs in chunks."""
    return batch > GRID_MAX_BATCH


def batch_chunks(batch: int) -> list[slice]:
    """Consecutive slices of at most GRID_MAX_BATCH sequences covering range(batch)."""
    return [slice(lo, min(batch, lo + GRID_MAX_BATCH)) for lo in range(0, batch, GRID_MAX_BATCH)]


def splits_within_grid(heads: int) -> int:
    """The most splits whose splits x heads fit a grid's z (the SM80 KV-cache kernel's)."""
    return GRID_MAX_BATCH // heads


def refuse_chunked_dropout(dropout, batch: int) -> None:
    """ValueError (before any launch) for dropout over more than GRID_MAX_BATCH sequences."""
    if dropout is not None and chunked(batch):
        raise ValueError(f"dropout_p > 0 takes at most {GRID_MAX_BATCH} sequences a call (one launch numbers "
                         f"the mask's (batch, head) pairs), got {batch}: split the batch")


def rows_of(x, s: slice):
    """A per-sequence argument's chunk: a tensor's rows `s` (the tensor itself when they are all
    of it: an unchunked call makes no views), None as it is."""
    return x if x is None or (s.start == 0 and s.stop >= x.shape[0]) else x[s]


def slopes_of(alibi_slopes, s: slice):
    """A chunk's ALiBi slopes: (batch, heads) slopes' rows `s`; (heads,) slopes or None as they are."""
    return alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[s]


def lengths_of(cu_seqlens, s: slice):
    """A chunk's prefix sums: entries s.start .. s.stop of `cu_seqlens`, still offsets into the
    whole packed tensors (a view: no sync, no copy; the tensor itself when unchunked)."""
    return rows_of(cu_seqlens, slice(s.start, s.stop + 1))
