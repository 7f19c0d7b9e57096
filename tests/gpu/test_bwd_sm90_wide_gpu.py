"""The Hopper backward above d 128 (kernels/sm90/bwd.py, `layouts.hopper.bwd_splits_head_dim`:
64 keys a CTA, the two consumer warpgroups splitting the head dim, P^T and dS^T through shared
memory, Q and dO one stage at d 256; the bucket 160 on the d 192 tiles, 224 on the d 256 ones;
d 192 on 96-key tiles with one dO stage, and MLA's q / k 192 with v 128 at V's own width on
96-key tiles, as in test_bwd_sm90_keys96_gpu.py)
against `cute_flash.reference` by the backward's rule (tests/helpers/backward.py). Each test
also checks that every backward it ran took the Hopper kernel."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_flash import flash_attn_func
from tests.helpers.backward import (assert_grads_match, check_bitwise_repeatable, check_dropout_grads,
                                    check_score_modifiers, check_varlen_bitwise_repeatable, check_varlen_grads, inputs,
                                    ours)
from tests.helpers.gpu_utils import config_lookups, gpu_settings, only_the_hopper_kernel

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hopper_path(monkeypatch, kernels):
    with only_the_hopper_kernel(monkeypatch, kernels, "bwd", "backwards"):
        yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [256, 192, 160, 224, 200, 129])
def test_dense_grads_match_reference(d, causal, dtype):
    """Every bucket the wide tiles serve, GQA 6:2, odd lengths (sq < sk: causal rows see a
    shifted diagonal)."""
    q, k, v, dout = inputs(2, 333, 517, 6, 2, d, dtype)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)


@pytest.mark.parametrize("d", [256, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_many_blocks(d, causal):
    """More CTAs than SMs and up to 16 query blocks per CTA: the one-stage Q / dO pipelines and
    the two P^T / dS^T stages wrap many times; sq > sk leaves causal key blocks with no row."""
    q, k, v, dout = inputs(3, 1000, 700, 12, 4, d)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)


@pytest.mark.parametrize("mod", ["window", "alibi", "softcap", "all"])
@gpu_settings(4)
@given(rng=st.random_module(), sq=st.integers(1, 400), sk=st.integers(1, 400), d=st.sampled_from([256, 192, 176]),
       data=st.data())
def test_score_modifiers_with_gqa(rng, mod, sq, sk, d, data):
    check_score_modifiers(mod, sq, sk, (4, 2), d, data)


@pytest.mark.parametrize("d, sq, sk, opts", [
    (256, 1000, 700, dict(causal=True)),
    (192, 257, 400, dict(window_size=(100, 20), softcap=15.0)),
], ids=["d256-causal", "d192-window-softcap"])
def test_dropout_grads_match_reference_with_the_philox_mask(d, sq, sk, opts):
    """Dropout's keep bits on the S^T tile split by queries between the warpgroups
    (`Dropout.pair_keep_bits` on each warpgroup's 64 x block_m / 2 part)."""
    check_dropout_grads(d, sq, sk, (6, 2), opts)


@pytest.mark.parametrize("d", [256, 192])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("used", [False, True], ids=["", "seqused_k"])
def test_varlen_grads_match_reference(d, causal, used):
    """Packed batches: an empty sequence, one of a single key, one past a key block, GQA; dK
    and dV leave by row-predicated copies (warpgroup 0 dK, warpgroup 1 dV)."""
    check_varlen_grads([(0, 40), (77, 1), (300, 257), (130, 129), (1, 60)], (6, 2), d, causal, used)


def test_varlen_long_and_short_sequences():
    check_varlen_grads([(3000, 3000), (5, 200), (130, 1), (64, 64)], (8, 2), 256, True, False)


@pytest.mark.parametrize("d", [256, 192, 160])
def test_deterministic_grads_are_bitwise_repeatable(monkeypatch, d):
    """deterministic=True: dQ's adds in key-block order (`DqTurn`; d 256 on 64-key blocks with
    one Q / dO stage, d 160 / 192 on 96-key blocks with one dO stage), three runs equal bit for bit
    and within the rule."""
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig

    tiles = config_lookups(monkeypatch, Sm90BwdConfig,
                           lambda c: (c.deterministic, c.traits.block_n, c.traits.stages_do))
    q, k, v, dout = inputs(2, 1000, 1500, 8, 2, d)
    check_bitwise_repeatable(flash_attn_func, dout, q, k, v, causal=True)
    assert set(tiles) == {(True, 64, 1) if d == 256 else (True, 96, 1)}, tiles


@pytest.mark.parametrize("d", [256, 192])
def test_varlen_deterministic_grads_are_bitwise_repeatable(d):
    """Packed batches, deterministic, with a window: equal bit for bit over three runs, and the
    reference rule per sequence."""
    check_varlen_bitwise_repeatable(d)


@pytest.fixture
def mla_values(monkeypatch):
    """V's head dim (`traits.head_dim_v`) of every Hopper backward the test's calls looked up:
    MLA's 192 / 128 runs at V's own width, not padded to one head dim."""
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig

    seen = config_lookups(monkeypatch, Sm90BwdConfig, lambda config: config.traits.head_dim_v)
    yield
    assert seen and set(seen) == {128}, seen


MLA_MODS = [dict(causal=True), {}, dict(window_size=(100, 20), softcap=15.0), dict(causal=True, alibi=True)]
MLA_MOD_IDS = ["causal", "none", "window-softcap", "causal-alibi"]


@pytest.mark.parametrize("opts", MLA_MODS, ids=MLA_MOD_IDS)
def test_mla_backward_with_score_modifiers(mla_values, opts):
    """MLA's q / k 192 with v 128 (`BwdTraits.head_dim_v`: V, dO and dV 128 wide; dV^T 128
    rows and dK^T 192 on the 96-key tiles), GQA 6:2, odd lengths, each modifier."""
    q, k, v, dout = inputs(2, 333, 517, 6, 2, 192, d_v=128)
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(2, 6, device="cuda", dtype=torch.float32)
    out, grads = ours(flash_attn_func, dout, q, k, v, **opts)
    assert out.shape[-1] == 128 and [g.shape[-1] for g in grads] == [192, 192, 128]
    assert_grads_match(grads, q, k, v, dout, out=out, **opts)


@pytest.mark.parametrize("causal", [False, True])
def test_mla_many_blocks(mla_values, causal):
    """More CTAs than SMs and 16 query blocks a CTA: dO's 128-column stages wrap many times."""
    q, k, v, dout = inputs(3, 1000, 700, 12, 4, 192, d_v=128)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)


def test_mla_dropout_grads_match_reference_with_the_philox_mask(mla_values):
    check_dropout_grads(192, 257, 400, (6, 2), dict(causal=True), d_v=128)


@pytest.mark.parametrize("used", [False, True], ids=["", "seqused_k"])
def test_mla_varlen_grads_match_reference(mla_values, used):
    """Packed: V's and dO's rows of the next sequence cleared at 128 columns, dV copied out 128
    wide by warpgroup 1."""
    check_varlen_grads([(0, 40), (77, 1), (300, 257), (130, 129), (1, 60)], (6, 2), 192, True, used, d_v=128)


def test_mla_deterministic_grads_are_bitwise_repeatable(mla_values):
    q, k, v, dout = inputs(2, 1000, 1500, 8, 2, 192, d_v=128)
    check_bitwise_repeatable(flash_attn_func, dout, q, k, v, causal=True)
