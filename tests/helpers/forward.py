"""The forward's shape tests on the GPU, shared by tests/gpu/test_fwd_gpu.py (the SM80 kernel)
and tests/gpu/test_fwd_sm90_gpu.py (the Hopper kernel, the sm_90 default): inputs, a poisoned
run through the public `flash_attn_func`, and the dense and head-dim tests' cases and bodies.
Each module defines the tests with these cases under its own path fixture."""
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.helpers.gpu_utils import assert_matches_reference, gpu_settings, poison_allocator

ODD_LENGTHS = [1, 2, 17, 63, 64, 65, 113, 128, 255, 256, 257, 1023]
BUCKETS = [32, 64, 96, 128, 160, 192, 224, 256]
GPU_SETTINGS = gpu_settings(20)

lengths = st.one_of(st.sampled_from(ODD_LENGTHS), st.integers(1, 700))
head_dims = st.one_of(st.sampled_from(BUCKETS), st.integers(1, 256))
heads = st.sampled_from([(1, 1), (2, 2), (4, 1), (4, 2), (6, 3), (8, 1)])


def run_forward(q, k, v, **opts):
    """out and LSE of `flash_attn_func`, the allocator poisoned first."""
    from cute_flash import flash_attn_func

    poison_allocator()
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    torch.cuda.synchronize()
    return out, lse


def inputs(b, sq, sk, h, hk, d, dtype, layout="bshd"):
    """q, k, v on the GPU; layout "bhsd": (b, h, s, d) storage viewed as (b, s, h, d)."""
    def make(s, heads):
        if layout == "bhsd":  # (b, h, s, d) storage viewed as (b, s, h, d): strided, read in place
            return torch.randn(b, heads, s, d, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(b, s, heads, d, device="cuda", dtype=dtype)

    return make(sq, h), make(sk, hk), make(sk, hk)


def dense_cases(test):
    """The dense shape test's cases: dtype and causal parametrized outside hypothesis, so that
    pytest-xdist can spread the drawn cases (and their kernel compilations) over workers."""
    drawn = given(rng=st.random_module(), b=st.integers(1, 3), sq=lengths, sk=lengths, hh=heads, d=head_dims,
                  layout=st.sampled_from(["bshd", "bhsd"]))
    test = GPU_SETTINGS(drawn(test))
    test = pytest.mark.parametrize("causal", [False, True])(test)
    return pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])(test)


def check_dense_matches_reference(b, sq, sk, hh, d, causal, dtype, layout):
    # A few output elements at least: with one, the low-precision reference can land on the
    # float32 one and leave a bar below half a step of the dtype (a flake, docs/semantics.md)
    assume(b * sq * hh[0] * d >= 16)
    q, k, v = inputs(b, sq, sk, *hh, d, dtype, layout)
    out, lse = run_forward(q, k, v, causal=causal)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


def head_dim_cases(test):
    """Every head-dim bucket and dims between them, causal or not."""
    test = pytest.mark.parametrize("causal", [False, True])(test)
    return pytest.mark.parametrize("d", BUCKETS + [8, 40, 72, 100, 136, 200, 250])(test)


def check_every_head_dim_bucket(d, causal):
    q, k, v = inputs(2, 200, 333, 4, 2, d, torch.bfloat16)
    out, lse = run_forward(q, k, v, causal=causal)
    assert_matches_reference(out, lse, q, k, v, causal=causal)
