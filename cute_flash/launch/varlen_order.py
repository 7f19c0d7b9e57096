"""The launch order of a packed batch's work tiles (`kernels/common/varlen_tiles.py`): every
sequence's blocks listed once, those with the most work first (longest-processing-time order),
computed on the device from the prefix sums with no host sync: by one kernel
(`kernels/common/varlen_order.py`) up to its CAPACITY entries, by torch calls (about thirty
launches) past it and on CPU tensors, the same list either way.

One CTA per (block, head) over max_seqlen's blocks of every sequence, in sequence order, left
most CTAs of a batch of mixed lengths with nothing to do and could start a long sequence's
heaviest blocks last, to run alone at the end (docs/tuning/backward.md, "Packed batches: the
launch order").
"""
from __future__ import annotations

import torch

from cute_flash.kernels.common.varlen_order import CAPACITY, PAST, VarlenOrderConfig
from cute_flash.launch import compiled, gpu


def tile_bound(total: int, batch: int, block: int) -> int:
    """Entries of the list: sum over sequences of ceil(length / block) is at most
    total // block + batch for lengths summing to `total`."""
    return total // block + batch


def builds_on_device(cu_seqlens: torch.Tensor, entries: int) -> bool:
    """The list from the launch-order kernel: CUDA prefix sums, at most its CAPACITY entries."""
    return cu_seqlens.is_cuda and entries <= CAPACITY


def _on_device(config: VarlenOrderConfig, cu_seqlens_q, cu_seqlens_k, entries: int, block_m: int, block_n: int,
               right: int) -> torch.Tensor:
    """(entries, 2) int32, the list `config` names, from one launch of the launch-order kernel."""
    tiles = torch.empty((entries, 2), dtype=torch.int32, device=cu_seqlens_q.device)
    padded = 1 << (entries - 1).bit_length()  # the sort's length: a power of two
    compiled.kernel_for(config, gpu.device_index(cu_seqlens_q.device))(cu_seqlens_q, cu_seqlens_k, tiles, block_m,
                                                                        block_n, right, padded)
    return tiles


def _lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long().clamp(min=0)


def _longest_first(lengths: torch.Tensor, total: int, block: int, work) -> torch.Tensor:
    """(entries, 2) int32 (sequence, block): each block of each sequence (`lengths` rows,
    `block` rows a block), ordered by work(sequence, block) (most first), ties in (sequence,
    block) order; entries past the batch's blocks name block PAST of sequence 0, last."""
    batch = lengths.shape[0]
    blocks = (lengths + block - 1) // block
    ends = torch.cumsum(blocks, 0)
    j = torch.arange(tile_bound(total, batch, block), device=lengths.device)
    seq = torch.searchsorted(ends, j, right=True)
    listed = seq < batch
    seq = seq.clamp(max=batch - 1)
    index = j - (ends - blocks)[seq]
    order = torch.sort(torch.where(listed, work(seq, index), -1), descending=True, stable=True).indices
    index = torch.where(listed, index, PAST)
    seq = torch.where(listed, seq, 0)
    return torch.stack([seq[order], index[order]], 1).to(torch.int32)


def key_blocks_longest_first(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_k: int, block_m: int,
                             block_n: int, right: int, descending: bool = False) -> torch.Tensor:
    """The backward's list: (sequence, key block), ordered by the query blocks that see the key
    block (the right window edge `right`, -1 for none, cuts them; the left edge is left out so
    that the count never grows with the key block, which keeps each sequence's key blocks in
    increasing order: what deterministic mode's `DqTurn` waits rely on). `descending`
    (`policy.packed_bwd_by_sequence`, under a right edge): the sequences by their first key
    block's work, most first, each one's key blocks last first, the order deterministic mode's
    `DqTurn`s then count (`Sm90BwdConfig.dq_descending`)."""
    entries = tile_bound(total_k, cu_seqlens_k.shape[0] - 1, block_n)
    if builds_on_device(cu_seqlens_k, entries):
        return _on_device(VarlenOrderConfig(True, right >= 0, descending), cu_seqlens_q, cu_seqlens_k, entries,
                          block_m, block_n, right)
    lq, lk = _lengths(cu_seqlens_q), _lengths(cu_seqlens_k)

    def work(seq, n_block):
        m_blocks = (lq[seq] + block_m - 1) // block_m
        if right < 0:
            return m_blocks
        first_row = (n_block * block_n - (lk[seq] - lq[seq]) - right).clamp(min=0)  # the first that sees the block
        return (m_blocks - first_row // block_m).clamp(min=0)

    def sequence_then_last_block_first(seq, n_block):  # a sort key: the first block's work, then the block
        return work(seq, torch.zeros_like(n_block)) * (PAST + 1) + n_block

    return _longest_first(lk, total_k, block_n, sequence_then_last_block_first if descending else work)


def query_blocks_longest_first(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, block_m: int,
                               block_n: int, right: int) -> torch.Tensor:
    """The forward's list: (sequence, query block), ordered by the key blocks the query block
    visits (cut by the right window edge `right`, -1 for none; the left edge left out)."""
    entries = tile_bound(total_q, cu_seqlens_q.shape[0] - 1, block_m)
    if builds_on_device(cu_seqlens_q, entries):
        return _on_device(VarlenOrderConfig(False, right >= 0), cu_seqlens_q, cu_seqlens_k, entries, block_m,
                          block_n, right)
    lq, lk = _lengths(cu_seqlens_q), _lengths(cu_seqlens_k)

    def work(seq, m_block):
        n_blocks = (lk[seq] + block_n - 1) // block_n
        if right < 0:
            return n_blocks
        last = ((m_block + 1) * block_m + lk[seq] - lq[seq] + right).clamp(min=0)  # past the last visible key
        return torch.minimum(n_blocks, (last + block_n - 1) // block_n)

    return _longest_first(lq, total_q, block_m, work)
