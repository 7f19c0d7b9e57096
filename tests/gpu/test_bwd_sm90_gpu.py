"""The Hopper backward (kernels/sm90/bwd.py, the default for dense and packed backwards on
sm_90) up to d 128 (above it: test_bwd_sm90_wide_gpu.py) against `cute_flash.reference` under
float32 autograd, by the backward's rule (tests/helpers/backward.py), with the allocator
poisoned first. Each test also checks that every backward it ran took the Hopper kernel: a
silent fall back to the SM80 kernel would pass the comparison."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_flash import flash_attn_func
from tests.helpers.backward import (VARLEN_MOD_IDS, VARLEN_MODS, assert_grads_match, check_bitwise_repeatable,
                                    check_dropout_grads, check_private_backward, check_score_modifiers,
                                    check_varlen_bitwise_repeatable, check_varlen_grads,
                                    check_varlen_nan_stays_in_its_sequence, check_varlen_score_modifiers, heads,
                                    inputs, lengths, ours, varlen_lengths)
from tests.helpers.gpu_utils import gpu_settings, only_the_hopper_kernel

pytestmark = pytest.mark.gpu

# head dims whose bucket (32, 64, 96, 128) the Hopper backward takes, each on tiles of its own
hopper_dims = st.one_of(st.sampled_from([32, 64, 96, 128]), st.integers(1, 128))


@pytest.fixture(autouse=True)
def hopper_path(monkeypatch, kernels):
    with only_the_hopper_kernel(monkeypatch, kernels, "bwd", "backwards"):
        yield


def test_private_backward_writes_given_tensors_and_returns_softmax_d():
    """tests/gpu/test_bwd_gpu.py's test of the private backward, here on the Hopper kernel (d 64)."""
    check_private_backward()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@gpu_settings(10)
@given(rng=st.random_module(), b=st.integers(1, 2), sq=lengths, sk=lengths, hh=heads, d=hopper_dims,
       layout=st.sampled_from(["bshd", "bhsd"]))
def test_dense_grads_match_reference(rng, b, sq, sk, hh, d, causal, dtype, layout):
    q, k, v, dout = inputs(b, sq, sk, *hh, d, dtype, layout)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)


@pytest.mark.parametrize("d", [32, 64, 128, 8, 40, 96, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_on_many_blocks(d, causal):
    """More key-block CTAs than SMs and up to 16 query blocks per CTA: both pipelines' stages
    and phases wrap several times; sq > sk leaves causal key blocks with no query row."""
    q, k, v, dout = inputs(3, 1000, 700, 12, 4, d)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)


MODS = ["window", "alibi", "softcap", "all"]


@pytest.mark.parametrize("mod", MODS)
@gpu_settings(8)
@given(rng=st.random_module(), sq=lengths, sk=lengths, hh=heads, d=st.sampled_from([32, 64, 96, 128, 100]),
       data=st.data())
def test_score_modifiers_with_gqa(rng, mod, sq, sk, hh, d, data):
    """Window (both edges drawn), ALiBi, softcap (the tanh derivative), and all together, on
    the transposed S tile, with GQA and odd lengths."""
    check_score_modifiers(mod, sq, sk, hh, d, data)


@pytest.mark.parametrize("d, sq, sk, opts", [
    (32, 300, 1000, dict(causal=True)),                         # 128-row query blocks
    (64, 700, 333, {}),
    (128, 1000, 700, dict(causal=True)),                        # several key blocks per SM, rows with no key
    (100, 257, 400, dict(window_size=(100, 20), softcap=15.0)),
    (96, 500, 900, dict(causal=True)),                          # 48 dQ columns a warpgroup
], ids=["d32-causal", "d64", "d128-causal-sq>sk", "d100-window-softcap", "d96-causal"])
def test_dropout_grads_match_reference_with_the_philox_mask(d, sq, sk, opts):
    """Dropout in the Hopper backward (`Dropout.pair_keep_bits`: lanes t and t ^ 4 split the
    Philox calls and swap keep bits): dq, dk, dv against the reference's autograd with the mask
    `philox.keep_mask` draws for the forward's seed and offset; a wrong bit, word or partner in
    any element moves a gradient far past the rule."""
    check_dropout_grads(d, sq, sk, (12, 4), opts)


# tests/gpu/test_bwd_gpu.py's packed-batch tests, here on the Hopper kernel (`call_varlen`)
@pytest.mark.parametrize("causal", [False, True])
@gpu_settings(8)
@given(rng=st.random_module(), lens=varlen_lengths, hh=heads, d=hopper_dims, used=st.booleans())
def test_varlen_grads_match_reference(rng, lens, hh, d, causal, used):
    check_varlen_grads(lens, hh, d, causal, used)


@pytest.mark.parametrize("opts", VARLEN_MODS, ids=VARLEN_MOD_IDS)
def test_varlen_grads_with_score_modifiers(opts):
    check_varlen_score_modifiers(opts)


def test_varlen_long_and_short_sequences():
    """One sequence of 3000 rows beside short ones, causal, GQA: key-block CTAs past a short
    sequence's keys walk nothing, and the long one's pipelines wrap many times."""
    check_varlen_grads([(3000, 3000), (5, 200), (130, 1), (64, 64)], (8, 2), 128, True, False)


def test_varlen_a_sequences_nan_stays_in_it():
    check_varlen_nan_stays_in_its_sequence()


@pytest.mark.parametrize("d", [128, 96])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(300, 40), softcap=10.0), {}],
                         ids=["causal", "window-softcap", "none"])
def test_deterministic_grads_are_bitwise_repeatable(opts, d):
    """deterministic=True on the Hopper kernel (`DqTurn`: dQ's adds in key-block order): three
    runs equal bit for bit and within the rule, with 16 key blocks adding into each query tile,
    GQA, and a left window edge (its key blocks counted from the tile's first, not 0)."""
    q, k, v, dout = inputs(2, 1000, 2000, 8, 2, d)
    check_bitwise_repeatable(flash_attn_func, dout, q, k, v, **opts)


def test_varlen_deterministic_grads_are_bitwise_repeatable():
    """Packed batches, deterministic, with a window: equal bit for bit over three runs, and the
    reference rule per sequence."""
    check_varlen_bitwise_repeatable(64)
