"""Property tests of the forward and backward kernels' compile-time design, on the CPU
(layouts.verify, layouts.verify_bwd).

Every chosen traits must fit in shared memory, use bijective smem layouts, read and write smem
without bank conflicts, move global memory in coalesced 16-byte vectors and split every tile
exactly once among threads. Counter-examples (an unswizzled layout, a strided gmem copy, broken
partitions) show each checker can fail. verify caches per traits, so the explicit bucket sweep
and the hypothesis draws share the expensive traces (~2-5 s per traits).
"""
import math

import cutlass
import cutlass.cute as cute
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_flash.launch.variants import sm90_traits_stages
from layouts import copy, hopper, smem, verify, verify_bwd
from layouts.hopper import (HopperTileTraits, choose_hopper_cache_traits, choose_hopper_traits,
                            shipped_hopper_bwd_traits, shipped_hopper_cache_traits, shipped_hopper_latent_traits,
                            shipped_hopper_traits)
from layouts.traits import (DTYPES, ELEMENT_BYTES, HEAD_DIM_BUCKETS, SMEM_LIMIT, FwdTraits, choose_bwd_traits,
                            choose_fwd_traits, head_dim_bucket, shipped_bwd_traits)

ARCHS = (80, 90)
SMALL_SMEM_ARCHS = (86, 89)  # 99 KB of shared memory per block: smaller tiles where sm_80's do not fit
CASES = [(d, dtype, arch) for d in HEAD_DIM_BUCKETS for dtype in DTYPES for arch in ARCHS]
CASE_IDS = [f"d{d}-{dtype}-sm{arch}" for d, dtype, arch in CASES]
# head dims 8..256 map onto the buckets, so the draws reuse the bucket sweep's cached traces
head_dims = st.integers(8, 256)
dtypes = st.sampled_from(DTYPES)
archs = st.sampled_from(ARCHS + SMALL_SMEM_ARCHS)
FEW = settings(max_examples=10, deadline=None)


def _assert_bijections(t):
    assert {name: verify.is_bijection(verify.smem_table(name, t)) for name in verify.SMEM_LAYOUTS} == \
        dict.fromkeys(verify.SMEM_LAYOUTS, True)


def _assert_bank_conflict_free(t):
    banks = verify.verify_traits(t)["banks"]
    assert {k: (b["worst"], b["vector_ok"]) for k, b in banks.items()} == dict.fromkeys(banks, (0, True))


def _assert_gmem(t):
    gmem = verify.verify_traits(t)["gmem"]
    assert {k: (g["vector_bytes"], g["vector_ok"], g["coalesced"]) for k, g in gmem.items()} == \
        dict.fromkeys(gmem, (16, True, True))
    runs = {r for g in gmem.values() for r in g["run_bytes"]}
    assert runs == {t.block_k_smem * ELEMENT_BYTES}


def _assert_coverage(t):
    cover = verify.verify_traits(t)["coverage"]
    assert {k: c["ok"] for k, c in cover.items()} == dict.fromkeys(verify.PARTITIONS, True)


def _assert_page_runs(t):
    runs = verify.verify_traits(t)["page_runs"]
    assert runs["ok"] and runs["run"] == copy.paged_row_group(t) >= 1


# --- smem budget -----------------------------------------------------------------------------


@given(d=head_dims, dtype=dtypes, arch=archs)
@settings(max_examples=200, deadline=None)
def test_chosen_traits_fit_smem(d, dtype, arch):
    t = choose_fwd_traits(d, dtype, arch)
    assert t.head_dim == head_dim_bucket(d) >= d
    assert t.smem_bytes <= SMEM_LIMIT[arch] and t.fits(arch)


@pytest.mark.parametrize("arch", SMALL_SMEM_ARCHS)
def test_backward_tiles_on_99_kb_gpus(arch):
    """sm_86 / sm_89: every bucket up to 160 gets backward tiles that fit 99 KB (smaller or
    single-buffered where sm_80's do not); above, a ValueError that says why, where an unknown
    arch used to fail with a KeyError."""
    for d in HEAD_DIM_BUCKETS:
        if d <= 160:
            t = choose_bwd_traits(d, "fp16", arch)
            assert t.head_dim == d and t.smem_bytes <= SMEM_LIMIT[arch] < choose_bwd_traits(d, "fp16", 80).smem_bytes
        else:
            with pytest.raises(ValueError, match="163 KB"):
                choose_bwd_traits(d, "fp16", arch)


