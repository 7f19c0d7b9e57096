"""The SM80 forward kernel against `cute_flash.reference` on the GPU (issues: forward kernel, score
modifiers). Shapes are drawn by hypothesis; every output is checked by the criterion of docs/semantics.md on
fresh inputs with the allocator poisoned first. On sm_90 GPUs, where dense forwards default to
the Hopper kernel, this module selects the SM80 kernel (`CUTE_FLASH_ARCH_PATH=sm80`, the path of
every sm_80/86/89 GPU); tests/gpu/test_fwd_sm90_gpu.py runs the same shape tests on the Hopper one."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.forward import (GPU_SETTINGS, check_dense_matches_reference, check_every_head_dim_bucket,
                                   dense_cases, head_dim_cases, heads, inputs, lengths, run_forward)
from tests.helpers.gpu_utils import assert_matches_reference, on_path, poison_allocator

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def sm80_path(monkeypatch, kernels):
    """Every test here on the SM80 forward, and only on it (no silent fall back either way)."""
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    yield
    assert kernels == on_path("sm80", "fwd"), kernels


@dense_cases
def test_dense_matches_reference(rng, b, sq, sk, hh, d, causal, dtype, layout):
    check_dense_matches_reference(b, sq, sk, hh, d, causal, dtype, layout)


@head_dim_cases
def test_every_head_dim_bucket(d, causal):
    check_every_head_dim_bucket(d, causal)


@pytest.mark.parametrize("d", [224, 256])
def test_small_shared_memory_tiles(d):
    """The forward tiles chosen for 99 KB of shared memory per block (sm_86, sm_89: 64 x 64, 4
    warps, where sm_80's 128 x 64 do not fit), run here by the same SM80 kernel."""
    from cute_flash.launch.dense import flash_fwd
    from layouts.traits import SMEM_LIMIT, choose_fwd_traits

    traits = choose_fwd_traits(d, "bf16", 86)
    assert traits.smem_bytes <= SMEM_LIMIT[86] < choose_fwd_traits(d, "bf16", 80).smem_bytes
    q, k, v = inputs(2, 300, 333, 4, 2, d, torch.bfloat16)
    poison_allocator()
    out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, causal=True, traits=traits)
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, q, k, v, causal=True)


def test_packed_qkv_is_read_in_place():
    from cute_flash import flash_attn_qkvpacked_func

    qkv = torch.randn(2, 300, 3, 4, 64, device="cuda", dtype=torch.float16)
    poison_allocator()
    out, lse, _ = flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    q, k, v = qkv.unbind(2)
    assert_matches_reference(out, lse, q, k, v, causal=True)


def test_custom_scale_and_deterministic_rerun():
    q, k, v = inputs(2, 511, 777, 8, 2, 128, torch.bfloat16)
    out1, lse1 = run_forward(q, k, v, softmax_scale=0.3, causal=True)
    out2, lse2 = run_forward(q, k, v, softmax_scale=0.3, causal=True)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    assert_matches_reference(out1, lse1, q, k, v, softmax_scale=0.3, causal=True)


def test_rows_without_keys_give_zero_and_inf_lse():
    q, k, v = inputs(1, 300, 40, 2, 2, 64, torch.float16)  # causal, sq > sk: 260 rows see nothing
    out, lse = run_forward(q, k, v, causal=True)
    assert (out[:, :260] == 0).all() and (lse[:, :, :260] == float("inf")).all()
    assert_matches_reference(out, lse, q, k, v, causal=True)


# --- score modifiers: window, ALiBi, softcap ---------------------------------------------------

windows = st.one_of(
    st.just((-1, -1)),
    st.tuples(st.integers(-1, 300), st.integers(-1, 300)),
    st.tuples(st.just(0), st.integers(-1, 50)),           # zero width on one side
    st.tuples(st.integers(-1, 50), st.just(0)),
    st.tuples(st.integers(2000, 5000), st.integers(2000, 5000)),  # wider than the sequence
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("alibi", [None, "h", "bh"])
@GPU_SETTINGS
@given(rng=st.random_module(), b=st.integers(1, 2), sq=lengths, sk=lengths, hh=heads,
       d=st.sampled_from([32, 64, 80, 128, 256]), window=windows, softcap=st.sampled_from([0.0, 5.0, 30.0]))
def test_modifiers_match_reference(rng, b, sq, sk, hh, d, causal, window, alibi, softcap, dtype):
    h = hh[0]
    q, k, v = inputs(b, sq, sk, *hh, d, dtype)
    slopes = None
    if alibi:
        shape = (h,) if alibi == "h" else (b, h)
        slopes = torch.rand(shape, device="cuda", dtype=torch.float32) * 0.5
    opts = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    out, lse = run_forward(q, k, v, **opts)
    assert_matches_reference(out, lse, q, k, v, **opts)


def test_window_leaving_rows_without_keys():
    # window (0, 0) with sq > sk: only rows whose diagonal lands on a key see exactly that key
    q, k, v = inputs(1, 200, 50, 2, 1, 64, torch.bfloat16)
    out, lse = run_forward(q, k, v, window_size=(0, 0))
    assert (lse[:, :, :150] == float("inf")).all() and (out[:, :150] == 0).all()
    assert_matches_reference(out, lse, q, k, v, window_size=(0, 0))
