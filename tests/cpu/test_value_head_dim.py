"""A value head dim of its own (MLA's q / k 192 with v 128, and the other way) on the CPU: the
public functions pass it to the launchers as it is (which pad around the kernels that take one
head dim: tests/cpu/test_launcher.py), so outputs have v's head dim and gradients the tensors'
shapes; checked end to end over a stand-in for the launchers that computes with the reference
(tests/helpers/reference_launch.py). The GPU tests run the same calls on the kernels."""
import pytest
import torch

import cute_flash
from cute_flash import flash_attn_interface as fai
from cute_flash.reference import attention_ref, attention_varlen_ref
from tests.helpers import reference_launch

BF16 = dict(atol=2e-2, rtol=2e-2)  # outputs and gradients rounded to bf16


@pytest.fixture
def launch(monkeypatch):
    return reference_launch.install(monkeypatch)


def _inputs(b, sq, sk, h, hk, d, d_v, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).bfloat16()
    k = torch.randn(b, sk, hk, d, generator=g).bfloat16()
    v = torch.randn(b, sk, hk, d_v, generator=g).bfloat16()
    return q, k, v


def _check_grads(ours, leaves, ref_out, dout):
    ref_out.backward(dout.float())
    for x, ref in zip(ours, leaves):
        assert x.grad.shape == x.shape
        torch.testing.assert_close(x.grad.float(), ref.grad, **BF16)


@pytest.mark.parametrize("d, d_v", [(48, 32), (24, 40)])
def test_dense_call_with_a_value_head_dim_of_its_own(launch, d, d_v):
    q, k, v = (x.requires_grad_() for x in _inputs(2, 37, 53, 4, 2, d, d_v))
    out, lse, _ = cute_flash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == (2, 37, 4, d_v)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, causal=True)  # the default scale is q's head dim's
    torch.testing.assert_close(out.float(), ref_out.detach(), **BF16)
    torch.testing.assert_close(lse, ref_lse.detach(), **BF16)
    dout = torch.randn_like(out)
    out.backward(dout)
    _check_grads((q, k, v), leaves, ref_out, dout)
    assert launch.calls == ["flash_fwd", "flash_bwd"]


def test_packed_call_with_a_value_head_dim_of_its_own(launch):
    q, k, v = (x[0].requires_grad_() for x in _inputs(1, 50, 50, 4, 2, 64, 40))
    cu = torch.tensor([0, 17, 50], dtype=torch.int32)
    out = cute_flash.flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, causal=True, window_size=(9, 0))
    assert out.shape == (50, 4, 40)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref_out, _ = attention_varlen_ref(*leaves, cu, cu, causal=True, window_size=(9, 0))
    torch.testing.assert_close(out.float(), ref_out.detach(), **BF16)
    dout = torch.randn_like(out)
    out.backward(dout)
    _check_grads((q, k, v), leaves, ref_out, dout)
    assert launch.calls == ["flash_fwd_varlen", "flash_bwd_varlen"]


@pytest.mark.parametrize("d, d_v", [(48, 32), (24, 40)])
def test_the_launchers_get_v_as_it_is(launch, d, d_v):
    """The launchers get v as it is, with or without a gradient (the Hopper forward takes its
    head dim; the SM80 forward and the backwards pad)."""
    q, k, v = _inputs(2, 37, 53, 4, 2, d, d_v)
    out = cute_flash.flash_attn_func(q, k, v, causal=True)
    cu = torch.tensor([0, 17, 37], dtype=torch.int32)
    packed = cute_flash.flash_attn_varlen_func(q[0], k[0, :37], v[0, :37], cu, cu, 20, 20)
    cute_flash.flash_attn_func(q.requires_grad_(), k, v, causal=True)
    assert launch.value_dims == [d_v] * 3
    assert out.shape == (2, 37, 4, d_v) and packed.shape == (37, 4, d_v)
    torch.testing.assert_close(out.float(), attention_ref(q.detach(), k, v, causal=True)[0].float(), **BF16)


def test_a_value_head_dim_with_a_sink(launch):
    q, k, v = _inputs(2, 20, 30, 4, 4, 32, 16)
    sink = torch.randn(4)
    out = cute_flash.flash_attn_func(q, k, v, learnable_sink=sink)
    ref_out, _ = attention_ref(q, k, v, learnable_sink=sink)
    torch.testing.assert_close(out.float(), ref_out.float(), **BF16)


@pytest.mark.parametrize("call", [
    lambda q, k, v: cute_flash.flash_attn_with_kvcache(q, k, v),
    lambda q, k, v: fai._flash_attn_forward(q, k, v, 0.0, 0.125, False, -1, -1, 0.0, None, False),
])
def test_entries_that_keep_one_head_dim_say_so(launch, call):
    """The KV-cache call (its appends land in the caller's caches, which padding would copy) and
    flash-attn 2's private forwards (whose backwards take one head dim) keep flash-attn 2's rule."""
    q, k, v = _inputs(2, 3, 30, 4, 4, 32, 16)
    with pytest.raises(ValueError, match="head dim must equal the head dim of q"):
        call(q, k, v)
    assert launch.calls == []


def test_value_head_dims_past_256_are_refused(launch):
    q, k, v = _inputs(1, 4, 4, 2, 2, 64, 264)
    with pytest.raises(ValueError, match="v head dim must be between 1 and 256"):
        cute_flash.flash_attn_func(q, k, v)