@pytest.mark.parametrize("d,dtype,arch", CASES, ids=CASE_IDS)
def test_smem_bytes_match_layout_cosizes(d, dtype, arch):
    """The budget `fits` checks must be what the layouts really occupy (cosize, in bytes)."""
    t = choose_fwd_traits(d, dtype, arch)
    q = verify.smem_table("sQ", t).max() + 1
    kv = verify.smem_table("sKV", t).max() + 1
    assert t.smem_bytes == ELEMENT_BYTES * (q + 2 * kv)
    assert t.smem_bytes <= SMEM_LIMIT[arch]


# --- the checks on every chosen traits: explicit buckets and hypothesis draws -----------------


@pytest.mark.parametrize("d,dtype,arch", CASES, ids=CASE_IDS)
def test_smem_layouts_are_bijections(d, dtype, arch):
    _assert_bijections(choose_fwd_traits(d, dtype, arch))


@pytest.mark.parametrize("d,dtype,arch", CASES, ids=CASE_IDS)
def test_ldmatrix_and_cp_async_are_bank_conflict_free(d, dtype, arch):
    _assert_bank_conflict_free(choose_fwd_traits(d, dtype, arch))


@pytest.mark.parametrize("d,dtype,arch", CASES, ids=CASE_IDS)
def test_gmem_copies_are_16_byte_and_coalesced(d, dtype, arch):
    _assert_gmem(choose_fwd_traits(d, dtype, arch))


@pytest.mark.parametrize("d,dtype,arch", CASES, ids=CASE_IDS)
def test_copy_and_mma_partitions_cover_tiles_once(d, dtype, arch):
    _assert_coverage(choose_fwd_traits(d, dtype, arch))


@pytest.mark.parametrize("d,dtype,arch", CASES, ids=CASE_IDS)
def test_paged_copy_runs_stay_inside_a_page(d, dtype, arch):
    _assert_page_runs(choose_fwd_traits(d, dtype, arch))


@given(d=head_dims, dtype=dtypes, arch=archs)
@FEW
def test_any_head_dim_passes_every_check(d, dtype, arch):
    t = choose_fwd_traits(d, dtype, arch)
    _assert_bijections(t)
    _assert_bank_conflict_free(t)
    _assert_gmem(t)
    _assert_coverage(t)
    _assert_page_runs(t)
    assert verify.report(t, arch)["ok"]


# --- the bank model and its counter-examples --------------------------------------------------


