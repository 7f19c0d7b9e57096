"""Every kernel variant the dispatcher can choose compiles for sm_80 and sm_90a, with no GPU.

CI compiles a covering subset (every head-dim bucket of the forward, KV-cache and backward
kernels on both archs, each flag on and off, the append kernel, the backward's preprocess and
dQ convert; the split-KV combine is part of every split kernel, compiled for every head-dim
bucket); the full traits x flags sweep is marked slow:
`pytest -m slow tests/compile/test_compile.py`.
"""
import re

import cutlass  # noqa: F401  (the DSL is a hard dependency: its absence fails here, never skips)
import pytest

from cute_flash.compile.registry import arch_option, build
from cute_flash.kernels.common.flags import CACHE_FLAGS, SCORE_FLAGS
from cute_flash.kernels.sm80.fwd import FwdConfig
from cute_flash.launch.variants import (BWD_FLAGS, append_variants, bwd_variants, fwd_variants, order_variants,
                                       packed_append_variants,
                                       sm90_bwd_variants)
from cute_flash.tools.canaries import compile_canary
from cute_flash.tools.sanitize import OUR_KERNELS
from layouts import hopper
from layouts.traits import SMEM_LIMIT, shipped_fwd_traits
from tests.helpers.roundtrip import OPERANDS, TileRoundTrip


def _cases(variants, full):
    return [pytest.param(arch, c, id=f"sm{arch}-{c.name}") for arch in (80, 90) for c in variants(arch, full)]


def _assert_one_kernel_for(arch, ptx_dir):
    """The compile kept one PTX file, holding one kernel entry, for `arch`'s target, named as
    racecheck's kernel filter expects (`sanitize.OUR_KERNELS`)."""
    from layouts.traits import sm_name

    (ptx,) = ptx_dir.glob("*.ptx")
    text = ptx.read_text()
    assert text.count(".entry ") == 1 and f".target {sm_name(arch)}" in text
    assert re.search(r"\.entry (\w+)\(", text).group(1).startswith(OUR_KERNELS)


def _compile(arch, config, tmp_path):
    assert config.smem_bytes <= SMEM_LIMIT[arch]
    build(config, arch, f"--keep-ptx --dump-dir={tmp_path}")
    _assert_one_kernel_for(arch, tmp_path)


