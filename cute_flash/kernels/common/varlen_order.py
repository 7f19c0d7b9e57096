"""A packed batch's launch-order list (`varlen_tiles.VarlenTiles`) built on the GPU in one
launch: the list `launch/varlen_order.py` makes with some thirty torch calls, which on a
training step of short sequences the host spent longer issuing than the GPU spent on the
attention kernels (docs/tuning/backward.md, "Packed batches: where the step's time goes").

One CTA. Each thread takes a run of sequences and counts their blocks; a scan over the
threads (within each warp by shuffles, then over the warps' totals) places each run in the
list. Each block gets one int64 sort key, most significant field first: its work plus one,
then the sequence and block in the order that ties keep, so that sorting the keys in
descending order is the host's stable sort by work (the entries past the batch's blocks get
key 0, last). A bitonic sort of the keys in shared memory (the list's length rounded up to a
power of two, at most CAPACITY), then each key decoded to (sequence, block), entries past the
batch's blocks to (0, PAST).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.common.varlen_tiles import fake_tiles
from layouts import smem as lsmem

THREADS = 1024
WARPS = THREADS // 32
CAPACITY = 16384  # keys a list may hold: 128 KB of shared memory (sm_90)
PAST = 1 << 20    # the block an entry past the batch's blocks names: past any sequence's end
FIELD = 20        # bits of a key's sequence and block fields
MASK = (1 << FIELD) - 1


@dataclass(frozen=True)
class VarlenOrderConfig:
    """The compile key of a launch-order kernel: which list it builds."""
    by_key: bool              # the backward's (key blocks, by the query blocks that see one), else the
                              # forward's (query blocks, by the key blocks they visit)
    has_right: bool = False   # a right window edge (causal) cuts the work
    descending: bool = False  # by_key: sequences by their first block's work, each one's blocks last first
                              # (the packed backward's under a right edge)

    def __post_init__(self):
        if self.descending and not self.by_key:
            raise ValueError("the descending order is the backward's list (by_key)")

    smem_bytes = 8 * CAPACITY + 4 * WARPS

    @property
    def name(self) -> str:
        return "varlen_order_" + ("key" if self.by_key else "query") + ("_r" if self.has_right else "") + (
            "_desc" if self.descending else "")


@dataclass(frozen=True)
class OrderScalars:
    """A list's run-time numbers."""
    block_m: object  # query rows a block
    block_n: object  # key rows a block
    right: object    # the right window edge (`VarlenOrderConfig.has_right`)
    padded: object   # the sort's length: the list's entries rounded up to a power of two


