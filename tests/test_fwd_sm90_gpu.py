"""The Hopper forward (kernels/fwd_sm90.py, opt-in with CUTE_FLASH_ARCH_PATH=sm90) against
`cute_flash.reference` on an sm_90 GPU, through the public `flash_attn_func`, by the criterion
of docs/semantics.md with the allocator poisoned first. Each test also checks that the Hopper
kernel ran: a silent fall back to the SM80 kernel would pass the comparison."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.gpu_utils import assert_matches_reference
from tests.test_fwd_gpu import BUCKETS, GPU_SETTINGS, _inputs, _run, head_dims, heads, lengths

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hopper_path(monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper kernel is sm_90a")
    from cute_flash.launch import compiled

    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    calls = compiled.sm90_kernel_for.cache_info()
    yield
    after = compiled.sm90_kernel_for.cache_info()
    assert after.hits + after.misses > calls.hits + calls.misses, "the Hopper kernel did not run"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@GPU_SETTINGS
@given(b=st.integers(1, 3), sq=lengths, sk=lengths, hh=heads, d=head_dims,
       layout=st.sampled_from(["bshd", "bhsd"]))
def test_dense_matches_reference(b, sq, sk, hh, d, causal, dtype, layout):
    q, k, v = _inputs(b, sq, sk, *hh, d, dtype, layout)
    out, lse = _run(q, k, v, causal=causal)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("d", BUCKETS + [8, 40, 100, 200])
@pytest.mark.parametrize("causal", [False, True])
def test_every_head_dim_bucket(d, causal):
    q, k, v = _inputs(2, 200, 333, 4, 2, d, torch.bfloat16)
    out, lse = _run(q, k, v, causal=causal)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("opts", [dict(window_size=(64, 0)), dict(window_size=(100, 37)),
                                  dict(softcap=30.0), dict(causal=True, softcap=20.0, window_size=(200, 0))],
                         ids=["window-left", "window-both", "softcap", "causal-window-softcap"])
def test_score_modifiers_with_gqa(opts):
    q, k, v = _inputs(2, 300, 513, 8, 2, 128, torch.bfloat16)
    out, lse = _run(q, k, v, **opts)
    assert_matches_reference(out, lse, q, k, v, **opts)


def test_alibi_with_gqa():
    q, k, v = _inputs(2, 257, 400, 6, 3, 64, torch.float16)
    slopes = torch.rand(2, 6, device="cuda", dtype=torch.float32)
    out, lse = _run(q, k, v, causal=True, alibi_slopes=slopes)
    assert_matches_reference(out, lse, q, k, v, causal=True, alibi_slopes=slopes)
