"""The Hopper backward (kernels/bwd_sm90.py, the default for dense backwards on sm_90 at head
dims up to 64 and 97..128) against `cute_flash.reference` under float32 autograd, by
test_bwd_gpu's rule, with the allocator poisoned first. Each test also checks that every
backward it ran took the Hopper kernel: a silent fall back to the SM80 kernel would pass the
comparison."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_flash import flash_attn_func
from tests.gpu_utils import gpu_settings
from tests.test_bwd_gpu import _inputs, assert_grads_match, check_score_modifiers, heads, lengths, ours
# The private backward's test (d 64: the Hopper kernel), collected here again under this module's fixture.
from tests.test_bwd_gpu import test_private_backward_writes_given_tensors_and_returns_softmax_d  # noqa: F401

pytestmark = pytest.mark.gpu

# head dims whose bucket (32, 64, 128) the Hopper backward takes
hopper_dims = st.one_of(st.sampled_from([32, 64, 128]), st.integers(1, 64), st.integers(97, 128))


@pytest.fixture(autouse=True)
def hopper_path(monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper kernel is sm_90a")
    from cute_flash.launch import backward

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)  # the default path
    taken = []
    route = backward.takes_hopper_bwd

    def recording(*args):
        taken.append(route(*args))
        return taken[-1]

    monkeypatch.setattr(backward, "takes_hopper_bwd", recording)
    yield
    assert taken and all(taken), f"a backward took the SM80 kernel ({taken.count(False)} of {len(taken)})"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@gpu_settings(10)
@given(b=st.integers(1, 2), sq=lengths, sk=lengths, hh=heads, d=hopper_dims,
       layout=st.sampled_from(["bshd", "bhsd"]))
def test_dense_grads_match_reference(b, sq, sk, hh, d, causal, dtype, layout):
    q, k, v, dout = _inputs(b, sq, sk, *hh, d, dtype, layout)
    _, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, causal=causal)


@pytest.mark.parametrize("d", [32, 64, 128, 8, 40, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_on_many_blocks(d, causal):
    """More key-block CTAs than SMs and up to 16 query blocks per CTA: both pipelines' stages
    and phases wrap several times; sq > sk leaves causal key blocks with no query row."""
    q, k, v, dout = _inputs(3, 1000, 700, 12, 4, d)
    _, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, causal=causal)


MODS = ["window", "alibi", "softcap", "all"]


@pytest.mark.parametrize("mod", MODS)
@gpu_settings(8)
@given(sq=lengths, sk=lengths, hh=heads, d=st.sampled_from([32, 64, 128, 100]), data=st.data())
def test_score_modifiers_with_gqa(mod, sq, sk, hh, d, data):
    """Window (both edges drawn), ALiBi, softcap (the tanh derivative), and all together, on
    the transposed S tile, with GQA and odd lengths."""
    check_score_modifiers(mod, sq, sk, hh, d, data)
