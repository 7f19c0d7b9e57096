"""Every kernel variant the dispatcher can choose compiles for sm_80 and sm_90a, with no GPU.

CI compiles a covering subset (every head-dim bucket of both kernels on both archs, each flag
on and off, the append kernel; the split-KV combine is part of every split kernel, compiled for
every head-dim bucket); the full traits x flags sweep is marked slow:
`pytest -m slow tests/test_compile.py`.
"""
import pytest

pytest.importorskip("cutlass")

from cute_flash.kernels.fwd import ALL_FLAG_NAMES, FLAG_NAMES, FlashFwd, compile_fwd, fwd_variants  # noqa: E402
from cute_flash.kernels.fake import arch_option  # noqa: E402
from cute_flash.kernels.roundtrip import OPERANDS, TileRoundTrip  # noqa: E402
from layouts.traits import SMEM_LIMIT, shipped_fwd_traits  # noqa: E402


def _id(arch, traits, flags):
    return f"sm{arch}-{traits.name}-" + "".join(str(int(flags.get(n, False))) for n in ALL_FLAG_NAMES)


def _cases(full):
    return [pytest.param(arch, t, f, id=_id(arch, t, f)) for arch in (80, 90) for t, f in fwd_variants(arch, full)]


def _compile(arch, traits, flags):
    assert traits.smem_bytes <= SMEM_LIMIT[arch]
    compiled = compile_fwd(FlashFwd(traits, **flags), arch)
    assert compiled is not None


@pytest.mark.parametrize("arch, traits, flags", _cases(full=False))
def test_fwd_variant_compiles(arch, traits, flags):
    _compile(arch, traits, flags)


@pytest.mark.slow
@pytest.mark.parametrize("arch, traits, flags", _cases(full=True))
def test_fwd_variant_compiles_full_sweep(arch, traits, flags):
    _compile(arch, traits, flags)


def test_subset_covers_every_traits_and_every_flag():
    covered = {t for arch in (80, 90) for t, _ in fwd_variants(arch)}
    assert covered == set(shipped_fwd_traits(80)) | set(shipped_fwd_traits(90))
    for arch in (80, 90):  # every head-dim bucket of both kernels on both archs
        assert {(t.head_dim, t.block_m, t.block_n) for t, _ in fwd_variants(arch)} == {
            (t.head_dim, t.block_m, t.block_n) for t in shipped_fwd_traits(arch)}
        assert any(f.get("varlen") and f.get("has_seqused_k") for _, f in fwd_variants(arch))
        assert any(f.get("varlen") and f.get("paged") for _, f in fwd_variants(arch))
        assert any(f.get("varlen") and f.get("any_page_size") for _, f in fwd_variants(arch))
    flags = [f for _, f in fwd_variants(90)]
    for name in FLAG_NAMES + ("paged", "split", "has_leftpad", "has_batch_idx", "pack_gqa", "any_page_size"):
        assert {f.get(name, False) for f in flags} == {False, True}, name
    assert any(all(f.get(n, n == "even_k") != (n == "even_k") for n in FLAG_NAMES) for f in flags)  # all on
    assert any(f.get("kvcache") and f.get("paged") and f.get("split") for f in flags)
    assert any(f.get("kvcache") and f.get("any_page_size") and f.get("split") for f in flags)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("paged, batch_idx, rotary, interleaved, q_per_row", [
    (False, False, False, False, False), (False, True, True, True, False), (True, False, True, False, True),
])
def test_append_kernel_compiles(arch, paged, batch_idx, rotary, interleaved, q_per_row):
    import cutlass

    from cute_flash.kernels.append import AppendKV, compile_append

    kernel = AppendKV(cutlass.Float16, paged, batch_idx, rotary, interleaved, q_per_row)
    assert compile_append(kernel, arch) is not None


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("operand", OPERANDS)
def test_roundtrip_kernel_compiles(arch, operand):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    shipped = shipped_fwd_traits(arch)
    for traits in (shipped[0], shipped[len(shipped) // 2], shipped[-1]):
        el = cutlass.BFloat16 if traits.dtype == "bf16" else cutlass.Float16
        x, y = (make_fake_compact_tensor(el, (cute.sym_int(), traits.head_dim), stride_order=(1, 0),
                                         assumed_align=16) for _ in range(2))
        opt = arch_option(arch)
        assert cute.compile(TileRoundTrip(traits, operand), x, y, make_fake_stream(), options=opt) is not None