def test_bank_model_on_hand_made_addresses():
    """16-byte accesses: phases of 8 lanes; 4-byte: one phase of 32; same word = broadcast."""
    lanes = np.arange(32)
    one = lambda addr, size: verify.bank_ways(np.asarray(addr).reshape(32, 1), size)  # noqa: E731
    assert one(lanes * 16, 16).tolist() == [[[1, 1, 1, 1]]]            # 4 x 128 B contiguous
    assert one(lanes * 128, 16).tolist() == [[[8, 8, 8, 8]]]           # same 16 B column: 8-way
    assert one((lanes % 8) * 16 + (lanes // 8) * 4096, 16).tolist() == [[[1, 1, 1, 1]]]
    assert one(np.zeros(32, int), 16).tolist() == [[[1, 1, 1, 1]]]     # broadcast
    assert one(lanes * 4, 4).tolist() == [[[1]]]
    assert one(lanes * 8, 4).tolist() == [[[2]]]                      # stride 2 words: 2-way


def _unswizzled_vt(rows, cols):
    return smem.transposed_view(smem.smem_layout_unswizzled(rows, cols))


def test_unswizzled_layout_is_flagged_by_the_bank_checker():
    """Row-major (64, 128) bf16: rows are 256 B apart, so the 8 rows of an ldmatrix phase share
    one bank group (8-way); cp.async still writes whole 128 B lines (conflict-free)."""
    t = FwdTraits(head_dim=128, block_m=64, block_n=64, num_warps=4)
    parts = verify.partitions(t)
    flat = verify.layout_table(smem.smem_layout_unswizzled, 64, 128)
    assert verify.is_bijection(flat)
    for name, table in [("ldsm_q", flat), ("ldsm_k", flat), ("ldsm_vt", verify.layout_table(_unswizzled_vt, 64, 128))]:
        b = verify.bank_conflicts(parts[name], table)
        assert (b["worst"], b["ok"], b["vector_ok"]) == (7, False, True), name
    for name in ("cpasync_q", "cpasync_kv"):
        assert verify.bank_conflicts(parts[name], flat)["worst"] == 0
    # the same copies are conflict-free on the swizzled layouts of the same traits
    assert verify.bank_conflicts(parts["ldsm_q"], verify.smem_table("sQ", t))["worst"] == 0


# --- gmem and coverage counter-examples ------------------------------------------------------


def _universal_copy(thr_shape, thr_stride, val_shape):
    bits = 16 * math.prod(val_shape)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=bits)
    return cute.make_tiled_copy_tv(atom, cute.make_layout(thr_shape, stride=thr_stride), cute.make_layout(val_shape))


def _column_major_threads():
    """128-bit copy with consecutive threads going down rows: each row gets 2 x 16 B per warp."""
    return _universal_copy((16, 8), (1, 16), (1, 8))


def _column_vectors():
    """Each thread's 8 values run down a column: not 16 contiguous bytes."""
    return _universal_copy((2, 64), (64, 1), (8, 1))


def _collapsed_threads():
    """Thread layout with a stride-0 mode: 8 thread columns share an id, a duplicated map."""
    return _universal_copy((16, 8), (8, 0), (1, 8))


def test_gmem_checker_flags_uncoalesced_and_unvectorised_copies():
    strided = verify.gmem_access(verify.capture_partition(_column_major_threads, (), "partition_S", (128, 128)))
    assert (strided["vector_ok"], strided["coalesced"], strided["run_bytes"]) == (True, False, [32])
    columns = verify.gmem_access(verify.capture_partition(_column_vectors, (), "partition_S", (128, 128)))
    assert not columns["vector_ok"] and not columns["ok"]


def test_coverage_checker_flags_broken_partitions():
    t = choose_fwd_traits(128)
    good = verify.partitions(t)["gmem_q"]
    assert verify.coverage(good)["ok"]

    collapsed = verify.coverage(verify.capture_partition(_collapsed_threads, (), "partition_S", good.tile))
    assert not collapsed["ok"] and collapsed["missing"] and collapsed["duplicated"]

    half = good.threads // 2  # the upper half of the threads repeats the lower half: half the tile
    halved = verify.Partition(np.concatenate([good.coords[:half], good.coords[:half]]), good.tile)
    assert verify.coverage(halved) == {"ok": False, "missing": good.coords[:half].size // 2,
                                        "duplicated": good.coords[:half].size // 2, "outside": 0}

    shifted = verify.Partition(good.coords + np.array([1, 0]), good.tile)
    assert verify.coverage(shifted)["outside"] == good.tile[1]

    b = verify.partitions(t)["mma_b_qk"]  # every warp reads all of B: a duplicate unless per warp
    assert verify.coverage(b)["ok"] and b.replicas == t.num_warps
    assert verify.coverage(verify.Partition(b.coords, b.tile))["duplicated"] == b.tile[0] * b.tile[1]


def _runs_without_phase_interleave(t):
    """The paged copy's runs as plain consecutive rows (row tiler R : G), no phase interleave."""
    rows = cute.make_layout(copy._rows_per_pass(t), stride=copy.paged_row_group(t))
    return cute.make_tiled_copy(copy._cp_async_atom(t), copy.gmem_tiled_copy_qkv(t).layout_tv_tiled,
                                (rows, cute.make_layout(t.block_k_smem)))


def test_page_run_and_bank_checkers_flag_the_naive_paged_copies():
    """The plain row order puts a thread's rows 16+ rows apart (a run would span pages); runs of
    consecutive rows without the phase interleave put two 64 B rows of equal parity in one
    phase (2-way conflicts on sK) where a row is 64 B (d 96)."""
    t = choose_fwd_traits(128)
    assert not verify.page_runs(verify.partitions(t)["gmem_kv"], copy.paged_row_group(t))["ok"]
    t = choose_fwd_traits(96)
    naive = verify.capture_partition(_runs_without_phase_interleave, (t,), "partition_D", (t.block_n, t.head_dim))
    assert verify.page_runs(naive, copy.paged_row_group(t))["ok"]
    assert verify.bank_conflicts(naive, verify.smem_table("sKV", t))["worst"] == 1
    assert verify.bank_conflicts(verify.partitions(t)["cpasync_kv_paged"], verify.smem_table("sKV", t))["worst"] == 0


# --- the host evaluator agrees with the DSL --------------------------------------------------


@cute.jit
def _dsl_layout_at(build: cutlass.Constexpr, args: cutlass.Constexpr, coords: cutlass.Constexpr):
    return _evaluate(build(*args), coords)


def _evaluate(layout, coords):
    return [int(layout(c)) for c in coords]


@cute.jit
def _dsl_partition_at(build: cutlass.Constexpr, args: cutlass.Constexpr, method: cutlass.Constexpr,
                      tile: cutlass.Constexpr, points: cutlass.Constexpr):
    return _partition_points(build(*args), method, tile, points)


def _partition_points(tiled, method, tile, points):
    ident = cute.make_identity_tensor(tile)
    return [tuple(int(x) for x in getattr(tiled.get_slice(t), method)(ident)[i]) for t, i in points]


@given(data=st.data(), d=st.sampled_from(HEAD_DIM_BUCKETS), name=st.sampled_from(sorted(verify.SMEM_LAYOUTS)))
@FEW
def test_smem_tables_match_dsl_at_natural_coordinates(data, d, name):
    t = choose_fwd_traits(d)
    table = verify.smem_table(name, t)
    rows = data.draw(st.lists(st.integers(0, table.shape[0] - 1), min_size=6, max_size=6))
    cols = data.draw(st.lists(st.integers(0, table.shape[1] - 1), min_size=6, max_size=6))
    coords = tuple(zip(rows, cols))
    assert _dsl_layout_at(verify.SMEM_LAYOUTS[name], (t,), coords) == [int(table[c]) for c in coords]


@given(data=st.data(), d=st.sampled_from(HEAD_DIM_BUCKETS), name=st.sampled_from(sorted(verify.PARTITIONS)))
@FEW
def test_partitions_match_dsl_for_any_thread(data, d, name):
    t = choose_fwd_traits(d)
    part = verify.partitions(t)[name]
    _, vec, accesses, _ = part.coords.shape
    points = tuple((data.draw(st.integers(0, part.threads - 1)), data.draw(st.integers(0, vec * accesses - 1)))
                   for _ in range(4))
    build, method, _, _ = verify.PARTITIONS[name]
    want = [tuple(int(x) for x in part.coords[th, i % vec, i // vec]) for th, i in points]
    assert _dsl_partition_at(build, (t,), method, part.tile, points) == want


def _swizzled(bits, base, shift, shape, stride):
    return cute.make_composed_layout(cute.make_swizzle(bits, base, shift), 0, cute.make_layout(shape, stride=stride))


@given(data=st.data(), bits=st.integers(1, 3), base=st.integers(0, 3), rows=st.sampled_from([2, 4, 8, 16]),
       cols=st.sampled_from([4, 8, 16, (4, 2), (2, 8)]), row_major=st.booleans())
@FEW
def test_host_swizzle_matches_dsl_everywhere(data, bits, base, rows, cols, row_major):
    """Whole-domain comparison (a capture itself re-checks only 8 points); CuTe needs |S| >= B."""
    shift = data.draw(st.integers(bits, 4)) * data.draw(st.sampled_from([1, -1]))
    n_cols = math.prod(cols) if isinstance(cols, tuple) else cols
    if row_major:
        stride = (n_cols, (1, cols[0]) if isinstance(cols, tuple) else 1)
    else:
        stride = (1, (rows, rows * cols[0]) if isinstance(cols, tuple) else rows)
    args = (bits, base, shift, (rows, cols), stride)
    table = verify.layout_table(_swizzled, *args)
    coords = tuple((r, c) for r in range(rows) for c in range(n_cols))
    assert _dsl_layout_at(_swizzled, args, coords) == [int(table[c]) for c in coords]


def test_report_cli_exits_1_when_a_check_fails(monkeypatch, capsys):
    from cute_flash.__main__ import main
    from cute_flash.tools import layouts_report as report

    t = choose_fwd_traits(128)
    monkeypatch.setattr(report, "shipped_fwd_traits", lambda arch: [t])
    monkeypatch.setattr(report, "shipped_bwd_traits", lambda arch: [choose_bwd_traits(128)])
    # one row of each Hopper table: every Hopper traits' checks are tests of their own below
    monkeypatch.setattr(report, "sm90_traits_stages", lambda: sm90_traits_stages()[:1])
    monkeypatch.setattr(report, "shipped_hopper_bwd_traits", lambda: shipped_hopper_bwd_traits()[:1])
    assert main(["layouts", "--arch", "90"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 120  # rows wrap by design
    monkeypatch.setitem(SMEM_LIMIT, 90, 1024)  # the same traits no longer fits
    assert main(["layouts", "--arch", "90"]) == 1
    out = capsys.readouterr().out.rstrip()
    assert f"sm90: 0/1 traits pass; FAILED: {t.name}\n" in out
    assert out.endswith("layouts report: FAILED (see the rows above)")


# --- the backward's layouts -------------------------------------------------------------------


def _shipped_bwd_traits():
    """Each backward traits any arch ships, with the archs that ship it: its checks but the
    shared-memory budget are the same on each."""
    archs = {}
    for arch in ARCHS + (86,):
        for t in shipped_bwd_traits(arch):
            archs.setdefault(t, []).append(arch)
    return list(archs.items())


@pytest.mark.parametrize("t, archs", _shipped_bwd_traits(), ids=lambda p: getattr(p, "name", None))
def test_every_backward_traits_passes_every_check(t, archs):
    """Fits, bijective smem layouts (and their transposed views), conflict-free cp.async,
    ldmatrix (plain and transposed) and accumulator stores, 16-byte coalesced gmem copies, and
    partitions covering their tiles (MMA operands once per reading warp)."""
    assert all(t.fits(arch) for arch in archs), archs
    r = verify_bwd.verify_traits(t)
    assert all(r["bijection"].values())
    assert {k: (b["worst"], b["vector_ok"]) for k, b in r["banks"].items()} == dict.fromkeys(r["banks"], (0, True))
    assert all(g["ok"] for g in r["gmem"].values())
    assert {k: c["ok"] for k, c in r["coverage"].items()} == dict.fromkeys(verify_bwd.PARTITIONS, True)


def _unswizzled_pds_t(rows, cols):
    return smem.transposed_view(smem.smem_layout_unswizzled(rows, cols))


def test_unswizzled_p_tile_is_flagged_for_the_transposed_reads():
    """P / dS stored row-major without the swizzle: rows of the 64 x 128 tile are 256 B apart, so
    the 8 rows an ldmatrix phase reads (transposed for dV / dK, plain for dQ) share one bank
    group, 8-way; the swizzled tile has no conflict."""
    t = choose_bwd_traits(128)
    parts = verify_bwd.partitions(t)
    flat_t = verify.layout_table(_unswizzled_pds_t, t.block_m, t.block_n)
    assert verify.bank_conflicts(parts["ldsm_pt"], flat_t)["worst"] == 7
    flat = verify.layout_table(smem.smem_layout_unswizzled, t.block_m, t.block_n)
    assert verify.bank_conflicts(parts["ldsm_ds"], flat)["worst"] == 7
    assert verify_bwd.verify_traits(t)["banks"]["ldsm_pt"]["worst"] == 0


def test_backward_coverage_counts_reading_warps():
    """In a 2 x 4 warp grid each A element is read by 4 warps and each B element by 2: a count
    of 1 would be wrong, the grid's count is right."""
    t = choose_bwd_traits(128)  # S/dP grid 2 x 4
    part = verify_bwd.partitions(t)["ldsm_q"]
    assert verify_bwd.coverage(part, 4)["ok"] and not verify_bwd.coverage(part, 1)["ok"]
    assert verify_bwd.coverage(verify_bwd.partitions(t)["ldsm_k"], 2)["ok"]


def _swapped_operand_view(acc):
    """`acc_as_operand_a` with two register groups swapped: what the P->A checks must catch."""
    n8 = cute.size(acc.shape[0]) // 4
    return cute.make_tensor(acc.iterator, cute.make_layout(((2, 2, 2), cute.size(acc.shape[1]), n8 // 2),
                                                           stride=((1, 4, 2), 4 * n8, 8)))


@pytest.mark.parametrize("traits, stages", sm90_traits_stages(), ids=lambda p: getattr(p, "name", f"s{p}"))
def test_hopper_traits_verify(traits, stages):
    """layouts.verify_hopper on every Hopper forward traits (the KV-cache entry's too) at each
    K / V stage count a shipped variant gives it: GMMA tiles are bijections, stages 1024-byte
    aligned, the S accumulator serves as P V's A operand in place, the accumulators cover S and
    O once, each warpgroup's TMA store boxes read its own rows of O's tile, and packed batches'
    O copy covers a warpgroup's rows once."""
    from layouts.verify_hopper import verify_hopper

    result = verify_hopper(traits, stages)
    assert result["ok"], result


def test_hopper_traits_with_a_value_head_dim_of_their_own():
    """V's own head dim (MLA's 192 / 128): named apart, its V stages sized by it, key blocks by
    the wider of the two, no tall tiles; a head_dim_v equal to head_dim is refused (None means
    the same), and one whose bucket is head_dim's is the plain traits (TMA zero-fills the rest)."""
    mla = choose_hopper_traits(192, "bf16", head_dim_v=128)
    assert (mla.head_dim, mla.head_dim_v, mla.dv, mla.block_m, mla.block_n) == (192, 128, 128, 128, 64)
    assert mla.name == "sm90_d192_v128_m128_n64_bf16" and mla in shipped_hopper_traits()
    assert mla.smem_bytes(2) == 2 * (128 * 192 + 2 * 64 * 192 + 2 * 64 * 128)
    assert choose_hopper_traits(128, "bf16", head_dim_v=256).block_n == 64
    assert choose_hopper_traits(64, "bf16", long_keys=True, head_dim_v=32).block_m == 128
    assert choose_hopper_traits(128, "bf16", head_dim_v=112) == choose_hopper_traits(128, "bf16")
    with pytest.raises(ValueError, match="head_dim_v"):
        HopperTileTraits(128, 128, 128, "bf16", head_dim_v=128)


def test_mla_unmasked_tiles_stage_o_in_q():
    """MLA's unmasked 128-key tiles (`unmasked`): two stages fit beside Q with O in Q's tile
    (one CTA a tile, no room for persistence), where each (row, col) of O lies at Q's; the
    check fails where O's swizzle atom is not Q's (d 96's 32-column atoms, V's 64)."""
    from layouts.verify_hopper import o_in_q_checks
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig

    wide = choose_hopper_traits(192, "bf16", head_dim_v=128, unmasked=True)
    assert (wide.block_n, hopper.wide_value_keys(wide), hopper.o_fits_q_tile(wide)) == (128, True, True)
    assert wide in shipped_hopper_traits() and not Sm90FwdConfig.fits_persistent(wide)
    assert Sm90FwdConfig.smem_for(wide, 2, persistent=False) == 2 * (128 * 192 + 2 * 128 * (192 + 128)) + 96
    assert choose_hopper_traits(256, "bf16", head_dim_v=128, unmasked=True).block_n == 64  # past WIDE_KEYS_MAX_DIMS
    assert choose_hopper_traits(192, "bf16", unmasked=True).block_n == 64  # one head dim: unchanged
    assert verify.in_arch_trace("sm_90a", lambda: o_in_q_checks(wide))
    narrow_atoms = HopperTileTraits(96, 128, 128, "bf16", 64)
    assert not hopper.o_fits_q_tile(narrow_atoms)
    assert not verify.in_arch_trace("sm_90a", lambda: o_in_q_checks(narrow_atoms))
    for cols in (16, 32, 48, 64, 96, 128, 160, 192, 224, 256):  # atom_cols, plain Python, is the DSL atom's
        atom = verify.in_arch_trace("sm_90a", lambda: cute.size(hopper.swizzle_atom(wide, cols).outer, mode=[1]))
        assert hopper.atom_cols(wide, cols) == atom


def test_hopper_report_covers_every_shipped_traits():
    """The report's (traits, stages) pairs hold every shipped Hopper forward traits, and the
    three-stage ones the launchers choose: d <= 96 on 128-row tiles (`kv_stages`) and the
    KV-cache entry's d <= 64 at one CTA an SM (`cache_stages`)."""
    pairs = sm90_traits_stages()
    shipped = {*shipped_hopper_traits(), *shipped_hopper_cache_traits(), *shipped_hopper_cache_traits(2),
               *shipped_hopper_latent_traits()}
    assert {t for t, _ in pairs} == shipped
    deep = {t for t, s in pairs if s == 3}
    assert choose_hopper_traits(96, "fp16") in deep and choose_hopper_cache_traits(64, "bf16") in deep
    assert choose_hopper_traits(128) not in deep and choose_hopper_cache_traits(128) not in deep


def test_hopper_p_operand_check_catches_a_wrong_view(monkeypatch):
    """The P->A check is not vacuous: swapping two register groups of the view fails it for
    every thread."""
    from layouts.verify_hopper import p_operand_checks

    monkeypatch.setattr(hopper, "acc_as_operand_a", _swapped_operand_view)
    traits = hopper.choose_hopper_traits(128)
    assert p_operand_checks(traits)["mismatched_threads"] == traits.num_threads


@pytest.mark.parametrize("traits", shipped_hopper_bwd_traits(), ids=lambda t: t.name)
def test_hopper_backward_traits_verify(traits):
    """layouts.verify_hopper.bwd_checks on every Hopper backward traits: its tiles are
    bijections with aligned stages, S^T and dP^T serve as dV's and dK's register A operands in
    place, the accumulators cover their tiles once, dQ's warpgroup runs fill the chunk, and the
    dK / dV store boxes read each warpgroup's own rows."""
    from layouts.verify_hopper import bwd_checks

    result = bwd_checks(traits)
    assert result["ok"], result


def test_hopper_backward_one_do_stage():
    """`BwdTraits.do_stages` 1 beside two Q stages (flash-attn-4's d 192 tiles): dO's tile and D
    take one stage, the shared memory counts one (the dQ staging tile fits beside it), the
    recipes verify, and as many dO stages as Q's are refused (None says so)."""
    from dataclasses import replace

    from layouts.verify_hopper import bwd_checks

    two = replace(hopper.choose_hopper_bwd_traits(192), block_n=96, q_stages=2)
    one = replace(two, do_stages=1)
    assert (two.stages_do, one.stages_do) == (2, 1)
    do_stage = ELEMENT_BYTES * one.block_m * one.dv + 4 * one.block_m + 2 * 8  # the tile, D, two mbarriers
    assert hopper.bwd_smem_bytes(two) - hopper.bwd_smem_bytes(one) == do_stage
    assert hopper.bwd_smem_bytes(two) > SMEM_LIMIT[90] >= hopper.bwd_smem_bytes(one)
    assert bwd_checks(one)["ok"]
    with pytest.raises(ValueError, match="do_stages"):
        replace(two, do_stages=2)


def test_hopper_backward_checks_catch_a_wrong_view_and_a_wrong_run(monkeypatch):
    """Not vacuous: swapping two register groups of the A-operand view fails `operand_a`, and
    stores in runs of one warp's width (the SM80 kernel's) against a warpgroup's reads fail
    `dq_runs`."""
    from layouts import dq, hopper
    from layouts.verify_hopper import bwd_checks

    traits = hopper.choose_hopper_bwd_traits(128)
    with monkeypatch.context() as m:
        m.setattr(hopper, "acc_as_operand_a", _swapped_operand_view)
        assert not bwd_checks(traits)["operand_a"]
    run = dq.run_layout
    monkeypatch.setattr(dq, "run_layout", lambda n, vec, group: run(n, vec, 32))
    assert not bwd_checks(traits)["dq_runs"]


@pytest.mark.parametrize("head_dim", [96, 160, 192, 224])
def test_hopper_o_copy_check_catches_row_stepping(head_dim):
    """The O copy check is not vacuous: the first version of the packed O copy stepped rows by
    128 // (d / 8) threads, which leaves rows out wherever d / 8 does not divide 128 (what the
    H200 run of 2026-12-01 failed on at d 96)."""
    from layouts.verify_hopper import o_copy_checks

    def row_stepping(thread, step, d):
        chunks = d // 8
        return thread // chunks + step * (128 // chunks), thread % chunks

    traits = hopper.choose_hopper_traits(head_dim)
    assert o_copy_checks(traits)["ok"]
    assert not o_copy_checks(traits, row_stepping)["ok"]


def test_hopper_o_staging_check_catches_a_tile_in_another_order(monkeypatch):
    """The O staging check is not vacuous: a (block_m, d) tile whose swizzle atoms run along the
    head dim first puts a warpgroup's 64 rows in no box-shaped region."""
    from layouts.verify_hopper import o_staging_checks

    def head_dim_first(traits, rows, cols=None):
        cols = cols or traits.head_dim
        return cute.tile_to_shape(hopper.swizzle_atom(traits, cols), (rows, cols), order=(1, 0))

    traits = hopper.choose_hopper_traits(128)
    assert o_staging_checks(traits)["ok"]
    monkeypatch.setattr(hopper, "smem_layout", head_dim_first)
    result = o_staging_checks(traits)
    assert not result["boxes_match_rows"], result


def _fwd_mma_shapes():
    from layouts.traits import shipped_fwd_traits

    shapes = {(t.block_m, t.block_n, t.num_warps): t for arch in (80, 90) for t in shipped_fwd_traits(arch)}
    return [pytest.param(t, id=f"m{m}_n{n}_w{w}") for (m, n, w), t in sorted(shapes.items())]


@pytest.mark.parametrize("traits", _fwd_mma_shapes())
def test_dropout_words_sm80_forward(traits):
    """Every SM80 forward tile: each thread's S values come in groups of 8 sharing one Philox
    counter (docs/semantics.md, Dropout), each value's word a static function of its fragment
    index: one Philox call per 8 values, no run-time word selects."""
    from layouts import mma
    from layouts.verify import in_arch_trace
    from layouts.verify_dropout import word_groups

    result = in_arch_trace("sm_80", lambda: word_groups(mma.tiled_mma(traits), (traits.block_m, traits.block_n),
                                                        wgmma=False))
    assert result["ok"], result


@pytest.mark.parametrize("traits", shipped_hopper_traits()[::2], ids=lambda t: t.name)
def test_dropout_words_hopper(traits):
    from layouts.verify import in_arch_trace
    from layouts.verify_dropout import word_groups

    result = in_arch_trace("sm_90a", lambda: word_groups(hopper.tiled_mma_qk(traits), (traits.block_m, traits.block_n),
                                                         wgmma=True))
    assert result["ok"], result


def test_dropout_word_check_catches_the_backward_s_tile():
    """Not vacuous: the backward's S tiled MMA puts a warp's n8 tiles 32 columns apart (its warp
    grid interleaves warps along N), so a thread holds 4 of each counter's 8 values: the check
    fails for every thread."""
    from layouts import mma
    from layouts.traits import shipped_bwd_traits
    from layouts.verify import in_arch_trace
    from layouts.verify_dropout import word_groups

    (t,) = [t for t in shipped_bwd_traits(90) if (t.block_m, t.block_n, t.atom_m_sdp) == (64, 128, 2)][:1]
    result = in_arch_trace("sm_80", lambda: word_groups(mma.tiled_mma_grid(t, t.atom_m_sdp), (t.block_m, t.block_n),
                                                        wgmma=False))
    assert result["bad_threads"] == result["threads"]


@pytest.mark.parametrize("traits", [t for t in shipped_hopper_bwd_traits() if hopper.bwd_keys_on_n(t)],
                         ids=lambda t: t.name)
def test_dropout_words_hopper_backward_on_96_keys(traits):
    """The 96-key tiles' S (queries on M, `dropout_ds_qk`): the forward's groups, one Philox
    call per 8 values at static steps of 16 rows and columns from each thread's first value,
    each warpgroup's 48 keys included."""
    from layouts.verify import in_arch_trace
    from layouts.verify_dropout import word_groups

    tile = hopper.bwd_scores_shape(traits)  # (block_m, block_n): queries on M
    result = in_arch_trace("sm_90a", lambda: word_groups(hopper.tiled_mma_sdp_t(traits), tile, wgmma=True))
    assert result["ok"], result


@pytest.mark.parametrize("traits", [t for t in shipped_hopper_bwd_traits() if not hopper.bwd_keys_on_n(t)],
                         ids=lambda t: t.name)
def test_dropout_pair_exchange_hopper_backward(traits):
    """The Hopper backward's S^T tile: lanes t and t ^ 4 share every Philox counter they touch,
    each holding 4 values at one half of the same 4 words, where `Dropout.pair_keep_bits` puts
    them (one Philox call per 8 values, as the forward, and one shuffle of keep bits); with lane
    t ^ 1 (the other columns) the pairing fails for every thread."""
    from layouts.verify import in_arch_trace
    from layouts.verify_dropout import pair_exchange

    tile = (traits.block_n, traits.block_m)
    result = in_arch_trace("sm_90a", lambda: pair_exchange(hopper.tiled_mma_sdp_t(traits), tile))
    assert result["ok"], result
    wrong = in_arch_trace("sm_90a", lambda: pair_exchange(hopper.tiled_mma_sdp_t(traits), tile, partner_xor=1))
    assert wrong["bad_threads"] == wrong["threads"], wrong


def _bwd_sdp_shapes():
    from layouts.traits import shipped_bwd_traits

    shapes = {(t.block_m, t.block_n, t.num_warps, t.atom_m_sdp): t
              for arch in (80, 90) for t in shipped_bwd_traits(arch)}
    return [pytest.param(t, id=f"m{m}_n{n}_w{w}_a{a}") for (m, n, w, a), t in sorted(shapes.items())]


@pytest.mark.parametrize("traits", _bwd_sdp_shapes())
def test_dropout_atoms_backward(traits):
    """Every backward S tile: each mma.sync atom's 4 values share one Philox counter, at the
    offsets `Dropout.atom_keeps` assumes (whatever the warp grid)."""
    from layouts import mma
    from layouts.verify import in_arch_trace
    from layouts.verify_dropout import atom_checks

    result = in_arch_trace("sm_80", lambda: atom_checks(mma.tiled_mma_grid(traits, traits.atom_m_sdp),
                                                        (traits.block_m, traits.block_n)))
    assert result["ok"], result


def test_latent_tiles_pass_the_hopper_checks(monkeypatch):
    """MLA decode's latent tiles: every Hopper check, with V as K's first 512 columns stage by
    stage and both warpgroups' P from the one S partition; the V check fails when K's stages
    are laid out column-first (not vacuous)."""
    from layouts.verify_hopper import latent_v_checks, report

    traits = hopper.choose_hopper_latent_traits("bf16")
    assert (traits.warpgroups, traits.row_warpgroups, traits.dv_wg) == (2, 1, 256)
    row = report(traits, 2)
    assert row["ok"] and row["smem"]["sV_in_sK"] and row["p_operand"]["threads"] == 256
    assert row["smem_bytes"] == 64 * 576 * 2 * 3
    staged = hopper.smem_layout_staged
    monkeypatch.setattr(hopper, "smem_layout_staged", lambda t, rows, stages, cols=None: cute.tile_to_shape(
        hopper.swizzle_atom(t, cols), (rows, cols or t.head_dim, stages), order=(1, 0, 2)))
    assert not verify.in_arch_trace("sm_90a", lambda: latent_v_checks(traits, 2))
    monkeypatch.setattr(hopper, "smem_layout_staged", staged)
    with pytest.raises(ValueError, match="latent tiles"):
        HopperTileTraits(576, 128, 64, "bf16", 512, latent=True)
