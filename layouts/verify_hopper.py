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
  the threads wrote, from a 1024-byte aligned base (TMA swizzles by address bits);
- packed batches' O copy (`hopper.o_copy_coord`): a warpgroup's threads copy every 16-byte
  chunk of its 64 rows exactly once;
- latent tiles (MLA decode): K's first dv columns, stage by stage, are a (block_n, dv) V tile;
- O staged in Q's tile where V's head dim is narrower (`hopper.o_fits_q_tile`): each (row,
  col) of O's tile lies at Q's (row, col).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import numpy as np

from layouts import dq as dq_order
from layouts import hopper
from layouts.hopper import HopperTileTraits
from layouts.traits import ELEMENT_BYTES, BwdTraits
from layouts.verify import HostLayout, in_arch_trace, is_bijection, partition_coords

STAGE_ALIGN = 1024


def smem_checks(traits: HopperTileTraits, stages: int = 2) -> dict:
    def run():
        out = {}
        for name, layout in (("sQ", hopper.smem_layout(traits, traits.block_m)),
                             ("sKV", hopper.smem_layout(traits, traits.block_n)),
                             ("sV", hopper.smem_layout(traits, traits.block_n, traits.dv)),
                             ("sO", hopper.smem_layout(traits, traits.block_m, traits.dv))):
            out[name] = is_bijection(HostLayout.of(layout).table())
        aligned, bijective = True, True
        for cols in dict.fromkeys((traits.head_dim, traits.dv)):  # K's stages, then V's where dv != d
            staged = hopper.smem_layout_staged(traits, traits.block_n, stages, cols)
            stage_bytes = ELEMENT_BYTES * cute.cosize(cute.slice_(staged, (None, None, 0)))
            out.setdefault("stage_bytes", stage_bytes)
            aligned = aligned and stage_bytes % STAGE_ALIGN == 0
            host = HostLayout.of(staged)
            offsets = host(np.arange(host.size))
            bijective = bijective and bool(np.array_equal(np.sort(offsets), np.arange(offsets.size)))
        out["stages_aligned"], out["staged_bijection"] = aligned, bijective
        if traits.latent:
            out["sV_in_sK"] = latent_v_checks(traits, stages)
        if traits.head_dim_v is not None and hopper.o_fits_q_tile(traits):
            out["sO_in_sQ"] = o_in_q_checks(traits)
        return out

    return in_arch_trace("sm_90a", run)


def latent_v_checks(traits: HopperTileTraits, stages: int) -> bool:
    """(Inside a trace) latent tiles read V as K's first dv columns (kernels/sm90/fwd.py: a
    `local_tile` of sK): element (key, col, stage) of K's staged tile, col < dv, lies where a
    (block_n, dv) V tile puts (key, col), plus the stage's start, so that the wgmma descriptors
    of that V tile address it."""
    staged = HostLayout.of(hopper.smem_layout_staged(traits, traits.block_n, stages))
    v_tile = HostLayout.of(hopper.smem_layout(traits, traits.block_n, traits.dv))
    bn, d, dv = traits.block_n, traits.head_dim, traits.dv
    r, c = (x.ravel() for x in np.meshgrid(np.arange(bn), np.arange(dv), indexing="ij"))
    want = v_tile(r + bn * c)
    return all(bool(np.array_equal(staged(r + bn * c + bn * d * s), want + s * bn * d)) for s in range(stages))


def o_in_q_checks(traits: HopperTileTraits) -> bool:
    """(Inside a trace) where `hopper.o_fits_q_tile` stages O in Q's tile (kernels/sm90/fwd.py:
    Q's buffer as a (block_m, dv) tile): element (row, col) of O's tile lies where Q's tile
    puts (row, col), so a warpgroup's rows of O are its own rows of Q."""
    q_tile = HostLayout.of(hopper.smem_layout(traits, traits.block_m))
    o_tile = HostLayout.of(hopper.smem_layout(traits, traits.block_m, traits.dv))
    bm = traits.block_m
    r, c = (x.ravel() for x in np.meshgrid(np.arange(bm), np.arange(traits.dv), indexing="ij"))
    return bool(np.array_equal(o_tile(r + bm * c), q_tile(r + bm * c)))