@pytest.mark.parametrize("arch, config", _cases(fwd_variants, full=False))
def test_fwd_variant_compiles(arch, config, tmp_path):
    _compile(arch, config, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("arch, config", _cases(fwd_variants, full=True))
def test_fwd_variant_compiles_full_sweep(arch, config, tmp_path):
    _compile(arch, config, tmp_path)


def test_subset_covers_every_traits_and_every_flag():
    covered = {c.traits for arch in (80, 90) for c in fwd_variants(arch)}
    assert covered == set(shipped_fwd_traits(80)) | set(shipped_fwd_traits(90))
    for arch in (80, 90):  # every head-dim bucket of both kernels on both archs
        assert {(c.traits.head_dim, c.traits.block_m, c.traits.block_n) for c in fwd_variants(arch)} == {
            (t.head_dim, t.block_m, t.block_n) for t in shipped_fwd_traits(arch)}
        assert any(c.varlen and c.has_seqused_k for c in fwd_variants(arch))
        assert any(c.varlen and c.paged for c in fwd_variants(arch))
        assert any(c.varlen and c.any_page_size for c in fwd_variants(arch))
        assert any(c.has_dropout and not c.varlen for c in fwd_variants(arch))
        assert any(c.has_dropout and c.varlen for c in fwd_variants(arch))
    configs = fwd_variants(90)
    for name in SCORE_FLAGS + CACHE_FLAGS + ("any_page_size",):
        assert {getattr(c, name) for c in configs} == {False, True}, name
    assert any(all(getattr(c, n) != (n == "even_k") for n in SCORE_FLAGS) for c in configs)  # all on
    assert any(c.kvcache and c.paged and c.split for c in configs)
    assert any(c.kvcache and c.any_page_size and c.split for c in configs)


@pytest.mark.parametrize("arch", [80, 90])
def test_dropout_variant_adds_philox(arch, tmp_path):
    """A dropout variant compiles, and its main loop holds Philox calls: one per 8 S values of a
    thread per key block (layouts/verify_dropout.py), each 20 wide multiplies of which only the
    first round's on the head row can be shared between calls; so at least 19 more per call of
    one step body than the plain variant (whose multiplies are address arithmetic)."""
    from layouts.traits import choose_fwd_traits

    t = choose_fwd_traits(128, "bf16", arch)
    counts = []
    for dropout in (False, True):
        out = tmp_path / str(dropout)
        out.mkdir()
        build(FwdConfig(t, has_right=True, has_dropout=dropout), arch, f"--keep-ptx --dump-dir={out}")
        (ptx,) = out.glob("*.ptx")
        counts.append(ptx.read_text().count("mul.wide.u32"))
    calls_per_step = t.block_m * t.block_n // (32 * t.num_warps) // 8
    assert counts[1] - counts[0] >= 19 * calls_per_step


def _small_smem_cases():
    """The kernels whose tiles on 99 KB GPUs (sm_86, sm_89) differ from sm_80's: the forward at
    d 224 / 256, the backward (and its dQ convert) at d 32..160; compiled for sm_86."""
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from cute_flash.kernels.sm80.dq_convert import DQConvertConfig
    from layouts.traits import HEAD_DIM_BUCKETS, bwd_fits, choose_bwd_traits, choose_fwd_traits

    cases = []
    for d in HEAD_DIM_BUCKETS:
        f = choose_fwd_traits(d, "fp16", 86)
        if f != choose_fwd_traits(d, "fp16", 80):
            cases.append(FwdConfig(f, has_right=True))
        if bwd_fits(d, 86) and choose_bwd_traits(d, "fp16", 86) != choose_bwd_traits(d, "fp16", 80):
            b = choose_bwd_traits(d, "fp16", 86)
            cases += [BwdConfig(b, has_right=True), DQConvertConfig(b)]
    return [pytest.param(c, id=c.name) for c in cases]


@pytest.mark.parametrize("config", _small_smem_cases())
def test_small_shared_memory_variants_compile_for_sm86(config, tmp_path):
    _compile(86, config, tmp_path)


@pytest.mark.parametrize("arch, config", _cases(bwd_variants, full=False))
def test_bwd_variant_compiles(arch, config, tmp_path):
    _compile(arch, config, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("arch, config", _cases(bwd_variants, full=True))
def test_bwd_variant_compiles_full_sweep(arch, config, tmp_path):
    _compile(arch, config, tmp_path)


def test_bwd_subset_covers_every_bucket_and_every_flag():
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from layouts.traits import HEAD_DIM_BUCKETS, choose_bwd_traits

    for arch in (80, 90):
        configs = [c for c in bwd_variants(arch) if isinstance(c, BwdConfig)]
        dtype = configs[0].traits.dtype
        assert {c.traits for c in configs} == {choose_bwd_traits(d, dtype, arch) for d in HEAD_DIM_BUCKETS}
        for name in BWD_FLAGS + ("varlen", "has_seqused_k"):
            assert {getattr(c, name) for c in configs} == {False, True}, name


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("config", append_variants() + packed_append_variants(), ids=lambda c: c.name)
def test_append_kernel_compiles(arch, config, tmp_path):
    build(config, arch, f"--keep-ptx --dump-dir={tmp_path}")
    _assert_one_kernel_for(arch, tmp_path)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("operand", OPERANDS)
def test_roundtrip_kernel_compiles(arch, operand, tmp_path):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    shipped = shipped_fwd_traits(arch)
    for i, traits in enumerate((shipped[0], shipped[len(shipped) // 2], shipped[-1])):
        el = cutlass.BFloat16 if traits.dtype == "bf16" else cutlass.Float16
        x, y = (make_fake_compact_tensor(el, (cute.sym_int(), traits.head_dim), stride_order=(1, 0),
                                         assumed_align=16) for _ in range(2))
        dump = tmp_path / str(i)
        dump.mkdir()
        cute.compile(TileRoundTrip(traits, operand), x, y, make_fake_stream(),
                     options=f"{arch_option(arch)} --keep-ptx --dump-dir={dump}")
        _assert_one_kernel_for(arch, dump)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
def test_hopper_tile_compiles_to_tma_and_wgmma(head_dim, tmp_path):
    """The Hopper recipes (layouts/hopper.py) compile for sm_90a into TMA tile loads and
    wgmma: one bulk tensor copy per 128/64/32-byte swizzle span of Q, K and V, and
    head_dim / 16 + block_n / 16 wgmma per warpgroup."""
    from tests.helpers.hopper_tile import compile_hopper_tile
    from layouts.hopper import HopperTileTraits

    traits = HopperTileTraits(head_dim, 128, 128 if head_dim <= 128 else 64)
    compile_hopper_tile(traits, 90, f"--keep-ptx --dump-dir={tmp_path}")
    _assert_one_kernel_for(90, tmp_path)
    (ptx,) = tmp_path.glob("*.ptx")
    text = ptx.read_text()
    assert text.count("wgmma.mma_async") == head_dim // 16 + traits.block_n // 16
    row_bytes = 2 * head_dim
    span = next(b for b in (128, 64, 32) if row_bytes % b == 0)  # the swizzle atom's width
    assert text.count("cp.async.bulk.tensor") == 3 * (row_bytes // span)  # Q, K, V: a box per span


def _sm90_configs():
    from cute_flash.launch.variants import sm90_variants

    return [pytest.param(c, id=c.name) for c in sm90_variants()]


@pytest.mark.parametrize("config", _sm90_configs())
def test_hopper_forward_compiles_to_wgmma(config, tmp_path):
    """The Hopper forward (the sm_90 default for dense forwards) builds for sm_90a: its two GEMMs
    are wgmma, head_dim / 16 + block_n / 16 per key block, each GEMM traced twice (the first S
    and the last P V are peeled off the loop), and it fits in shared memory. Its softmax takes
    row maxima with max.f32, not the slower max.NaN.f32, and rescales O lazily behind a warp
    vote (docs/tuning/hopper-forward.md, Hopper step 7). Philox's 32x32 -> 64-bit multiplies by its round
    constant appear exactly in the dropout variants (others multiply block indices wide too),
    which decide a word's two elements with one bf16x2 compare, 4 per call.
    O leaves through TMA stores, except from packed batches, whose rows go out in 128-bit
    stores behind a row predicate (a box past a sequence would overwrite the next one's), and
    from split-KV tiles (fp32 partials, merged with plain stores). Packed batches and KV
    caches zero V rows past seqlen_k behind named barrier 7 (`clear_v_tail`); dense calls
    never do. Speculative maxima over S (d 64's 192-row tiles) vote by warpgroup and, where the
    vote fails, issue Q K^T again; blocks a causal edge crosses take `update` instead. With K /
    V multicast, K and V arrive by multicast copies and the persistent schedule strides
    statically (no tile counter). KV caches launched as programmatic dependents wait for the
    previous grid before touching global memory (`Sm90FwdConfig.dependent_launch`)."""
    from layouts.philox import M0

    assert config.smem_bytes <= SMEM_LIMIT[90]
    build(config, 90, f"--keep-ptx --dump-dir={tmp_path}")
    _assert_one_kernel_for(90, tmp_path)
    (ptx,) = tmp_path.glob("*.ptx")
    t = config.traits
    text = ptx.read_text()
    # speculating in place, a failed warpgroup vote (bar.red.and) issues Q K^T again, traced in
    # the unmasked softmax, and in the masked one under a window's left edge (elsewhere masked
    # blocks take `update`)
    votes = (2 if config.has_left else 1) if config.speculative_in_place else 0
    assert text.count("wgmma.mma_async") == 2 * (t.head_dim // 16 + t.block_n // 16) + votes * (t.head_dim // 16)
    assert text.count("bar.red.and.pred") == votes
    assert "max.NaN.f32" not in text
    assert "vote.sync.any.pred" in text
    assert (f", {M0 - (1 << 32)};" in text) == config.has_dropout  # the immediate, as an int32
    compares = text.count("setp.lt.bf16x2")
    assert (compares > 0) == config.has_dropout and compares % 4 == 0
    assert (".global.shared::cta" in text) == (not config.varlen and not config.split)  # a TMA store
    assert ("st.global.v4" in text) == config.varlen
    assert (re.search(r"bar\.sync\s+7,", text) is not None) == config.clears_v_tail
    # a cluster-merged split reads the other splits' partials from their shared memory, and
    # touches no arrival counter
    assert ("ld.shared::cluster.f32" in text) == config.cluster_merge
    assert ("atom.global" in text) == ((config.persistent and not config.kv_multicast)
                                       or (config.split and not config.cluster_merge))
    assert ("multicast::cluster" in text) == config.kv_multicast
    # KV caches launched as programmatic dependents
    assert text.count("griddepcontrol.wait") == text.count("griddepcontrol.launch_dependents") == (
        1 if config.dependent_launch else 0)


@pytest.mark.parametrize("d, split", [(128, True), (64, False)])
def test_hopper_cache_entry_two_ctas_per_sm(d, split, tmp_path):
    """The KV-cache entry's two-CTAs-an-SM variant (`Sm90FwdConfig.ctas_per_sm`, taken for
    short caches by `policy.takes_two_ctas_per_sm`) asks for two CTAs an SM (PTX
    .minnctapersm 2), fits in half an SM's shared memory, and ptxas fits it in 128 registers a
    thread without spilling (the consumer raised to 232 by setmaxnreg). It compiles on a
    machine without a GPU: the shared-memory carveout is given, so the DSL does not ask the
    device."""
    from cute_flash.kernels.sm90.fwd import SMEM_PER_SM, Sm90FwdConfig
    from cute_flash.tools.resources import find_ptxas, ptxas_report
    from layouts.hopper import HopperTileTraits

    config = Sm90FwdConfig(HopperTileTraits(d, 64, 64), kvcache=True, split=split, pack_gqa=True, ctas_per_sm=2)
    assert 2 * (config.smem_bytes + 1024) <= SMEM_PER_SM
    build(config, 90, f"--keep-ptx --dump-dir={tmp_path}")
    (ptx,) = tmp_path.glob("*.ptx")
    assert re.search(r"\.minnctapersm\s+2", ptx.read_text())
    if find_ptxas() is None:
        pytest.skip("no ptxas on this machine: the register check did not run")
    report = ptxas_report(str(ptx), 90)
    assert report["registers"] <= 128 and not report.get("spill_stores") and not report.get("spill_loads")


def test_two_ctas_per_sm_only_where_two_fit():
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from layouts.hopper import HopperTileTraits

    with pytest.raises(ValueError):  # 64 x 128 tiles at d 128: 144 KB of shared memory
        Sm90FwdConfig(HopperTileTraits(128, 64, 128), kvcache=True, ctas_per_sm=2)
    with pytest.raises(ValueError):  # two consumer warpgroups
        Sm90FwdConfig(HopperTileTraits(64, 128, 64), kvcache=True, ctas_per_sm=2)
    with pytest.raises(ValueError):  # not a KV-cache entry
        Sm90FwdConfig(HopperTileTraits(64, 64, 64), ctas_per_sm=2)
    with pytest.raises(ValueError):
        Sm90FwdConfig(HopperTileTraits(64, 64, 64), kvcache=True, ctas_per_sm=3)
    assert Sm90FwdConfig(HopperTileTraits(128, 64, 64), kvcache=True, ctas_per_sm=2).name.endswith("c2-......")


@pytest.mark.parametrize("config", _sm90_configs())
def test_hopper_forward_wgmma_not_serialized(config, tmp_path):
    """ptxas keeps the Hopper forward's wgmmas asynchronous: its C7512 warning (serialized for
    want of registers) cost d 128 a quarter of its speed once (docs/tuning/hopper-forward.md, Hopper step 4).
    Needs a ptxas (CUDA toolkit) on the machine."""
    from cute_flash.tools.resources import find_ptxas, ptxas_report

    if find_ptxas() is None:
        pytest.skip("no ptxas on this machine")
    build(config, 90, f"--keep-ptx --dump-dir={tmp_path}")
    (ptx,) = tmp_path.glob("*.ptx")
    report = ptxas_report(str(ptx), 90)
    assert report.get("registers"), "ptxas gave no resource report"
    assert not report.get("wgmma_serialized")


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_backward_128_query_rows_wgmma_not_serialized(causal, tmp_path):
    """d 64 on 128 x 128 tiles (flash-attn-4's): S^T and dP^T take 64 registers each, and with
    dK's A from registers ptxas serialized the wgmmas (C7512); dK reads dS^T from its
    shared-memory tile there (`layouts.hopper.bwd_dk_reads_smem`). Needs a ptxas."""
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.tools.resources import find_ptxas, ptxas_report
    from layouts.traits import BwdTraits

    if find_ptxas() is None:
        pytest.skip("no ptxas on this machine")
    traits = BwdTraits(64, 128, 128, 8, 4, 4, 4)
    assert hopper.bwd_dk_reads_smem(traits) and not hopper.bwd_dk_reads_smem(hopper.choose_hopper_bwd_traits(64))
    build(Sm90BwdConfig(traits, has_right=causal, dq_path="writer"), 90, f"--keep-ptx --dump-dir={tmp_path}")
    (ptx,) = tmp_path.glob("*.ptx")
    report = ptxas_report(str(ptx), 90)
    assert report.get("registers"), "ptxas gave no resource report"
    assert not report.get("wgmma_serialized")


@pytest.mark.parametrize("config", sm90_bwd_variants(), ids=lambda c: c.name)
def test_hopper_backward_compiles_to_wgmma(config, tmp_path):
    """The Hopper backward (the sm_90 default backward) and its dQ convert build for sm_90a and
    fit in shared memory. The main kernel's five GEMMs are wgmma, one per 16-wide k step: S^T
    over the head dim and dP^T over V's (`dv`), dV and dK over the query block (on the 96-key
    tiles dV^T and dK^T, one per 64 head-dim rows too), dQ over the block's keys. With dropout
    each Philox call's four words are decided by four bf16x2 compares (to masks,
    `Dropout.pair_keep_bits`; on the 96-key tiles to predicates, `keep_pair`). Deterministic
    variants order dQ's adds with an acquire load and a release add (`DqTurn`), the others have
    neither; those that hand dQ to writer warps (deterministic, `dq_path` "writer") meet them at
    160-thread barriers (a warpgroup and its writer warp), the others have none; the "atomic" dQ
    path adds with vector atomics and no bulk reduce, the others the reverse. On the 96-key
    tiles P and dS reach shared memory as pairs of keys, in 32-bit stores."""
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig

    assert config.smem_bytes <= SMEM_LIMIT[90]
    build(config, 90, f"--keep-ptx --dump-dir={tmp_path}")
    _assert_one_kernel_for(90, tmp_path)
    if isinstance(config, Sm90BwdConfig):
        t = config.traits
        (ptx,) = tmp_path.glob("*.ptx")
        text = ptx.read_text()
        dkv = 2 * t.block_m // 16  # dV and dK: a k step each 16 queries
        if hopper.bwd_keys_on_n(t):  # dV^T and dK^T: a k step each 16 queries each 64 head-dim rows
            dkv = (t.head_dim + t.dv) // hopper.WGMMA_M * t.block_m // 16
        assert text.count("wgmma.mma_async") == (t.head_dim + t.dv) // 16 + dkv + t.block_n // 16
        if hopper.bwd_keys_on_n(t):  # a thread's share of P and of dS, two keys a store
            assert text.count("st.shared.b32") >= t.block_m * t.block_n // (128 * hopper.bwd_warpgroups(t))
        compares = text.count("set.lt.u32.bf16x2") + text.count("setp.lt.bf16x2")  # `keep_halves`, `keep_pair`
        assert (compares > 0) == config.has_dropout and compares % 4 == 0
        # deterministic: each warpgroup's first thread spins on its tile's count, then counts its adds
        assert ("ld.acquire.gpu.global" in text) == ("atom.global.release.add" in text) == config.deterministic
        assert bool(re.search(r"bar\.(sync|arrive)\s+\S+, 160;", text)) == config.writes_dq_apart
        assert ("cp.reduce.async.bulk" in text) == config.stages_dq
        assert ("red.relaxed.gpu.global.add.v4.f32" in text) != config.stages_dq


@pytest.mark.slow
@pytest.mark.parametrize("config", sm90_bwd_variants(True), ids=lambda c: c.name)
def test_hopper_backward_full_sweep(config, tmp_path):
    build(config, 90, f"--keep-ptx --dump-dir={tmp_path}")
    _assert_one_kernel_for(90, tmp_path)


@pytest.mark.parametrize("config", order_variants(), ids=lambda c: c.name)
def test_launch_order_kernel_compiles(config, tmp_path):
    """The packed batches' launch-order kernel (kernels/common/varlen_order.py), for the Hopper
    kernels that read its list: its key sort in shared memory behind barriers."""
    _compile(90, config, tmp_path)
    text = next(tmp_path.glob("*.ptx")).read_text()
    assert "bar.sync" in text and "st.shared.b64" in text and "shfl.sync.up" in text


@pytest.mark.parametrize("arch", [80, 90])
def test_race_canary_compiles_with_shared_memory_accesses(arch, tmp_path):
    """racecheck's canary (`tools/canaries.py`, "race"): one kernel, named as ours, whose
    shared-memory store and load survive compilation (nothing for racecheck to see otherwise)."""
    compile_canary("race", arch, f"--keep-ptx --dump-dir={tmp_path}")
    _assert_one_kernel_for(arch, tmp_path)
    text = next(tmp_path.glob("*.ptx")).read_text()
    assert "st.shared" in text and "ld.shared" in text and "bar.sync" not in text


@pytest.mark.parametrize("arch", [80, 90])
def test_overrun_canary_compiles_with_its_global_store(arch, tmp_path):
    """memcheck's canary (`tools/canaries.py`, "overrun"): one kernel, named as ours, whose global
    store past the tensor's end survives compilation (nothing for memcheck to see otherwise)."""
    compile_canary("overrun", arch, f"--keep-ptx --dump-dir={tmp_path}")
    _assert_one_kernel_for(arch, tmp_path)
    assert "st.global" in next(tmp_path.glob("*.ptx")).read_text()


def _alibi_configs():
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from layouts.hopper import choose_hopper_bwd_traits, choose_hopper_traits
    from layouts.traits import choose_fwd_traits

    return [pytest.param(90, Sm90FwdConfig(choose_hopper_traits(128), has_alibi=True, has_right=True),
                         id="sm90-fwd-causal"),
            pytest.param(90, Sm90BwdConfig(choose_hopper_bwd_traits(128), has_alibi=True), id="sm90-bwd"),
            pytest.param(80, FwdConfig(choose_fwd_traits(128, "bf16", 80), has_alibi=True), id="sm80-fwd")]


@pytest.mark.parametrize("arch, config", _alibi_configs())
def test_alibi_converts_coordinates_per_tile_not_per_score(arch, config, tmp_path):
    """ALiBi's distance is fp32 math on one converted (row, column) per thread
    (`score_mods.apply_alibi`): int-to-float conversions at most an eighth of the exponentials
    (one per score converted 132-192 a kernel, against 196-200 exponentials)."""
    build(config, arch, f"--keep-ptx --dump-dir={tmp_path}")
    (ptx,) = tmp_path.glob("*.ptx")
    text = ptx.read_text()
    exps = text.count("ex2.approx")
    assert exps > 0 and text.count("cvt.rn.f32.s32") * 8 <= exps


def _softcap_mod_configs():
    from cute_flash import mods
    from cute_flash.kernels.common.user_mods import UserMod, UserMods
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from layouts.hopper import choose_hopper_bwd_traits, choose_hopper_traits
    from layouts.traits import choose_bwd_traits, choose_fwd_traits

    spec = mods.softcap(30.0)
    fwd = UserMods(UserMod.of(spec.score_mod))
    bwd = UserMods(UserMod.of(spec.score_mod), score_mod_bwd=UserMod.of(spec.score_mod_bwd))
    return [pytest.param(90, Sm90FwdConfig(choose_hopper_traits(128), mods=fwd), id="sm90-fwd"),
            pytest.param(90, Sm90BwdConfig(choose_hopper_bwd_traits(128), mods=bwd), id="sm90-bwd"),
            pytest.param(80, FwdConfig(choose_fwd_traits(128, "bf16", 80), mods=fwd), id="sm80-fwd"),
            pytest.param(80, BwdConfig(choose_bwd_traits(128, "bf16", 80), mods=bwd), id="sm80-bwd")]


@pytest.mark.parametrize("arch, config", _softcap_mod_configs())
def test_the_softcap_mod_takes_the_fast_tanh_and_no_division(arch, config, tmp_path):
    """`mods.softcap` as the built-in softcap runs it: tanh.approx (one MUFU op) on the score
    times 1 / cap; the precise tanh and a division per score tripled the forward's instructions."""
    build(config, arch, f"--keep-ptx --dump-dir={tmp_path}")
    (ptx,) = tmp_path.glob("*.ptx")
    text = ptx.read_text()
    assert "tanh.approx.f32" in text and "div.rn.f32" not in text