class VarlenOrder:
    def __init__(self, config: VarlenOrderConfig):
        self.config = config

    @cute.jit
    def __call__(self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mTiles: cute.Tensor,
                 block_m: cutlass.Int32, block_n: cutlass.Int32, right: cutlass.Int32, padded: cutlass.Int32,
                 stream):
        """mCuSeqlens* (batch + 1,) int32 prefix sums; mTiles (entries, 2) int32, written: the
        list of `launch/varlen_order.py` (entries at most CAPACITY); padded: entries rounded up
        to a power of two; right: the right window edge (`has_right`)."""
        storage = lsmem.smem_struct({"keys": (cutlass.Int64, CAPACITY, 16), "runs": (cutlass.Int32, WARPS, 16)})
        scalars = OrderScalars(block_m, block_n, right, padded)
        self.kernel(mCuSeqlensQ, mCuSeqlensK, mTiles, scalars, storage).launch(
            grid=(1, 1, 1), block=[THREADS, 1, 1], smem=storage.size_in_bytes(), stream=stream)

    @cute.jit
    def lengths(self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, seq):
        """Sequence `seq`'s query and key rows (the host's `_lengths`: none where the prefix
        sums fall)."""
        return (cutlass.max(mCuSeqlensQ[seq + 1] - mCuSeqlensQ[seq], 0),
                cutlass.max(mCuSeqlensK[seq + 1] - mCuSeqlensK[seq], 0))

    @cute.jit
    def listed_blocks(self, lq, lk, block):
        """The list's blocks of a sequence of lq query and lk key rows: its key blocks
        (`by_key`) or its query blocks, of `block` rows."""
        rows = lq
        if cutlass.const_expr(self.config.by_key):
            rows = lk
        return (rows + block - 1) // block

    @cute.jit
    def work(self, scalars: OrderScalars, lq, lk, block):
        """The host's `work(seq, block)`: the key blocks a query block visits (forward), or the
        query blocks that see a key block (backward); the right edge cuts them, the left is
        left out."""
        block_m, block_n, right = scalars.block_m, scalars.block_n, scalars.right
        work = cutlass.Int32(0)
        if cutlass.const_expr(self.config.by_key):
            work = (lq + block_m - 1) // block_m
            if cutlass.const_expr(self.config.has_right):
                first_row = cutlass.max(block * block_n - (lk - lq) - right, 0)  # the first row that sees it
                work = cutlass.max(work - first_row // block_m, 0)
        else:
            work = (lk + block_n - 1) // block_n
            if cutlass.const_expr(self.config.has_right):
                last = cutlass.max((block + 1) * block_m + lk - lq + right, 0)  # past the last visible key
                work = cutlass.min(work, (last + block_n - 1) // block_n)
        return work

    @cute.jit
    def key(self, scalars: OrderScalars, seq, block, lq, lk):
        """Block `block` of sequence `seq`'s sort key (descending order is the list's); lq, lk
        the sequence's query and key rows."""
        if cutlass.const_expr(self.config.descending):
            work = self.work(scalars, lq, lk, 0)
            return ((cutlass.Int64(work) + 1) << (2 * FIELD)) | (cutlass.Int64(block) << FIELD) | cutlass.Int64(
                MASK - seq)
        work = self.work(scalars, lq, lk, block)
        return ((cutlass.Int64(work) + 1) << (2 * FIELD)) | (cutlass.Int64(MASK - seq) << FIELD) | cutlass.Int64(
            MASK - block)

    @cute.kernel
    def kernel(self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mTiles: cute.Tensor, scalars: OrderScalars,
               storage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        lane, warp = tidx % 32, tidx // 32
        smem = cutlass.memory.SmemAllocator().allocate(storage)
        keys = smem.keys.get_tensor(cute.make_layout(CAPACITY))  # (CAPACITY,) int64
        runs = smem.runs.get_tensor(cute.make_layout(WARPS))     # (WARPS,) int32: each warp's blocks
        batch = mCuSeqlensQ.shape[0] - 1
        entries = mTiles.shape[0]
        block = scalars.block_m  # the listed blocks' rows
        if cutlass.const_expr(self.config.by_key):
            block = scalars.block_n
        padded = scalars.padded
        per = (batch + THREADS - 1) // THREADS
        first = tidx * per
        last = cutlass.min(first + per, batch)

        count = cutlass.Int32(0)  # this thread's sequences' blocks
        for seq in cutlass.range(first, last, unroll=1):
            lq, lk = self.lengths(mCuSeqlensQ, mCuSeqlensK, seq)
            count = count + self.listed_blocks(lq, lk, block)
        scan = count  # inclusive over the warp's lanes
        for s in cutlass.range_constexpr(5):
            below = cute.arch.shuffle_sync_up(scan, 1 << s)
            if lane >= (1 << s):
                scan = scan + below
        if lane == 31:
            runs[warp] = scan
        cute.arch.barrier()
        start = scan - count  # the warps before this one, then the lanes before this one
        total = cutlass.Int32(0)
        for w in cutlass.range(WARPS, unroll=1):
            if w < warp:
                start = start + runs[w]
            total = total + runs[w]

        listed = cutlass.min(total, entries)
        for i in cutlass.range(listed + tidx, padded, THREADS, unroll=1):
            keys[i] = cutlass.Int64(0)  # past the batch's blocks, and the padding
        position = start
        for seq in cutlass.range(first, last, unroll=1):
            lq, lk = self.lengths(mCuSeqlensQ, mCuSeqlensK, seq)
            for b in cutlass.range(self.listed_blocks(lq, lk, block), unroll=1):
                if position < entries:
                    keys[position] = self.key(scalars, seq, b, lq, lk)
                position = position + 1
        cute.arch.barrier()

        sort_descending(keys, padded, tidx)
        for i in cutlass.range(tidx, entries, THREADS, unroll=1):
            key = keys[i]
            seq, block_index = cutlass.Int32(0), cutlass.Int32(PAST)
            if key != 0:
                if cutlass.const_expr(self.config.descending):
                    block_index = cutlass.Int32((key >> FIELD) & MASK)
                    seq = MASK - cutlass.Int32(key & MASK)
                else:
                    seq = MASK - cutlass.Int32((key >> FIELD) & MASK)
                    block_index = MASK - cutlass.Int32(key & MASK)
            mTiles[i, 0] = seq
            mTiles[i, 1] = block_index


@cute.jit
def sort_descending(keys: cute.Tensor, padded, tidx):
    """Bitonic sort of keys[:padded] (a power of two) in shared memory, largest first, by the
    CTA's THREADS threads: runs of `size` sorted in alternating directions, merged by compares
    at halving strides, a barrier after each."""
    size = cutlass.Int32(2)
    while size <= padded:
        stride = size // 2
        while stride > 0:
            for i in cutlass.range(tidx, padded, THREADS, unroll=1):
                partner = i ^ stride
                if partner > i:
                    a, b = keys[i], keys[partner]
                    swap = a > b  # a run in ascending order
                    if (i & size) == 0:  # a run in descending order
                        swap = a < b
                    if swap:
                        keys[i] = b
                        keys[partner] = a
            cute.arch.barrier()
            stride = stride // 2
        size = size * 2


def entry(config: VarlenOrderConfig):
    """The jit function `config` compiles."""
    return VarlenOrder(config)


def fake_args(config: VarlenOrderConfig) -> list:
    """Placeholders for `VarlenOrder.__call__`, in parameter order."""
    return [fake_tensor(cutlass.Int32, 1), fake_tensor(cutlass.Int32, 1), fake_tiles(), 128, 128, -1, 256,
            fake_stream()]