def p_operand_checks(traits: HopperTileTraits) -> dict:
    """For each thread: C coordinate of S at the accumulator index `acc_as_operand_a` puts at
    A position j == the A coordinate of the P V wgmma at j."""
    return in_arch_trace("sm_90a", lambda: operand_a_check(hopper.tiled_mma_qk(traits), hopper.tiled_mma_pv(traits),
                                                           (traits.block_m, traits.block_n)))


def operand_a_check(mma_c, mma_a, tile) -> dict:
    """(Inside a trace) the accumulators of `mma_c` over `tile`, re-viewed by
    `acc_as_operand_a`, hold at A position j of every thread the element `mma_a` reads there
    (where `mma_a` has more threads, the latent tiles' warpgroups sharing rows: thread t's A is
    thread t mod mma_c's size's S)."""
    acc = cute.make_rmem_tensor(mma_c.get_slice(0).partition_shape_C(tile), cutlass.Float32)
    view = HostLayout.of(hopper.acc_as_operand_a(acc).layout)
    where = view(np.arange(view.size))
    c = partition_coords(mma_c, "partition_C", tile)[:, 0]  # (threads, values, (row, col))
    a = partition_coords(mma_a, "partition_A", tile)[:, 0]
    c = c[np.arange(len(a)) % len(c)]
    bad = sum(int(a_xy.shape[0] != view.size or not np.array_equal(c_xy[where], a_xy)) for c_xy, a_xy in zip(c, a))
    return {"threads": mma_a.size, "values": view.size, "mismatched_threads": bad, "ok": bad == 0}


def accumulator_coverage(traits: HopperTileTraits) -> dict:
    """The C partitions of all threads hold every element of S (block_m, block_n) and of O
    (block_m, dv) exactly once: the warpgroups split the rows (latent tiles: O's columns, each
    of their warpgroups computing the S of the one row warpgroup), nothing overlaps."""
    def run():
        out = {}
        for name, mma, tile in (("S", hopper.tiled_mma_qk(traits), (traits.block_m, traits.block_n)),
                                ("O", hopper.tiled_mma_pv(traits), (traits.block_m, traits.dv))):
            out[name] = covers_once(mma, tile)
        return out

    return in_arch_trace("sm_90a", run)


def covers_once(mma, tile) -> bool:
    """(Inside a trace) the C partitions of all of `mma`'s threads hold every element of `tile`
    exactly once."""
    counts = np.zeros(tile, dtype=np.int64)
    xy = partition_coords(mma, "partition_C", tile).reshape(-1, 2)  # every thread's (row, col)
    np.add.at(counts, (xy[:, 0], xy[:, 1]), 1)
    return bool((counts == 1).all())


def o_staging_checks(traits: HopperTileTraits) -> dict:
    """TMA moves a tile in boxes one swizzle atom wide (128 bytes of a row at most). For each
    warpgroup w and atom column j: the offset of (64 w + r, j * cols + c) in the (block_m, dv)
    tile == the offset of (r, c) in a (64, cols) box of the same atom, plus one base per box,
    and that base is a multiple of 1024 bytes."""
    return staging_checks(traits, traits.block_m, traits.row_warpgroups, traits.dv)


