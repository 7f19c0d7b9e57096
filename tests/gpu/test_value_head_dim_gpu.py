"""A value head dim of its own on the kernels (MLA's q / k 192 with v 128, and the other way):
outputs and gradients of the dense and packed calls against the reference by the criterion of
docs/semantics.md, on the Hopper path and the SM80 one, each asserting which kernels ran.
tests/cpu/test_value_head_dim.py checks the padding around the kernels on the CPU."""
import pytest
import torch

import cute_flash
from cute_flash.reference import attention_varlen_ref
from tests.helpers.backward import assert_grads_match
from tests.helpers.gpu_utils import assert_matches_reference, backward_on_path, cu_seqlens, on_path

pytestmark = pytest.mark.gpu


def _inputs(shape_q, shape_k, d, d_v, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(*shape_q, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(*shape_k, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(*shape_k, d_v, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(*shape_q, d_v, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, dout


@pytest.mark.parametrize("d, d_v, causal", [(192, 128, True), (192, 128, False), (64, 128, True), (128, 64, False)])
def test_dense_call_with_a_value_head_dim_of_its_own(arch_path, kernels, d, d_v, causal):
    q, k, v, dout = _inputs((2, 300, 16), (2, 300, 4), d, d_v, seed=d + d_v)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = cute_flash.flash_attn_func(*leaves, causal=causal, return_attn_probs=True)
    assert out.shape == (2, 300, 16, d_v)
    assert_matches_reference(out.detach(), lse, q, k, v, causal=causal)
    out.backward(dout)
    assert_grads_match([x.grad for x in leaves], q, k, v, dout, out=out, causal=causal)
    assert kernels == on_path(arch_path, "fwd") | backward_on_path(arch_path, max(d, d_v))


def test_packed_call_with_a_value_head_dim_of_its_own(arch_path, kernels):
    lengths = [300, 1, 129, 64]
    cu, total = cu_seqlens(lengths), sum(lengths)
    q, k, v, dout = _inputs((total, 16), (total, 4), 192, 128, seed=5)
    def ref_fn(q, k, v, **opts):
        return attention_varlen_ref(q, k, v, cu, cu, **opts)

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse, _ = cute_flash.flash_attn_varlen_func(*leaves, cu, cu, max(lengths), max(lengths), causal=True,
                                                    return_attn_probs=True)
    assert_matches_reference(out.detach(), lse, q, k, v, ref_fn, causal=True)
    out.backward(dout)
    assert_grads_match([x.grad for x in leaves], q, k, v, dout, out=out, ref_fn=ref_fn, causal=True)
    assert kernels == on_path(arch_path, "fwd") | backward_on_path(arch_path, 192)
