"""The Hopper backward's dQ adds (a part of `FlashBwdSm90`, `DQ_PATHS`): a warpgroup's dQ values
staged in shared memory and added into dQaccum by one bulk reduce-add, issued by the warpgroup or
handed to a producer warp that issues it (`Sm90BwdConfig.writes_dq_apart`; deterministic mode:
in the tile's turn, `DqTurn`), or added from registers by vector atomics."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.block_range import BlockRange, Window
from cute_flash.kernels.common.dq_accum import bulk_add_run, first_tile, stage_run, tiles_of
from cute_flash.kernels.sm90.barriers import BwdBarrier
from cute_flash.kernels.sm90.bwd_state import DqTurn, KeyTile, Sm90BwdSmem, Sm90BwdTensors
from layouts.dq import HOPPER_VEC, chunk_index


class DqAdds:
    """dQ out of a consumer warpgroup, and the writer warps."""

    def dq_chunk(self, mdQaccum: cute.Tensor, tile: KeyTile, m_block) -> cute.Tensor:
        """(bm * d,) dQaccum floats of query block m_block of this (sequence, head)."""
        if cutlass.const_expr(tile.seq.sum_s_q is None):
            return mdQaccum[0, tile.bidb, tile.bidh, m_block, None]
        return tiles_of(mdQaccum, 0, tile.bidb, tile.bidh, True)[first_tile(tile.seq, tile.bidb, self.t.block_m)
                                                                 + m_block, None]

    def dq_turn(self, args: Sm90BwdTensors, tile: KeyTile, m_block, window: Window):
        """Deterministic mode: this CTA's `DqTurn` at query block m_block, whose key blocks are
        [n_block_min, n_block_max) (`BlockRange`, exactly the blocks whose `QueryBlocks` hold
        m_block), counted from below, or from above with `dq_descending`."""
        if cutlass.const_expr(tile.seq.sum_s_q is None):
            row = args.mSemaphore[tile.bidb, tile.bidh, None]
        else:
            row = args.mSemaphore[tile.bidh, None]
        index = first_tile(tile.seq, tile.bidb, self.t.block_m) + m_block
        blocks = BlockRange.make(tile.seq, m_block, self.t.block_m, self.t.block_n, window)
        earlier = tile.n_block - blocks.n_block_min  # key blocks that add before this one
        if cutlass.const_expr(self.config.dq_descending):
            earlier = blocks.n_block_max - 1 - tile.n_block
        return DqTurn(cute.domain_offset((index,), row).iterator, earlier * self.wgs)

    @cute.jit
    def add_dq(self, acc_dq: cute.Tensor, chunk: cute.Tensor, sdQaccum: cute.Tensor, mma_tidx):
        """This warpgroup's dQ values -> its run of sdQaccum (16-byte stores, a warp's covering
        512 consecutive bytes) -> one bulk reduce-add of the run into the same run of `chunk`,
        issued by the warpgroup's first thread once the previous one has read the run."""
        run = cute.size(acc_dq) * 128  # floats
        wg_idx = cute.arch.make_warp_uniform(mma_tidx // 128)
        first = mma_tidx % 128 == 0
        if first:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=BwdBarrier.DQ + wg_idx, number_of_threads=128)
        stage_run(acc_dq, sdQaccum, chunk_index(0, mma_tidx, cute.size(acc_dq), HOPPER_VEC, 128), HOPPER_VEC, 128)
        cute.arch.barrier(barrier_id=BwdBarrier.DQ + wg_idx, number_of_threads=128)
        if first:
            bulk_add_run(chunk, sdQaccum, wg_idx * run, run)

    @cute.jit
    def add_dq_atomic(self, acc_dq: cute.Tensor, chunk: cute.Tensor, mma_tidx):
        """The "atomic" path: this thread's dQ values added into `chunk` from registers, four
        floats a `red.global.add.v4.f32` at their places in the warpgroup's run (the staged
        paths' order, so the convert reads either alike)."""
        per_thread = cute.size(acc_dq)
        for j in cutlass.range(per_thread // HOPPER_VEC, unroll_full=True):
            where = chunk.iterator + chunk_index(j * HOPPER_VEC, mma_tidx, per_thread, HOPPER_VEC, 128)
            pack = cute.make_rmem_tensor((HOPPER_VEC,), cutlass.Float32)
            for u in cutlass.range_constexpr(HOPPER_VEC):
                pack[u] = acc_dq[j * HOPPER_VEC + u]
            cute.arch.red(where, pack.load(), op="add", dtype="f32", sem="relaxed", scope="gpu")

    @cute.jit
    def hand_dq(self, acc_dq: cute.Tensor, sdQaccum: cute.Tensor, mma_tidx):
        """With writer warps: this warpgroup's dQ values into its run of sdQaccum once its writer
        warp's last bulk add has read the run (`DQ_EMPTY`), then handed to that warp (`DQ_FULL`,
        an arrive: the warpgroup waits neither for the add nor, deterministic, for its turn)."""
        wg_idx = cute.arch.make_warp_uniform(mma_tidx // 128)
        cute.arch.barrier(barrier_id=BwdBarrier.DQ_EMPTY + wg_idx, number_of_threads=128 + 32)
        stage_run(acc_dq, sdQaccum, chunk_index(0, mma_tidx, cute.size(acc_dq), HOPPER_VEC, 128), HOPPER_VEC, 128)
        cute.arch.barrier_arrive(barrier_id=BwdBarrier.DQ_FULL + wg_idx, number_of_threads=128 + 32)

    @cute.jit
    def write_dq(self, args: Sm90BwdTensors, smem: Sm90BwdSmem, tile: KeyTile, window: Window, wg_idx):
        """One warp of the producer warpgroup: consumer warpgroup wg_idx's dQ adds, query block by
        query block as the consumers visit them. The staging run starts free; each staged run
        (`hand_dq`) is added by lane 0 (deterministic: in the tile's turn, `DqTurn`) and handed
        back once the bulk add has read it (deterministic: and counted once the add is written).
        The warp stays converged around the named barriers."""
        run = self.t.block_m * self.t.head_dim // self.wgs  # floats: a warpgroup's share of the tile
        lane = cute.arch.lane_idx()
        count = tile.count()
        if count > 0:
            cute.arch.barrier_arrive(barrier_id=BwdBarrier.DQ_EMPTY + wg_idx, number_of_threads=128 + 32)
        ordered = self.config.deterministic  # each add in the tile's turn (`DqTurn`)
        for i in cutlass.range(count, unroll=1):
            m_block = tile.m_block(i)
            turn = None
            if cutlass.const_expr(ordered):
                turn = self.dq_turn(args, tile, m_block, window)
            chunk = self.dq_chunk(args.mdQaccum, tile, m_block)  # (bm * d,)
            cute.arch.barrier(barrier_id=BwdBarrier.DQ_FULL + wg_idx, number_of_threads=128 + 32)
            if lane == 0:
                if cutlass.const_expr(ordered):
                    wait_turn(turn)
                bulk_add_run(chunk, smem.sdQaccum, wg_idx * run, run)
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()
            if i + 1 < count:  # the last run is never staged over: no arrive waits for it
                cute.arch.barrier_arrive(barrier_id=BwdBarrier.DQ_EMPTY + wg_idx, number_of_threads=128 + 32)
            if cutlass.const_expr(ordered):
                if lane == 0:
                    end_turn(turn)
                cute.arch.sync_warp()


@cute.jit
def wait_turn(turn: DqTurn):
    """Spin until the tile's semaphore reaches turn.before (acquire: the earlier adds, then
    ours), then order that before this thread's bulk adds (async proxy)."""
    seen = cute.arch.load(turn.semaphore, cutlass.Int32, sem="acquire", scope="gpu")
    while seen < turn.before:
        seen = cute.arch.load(turn.semaphore, cutlass.Int32, sem="acquire", scope="gpu")
    cute.arch.fence_proxy("async.global")


@cute.jit
def end_turn(turn: DqTurn):
    """Wait until this thread's bulk adds are done (written, not just read), then count them
    with a release the next key block's acquire pairs with."""
    cute.arch.cp_async_bulk_wait_group(0)
    cute.arch.fence_proxy("async.global")
    cute.arch.atomic_add(turn.semaphore, cutlass.Int32(1), sem="release", scope="gpu")
