"""The Hopper backward's 96-key tiles, MLA's q / k 192 with v 128 (`layouts.hopper.bwd_keys_on_n`:
S and dP with the queries on wgmma's M and each warpgroup's 48 keys on N, dK^T and dV^T with
the head dim on M, one P / dS stage, as the S accumulators lie: P under its warpgroup's
`P_READY` barrier, dS under the two warpgroups' `DS_FREE`) against `cute_flash.reference` by
the backward's rule (tests/helpers/backward.py). Each test asserts that every backward it ran
took the Hopper kernel on 96-key tiles."""
import operator

import cutlass.cute as cute
import pytest
import torch

from cute_flash import flash_attn_func, mods
from tests.helpers.backward import (assert_grads_match, check_bitwise_repeatable, check_dropout_grads,
                                    check_varlen_grads, inputs, ours)
from tests.helpers.gpu_utils import config_lookups, only_the_hopper_kernel

pytestmark = pytest.mark.gpu

D, D_V = 192, 128


@pytest.fixture(autouse=True)
def keys_on_n(monkeypatch, kernels):
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig

    with only_the_hopper_kernel(monkeypatch, kernels, "bwd", "backwards"):
        seen = config_lookups(monkeypatch, Sm90BwdConfig, lambda config: config.traits.block_n)
        yield
    assert seen and set(seen) == {96}, f"key blocks of the backwards that ran: {seen}"


@pytest.mark.parametrize("causal", [False, True])
def test_dense_grads_match_reference(causal):
    """GQA 6:2, odd lengths: 517 keys end 37 keys into the sixth 96-key block."""
    q, k, v, dout = inputs(2, 333, 517, 6, 2, D, d_v=D_V)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(1000, 700), (300, 2000)], ids=["sq>sk", "sq<sk"])
def test_many_blocks(sq, sk, causal):
    """More CTAs than SMs, up to 16 query blocks a CTA: the one dS^T stage is reused each block."""
    q, k, v, dout = inputs(3, sq, sk, 12, 4, D, d_v=D_V)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(100, 20), softcap=15.0)],
                         ids=["causal", "window-softcap"])
def test_dropout_grads_match_reference_with_the_philox_mask(opts):
    """The keep mask drawn on S (queries on M, `dropout_ds_qk`) is the forward's."""
    check_dropout_grads(D, 257, 400, (6, 2), opts, d_v=D_V)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("used", [False, True], ids=["", "seqused_k"])
def test_varlen_grads_match_reference(causal, used):
    """Packed: dK and dV leave by row-predicated copies in two passes (64 rows, then 32)."""
    check_varlen_grads([(0, 40), (77, 1), (300, 257), (130, 129), (1, 60), (2000, 1000)], (6, 2), D, causal, used,
                       d_v=D_V)


def test_deterministic_grads_are_bitwise_repeatable():
    q, k, v, dout = inputs(2, 1000, 1500, 8, 2, D, d_v=D_V)
    check_bitwise_repeatable(flash_attn_func, dout, q, k, v, causal=True)


def test_gradients_with_a_document_block_mask():
    """A mask_mod with a FlexAttention BlockMask of 128-key blocks, retiled to 96 keys."""
    q, k, v, dout = inputs(2, 700, 700, 4, 2, D, d_v=D_V)
    docs = torch.cumsum(torch.rand(2, 700, generator=torch.Generator().manual_seed(1)) < 0.004, 1)
    spec = mods.document_mask(docs.to(torch.int32).cuda())
    block_mask = spec.block_mask(2, 4, 700, 700, block_size=128)
    out, grads = ours(lambda q, k, v: flash_attn_func(q, k, v, **spec.kwargs(), block_mask=block_mask), dout, q, k, v)
    assert_grads_match(grads, q, k, v, dout, out=out, **spec.ref_kwargs())


def test_a_causal_mask_mod_gives_the_causal_gradients():
    @cute.jit
    def causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return operator.ge(q_idx, kv_idx)

    q, k, v, dout = inputs(2, 500, 500, 4, 2, D, d_v=D_V)
    out, grads = ours(lambda q, k, v: flash_attn_func(q, k, v, mask_mod=causal), dout, q, k, v)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=True)
