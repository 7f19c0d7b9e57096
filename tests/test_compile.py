"""Every kernel variant the dispatcher can choose compiles for sm_80 and sm_90a, with no GPU.

CI compiles a covering subset (each shipped traits once, each flag combination once); the full
traits x flags sweep is marked slow: `pytest -m slow tests/test_compile.py`.
"""
import pytest

pytest.importorskip("cutlass")

from cute_flash.kernels.fwd import ALL_FLAG_NAMES, FLAG_NAMES, FlashFwd, compile_fwd, fwd_variants  # noqa: E402
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


def test_subset_covers_every_traits_and_every_flag_combination():
    for arch in (80, 90):
        assert {t for t, _ in fwd_variants(arch)} == set(shipped_fwd_traits(arch))
    assert len({tuple(f[n] for n in FLAG_NAMES) for _, f in fwd_variants(90)}) == 2 ** len(FLAG_NAMES)
    for arch in (80, 90):
        assert any(f.get("varlen") and f.get("has_seqused_k") for _, f in fwd_variants(arch))


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
        opt = f"--gpu-arch=sm_{arch}{'a' if arch >= 90 else ''}"
        assert cute.compile(TileRoundTrip(traits, operand), x, y, make_fake_stream(), options=opt) is not None
