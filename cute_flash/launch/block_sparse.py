"""A FlexAttention `BlockMask` as the kernels' block-sparse lists (`kernels/common/block_sparse.py`)
at the kernel's own tile sizes.

A BlockMask classes each (query block, key block) pair at its block sizes as empty (skipped),
partial (the mask is evaluated) or full (every score kept). At other tile sizes a tile is
empty when every BlockMask block it overlaps is, full when every one is, partial otherwise: a
conversion that may turn full or empty into partial (where the mask_mod then runs), never the
reverse, so the output is the mask's either way. All on the device, no synchronisation; kept
on the BlockMask per tile size, since a model reuses one mask in every layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockLists:
    """What this package reads of a FlexAttention BlockMask (its names), as the custom ops carry
    it through a compiled graph: the lists as tensors, the block sizes and lengths as ints."""
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor | None
    full_kv_indices: torch.Tensor | None
    BLOCK_SIZE: tuple
    seq_lengths: tuple

    @staticmethod
    def of_op(tensors: list, sizes: list) -> "BlockLists | None":
        """From an op's block_mask (the two or four lists) and block_mask_sizes (BLOCK_SIZE, then
        seq_lengths) arguments; None when they are empty."""
        if not tensors:
            return None
        full = tensors[2:] or [None, None]
        return BlockLists(tensors[0], tensors[1], *full, tuple(sizes[:2]), tuple(sizes[2:]))


def op_arguments(block_mask) -> tuple:
    """A BlockMask as the custom ops' (block_mask, block_mask_sizes) arguments (`BlockLists.of_op`)."""
    if block_mask is None:
        return [], []
    tensors = [block_mask.kv_num_blocks, block_mask.kv_indices]
    if block_mask.full_kv_num_blocks is not None:
        tensors += [block_mask.full_kv_num_blocks, block_mask.full_kv_indices]
    return tensors, [*block_mask.BLOCK_SIZE, *block_mask.seq_lengths]


def block_lists(block_mask, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_m: int,
                block_n: int, by_key: bool = False) -> list:
    """[partial_cnt, partial_idx, full_cnt, full_idx] int32 at (block_m, block_n) tiles, per
    query block (the forward's), or per key block (`by_key`: the backward's); batch and heads
    extents are the mask's (the call's or 1). The forward's key block that the sequence's end
    cuts is never full (`_cut_by_the_end`); its lists go from the last key block down, the
    order the dense forward walks, the backward's query blocks up."""
    check_block_mask(block_mask, batch, heads, seqlen_q, seqlen_k)
    memo = block_mask.__dict__.setdefault("_cute_flash_lists", {})
    key = (block_m, block_n, by_key)
    if key not in memo:
        status = _status(block_mask)
        status = _retile(status, block_mask.BLOCK_SIZE, (block_m, block_n), seqlen_q, seqlen_k)
        if by_key:
            memo[key] = _lists(status.transpose(-1, -2), descending=False)
        else:
            memo[key] = _lists(_cut_by_the_end(status, seqlen_k, block_n), descending=True)
    return memo[key]


def check_block_mask(block_mask, batch: int, heads: int, seqlen_q: int, seqlen_k: int):
    """The mask's lengths and (B, H) are the call's (B and H may be 1: one mask for all)."""
    lengths = tuple(block_mask.seq_lengths)
    if lengths != (seqlen_q, seqlen_k):
        raise ValueError(f"block_mask was built for (Q_LEN, KV_LEN) {lengths}, the call has ({seqlen_q}, {seqlen_k})")
    b, h = block_mask.kv_num_blocks.shape[:2]
    if b not in (1, batch) or h not in (1, heads):
        raise ValueError(f"block_mask was built for (B, H) ({b}, {h}); the call has ({batch}, {heads}) "
                         "(1 broadcasts)")


def _status(block_mask) -> torch.Tensor:
    """(B, H, m_blocks, n_blocks) int32 EMPTY / PARTIAL / FULL at the mask's block sizes (int32:
    CUDA has no byte atomics, and torch's scatter-max on int8 reads the whole aligned word around
    each byte, past the tensor's end for its last bytes: memcheck caught it)."""
    cnt, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    status = torch.zeros(idx.shape, dtype=torch.int32, device=idx.device)
    _mark(status, cnt, idx, PARTIAL)
    if block_mask.full_kv_num_blocks is not None:
        _mark(status, block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)
    return status


def _mark(status, cnt, idx, value):
    listed = torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]
    status.scatter_reduce_(-1, idx.long(), (listed * value).to(torch.int32), reduce="amax")


def _retile(status: torch.Tensor, theirs: tuple, ours: tuple, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """The status of our tiles from theirs: each axis cut at the grain both sizes are multiples
    of, each of our tiles the min (FULL only when all are) and max (EMPTY only when all are) of
    the grains inside the sequence."""
    if tuple(theirs) == tuple(ours):
        return status[..., :-(-seqlen_q // ours[0]), :-(-seqlen_k // ours[1])]
    lo = hi = status
    for axis, (their, our, length) in enumerate(zip(theirs, ours, (seqlen_q, seqlen_k))):
        grain = math.gcd(their, our)
        dim = status.dim() - 2 + axis
        grains = -(-length // grain)
        lo = lo.repeat_interleave(their // grain, dim).narrow(dim, 0, grains)
        hi = hi.repeat_interleave(their // grain, dim).narrow(dim, 0, grains)
        per_tile = our // grain
        pad = -grains % per_tile  # past the sequence: neutral for both
        lo = _fold(lo, dim, per_tile, pad, FULL, torch.amin)
        hi = _fold(hi, dim, per_tile, pad, EMPTY, torch.amax)
    return torch.where(lo == FULL, FULL, torch.where(hi == EMPTY, EMPTY, PARTIAL)).to(torch.int32)


def _fold(x, dim, per_tile, pad, fill, reduce):
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_full(shape, fill)], dim)
    shape = list(x.shape)
    shape[dim:dim + 1] = [shape[dim] // per_tile, per_tile]
    return reduce(x.reshape(shape), dim=dim + 1)


def _cut_by_the_end(status: torch.Tensor, seqlen_k: int, block_n: int) -> torch.Tensor:
    """The forward's statuses with the key block past seqlen_k's end partial where full: the
    kernels then mask a full block with neither the mask_mod nor the sequence's end, and where
    the call has no built-in mask a full block needs no mask at all
    (`SparseRow.visit`'s `edges`)."""
    if seqlen_k % block_n == 0:
        return status
    status = status.clone()
    status[..., -1] = torch.where(status[..., -1] == FULL, PARTIAL, status[..., -1])
    return status


def _lists(status: torch.Tensor, descending: bool) -> list:
    """Each row's partial and full blocks first, in increasing order or from the last down
    (`descending`), with their counts."""
    out = []
    last = status.shape[-1] - 1
    for value in (PARTIAL, FULL):
        hit = status == value
        if descending:
            order = last - torch.argsort((~hit.flip(-1)).to(torch.int8), dim=-1, stable=True)
        else:
            order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True)
        out += [hit.sum(-1, dtype=torch.int32).contiguous(), order.to(torch.int32).contiguous()]
    return out
