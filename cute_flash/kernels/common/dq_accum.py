"""Where the backward accumulates dQ in fp32: the layout of dQaccum and the device helpers both
backwards add into it with.

dQaccum holds one chunk of kBlockM * kHeadDim floats per (query tile, head, batch), in *warp
order*: each warp of the dQ GEMM owns a contiguous run of the chunk, and within it, with `vec`
floats per atomic add, value i of lane l sits at (i // vec) * 32 * vec + l * vec + i % vec. So
the j-th atomic add of a warp covers 32 * vec consecutive floats: whole 128-byte lines (in
(row, col) order a warp's add touches 8 rows, half of a 32-byte sector each). vec is 4 on sm_90
(`red.global.add.v4.f32`), 1 before (no vector float reductions). A warp's run being contiguous
lets sm_90 replace its atomics by one `cp.reduce.async.bulk` of the run staged in shared
memory (BwdConfig.dq_bulk). Thread order (vec 1) in place of (row, col) order was the SM80
backward's largest single gain (docs/tuning/backward.md, "The SM80 backward").

Packed batches: sequence b's tiles start at tile cu_seqlens_q[b] // kBlockM + b, which keeps
every sequence's tiles apart (a tile never holds rows of two sequences); the buffer has
total_q // kBlockM + batch + 1 tiles.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.fake import fake_tensor
from cute_flash.kernels.common.seq_info import SeqInfo
from layouts.dq import run_layout
from layouts.traits import ALIGN, COPY_BYTES


def first_tile(seq: SeqInfo, bidb, block_m: cutlass.Constexpr):
    """Index of sequence bidb's first dQaccum tile in a packed batch (0 when dense: the tile
    mode is per sequence there)."""
    if cutlass.const_expr(seq.sum_s_q is None):
        return 0
    return seq.sum_s_q // block_m + bidb


@cute.jit
def stage_run(acc_dq: cute.Tensor, sdQaccum: cute.Tensor, first, vec: cutlass.Constexpr, group: cutlass.Constexpr):
    """A thread's dQ values into their places in its group's run of the fp32 staging tile
    (`vec`-float stores from `first`, its first value's `chunk_index`), fenced so that a bulk
    copy (async proxy) may read them."""
    per_thread = cute.size(acc_dq)
    mine = cute.make_tensor(sdQaccum.iterator + first, run_layout(per_thread, vec, group))  # (vec, adds)
    cute.autovec_copy(cute.make_tensor(acc_dq.iterator, cute.make_layout((vec, per_thread // vec))), mine)
    cute.arch.fence_proxy("async.shared", space="cta")


@cute.jit
def bulk_add_run(chunk: cute.Tensor, sdQaccum: cute.Tensor, start, run: cutlass.Constexpr):
    """One thread's `cp.reduce.async.bulk` of sdQaccum[start : start + run] into the same floats
    of `chunk` (the TMA unit does the adds), committed as a bulk group."""
    src = sdQaccum.iterator + cute.assume(start, divby=run)
    dst = chunk.iterator + cute.assume(start, divby=run)
    cute.arch.inline_ptx("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [{$r0}], [{$r1}], {$r2};",
                         read_only_args=[dst.toint(), src.toint(), cutlass.Int32(run * 4)])
    cute.arch.cp_async_bulk_commit_group()


def tiles_of(mdQaccum: cute.Tensor, slot, bidb, bidh, varlen: cutlass.Constexpr):
    """(tiles, block_m * head_dim) chunks of one slice, batch (dense) and head: mdQaccum is
    (slices, batch, heads, tiles, chunk) dense, (slices, heads, tiles, chunk) packed."""
    if cutlass.const_expr(varlen):
        return mdQaccum[slot, bidh, None, None]
    return mdQaccum[slot, bidb, bidh, None, None]


def fake_dq_accum(traits, varlen: bool):
    """dQaccum's placeholder: (slices, [batch,] heads, tiles, chunk), the chunk (kBlockM *
    kHeadDim) static."""
    return fake_tensor(cutlass.Float32, 4 if varlen else 5, ALIGN, COPY_BYTES,
                       last_extent=traits.block_m * traits.head_dim)
