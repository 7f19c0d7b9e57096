"""softmax_scale <= 0 (`launch/args.py:positive_scale`): the kernels take row maxima of unscaled
scores and mask with -inf before scaling, so the host runs a negative scale as |scale| on -q
(negating dq) and 0 as q = 0 at scale 1 (dq = 0). Every entry point against the reference,
causal (masked scores meet the scale) and not; forward and backward on both kernel paths."""
import pytest
import torch

from cute_flash import flash_attn_func, flash_attn_varlen_func
from cute_flash.reference import attention_varlen_ref
from tests.helpers.backward import assert_grads_match
from tests.helpers.caches import run_case
from tests.helpers.gpu_utils import assert_matches_reference, cu_seqlens, on_path, poison_allocator

pytestmark = pytest.mark.gpu

SCALES = [-0.3, 0.0]


def _run(fn, dout, *inputs, **opts):
    """(out, lse, grads) of `fn` (a public function) on a poisoned allocator."""
    poison_allocator()
    leaves = [x.detach().requires_grad_() for x in inputs]
    out, lse, _ = fn(*leaves, return_attn_probs=True, **opts)
    out.backward(dout)
    torch.cuda.synchronize()
    return out.detach(), lse, [x.grad for x in leaves]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", SCALES)
def test_dense(scale, causal, arch_path, kernels):
    """d 64 dense: on an H200 the default path is the Hopper forward and backward."""
    q, dout = (torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 150, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    opts = dict(softmax_scale=scale, causal=causal)
    out, lse, grads = _run(flash_attn_func, dout, q, k, v, **opts)
    assert kernels == on_path(arch_path, "fwd", "bwd")
    assert_matches_reference(out, lse, q, k, v, **opts)
    assert_grads_match(grads, q, k, v, dout, out=out, **opts)
    if scale == 0:
        assert not grads[0].any(), "dq of a zero scale"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", SCALES)
def test_varlen(scale, causal):
    lq, lk = [37, 120, 1], [90, 64, 200]
    q, dout = (torch.randn(sum(lq), 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(sum(lk), 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    opts = dict(softmax_scale=scale, causal=causal)

    def ours(q, k, v, **o):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), **o)

    def ref(q, k, v, **o):
        return attention_varlen_ref(q, k, v, cu_q, cu_k, **o)

    out, lse, grads = _run(ours, dout, q, k, v, **opts)
    assert_matches_reference(out, lse, q, k, v, ref_fn=ref, **opts)
    assert_grads_match(grads, q, k, v, dout, out=out, ref_fn=ref, **opts)


@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("scale", SCALES)
def test_kvcache(scale, num_splits):
    """A decode step (GQA folded, split or not) and a causal chunk with rotary appends."""
    run_case(2, 1, 32, 8, 128, torch.bfloat16, 4096, [4000, 77], 1, num_splits, softmax_scale=scale)
    run_case(3, 40, 8, 2, 64, torch.float16, 512, [100, 0, 300], 40, num_splits, causal=True,
             rotary=(64, True), softmax_scale=scale)

