"""Host-side checks of the Hopper recipes (layouts/hopper.py), with `layouts.verify`'s numpy
models of the DSL's layouts.

What must hold for the Hopper kernels to be right, checked without a GPU:
- every smem tile (Q, K/V, one stage and staged) is a bijection onto its tile;
- every stage starts on a 1024-byte boundary of its buffer (a swizzle atom's period: TMA and
  the wgmma descriptors address swizzled tiles from such a base);
- the S accumulator of each thread, re-viewed by `acc_as_operand_a`, holds at A-operand
  position j exactly the (row, key) element that the P V wgmma expects there, for every thread
  of every warpgroup: P goes from one GEMM into the next without leaving its registers;
- the threads' accumulators cover S and O exactly once (what the softmax and the O store
  rely on);
- O's staging: the (64, d) box each warpgroup's TMA store reads, in the one-warpgroup layout
  its atom was built for, addresses exactly that warpgroup's rows of the (block_m, d) tile
  the threads wrote, from a 1024-byte aligned base (TMA swizzles by address bits).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import numpy as np

from layouts import hopper
from layouts.hopper import HopperTileTraits
from layouts.traits import ELEMENT_BYTES
from layouts.verify import HostLayout, in_arch_trace, is_bijection, partition_coords

STAGE_ALIGN = 1024


def smem_checks(traits: HopperTileTraits, stages: int = 2) -> dict:
    def run():
        out = {}
        for name, layout in (("sQ", hopper.smem_layout(traits, traits.block_m)),
                             ("sKV", hopper.smem_layout(traits, traits.block_n))):
            out[name] = is_bijection(HostLayout.of(layout).table())
        staged = hopper.smem_layout_staged(traits, traits.block_n, stages)
        stage_bytes = ELEMENT_BYTES * cute.cosize(cute.slice_(staged, (None, None, 0)))
        out["stage_bytes"] = stage_bytes
        out["stages_aligned"] = stage_bytes % STAGE_ALIGN == 0
        host = HostLayout.of(staged)
        offsets = host(np.arange(host.size))
        out["staged_bijection"] = bool(np.array_equal(np.sort(offsets), np.arange(offsets.size)))
        return out

    return in_arch_trace("sm_90a", run)


def p_operand_checks(traits: HopperTileTraits) -> dict:
    """For each thread: C coordinate of S at the accumulator index `acc_as_operand_a` puts at
    A position j == the A coordinate of the P V wgmma at j."""
    def run():
        qk, pv = hopper.tiled_mma_qk(traits), hopper.tiled_mma_pv(traits)
        tile = (traits.block_m, traits.block_n)
        acc = cute.make_rmem_tensor(qk.get_slice(0).partition_shape_C(tile), cutlass.Float32)
        view = HostLayout.of(hopper.acc_as_operand_a(acc).layout)
        where = view(np.arange(view.size))
        c = partition_coords(qk, "partition_C", tile)[:, 0]  # (threads, values, (row, col))
        a = partition_coords(pv, "partition_A", tile)[:, 0]
        bad = sum(int(a_xy.shape[0] != view.size or not np.array_equal(c_xy[where], a_xy))
                  for c_xy, a_xy in zip(c, a))
        return {"threads": traits.num_threads, "values": view.size, "mismatched_threads": bad, "ok": bad == 0}

    return in_arch_trace("sm_90a", run)


def accumulator_coverage(traits: HopperTileTraits) -> dict:
    """The C partitions of all threads hold every element of S (block_m, block_n) and of O
    (block_m, head_dim) exactly once: the warpgroups split the rows, nothing overlaps."""
    def run():
        out = {}
        for name, mma, tile in (("S", hopper.tiled_mma_qk(traits), (traits.block_m, traits.block_n)),
                                ("O", hopper.tiled_mma_pv(traits), (traits.block_m, traits.head_dim))):
            counts = np.zeros(tile, dtype=np.int64)
            xy = partition_coords(mma, "partition_C", tile).reshape(-1, 2)  # every thread's (row, col)
            np.add.at(counts, (xy[:, 0], xy[:, 1]), 1)
            out[name] = bool((counts == 1).all())
        return out

    return in_arch_trace("sm_90a", run)


def o_staging_checks(traits: HopperTileTraits) -> dict:
    """TMA moves a tile in boxes one swizzle atom wide (128 bytes of a row at most). For each
    warpgroup w and atom column j: the offset of (64 w + r, j * cols + c) in the (block_m, d)
    tile == the offset of (r, c) in a (64, cols) box of the same atom, plus one base per box,
    and that base is a multiple of 1024 bytes."""
    def run():
        rows = hopper.WGMMA_M
        cols = cute.size(hopper.swizzle_atom(traits).shape[1])
        tile = HostLayout.of(hopper.smem_layout(traits, traits.block_m))
        box = HostLayout.of(cute.tile_to_shape(hopper.swizzle_atom(traits), (rows, cols), order=(0, 1)))
        r, c = (x.ravel() for x in np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij"))
        box_offsets = box(r + rows * c)
        bases, same = [], True
        for w in range(traits.warpgroups):
            for j in range(traits.head_dim // cols):
                delta = tile(rows * w + r + traits.block_m * (j * cols + c)) - box_offsets
                same = same and bool((delta == delta[0]).all())
                bases.append(int(delta[0]))
        aligned = all(b * ELEMENT_BYTES % STAGE_ALIGN == 0 for b in bases)
        return {"box_cols": cols, "bases": bases, "boxes_match_rows": same, "bases_aligned": aligned,
                "ok": same and aligned}

    return in_arch_trace("sm_90a", run)


def verify_hopper(traits: HopperTileTraits) -> dict:
    smem = smem_checks(traits)
    p = p_operand_checks(traits)
    cover = accumulator_coverage(traits)
    o_staging = o_staging_checks(traits)
    ok = (smem["sQ"] and smem["sKV"] and smem["staged_bijection"] and smem["stages_aligned"] and p["ok"]
          and all(cover.values()) and o_staging["ok"])
    return {"smem": smem, "p_operand": p, "acc_coverage": cover, "o_staging": o_staging, "ok": ok}


def report(traits: HopperTileTraits, stages: int = 2) -> dict:
    """The row of `python -m layouts report` for a Hopper traits (sm_90 only)."""
    from layouts.traits import SMEM_LIMIT

    checks = verify_hopper(traits)
    smem_bytes = traits.smem_bytes(stages)
    fits = smem_bytes <= SMEM_LIMIT[90]
    return {"name": f"{traits.name}_s{stages}", "smem_bytes": smem_bytes, "fits": fits, **checks,
            "ok": fits and checks["ok"]}