def staging_checks(traits, tile_rows: int, warpgroups: int, head_dim: int | None = None, bwd: bool = False) -> dict:
    """`o_staging_checks` for a (tile_rows, head_dim) tile (default the traits' head dim)
    stored by `warpgroups` boxes of tile_rows / warpgroups rows each (O in the forward,
    `hopper.smem_layout`; dK and dV in sK / sV in the backward, `bwd`: `hopper.bwd_smem_layout`,
    its atom picked for `bwd_atom_cols`). The latent tiles' two warpgroups store halves of one
    64-row band's columns, atoms these boxes check one by one."""
    head_dim = head_dim or traits.head_dim

    def run():
        rows = tile_rows // warpgroups
        if bwd:
            atom = hopper.swizzle_atom(traits, hopper.bwd_atom_cols(traits, head_dim))
            tile = HostLayout.of(hopper.bwd_smem_layout(traits, tile_rows, cols=head_dim))
        else:
            atom = hopper.swizzle_atom(traits, head_dim)
            tile = HostLayout.of(hopper.smem_layout(traits, tile_rows, head_dim))
        cols = cute.size(atom.shape[1])
        box = HostLayout.of(cute.tile_to_shape(atom, (rows, cols), order=(0, 1)))
        r, c = (x.ravel() for x in np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij"))
        box_offsets = box(r + rows * c)
        bases, same = [], True
        for w in range(warpgroups):
            for j in range(head_dim // cols):
                delta = tile(rows * w + r + tile_rows * (j * cols + c)) - box_offsets
                same = same and bool((delta == delta[0]).all())
                bases.append(int(delta[0]))
        aligned = all(b * ELEMENT_BYTES % STAGE_ALIGN == 0 for b in bases)
        return {"box_cols": cols, "bases": bases, "boxes_match_rows": same, "bases_aligned": aligned,
                "ok": same and aligned}

    return in_arch_trace("sm_90a", run)


def o_copy_checks(traits: HopperTileTraits, coord=None) -> dict:
    """Every (row, 16-byte chunk) of a warpgroup's (64, dv) O tile is copied by exactly one
    (thread, step) of `coord` (default `hopper.o_copy_coord`, what the kernel calls)."""
    coord = coord or hopper.o_copy_coord
    chunks = traits.dv * ELEMENT_BYTES // 16
    counts = np.zeros((hopper.WGMMA_M, chunks), dtype=np.int64)
    thread, step = np.meshgrid(np.arange(128), np.arange(hopper.o_copy_steps(traits.dv)), indexing="ij")
    row, chunk = coord(thread.ravel(), step.ravel(), traits.dv)
    inside = (row < hopper.WGMMA_M) & (chunk < chunks)
    np.add.at(counts, (row[inside], chunk[inside]), 1)
    return {"chunks": chunks, "ok": bool((counts == 1).all() and inside.all())}


def bwd_checks(traits: BwdTraits) -> dict:
    """The Hopper backward's recipes (layouts/hopper.py, kernels/sm90/bwd.py) for one tile:
    - Q (q_stages) / dO (`stages_do`), K / V and dS^T (`bwd_ds_stages`) are bijections, stages 1024-byte
      aligned (dO and V at V's head dim `dv`);
    - the S^T and dP^T accumulators, re-viewed by `acc_as_operand_a`, are the register A
      operands of dV += P^T dO and dK += dS^T Q, thread by thread (up to d 128; above it
      P^T and dS^T reach those GEMMs through shared memory, `bwd_splits_head_dim`);
    - the C partitions cover S^T (block_n, block_m), dK (block_n, d), dV (block_n, dv) and dQ
      (block_m, d) exactly once (on the 96-key tiles S, dK^T and dV^T, `bwd_keys_on_n`);
    - dQ's warpgroup runs: `chunk_index` (group 128, 16-byte vectors), where DQConvert reads
      each value, puts every thread's values at distinct places of the block_m x d chunk,
      filling it, and `run_layout` from each thread's first value, what add_dq stores through,
      agrees with it;
    - each warpgroup's TMA store boxes of dK / dV read its own 64 rows of the (block_n, d) and
      (block_n, dv) tiles (above d 128 one warpgroup stores each whole tile)."""

    bm, bn, d, dv = traits.block_m, traits.block_n, traits.head_dim, traits.dv
    split = hopper.bwd_splits_head_dim(traits)

    def run():
        out = {}
        for name, layout in (("sQ", hopper.bwd_smem_layout(traits, bm, traits.q_stages)),
                             ("sdO", hopper.bwd_smem_layout(traits, bm, traits.stages_do, dv)),
                             ("sK", hopper.bwd_smem_layout(traits, bn)),
                             ("sV", hopper.bwd_smem_layout(traits, bn, cols=dv)),
                             ("sdS", hopper.smem_layout_ds(traits, hopper.bwd_ds_stages(traits)))):
            host = HostLayout.of(layout)
            out[name] = is_bijection(host(np.arange(host.size)))
            if cute.rank(layout.shape) == 3:
                stage = ELEMENT_BYTES * cute.cosize(cute.slice_(layout, (None, None, 0)))
                out[f"{name}_stage_aligned"] = stage % STAGE_ALIGN == 0
        sdp, dkv, dq = hopper.tiled_mma_sdp_t(traits), hopper.tiled_mma_dkv(traits), hopper.tiled_mma_dq(traits)
        dv_mma = hopper.tiled_mma_dkv(traits, dv)
        if not split:
            out["operand_a"] = (operand_a_check(sdp, dkv, (bn, bm))["ok"]
                                and operand_a_check(sdp, dv_mma, (bn, bm))["ok"])
        for name, mma, tile in (("S^T", sdp, hopper.bwd_scores_shape(traits)),
                                ("dK", dkv, hopper.bwd_dkv_shape(traits)),
                                ("dV", dv_mma, hopper.bwd_dkv_shape(traits, dv)), ("dQ", dq, (bm, d))):
            out[f"cover_{name}"] = covers_once(mma, tile)
        per_thread = bm * d // dq.size
        where = np.array([[dq_order.chunk_index(i, t, per_thread, dq_order.HOPPER_VEC, 128) for i in range(per_thread)]
                          for t in range(dq.size)])  # what DQConvert reads
        run = HostLayout.of(dq_order.run_layout(per_thread, dq_order.HOPPER_VEC, 128))
        stored = where[:, :1] + run(np.arange(per_thread))[None, :]  # what the kernel's add_dq stores
        out["dq_runs"] = is_bijection(where) and bool(np.array_equal(stored, where))
        return out

    out = in_arch_trace("sm_90a", run)
    out["dkv_staging"] = all(staging_checks(traits, bn, 1 if split else hopper.bwd_warpgroups(traits), cols,
                                            bwd=True)["ok"] for cols in {d, dv})
    out["ok"] = all(out.values())
    return out


def verify_hopper(traits: HopperTileTraits, stages: int = 2) -> dict:
    smem = smem_checks(traits, stages)
    p = p_operand_checks(traits)
    cover = accumulator_coverage(traits)
    o_staging = o_staging_checks(traits)
    o_copy = o_copy_checks(traits)
    ok = (smem["sQ"] and smem["sKV"] and smem["sV"] and smem["sO"] and smem["staged_bijection"]
          and smem["stages_aligned"] and smem.get("sV_in_sK", True) and smem.get("sO_in_sQ", True) and p["ok"]
          and all(cover.values()) and o_staging["ok"] and o_copy["ok"])
    return {"smem": smem, "p_operand": p, "acc_coverage": cover, "o_staging": o_staging, "o_copy": o_copy,
            "ok": ok}


def report(traits: HopperTileTraits, stages: int = 2) -> dict:
    """The row of `python -m layouts report` for a Hopper traits (sm_90 only)."""
    from layouts.traits import SMEM_LIMIT

    checks = verify_hopper(traits, stages)
    smem_bytes = traits.smem_bytes(stages)
    fits = smem_bytes <= SMEM_LIMIT[90]
    return {"name": f"{traits.name}_s{stages}", "smem_bytes": smem_bytes, "fits": fits, **checks,
            "ok": fits and checks["ok"]}
