"""The launch order of a packed batch's work tiles (`kernels/common/varlen_tiles.py`): every
sequence's blocks listed once, those with the most work first (longest-processing-time order),
computed on the device from the prefix sums with no host sync.

One CTA per (block, head) over max_seqlen's blocks of every sequence, in sequence order, left
most CTAs of a batch of mixed lengths with nothing to do and could start a long sequence's
heaviest blocks last, to run alone at the end (docs/tuning/backward.md, "Packed batches: the
launch order").
"""
from __future__ import annotations

import torch


def tile_bound(total: int, batch: int, block: int) -> int:
    """Entries of the list: sum over sequences of ceil(length / block) is at most
    total // block + batch for lengths summing to `total`."""
    return total // block + batch


def key_blocks_longest_first(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_k: int, block_m: int,
                             block_n: int, right: int) -> torch.Tensor:
    """(entries, 2) int32 (sequence, key block) for the backward: each key block of each sequence,
    ordered by the query blocks that see it (most first; the right window edge `right`, -1 for
    none, cuts them, the left edge is left out so that the count never grows with the key block),
    ties in (sequence, key block) order, so each sequence's key blocks stay in increasing order
    (what deterministic mode's `DqTurn` waits rely on). Entries past the batch's blocks name
    key block 2**20 of sequence 0, past any sequence's keys."""
    batch = cu_seqlens_q.shape[0] - 1
    entries = tile_bound(total_k, batch, block_n)
    lq = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long().clamp(min=0)
    lk = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long().clamp(min=0)
    blocks = (lk + block_n - 1) // block_n
    ends = torch.cumsum(blocks, 0)
    j = torch.arange(entries, device=cu_seqlens_k.device)
    seq = torch.searchsorted(ends, j, right=True)
    listed = seq < batch
    seq = seq.clamp(max=batch - 1)
    n_block = j - (ends - blocks)[seq]
    m_blocks = (lq[seq] + block_m - 1) // block_m
    work = m_blocks
    if right >= 0:  # query blocks before the one holding the first row that sees the block's first key
        first_row = (n_block * block_n - (lk[seq] - lq[seq]) - right).clamp(min=0)
        work = (m_blocks - first_row // block_m).clamp(min=0)
    work = torch.where(listed, work, -1)
    order = torch.sort(work, descending=True, stable=True).indices
    n_block = torch.where(listed, n_block, 1 << 20)
    seq = torch.where(listed, seq, 0)
    return torch.stack([seq[order], n_block[order]], 1).to(torch.int32)
